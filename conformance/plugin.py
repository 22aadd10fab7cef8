"""pytest plugin for the conformance suite (pytest11 entry point
``gram_haiku_conformance``).

Options (each also an environment variable, for tox and CI):

* ``--conformance-ops`` / ``CONFORMANCE_OPS``: comma-separated op names to
  check (default: every registered op).
* ``--conformance-thorough`` / ``CONFORMANCE_THOROUGH=1``: a larger
  hypothesis budget (nightly runs).
* ``--conformance-timeout`` / ``CONFORMANCE_TIMEOUT_S``: seconds a
  multi-device runner subprocess may take (default 3600; 0 for none).
* ``CONFORMANCE_PIN_DEVICES=1``: under pytest-xdist, each worker sees one
  accelerator (``CUDA_VISIBLE_DEVICES`` / ``TPU_VISIBLE_CHIPS`` set from
  ``PYTEST_XDIST_WORKER`` before JAX starts) and does not preallocate.

Fixtures: ``conformance_op`` (parametrised over the selected ops) and
``conformance_platform`` (over the platforms of cpu/gpu/tpu that are
present; the absent ones are named once in the terminal summary).
"""

import os

import pytest

PLATFORMS = ("cpu", "gpu", "tpu")


def pin_worker_device(environ=os.environ) -> dict:
  """Pins this xdist worker to one accelerator, if opted in.

  Reads ``PYTEST_XDIST_WORKER`` (``gw0``, ``gw1``...) and sets
  ``CUDA_VISIBLE_DEVICES`` and ``TPU_VISIBLE_CHIPS`` to the worker's index
  (modulo ``CONFORMANCE_NUM_DEVICES`` when given) and
  ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, so that workers share a machine
  without fighting over device memory. Must run before JAX initialises a
  backend. Returns the variables it set.
  """
  if environ.get("CONFORMANCE_PIN_DEVICES", "") not in ("1", "true", "yes"):
    return {}
  worker = environ.get("PYTEST_XDIST_WORKER", "")
  if not worker.startswith("gw"):
    return {}
  index = int(worker[2:])
  count = int(environ.get("CONFORMANCE_NUM_DEVICES", "0") or 0)
  if count > 0:
    index %= count
  pinned = {"CUDA_VISIBLE_DEVICES": str(index),
            "TPU_VISIBLE_CHIPS": str(index),
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  environ.update(pinned)
  return pinned


def thorough() -> bool:
  """Whether the nightly budget is on (``--conformance-thorough`` sets the
  environment variable in :func:`pytest_configure`, for xdist workers too)."""
  return os.environ.get("CONFORMANCE_THOROUGH", "") in ("1", "true")


def pytest_addoption(parser):
  group = parser.getgroup("conformance")
  group.addoption("--conformance-ops", default=os.environ.get(
      "CONFORMANCE_OPS", ""), help="comma-separated op names to check "
      "(default: all registered; env CONFORMANCE_OPS)")
  group.addoption(
      "--conformance-thorough", action="store_true",
      default=thorough(),
      help="raise the hypothesis example budget (env CONFORMANCE_THOROUGH=1)")
  group.addoption(
      "--conformance-timeout", default=None, metavar="SECONDS",
      help="seconds a multi-device runner subprocess may take (default "
      "3600, 0 for none; env CONFORMANCE_TIMEOUT_S)")


def pytest_configure(config):
  pin_worker_device()
  if config.getoption("--conformance-thorough", default=False):
    # Read at collection time by the families (and by xdist workers, which
    # inherit the environment).
    os.environ["CONFORMANCE_THOROUGH"] = "1"
  timeout = config.getoption("--conformance-timeout", default=None)
  if timeout is not None:  # Read by conformance.runner, in workers too.
    os.environ["CONFORMANCE_TIMEOUT_S"] = str(timeout)
  config.addinivalue_line(
      "markers", "conformance_family(name): the check family of a test")
  config.addinivalue_line("markers", "conformance: a conformance-suite test")


def selected_ops(config):
  from conformance.registry import registered_ops  # pylint: disable=g-import-not-at-top
  names = [n for n in config.getoption("--conformance-ops").split(",") if n]
  ops = registered_ops()
  unknown = set(names) - {op.name for op in ops}
  if unknown:
    raise pytest.UsageError(
        f"--conformance-ops: unknown ops {sorted(unknown)}; registered: "
        f"{[op.name for op in ops]}")
  return [op for op in ops if not names or op.name in names]


def pytest_generate_tests(metafunc):
  if "conformance_op" in metafunc.fixturenames:
    ops = selected_ops(metafunc.config)
    metafunc.parametrize("conformance_op", ops, ids=[op.name for op in ops])
  if "conformance_platform" in metafunc.fixturenames:
    metafunc.parametrize("conformance_platform", present_platforms(),
                         indirect=True)


def present_platforms() -> list[str]:
  """The platforms of :data:`PLATFORMS` that ``jax.devices()`` reports: the
  suite's cases are parametrised over these alone (the absent ones get one
  line in the terminal summary, not a skip per case)."""
  from conformance.checks import platforms_present  # pylint: disable=g-import-not-at-top
  present = platforms_present()
  return [p for p in PLATFORMS if p in present]


@pytest.fixture
def conformance_platform(request):
  return request.param


def pytest_terminal_summary(terminalreporter):
  """One line naming the platforms that the cases did not run on (read from
  the reports, so that the pytest-xdist controller starts no JAX backend)."""
  absent = set()
  for reports in terminalreporter.stats.values():
    for report in reports:
      props = dict(getattr(report, "user_properties", ()) or ())
      if "conformance_absent" in props:
        absent.update(p for p in props["conformance_absent"].split(",") if p)
  if absent:
    terminalreporter.write_line(
        f"conformance: platform(s) {', '.join(sorted(absent))} not present "
        "here (jax.devices() reports none), so their cases were not "
        "collected; run on a machine that has them to check those backends.")


def pytest_collection_modifyitems(items):
  """Records op, family and platform of each test (for the summary table),
  and the platforms that are absent."""
  absent = None
  for item in items:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
      continue
    op = callspec.params.get("conformance_op")
    family = item.get_closest_marker("conformance_family")
    if op is None or family is None:
      continue
    if absent is None:
      absent = [p for p in PLATFORMS if p not in present_platforms()]
    item.user_properties.append(("conformance_op", op.name))
    item.user_properties.append(("conformance_family", family.args[0]))
    item.user_properties.append(
        ("conformance_platform", callspec.params.get("conformance_platform",
                                                     "cpu")))
    item.user_properties.append(("conformance_absent", ",".join(absent)))
