"""Meta-tests: the suite catches deliberately broken ops, in the right family.

Each broken op is ``GramLinear`` with one defect. The test asserts that the
family meant to catch that defect fails, and that a family the defect does
not touch still passes (so the failure is specific, not noise).
"""

import unittest

import jax
import jax.numpy as jnp
import pytest

from gram_haiku.conformance import checks
from gram_haiku.conformance import sharded
from gram_haiku.conformance import testing
from gram_haiku.conformance.ops.linear import _linear_params
from gram_haiku.conformance.ops.linear import _linear_plain
from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec
from gram_haiku import gram_linear
from gram_haiku._src import kernels
from gram_haiku._src.ops.linear import GramLinear


def _spec(op_cls, with_bias=True, apply=None):
  def default_apply(p, probe, x, example_axis=None, mode="gram", plan=None):
    return op_cls.apply(x, (p["w"], p.get("b")), probe, name="broken",
                        example_axis=example_axis, strategy="ghost",
                        mode=mode, precision=None, plan=plan)
  return OpSpec(name="broken", make_params=_linear_params(with_bias),
                make_example=lambda k, lead, dt: normal(k, lead + (5,), dt),
                apply=apply or default_apply, plain=_linear_plain)


def _upcast(acc):
  """Makes accumulator ``acc`` receive float32 cotangents."""
  accum = acc.accum
  acc.accum = lambda ct: accum(ct.astype(jnp.float32))
  return acc


class WrongDtypeLinear(GramLinear):
  """Returns the weight cotangent in float32 whatever the weight's dtype."""

  def vjp_bwd(self, res, g, x_acc, w_acc, b_acc, probe_acc):
    super().vjp_bwd(res, g, x_acc, _upcast(w_acc), b_acc, probe_acc)


class OverBatchedLinear(GramLinear):
  """Its batching rule returns the output with the mapped axis twice."""

  def batch(self, axis_data, args, dims):
    out, dim = super().batch(axis_data, args, dims)
    return jnp.broadcast_to(out[None], (out.shape[0],) + out.shape), dim


class _BrokenGramLinear(GramLinear):
  """A linear op whose full Gram comes from ``broken_gram`` (norms intact)."""

  def probe_cotangent_and_grads(self, x, g, params, wanted, cfg):
    if self.mode != "gram":
      return super().probe_cotangent_and_grads(x, g, params, wanted, cfg)
    xm, gm = kernels.linear_factors(x, g,
                                    self.example_axis.resolved_position())
    return self.broken_gram(xm, gm, params[1] is not None, cfg), {}


class NoCrossTermsLinear(_BrokenGramLinear):
  """Sums per-position Grams: drops the cross terms of a sequence."""

  def broken_gram(self, xm, gm, with_bias, cfg):
    total = 0.
    for t in range(xm.shape[1]):
      total = total + kernels.linear_gram(
          xm[:, t:t + 1], gm[:, t:t + 1], with_bias=with_bias,
          method="ghost", cfg=cfg)
    return total


class PhantomBiasLinear(_BrokenGramLinear):
  """Adds a bias term to the Gram of a layer that has no bias."""

  def broken_gram(self, xm, gm, with_bias, cfg):
    del with_bias
    return kernels.linear_gram(xm, gm, with_bias=True, method="ghost",
                               cfg=cfg)


class KeepsFrozenTermsLinear(GramLinear):
  """Declares ``w`` and ``b`` droppable but keeps a dropped (frozen)
  parameter's term: a zero stands in for it, and the per-example gradient
  of ``x @ w + b`` does not depend on the value of ``w`` or ``b``."""

  def probe_cotangent_and_grads(self, x, g, params, wanted, cfg):
    full = [jnp.zeros(a.shape, a.dtype) if p is None else p
            for p, a in zip(params, self.param_avals)]
    return super().probe_cotangent_and_grads(x, g, full, wanted, cfg)


class FreezesEverythingLinear(GramLinear):
  """Treats one frozen parameter as the whole layer frozen: no term at all."""

  def probe_cotangent_and_grads(self, x, g, params, wanted, cfg):
    value, provided = super().probe_cotangent_and_grads(x, g, params, wanted,
                                                        cfg)
    if self.plan.frozen:
      value = jnp.zeros_like(value)
    return value, provided


class UnboundedNormsLinear(GramLinear):
  """Ignores ``cfg.upper_bound``: its ghost norms carry no rounding bound,
  so a cancelling example's norm may come out below the truth."""

  def probe_cotangent_and_grads(self, x, g, params, wanted, cfg):
    return super().probe_cotangent_and_grads(
        x, g, params, wanted, cfg.replace(upper_bound=False))


def test_wrong_cotangent_dtype_fails_parity():
  spec = _spec(WrongDtypeLinear)
  with pytest.raises(AssertionError, match="cotangent dtype float32"):
    checks.check_backward_parity(spec, "bfloat16")
  checks.check_vmap_depth_invariance(spec, (0, 0), (0, 0), "none")


def test_over_batched_output_fails_vmap():
  spec = _spec(OverBatchedLinear)
  with pytest.raises((AssertionError, ValueError, TypeError)):
    checks.check_vmap_depth_invariance(spec, (0,), (0,), "none")
  checks.check_backward_parity(spec, "float32")  # no vmap: not affected


def test_missing_cross_terms_fails_vmap():
  spec = _spec(NoCrossTermsLinear)
  with pytest.raises(AssertionError, match="reference"):
    checks.check_vmap_depth_invariance(spec, (), (), "none")
  with pytest.raises(AssertionError, match="reference"):
    checks.check_vmap_depth_invariance(spec, (0,), (0,), "outside")
  checks.check_backward_parity(spec, "float32")


def test_phantom_bias_fails_reference():
  spec = _spec(PhantomBiasLinear, with_bias=False)
  with pytest.raises(AssertionError, match="reference"):
    checks.check_vmap_depth_invariance(spec, (0,), (0,), "none")
  checks.check_backward_parity(spec, "float32")


def test_summing_per_application_grams_fails_sharing():
  # A rule that ignores the per-example protocol for shared weights and
  # writes each application's Gram: the sum of per-application Grams.
  def apply(p, probe, x, example_axis=None, mode="gram"):
    del mode  # The defect: always a Gram.
    return gram_linear(x, p["w"], p["b"], probe, example_axis=example_axis)
  spec = _spec(GramLinear, apply=apply)
  with pytest.raises((AssertionError, ValueError)):
    checks.check_shared_twice(spec)
  with pytest.raises((AssertionError, ValueError)):
    checks.check_scan_shared(spec)
  checks.check_vmap_depth_invariance(spec, (0,), (0,), "none")


@pytest.mark.parametrize("op_cls", [KeepsFrozenTermsLinear,
                                    FreezesEverythingLinear])
def test_mishandled_frozen_parameter_fails_frozen(op_cls):
  spec = _spec(op_cls)
  with pytest.raises(AssertionError, match="frozen"):
    checks.check_frozen(spec)
  checks.check_vmap_depth_invariance(spec, (0,), (0,), "none")


def test_frozen_family_needs_plan_passed_on():
  def apply(p, probe, x, example_axis=None, mode="gram"):
    return gram_linear(x, p["w"], p["b"], probe, example_axis=example_axis,
                       mode=mode)
  spec = _spec(GramLinear, apply=apply)
  with pytest.raises(checks.NotApplicable, match="plan"):
    checks.check_frozen(spec)


def test_mixin_skips_the_frozen_family_that_cannot_apply():

  def apply(p, probe, x, example_axis=None, mode="gram"):  # no plan=
    return gram_linear(x, p["w"], p["b"], probe, example_axis=example_axis,
                       mode=mode)

  class NoPlan(testing.GramOpTestMixin, unittest.TestCase):
    op_spec = _spec(GramLinear, apply=apply)

  class Good(testing.GramOpTestMixin, unittest.TestCase):
    op_spec = _spec(GramLinear)

  class Broken(testing.GramOpTestMixin, unittest.TestCase):
    op_spec = _spec(KeepsFrozenTermsLinear)

  outcomes = {}
  for case in (NoPlan, Good, Broken):
    result = unittest.TestResult()
    case("test_frozen").run(result)
    outcomes[case.__name__] = (len(result.skipped), len(result.failures),
                               len(result.errors))
  assert outcomes == {"NoPlan": (1, 0, 0), "Good": (0, 0, 0),
                      "Broken": (0, 1, 0)}, outcomes


def test_sharded_cases_parse_op_names_with_colons():
  assert sharded.parse_cases("ns:linear:jit_auto,conv2d:shard_map,") == {
      ("ns:linear", "jit_auto"), ("conv2d", "shard_map")}
  assert sharded.parse_cases("") == set()


def test_good_op_passes_every_family():
  spec = _spec(GramLinear)
  for case in ("float32", "bfloat16", "mixed"):
    checks.check_backward_parity(spec, case)
  for ins, outs in checks.VMAP_LAYOUTS[2]:
    checks.check_vmap_depth_invariance(spec, ins, outs, "outside")
  for case in checks.EXAMPLE_AXIS_CASES:
    checks.check_example_axis_selection(spec, case)
  for check in checks.TRANSFORM_CHECKS.values():
    check(spec)
  checks.check_frozen(spec)
  assert jax.devices()


def test_property_search_catches_missing_cross_terms():
  from gram_haiku.conformance import properties  # pylint: disable=g-import-not-at-top
  broken = _spec(NoCrossTermsLinear)
  model = properties.RandomModel(ops=(broken,), batch=3, within=3,
                                 in_axes=(), seed=1)
  with pytest.raises(AssertionError, match="reference"):
    properties.check_random_model(model)
  good = properties.RandomModel(ops=(_spec(GramLinear),) * 2, batch=3,
                                within=3, in_axes=(0, 0), seed=1)
  properties.check_random_model(good)


def test_norms_without_their_rounding_bound_fail_bounds():
  spec = _spec(UnboundedNormsLinear)
  with pytest.raises(AssertionError, match="below the float64 truth"):
    checks.check_norm_bounds(spec, "cancelling", "norms")
  checks.check_norm_bounds(spec, "ordinary", "per_example")
  checks.check_norm_bounds(_spec(GramLinear), "cancelling", "norms")
