"""``y = x @ w (+ b)`` as a primitive whose backward pass also emits the Gram.

The forward pass is exactly ``hk.Linear.__call__``. The probe's cotangent is
the per-example gradient Gram of ``w`` and ``b`` (or its diagonal, or the
per-example gradients; see :mod:`gram_haiku._src.ops.base`), computed by the
ghost or the materialised method of :mod:`gram_haiku._src.kernels`,
whichever :func:`gram_haiku._src.cost_model.linear_method` says is cheaper
(consulted once per application).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src import cost_model
from gram_haiku._src import kernels
from gram_haiku._src.example_axis import ExampleAxis
from gram_haiku._src.example_axis import ExampleAxisSpec
from gram_haiku._src.kernels import KernelConfig
from gram_haiku._src.ops import base
from gram_haiku._src.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.plan import Plan


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

  def forward(self, x, w, b):
    return linear_forward(x, w, b, self.precision)

  sharding_aware = True  # gathers columns, row-sharded contractions

  def _factors(self, x, g, example_dim):
    """``(B, T, N)`` inputs and ``(B, T, M)`` cotangents, accumulation dtype."""
    return kernels.linear_factors(x, g, example_dim)

  def method(self, xm, dm, cfg: KernelConfig) -> str:
    """The cost model's method for these factors (one consultation)."""
    b, t, n = xm.shape
    return cost_model.linear_method(
        b, t, n, dm.shape[-1], jnp.dtype(xm.dtype).itemsize, mode=self.mode,
        strategy=self.strategy, cols=cfg.column_count(b),
        budget=cfg.memory_budget_bytes)

  def from_factors_strategy(self, mode, x, g):
    if mode != "norms" or self.strategy != "auto":
      return self.strategy
    xm, dm = self._factors(x, g, self.example_axis.resolved_position())
    b, t, n = xm.shape
    return cost_model.linear_norms_from_factors(
        b, t, n, dm.shape[-1], jnp.dtype(xm.dtype).itemsize,
        self.plan.memory_budget_bytes)

  # A None ``w`` (frozen, see GramOp.droppable) leaves the bias's term:
  # per example ``sum_t d_t``. Neither gradient reads the other parameter.
  droppable = (0, 1)

  def _bias_grads(self, x, g, example_dim):
    """``(B, M)`` per-example bias gradients (``w`` frozen)."""
    return self._factors(x, g, example_dim)[1].sum(axis=1)

  def gram(self, x, g, params, example_dim, cfg):
    if params[0] is None:
      db = self._bias_grads(x, g, example_dim)
      return kernels.gram_matmul(db, db, cfg)
    xm, dm = self._factors(x, g, example_dim)
    return kernels.linear_gram(xm, dm, with_bias=params[1] is not None,
                               method=self.method(xm, dm, cfg), cfg=cfg)

  def sq_norms(self, x, g, params, example_dim, cfg):
    if params[0] is None:
      return jnp.sum(self._bias_grads(x, g, example_dim) ** 2, axis=-1)
    xm, dm = self._factors(x, g, example_dim)
    return kernels.linear_sq_norms(xm, dm, with_bias=params[1] is not None,
                                   method=self.method(xm, dm, cfg), cfg=cfg)

  def per_example_grads(self, x, g, params, example_dim):
    if params[0] is None:
      return (self._bias_grads(x, g, example_dim),)
    xm, dm = self._factors(x, g, example_dim)
    with_bias = params[1] is not None
    return _split_folded(kernels.per_example_linear_grads(xm, dm, with_bias),
                         xm.shape[-1], with_bias)

  def probe_cotangent_and_grads(self, x, g, params, wanted, cfg):
    """Materialised per-example gradients also give ``dw`` and ``db``.

    When the Gram (or the squared norms) is formed from per-example
    gradients (``"per_example"`` mode, or where the cost model picks
    materialising) at more than one position, their sum over examples is
    the ordinary weight (and bias) gradient: it is returned as such instead
    of running the weight's VJP as well.
    """
    w, b = params
    if w is None:  # Frozen: the bias's own, small, per-example gradients.
      db = self._bias_grads(x, g, self.example_axis.resolved_position())
      return kernels.probe_value(self.mode, db, cfg), {}
    with_bias = b is not None
    xm, dm = self._factors(x, g, self.example_axis.resolved_position())
    size, positions = xm.shape[:2]
    method = self.method(xm, dm, cfg)
    if method == "ghost":
      fn = (kernels.linear_sq_norms if self.mode == "norms"
            else kernels.linear_gram)
      return fn(xm, dm, with_bias=with_bias, method=method, cfg=cfg), {}
    folded = kernels.per_example_linear_grads(xm, dm, with_bias)
    grads = _split_folded(folded, xm.shape[-1], with_bias)
    value = kernels.probe_value(self.mode, kernels.rows(folded), cfg)
    if positions == 1:
      # One position: the per-example gradients are outer products, and
      # JAX's own weight-gradient matmul beats summing them.
      return value, {}
    provided = {}
    for i, (p, pe) in enumerate(zip(params, grads)):
      if i in wanted and p is not None:
        provided[i] = kernels.example_sum(pe).astype(p.dtype)
    return value, provided


def _split_folded(folded, n: int, with_bias: bool):
  """``(dw,)`` or ``(dw, db)`` per example from
  :func:`kernels.per_example_linear_grads`' ``(B, N (+1), M)``."""
  return (folded[:, :n], folded[:, n]) if with_bias else (folded,)


def gram_linear(x: jax.Array, w: jax.Array, b: Optional[jax.Array],
                probe: jax.Array, *, name: str = "linear",
                example_axis: ExampleAxisSpec | ExampleAxis = None,
                precision: lax.Precision | None = None,
                strategy: str = "auto", mode: str = "gram",
                memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
                plan: Optional[Plan] = None) -> jax.Array:
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
    example_axis: which axis is the example axis: ``None`` (default:
      outermost vmap, else axis 0 of ``x``), ``0`` (``x``'s own axis 0;
      every vmap is then within-example) or a vmap ``axis_name``.
    precision: passed to ``jnp.dot`` as in ``hk.Linear``.
    strategy: ``"auto"``, ``"ghost"`` or ``"materialize"``.
    mode: ``"gram"``, ``"norms"`` or ``"per_example"``.
    memory_budget_bytes: the largest intermediate (bytes) a Gram kernel
      builds at once; larger Grams are computed in blocks.
    plan: a :class:`~gram_haiku._src.plan.Plan` holding the four options
      above (``track()`` passes one); when given, they are ignored.

  Returns:
    ``[..., M]``, exactly ``hk.Linear``'s output. The cotangent of ``probe`` is
    ``G[i, j] = <g_i, g_j>`` over ``w`` and ``b`` (``"gram"``), its diagonal
    (``"norms"``) or the flattened ``g_i`` (``"per_example"``).

  Raises:
    ValueError: for a bad option; at differentiation time when ``probe``
      has the wrong shape, or under ``vmap`` when ``probe`` is batched.
    NotImplementedError: under ``vmap`` when ``w`` or ``b`` is batched.
  """
  return GramLinear.apply(x, (w, b), probe, name=name, plan=plan,
                          example_axis=example_axis, strategy=strategy,
                          mode=mode, memory_budget_bytes=memory_budget_bytes,
                          precision=precision)
