"""pytest plugin: ``--conformance-ops`` selects ops; fixtures for custom ops.

Registered as the ``gram_haiku_conformance`` pytest11 entry point.
"""

import os


def pytest_addoption(parser):
  group = parser.getgroup("conformance")
  group.addoption("--conformance-ops", default=os.environ.get(
      "CONFORMANCE_OPS", ""), help="comma-separated op names to check "
      "(default: all registered; env CONFORMANCE_OPS)")


def selected_ops(config):
  from conformance.registry import registered_ops  # pylint: disable=g-import-not-at-top
  names = [n for n in config.getoption("--conformance-ops").split(",") if n]
  ops = registered_ops()
  return [op for op in ops if not names or op.name in names]


def pytest_generate_tests(metafunc):
  if "conformance_op" in metafunc.fixturenames:
    ops = selected_ops(metafunc.config)
    metafunc.parametrize("conformance_op", ops, ids=[op.name for op in ops])
