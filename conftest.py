"""Repository-wide pytest setup (not shipped).

XLA's CPU backend spends most of this suite's time compiling many small
programs; its optimisation passes buy nothing at these sizes, so the suite
runs with ``jax_disable_most_optimizations`` (about 1.7x faster here), and
XLA compiles each program with its classic CPU code generator into one LLVM
module (see ``_FAST_COMPILE``). The math is unchanged: XLA's optimisations
reorder floating-point work only within the tolerances the tests use. The
multi-device runner subprocesses set their own optimisation level (the case
whose HLO collective counts are checked compiles with JAX's defaults).
"""

import gc
import importlib.metadata
import os

import pytest

# XLA's compilations persist across runs (and across this run's workers and
# subprocesses, which inherit the environment) in the ignored folder
# .jax_cache: a first run compiles everything (about 10% of it is repeated,
# and then read back), a second run on the same machine takes about a third
# of the time. Set JAX_COMPILATION_CACHE_DIR yourself to use another folder.
_ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(_ROOT, ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Two XLA CPU flags that only change how a program is compiled, not its math
# (the runner subprocesses inherit them; one already in XLA_FLAGS is left
# as it is):
# * the classic code generator: XLA's CPU fusion emitters take about 1.5x
#   longer to compile each of this suite's many small programs and run them
#   no faster at these sizes (measured: a tiny elementwise program 62 ->
#   42 ms; two heavy tests 30 -> 18 s). jaxlib 0.9 and 0.10 have the flag;
#   0.11 removed it (an unknown XLA flag aborts the process), so it is set
#   for those releases only;
# * one LLVM module per program: by default XLA splits each program's code
#   into up to 32 modules compiled in parallel, which costs more CPU time in
#   all than it saves on programs this small (measured, cold:
#   test_frozen.py and test_loops.py 59 -> 49 CPU-s). jaxlib 0.10 and 0.11
#   both have the flag.
_FAST_COMPILE = {"xla_cpu_parallel_codegen_split_count": "1"}
_JAXLIB = importlib.metadata.version("jaxlib").split(".")[:2]
if tuple(int(p) for p in _JAXLIB) < (0, 11):
  _FAST_COMPILE["xla_cpu_use_fusion_emitters"] = "false"
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")] +
    [f"--{name}={value}" for name, value in _FAST_COMPILE.items()
     if name not in os.environ.get("XLA_FLAGS", "")]).strip()

# The documentation's example processes (tests/test_docs.py) read it from the
# environment at import; this process has imported JAX already (the pytest
# plugin's package did), so it is also set here.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_disable_most_optimizations", True)

# The documented third-party example runs every family in our own run, as a
# registered op (the sharded family's runner imports this module for it).
from gram_haiku import conformance  # pylint: disable=g-import-not-at-top,wrong-import-position
from gram_haiku.conformance import plugin as _plugin  # pylint: disable=g-import-not-at-top,wrong-import-position
from gram_haiku.conformance.examples import scaled_linear  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests import budget  # pylint: disable=g-import-not-at-top,wrong-import-position

conformance.register(scaled_linear.SPEC)

# Python's cyclic garbage collector: tracing and lowering allocate millions
# of short-lived objects, and at the default thresholds (700, 10, 10) its
# collections took 8% of a test file's time (tests/test_reweight.py, cold
# compilation cache: 2.7 of 34 s in 2,082 collections, 14 of them full);
# at these thresholds 0.7 s. The objects alive after the imports are frozen
# (left out of every later collection). Tests that need garbage gone call
# gc.collect() themselves.
gc.freeze()
gc.set_threshold(50_000, 50, 100)


# The default budget (the README's test command, at most 6 minutes cold on
# 2 cores) runs every test function once: a parametrised sweep its first
# case (its parameters' first values: the parametrisations list the plain
# case first), except the sweeps of FULL_FILES and EVERY_CASE, which run
# every case, those of SAMPLED_SWEEPS, one in k, and THOROUGH_ONLY, left
# out. The nightly conformance-thorough env (CONFORMANCE_THOROUGH=1 /
# --conformance-thorough) runs every case of every function. (The
# conformance suite's ops are sampled by its own plugin.)
# Files whose sweeps all run every case by default: the real cases of
# shared/cases and the checks of every documentation page.
FULL_FILES = ("tests/test_cases.py", "tests/test_docs.py")
# Sweeps elsewhere that run every case: the sharded cases of
# tests/distributed_cases.py's default list (cases(everything=False), which
# its one runner computes whole, each case reported; --all adds the rest).
EVERY_CASE = ("tests/test_distributed.py::test_sharded_case",)
# Sweeps that keep one case in k (a key a file: each of its sweeps), first
# included, and where a sweep crosses parameters or has two cases each
# value of each at least once: the clip bound's attacks, every other case
# of each in order of collection (of the cancelling attack one in four)
# with every layer, strategy and mode; the interpreter's red-team corpus,
# one row in twenty-four (each row one verdict of the same interpreter,
# the rows of refused programs among them).
SAMPLED_SWEEPS = {
    "tests/test_clip_bound.py": 2,
    "tests/test_clip_bound.py::test_a_cancelling_example_is_clipped": 4,
    "tests/test_interpreter_corpus.py::test_corpus_row": 24,
}


# Test functions left to the thorough env (file::function): those of
# tests/thorough_only.txt, by hand (each with its reason) and chosen by
# tests/budget.py (their lines of gram_haiku run by the default budget's
# other tests; GRAM_HAIKU_BUDGET_ALL=1 ignores that section, as budget.py
# does when it measures).
THOROUGH_ONLY = frozenset(budget.keys(
    generated=not os.environ.get("GRAM_HAIKU_BUDGET_ALL")))


def _sampled(items):
  """The items of the parametrised sweeps to keep in the default budget,
  and all the sweeps' items: each function's first case (in order of
  collection), every case of :data:`FULL_FILES` and :data:`EVERY_CASE`,
  one in ``k`` of :data:`SAMPLED_SWEEPS` and, in those that cross
  parameters or have two cases, each value of each at least once. The
  conformance suite's items (sampled by its plugin) are left alone."""
  groups = {}
  for item in items:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "conformance_op" in callspec.params:
      continue
    # A sweep is a function of its module or class: two classes' methods
    # of one name (a mixin's) keep a case each.
    groups.setdefault((item.parent.nodeid, _key(item)), []).append(item)
  keep = set()
  for group in groups.values():
    key = _key(group[0])
    every = SAMPLED_SWEEPS.get(key, SAMPLED_SWEEPS.get(key.split("::")[0]))
    if every:
      kept = group[::every]
      # and, where the sweep crosses parameters or has two cases, each
      # value of each at least once (a strategy, a mode or a layer that
      # alternates with another in the sweep's order).
      held = {(n, repr(v)) for item in kept
              for n, v in item.callspec.params.items()}
      crossed = len(group[0].callspec.params) > 1 or len(group) <= 2
      for item in group if crossed else ():
        values = {(n, repr(v)) for n, v in item.callspec.params.items()}
        if not values <= held:
          kept.append(item)
          held |= values
    elif key in EVERY_CASE or key.split("::")[0] in FULL_FILES:
      kept = group
    else:
      kept = group[:1]
    keep.update(id(item) for item in kept)
  return keep, {id(item) for group in groups.values() for item in group}


def _key(item):
  """``file::function`` of a test item (:func:`tests.budget.function_key`,
  the keys of tests/thorough_only.txt)."""
  return budget.function_key(item.nodeid)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """Under ``-n`` without ``--dist``, xdist's worksteal scheduler: a worker
  that runs out of tests takes some of the other's queue instead of
  idling while the other finishes it (its gain was within this suite's
  run-to-run noise on 2 cores, 2026-12-07)."""
  option = config.option
  if getattr(option, "numprocesses", None) and getattr(
      option, "dist", None) == "no":
    option.dist = "worksteal"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  """Leaves out :data:`THOROUGH_ONLY` and samples the parametrised sweeps
  (:func:`_sampled`) outside the thorough budget; the deselected count says
  how many cases it left out. Runs after ``-k``/``-m`` have deselected
  theirs: ``-k`` naming a sweep's later case runs that case (sampled first,
  the sweep would keep its first case, which ``-k`` then left out)."""
  if _plugin.thorough():
    return
  keep, drop = [], []
  sampled, grouped = _sampled(items)
  for item in items:
    if _key(item) in THOROUGH_ONLY:
      drop.append(item)
    elif id(item) in grouped:
      (keep if id(item) in sampled else drop).append(item)
    else:
      keep.append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_terminal_summary(terminalreporter, config):
  del config
  if not _plugin.thorough():
    terminalreporter.write_line(
        "gram_haiku: the default budget ran every test function once (a "
        "parametrised sweep its first case; every case of conftest."
        "FULL_FILES and EVERY_CASE, one in k of SAMPLED_SWEEPS), none of "
        "tests/thorough_only.txt (in the deselected count); tox -e "
        "conformance-thorough runs them all.")
