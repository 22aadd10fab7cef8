"""Meta-tests: the suite catches deliberately broken ops, in the right family.

Each broken op is the linear layer's rule (``gram_haiku.ops.linear_rule``)
with one defect in one of its functions, as a third party's rule would
have it, or (for a defect no rule can make: the batching rule) the op
binding it with one defect. The test asserts that the family meant to catch
that defect fails, and that a family the defect does not touch still passes
(so the failure is specific, not noise).
"""

import dataclasses
import unittest

import jax
import jax.numpy as jnp
import pytest

from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute.plan import Plan
from gram_haiku._src.ops import linear as linear_lib
from gram_haiku._src.ops import op as op_lib
from gram_haiku._src.ops.adapter import aval_of
from gram_haiku.conformance import checks
from gram_haiku.conformance import sharded
from gram_haiku.conformance import testing
from gram_haiku.conformance.ops.linear import _linear_params
from gram_haiku.conformance.ops.linear import _linear_plain
from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec
from gram_haiku.ops import gram_linear
from gram_haiku.ops import linear_rule

LINEAR = linear_rule()


def _spec(rule=LINEAR, with_bias=True, apply=None, op_cls=op_lib.RuleOp):
  def default_apply(p, probe, x, example_axis=None, mode="gram", plan=None):
    if plan is None:
      plan = Plan.make(mode=mode, strategy="ghost", example_axis=example_axis)
    params = (p["w"], p.get("b"))
    op = op_cls(aval_of(x), tuple(map(aval_of, params)), aval_of(probe),
                name="broken", plan=plan, rule=rule)
    return op(x, *params, probe)
  return OpSpec(name="broken", make_params=_linear_params(with_bias),
                make_example=lambda k, lead, dt: normal(k, lead + (5,), dt),
                apply=apply or default_apply, plain=_linear_plain)


def _with_fused(fn):
  """The linear rule with ``fn`` as its ``probe_cotangent_and_grads``."""
  return dataclasses.replace(LINEAR, probe_cotangent_and_grads=fn)


def _float32_weight_grad(x, g, params, example_dim, mode, wanted, cfg):
  """Gives the weight's cotangent in float32 whatever the weight's dtype."""
  value, provided = linear_lib.probe_cotangent_and_grads(
      x, g, params, example_dim, mode, wanted, cfg)
  if 0 in wanted and params[0] is not None:
    xm, gm = kernels.linear_factors(x, g, example_dim)
    provided[0] = jnp.einsum("btn,btm->nm", xm.astype(jnp.float32),
                             gm.astype(jnp.float32))
  return value, provided


WRONG_DTYPE = _with_fused(_float32_weight_grad)


class OverBatchedOp(op_lib.RuleOp):
  """Its batching rule returns the output with the mapped axis twice."""

  def batch(self, axis_data, args, dims):
    out, dim = super().batch(axis_data, args, dims)
    return jnp.broadcast_to(out[None], (out.shape[0],) + out.shape), dim


def _broken_gram(broken):
  """The linear rule whose full Gram comes from ``broken(xm, gm, with_bias,
  cfg)`` (norms intact)."""
  def fused(x, g, params, example_dim, mode, wanted, cfg):
    if mode != "gram":
      return linear_lib.probe_cotangent_and_grads(x, g, params, example_dim,
                                                  mode, wanted, cfg)
    xm, gm = kernels.linear_factors(x, g, example_dim)
    return broken(xm, gm, params[1] is not None, cfg), {}
  return _with_fused(fused)


def _per_position_grams(xm, gm, with_bias, cfg):
  """Sums per-position Grams: drops the cross terms of a sequence."""
  total = 0.
  for t in range(xm.shape[1]):
    total = total + kernels.linear_gram(
        xm[:, t:t + 1], gm[:, t:t + 1], with_bias=with_bias,
        method="ghost", cfg=cfg)
  return total


def _phantom_bias_gram(xm, gm, with_bias, cfg):
  """Adds a bias term to the Gram of a layer that has no bias."""
  del with_bias
  return kernels.linear_gram(xm, gm, with_bias=True, method="ghost", cfg=cfg)


NO_CROSS_TERMS = _broken_gram(_per_position_grams)
PHANTOM_BIAS = _broken_gram(_phantom_bias_gram)


def _keeps_frozen_terms(x, g, params, example_dim, mode, wanted, cfg):
  """Declares ``w`` and ``b`` droppable but keeps a dropped (frozen)
  parameter's term: a zero stands in for it, and the per-example gradient
  of ``x @ w + b`` does not depend on the value of ``w`` or ``b``."""
  n, m = x.shape[-1], g.shape[-1]
  w, b = params
  full = (jnp.zeros((n, m), x.dtype) if w is None else w,
          jnp.zeros((m,), g.dtype) if b is None else b)
  return linear_lib.probe_cotangent_and_grads(x, g, full, example_dim, mode,
                                              wanted, cfg)


def _freezes_everything(x, g, params, example_dim, mode, wanted, cfg):
  """Treats one frozen (dropped) parameter as the whole layer frozen: no
  term at all."""
  value, provided = linear_lib.probe_cotangent_and_grads(
      x, g, params, example_dim, mode, wanted, cfg)
  if any(p is None for p in params):
    value = jnp.zeros_like(value)
  return value, provided


def _unbounded_norms(x, g, params, example_dim, mode, wanted, cfg):
  """Ignores ``cfg.upper_bound``: its ghost norms carry no rounding bound,
  so a cancelling example's norm may come out below the truth."""
  return linear_lib.probe_cotangent_and_grads(
      x, g, params, example_dim, mode, wanted, cfg.replace(upper_bound=False))


def _batch_wide_fallback(x, g, params, example_dim, mode, wanted, cfg):
  """Sound norm bounds chosen for the whole batch: where any example's
  ghost bound is loose, every example takes the materialised bound (the
  switch gram_haiku's own kernels made before they chose per example),
  so one example changes the others' bounds and clip factors."""
  value, provided = linear_lib.probe_cotangent_and_grads(
      x, g, params, example_dim, mode, wanted, cfg)
  if mode != "norms" or not cfg.upper_bound or params[0] is None:
    return value, provided
  xm, gm = kernels.linear_factors(x, g, example_dim)
  by = lambda method: kernels.linear_sq_norms(
      xm, gm, with_bias=params[1] is not None, method=method, cfg=cfg)
  _, loose = norm_bounds.ghost(*kernels.ghost_sq_norms(xm, gm, cfg, True))
  return jnp.where(jnp.any(loose), by("materialize"), by("ghost")), provided


KEEPS_FROZEN_TERMS = _with_fused(_keeps_frozen_terms)
FREEZES_EVERYTHING = _with_fused(_freezes_everything)
UNBOUNDED_NORMS = _with_fused(_unbounded_norms)
BATCH_WIDE_FALLBACK = _with_fused(_batch_wide_fallback)


def test_wrong_cotangent_dtype_fails_parity():
  spec = _spec(WRONG_DTYPE)
  with pytest.raises(AssertionError, match="cotangent dtype float32"):
    checks.check_backward_parity(spec, "bfloat16")
  checks.check_vmap_depth_invariance(spec, (0, 0), (0, 0), "none")


def test_over_batched_output_fails_vmap():
  spec = _spec(op_cls=OverBatchedOp)
  with pytest.raises((AssertionError, ValueError, TypeError)):
    checks.check_vmap_depth_invariance(spec, (0,), (0,), "none")
  checks.check_backward_parity(spec, "float32")  # no vmap: not affected


def test_missing_cross_terms_fails_vmap():
  spec = _spec(NO_CROSS_TERMS)
  with pytest.raises(AssertionError, match="reference"):
    checks.check_vmap_depth_invariance(spec, (), (), "none")
  with pytest.raises(AssertionError, match="reference"):
    checks.check_vmap_depth_invariance(spec, (0,), (0,), "outside")
  checks.check_backward_parity(spec, "float32")


def test_phantom_bias_fails_reference():
  spec = _spec(PHANTOM_BIAS, with_bias=False)
  with pytest.raises(AssertionError, match="reference"):
    checks.check_vmap_depth_invariance(spec, (0,), (0,), "none")
  checks.check_backward_parity(spec, "float32")


def test_summing_per_application_grams_fails_sharing():
  # A rule that ignores the per-example protocol for shared weights and
  # writes each application's Gram: the sum of per-application Grams.
  def apply(p, probe, x, example_axis=None, mode="gram"):
    del mode  # The defect: always a Gram.
    return gram_linear(x, p["w"], p["b"], probe, example_axis=example_axis)
  spec = _spec(apply=apply)
  with pytest.raises((AssertionError, ValueError)):
    checks.check_shared_twice(spec)
  with pytest.raises((AssertionError, ValueError)):
    checks.check_scan_shared(spec)
  checks.check_vmap_depth_invariance(spec, (0,), (0,), "none")


@pytest.mark.parametrize("rule", [KEEPS_FROZEN_TERMS, FREEZES_EVERYTHING],
                         ids=["keeps_frozen_terms", "freezes_everything"])
def test_mishandled_frozen_parameter_fails_frozen(rule):
  spec = _spec(rule)
  with pytest.raises(AssertionError, match="frozen"):
    checks.check_frozen(spec)
  checks.check_vmap_depth_invariance(spec, (0,), (0,), "none")


def test_frozen_family_needs_plan_passed_on():
  def apply(p, probe, x, example_axis=None, mode="gram"):
    return gram_linear(x, p["w"], p["b"], probe, example_axis=example_axis,
                       mode=mode)
  spec = _spec(apply=apply)
  with pytest.raises(checks.NotApplicable, match="plan"):
    checks.check_frozen(spec)


def test_mixin_skips_the_frozen_family_that_cannot_apply():

  def apply(p, probe, x, example_axis=None, mode="gram"):  # no plan=
    return gram_linear(x, p["w"], p["b"], probe, example_axis=example_axis,
                       mode=mode)

  class NoPlan(testing.GramOpTestMixin, unittest.TestCase):
    op_spec = _spec(apply=apply)

  class Good(testing.GramOpTestMixin, unittest.TestCase):
    op_spec = _spec()

  class Broken(testing.GramOpTestMixin, unittest.TestCase):
    op_spec = _spec(KEEPS_FROZEN_TERMS)

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
  spec = _spec()
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
  broken = _spec(NO_CROSS_TERMS)
  model = properties.RandomModel(ops=(broken,), batch=3, within=3,
                                 in_axes=(), seed=1)
  with pytest.raises(AssertionError, match="reference"):
    properties.check_random_model(model)
  good = properties.RandomModel(ops=(_spec(),) * 2, batch=3,
                                within=3, in_axes=(0, 0), seed=1)
  properties.check_random_model(good)


def test_norms_without_their_rounding_bound_fail_bounds():
  spec = _spec(UNBOUNDED_NORMS)
  with pytest.raises(AssertionError, match="below the float64 truth"):
    checks.check_norm_bounds(spec, "cancelling", "norms")
  checks.check_norm_bounds(spec, "ordinary", "per_example")
  checks.check_norm_bounds(_spec(), "cancelling", "norms")


def test_a_batch_wide_fallback_fails_bounds():
  """Bounds that are sound but chosen for the whole batch (the others'
  switched with example 0's cancelling inputs) fail the bounds family:
  one example must not change another's clip factor."""
  spec = _spec(BATCH_WIDE_FALLBACK)
  with pytest.raises(AssertionError, match="other examples"):
    checks.check_norm_bounds(spec, "cancelling", "norms")
  checks.check_norm_bounds(spec, "ordinary", "norms")
  checks.check_norm_bounds(_spec(), "cancelling", "per_example")
