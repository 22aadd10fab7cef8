"""``y = x @ w (+ b)``: the linear layer's rule, and its primitive.

The rule (:func:`linear_rule`) is pure functions of arrays: the forward
pass, exactly ``hk.Linear.__call__``; the per-example gradient Gram of ``w``
and ``b`` (or its diagonal, or the per-example gradients) by the ghost or
the materialised method of :mod:`gram_haiku._src.compute.kernels`, whichever
:func:`cost` (:func:`gram_haiku._src.compute.cost_model.linear_method`) says is
cheaper. :func:`gram_linear` binds it as a Gram op
(:func:`gram_haiku._src.ops.op.bind`), which consults the cost once per
application (:mod:`gram_haiku._src.ops.modes`).

Shapes (see :mod:`gram_haiku._src.rules.rule`): ``x: [..., N]``, ``g: [..., M]``
(the output cotangent, same leading axes, example axis at ``example_dim``),
``params = (w, b)`` with ``w: [N, M]`` and ``b: [M]``, either of which may
be None (no bias, or a frozen weight whose term is left out). With ``T``
within-example positions, ``g_i = (sum_t x_it^T d_it, sum_t d_it)``.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute.example_axis import ExampleAxis
from gram_haiku._src.compute.example_axis import ExampleAxisSpec
from gram_haiku._src.compute.kernels import KernelConfig
from gram_haiku._src.compute.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.compute.plan import Plan
from gram_haiku._src.ops import op as op_lib
from gram_haiku._src.rules.rule import Rule


def linear_forward(x, w, b, precision=None):
  """The exact computation of ``hk.Linear.__call__`` (same ops, same order)."""
  out = jnp.dot(x, w, precision=precision)
  if b is not None:
    out = out + jnp.broadcast_to(b, out.shape)
  return out


def _sizes(x, g, example_dim: int):
  """``(B, T, N, M)`` of :func:`kernels.linear_factors`' factors, from the
  shapes alone."""
  lead = tuple(x.shape[:-1])
  others = lead[:example_dim] + lead[example_dim + 1:]
  return lead[example_dim], math.prod(others), x.shape[-1], g.shape[-1]


def cost(x, g, params, example_dim: int, cfg: KernelConfig, *,
         mode: str = "gram", strategy: str = "auto",
         reuse: bool = True) -> str:
  """``"ghost"`` or ``"materialize"``: the cost model's method for these
  shapes (:func:`cost_model.linear_method`; after the pass, without reuse,
  the diagonal by :func:`cost_model.linear_norms_from_factors`)."""
  del params
  b, t, n, m = _sizes(x, g, example_dim)
  acc_bytes = kernels.accumulation_dtype(x.dtype, g.dtype).itemsize
  if not reuse and mode == "norms" and strategy == "auto":
    return cost_model.linear_norms_from_factors(b, t, n, m, acc_bytes,
                                                cfg.memory_budget_bytes)
  return cost_model.linear_method(
      b, t, n, m, acc_bytes, mode=mode, strategy=strategy,
      cols=cfg.column_count(b), budget=cfg.memory_budget_bytes)


def _method(x, g, params, example_dim, cfg: KernelConfig, mode: str) -> str:
  return cfg.method or cost(x, g, params, example_dim, cfg, mode=mode)


def _bias_grads(x, g, example_dim):
  """``(B, M)`` per-example bias gradients (``w`` frozen)."""
  return kernels.linear_factors(x, g, example_dim)[1].sum(axis=1)


def _split_folded(folded, n: int, with_bias: bool):
  """``(dw,)`` or ``(dw, db)`` per example from
  :func:`kernels.per_example_linear_grads`' ``(B, N (+1), M)``."""
  return (folded[:, :n], folded[:, n]) if with_bias else (folded,)


def gram(x, g, params, example_dim: int, cfg: KernelConfig) -> jax.Array:
  """``[B, B]`` Gram of the per-example gradients of ``w`` and ``b``
  (``cfg.method``: ``"ghost"`` or ``"materialize"``; None: :func:`cost`'s);
  ``[b, B]`` rows when ``cfg`` gathers columns. Float32 (float64)."""
  w, b = params
  if w is None:
    db = _bias_grads(x, g, example_dim)
    return kernels.gram_matmul(db, db, cfg)
  xm, dm = kernels.linear_factors(x, g, example_dim)
  return kernels.linear_gram(xm, dm, with_bias=b is not None,
                             method=_method(x, g, params, example_dim, cfg,
                                            "gram"), cfg=cfg)


def sq_norms(x, g, params, example_dim: int, cfg: KernelConfig) -> jax.Array:
  """``[B]`` squared per-example gradient norms (the Gram's diagonal)."""
  w, b = params
  if w is None:
    if cfg.upper_bound:
      return kernels.bias_sq_norm_bounds(
          kernels.linear_factors(x, g, example_dim)[1], cfg.precision)
    return jnp.sum(_bias_grads(x, g, example_dim) ** 2, axis=-1)
  xm, dm = kernels.linear_factors(x, g, example_dim)
  return kernels.linear_sq_norms(xm, dm, with_bias=b is not None,
                                 method=_method(x, g, params, example_dim,
                                                cfg, "norms"), cfg=cfg)


def per_example_grads(x, g, params, example_dim: int):
  """``(dw [B, N, M], db [B, M])`` per example (absent ones left out)."""
  w, b = params
  if w is None:
    return (_bias_grads(x, g, example_dim),)
  xm, dm = kernels.linear_factors(x, g, example_dim)
  with_bias = b is not None
  return _split_folded(kernels.per_example_linear_grads(xm, dm, with_bias),
                       xm.shape[-1], with_bias)


def probe_cotangent_and_grads(x, g, params, example_dim: int, mode: str,
                              wanted, cfg: KernelConfig):
  """The probe's value by ``mode``; materialised per-example gradients
  also give ``dw`` and ``db``.

  When the Gram (or the squared norms) is formed from per-example gradients
  (``"per_example"`` mode, or where the cost model picks materialising) at
  more than one position, their sum over examples is the ordinary weight
  (and bias) gradient: it is returned as such for the indices in
  ``wanted``, and the op does not run the weight's VJP as well.
  """
  w, b = params
  if w is None:  # Frozen: the bias's own, small, per-example gradients.
    if mode == "norms" and cfg.upper_bound:
      return sq_norms(x, g, params, example_dim, cfg), {}
    db = _bias_grads(x, g, example_dim)
    return kernels.probe_value(mode, db, cfg), {}
  with_bias = b is not None
  xm, dm = kernels.linear_factors(x, g, example_dim)
  positions = xm.shape[1]
  method = _method(x, g, params, example_dim, cfg, mode)
  chunked = (mode == "gram" and
             kernels.materialized_chunk(xm, dm, cfg) < dm.shape[-1])
  if method == "ghost" or chunked:
    # (Per-example gradients over the budget: formed by chunks of output
    # features inside the Gram, none of them whole to give dw.)
    fn = (kernels.linear_sq_norms if mode == "norms"
          else kernels.linear_gram)
    return fn(xm, dm, with_bias=with_bias, method=method, cfg=cfg), {}
  folded = kernels.per_example_linear_grads(xm, dm, with_bias,
                                            cfg.precision)
  if mode == "norms" and cfg.upper_bound:
    value = kernels.linear_sq_norm_bounds_of(kernels.rows(folded), xm, dm,
                                             with_bias, cfg.precision)
  else:
    value = kernels.probe_value(mode, kernels.rows(folded), cfg)
  if positions == 1:
    # One position: the per-example gradients are outer products, and
    # JAX's own weight-gradient matmul beats summing them.
    return value, {}
  if not any(i in wanted and p is not None for i, p in enumerate(params)):
    return value, {}
  # One sum of the folded (w, b) gradients, split after: summing each
  # slice of them would copy it first (a B x N x M copy for w).
  summed = _split_folded(kernels.example_sum(folded, cfg.precision)[None],
                         xm.shape[-1], with_bias)
  return value, {i: pe[0].astype(p.dtype)
                 for i, (p, pe) in enumerate(zip(params, summed))
                 if i in wanted and p is not None}


def per_example_error(x, g, params, example_dim: int,
                      cfg: KernelConfig) -> jax.Array:
  """``[B]``: the rounding bound of :func:`per_example_grads` in norm units,
  ``e_T (sum_t |x_t| |d_t| + sum_t |d_t|)`` (each entry sums ``T``
  positions; :func:`gram_haiku._src.compute.norm_bounds.dot_error`)."""
  w, b = params
  xm, dm = kernels.linear_factors(x, g, example_dim)
  tri = jnp.zeros(dm.shape[:1], dm.dtype)
  if w is not None:
    tri = tri + norm_bounds.triangle(xm, dm)
  if b is not None:
    tri = tri + jnp.sum(norm_bounds.row_norms(dm), axis=1)
  return norm_bounds.dot_error(xm.shape[1], dm.dtype, cfg.precision) * tri


def linear_rule(precision: lax.Precision | None = None) -> Rule:
  """``hk.Linear``'s rule: ``x @ w + b`` with ``jnp.dot``'s ``precision``.

  Sharding-aware (gathers columns, row-sharded contractions); ``w`` and
  ``b`` are droppable (a None ``w`` leaves the bias's term, per example
  ``sum_t d_t``; neither gradient reads the other parameter).
  """
  return Rule(forward=functools.partial(linear_forward, precision=precision),
              param_names=("w", "b"), feature_ndim=1, gram=gram,
              sq_norms=sq_norms, per_example_grads=per_example_grads,
              per_example_error=per_example_error,
              probe_cotangent_and_grads=probe_cotangent_and_grads,
              cost=cost, droppable=(0, 1), sharding_aware=True)


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
    plan: a :class:`~gram_haiku._src.compute.plan.Plan` holding the four options
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
  return op_lib.bind(linear_rule(precision), x, (w, b), probe, name=name,
                     plan=plan, example_axis=example_axis, strategy=strategy,
                     mode=mode, memory_budget_bytes=memory_budget_bytes)
