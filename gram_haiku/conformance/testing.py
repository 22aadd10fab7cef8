"""``GramOpTestMixin``: the check families as an ``absltest`` test case.

In the spirit of ``dm_env``'s ``EnvironmentTestMixin``: mix it into a
``absltest.TestCase`` (or ``unittest.TestCase``) and set ``op_spec``::

  class ScaledLinearTest(gram_haiku.conformance.testing.GramOpTestMixin,
                         absltest.TestCase):
    op_spec = scaled_linear.SPEC

Every family but ``sharded`` (which needs a process of its own: use the
pytest plugin) runs on the default platform; each case is a ``subTest``, and
a family none of whose cases applies to the op fails, except ``frozen``,
which is skipped with its reason (its one check needs an ``apply`` that
passes ``plan=`` on and parameters given to the op as they are).
"""

from __future__ import annotations

from typing import Optional

from gram_haiku.conformance import checks
from gram_haiku.conformance.registry import OpSpec


class GramOpTestMixin:
  """Test methods for one Gram op; subclasses set :attr:`op_spec`."""

  op_spec: Optional[OpSpec] = None

  def _spec(self) -> OpSpec:
    if self.op_spec is None:
      raise NotImplementedError(
          f"{type(self).__name__}: set `op_spec` to the OpSpec under test.")
    return self.op_spec

  def _each(self, label, cases, run):
    """Runs every case as a subTest; fails if none of them applies (a family
    that checked nothing must not pass)."""
    applied = 0
    cases = list(cases)
    for case in cases:
      with self.subTest(**{label: case}):  # pytype: disable=attribute-error
        try:
          applied += 1  # A failure below counts: it checked something.
          run(case)
        except checks.NotApplicable:
          applied -= 1
    if cases and not applied:
      raise AssertionError(
          f"{type(self).__name__}: none of the {len(cases)} cases "
          f"({label}s) applies to op {self._spec().name!r}, so this family "
          "checked nothing.")

  def test_reference_equality(self):
    cases = [(c, v) for c in checks.REFERENCE_CASES for v in (False, True)]
    self._each("case", cases, lambda c: checks.check_reference_equality(
        self._spec(), c[0], c[1]))

  def test_backward_parity(self):
    self._each("dtype", list(checks.DTYPE_CASES),
               lambda c: checks.check_backward_parity(self._spec(), c))

  def test_vmap_depth_invariance(self):
    layouts = [(i, o) for ls in checks.VMAP_LAYOUTS.values() for i, o in ls]
    self._each("layout", layouts, lambda l: checks.check_vmap_depth_invariance(
        self._spec(), l[0], l[1], "outside"))

  def test_example_axis_selection(self):
    self._each("case", checks.EXAMPLE_AXIS_CASES,
               lambda c: checks.check_example_axis_selection(self._spec(), c))

  def test_checkpoint(self):
    self._each("policy", list(checks.CHECKPOINT_POLICIES),
               lambda p: checks.check_checkpoint(self._spec(), p, True))

  def test_transforms(self):
    self._each("check", list(checks.TRANSFORM_CHECKS),
               lambda c: checks.TRANSFORM_CHECKS[c](self._spec()))

  def test_norm_bounds(self):
    cases = [(c, m) for c in checks.BOUND_CASES
             for m in ("norms", "per_example")]

    def one(cm):
      try:
        checks.check_norm_bounds(self._spec(), *cm)
      except checks.NotApplicable:
        pass  # (an integer input cannot be offset; the other cases ran)
    self._each("case", cases, one)

  def test_frozen(self):
    # Skipped (with the reason), not failed, when the family cannot apply:
    # an ``apply`` without ``plan=``, or parameters reshaped before the op.
    try:
      checks.check_frozen(self._spec())
    except checks.NotApplicable as e:
      self.skipTest(f"frozen family not applicable: {e}")  # pytype: disable=attribute-error
