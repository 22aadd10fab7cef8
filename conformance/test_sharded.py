"""Sharded vs single device, from :mod:`conformance.sharded` (own process)."""

import json
import os
import subprocess
import sys

import pytest

from conformance import sharded

# One worker starts the runner (``pytest -n`` with --dist loadgroup).
pytestmark = [pytest.mark.conformance,
              pytest.mark.xdist_group("conformance_sharded")]

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
  if rec["status"] == "skip":
    pytest.skip(rec["reason"])
  if rec["status"] == "fail":
    pytest.fail(f"{rec['error']}\n{rec.get('traceback', '')}")
