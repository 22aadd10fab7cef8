"""Multi-device runners: a subprocess started once per pytest run.

The sharded checks need a JAX process of their own (the CPU device count, and
``jax.distributed``, must be set before JAX starts a backend), so a *runner*
subprocess computes every case and writes one JSON record per case; the tests
read the records. :func:`run_once` starts each runner once for the whole
pytest run, whether or not pytest-xdist splits it over workers, and whatever
pytest or pytest-xdist version is installed: the first worker to need a
runner starts it under a file lock in the run's shared temporary directory
and writes the outcome there; every other worker waits on the lock and reads
it.

If the runner fails (non-zero exit, no output, or past its timeout), the
first test that reads the outcome fails with the runner's command and the
tail of its stderr; the runner's other tests are skipped, pointing to that
failure, so one broken runner is one failure in the report.

Timeout: ``--conformance-timeout`` / ``CONFORMANCE_TIMEOUT_S`` (seconds,
default :data:`DEFAULT_TIMEOUT_S`; ``0`` for none). A slow machine needs a
larger value, not a bug report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
from typing import Optional, Sequence

import filelock
import pytest

#: Seconds a runner may take unless ``CONFORMANCE_TIMEOUT_S`` says otherwise.
DEFAULT_TIMEOUT_S = 3600
TIMEOUT_ENV = "CONFORMANCE_TIMEOUT_S"
_STDERR_TAIL = 6000


def timeout_s(default: float = DEFAULT_TIMEOUT_S) -> Optional[float]:
  """The runner timeout in seconds (None: no timeout), ``default`` unless
  ``CONFORMANCE_TIMEOUT_S`` is set.

  Raises:
    ValueError: if ``CONFORMANCE_TIMEOUT_S`` is not a number.
  """
  text = os.environ.get(TIMEOUT_ENV, "").strip()
  if not text:
    return float(default)
  try:
    value = float(text)
  except ValueError:
    raise ValueError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds "
                     "(use 0 for no timeout).") from None
  return value if value > 0 else None


def child_environ(environ=None) -> dict:
  """A copy of ``environ`` (default ``os.environ``) for a runner subprocess.

  The runner sets its own CPU device count, so a
  ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` is dropped;
  every other XLA flag is kept (a test run's compile-time flags reach its
  runners too).
  """
  env = dict(os.environ if environ is None else environ)
  strip_device_count_flag(env)
  return env


def import_roots(modules) -> list[str]:
  """The directories from which this process imported ``modules`` (names):
  for ``pkg.mod`` loaded from ``/a/pkg/mod.py``, ``/a``. A runner given
  them on ``PYTHONPATH`` imports the same files (a conftest.py found by
  pytest is imported from its own directory, wherever pytest runs)."""
  roots = []
  for name in modules:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if not path:
      continue
    root = os.path.dirname(os.path.abspath(path))
    depth = name.count(".") + (os.path.basename(path) == "__init__.py")
    for _ in range(depth):
      root = os.path.dirname(root)
    if root not in roots:
      roots.append(root)
  return roots


def with_import_path(environ: dict, paths) -> dict:
  """``environ`` with ``paths`` put first on its ``PYTHONPATH`` (the rest
  of it kept)."""
  old = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  new = list(paths) + [p for p in old if p not in paths]
  if new:
    environ["PYTHONPATH"] = os.pathsep.join(new)
  return environ


def strip_device_count_flag(environ) -> None:
  """Removes ``--xla_force_host_platform_device_count=...`` from
  ``environ["XLA_FLAGS"]`` in place (and the variable, if nothing is left)."""
  flags = [f for f in environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  if flags:
    environ["XLA_FLAGS"] = " ".join(flags)
  else:
    environ.pop("XLA_FLAGS", None)


@dataclasses.dataclass
class Outcome:
  """What a runner left: its records, or why there are none.

  Attributes:
    name: the runner's name.
    records: the JSON records (a list), or None if the runner failed.
    error: why it failed (command, exit status or timeout, stderr tail).
    first_report: whether this reader is the first to see the failure (it
      then reports it; the others skip).
  """
  name: str
  records: Optional[list]
  error: str = ""
  first_report: bool = False

  def get(self) -> list:
    """The records; or fails the calling test (the first reader of a
    failure) or skips it (every other reader)."""
    if self.records is not None:
      return self.records
    if self.first_report:
      self.first_report = False
      pytest.fail(f"runner {self.name!r}: {self.error}", pytrace=False)
    pytest.skip(f"runner {self.name!r} failed; the failure is reported "
                "once, by another test of this run")


def _shared_dir(tmp_path_factory) -> pathlib.Path:
  """The run's temporary directory, shared by all pytest-xdist workers."""
  base = pathlib.Path(tmp_path_factory.getbasetemp())
  if os.environ.get("PYTEST_XDIST_WORKER"):
    base = base.parent  # Each worker has its own basetemp below the run's.
  return base


def _run(cmd: Sequence[str], out: pathlib.Path, env, cwd) -> dict:
  limit = timeout_s()
  shown = " ".join(cmd)
  try:
    proc = subprocess.run(list(cmd), capture_output=True, text=True,
                          timeout=limit, env=env, cwd=cwd, check=False)
  except subprocess.TimeoutExpired as e:
    err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    return {"error": (
        f"the runner `{shown}` took longer than {limit:.0f} s and was "
        f"stopped. On a slow or busy machine raise the limit: "
        f"{TIMEOUT_ENV}=<seconds> (or --conformance-timeout; 0 for none).\n"
        f"Its stderr ended with:\n{err[-_STDERR_TAIL:]}")}
  if proc.returncode != 0 or not out.exists():
    return {"error": (
        f"the runner `{shown}` exited with status {proc.returncode}"
        f"{'' if out.exists() else ' and wrote no records'}. Its stderr "
        f"ended with:\n{proc.stderr[-_STDERR_TAIL:]}")}
  with open(out) as f:
    return {"records": json.load(f)}


def run_once(name: str, cmd: Sequence[str], tmp_path_factory, *,
             env=None, cwd=None) -> Outcome:
  """Runs ``cmd`` (which writes JSON to ``{out}``) once per pytest run.

  Args:
    name: the runner's name: one run per name per pytest run.
    cmd: the command; the string ``"{out}"`` in it is replaced by the path
      of the JSON file it must write.
    tmp_path_factory: pytest's fixture (for the run's shared directory).
    env, cwd: for :func:`subprocess.run`.

  Returns:
    The :class:`Outcome`, the same for every worker.
  """
  shared = _shared_dir(tmp_path_factory)
  result = shared / f"runner-{name}.result.json"
  out = shared / f"runner-{name}.records.json"
  with filelock.FileLock(str(shared / f"runner-{name}.lock")):
    if result.exists():
      with open(result) as f:
        state = json.load(f)
    else:
      cmd = [c.replace("{out}", str(out)) for c in cmd]
      state = _run(cmd, out, env, cwd)
    first = "error" in state and not state.get("reported", False)
    if first or not result.exists():
      state["reported"] = state.get("reported", False) or first
      with open(result, "w") as f:
        json.dump(state, f)
  if "error" in state:
    return Outcome(name, None, state["error"], first_report=first)
  return Outcome(name, state["records"])


def python_cmd(module: str, *args: str) -> list[str]:
  """``[python, -m, module, --json, {out}, *args]``."""
  return [sys.executable, "-m", module, "--json", "{out}", *args]
