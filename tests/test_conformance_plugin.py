"""The plugin's xdist device pinning; the runners' environment."""

import pytest

from gram_haiku.conformance import plugin
from gram_haiku.conformance import runner

pytestmark = pytest.mark.conformance


def test_pinning_is_opt_in():
  env = {"PYTEST_XDIST_WORKER": "gw3"}
  assert plugin.pin_worker_device(env) == {}
  assert "CUDA_VISIBLE_DEVICES" not in env


def test_pinning_sets_one_device_per_worker():
  env = {"PYTEST_XDIST_WORKER": "gw3", "CONFORMANCE_PIN_DEVICES": "1"}
  plugin.pin_worker_device(env)
  assert env["CUDA_VISIBLE_DEVICES"] == "3"
  assert env["TPU_VISIBLE_CHIPS"] == "3"
  assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_pinning_wraps_around_the_device_count():
  env = {"PYTEST_XDIST_WORKER": "gw5", "CONFORMANCE_PIN_DEVICES": "1",
         "CONFORMANCE_NUM_DEVICES": "4"}
  plugin.pin_worker_device(env)
  assert env["CUDA_VISIBLE_DEVICES"] == "1"


def test_no_pinning_outside_xdist():
  env = {"CONFORMANCE_PIN_DEVICES": "1"}
  assert plugin.pin_worker_device(env) == {}


def test_child_environ_drops_only_the_device_count():
  env = runner.child_environ({
      "XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_foo=1",
      "OTHER": "x"})
  assert env == {"XLA_FLAGS": "--xla_foo=1", "OTHER": "x"}
  env = runner.child_environ(
      {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
  assert "XLA_FLAGS" not in env


def test_conformance_cli_without_pytest_says_what_to_install():
  """``python -m conformance`` where pytest is missing (a [demo] install):
  one line naming the extra, not a traceback."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ("import sys; sys.modules['pytest'] = None; import runpy; "
          "runpy.run_module('gram_haiku.conformance', run_name='__main__')")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, check=False, timeout=120)
  assert out.returncode == 1
  assert "pip install 'gram_haiku[conformance]'" in out.stderr
  assert "Traceback" not in out.stderr


def test_the_plugin_imports_nothing_heavy_for_unrelated_tests(tmp_path):
  """The pytest11 entry point loads in every pytest run of an environment
  with gram_haiku installed: an unrelated test must not pay for JAX."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  (tmp_path / "test_other.py").write_text(
      "import sys\n"
      "def test_other():\n"
      "  assert 'jax' not in sys.modules and 'numpy' not in sys.modules\n")
  import importlib.metadata  # pylint: disable=g-import-not-at-top
  installed = any(e.value.startswith("gram_haiku.conformance.plugin") for e in
                  importlib.metadata.entry_points(group="pytest11"))
  load = [] if installed else ["-p", "gram_haiku.conformance.plugin"]
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-p", "no:xdist", *load, "test_other.py"],
      cwd=tmp_path, capture_output=True, text=True, check=False, timeout=120)
  assert out.returncode == 0, out.stdout + out.stderr
