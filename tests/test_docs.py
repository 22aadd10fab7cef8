"""The documentation as a user reads it: its examples run, and it speaks of
the project and its users alone."""

import doctest
import importlib
import os
import pkgutil
import re
import subprocess
import sys
import textwrap

import pytest

from conformance import runner
from gram_haiku._src import hijax_compat as hx
from tests import doctest_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _doc_files():
  files = [os.path.join(ROOT, "README.md")] + sorted(
      os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".rst"))
  # docs/quickstart.rst holds the README's quickstart, verbatim (checked
  # below): running it once is enough.
  files = [f for f in files if not f.endswith("quickstart.rst")]
  return [f for f in files if ">>>" in doctest_file.examples_text(f)]


def _doc_groups():
  """Files whose examples configure JAX run alone; the others share one
  process (each file still gets its own globals)."""
  alone = [(f,) for f in _doc_files() if doctest_file.configures_jax(f)]
  rest = tuple(f for f in _doc_files() if not doctest_file.configures_jax(f))
  return alone + ([rest] if rest else [])


@pytest.mark.parametrize(
    "paths", _doc_groups(),
    ids=lambda ps: "+".join(os.path.relpath(p, ROOT) for p in ps))
def test_doc_examples_run(paths):
  """Every ``>>>`` example of README.md and docs/*.rst, in a process of
  their own."""
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


def _rst_pycon_block(path):
  text = open(path).read()
  start = text.index(".. code-block:: pycon\n\n") + len(
      ".. code-block:: pycon\n\n")
  lines = []
  for line in text[start:].splitlines():
    if line and not line.startswith(" "):
      break
    lines.append(line)
  return textwrap.dedent("\n".join(lines)).strip()


def test_quickstart_is_the_same_in_readme_and_docs():
  readme = doctest_file.examples_text(os.path.join(ROOT, "README.md")).strip()
  docs = _rst_pycon_block(os.path.join(DOCS, "quickstart.rst"))
  assert readme == docs


def _public_modules():
  names = []
  for package in ("gram_haiku", "conformance"):
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
