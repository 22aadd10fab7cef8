"""Runs the ``>>>`` examples of documentation files, in a process of their own.

``python -m tests.doctest_file PATH [PATH ...]``: for a Markdown file, the
```` ```pycon ```` blocks; for reStructuredText, the whole file; each file
with its own globals. Exits non-zero, printing each failure, if any example
fails or a file has none. A process of their own, because an example may
configure JAX before it starts (``jax_num_cpu_devices`` for fake devices):
such a file runs alone (:func:`configures_jax`).
"""

from __future__ import annotations

import doctest
import re
import sys

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

_PYCON = re.compile(r"^```pycon\n(.*?)^```", re.S | re.M)


def examples_text(path: str) -> str:
  """The text whose ``>>>`` examples run: pycon blocks of Markdown, or all."""
  with open(path) as f:
    text = f.read()
  if path.endswith(".md"):
    return "\n\n".join(m.group(1) for m in _PYCON.finditer(text))
  return text


def run(path: str) -> doctest.TestResults:
  text = examples_text(path)
  test = doctest.DocTestParser().get_doctest(text, {}, path, path, 0)
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  runner.run(test)
  return runner.summarize(verbose=False)


def configures_jax(path: str) -> bool:
  """Whether the file's examples change JAX's set-up (then it runs alone)."""
  return "jax.config.update(" in examples_text(path)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  bad = 0
  for path in argv:
    results = run(path)
    print(f"{path}: {results.attempted} examples, {results.failed} failed",
          flush=True)
    bad += bool(results.failed or not results.attempted)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
