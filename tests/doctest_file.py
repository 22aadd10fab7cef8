"""Runs the ``>>>`` examples of one documentation file, in a process of its own.

``python -m tests.doctest_file PATH``: for a Markdown file, the ```` ```pycon ````
blocks; for reStructuredText, the whole file. Exits non-zero, printing each
failure, if any example fails. A process of its own, because an example may
configure JAX before it starts (``jax_num_cpu_devices`` for fake devices).
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


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  results = run(argv[0])
  print(f"{argv[0]}: {results.attempted} examples, {results.failed} failed")
  return 1 if results.failed or not results.attempted else 0


if __name__ == "__main__":
  sys.exit(main())
