"""A layer's book-keeping factors: each example's input and output cotangent.

In the ``"factors"`` probe mode a layer writes, per example, its input ``x_i``
and its output cotangent ``d_i`` (flattened, one row ``[K]`` per example)
instead of a Gram. After the pass :mod:`gram_haiku._src.passes.bookkeeping` opens
the rows again (:func:`split_factors`) and forms the Gram, the norms and any
reweighted gradient ``sum_i c_i g_i`` from them by the layer's own rule
(:func:`reweighted_param_grads`), with no second backward pass.

These are functions of an op (a bound :class:`gram_haiku.Rule`) and
arrays; no rule overrides them.

Source: Bu, Mao, Xu, Karypis (2023), "Differentially private optimization
on large model at small cost" (ICML; the "BK" algorithm of fastDP).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gram_haiku._src.compute import kernels


def factor_width(op) -> int:
  """``K``: entries per example of the op's input plus its output cotangent."""
  total = math.prod(op.x_aval.shape) + math.prod(op.out_aval.shape)
  return total // max(op.example_size(), 1)


def factor_matrix(op, x, g) -> jax.Array:
  """``[B, K]``: per example, the flattened input ``x`` then output cotangent
  ``g``, in the op's accumulation dtype (the ``"factors"`` mode's
  cotangent)."""
  e = op.example_axis.resolved_position()
  acc = op.accumulation_dtype()
  xm = jnp.moveaxis(x, e, 0)
  gm = jnp.moveaxis(g, e, 0)
  return jnp.concatenate([kernels.rows(xm).astype(acc),
                          kernels.rows(gm).astype(acc)], axis=1)


def split_factors(op, f):
  """Inverse of :func:`factor_matrix`: ``(x, g)`` in the op's layout (``x``
  in its own dtype, ``g`` in the accumulation dtype) from ``f: [B, K]``."""
  e = op.example_axis.resolved_position()
  xs = list(op.x_aval.shape)
  gs = list(op.out_aval.shape)
  b = xs[e]
  moved = lambda s: [s[e]] + s[:e] + s[e + 1:]
  n = math.prod(xs) // max(b, 1)
  x = f[:, :n].reshape(moved(xs)).astype(op.x_aval.dtype)
  g = f[:, n:].reshape(moved(gs))
  return jnp.moveaxis(x, 0, e), jnp.moveaxis(g, 0, e)


def scale_examples(a, c, example_dim: int):
  """``c_i a_i`` along axis ``example_dim`` of ``a``; rows with ``c_i == 0``
  are exact zeros (also where ``a_i`` is not finite)."""
  shape = [1] * a.ndim
  shape[example_dim] = a.shape[example_dim]
  c = c.reshape(shape)
  return jnp.where(c != 0, a * c.astype(a.dtype), jnp.zeros((), a.dtype))


def reweighted_param_grads(op, x, g, params, c, wanted,
                           mask_inputs: bool = True, dtype=None) -> dict:
  """``{i: sum_e c_e g_e}`` for the parameters ``params[i]``, ``i`` in
  ``wanted``: the layer's own weight VJP with its output cotangent scaled
  per example (exact for every rule: a per-example gradient is linear in
  the example's output cotangent; ``x^T diag(c) d`` for a linear layer).

  Rows with ``c_e == 0`` have their output cotangent zeroed, even where it
  is not finite. ``mask_inputs``: zero those rows of the input too (a
  padded row may hold anything, even NaN, and ``NaN * 0`` is NaN), at the
  cost of a masked copy of ``x``; without padding every row is a real
  example, whose input is what ``jax.grad`` would see as well.
  ``dtype``: the sums' dtype where wider than the layer's (a float16
  layer's clipped sum asked for in float32): the VJP then runs on ``x``
  and the parameters cast up to it, so that the sum over the examples is
  neither rounded to the layer's dtype nor overflows there.
  """
  e = op.example_axis.resolved_position()
  gs = scale_examples(g.astype(op.accumulation_dtype()), c, e)
  if mask_inputs and kernels.is_float(x.dtype):
    x = scale_examples(x, (c != 0).astype(x.dtype), e)
  if dtype is not None:
    up = lambda a: (a.astype(jnp.promote_types(a.dtype, dtype))
                    if a is not None and kernels.is_float(a.dtype) else a)
    x, params = up(x), [up(p) for p in params]
  cts = op.forward_vjp(x, params, gs, False, list(wanted))
  return dict(zip(wanted, cts))
