"""The multi-device runner protocol (gram_haiku/conformance/runner.py) and
the ``python -m gram_haiku.conformance`` command line."""

import json
import subprocess
import sys

import pytest

from gram_haiku.conformance import __main__ as conformance_main
from gram_haiku.conformance import runner


class _Factory:
  """A stand-in for pytest's tmp_path_factory, outside xdist."""

  def __init__(self, path):
    self._path = path

  def getbasetemp(self):
    return self._path


def _script(tmp_path, body):
  path = tmp_path / "runner_script.py"
  path.write_text(body)
  return [sys.executable, str(path), "{out}"]


def test_runs_once_and_shares_the_records(tmp_path, monkeypatch):
  monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
  count = tmp_path / "count"
  cmd = _script(tmp_path, (
      "import json, sys, pathlib\n"
      f"p = pathlib.Path({str(count)!r})\n"
      "p.write_text(str(int(p.read_text() or 0) + 1) if p.exists() else '1')\n"
      "json.dump([{'case': 'a', 'status': 'pass'}], open(sys.argv[1], 'w'))\n"))
  first = runner.run_once("r", cmd, _Factory(tmp_path))
  second = runner.run_once("r", cmd, _Factory(tmp_path))
  assert first.get() == second.get() == [{"case": "a", "status": "pass"}]
  assert count.read_text() == "1"


def test_a_failed_runner_fails_one_test_and_skips_the_rest(tmp_path,
                                                           monkeypatch):
  monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
  cmd = _script(tmp_path, "import sys\nprint('boom: the cause', "
                "file=sys.stderr)\nsys.exit(3)\n")
  outcome = runner.run_once("bad", cmd, _Factory(tmp_path))
  with pytest.raises(pytest.fail.Exception, match="(?s)status 3.*boom: the "
                     "cause"):
    outcome.get()
  with pytest.raises(pytest.skip.Exception, match="reported once"):
    outcome.get()
  # Another worker reading the same outcome skips too.
  again = runner.run_once("bad", cmd, _Factory(tmp_path))
  with pytest.raises(pytest.skip.Exception):
    again.get()
  state = json.loads((tmp_path / "runner-bad.result.json").read_text())
  assert state["reported"]


def test_timeout_message_names_the_setting(tmp_path, monkeypatch):
  monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
  monkeypatch.setenv(runner.TIMEOUT_ENV, "1")
  cmd = _script(tmp_path, "import time\ntime.sleep(30)\n")
  outcome = runner.run_once("slow", cmd, _Factory(tmp_path))
  with pytest.raises(pytest.fail.Exception,
                     match=f"longer than 1 s.*{runner.TIMEOUT_ENV}"):
    outcome.get()


def test_timeout_setting(monkeypatch):
  monkeypatch.delenv(runner.TIMEOUT_ENV, raising=False)
  assert runner.timeout_s() == runner.DEFAULT_TIMEOUT_S
  assert runner.timeout_s(default=5) == 5
  monkeypatch.setenv(runner.TIMEOUT_ENV, "0")
  assert runner.timeout_s() is None
  monkeypatch.setenv(runner.TIMEOUT_ENV, "soon")
  with pytest.raises(ValueError, match="CONFORMANCE_TIMEOUT_S='soon'"):
    runner.timeout_s()


def test_shared_dir_is_the_runs_under_xdist(tmp_path, monkeypatch):
  worker = tmp_path / "popen-gw1"
  worker.mkdir()
  monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
  assert runner._shared_dir(_Factory(worker)) == tmp_path  # pylint: disable=protected-access
  monkeypatch.delenv("PYTEST_XDIST_WORKER")
  assert runner._shared_dir(_Factory(worker)) == worker  # pylint: disable=protected-access


def test_conformance_cli_help_shows_our_options(capsys):
  with pytest.raises(SystemExit) as e:
    conformance_main.pytest_args(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  for option in ("--ops", "--modules", "--thorough", "--timeout",
                 "--pytest-help"):
    assert option in out
  assert len(out.splitlines()) < 40


def test_conformance_cli_translates_options_and_runs_in_parallel():
  args = conformance_main.pytest_args(["--ops", "linear", "--thorough",
                                       "--timeout", "60", "-x"])
  assert args[:1] == ["-x"]
  assert args[args.index("--conformance-ops") + 1] == "linear"
  assert "--conformance-thorough" in args
  assert args[args.index("--conformance-timeout") + 1] == "60"
  assert args[-2:] == ["-n", "auto"]  # pytest-xdist is installed here
  args = conformance_main.pytest_args(["--modules", "my_ops,more"])
  assert args[args.index("--conformance-modules") + 1] == "my_ops,more"
  assert "auto" not in conformance_main.pytest_args(["-n", "0"])
  assert conformance_main.pytest_args(["--pytest-help"])[0] == "--help"


class _Op:
  def __init__(self, name):
    self.name = name


class _Marker:
  def __init__(self, family):
    self.args = (family,)


class _Item:
  """What :func:`conformance.plugin.sample_items` reads of a pytest item."""

  def __init__(self, fn, family, op, case):
    self.originalname = fn
    self._family = family
    self.callspec = type("CallSpec", (), {})()
    self.callspec.params = {"conformance_op": _Op(op), "case": case,
                            "conformance_platform": "cpu"}

  def get_closest_marker(self, name):
    assert name == "conformance_family"
    return _Marker(self._family)


@pytest.mark.parametrize("n_ops,n_cases", [(16, 6), (16, 17), (5, 4), (3, 9),
                                            (1, 6), (16, 2)])
def test_default_budget_runs_every_family_on_every_op(n_ops, n_cases):
  from gram_haiku.conformance import plugin  # pylint: disable=g-import-not-at-top
  ops = [f"op{i}" for i in range(n_ops)]
  items = [_Item("test_f", "vmap", op, case) for op in ops
           for case in range(n_cases)]
  # A second function of the same family (a row of the table is a family).
  items += [_Item("test_g", "vmap", op, c) for op in ops for c in range(4)]
  items += [_Item("test_s", "sharded", op, c) for op in ops for c in range(3)]
  keep, drop = plugin.sample_items(items, ops)
  assert len(keep) + len(drop) == len(items)
  kept = {(i.originalname, i.callspec.params["conformance_op"].name,
           i.callspec.params["case"]) for i in keep}
  for op in ops:  # every op runs the family
    assert any(k[0] in ("test_f", "test_g") and k[1] == op for k in kept), op
    # The sharded family is sampled too (its runner runs the kept pairs).
    assert any(k[0] == "test_s" and k[1] == op for k in kept), op
  for name, cases in (("test_f", n_cases), ("test_g", 4), ("test_s", 3)):
    for case in range(cases):  # every case runs on enough ops
      on = sum(1 for k in kept if k[0] == name and k[2] == case)
      assert on >= min(n_ops, plugin.OPS_PER_CASE), (name, case, on)
  # The family's two functions share the ops: about one item per op or per
  # case, whichever is more, not one per op and function.
  family = sum(1 for k in kept if k[0] in ("test_f", "test_g"))
  assert family <= max(n_ops, n_cases + 4) + plugin.OPS_PER_CASE, family
  if n_ops <= plugin.OPS_PER_CASE:
    assert not drop


@pytest.mark.parametrize("sizes", [(4, 2, 2), (2, 2), (3, 3), (5,), (2, 3)])
def test_spread_runs_every_value_of_every_axis(sizes):
  import itertools  # pylint: disable=g-import-not-at-top
  from tests import problems  # pylint: disable=g-import-not-at-top
  axes = [[(f"a{k}v{i}", (k, i)) for i in range(n)]
          for k, n in enumerate(sizes)]
  picked = [p.values for p in problems.spread(*axes)]
  for k, n in enumerate(sizes):  # every value of every axis runs
    assert {v[k] for v in picked} == {(k, i) for i in range(n)}, (k, picked)
  assert len(set(picked)) == len(picked)  # no combination twice
  full = list(itertools.product(*[[v for _, v in a] for a in axes]))
  assert set(picked) <= set(full)
  if len(sizes) == 1:
    assert len(picked) == sizes[0]


def test_sharded_runner_skips_a_platform_its_process_cannot_open(tmp_path):
  # On a one-chip TPU the test process holds the chip, so the runner's own
  # process cannot open it: each case of that platform is a skip that says
  # why, not a missing record (which failed every sharded test there). Here
  # "tpu" is absent, which the runner meets the same way.
  out = tmp_path / "records.json"
  proc = subprocess.run(
      [sys.executable, "-m", "gram_haiku.conformance.sharded", "--json", str(out),
       "--ops", "linear", "--platforms", "tpu"],
      capture_output=True, text=True, check=False,
      env=runner.child_environ(), timeout=300)
  assert proc.returncode == 0, proc.stderr
  records = json.loads(out.read_text())
  assert {(r["op"], r["platform"]) for r in records} == {("linear", "tpu")}
  assert sorted(r["layout"] for r in records) == sorted(
      ("jit_auto", "jit_explicit", "shard_map"))
  for r in records:
    assert r["status"] == "skip"
    assert "cannot open platform 'tpu'" in r["reason"]
