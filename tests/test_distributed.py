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

from gram_haiku.conformance import runner
from gram_haiku.conformance.plugin import thorough
from tests import distributed_cases

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# f32 tolerance relative to the Gram's (the gradients') largest entry.
RTOL = 1e-5


def _env():
  env = runner.child_environ()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


@pytest.fixture(scope="module")
def records(tmp_path_factory):
  extra = ["--all"] if thorough() else []
  return runner.run_once(
      "distributed-cases",
      runner.python_cmd("tests.distributed_cases", *extra),
      tmp_path_factory, env=_env(), cwd=ROOT)


def _case_names():
  return [name for name, _ in distributed_cases.cases(everything=thorough())]


# The runner starts once per pytest run, whatever the number of xdist
# workers (conformance.runner).
@pytest.mark.parametrize("case", _case_names())
def test_sharded_case(case, records):
  rec = {r["case"]: r for r in records.get()}.get(case)
  assert rec is not None, f"the runner produced no record for {case}"
  if rec["status"] == "skip":
    pytest.skip(rec["reason"])
  assert rec["status"] == "pass", f"{rec['error']}\n{rec['traceback']}"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_two_processes_match_one(tmp_path):
  """jax.distributed on loopback: 2 processes x 4 CPU devices, gloo."""
  limit = runner.timeout_s(default=600)
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
  deadline = None if limit is None else time.monotonic() + limit
  try:
    for p in procs:
      p.wait(timeout=None if deadline is None
             else max(1.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    pytest.fail(f"the 2-process run took over {limit:.0f} s; on a slow or "
                f"busy machine raise {runner.TIMEOUT_ENV}=<seconds> (0: no "
                "limit)", pytrace=False)
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
