"""Book-keeping: a layer's Gram and reweighted gradient from what it kept.

In a reweighted pass (:func:`gram_haiku.reweighted_grad`) each tracked
layer keeps, through the one backward pass, either its *factors* (every
example's input ``x_i`` and output cotangent ``d_i``: probe mode
``"factors"``) or its flattened *per-example gradients* ``F`` (probe mode
``"per_example"``), whichever
:func:`gram_haiku._src.compute.cost_model.bookkeeping_method` finds smaller. Once
every layer's contribution to the per-example norms (or Gram) is known and
the weights ``c`` are chosen, this module re-contracts:

* factors: ``sum_i c_i g_i = J^T (c * d)``, the layer's own weight VJP at
  its inputs with the output cotangent scaled per example (exact for every
  rule, since a per-example gradient is linear in its output cotangent;
  ``x^T diag(c) d`` for a linear layer);
* per-example gradients: ``c^T F``.

Source: Bu, Mao, Xu, Karypis (2023), "Differentially private optimization
on large model at small cost" (ICML; the "BK" algorithm of fastDP).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute.kernels import KernelConfig
from gram_haiku._src.ops import factors
from gram_haiku._src.ops import modes


def op_params(op, leaves: Sequence[Any], leaf_index: Sequence[Any]) -> list:
  """The op's parameter operands rebuilt from the parameter leaves.

  ``leaf_index[k]`` is the leaf that operand ``k`` is a cast or reshape of
  (the traced program says so; anything else was refused), or None for an
  absent operand.
  """
  out = []
  for aval, k in zip(op.param_avals, leaf_index):
    if aval is None or k is None:
      out.append(None)
    else:
      out.append(jnp.reshape(leaves[k], aval.shape).astype(aval.dtype))
  return out


def from_factors(op, x, g, params, mode: str,
                 upper_bound: bool = False,
                 row_split: Optional[int] = None,
                 column_axes: tuple[str, ...] = ()) -> jax.Array:
  """``[B, B]`` Gram (``mode="gram"``) or ``[B]`` squared norms from the
  factors (:func:`~gram_haiku._src.ops.factors.split_factors` of its
  ``[B, K]`` store) of one application, by the op's own rule. Its cost
  function is told that nothing reuses materialised per-example gradients
  here (the weight gradient is re-contracted anyway). ``upper_bound``:
  squared norms as sound upper bounds (clip factors;
  :mod:`gram_haiku._src.compute.norm_bounds`). ``row_split``: the Gram's
  block ``G[:s, s:]`` across the first ``s`` examples and the others
  (:attr:`~gram_haiku._src.compute.kernels.KernelConfig.row_split`).
  ``column_axes``: under ``shard_map``, the mesh axes the examples are
  split over: the columns are gathered from every device
  (:meth:`~gram_haiku._src.compute.kernels.KernelConfig.columns`), and the
  result is this device's rows."""
  cfg = KernelConfig(memory_budget_bytes=op.plan.memory_budget_bytes,
                     precision=op.plan.precision, upper_bound=upper_bound,
                     row_split=row_split, column_axes=tuple(column_axes))
  return modes.products(op.in_mode(mode), x, g, params, (), cfg,
                        reuse=False)[0]


def materializes_block(op, x, g, params, row_split: int,
                       column_axes: tuple[str, ...] = ()) -> bool:
  """Whether the op's cost function forms the block ``G[:s, s:]`` of these
  factors from materialised per-example gradients (method
  ``"materialize"``, counting their reuse for the update) and every
  example's fit the memory budget at once: then :func:`block_and_row_sums`
  forms it, and the rows' gradient, from them."""
  cfg = KernelConfig(memory_budget_bytes=op.plan.memory_budget_bytes,
                     precision=op.plan.precision, row_split=row_split,
                     column_axes=tuple(column_axes))
  n = cost_model.size_hint(x.shape[op.example_axis.resolved_position()])
  held = cfg.row_count(n) + cfg.column_count(n)  # F_t and (gathered) F_q
  itemsize = jnp.dtype(op.accumulation_dtype()).itemsize
  if held * op.num_params() * itemsize > cfg.memory_budget_bytes:
    return False
  return modes.with_method(op.in_mode("gram"), x, g, params, cfg,
                           reuse=True).method == "materialize"


def block_and_row_sums(op, x, g, params, row_split: int,
                       column_axes: tuple[str, ...] = ()
                       ) -> tuple[jax.Array, dict]:
  """``([s, B - s] block, {k: sum_{i < s} g_i})`` from the factors of one
  application: the per-example gradients of the first ``s`` examples
  ``F_t`` and of the others ``F_q``, each materialised once by the rule
  (``"per_example"`` mode, its fused function where it has one), give the
  block ``F_t F_q^T`` and each trainable operand ``k``'s sum over the first
  ``s`` (the rule's own sum where it formed it, else ``1^T F_t``).

  This is a cross pass's update where its training examples' weights are
  all 1 (:func:`gram_haiku.cross_gram` without clipping): no
  re-contraction of their factors, whose cost equals forming ``F_t``
  again; and the block never slices a ``[B, P]`` array (the factors are
  split, not the per-example gradients). ``column_axes``: under
  ``shard_map``, ``F_q`` is gathered from every device
  (:meth:`~gram_haiku._src.compute.kernels.KernelConfig.columns`) and the
  block is this device's rows. Exact as the rule's per-example gradients
  are; a frozen operand has zero columns and no sum.
  """
  e = op.example_axis.resolved_position()
  n = x.shape[e]
  part = lambda a, lo, hi: jax.lax.slice_in_dim(a, lo, hi, axis=e)
  cfg = KernelConfig(memory_budget_bytes=op.plan.memory_budget_bytes,
                     precision=op.plan.precision)
  per_example = op.in_mode("per_example")
  wanted = [k for k, p in enumerate(params)
            if p is not None and k not in (op.plan.frozen or ())]
  f_t, sums = modes.products(per_example, part(x, 0, row_split),
                             part(g, 0, row_split), params, wanted, cfg)
  f_q = modes.products(per_example, part(x, row_split, n),
                       part(g, row_split, n), params, (), cfg)[0]
  block = kernels.gram_matmul(f_t, f_q, cfg.replace(
      column_axes=tuple(column_axes)))
  missing = [k for k in wanted if k not in sums]
  if missing:
    ones = jnp.ones((f_t.shape[0],), f_t.dtype)
    summed = recontract_per_example(op, f_t, ones)
    sums = {**sums, **{k: summed[k] for k in missing}}
  return block, sums


def query_summed_from_factors(op, x, g, params, row_split: int,
                              axes: tuple[str, ...] = (),
                              sliceable: bool = False) -> jax.Array:
  """``[s]``: ``<g_i, sum_{q >= s} g_q>`` for the first ``s`` examples
  against the sum of the others' per-example gradients, from the factors
  of one application, without their ``s x (B - s)`` block: the summed
  gradient ``H`` is re-contracted (weight 1 on the examples from ``s`` on,
  whose rows alone are kept), then ``<g_i, H> = d_i . (J_i H)``, the
  output cotangent against the forward-mode derivative of the layer at
  example ``i``'s input in the direction ``H``: one JVP of the layer on
  the first ``s`` examples. Exact for every rule (a per-example gradient
  is ``J_i^T d_i``); frozen parameters have no term. ``axes``: under
  ``shard_map``, the mesh axes the examples are split over: ``H`` is
  summed over every device's others (``psum``), the first ``s`` are this
  device's. ``sliceable``: the factors are one application's (not
  slots'), so ``H`` is re-contracted on the others' rows alone. ``H`` is
  formed in the accumulation dtype (float inputs and parameters cast up
  first): it is no parameter's update, and rounded to bfloat16
  parameters it would leave the sums ~1e-3 off where ``total`` is
  float32-exact."""
  e = op.example_axis.resolved_position()
  acc = op.accumulation_dtype()
  n = x.shape[e]
  c = (jnp.arange(n) >= row_split).astype(acc)
  present = [k for k, p in enumerate(params) if p is not None]
  up = lambda a: (a.astype(jnp.promote_types(a.dtype, acc))
                  if a is not None and kernels.is_float(a.dtype) else a)
  h = recontract_factors(op, up(x), g, [up(p) for p in params], c,
                         True,  # (frozen: no term)
                         (row_split, n) if sliceable else None)
  if axes:
    h = {k: sum_over_devices(v, axes, x) for k, v in h.items()}
  xt = jax.lax.slice_in_dim(x, 0, row_split, axis=e)
  gt = jax.lax.slice_in_dim(g, 0, row_split, axis=e).astype(acc)
  if jnp.issubdtype(xt.dtype, jnp.floating):
    xt = xt.astype(jnp.promote_types(xt.dtype, acc))

  def forward(*ps):
    full = list(params)
    for k, p in zip(present, ps):
      full[k] = p
    return op.rule.forward(xt, *full)
  primals = [params[k].astype(acc) for k in present]
  tangents = [h[k].astype(acc) if k in h else jnp.zeros_like(p)
              for k, p in zip(present, primals)]
  y_dot = jax.jvp(forward, primals, tangents)[1].astype(acc)
  others = tuple(a for a in range(gt.ndim) if a != e)
  return jnp.sum(gt * y_dot, axis=others)


def sum_over_devices(v, axes: tuple[str, ...], like) -> jax.Array:
  """``v``, a sum over this device's examples, summed over the devices of
  the mesh ``axes`` once. Inside ``shard_map`` with VMA checking, JAX's
  AD has already summed the cotangent of a replicated parameter (``v`` is
  then invariant over ``axes``); with ``check_vma=False`` nothing is
  typed (``like``, a value of the examples, varies over none of ``axes``)
  and the sum is made here."""
  if not set(axes) & hx.varying_axes(like):
    return jax.lax.psum(v, axes)
  left = tuple(a for a in axes if a in hx.varying_axes(v))
  return jax.lax.psum(v, left) if left else v


def recontract_factors(op, x, g, params, c, mask_inputs: bool,
                       rows: Optional[tuple[int, int]] = None,
                       dtype=None) -> dict:
  """``{k: sum_i c_i g_i}`` for each present parameter operand ``k`` that is
  not frozen (``Plan.frozen``), from the factors ``(x, g)`` of one
  application; ``mask_inputs``: rows with ``c_i = 0`` may hold anything
  (padding), so their inputs are zeroed too (see
  :func:`~gram_haiku._src.ops.factors.reweighted_param_grads`).
  ``rows``: ``(start, stop)``, the only examples whose ``c_i`` may be
  non-zero (a cross pass's training examples, or its queries): the
  re-contraction runs on those rows alone, the others' cost saved (the
  factors of one application: their examples' axis is the op's).
  ``dtype``: the sums' dtype, where wider than the layer's
  (:func:`~gram_haiku._src.ops.factors.reweighted_param_grads`)."""
  if rows is not None:
    e = op.example_axis.resolved_position()
    start, stop = rows
    x = jax.lax.slice_in_dim(x, start, stop, axis=e)
    g = jax.lax.slice_in_dim(g, start, stop, axis=e)
    c = c[start:stop]
  wanted = [k for k, p in enumerate(params)
            if p is not None and k not in (op.plan.frozen or ())]
  return factors.reweighted_param_grads(op, x, g, params, c, wanted,
                                        mask_inputs, dtype)


def recontract_per_example(op, f, c) -> dict:
  """``{k: sum_i c_i g_i}`` for each present parameter operand ``k``, from
  per-example gradients ``f: [..., B, P]`` (the columns of the operands in
  order; leading axes are ``hk.layer_stack``'s, one slice per layer)."""
  acc = f.dtype
  cb = c.astype(acc).reshape((1,) * (f.ndim - 2) + (-1, 1))
  weighted = jnp.sum(jnp.where(cb != 0, f * cb, jnp.zeros((), acc)), axis=-2)
  out, start = {}, 0
  lead = weighted.shape[:-1]
  for k, aval in enumerate(op.param_avals):
    if aval is None:
      continue
    size = math.prod(aval.shape)
    if k not in (op.plan.frozen or ()):  # (a frozen one's are zero)
      out[k] = weighted[..., start:start + size].reshape(lead + aval.shape)
    start += size
  return out


def to_leaf(ct, leaf, dtype=None):
  """A cotangent in a parameter leaf's shape and dtype (``dtype`` where
  given: the sum's, so that a float16 leaf's float32 sum is not rounded
  to float16 first, nor overflows there), summed over the mesh axes the
  leaf is invariant along (``shard_map``: replicated parameters get every
  device's share, as JAX's own AD gives them)."""
  ct = hx.reduce_to_type_of(ct, leaf)
  return jnp.reshape(ct, leaf.shape).astype(
      leaf.dtype if dtype is None else dtype)
