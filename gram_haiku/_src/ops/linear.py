"""``y = x @ w (+ b)`` as a primitive whose backward pass also emits the Gram.

The forward pass is exactly ``hk.Linear.__call__``. The probe's cotangent is
the per-example gradient Gram of ``w`` and ``b`` (or its diagonal, or the
per-example gradients; see :mod:`gram_haiku._src.ops.base`), computed by the
ghost or the materialised method of :mod:`gram_haiku._src.gram_math`,
whichever a FLOP count says is cheaper.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src import gram_math
from gram_haiku._src.example_axis import ExampleAxis
from gram_haiku._src.ops import base


def linear_forward(x, w, b, precision=None):
  """The exact computation of ``hk.Linear.__call__`` (same ops, same order)."""
  out = jnp.dot(x, w, precision=precision)
  if b is not None:
    out = out + jnp.broadcast_to(b, out.shape)
  return out


class GramLinear(base.GramOp):
  """Primitive for ``x @ w + b``; the probe's cotangent is the Gram of (w, b).

  Inputs: ``x: [..., N]`` (any float dtype), ``w: [N, M]``, ``b: [M]`` or
  None, ``probe`` (``f32[B, B]`` in ``"gram"`` mode; float64 under x64).
  Output: the same array as ``hk.Linear``. Cotangents of ``x``, ``w``, ``b``
  are JAX's own; the probe gets the Gram, accumulated in float32 (float64)
  at ``Precision.HIGHEST`` and cast to the probe's dtype.
  """

  param_names = ("w", "b")
  feature_ndim = 1

  def forward(self, x, w, b):
    return linear_forward(x, w, b, self.precision)

  sharding_aware = True  # gathers columns, row-sharded contractions

  def gram(self, x, g, params, example_dim):
    return gram_math.linear_gram(x, g, example_dim=example_dim,
                                 with_bias=params[1] is not None,
                                 strategy=self.strategy)

  def sq_norms(self, x, g, params, example_dim):
    return gram_math.linear_sq_norms(x, g, example_dim=example_dim,
                                     with_bias=params[1] is not None,
                                     strategy=self.strategy)

  def per_example_grads(self, x, g, params, example_dim):
    acc = self.accumulation_dtype()
    xm = gram_math.to_example_major(x, example_dim).astype(acc)
    dm = gram_math.to_example_major(g, example_dim).astype(acc)
    gw, gb = gram_math.per_example_linear_grads(xm, dm)
    return (gw,) if params[1] is None else (gw, gb)

  def probe_cotangent_and_grads(self, x, g, params, wanted):
    """Materialised per-example gradients also give ``dw`` and ``db``.

    When the Gram (or the squared norms) is formed from per-example
    gradients (``"per_example"`` mode, or where the cost model picks
    materialising) at more than one position, their sum over examples is
    the ordinary weight (and bias) gradient: it is returned as such instead
    of running the weight's VJP as well.
    """
    e = self.example_axis.resolved_position()
    acc = self.accumulation_dtype()
    w, b = params
    lead = self.lead_shape(x.shape)
    size = lead[e]
    positions = max(1, math.prod(lead) // max(size, 1))
    shape = (size, positions, w.shape[0], w.shape[1],
             jnp.dtype(acc).itemsize, self.strategy)
    if self.mode == "norms":
      if gram_math.choose_norms_strategy(*shape) == "ghost":
        return self.sq_norms(x, g, params, e), {}
    elif self.mode == "gram":
      if gram_math.choose_strategy(*shape) == "ghost":
        return self.gram(x, g, params, e), {}
    grads = self.per_example_grads(x, g, params, e)
    f = jnp.concatenate([a.reshape(size, -1) for a in grads], axis=1)
    value = self.probe_value(f)
    if math.prod(lead) == size:
      # One position: the per-example gradients are outer products, and
      # JAX's own weight-gradient matmul beats summing them.
      return value, {}
    provided = {}
    for i, (p, pe) in enumerate(zip(params, grads)):
      if i in wanted and p is not None:
        provided[i] = gram_math.example_sum(pe).astype(p.dtype)
    return value, provided


def gram_linear(x: jax.Array, w: jax.Array, b: Optional[jax.Array],
                probe: jax.Array, *, name: str = "linear",
                example_axis: ExampleAxis | None = None,
                precision: lax.Precision | None = None,
                strategy: str = "auto", mode: str = "gram") -> jax.Array:
  """``x @ w + b`` whose backward pass writes the per-example Gram into ``probe``.

  Args:
    x: ``[..., N]`` input; its leading axes are the example axis and
      within-example axes (see ``example_axis``).
    w: ``[N, M]`` weight.
    b: ``[M]`` bias, or None.
    probe: zeros: ``[B, B]`` for ``mode="gram"``, ``[B]`` for ``"norms"``,
      ``[B, P]`` for ``"per_example"`` (``P = N*M (+ M)``); float32, or
      float64 under x64. ``B`` is the size of the example axis as seen by
      the differentiated function.
    name: module name used in error messages.
    example_axis: which axis is the example axis; default: outermost vmap,
      else axis 0 of ``x``.
    precision: passed to ``jnp.dot`` as in ``hk.Linear``.
    strategy: ``"auto"``, ``"ghost"`` or ``"materialize"``.
    mode: ``"gram"``, ``"norms"`` or ``"per_example"``.

  Returns:
    ``[..., M]``, exactly ``hk.Linear``'s output. The cotangent of ``probe`` is
    ``G[i, j] = <g_i, g_j>`` over ``w`` and ``b`` (``"gram"``), its diagonal
    (``"norms"``) or the flattened ``g_i`` (``"per_example"``).

  Raises:
    ValueError: at differentiation time when ``probe`` has the wrong shape,
      or under ``vmap`` when ``probe`` is batched.
    NotImplementedError: under ``vmap`` when ``w`` or ``b`` is batched.
  """
  if example_axis is None:
    example_axis = ExampleAxis.from_spec(None)
  gram_math.choose_strategy(1, 1, 1, 1, 4, strategy)  # validates `strategy`
  base.check_mode(mode)
  prim = GramLinear(base.aval_of(x), (base.aval_of(w), base.aval_of(b)),
                    base.aval_of(probe), example_axis=example_axis,
                    precision=precision, name=name, strategy=strategy,
                    mode=mode)
  return prim(x, w, b, probe)
