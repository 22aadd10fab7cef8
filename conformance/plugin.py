"""pytest plugin for the conformance suite (pytest11 entry point
``gram_haiku_conformance``).

Options (each also an environment variable, for tox and CI):

* ``--conformance-ops`` / ``CONFORMANCE_OPS``: comma-separated op names to
  check (default: every registered op).
* ``--conformance-thorough`` / ``CONFORMANCE_THOROUGH=1``: a larger
  hypothesis budget (nightly runs).
* ``CONFORMANCE_PIN_DEVICES=1``: under pytest-xdist, each worker sees one
  accelerator (``CUDA_VISIBLE_DEVICES`` / ``TPU_VISIBLE_CHIPS`` set from
  ``PYTEST_XDIST_WORKER`` before JAX starts) and does not preallocate.

Fixtures: ``conformance_op`` (parametrised over the selected ops) and
``conformance_platform`` (over cpu/gpu/tpu; an absent platform is skipped
with a message saying so).
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


def pytest_configure(config):
  pin_worker_device()
  if config.getoption("--conformance-thorough", default=False):
    # Read at collection time by the families (and by xdist workers, which
    # inherit the environment).
    os.environ["CONFORMANCE_THOROUGH"] = "1"
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
    metafunc.parametrize("conformance_platform", PLATFORMS,
                         indirect=True)


@pytest.fixture
def conformance_platform(request):
  from conformance.checks import platforms_present  # pylint: disable=g-import-not-at-top
  platform = request.param
  if platform not in platforms_present():
    pytest.skip(f"platform {platform!r} is not present on this machine "
                "(jax.devices() reports none)")
  return platform


def pytest_collection_modifyitems(items):
  """Records op, family and platform of each test (for the summary table)."""
  for item in items:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
      continue
    op = callspec.params.get("conformance_op")
    family = item.get_closest_marker("conformance_family")
    if op is None or family is None:
      continue
    item.user_properties.append(("conformance_op", op.name))
    item.user_properties.append(("conformance_family", family.args[0]))
    item.user_properties.append(
        ("conformance_platform", callspec.params.get("conformance_platform",
                                                     "cpu")))
