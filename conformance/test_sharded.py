"""Sharded vs single device, from :mod:`conformance.sharded` (own process)."""

import json
import os
import subprocess
import sys

import pytest

from conformance import sharded

pytestmark = pytest.mark.conformance

#: Layouts whose support is issue 5 (distributed); until it lands they run,
#: report their failure, and are marked xfail with that reason.
PENDING_ISSUE_5 = {
    "jit_explicit": "issue 5 (distributed): under an Explicit mesh the Gram "
                    "contractions over the sharded example axis need an "
                    "explicit out_sharding",
    "shard_map": "issue 5 (distributed): under shard_map each device must "
                 "return its rows f32[B_local, B] of the global Gram, "
                 "gathering the other devices' factors",
}


@pytest.fixture(scope="session")
def sharded_records(tmp_path_factory, pytestconfig):
  out = tmp_path_factory.mktemp("sharded") / "records.json"
  ops = pytestconfig.getoption("--conformance-ops")
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run(
      [sys.executable, "-m", "conformance.sharded", "--json", str(out),
       "--ops", ops], capture_output=True, text=True, timeout=600, env=env,
      check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(out) as f:
    return {(r["op"], r["layout"], r["platform"]): r for r in json.load(f)}


@pytest.mark.conformance_family("sharded")
@pytest.mark.parametrize("layout", sharded.LAYOUTS)
def test_sharded_equals_single_device(conformance_op, conformance_platform,
                                      layout, sharded_records):
  rec = sharded_records.get((conformance_op.name, layout,
                             conformance_platform))
  assert rec is not None, "the sharded runner produced no record"
  if rec["status"] == "fail":
    if layout in PENDING_ISSUE_5:
      first_line = rec["error"].splitlines()[0][:200]
      pytest.xfail(f"{PENDING_ISSUE_5[layout]} (got {first_line})")
    pytest.fail(f"{rec['error']}\n{rec.get('traceback', '')}")
