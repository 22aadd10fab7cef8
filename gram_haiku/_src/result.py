"""The :class:`Grams` result type."""

from __future__ import annotations

from typing import Mapping

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

  Units: squared units of the loss per squared parameter unit. Loss scale: for
  ``loss = sum_i l_i`` the Gram is the reference ``F @ F.T``; for
  ``loss = mean_i l_i`` it is ``F @ F.T / B**2`` (the cotangents carry the
  ``1/B``).
  """

  def __init__(self, by_layer: Mapping[str, jax.Array]):
    self.by_layer = dict(by_layer)

  @property
  def total(self) -> jax.Array:
    """``f32[B, B]``: the whole model's Gram, the sum over tracked layers."""
    grams = list(self.by_layer.values())
    total = grams[0]
    for g in grams[1:]:
      total = total + g
    return total

  @property
  def norms(self) -> jax.Array:
    """``f32[B]``: per-example gradient norms, ``sqrt(diag(total))``.

    Negative diagonal entries from float rounding are clamped to 0.
    """
    diag = jnp.diagonal(self.total, axis1=-2, axis2=-1)
    return jnp.sqrt(jnp.maximum(diag, 0))

  def tree_flatten(self):
    keys = tuple(sorted(self.by_layer))
    return tuple(self.by_layer[k] for k in keys), keys

  @classmethod
  def tree_unflatten(cls, keys, leaves):
    return cls(dict(zip(keys, leaves)))

  def __repr__(self):
    layers = ", ".join(
        f"{k!r}: {getattr(v, 'dtype', '?')}{list(getattr(v, 'shape', ()))}"
        for k, v in sorted(self.by_layer.items()))
    return f"Grams(by_layer={{{layers}}})"
