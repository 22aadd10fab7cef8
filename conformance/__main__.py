"""``python -m conformance [pytest args]``: run the suite, print a summary.

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

import pytest

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


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  collector = SummaryCollector()
  here = os.path.dirname(os.path.abspath(__file__))
  # `python -m conformance` has imported the package before pytest could
  # rewrite its asserts; the checks raise their own messages, so that is fine.
  args = [here, "-q", "-p", "no:cacheprovider",
          "-W", "ignore::pytest.PytestAssertRewriteWarning"]
  if "conformance.plugin" not in sys.modules and not _plugin_installed():
    args += ["-p", "conformance.plugin"]
  status = pytest.main(args + argv, plugins=[collector])
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
  return any(ep.value == "conformance.plugin" for ep in eps)


if __name__ == "__main__":
  sys.exit(main())
