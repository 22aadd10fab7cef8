"""``python -m gram_haiku.conformance [options] [pytest args]``: run the
suite, print a summary.

Runs ``pytest --pyargs gram_haiku.conformance`` (extra arguments are passed
on, e.g. ``-n auto`` or ``--ops linear``) from the current directory, so
that a ``conftest.py`` there registers your ops exactly as under pytest;
then prints one row per op x check family x platform with its counts of
passed, failed (errors included), skipped and xfailed tests and of the
cases the default budget deselected. Exits with pytest's status: non-zero
when anything failed.
"""

from __future__ import annotations

import collections
import sys

try:
  import pytest
except ImportError:  # A [demo] or [dp] install: the suite needs pytest.
  sys.exit("python -m gram_haiku.conformance needs pytest, pytest-xdist "
           "and hypothesis: pip install 'gram_haiku[conformance]' (in a "
           "checkout: pip install '.[conformance]').")

OUTCOMES = ("passed", "failed", "skipped", "xfailed")
PACKAGE = "gram_haiku.conformance"
PLUGIN = PACKAGE + ".plugin"


class SummaryCollector:
  """A pytest plugin that counts outcomes by (op, family, platform), and the
  cases of each that the default budget deselected."""

  def __init__(self):
    self.counts = collections.defaultdict(collections.Counter)
    self.deselected = {}

  def pytest_runtest_logreport(self, report):
    props = dict(report.user_properties)
    if "conformance_op" not in props:
      return
    key = (props["conformance_op"], props["conformance_family"],
           props["conformance_platform"])
    self.deselected[key] = max(self.deselected.get(key, 0),
                               int(props.get("conformance_deselected", 0)))
    if report.when != "call" and not (report.failed or report.skipped):
      return
    if hasattr(report, "wasxfail"):
      outcome = "xfailed" if report.skipped else "passed"
    elif report.failed:
      outcome = "failed"
    elif report.skipped:
      outcome = "skipped"
    else:
      outcome = "passed"
    self.counts[key][outcome] += 1

  def table(self) -> str:
    """One row per (op, family, platform): its counts, the cases the default
    budget deselected (a row with any is marked ``sampled``), its status;
    then the total deselected."""
    rows = [("op", "family", "platform", *OUTCOMES, "deselected", "status")]
    for key in sorted(self.counts):
      c = self.counts[key]
      status = ("FAIL" if c["failed"] else
                "pass" if c["passed"] else
                "xfail" if c["xfailed"] else "skip")
      skipped = self.deselected.get(key, 0)
      if skipped:
        status += " (sampled)"
      rows.append((*key, *(str(c[o]) for o in OUTCOMES), str(skipped),
                   status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = sum(self.deselected.get(key, 0) for key in self.counts)
    if total:
      lines.append(
          f"{total} cases deselected by the default budget, in the rows "
          "marked (sampled): only the built-in ops are sampled (gram_haiku's "
          "nightly run, tox -e conformance-thorough, checks all of their "
          "cases); --thorough runs them all.")
    else:
      lines.append("0 cases deselected: every case of every row ran.")
    return "\n".join(lines)


def _parser():
  import argparse  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(
      prog="python -m gram_haiku.conformance", allow_abbrev=False,
      usage="python -m gram_haiku.conformance [options] [pytest arguments ...]",
      description="Run the conformance suite on the registered Gram ops "
      "(every family on every platform present) and print the op x family "
      "x platform table. Any other argument goes to pytest.",
      epilog="pytest's own options: python -m gram_haiku.conformance "
      "--pytest-help. "
      "Without -n, the run is spread over every core (pytest-xdist's -n "
      "auto) when pytest-xdist is installed; -n 0 runs in this process.")
  p.add_argument("--ops", "--conformance-ops", dest="ops", default=None,
                 metavar="NAMES", help="comma-separated op names (default: "
                 "every registered op; env CONFORMANCE_OPS)")
  p.add_argument("--modules", "--conformance-modules", dest="modules",
                 default=None, metavar="MODULES", help="comma-separated "
                 "modules to import first: they register your ops (default: "
                 "the conftest.py of the current directory registers them, "
                 "as under pytest; env CONFORMANCE_MODULES)")
  p.add_argument("--thorough", "--conformance-thorough", dest="thorough",
                 action="store_true", help="every vmap/jit layout and a "
                 "large hypothesis budget (the nightly run)")
  p.add_argument("--timeout", "--conformance-timeout", dest="timeout",
                 default=None, metavar="SECONDS", help="seconds a "
                 "multi-device runner may take (default 3600, 0: none; env "
                 "CONFORMANCE_TIMEOUT_S)")
  p.add_argument("--pytest-help", action="store_true",
                 help="show pytest's help instead")
  return p


def _has_xdist() -> bool:
  import importlib.util  # pylint: disable=g-import-not-at-top
  return importlib.util.find_spec("xdist") is not None


def pytest_args(argv) -> list[str]:
  """The pytest arguments for ``python -m gram_haiku.conformance ARGV``
  (after our own options are translated); exits for ``--help``."""
  ours, rest = _parser().parse_known_args(argv)
  if ours.pytest_help:
    rest = ["--help"] + rest
  if ours.ops is not None:
    rest += ["--conformance-ops", ours.ops]
  if ours.modules is not None:
    rest += ["--conformance-modules", ours.modules]
  if ours.thorough:
    rest.append("--conformance-thorough")
  if ours.timeout is not None:
    rest += ["--conformance-timeout", str(ours.timeout)]
  parallel = any(a == "-n" or a.startswith(("-n", "--numprocesses"))
                 for a in rest)
  if not parallel and not ours.pytest_help and _has_xdist():
    rest += ["-n", "auto"]
  return rest


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra = pytest_args(argv)
  collector = SummaryCollector()
  # The package by name, as `pytest --pyargs gram_haiku.conformance` does:
  # the rootdir and the conftest.py that pytest loads first are those of the
  # current directory (where a third party registers their ops), not the
  # installed package's.
  # `python -m` has imported the package before pytest could rewrite its
  # asserts; the checks raise their own messages, so that is fine.
  args = ["--pyargs", PACKAGE, "-q", "-p", "no:cacheprovider",
          "-W", "ignore::pytest.PytestAssertRewriteWarning"]
  if PLUGIN not in sys.modules and not _plugin_installed():
    args += ["-p", PLUGIN]
  status = pytest.main(args + extra, plugins=[collector])
  if "--help" in extra or status == pytest.ExitCode.USAGE_ERROR:
    return int(status)
  print()
  print("Conformance summary (op x family x platform):")
  print(collector.table())
  return int(status)


def _plugin_installed() -> bool:
  from importlib import metadata  # pylint: disable=g-import-not-at-top
  try:
    eps = metadata.entry_points(group="pytest11")
  except TypeError:  # pragma: no cover - Python < 3.10
    eps = metadata.entry_points().get("pytest11", [])
  return any(ep.value == PLUGIN for ep in eps)


if __name__ == "__main__":
  sys.exit(main())
