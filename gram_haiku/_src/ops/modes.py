"""The probe modes every rule gets: what the backward pass writes, by mode.

A rule (:class:`gram_haiku.GramOp`) says how to compute one layer's Gram,
squared norms and per-example gradients (``gram``, ``sq_norms``,
``per_example_grads``, ``probe_cotangent_and_grads``). This module is the
one place that turns the op's plan (:class:`~gram_haiku._src.plan.Plan`)
into calls of those hooks, for every rule alike:

* ``"gram"``, ``"norms"``, ``"per_example"``: the rule's own products, of
  its trainable parameters only (:func:`products`: a parameter in
  ``Plan.frozen`` has no term);
* ``"factors"``: the layer's input and output cotangent per example
  (:mod:`gram_haiku._src.ops.factors`), for book-keeping after the pass;
* ``"clip"``: the squared norms, while the parameters get the clipped sum
  ``sum_i m_i c_i g_i`` (per-layer clipping inside the backward rule).

The adapter (:mod:`gram_haiku._src.ops.adapter`) calls
:func:`backward_products` once per application in the backward pass.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gram_haiku._src import hijax_compat as hx
from gram_haiku._src import kernels
from gram_haiku._src.kernels import KernelConfig
from gram_haiku._src.ops import factors


def clip_weights(sq_norms, clip) -> jax.Array:
  """``c_i`` of a :class:`~gram_haiku._src.plan.Clip` from squared norms.

  ``"abadi"``: ``min(1, C / |g_i|)``; ``"automatic"``: ``C / (|g_i| +
  gamma)``. A norm of zero gives 1 (``"abadi"``); a norm that is not finite
  gives 0, so that such an example contributes nothing.

  Args:
    sq_norms: ``[B]`` squared per-example gradient norms.
    clip: the :class:`~gram_haiku._src.plan.Clip` (threshold ``C`` in the
      units of the gradient norm).

  Returns:
    ``[B]`` weights in the dtype of ``sq_norms``.
  """
  norm = jnp.sqrt(jnp.maximum(sq_norms, 0))
  c = jnp.asarray(clip.l2_clip_norm, norm.dtype)
  if clip.function == "automatic":
    w = c / (norm + jnp.asarray(clip.gamma, norm.dtype))
  else:
    w = jnp.where(norm > c, c / jnp.where(norm > 0, norm, 1), 1)
  return jnp.where(jnp.isfinite(norm), w, 0).astype(norm.dtype)


def probe_width(op) -> int:
  """The second axis of a ``"per_example"`` probe (``P``, the op's parameter
  entries) or of a ``"factors"`` probe (``K``, see
  :func:`~gram_haiku._src.ops.factors.factor_width`)."""
  if op.mode == "factors":
    return factors.factor_width(op)
  return op.num_params()


def products(op, x, g, params, wanted, cfg: KernelConfig):
  """The rule's ``probe_cotangent_and_grads``, of the trainable parameters
  only: those in ``Plan.frozen`` have no gradient, so they have no term in
  the Gram or the norms, and zero columns among the per-example gradients.

  ``params[i]`` may be None for a frozen one when the rule's ``droppable``
  holds it (after the pass, where only the parameter leaves are known).
  A frozen parameter the rule cannot drop is handled by exact per-example
  VJPs of the others (``B x P`` memory for those).

  Returns:
    ``(value, provided)`` as ``GramOp.probe_cotangent_and_grads``.
  """
  frozen = [i for i in op.plan.frozen or ()
            if op.param_avals[i] is not None]
  if not frozen:
    return op.probe_cotangent_and_grads(x, g, params, wanted, cfg)
  wanted = [i for i in wanted if i not in frozen]
  keep = [i for i, a in enumerate(op.param_avals)
          if a is not None and i not in frozen]
  e = op.example_axis.resolved_position()
  if not keep:  # A frozen layer: no term at all.
    b = x.shape[e]
    shape = {"gram": (b, cfg.column_count(b)), "norms": (b,)}.get(
        op.mode, (b, op.num_params()))
    return hx.vary_like(jnp.zeros(shape, op.accumulation_dtype()), x, g), {}
  if set(frozen) <= set(op.droppable):
    masked = [None if i in frozen else p for i, p in enumerate(params)]
    if op.mode != "per_example":
      return op.probe_cotangent_and_grads(x, g, masked, wanted, cfg)
    grads = op.per_example_grads(x, g, masked, e)
  else:
    grads = op.vjp_per_example(x, g, params, e, keep)
  f = jnp.concatenate([kernels.rows(a) for a in grads], axis=1)
  if op.mode != "per_example":
    return kernels.probe_value(op.mode, f, cfg), {}
  # Zero columns for the frozen parameters, so that the store keeps the
  # layout of every parameter (see :func:`probe_width`).
  cols, start = [], 0
  for i, a in enumerate(op.param_avals):
    if a is None:
      continue
    n = math.prod(a.shape)
    if i in frozen:
      cols.append(jnp.zeros((f.shape[0], n), f.dtype))
    else:
      cols.append(f[:, start:start + n])
      start += n
  return jnp.concatenate(cols, axis=1), {}


def backward_products(op, x, g, params, wanted, cfg: KernelConfig,
                      weights=None):
  """The probe's cotangent and the parameter cotangents found on the way,
  by the op's mode (see the module docstring).

  Args:
    op: the Gram op (its plan gives the mode, ``Plan.frozen`` and
      ``Plan.clip``).
    x: the op's input; ``g``: its output cotangent.
    params: the parameter inputs (None for absent ones).
    wanted: indices of the parameters whose ordinary cotangent is needed.
    cfg: the columns to gather and the memory budget.
    weights: ``"clip"`` mode only: ``[B]`` per-example weights ``m_i`` (the
      probe's value: 1, or 0 for a padded row).

  Returns:
    ``(value, provided)``: the probe's cotangent and ``{index: cotangent}``
    for parameters whose cotangent was computed here (the adapter runs
    JAX's own VJP for the others).
  """
  if op.mode == "factors":
    return factors.factor_matrix(op, x, g), {}
  if op.mode == "clip":
    sq = products(op.in_mode("norms"), x, g, params, (), cfg)[0]
    c = clip_weights(sq, op.plan.clip) * weights.astype(sq.dtype)
    wanted = [i for i in wanted if i not in (op.plan.frozen or ())]
    provided = factors.reweighted_param_grads(op, x, g, params, c, wanted)
    return sq, {i: hx.reduce_to_type_of(ct, params[i]).astype(
        params[i].dtype) for i, ct in provided.items()}
  return products(op, x, g, params, wanted, cfg)
