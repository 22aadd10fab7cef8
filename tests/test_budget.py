"""The default budget's choice of tests (tests/budget.py, conftest.py)."""

import importlib
import inspect
import os
import sys
import types
import unittest

import conftest
import pytest
from tests import budget

ROOT = budget.ROOT


def _functions(path):
  """The names pytest collects as tests in a test module: its functions
  named ``test*`` and the ``test*`` methods (inherited ones included: a
  mixin's tests) of its classes named ``Test*`` and of its
  ``unittest.TestCase`` classes. A module, class or constant whose name
  starts with ``test`` (``from gram_haiku.conformance import testing``) is
  no test: listed, it would leave nothing out."""
  module = importlib.import_module(path[:-len(".py")].replace("/", "."))
  names = {n for n, obj in inspect.getmembers(module, inspect.isfunction)
           if n.startswith("test")}
  for name, cls in inspect.getmembers(module, inspect.isclass):
    if name.startswith("Test") or issubclass(cls, unittest.TestCase):
      names.update(n for n, _ in inspect.getmembers(cls, inspect.isfunction)
                   if n.startswith("test"))
  return names


def test_every_listed_test_exists():
  """A renamed or removed test left in tests/thorough_only.txt would keep
  nothing out and say nothing: each entry names a test of its file."""
  missing = []
  for key in sorted(budget.keys()):
    path, name = key.split("::")
    if not os.path.exists(os.path.join(ROOT, path)):
      missing.append(f"{key}: no file {path}")
    elif not os.path.basename(path).startswith("test_"):
      missing.append(f"{key}: {path} is no test file pytest collects")
    elif name not in _functions(path):
      missing.append(f"{key}: no test {name} in {path}")
  assert not missing, "\n".join(missing)


def test_nothing_always_kept_is_generated():
  """The tests the tool always keeps (the named files and tests, the
  soundness tests) are not in the generated section (the hand-written one
  gives its own reasons)."""
  _, generated = budget.read_list()
  listed = [k for k in generated if k.startswith(budget.ALWAYS_FILES) or
            k in budget.ALWAYS or budget.SOUNDNESS.search(k)]
  assert generated and not listed, listed


def test_a_test_whose_lines_others_run_is_left_out():
  lines = {
      "tests/test_a.py::test_big": {("m", 1), ("m", 2), ("m", 3)},
      "tests/test_a.py::test_part[x]": {("m", 1), ("m", 2)},
      "tests/test_a.py::test_own": {("m", 4)},
      "tests/test_a.py::test_refused_input": {("m", 1)},
      "tests/test_a.py::test_cheap": {("m", 1)},
      "tests/test_clip_bound.py::test_attack": {("m", 1)},
  }
  seconds = {"tests/test_a.py::test_big": 1.5,
             "tests/test_a.py::test_part[x]": 1.0,
             "tests/test_a.py::test_own": 1.0,
             "tests/test_a.py::test_refused_input": 1.0,
             "tests/test_a.py::test_cheap": 0.1,
             "tests/test_clip_bound.py::test_attack": 3.0}
  # test_big runs test_part's lines; the soundness-named test, the cheap
  # one and the clip bound's attack are kept whatever their lines.
  assert budget.choose(lines, seconds) == ["tests/test_a.py::test_part[x]"]
  assert budget.function_key("tests/test_a.py::Case::test_m[1-2]") == (
      "tests/test_a.py::test_m")
  # With a time budget: test_big (3 lines in 1.5 s) is picked first, and
  # past its 1.5 s test_own's own line is left to the thorough env; the
  # always-kept tests' seconds do not count.
  assert budget.choose(lines, seconds, keep_s=1.0) == [
      "tests/test_a.py::test_own", "tests/test_a.py::test_part[x]"]
  assert budget.choose(lines, seconds, keep_s=2.0) == [
      "tests/test_a.py::test_part[x]"]
  assert budget.choose(lines, seconds, keep_s=0.0) == [
      "tests/test_a.py::test_big", "tests/test_a.py::test_own",
      "tests/test_a.py::test_part[x]"]


def test_the_generated_section_is_rewritten_and_the_hand_one_kept(tmp_path):
  path = tmp_path / "list.txt"
  path.write_text("# why\ntests/a.py::test_x\n"
                  f"{budget.MARK}: old)\ntests/a.py::test_y  # 1.0\n")
  hand, generated = budget.read_list(str(path))
  assert hand == ["# why", "tests/a.py::test_x"]
  assert generated == ["tests/a.py::test_y"]
  assert budget.keys(str(path)) == {"tests/a.py::test_x",
                                    "tests/a.py::test_y"}
  assert budget.keys(str(path), generated=False) == {"tests/a.py::test_x"}


def test_only_a_collected_test_counts_as_listed():
  names = _functions("tests/test_conformance_example.py")
  # A module-level test, a mixin's inherited method, a TestCase's own one.
  assert {"test_example_is_exact", "test_transforms",
          "test_a_family_that_checks_nothing_fails"} <= names
  # The conformance testing module imported there, and a method of a class
  # pytest does not collect (defined inside a test), are no tests.
  assert "testing" not in names and "test_nothing" not in names


def _item(nodeid, **params):
  parent, name = nodeid.split("[")[0].rsplit("::", 1)
  return types.SimpleNamespace(
      nodeid=nodeid, originalname=name,
      parent=types.SimpleNamespace(nodeid=parent),
      callspec=types.SimpleNamespace(params=params))


def test_each_sweep_keeps_its_first_case():
  items = [_item("tests/test_a.py::A::test_m[1]", n=1),
           _item("tests/test_a.py::A::test_m[2]", n=2),
           _item("tests/test_a.py::B::test_m[1]", n=1),
           _item("tests/test_a.py::B::test_m[2]", n=2),
           _item("tests/test_a.py::test_m[1]", n=1),
           _item("tests/test_a.py::test_m[2]", n=2),
           _item("tests/test_a.py::test_op[x]", conformance_op="x")]
  keep, grouped = conftest._sampled(items)  # pylint: disable=protected-access
  # Two classes' methods of one name, and the module's function of that
  # name, are three sweeps: each runs its first case. The conformance
  # suite's items are its plugin's.
  assert [i.nodeid for i in items if id(i) in keep] == [
      "tests/test_a.py::A::test_m[1]", "tests/test_a.py::B::test_m[1]",
      "tests/test_a.py::test_m[1]"]
  assert grouped == {id(i) for i in items[:6]}


def test_a_function_with_a_case_kept_is_not_listed():
  lines = {"tests/t.py::test_big": {("m", 1), ("m", 2)},
           "tests/t.py::test_f[a]": {("m", 1), ("m", 2)},
           "tests/t.py::test_f[b]": {("m", 3)},
           "tests/t.py::A::test_g": {("m", 1)},
           "tests/t.py::B::test_g": {("m", 4)},
           "tests/t.py::test_h": {("m", 2)}}
  seconds = dict.fromkeys(lines, 1.0)
  # test_big runs test_f[a]'s lines (of equal gains the first id is kept,
  # whatever the order of the contexts), A's test_g's, and test_h's; but
  # the list leaves out a function's every case and both classes' test_g.
  for order in (lines, dict(reversed(lines.items()))):
    assert budget.choose(order, seconds) == [
        "tests/t.py::A::test_g", "tests/t.py::test_f[a]", "tests/t.py::test_h"]
  assert budget.left_out(lines, seconds) == [("tests/t.py::test_h", 1.0)]
  assert budget.left_out(lines, seconds, {"tests/t.py::test_h"}) == []


def test_a_missing_input_leaves_the_list_as_it_is(tmp_path, monkeypatch):
  listed = tmp_path / "list.txt"
  listed.write_text(f"# why\ntests/a.py::test_x\n{budget.MARK})\n")
  monkeypatch.setattr(budget, "LIST", str(listed))
  durations = tmp_path / "durations.log"
  durations.write_text("1.00s call     tests/a.py::test_y\n")
  argv = ["--no-run", "--data", str(tmp_path / "none"),
          "--durations", str(durations)]
  with pytest.raises(SystemExit, match="2"):
    budget.main(argv)
  # No coverage.py: one line saying what to install, not a traceback.
  monkeypatch.setitem(sys.modules, "coverage", None)
  with pytest.raises(SystemExit, match="2"):
    budget.main(argv)
  assert listed.read_text() == f"# why\ntests/a.py::test_x\n{budget.MARK})\n"


def test_durations_are_read_whole_ids(tmp_path):
  log = tmp_path / "durations.log"
  log.write_text(
      "===== slowest durations =====\n"
      "0.71s call     tests/a.py::test_x[pad0-shape \\\\(8,\\\\).*7 examples]\n"
      "0.44s call     tests/a.py::test_y[sum / B]\n"
      "0.10s setup    tests/a.py::test_y[sum / B]\n"
      "(12 durations < 0.005s hidden.  Use -vv to show these durations.)\n")
  assert budget.read_durations(str(log)) == {
      "tests/a.py::test_x[pad0-shape \\\\(8,\\\\).*7 examples]": 0.71,
      "tests/a.py::test_y[sum / B]": 0.44 + 0.10}


def test_every_sweep_key_names_a_test():
  """A renamed sweep of conftest.py's FULL_FILES, EVERY_CASE or
  SAMPLED_SWEEPS would silently fall back to its first case."""
  missing = []
  for key in (*conftest.SAMPLED_SWEEPS, *conftest.EVERY_CASE,
              *conftest.FULL_FILES):
    path, _, name = key.partition("::")
    if not os.path.exists(os.path.join(ROOT, path)):
      missing.append(f"{key}: no file {path}")
    elif name and name not in _functions(path):
      missing.append(f"{key}: no test {name} in {path}")
  assert not missing, "\n".join(missing)
