"""Sharded Grams: 8 fake CPU devices, and 2 processes on loopback.

The cases run in subprocesses, because the CPU device count (and
``jax.distributed``) must be set before JAX starts a backend: see
:mod:`tests.distributed_cases` and :mod:`tests.multiprocess_worker`.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conformance.plugin import thorough
from tests import distributed_cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300
# f32 tolerance relative to the Gram's (the gradients') largest entry.
RTOL = 1e-5


def _env():
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  out = tmp_path_factory.mktemp("distributed") / "records.json"
  extra = ["--all"] if thorough() else []
  proc = subprocess.run(
      [sys.executable, "-m", "tests.distributed_cases", "--json", str(out)]
      + extra,
      capture_output=True, text=True, timeout=900, env=_env(), cwd=ROOT,
      check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(out) as f:
    return {r["case"]: r for r in json.load(f)}


def _case_names():
  return [name for name, _ in distributed_cases.cases(everything=thorough())]


# One worker runs the whole runner (``pytest -n``: --dist loadgroup).
@pytest.mark.xdist_group("distributed_cases")
@pytest.mark.parametrize("case", _case_names())
def test_sharded_case(case, records):
  rec = records.get(case)
  assert rec is not None, f"the runner produced no record for {case}"
  if rec["status"] == "skip":
    pytest.skip(rec["reason"])
  assert rec["status"] == "pass", f"{rec['error']}\n{rec['traceback']}"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.xdist_group("two_processes")
def test_two_processes_match_one(tmp_path):
  """jax.distributed on loopback: 2 processes x 4 CPU devices, gloo."""
  port = _free_port()
  procs, outs = [], []
  for pid in range(2):
    out = tmp_path / f"process{pid}.json"
    log = open(tmp_path / f"process{pid}.log", "w")  # pylint: disable=consider-using-with
    outs.append((out, log))
    procs.append(subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "tests.multiprocess_worker", "--process-id",
         str(pid), "--num-processes", "2", "--port", str(port), "--json",
         str(out)], stdout=log, stderr=subprocess.STDOUT, env=_env(),
        cwd=ROOT))
  deadline = time.monotonic() + TIMEOUT_S
  try:
    for p in procs:
      p.wait(timeout=max(1.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    pytest.fail(f"the 2-process run took over {TIMEOUT_S} s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for _, log in outs:
      log.close()
  for pid, (p, (out, _)) in enumerate(zip(procs, outs)):
    log_text = (tmp_path / f"process{pid}.log").read_text()[-3000:]
    assert p.returncode == 0, f"process {pid} failed:\n{log_text}"
    rec = json.loads(out.read_text())
    assert rec["devices"] == 8 and rec["local_devices"] == 4, rec
    for layout in ("shard_map", "jit_auto"):
      assert rec[layout]["gram_shape"] == [16, 16], rec
      assert rec[layout]["gram_rel_err"] < RTOL, (pid, layout, rec)
      assert rec[layout]["grad_rel_err"] < RTOL, (pid, layout, rec)
