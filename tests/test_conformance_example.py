"""The documented third-party example, checked with the absltest mixin."""

from absl.testing import absltest
import pytest

from gram_haiku.conformance import checks
from gram_haiku.conformance import testing
from gram_haiku.conformance.examples import scaled_linear

pytestmark = pytest.mark.conformance


class ScaledLinearTest(testing.GramOpTestMixin, absltest.TestCase):
  op_spec = scaled_linear.SPEC


class MissingSpecTest(absltest.TestCase):

  def test_mixin_without_spec_says_what_to_do(self):
    class Incomplete(testing.GramOpTestMixin, absltest.TestCase):
      pass
    with self.assertRaisesRegex(NotImplementedError, "set `op_spec`"):
      Incomplete("test_backward_parity").test_backward_parity()


class NothingAppliesTest(absltest.TestCase):

  def test_a_family_that_checks_nothing_fails(self):
    class AllInapplicable(testing.GramOpTestMixin, absltest.TestCase):
      op_spec = scaled_linear.SPEC

      def test_nothing(self):
        def never(case):
          raise checks.NotApplicable(f"not for {case}")
        self._each("case", ["a", "b"], never)
    with self.assertRaisesRegex(AssertionError, "checked nothing"):
      AllInapplicable("test_nothing").test_nothing()


def test_example_is_exact():
  checks.check_vmap_depth_invariance(scaled_linear.SPEC, (0, 1), (0, 0),
                                     "outside")


if __name__ == "__main__":
  absltest.main()
