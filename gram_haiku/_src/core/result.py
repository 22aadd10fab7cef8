"""The result types: :class:`Grams` and :class:`CrossGrams`."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class Grams:
  """Per-example gradient Gram matrices of one backward pass.

  A pytree (its leaves are the per-layer Grams), so it passes through
  ``jax.jit`` and ``jax.vmap``; under ``vmap`` every array gains the mapped
  axes in front and the properties below act on the last two axes.

  Attributes:
    by_layer: ``{module name: f32[B, B]}``, the Gram of each tracked module's
      parameters. ``G[i, j] = <g_i, g_j>`` where ``g_i`` is the gradient of
      example ``i``'s contribution to the differentiated scalar.
    sq_norms_by_layer: ``{module name: f32[B]}`` for modules tracked with
      ``track(mode="norms")``: only the diagonal ``|g_i|^2``.
    coverage: ``{parameter full name: ParamCoverage}`` for every parameter
      given to :func:`gram_haiku.value_grad_and_gram`: tracked (with the rule
      used), untracked (with the module type that read it), or unused (never
      read, so its gradient is zero: rule ``"unused"``, counted as covered).

    mesh_axes: inside ``shard_map`` (``value_grad_and_gram(mesh_axes=...)``),
      the mesh axes the examples are split over. Each array of
      :attr:`by_layer` is then this device's rows ``f32[b, B]`` of the
      global Gram (``b = B / n`` local examples); ``out_specs=P(mesh_axes,
      None)`` assembles the ``(B, B)`` Gram. :attr:`sq_norms_by_layer`
      holds the local ``f32[b]``.

  Units: squared units of the loss per squared parameter unit. Loss scale: for
  ``loss = sum_i l_i`` the Gram is the reference ``F @ F.T``; for
  ``loss = mean_i l_i`` it is ``F @ F.T / B**2`` (the cotangents carry the
  ``1/B``).
  """

  def __init__(self, by_layer: Mapping[str, jax.Array],
               sq_norms_by_layer: Mapping[str, jax.Array] | None = None,
               coverage: Mapping[str, Any] | None = None,
               mesh_axes: tuple[str, ...] = ()):
    self.by_layer = dict(by_layer)
    self.sq_norms_by_layer = dict(sq_norms_by_layer or {})
    self.coverage = dict(coverage or {})
    self.mesh_axes = tuple(mesh_axes)

  @property
  def complete(self) -> bool:
    """True when every trainable parameter is covered by the Gram.

    That is, every parameter read in the pass was read by a tracked layer
    (unused parameters have zero gradient and count as covered). When False,
    :attr:`coverage` says which parameters are left out and why.
    """
    return all(c.tracked for c in self.coverage.values())

  @property
  def untracked(self) -> list[str]:
    """Names of the parameters the Gram leaves out (sorted)."""
    return sorted(k for k, c in self.coverage.items() if not c.tracked)

  @property
  def total(self) -> jax.Array:
    """``f32[B, B]``: the whole model's Gram, the sum over tracked layers.

    Raises:
      ValueError: when some layer was tracked with ``mode="norms"`` (only
        its diagonal exists); use :attr:`norms` or :attr:`sq_norms`.
    """
    if self.sq_norms_by_layer:
      raise ValueError(
          "Grams.total: layers " + ", ".join(sorted(self.sq_norms_by_layer))
          + " computed only the diagonal of their Gram (tracked with "
          "track(mode='norms'), or in a reweighted_grad or clipped_grad pass "
          "with needs='norms'). Use grams.norms / grams.sq_norms, or track "
          "them with mode='gram' (reweighted_grad(..., needs='gram')) for the "
          "full matrix.")
    return _sum(list(self.by_layer.values()))

  @property
  def sq_norms(self) -> jax.Array:
    """``f32[B]``: squared per-example gradient norms, ``diag(total)``.

    For local rows ``f32[b, B]`` (see :attr:`mesh_axes`), the local
    ``f32[b]``: the entries ``G[i, k b + i]`` of device ``k``'s rows,
    which needs ``lax.axis_index``, so ask inside the ``shard_map``.
    """
    parts = [_diagonal(g, self.mesh_axes) for g in self.by_layer.values()]
    return _sum(parts + list(self.sq_norms_by_layer.values()))

  @property
  def norms(self) -> jax.Array:
    """``f32[B]``: per-example gradient norms, ``sqrt(diag(total))``.

    Negative diagonal entries from float rounding are clamped to 0.
    """
    return jnp.sqrt(jnp.maximum(self.sq_norms, 0))

  def tree_flatten(self):
    full = tuple(sorted(self.by_layer))
    diag = tuple(sorted(self.sq_norms_by_layer))
    leaves = tuple(self.by_layer[k] for k in full) + tuple(
        self.sq_norms_by_layer[k] for k in diag)
    coverage = tuple(sorted(self.coverage.items()))
    return leaves, (full, diag, coverage, self.mesh_axes)

  @classmethod
  def tree_unflatten(cls, keys, leaves):
    full, diag, coverage, mesh_axes = keys
    return cls(dict(zip(full, leaves[:len(full)])),
               dict(zip(diag, leaves[len(full):])), dict(coverage),
               mesh_axes)

  def __repr__(self):
    def fmt(d):
      return ", ".join(
          f"{k!r}: {getattr(v, 'dtype', '?')}{list(getattr(v, 'shape', ()))}"
          for k, v in sorted(d.items()))
    extra = (f", sq_norms_by_layer={{{fmt(self.sq_norms_by_layer)}}}"
             if self.sq_norms_by_layer else "")
    if self.coverage and not self.complete:
      extra += f", untracked={self.untracked}"
    return f"Grams(by_layer={{{fmt(self.by_layer)}}}{extra})"


def _sum(arrays):
  total = arrays[0]
  for a in arrays[1:]:
    total = total + a
  return total


def _diagonal(g: jax.Array, mesh_axes: tuple[str, ...]) -> jax.Array:
  """``diag`` of a square Gram, or of this device's rows ``[b, B]``."""
  rows, cols = g.shape[-2], g.shape[-1]
  if rows == cols:
    return jnp.diagonal(g, axis1=-2, axis2=-1)
  if not mesh_axes:
    raise ValueError(
        f"Grams: a Gram of shape {tuple(g.shape)} is not square and no mesh "
        "axes are known, so its diagonal is undefined.")
  names = mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]
  start = jax.lax.axis_index(names) * rows
  block = jax.lax.dynamic_slice_in_dim(g, start, rows, axis=-1)
  return jnp.diagonal(block, axis1=-2, axis2=-1)


@jax.tree_util.register_pytree_node_class
class CrossGrams:
  """Gram blocks between two sets of examples, from one backward pass.

  Attributes:
    by_layer: ``{module name: f32[B, V]}``, per tracked module
      ``G[i, q] = <g_i, h_q>``: ``g_i`` the gradient of training example
      ``i``'s loss, ``h_q`` that of query ``q``'s, both with respect to the
      module's parameters.
    summed_by_layer: ``{module name: f32[B]}``, per tracked module
      ``<g_i, sum_q h_q>``, the row sums of its block, formed without the
      block (In-Run Data Shapley's first-order term).
    sq_norms_by_layer: ``{module name: f32[B]}``, per tracked module the
      training examples' own ``|g_i|^2`` (the Gram's diagonal: TracIn's
      self-influence), from the same pass.
    coverage: as :attr:`Grams.coverage`.

  Units: squared units of the loss per squared parameter unit (for a loss
  ``sum_i l_i``; see :func:`gram_haiku.cross_gram`). Under ``jax.jit``
  only what is used is computed: the blocks or their row sums.
  """

  def __init__(self, by_layer: Mapping[str, jax.Array],
               summed_by_layer: Mapping[str, jax.Array] | None = None,
               sq_norms_by_layer: Mapping[str, jax.Array] | None = None,
               coverage: Mapping[str, Any] | None = None):
    self.by_layer = dict(by_layer)
    self.summed_by_layer = dict(summed_by_layer or {})
    self.sq_norms_by_layer = dict(sq_norms_by_layer or {})
    self.coverage = dict(coverage or {})

  @property
  def total(self) -> jax.Array:
    """``f32[B, V]``: the whole model's block, the sum over tracked layers."""
    return _sum(list(self.by_layer.values()))

  @property
  def query_summed(self) -> jax.Array:
    """``f32[B]``: ``<g_i, sum_q h_q>`` over the whole model, ``total``'s
    row sums, formed without ``total``."""
    return _sum(list(self.summed_by_layer.values()))

  @property
  def sq_norms(self) -> jax.Array:
    """``f32[B]``: the training examples' ``|g_i|^2`` over the whole
    model."""
    return _sum(list(self.sq_norms_by_layer.values()))

  @property
  def complete(self) -> bool:
    """True when every trainable parameter is covered (:attr:`Grams.complete`)."""
    return all(c.tracked for c in self.coverage.values())

  def tree_flatten(self):
    parts = (self.by_layer, self.summed_by_layer, self.sq_norms_by_layer)
    keys = tuple(tuple(sorted(d)) for d in parts)
    leaves = tuple(d[k] for d, ks in zip(parts, keys) for k in ks)
    return leaves, (keys, tuple(sorted(self.coverage.items())))

  @classmethod
  def tree_unflatten(cls, aux, leaves):
    keys, coverage = aux
    dicts, start = [], 0
    for ks in keys:
      dicts.append(dict(zip(ks, leaves[start:start + len(ks)])))
      start += len(ks)
    return cls(*dicts, coverage=dict(coverage))

  def __repr__(self):
    shapes = {k: tuple(jnp.shape(v)) for k, v in self.by_layer.items()}
    return f"CrossGrams(by_layer={shapes})"
