"""``gram_embed`` (``hk.Embed``), both lookup styles.

Integer ids (``integer_input=True``): their cotangent must be ``float0``.
The ids are drawn in ``[0, V)`` with ``V`` small, so that ids repeat within
every example. They are in range on purpose: out of range, ``jnp``'s own
gradient depends on the layout (an array of ids is a gather whose gradient
drops the id, a scalar id under ``vmap`` a ``dynamic_slice`` whose gradient
clamps it), so the suite's explicitly batched reference would not be the
truth for every vmap depth; ``tests/test_embed.py`` checks those ids
against the reference of the same layout.

``plain`` is an independent untracked lookup: ``E[ids]`` or
``one_hot(ids) @ E`` at ``HIGHEST`` precision.
"""

import jax
import jax.numpy as jnp

from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec
from gram_haiku.conformance.registry import register
from gram_haiku.ops import gram_embed

_V, _D = 5, 3
_HIGHEST = jax.lax.Precision.HIGHEST


def _plain(style):
  def plain(p, ids):
    e = p["embeddings"]
    if style == "ARRAY_INDEX":
      return e[ids]
    return jnp.dot(jax.nn.one_hot(ids, _V), e, precision=_HIGHEST)
  return plain


def _apply(style):
  def apply(p, probe, ids, **kw):
    return gram_embed(ids, p["embeddings"], probe, lookup_style=style,
                      precision=_HIGHEST, name=f"embed_{style.lower()}", **kw)
  return apply


for _style in ("ARRAY_INDEX", "ONE_HOT"):
  register(OpSpec(
      name=f"embed_{_style.lower()}",
      make_params=lambda key, dtype: {"embeddings": normal(key, (_V, _D),
                                                           dtype)},
      make_example=lambda key, lead, dtype: jax.random.randint(
          key, tuple(lead), 0, _V),
      apply=_apply(_style),
      plain=_plain(_style),
      integer_input=True))
