"""The default budget's choice of tests (tests/budget.py, conftest.py)."""

import importlib
import inspect
import os

from tests import budget

ROOT = budget.ROOT


def _functions(path):
  """The names of the test functions of a test module and of the methods
  of its classes (inherited ones included: a mixin's tests)."""
  module = importlib.import_module(path[:-len(".py")].replace("/", "."))
  names = {n for n in dir(module) if n.startswith("test")}
  for _, cls in inspect.getmembers(module, inspect.isclass):
    names.update(n for n in dir(cls) if n.startswith("test"))
  return names


def test_every_listed_test_exists():
  """A renamed or removed test left in tests/thorough_only.txt would keep
  nothing out and say nothing: each entry names a test of its file."""
  missing = []
  for key in sorted(budget.keys()):
    path, name = key.split("::")
    if not os.path.exists(os.path.join(ROOT, path)):
      missing.append(f"{key}: no file {path}")
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
