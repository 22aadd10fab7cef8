"""The documentation as a user reads it: its examples run, and it speaks of
the project and its users alone."""

import doctest
import importlib
import importlib.util
import os
import pkgutil
import re
import subprocess
import sys

import pytest

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku.conformance import runner
from tests import doctest_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


#: Pages rewritten elsewhere, whose blocks are not checked yet (each with
#: the reason). Empty it as they are rewritten.
PENDING: dict[str, str] = {}


def _all_doc_files():
  return [os.path.join(ROOT, "README.md")] + sorted(
      os.path.join(DOCS, f) for f in os.listdir(DOCS)
      if f.endswith(".rst") and f not in PENDING)


def _runs_code(path):
  return any(b.kind in ("doctest", "python")
             for b in doctest_file.blocks(path))


def _doc_files():
  # docs/quickstart.rst holds the README's quickstart, verbatim (checked
  # below): running it once is enough.
  return [f for f in _all_doc_files()
          if not f.endswith("quickstart.rst") and _runs_code(f)]


def _doc_groups():
  """Files whose examples configure JAX run alone; the others share one
  process (each file still gets its own globals)."""
  alone = [(f,) for f in _doc_files() if doctest_file.configures_jax(f)]
  rest = tuple(f for f in _doc_files() if not doctest_file.configures_jax(f))
  return alone + ([rest] if rest else [])


def _rel(path):
  return os.path.relpath(path, ROOT)


@pytest.mark.parametrize(
    "paths", _doc_groups(), ids=lambda ps: "+".join(_rel(p) for p in ps))
def test_doc_examples_run(paths):
  """Every ``>>>`` example and every ``python`` block of README.md and
  docs/*.rst, in a process of their own (tests/doctest_file.py)."""
  if (any(p.endswith("distributed.rst") for p in paths) and
      hx.JAX_VERSION < (0, 10, 2)):
    pytest.skip("jax < 0.10.2 cannot differentiate the plain layer under "
                "Explicit mesh axes (its weight gradient's out_sharding is "
                "ambiguous there); the README says to use 0.10.2")
  env = runner.child_environ()
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, "-m", "tests.doctest_file", *paths],
                        capture_output=True, text=True, env=env, cwd=ROOT,
                        timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("path", _all_doc_files(), ids=_rel)
def test_every_code_block_is_run_checked_or_a_fragment(path):
  """A block with no language or an unknown one would be neither run nor
  checked; a fragment must at least parse."""
  assert not doctest_file.problems(path), "\n".join(
      doctest_file.problems(path))


@pytest.mark.parametrize("path", _all_doc_files(), ids=_rel)
def test_shell_commands_exist(path):
  """Each command of a shell block: its program, its ``python -m`` module
  and flags (from the module's ``--help``), ``pip`` extras, ``tox``
  environments."""
  found = doctest_file.check_shell(*(b for b in doctest_file.blocks(path)
                                     if b.kind == "shell"))
  assert not found, "\n".join(found)


def test_the_code_block_checks_can_fail(tmp_path):
  md = tmp_path / "page.md"
  md.write_text("text\n\n    pip install nothing\n\n```python\n"
                "undefined_name\n```\n\n```python fragment\n"
                "from my_ops import SPEC\n```\n\n```bash\n"
                "python -m gram_haiku demo --no-such-flag && tox -e nope && "
                "pip install '.[nope]' && make all\n```\n")
  rst = tmp_path / "page.rst"
  rst.write_text("Title\n=====\n\nA literal block::\n\n    x = 1\n\n"
                 ".. code-block:: python\n   :class: fragment\n\n"
                 "   def f(:\n\n>>> 1 + 1\n3\n")
  assert [b.kind for b in doctest_file.blocks(str(md))] == [
      "unknown", "python", "fragment", "shell"]
  assert [b.kind for b in doctest_file.blocks(str(rst))] == [
      "unknown", "fragment", "doctest"]
  assert len(doctest_file.problems(str(md))) == 1
  assert len(doctest_file.problems(str(rst))) == 2    # no language; syntax
  results = doctest_file.run(str(md))
  assert (results.attempted, results.failed) == (1, 1)
  assert doctest_file.run(str(rst)).failed == 1
  shell = [b for b in doctest_file.blocks(str(md)) if b.kind == "shell"]
  found = doctest_file.check_shell(shell[0])
  assert len(found) == 4, found
  for word in ("--no-such-flag", "'nope'", "make"):
    assert any(word in f for f in found), (word, found)


def test_quickstart_is_the_same_in_readme_and_docs():
  def first_doctest(path):
    return next(b.code for b in doctest_file.blocks(path)
                if b.kind == "doctest").strip()
  assert (first_doctest(os.path.join(ROOT, "README.md")) ==
          first_doctest(os.path.join(DOCS, "quickstart.rst")))


def test_readme_set_up_is_two_commands():
  """One installs and runs the demo, one installs and runs the tests."""
  readme = os.path.join(ROOT, "README.md")
  with open(readme, encoding="utf-8") as f:
    text = f.read()
  start = text.index("## Set up")
  end = text.index("\n## ", start + 1)
  first = text[:start].count("\n") + 1
  last = text[:end].count("\n") + 1
  shell = [b.code.strip() for b in doctest_file.blocks(readme)
           if first <= b.line <= last and b.kind == "shell"]
  assert shell == ['pip install ".[demo]" && python -m gram_haiku demo',
                   'pip install -e ".[test]" && python -m pytest -n auto']


def test_readme_layout_names_every_private_module():
  """The README's map of ``gram_haiku/_src`` stays current."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    layout = f.read().split("## Layout", 1)[1]
  src = os.path.join(ROOT, "gram_haiku", "_src")
  missing = []
  for dirpath, _, files in os.walk(src):
    for name in files:
      if name.endswith(".py") and name != "__init__.py":
        if not re.search(r"`" + re.escape(name) + "`", layout):
          missing.append(os.path.relpath(os.path.join(dirpath, name), src))
  assert not missing, f"README.md's Layout does not name {sorted(missing)}"


def _layer_table():
  """Rows of the supported-layers table of docs/layers.rst: (the Haiku
  classes named in the first cell, the rule cell)."""
  with open(os.path.join(DOCS, "layers.rst"), encoding="utf-8") as f:
    text = f.read()
  table = text.split(".. list-table::", 1)[1].split("\n\n", 2)[1]
  rows = []
  for row in re.split(r"^   \* - ", table, flags=re.M)[2:]:   # after header
    cells = re.split(r"^     - ", row, flags=re.M)
    names = re.findall(r"``(hk\.[\w.]+)``", cells[0])
    rows.append((names, cells[1].strip()))
  return rows


def _haiku_class(name):
  import haiku as hk  # pylint: disable=g-import-not-at-top
  obj = hk
  for part in name.split(".")[1:]:
    obj = getattr(obj, part)
  return obj


def _handler(cls):
  """The handler track() runs for ``cls``: its own, else that of the class
  defining its ``__call__``."""
  from gram_haiku._src.frontend import registry  # pylint: disable=g-import-not-at-top
  definer = next(c for c in cls.__mro__ if "__call__" in vars(c))
  return registry.handler_for(cls) or registry.handler_for(definer)


def test_supported_layers_table_matches_the_registry():
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.frontend import registry  # pylint: disable=g-import-not-at-top
  gram_haiku.track  # pylint: disable=pointless-statement  (registers)
  rows = _layer_table()
  assert len(rows) > 10, rows
  tracked = {}
  for names, rule in rows:
    for name in names:
      cls = _haiku_class(name)
      if not isinstance(cls, type):   # hk.get_parameter
        continue
      handler = _handler(cls)
      m = re.fullmatch(r"``(\w+)``", rule)
      if m:
        assert handler is not None, f"{name}: the table says {rule}, " \
                                    "but track() has no rule for it"
        assert handler.__name__ == m.group(1), (name, handler.__name__, rule)
        tracked[cls] = name
      else:   # made of tracked parts, or untracked: no rule of its own
        assert handler is None, f"{name}: the table says {rule}, but " \
                                f"track() runs {handler.__name__} for it"
  # Haiku's own classes (a test may have registered one of its own).
  missing = [f"hk.{c.__name__} ({h.__name__})"
             for c, h in registry._HANDLERS.items()  # pylint: disable=protected-access
             if c.__module__.startswith("haiku.") and c not in tracked]
  assert not missing, f"registered but not in docs/layers.rst: {missing}"


def test_api_page_states_the_probe_name():
  import gram_haiku  # pylint: disable=g-import-not-at-top
  with open(os.path.join(DOCS, "api.rst"), encoding="utf-8") as f:
    text = f.read()
  assert f':value: "{gram_haiku.PROBE_NAME}"' in text


def test_rendered_pages_show_public_names_only(tmp_path):
  """The Sphinx build (warnings as errors) of docs/: docs/conf.py warns for
  a private path (``_src``) or "see the module docstring" on any rendered
  page, and for a docstring reference it cannot map to a public page."""
  pytest.importorskip("sphinx")
  proc = subprocess.run(
      [sys.executable, "-m", "sphinx", "-q", "-W", "--keep-going", "-b",
       "text", DOCS, str(tmp_path / "text")],
      capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  pending = {f"{name}.txt" for name in _conf().PENDING}
  for name in os.listdir(tmp_path / "text"):
    if name.endswith(".txt") and name not in pending:
      text = (tmp_path / "text" / name).read_text(encoding="utf-8")
      assert "_src" not in text, name
      assert not re.search(r"see\s+the\s+module\s+docstring", text), name


def _conf():
  spec = importlib.util.spec_from_file_location(
      "docs_conf", os.path.join(DOCS, "conf.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_rendered_page_check_can_fail():
  conf = _conf()
  for line in ("see gram_haiku._src.compute.norm_bounds", "(see the module\n"
               "docstring)"):
    assert any(p.search(line) for p, _ in conf.FORBIDDEN), line
  assert not any(p.search("gram_haiku.Rule; sources") for p, _ in
                 conf.FORBIDDEN)
  lines = [":mod:`gram_haiku._src.compute.norm_bounds` and "
           ":class:`gram_haiku._src.nowhere.Thing`"]
  conf._process_docstring(None, "function", "f", None, None, lines)  # pylint: disable=protected-access
  assert "_src.norm_bounds" not in lines[0] and "Formal guarantees" in lines[0]
  assert "gram_haiku._src.nowhere.Thing" in lines[0]   # left: reported
  assert conf._public_types("x: ~jax._src.mesh.Mesh, p: "  # pylint: disable=protected-access
                            "gram_haiku._src.compute.plan.Plan") == (
                                "x: ~jax.sharding.Mesh, p: gram_haiku.Plan")


def _public_modules():
  names = []
  for package in ("gram_haiku",):   # gram_haiku.conformance included
    pkg = importlib.import_module(package)
    names.append(package)
    for info in pkgutil.walk_packages(pkg.__path__, package + "."):
      if ".test_" in info.name or info.name.endswith("__main__"):
        continue
      names.append(info.name)
  return names


def test_docstring_examples_run():
  """Every ``>>>`` example in the shipped packages' docstrings."""
  finder = doctest.DocTestFinder(exclude_empty=True)
  runner = doctest.DocTestRunner(optionflags=doctest_file.FLAGS)
  for name in _public_modules():
    module = importlib.import_module(name)
    for test in finder.find(module):
      runner.run(test)
  results = runner.summarize(verbose=False)
  assert results.attempted > 0, "no docstring examples found"
  assert results.failed == 0, f"{results.failed} docstring examples failed"


#: What a user cannot see or use: the project's internal documents, its
#: issue numbers, paths of one machine, and wording about how it was built.
INTERNAL = (
    (r"DESIGN\.md|STYLE\.md|CASES\.md|DEVELOPERS\.md", "an unshipped file"),
    (r"§", "a section of an unshipped file"),
    (r"\b[Ii]ssues? ?#?\d", "an issue number"),
    (r"/work/|/root/|/home/\w+|/tmp/", "a machine-specific path"),
    (r"\bsessions? (that|which|who)\b|\blent\b", "wording about the "
     "project's own sessions"),
    (r"\bby hand\b", "a maintenance chore"),
)


def _user_facing_files():
  out = [os.path.join(ROOT, "README.md")]
  out += [os.path.join(DOCS, f) for f in os.listdir(DOCS)
          if f.endswith((".rst", ".inc"))]
  perf = os.path.join(DOCS, "perf")
  if os.path.isdir(perf):
    out += [os.path.join(perf, f) for f in os.listdir(perf)
            if f.endswith(".inc")]
  for package in ("gram_haiku", "conformance", "benchmarks"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
      out += [os.path.join(dirpath, f) for f in files if f.endswith(".py")]
  return sorted(out)


def test_docs_speak_of_the_project_and_its_users_alone():
  found = []
  for path in _user_facing_files():
    with open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        for pattern, what in INTERNAL:
          if re.search(pattern, line):
            found.append(f"{os.path.relpath(path, ROOT)}:{n}: {what}: "
                         f"{line.strip()}")
  assert not found, "\n".join(found)


def test_the_internal_reference_check_can_fail():
  lines = ["see DESIGN.md §2", "as issue #6 asks", "/work/bench-venv/bin/x",
           "No GPU was lent to the session that made it",
           "must be updated by hand"]
  for line in lines:
    assert any(re.search(p, line) for p, _ in INTERNAL), line
  assert not any(re.search(p, "once per pytest session")
                 for p, _ in INTERNAL)


_AUTODOC = re.compile(r"^\.\. auto(module|class|function|data)::\s*(\S+)",
                      re.M)


def _autodoc_targets():
  for name in sorted(os.listdir(DOCS)):
    if name.endswith(".rst"):
      with open(os.path.join(DOCS, name)) as f:
        for kind, target in _AUTODOC.findall(f.read()):
          yield name, kind, target


def test_every_autodoc_target_exists():
  # Sphinx (-W, the docs tox env) fails on a target that no longer exists;
  # this finds it in the default suite.
  targets = list(_autodoc_targets())
  assert targets
  for doc, kind, target in targets:
    if kind == "module":
      importlib.import_module(target)
      continue
    module, _, attr = target.rpartition(".")
    assert hasattr(importlib.import_module(module), attr), (doc, target)
