"""``python -m gram_haiku.conformance [pytest args]``: run the suite, print a summary.

Runs ``pytest`` on the conformance package (extra arguments are passed on,
e.g. ``-n auto`` or ``--conformance-ops linear``), then prints one row per
op x check family x platform with its counts of passed, failed (errors
included), skipped and xfailed tests. Exits with pytest's status: non-zero
when anything failed.
"""

from __future__ import annotations

import collections
import os
import sys

try:
  import pytest
except ImportError:  # A [demo] or [dp] install: the suite needs pytest.
  sys.exit("python -m gram_haiku.conformance needs pytest, pytest-xdist and hypothesis:"
           " pip install 'gram_haiku[conformance]'.")

OUTCOMES = ("passed", "failed", "skipped", "xfailed")


class SummaryCollector:
  """A pytest plugin that counts outcomes by (op, family, platform)."""

  def __init__(self):
    self.counts = collections.defaultdict(collections.Counter)

  def pytest_runtest_logreport(self, report):
    props = dict(report.user_properties)
    if "conformance_op" not in props:
      return
    if report.when != "call" and not (report.failed or report.skipped):
      return
    key = (props["conformance_op"], props["conformance_family"],
           props["conformance_platform"])
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
    rows = [("op", "family", "platform", *OUTCOMES, "status")]
    for key in sorted(self.counts):
      c = self.counts[key]
      status = ("FAIL" if c["failed"] else
                "pass" if c["passed"] else
                "xfail" if c["xfailed"] else "skip")
      rows.append((*key, *(str(c[o]) for o in OUTCOMES), status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _parser():
  import argparse  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(
      prog="python -m gram_haiku.conformance", allow_abbrev=False,
      usage="python -m gram_haiku.conformance [options] [pytest arguments ...]",
      description="Run the conformance suite on the registered Gram ops "
      "(every family on every platform present) and print the op x family "
      "x platform table. Any other argument goes to pytest.",
      epilog="pytest's own options: python -m gram_haiku.conformance --pytest-help. "
      "Without -n, the run is spread over every core (pytest-xdist's -n "
      "auto) when pytest-xdist is installed; -n 0 runs in this process.")
  p.add_argument("--ops", "--conformance-ops", dest="ops", default=None,
                 metavar="NAMES", help="comma-separated op names (default: "
                 "every registered op; env CONFORMANCE_OPS)")
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
  """The pytest arguments for ``python -m gram_haiku.conformance ARGV`` (after our own
  options are translated); exits for ``--help``."""
  ours, rest = _parser().parse_known_args(argv)
  if ours.pytest_help:
    rest = ["--help"] + rest
  if ours.ops is not None:
    rest += ["--conformance-ops", ours.ops]
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
  here = os.path.dirname(os.path.abspath(__file__))
  # `python -m gram_haiku.conformance` has imported the package before pytest could
  # rewrite its asserts; the checks raise their own messages, so that is fine.
  args = [here, "-q", "-p", "no:cacheprovider",
          "-W", "ignore::pytest.PytestAssertRewriteWarning"]
  if "gram_haiku.conformance.plugin" not in sys.modules and not _plugin_installed():
    args += ["-p", "gram_haiku.conformance.plugin"]
  status = pytest.main(args + extra, plugins=[collector])
  if "--help" in extra:
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
  return any(ep.value == "gram_haiku.conformance.plugin" for ep in eps)


if __name__ == "__main__":
  sys.exit(main())
