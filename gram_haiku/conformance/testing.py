"""``GramOpTestMixin``: the check families as an ``absltest`` test case.

In the spirit of ``dm_env``'s ``EnvironmentTestMixin``: mix it into a
``absltest.TestCase`` (or ``unittest.TestCase``) and set ``op_spec``::

  class ScaledLinearTest(gram_haiku.conformance.testing.GramOpTestMixin,
                         absltest.TestCase):
    op_spec = scaled_linear.SPEC

Its test methods are made from the check registry
(:mod:`gram_haiku.conformance.families`), one ``test_<check>`` per check,
as the pytest plugin's tests are: a family registered there (yours
included, if registered before the test case class is defined) runs here
too. Every family but those with a runner of their own (``sharded``, which
needs a process of its own: use the pytest plugin; ``properties``) runs on
the default platform; each case is a ``subTest``, and a check none of whose
cases applies to the op fails, except ``frozen``, which is skipped with its
reason (its one check needs an ``apply`` that passes ``plan=`` on and
parameters given to the op as they are).
"""

from __future__ import annotations

from typing import Optional

from gram_haiku.conformance import checks  # Registers the built-in checks.
from gram_haiku.conformance import families
from gram_haiku.conformance.registry import OpSpec

del checks


def _method(check: families.Check):
  def test(self):
    self._run_check(check)  # pylint: disable=protected-access
  test.__name__ = test.__qualname__ = check.test_name
  test.__doc__ = (f"The {check.family!r} family's check {check.name!r}, "
                  "every case a subTest.")
  return test


class GramOpTestMixin:
  """Test methods for one Gram op; subclasses set :attr:`op_spec`."""

  op_spec: Optional[OpSpec] = None

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    _add_check_methods(cls)

  def _spec(self) -> OpSpec:
    if self.op_spec is None:
      raise NotImplementedError(
          f"{type(self).__name__}: set `op_spec` to the OpSpec under test.")
    return self.op_spec

  def _run_check(self, check: families.Check):
    """Runs every case of ``check`` as a subTest; a check none of whose
    cases applies (all raised ``NotApplicable``) fails, or is skipped where
    the check says so (a family that checked nothing must not pass)."""
    spec = self._spec()
    cases = check.cases_for_mixin()
    applied, reasons = 0, []
    for case in cases:
      with self.subTest(case=case.id or check.name):  # pytype: disable=attribute-error
        try:
          applied += 1  # A failure below counts: it checked something.
          check.run(spec, *case.args)
        except families.NotApplicable as e:
          applied -= 1
          reasons.append(str(e))
    if cases and not applied:
      if check.if_none_apply == "skip":
        self.skipTest(f"{check.family} family not applicable: "  # pytype: disable=attribute-error
                      f"{'; '.join(dict.fromkeys(reasons))}")
      raise AssertionError(
          f"{type(self).__name__}: none of the {len(cases)} cases of check "
          f"{check.name!r} applies to op {spec.name!r}, so this family "
          "checked nothing.")


def _add_check_methods(cls) -> None:
  """A ``test_<check>`` method on ``cls`` for every registered check (with
  no runner of its own) it does not define itself."""
  for check in families.op_checks():
    if check.test_name not in vars(cls) and not any(
        check.test_name in vars(base) and base is not GramOpTestMixin
        for base in cls.__mro__[1:]):
      setattr(cls, check.test_name, _method(check))


_add_check_methods(GramOpTestMixin)
