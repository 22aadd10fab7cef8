"""The documented third-party example, checked with the absltest mixin; the
mixin's methods come from the check registry, a third party's family
included."""

from absl.testing import absltest
import pytest

from gram_haiku import conformance
from gram_haiku.conformance import checks
from gram_haiku.conformance import families
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
        def never(spec, case):
          raise checks.NotApplicable(f"{spec.name}: not for {case}")
        self._run_check(families.Check(
            name="nothing", family="nothing", run=never, params=("case",),
            cases=[families.Case("a", ("a",)), families.Case("b", ("b",))]))
    with self.assertRaisesRegex(AssertionError, "checked nothing"):
      AllInapplicable("test_nothing").test_nothing()


def test_the_mixin_has_a_method_per_registered_check():
  names = {c.test_name for c in families.op_checks()}
  assert names <= set(dir(ScaledLinearTest)), names - set(dir(ScaledLinearTest))
  assert {c.family for c in families.checks()} >= {
      "parity", "reference", "vmap", "transforms", "frozen", "bounds",
      "sharded", "properties"}
  assert not hasattr(ScaledLinearTest, "test_sharded_equals_single_device")


def _output_is_finite(spec, scale):
  """A third party's check: the op's output on scaled inputs is finite."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  params, x = checks.make_problem(spec, (checks.B, 2))
  out = spec.apply(params, jnp.zeros((checks.B, checks.B)), x * scale)
  assert bool(jnp.all(jnp.isfinite(out))), f"{spec.name}: not finite"


@pytest.mark.parametrize("scale,fails", [(2.0, False), (float("inf"), True)])
def test_a_third_party_family_runs_in_the_mixin(monkeypatch, scale, fails):
  import unittest  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(families, "_REGISTRY", dict(families._REGISTRY))  # pylint: disable=protected-access
  conformance.register_check(conformance.Check(
      name="output_is_finite", family="finite", run=_output_is_finite,
      params=("scale",), cases=[conformance.Case(f"x{scale}", (scale,))]))

  class WithMyFamily(testing.GramOpTestMixin, unittest.TestCase):
    op_spec = scaled_linear.SPEC

  assert "finite" in families.families()
  result = unittest.TestResult()
  WithMyFamily("test_output_is_finite").run(result)
  assert result.testsRun == 1
  assert (len(result.failures) == 1) == fails, result.failures
  assert not result.errors, result.errors


def test_a_check_record_says_what_is_wrong_with_it():
  with pytest.raises(ValueError, match="identifier"):
    conformance.Check(name="not a name", family="f", run=print)
  with pytest.raises(TypeError, match="run must be a function"):
    conformance.Check(name="no_run", family="f")
  with pytest.raises(TypeError, match="takes a conformance.Check"):
    conformance.register_check("check_me")
  bad = conformance.Check(name="bad", family="f", run=print, params=("a",),
                          cases=[conformance.Case("x", (1, 2))])
  with pytest.raises(ValueError, match="2 arguments for params"):
    bad.cases_for(thorough=False)


def test_example_is_exact():
  checks.check_vmap_depth_invariance(scaled_linear.SPEC, (0, 1), (0, 0),
                                     "outside")


if __name__ == "__main__":
  absltest.main()
