"""The suite must catch deliberately broken ops, in the right family."""

import jax
import jax.numpy as jnp
import pytest

from conformance import checks
from conformance.builtin_ops import _linear_params
from conformance.builtin_ops import _linear_plain
from conformance.registry import normal
from conformance.registry import OpSpec
from gram_haiku import gram_linear


def _spec(apply):
  return OpSpec(name="broken", make_params=_linear_params(True),
                make_example=lambda k, lead, dt: normal(k, lead + (5,), dt),
                apply=apply, plain=_linear_plain)


def test_wrong_gram_fails_invariance():
  # A rule that sums per-position Grams instead of per-example gradients:
  # emulated by calling the op under an inner example_axis it cannot see.
  def apply(p, probe, x):
    out = gram_linear(x, p["w"], p["b"], probe)
    return out * 1.1  # wrong forward -> wrong cotangents -> wrong Gram
  with pytest.raises(AssertionError):
    checks.check_vmap_depth_invariance(_spec(apply), (0,), "none")


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
