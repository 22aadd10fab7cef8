"""Runs the code blocks of documentation files, in a process of their own.

``python -m tests.doctest_file PATH [PATH ...]``: every code block of each
file (README.md and docs/*.rst), in the order of the file, with one set of
globals per file. Exits non-zero, printing each failure, if a block fails,
a block is of no known kind, or a file has no example at all.

What each block is, by its language (Markdown: the word after the opening
```` ``` ````; reStructuredText: ``.. code-block:: LANG``, or a paragraph
that starts with ``>>>``):

* ``pycon`` (or any block whose first line starts with ``>>>``): a doctest.
* ``python``: run as a script, in the file's globals, after the blocks above
  it (so it may use their names), and before the ones below.
* ``bash``, ``console``, ``shell``, ``sh``: not run; each command is checked
  instead (:func:`check_shell`): the program is one we know, the module of a
  ``python -m`` exists and takes the flags given, a ``pip`` extra exists,
  a ``tox -e`` environment exists.
* ``text``: output, not code.
* A **fragment**, marked ``fragment`` (Markdown: ```` ```python fragment ````;
  reStructuredText: the option ``:class: fragment``), is a piece of a larger
  program that cannot run alone (a ``conftest.py`` importing the reader's
  own module). It must still parse as Python; it is not run.

Anything else fails: a literal block without a language (reStructuredText's
``::``, Markdown's indented block), an unknown language. A process of its
own, because an example may configure JAX before it starts
(``jax_num_cpu_devices`` for fake devices): such a file runs alone
(:func:`configures_jax`).
"""

from __future__ import annotations

import ast
import configparser
import dataclasses
import doctest
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOCTEST_LANGS = ("pycon",)
PYTHON_LANGS = ("python", "py", "python3")
SHELL_LANGS = ("bash", "console", "shell", "sh")
OUTPUT_LANGS = ("text",)
FRAGMENT = "fragment"


@dataclasses.dataclass(frozen=True)
class Block:
  """One code block of a documentation file."""
  path: str
  line: int         # 1-based line of the block's first line of code
  lang: str         # "" where the source gives none
  code: str         # dedented
  fragment: bool = False

  @property
  def kind(self) -> str:
    """"doctest", "python", "shell", "output", "fragment" or "unknown"."""
    if self.code.lstrip().startswith(">>>"):
      return "doctest" if not self.fragment else "fragment"
    if self.fragment:
      return "fragment"
    if self.lang in DOCTEST_LANGS:
      return "doctest"
    if self.lang in PYTHON_LANGS:
      return "python"
    if self.lang in SHELL_LANGS:
      return "shell"
    if self.lang in OUTPUT_LANGS:
      return "output"
    return "unknown"

  def where(self) -> str:
    return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


_FENCE = re.compile(r"^```(\S*)[ \t]*(.*)$")


def _markdown_blocks(path: str, text: str) -> list[Block]:
  blocks, lines, n = [], text.splitlines(), 0
  while n < len(lines):
    m = _FENCE.match(lines[n])
    if m:
      lang, info = m.group(1), m.group(2).split()
      end = n + 1
      while end < len(lines) and not lines[end].startswith("```"):
        end += 1
      blocks.append(Block(path, n + 2, lang, "\n".join(lines[n + 1:end]),
                          FRAGMENT in info))
      n = end + 1
      continue
    # An indented code block: four spaces after a blank line (list items'
    # continuation lines are indented by two).
    if (lines[n].startswith("    ") and lines[n].strip() and n > 0 and
        not lines[n - 1].strip()):
      blocks.append(Block(path, n + 1, "", textwrap.dedent(lines[n])))
    n += 1
  return blocks


_DIRECTIVE = re.compile(r"^(\s*)\.\. (code-block|code|sourcecode)::\s*(\S*)")
_OTHER_DIRECTIVE = re.compile(r"^\s*\.\. [\w:-]+::")


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _indented_body(lines, start, min_indent):
  """The lines from ``start`` indented more than ``min_indent`` (blank lines
  inside included); returns (first, end) line indices."""
  n = start
  while n < len(lines) and not lines[n].strip():
    n += 1
  first = end = n
  while n < len(lines):
    if lines[n].strip():
      if _indent(lines[n]) <= min_indent:
        break
      end = n + 1
    n += 1
  return first, end


def _rst_blocks(path: str, text: str) -> list[Block]:
  blocks, lines, n = [], text.splitlines(), 0
  while n < len(lines):
    line = lines[n]
    m = _DIRECTIVE.match(line)
    if m:
      indent, lang = len(m.group(1)), m.group(3)
      n += 1
      classes = []
      while n < len(lines) and re.match(r"^\s+:[\w-]+:", lines[n]):
        opt = lines[n].strip()
        if opt.startswith(":class:"):
          classes += opt[len(":class:"):].split()
        n += 1
      first, end = _indented_body(lines, n, indent)
      blocks.append(Block(path, first + 1, lang,
                          textwrap.dedent("\n".join(lines[first:end])),
                          FRAGMENT in classes))
      n = max(end, n)
      continue
    if _OTHER_DIRECTIVE.match(line):
      # Another directive (math, list-table, autodoc, ...): skip its body.
      first, end = _indented_body(lines, n + 1, _indent(line))
      n = max(end, n + 1)
      continue
    if line.rstrip().endswith("::") and line.strip() and not (
        line.lstrip().startswith("..")):
      # A literal block with no language.
      first, end = _indented_body(lines, n + 1, _indent(line))
      if end > first:
        blocks.append(Block(path, first + 1, "",
                            textwrap.dedent("\n".join(lines[first:end]))))
        n = end
        continue
    if line.lstrip().startswith(">>>"):
      # A doctest block: a paragraph starting with >>>, up to a blank line.
      end = n
      while end < len(lines) and lines[end].strip():
        end += 1
      blocks.append(Block(path, n + 1, "pycon",
                          textwrap.dedent("\n".join(lines[n:end]))))
      n = end
      continue
    n += 1
  return blocks


def blocks(path: str) -> list[Block]:
  """Every code block of a Markdown or reStructuredText file, in order."""
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if path.endswith(".md"):
    return _markdown_blocks(path, text)
  return _rst_blocks(path, text)


def examples_text(path: str) -> str:
  """The text of the file's doctest blocks, in order."""
  return "\n\n".join(b.code for b in blocks(path) if b.kind == "doctest")


def _examples(path: str) -> list[doctest.Example]:
  """The file's doctest and Python blocks as doctest examples, in order (a
  Python block is one example that runs it as a script)."""
  parser, out = doctest.DocTestParser(), []
  for block in blocks(path):
    if block.kind == "doctest":
      for ex in parser.get_examples(block.code, path):
        ex.lineno += block.line - 1
        out.append(ex)
    elif block.kind == "python":
      # Padded so that a traceback gives the file's own line numbers.
      source = "\n" * (block.line - 1) + block.code
      out.append(doctest.Example(
          f"exec(compile({source!r}, {path!r}, 'exec'))\n", "",
          lineno=block.line - 1))
  return out


def run(path: str) -> doctest.TestResults:
  test = doctest.DocTest(_examples(path), {}, path, path, 0, None)
  runner = doctest.DocTestRunner(optionflags=FLAGS)
  runner.run(test)
  return runner.summarize(verbose=False)


def problems(path: str) -> list[str]:
  """Blocks that are neither run nor checked: no language, an unknown one,
  a fragment that does not parse."""
  out = []
  for block in blocks(path):
    kind = block.kind
    if kind == "unknown":
      what = (f"language {block.lang!r}" if block.lang else "no language")
      out.append(f"{block.where()}: a code block with {what}: give it one "
                 f"of {DOCTEST_LANGS + PYTHON_LANGS + SHELL_LANGS} (or "
                 f"{OUTPUT_LANGS}), or mark it {FRAGMENT!r}")
    elif kind == "fragment" and (block.lang in PYTHON_LANGS or
                                 block.lang in DOCTEST_LANGS):
      code = block.code
      if code.lstrip().startswith(">>>"):
        code = "\n".join(ex.source for ex in
                         doctest.DocTestParser().get_examples(code))
      try:
        ast.parse(code)
      except SyntaxError as e:
        out.append(f"{block.where()}: a fragment that is not Python: {e}")
  return out


def configures_jax(path: str) -> bool:
  """Whether the file's examples change JAX's set-up (then it runs alone)."""
  return any("jax.config.update(" in b.code for b in blocks(path)
             if b.kind in ("doctest", "python"))


# Shell blocks: each command is checked, not run.

_KNOWN_PROGRAMS = ("pip", "python", "pytest", "tox", "gram-haiku", "cd")


def _commands(code: str) -> list[list[str]]:
  """The commands of a shell block: comments dropped, continuation lines
  joined, split at ``&&``, ``||``, ``;`` and ``|``."""
  text = re.sub(r"\\\n", " ", code)
  out = []
  for line in text.splitlines():
    line = line.strip()
    if line.startswith("$ "):
      line = line[2:]
    words = shlex.split(line, comments=True)
    cmd = []
    for w in words + [";"]:
      if w in ("&&", "||", ";", "|"):
        if cmd:
          out.append(cmd)
        cmd = []
      else:
        cmd.append(w)
  # Environment assignments in front of a command (VAR=value cmd ...).
  return [[w for i, w in enumerate(c)
           if not (re.match(r"^\w+=", w) and
                   all(re.match(r"^\w+=", v) for v in c[:i + 1]))]
          for c in out]


def _setup_cfg() -> configparser.ConfigParser:
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, "setup.cfg"))
  return cfg


def _extras() -> set[str]:
  return set(_setup_cfg()["options.extras_require"])


def _tox_envs() -> set[str]:
  cfg = configparser.ConfigParser()
  cfg.read(os.path.join(ROOT, "tox.ini"))
  envs = {s.split(":", 1)[1] for s in cfg.sections()
          if s.startswith("testenv:")}
  envs |= {e.strip() for e in cfg["tox"].get("envlist", "").split(",")}
  return envs


#: ``python -m MODULE [SUBCOMMAND] --help`` of each argv given, in this one
#: process (each module run as ``-m`` runs it, its output read from file
#: descriptors 1 and 2; warnings off): one interpreter and one JAX import for
#: all of a page's modules, not one each. Prints the texts as a JSON list.
_HELP_DRIVER = """
import json, os, runpy, sys, tempfile, traceback
texts = []
for argv in json.loads(sys.argv[1]):
  with tempfile.TemporaryFile() as out:
    sys.stdout.flush(); sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1); os.dup2(out.fileno(), 2)
    sys.argv = [argv[1], *argv[2:], "--help"]
    try:
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit:
      pass
    except BaseException:
      traceback.print_exc()
    finally:
      sys.stdout.flush(); sys.stderr.flush()
      os.dup2(saved[0], 1); os.dup2(saved[1], 2)
      os.close(saved[0]); os.close(saved[1])
    out.seek(0)
    texts.append(out.read().decode("utf-8", "replace"))
print(json.dumps(texts))
"""

_HELP_TEXTS: dict[tuple[str, ...], str] = {}


def _read_helps(argvs) -> dict[tuple[str, ...], str]:
  """The ``--help`` text of each argv (``("-m", module, *subcommand)``),
  those not read before read in one process (:data:`_HELP_DRIVER`)."""
  missing = list(dict.fromkeys(a for a in argvs if a not in _HELP_TEXTS))
  if missing:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _HELP_DRIVER,
         json.dumps(missing)], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300, check=False)
    try:
      texts = json.loads(proc.stdout.splitlines()[-1])
    except (IndexError, ValueError):
      texts = [f"(no --help read: {proc.stdout[-2000:]}"
               f"{proc.stderr[-2000:]})"] * len(missing)
    _HELP_TEXTS.update(zip(missing, texts))
  return {a: _HELP_TEXTS[a] for a in argvs}


def _flags(args: list[str]) -> list[str]:
  out = []
  for a in args:
    if a == "--":
      break
    if a.startswith("--") and a not in ("--help",):
      out.append(a.split("=", 1)[0])
  return out


def _check_flags(where, argv, args, problems_out, help_of):
  if not _flags(args):
    return
  text = help_of(tuple(argv))
  for flag in _flags(args):
    if not re.search(re.escape(flag) + r"\b", text):
      problems_out.append(f"{where}: {' '.join(argv)} has no {flag} "
                          f"(not in its --help)")


def check_shell(*shell_blocks: Block) -> list[str]:
  """What is wrong with the commands of shell blocks (empty: nothing).

  A first pass finds the ``--help`` texts the flags are checked against,
  read together in one process (:func:`_read_helps`); the second checks.
  """
  wanted = []
  _check_commands(shell_blocks, lambda argv: wanted.append(argv) or "")
  return _check_commands(shell_blocks, _read_helps(wanted).__getitem__)


def _check_commands(shell_blocks, help_of) -> list[str]:
  out = []
  for block in shell_blocks:
    _check_block(block, help_of, out)
  return out


def _check_block(block: Block, help_of, out: list[str]) -> None:
  where = block.where()
  for cmd in _commands(block.code):
    prog, args = cmd[0], cmd[1:]
    if prog not in _KNOWN_PROGRAMS:
      out.append(f"{where}: unknown command {prog!r}: add a check for it "
                 f"to tests/doctest_file.py or mark the block {FRAGMENT!r}")
    elif prog == "pip":
      for a in args:
        m = re.match(r"^[\w./-]*\[([\w,-]+)\]$", a)
        for extra in (m.group(1).split(",") if m else ()):
          if extra not in _extras():
            out.append(f"{where}: pip extra {extra!r} is not in setup.cfg")
    elif prog == "python":
      if args[:1] != ["-m"] or len(args) < 2:
        out.append(f"{where}: only 'python -m MODULE' is checked: {cmd}")
        continue
      module = args[1]
      sys.path.insert(0, ROOT)
      try:
        found = importlib.util.find_spec(module) is not None
      except ImportError:
        found = False
      finally:
        sys.path.remove(ROOT)
      if not found:
        out.append(f"{where}: no module {module!r}")
        continue
      rest = args[2:]
      # Leading words that are not flags name a subcommand (dp-demo) or are
      # positional arguments; --help after them still asks the module.
      sub = []
      for a in rest:
        if a.startswith("-"):
          break
        sub.append(a)
      _check_flags(where, ["-m", module, *sub[:1]] if module == "gram_haiku"
                   else ["-m", module], rest, out, help_of)
    elif prog == "pytest":
      _check_flags(where, ["-m", "pytest"], args, out, help_of)
    elif prog == "gram-haiku":
      sub = [a for a in args[:1] if not a.startswith("-")]
      _check_flags(where, ["-m", "gram_haiku", *sub], args, out, help_of)
    elif prog == "tox":
      envs = []
      for i, a in enumerate(args):
        if a == "-e" and i + 1 < len(args):
          envs += args[i + 1].split(",")
      for env in envs:
        if env not in _tox_envs():
          out.append(f"{where}: no tox environment {env!r}")


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  bad = 0
  for path in argv:
    for p in problems(path):
      print(p, flush=True)
      bad += 1
    results = run(path)
    print(f"{path}: {results.attempted} examples, {results.failed} failed",
          flush=True)
    bad += bool(results.failed or not results.attempted)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
