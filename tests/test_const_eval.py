"""The host evaluation of constant index computations, against JAX's own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gram_haiku._src.analysis import const_eval

_RNG = np.random.default_rng(0)
_A = _RNG.integers(-6, 6, (3, 4)).astype(np.int32)
_B = _RNG.integers(-6, 6, (3, 4)).astype(np.int32)

_PROGRAMS = {
    "arithmetic": lambda a, b: (a + b) * b - (-a),
    "remainder_division": lambda a, b: (
        jax.lax.rem(a, jax.lax.select_n(b == 0, b, jnp.full_like(b, 3))) +
        jax.lax.div(a, jax.lax.select_n(b == 0, b, jnp.full_like(b, -5)))),
    "min_max": lambda a, b: jnp.maximum(a, b) - jnp.minimum(a, 2),
    "comparisons": lambda a, b: jnp.stack([a < b, a <= b, a > b, a >= b,
                                           a == b, a != b]),
    "logic": lambda a, b: jnp.logical_not((a < 0) & (b > 0) | (a == b)),
    "integer_bits": lambda a, b: (~(a | 3) & b) ^ (a + 7),
    "negative_indices": lambda a, b: jax.lax.select_n(a < 0, a, a + 4),
    "remainder_by_a_literal": lambda a, b: jax.lax.rem(a, 3) - jax.lax.div(b, -2),
    "broadcast": lambda a, b: jnp.broadcast_to(a[:, None, :], (3, 2, 4)),
    "iota": lambda a, b: jnp.arange(4, dtype=jnp.int32)[None] + a,
    "reshape_squeeze": lambda a, b: a.reshape(12, 1).squeeze(1),
    "concatenate": lambda a, b: jnp.concatenate([a, b], axis=1),
    "fortran_order": lambda a, b: a.reshape(4, 3, order="F") + jnp.ravel(
        b, order="F").reshape(4, 3),
    "tile_transpose": lambda a, b: jnp.tile(a, (2, 1)).T + jnp.tile(b.T, 2),
    "convert": lambda a, b: (a > 0).astype(jnp.int32) + b.astype(jnp.int8),
}


@pytest.mark.parametrize("name", sorted(_PROGRAMS))
def test_each_equation_matches_jax(name):
  jaxpr = jax.make_jaxpr(_PROGRAMS[name])(_A, _B).jaxpr
  env = dict(zip(jaxpr.invars, (_A, _B)))
  read = lambda v: (np.asarray(v.val) if isinstance(v, jax.extend.core.Literal)
                    else env[v])
  evaluated = 0
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    want = np.asarray(eqn.primitive.bind(*ins, **eqn.params))
    got = const_eval.evaluate(eqn.primitive.name, eqn.params, ins,
                              eqn.outvars[0].aval.dtype)
    if got is not None:
      evaluated += 1
      assert got.dtype == want.dtype, eqn
      np.testing.assert_array_equal(got, want, err_msg=str(eqn))
    env[eqn.outvars[0]] = want
  assert evaluated == len(jaxpr.eqns), name  # every equation modelled


def test_floats_and_overflow_are_left_to_the_program():
  assert const_eval.evaluate("add", {}, [np.ones(2, np.float32)] * 2,
                             np.float32) is None
  big = np.array([2 ** 40], np.int64)
  assert const_eval.evaluate("convert_element_type", {}, [big],
                             np.int32) is None
  assert const_eval.evaluate("gather", {}, [_A], np.int32) is None
