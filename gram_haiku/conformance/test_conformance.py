"""The conformance families over every registered op (``pytest --pyargs
gram_haiku.conformance``).

One test per check of the registry (:mod:`gram_haiku.conformance.families`:
the built-in families and any a third party registered before collection),
named ``test_<check>`` and parametrised over its cases (the default budget's,
or ``--conformance-thorough``'s), marked with its family (the row of the
summary table). Each test takes the ``conformance_op`` and
``conformance_platform`` fixtures from :mod:`gram_haiku.conformance.plugin`:
ops are the registered :class:`OpSpec` s, platforms those ``jax.devices()``
reports. A case that does not apply to the op (``NotApplicable``) is
skipped, with the reason.
"""

import inspect

import pytest

from gram_haiku.conformance import checks
from gram_haiku.conformance import families
from gram_haiku.conformance import plugin

pytestmark = pytest.mark.conformance


def make_test(check: families.Check):
  """The pytest test of ``check``: ``test_<name>(conformance_op,
  conformance_platform, *params)`` over its cases."""
  def test(conformance_op, conformance_platform, **params):
    with checks.on_platform(conformance_platform):
      try:
        check.run(conformance_op, *[params[n] for n in check.params])
      except families.NotApplicable as e:
        pytest.skip(f"not applicable: {e}")

  test.__name__ = test.__qualname__ = check.test_name
  test.__doc__ = getattr(check.run, "__doc__", None)
  test.__signature__ = inspect.Signature([
      inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD)
      for n in ("conformance_op", "conformance_platform", *check.params)])
  if check.params:
    test = pytest.mark.parametrize(
        ",".join(check.params),
        [pytest.param(*c.args, id=c.id)
         for c in check.cases_for(plugin.thorough())])(test)
  return pytest.mark.conformance_family(check.family)(test)


for _check in families.op_checks():
  globals()[_check.test_name] = make_test(_check)
del _check
