"""The suite must catch deliberately broken ops, in the right family."""

import jax
import jax.numpy as jnp
import pytest

from conformance import checks
from conformance.ops.linear import _linear_params
from conformance.ops.linear import _linear_plain
from conformance.registry import normal
from conformance.registry import OpSpec
from gram_haiku import gram_linear


def _spec(apply):
  return OpSpec(name="broken", make_params=_linear_params(True),
                make_example=lambda k, lead, dt: normal(k, lead + (5,), dt),
                apply=apply, plain=_linear_plain)


def test_wrong_gram_fails_invariance():
  # The classic per-example-gradient bug: one Gram per position, summed
  # (sum_t G_t) instead of the Gram of the summed per-example gradient. The
  # forward values and parameter gradients are right; only the Gram is wrong.
  def apply(p, probe, x):  # x: (B, T, N), explicitly batched
    outs = [gram_linear(x[:, t], p["w"], p["b"], probe)
            for t in range(x.shape[1])]
    return jnp.stack(outs, axis=1)
  spec = _spec(apply)
  with pytest.raises(AssertionError):
    checks.check_vmap_depth_invariance(spec, (), "none")


def test_wrong_cotangent_dtype_fails_parity():
  @jax.custom_vjp
  def bad_linear(x, w, b):
    return x @ w + b
  def fwd(x, w, b):
    return x @ w + b, (x, w)
  def bwd(res, g):
    x, w = res
    g32 = g.astype(jnp.float32)
    return (g32 @ w.T.astype(jnp.float32)), x.T.astype(jnp.float32) @ g32, \
        g32.sum(0)
  bad_linear.defvjp(fwd, bwd)
  def apply(p, probe, x):
    del probe
    return bad_linear(x, p["w"], p["b"])
  with pytest.raises((AssertionError, TypeError, ValueError)):
    checks.check_backward_parity(_spec(apply), jnp.bfloat16)


def test_good_op_passes():
  spec = _spec(lambda p, probe, x: gram_linear(x, p["w"], p["b"], probe))
  checks.check_backward_parity(spec, jnp.float32)
  checks.check_vmap_depth_invariance(spec, (0, 0), "outside")
