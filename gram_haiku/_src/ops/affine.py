"""The elementwise affine map of normalisation layers and ``hk.Bias``.

``y = xhat * scale + offset``, with ``scale`` and ``offset`` broadcast over
``xhat`` (numpy rules, aligned on the trailing axes; either may be None). It
is the learnable part shared by ``hk.LayerNorm``, ``hk.InstanceNorm``,
``hk.RMSNorm`` and ``hk.GroupNorm`` (``xhat`` is the normalised input), and
``hk.Bias`` is ``y = x + b`` (``scale=None``, optionally ``b * multiplier``).
``xhat`` is computed by ordinary JAX ops *outside* the op, so the
normalisation's own gradient flows to the layer input as usual: the op only
gives ``xhat`` its cotangent ``g * scale``.

Per-example gradient. The trailing ``feature_ndim`` axes of ``xhat`` are the
parameters' axes (a parameter axis of size 1 is broadcast over); every axis
before them is the example axis or a within-example axis. For example ``i``

    dscale_i = R(g_i * xhat_i),   doffset_i = R(g_i) * multiplier

where ``R`` sums over the within-example axes and the broadcast axes. These
are small (``B x C`` for a norm's per-channel parameters, never more entries
than the layer's output cotangent), so they are materialised and the Gram is
``F F^T`` with ``F = [dscale | doffset]`` flattened per example: cost
``~B N + B^2 P`` for an output of ``B x N`` entries and ``P`` parameters;
the diagonal is ``sum(F * F, axis=1)`` (``~B N``). A ghost form would cost
more (``B^2 T^2 (C + 1)`` per parameter), so there is no strategy choice.

The rule (:func:`affine_rule`) is these pure functions of arrays;
:func:`gram_affine` binds it as a Gram op.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute.example_axis import ExampleAxis
from gram_haiku._src.compute.example_axis import ExampleAxisSpec
from gram_haiku._src.compute.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.compute.plan import Plan
from gram_haiku._src.ops import op as op_lib
from gram_haiku._src.rules import rule as rule_lib
from gram_haiku._src.rules.rule import Rule


def affine_forward(x, scale, offset, offset_multiplier=None):
  """``x * scale + offset * multiplier``, broadcast explicitly to ``x``.

  The same elementwise operations, in the same order, as the end of
  ``hk.GroupNorm`` and ``hk.Bias``; explicit broadcasting keeps it valid
  under ``jax_numpy_rank_promotion="raise"`` (as Haiku does). A
  parameter's leading size-1 axes are dropped first (:func:`_feature_shape`),
  so that it broadcasts to one example's ``x`` under ``vmap``.
  """
  y = x
  if scale is not None:
    y = y * jnp.broadcast_to(_features(scale), jnp.shape(y))
  if offset is not None:
    b = jnp.broadcast_to(_features(offset), jnp.shape(y))
    if offset_multiplier is not None:
      b = b * offset_multiplier
    y = y + b
  return y


def _feature_shape(shape) -> tuple[int, ...]:
  """A parameter's shape without its leading size-1 axes.

  Haiku stores some parameters at the input's full rank with a size-1
  leading (batch) axis, e.g. ``hk.LayerNorm(param_axis=1)`` on ``(B, T, C)``
  has scale ``(1, T, 1)``. Those axes are broadcast over, so they are not
  parameter axes: the op takes the parameter as stored (so that it is the
  very value Haiku holds, and its cotangent has the stored shape), and the
  rule counts its axes from this shape, which leaves the example axis
  among the leading axes of ``x``.
  """
  shape = tuple(shape)
  k = 0
  while k < len(shape) and shape[k] == 1:
    k += 1
  return shape[k:]


def _features(p):
  """``p`` without its leading size-1 axes (:func:`_feature_shape`)."""
  return jnp.reshape(p, _feature_shape(jnp.shape(p)))


def static_multiplier(value):
  """A hashable static form of ``hk.Bias``'s ``multiplier``, or raises.

  Python numbers and NumPy scalars (or 0-d NumPy arrays) are kept with their
  exact type, so ``b * multiplier`` promotes as in Haiku.

  Raises:
    NotImplementedError: for a JAX array or a non-scalar.
  """
  if value is None or isinstance(value, (numbers.Number, np.generic)):
    return value
  if isinstance(value, np.ndarray) and value.ndim == 0:
    return value[()]
  raise NotImplementedError(
      "gram_haiku: hk.Bias(multiplier=...) inside gram_haiku.track() takes "
      "None, a Python number or a NumPy scalar, got "
      f"{type(value).__name__} {getattr(value, 'shape', '')}. An array "
      "multiplier would need its own operand in the Gram op.\n"
      "What to do: pass a static scalar, or apply the bias outside track().")


def _reduce_to(a, param_shape, feature_ndim):
  """Sums ``a: (B, ..., *features)`` to the per-example ``(B, *param_shape)``.

  Sums over every axis between the example axis and the ``feature_ndim``
  trailing axes, and over feature axes where the parameter has size 1.
  """
  feat = a.shape[a.ndim - feature_ndim:] if feature_ndim else ()
  a = kernels.rows(a, *feat).sum(axis=1)
  own = _feature_shape(param_shape)
  padded = (1,) * (feature_ndim - len(own)) + own
  axes = tuple(1 + k for k, (p, n) in enumerate(zip(padded, feat))
               if p == 1 and n != 1)
  if axes:
    a = a.sum(axis=axes, keepdims=True)
  return a.reshape((a.shape[0],) + tuple(param_shape))


def per_example_grads(x, g, params, example_dim: int, *, feature_ndim: int,
                      offset_multiplier=None):
  """``(dscale [B, *scale.shape], doffset [B, *offset.shape])`` per example
  (absent ones left out), in the accumulation dtype; see the module
  docstring. ``x`` is ``xhat``; its trailing ``feature_ndim`` axes are the
  parameters' axes."""
  acc = rule_lib.accumulation_dtype(x, params)
  gm = jnp.moveaxis(g, example_dim, 0).astype(acc)
  scale, offset = params
  out = []
  if scale is not None:
    xm = jnp.moveaxis(x, example_dim, 0).astype(acc)
    out.append(_reduce_to(gm * xm, scale.shape, feature_ndim))
  if offset is not None:
    go = _reduce_to(gm, offset.shape, feature_ndim)
    if offset_multiplier is not None:
      go = go * jnp.asarray(offset_multiplier, acc)
    out.append(go)
  return out


def sq_norms(x, g, params, example_dim: int, cfg, *, feature_ndim: int,
             offset_multiplier=None):
  """``[B]`` squared norms ``sum(F * F)``; with ``cfg.upper_bound``, sound
  upper bounds (:func:`gram_haiku._src.compute.norm_bounds.materialized`): each
  entry of ``F`` sums ``g * xhat`` (or ``g``) over the summed axes, so it
  is off by at most ``e_T`` times the same sum of absolute values, which
  :func:`per_example_grads` of ``|xhat|`` and ``|g|`` gives."""
  grads = functools.partial(per_example_grads, feature_ndim=feature_ndim,
                            offset_multiplier=offset_multiplier)
  f = rule_lib.flat(grads(x, g, params, example_dim))
  if not cfg.upper_bound:
    return jnp.sum(f * f, axis=1)
  return norm_bounds.of_rows(f, per_example_error(
      x, g, params, example_dim, cfg, feature_ndim=feature_ndim,
      offset_multiplier=offset_multiplier))


def per_example_error(x, g, params, example_dim: int, cfg, *,
                      feature_ndim: int, offset_multiplier=None):
  """``[B]``: the rounding bound of :func:`per_example_grads` in norm units:
  each entry sums ``g * xhat`` (or ``g``) over the summed axes, so it is
  off by at most ``e_T`` times the same sum of absolute values, which
  :func:`per_example_grads` of ``|xhat|`` and ``|g|`` gives."""
  del cfg
  a = jnp.abs(rule_lib.flat(per_example_grads(
      jnp.abs(x), jnp.abs(g), params, example_dim, feature_ndim=feature_ndim,
      offset_multiplier=offset_multiplier)))
  # Each entry of a parameter of P entries sums (elements / P) products.
  sizes = [math.prod(p.shape) for p in params if p is not None]
  terms = math.prod(x.shape) // max(x.shape[example_dim] * min(sizes), 1)
  return norm_bounds.dot_error(terms, a.dtype, lax.Precision.HIGHEST) * (
      jnp.sqrt(norm_bounds.of_rows(a)))


def affine_rule(feature_ndim: int, offset_multiplier=None) -> Rule:
  """The rule of ``xhat * scale + offset * offset_multiplier``, parameters
  ``(scale, offset)`` over the ``feature_ndim`` trailing axes of ``xhat``
  (the learnable part of the norms and ``hk.Bias``).

  It gives the per-example gradients (small: never more entries than the
  output), and the squared norms with their rounding bound; the default
  Gram, ``F F^T`` of the per-example gradients, is this layer's formula
  and gathers columns and shards rows (sharding-aware). Each parameter's
  term is its own (both droppable).
  """
  return Rule(
      forward=functools.partial(affine_forward,
                                offset_multiplier=offset_multiplier),
      param_names=("scale", "offset"), feature_ndim=feature_ndim,
      per_example_grads=functools.partial(
          per_example_grads, feature_ndim=feature_ndim,
          offset_multiplier=offset_multiplier),
      sq_norms=functools.partial(sq_norms, feature_ndim=feature_ndim,
                                 offset_multiplier=offset_multiplier),
      per_example_error=functools.partial(
          per_example_error, feature_ndim=feature_ndim,
          offset_multiplier=offset_multiplier),
      droppable=(0, 1), sharding_aware=True)


def layer_rule(x, scale, offset, offset_multiplier=None, name="affine"):
  """``(rule, scale, offset)``: :func:`affine_rule` for these operands, and
  the parameters as the op takes them: as stored (leading size-1 axes
  kept; the rule's ``feature_ndim`` does not count them).

  Raises:
    ValueError: when neither ``scale`` nor ``offset`` is given, or they do
      not broadcast to ``x``.
    NotImplementedError: for a non-static ``offset_multiplier``.
  """
  if scale is None and offset is None:
    raise ValueError("gram_affine needs a scale or an offset parameter.")
  offset_multiplier = static_multiplier(offset_multiplier)
  feature_ndim = max(len(_feature_shape(p.shape)) for p in (scale, offset)
                     if p is not None)
  if feature_ndim > jnp.ndim(x):
    raise ValueError(
        f"gram_affine ({name}): parameters of rank {feature_ndim} do not "
        f"broadcast to an input of shape {jnp.shape(x)}.")
  return affine_rule(feature_ndim, offset_multiplier), scale, offset


def gram_affine(x: jax.Array, scale: Optional[jax.Array],
                offset: Optional[jax.Array], probe: jax.Array, *,
                offset_multiplier=None, name: str = "affine",
                example_axis: ExampleAxisSpec | ExampleAxis = None,
                strategy: str = "auto", mode: str = "gram",
                memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
                plan: Optional[Plan] = None) -> jax.Array:
  """``x * scale + offset`` whose backward pass writes the Gram into ``probe``.

  Args:
    x: the normalised input ``xhat`` (or, for ``hk.Bias``, the input).
    scale: None, or an array broadcastable to ``x``'s trailing axes.
    offset: None, or an array broadcastable to ``x``'s trailing axes.
    probe: zeros: ``[B, B]`` for ``mode="gram"``, ``[B]`` for ``"norms"``,
      ``[B, P]`` for ``"per_example"`` (``P`` = entries of scale and
      offset); float32 (float64 under x64).
    offset_multiplier: None or a static scalar multiplying ``offset``
      (``hk.Bias``'s ``multiplier``).
    name: module name used in error messages.
    example_axis: which axis is the example axis (as
      :func:`gram_haiku.ops.gram_linear`). Parameter axes are the trailing
      ``max(ndim(scale), ndim(offset))`` axes of ``x`` (after leading
      size-1 parameter axes are dropped); the others are leading axes.
    strategy: accepted for a uniform interface; the Gram is always formed
      from the materialised per-example gradients.
    mode: ``"gram"``, ``"norms"`` or ``"per_example"``.
    memory_budget_bytes, plan: as :func:`gram_haiku.ops.gram_linear`.

  Returns:
    ``x * scale + offset * offset_multiplier`` (absent terms left out). The
    cotangent of ``probe`` is ``G[i, j] = <g_i, g_j>`` over scale and offset.

  Raises:
    ValueError: for an unknown strategy or mode, when neither ``scale`` nor
      ``offset`` is given; at differentiation time when ``probe`` has the
      wrong shape.
    NotImplementedError: for a non-static ``offset_multiplier``.
  """
  if plan is None:
    plan = Plan.make(mode=mode, strategy=strategy, example_axis=example_axis,
                     memory_budget_bytes=memory_budget_bytes)
  x = jnp.asarray(x)
  rule, scale, offset = layer_rule(x, scale, offset, offset_multiplier, name)
  return op_lib.bind(rule, x, (scale, offset), probe, name=name, plan=plan)
