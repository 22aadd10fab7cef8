"""``hk.Embed`` inside ``track()``: the same parameter, the Gram op.

``module.embeddings`` (the property that calls ``hk.get_parameter``) is read
exactly as ``hk.Embed.__call__`` reads it, so the parameter's name, shape,
dtype and initialiser are Haiku's and the property keeps working for user
code. Only the lookups made through ``__call__`` are in the Gram: a
parameter read through the property and used elsewhere (tied input/output
embeddings) contributes gradient that this module's Gram does not contain.
"""

import haiku as hk
import jax.numpy as jnp

from gram_haiku._src.frontend.registry import register_layer
from gram_haiku._src.ops import embed as embed_op


@register_layer(hk.Embed)
def embed(call, module: hk.Embed, ids, lookup_style=None, precision=None):
  """``hk.Embed.__call__`` with its rule (same parameter)."""
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError("hk.Embed's __call__ method must take an array of "
                     "integer dtype but was called with an array of "
                     f"{ids.dtype}")
  lookup_style = lookup_style or module.lookup_style
  if isinstance(lookup_style, str):
    lookup_style = getattr(hk.EmbedLookupStyle, lookup_style.upper())
  if lookup_style not in (hk.EmbedLookupStyle.ARRAY_INDEX,
                          hk.EmbedLookupStyle.ONE_HOT):
    raise NotImplementedError(f"{lookup_style} is not supported by hk.Embed.")
  precision = module.precision if precision is None else precision
  embeddings = module.embeddings  # The forward applies jnp.asarray.
  rule = embed_op.layer_rule(ids, lookup_style.name, precision)
  return call.apply(rule, ids, (embeddings,))
