"""``unembed``: an output layer tied to an embedding, tracked.

``logits = h @ embed.embeddings.T`` reuses the embedding matrix ``E``, so
``E``'s per-example gradient is the sum of its lookup and output-layer
parts, and the Gram needs the cross terms between them. ``track()`` cannot
see a raw matmul, so a raw ``h @ embed.embeddings.T`` inside ``track()``
raises (the parameter would be used outside its tracked layer). This
function computes the same logits as a Gram op of the embedding module:
:func:`gram_haiku.value_grad_and_gram` then sees ``E`` used twice and
accumulates its per-example gradients over both uses (probe ``[B, V*D]``),
cross terms included.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp

from gram_haiku._src.frontend.tracking import current_tracker
from gram_haiku._src.frontend.tracking import LayerCall
from gram_haiku._src.ops import linear
from gram_haiku._src.rules.rule import Rule


def _unembed(h, embeddings, *, precision):
  return jnp.dot(h, embeddings.T, precision=precision)


def _per_example_error(h, g, params, example_dim, cfg):
  """The rounding bound of the per-example gradients ``sum_t d_t h_t^T``:
  a linear map's (:func:`gram_haiku._src.ops.linear.per_example_error`)."""
  return linear.per_example_error(h, g, (params[0], None), example_dim, cfg)


def unembed(embed: hk.Embed, h: jax.Array, *,
            precision: jax.lax.Precision | None = None) -> jax.Array:
  """``h @ embed.embeddings.T``, tracked as a second use of the embedding.

  Args:
    embed: the ``hk.Embed`` whose table is tied to the output layer.
    h: ``[..., D]`` hidden states (``D = embed.embed_dim``).
    precision: passed to ``jnp.dot``.

  Returns:
    ``[..., V]`` logits, exactly ``jnp.dot(h, embed.embeddings.T)``. Outside
    ``gram_haiku.track()`` that is all it does.

  Raises:
    ValueError: from ``track()``'s checks, e.g. when the example axis of
      ``h`` does not match the other layers'.
  """
  tracker = current_tracker()
  if tracker is None:
    return _unembed(h, embed.embeddings, precision=precision)
  with tracker.tracking_rule("unembed"):
    embeddings = embed.embeddings
  rule = Rule(forward=functools.partial(_unembed, precision=precision),
              param_names=("embeddings",), feature_ndim=1,
              per_example_error=_per_example_error)
  return LayerCall(tracker, embed).apply(rule, h, (embeddings,))
