"""The Haiku-suite harness (tests/haiku_suite) works: a smoke run.

The harness itself (Haiku's own tests with ``track()`` around every
transform, about ten minutes) runs in ``tox -e haiku-suite`` and the nightly
``conformance-thorough``; here it runs one small Haiku test file.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_haiku_bias_tests_pass_under_track():
  run = subprocess.run(
      [sys.executable, "-m", "tests.haiku_suite", "bias_test"], cwd=ROOT,
      capture_output=True, text=True, timeout=300, check=False)
  out = run.stdout + run.stderr
  assert run.returncode == 0, out
  assert re.search(r"\b\d+ passed\b", out) and " failed" not in out, out
  # The patched transforms ran the layers tracked: probes came back.
  calls = re.search(r"haiku_suite: (\d+) tracked init/apply calls", out)
  assert calls and int(calls.group(1)) > 0, out
