"""``unembed``: an output layer tied to an embedding, tracked.

``logits = h @ embed.embeddings.T`` reuses the embedding matrix ``E``, so
``E``'s per-example gradient is the sum of its lookup and output-layer
parts, and the Gram needs the cross terms between them. ``track()`` cannot
see a raw matmul, so a raw ``h @ embed.embeddings.T`` inside ``track()``
raises (the parameter would be used outside its tracked layer). This
function computes the same logits as a Gram op of the embedding module:
:func:`gram_haiku.value_grad_and_gram` then sees ``E`` used twice and
accumulates its per-example gradients over both uses (probe ``[B, V*D]``),
cross terms included. Where only norms are read (clipping, reweighting)
each use keeps its factors instead (:mod:`gram_haiku._src.passes.parts`):
the output layer's norms are a linear map's (ghost or materialised by the
cost model), and the cross term between the uses is
:func:`lookup_output_cross`, neither with a ``V x D`` array per example.
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
from jax import lax
import jax.numpy as jnp

from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.frontend.tracking import current_tracker
from gram_haiku._src.frontend.tracking import LayerCall
from gram_haiku._src.ops import embed as embed_lib
from gram_haiku._src.ops import linear
from gram_haiku._src.rules.rule import Rule


def _unembed(h, embeddings, *, precision):
  return jnp.dot(h, embeddings.T, precision=precision)


def _per_example_error(h, g, params, example_dim, cfg):
  """The rounding bound of the per-example gradients ``sum_t d_t h_t^T``:
  a linear map's (:func:`gram_haiku._src.ops.linear.per_example_error`)."""
  return linear.per_example_error(h, g, (params[0], None), example_dim, cfg)


def _as_linear(params):
  """The output layer is a linear map ``h @ w`` with ``w = E^T`` and no
  bias: each per-example gradient of ``E`` is the transpose of ``w``'s, so
  their Grams and norms are the linear rule's. Its functions read only
  whether ``w`` is present, not its values."""
  return (params[0], None)


def _gram(h, g, params, example_dim, cfg):
  return linear.gram(h, g, _as_linear(params), example_dim, cfg)


def _sq_norms(h, g, params, example_dim, cfg):
  return linear.sq_norms(h, g, _as_linear(params), example_dim, cfg)


def _cost(h, g, params, example_dim, cfg, **kw):
  return linear.cost(h, g, _as_linear(params), example_dim, cfg, **kw)


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
              param_names=("embeddings",), feature_ndim=1, gram=_gram,
              sq_norms=_sq_norms, cost=_cost,
              per_example_error=_per_example_error)
  return LayerCall(tracker, embed).apply(rule, h, (embeddings,))


# -- the cross term between the lookup and the output layer -------------------


def is_unembed(op) -> bool:
  """Whether ``op`` applies :func:`unembed`'s rule."""
  fn = op.rule.forward
  return isinstance(fn, functools.partial) and fn.func is _unembed


def _lookup_style(op):
  """``(lookup_style, scalar_ids)`` of an ``hk.Embed`` lookup's op whose
  every lookup adds to one row (no wrapped ``one_hot``), else None."""
  fn = op.rule.forward
  if not (isinstance(fn, functools.partial) and
          fn.func is embed_lib.embed_forward):
    return None
  style = fn.keywords.get("lookup_style", "ARRAY_INDEX")
  scalar_ids = bool(fn.keywords.get("scalar_ids", False))
  vocab = op.param_avals[0].shape[0]
  if embed_lib.key_count(vocab, op.x_aval.dtype, style, scalar_ids) != vocab:
    return None
  return style, scalar_ids


def _example_rows(op, a, tail: int):
  """``a`` in ``op``'s layout as ``(B, n, tail)``: example axis first, the
  other leading axes merged."""
  a = jnp.moveaxis(a, op.example_axis.resolved_position(), 0)
  return kernels.rows(a, tail) if tail else kernels.rows(a)


def lookup_output_cross(lookup, output, upper_bound: bool):
  """``<E_i, O_i>`` per example, where ``E_i`` is example ``i``'s gradient
  of a tied table through its ``hk.Embed`` lookup and ``O_i`` through
  :func:`unembed`, from their factors, without a ``V x D`` array per
  example.

  With ``k_t`` the row that lookup ``t`` reads, ``e_t`` its cotangent
  (``[D]``), ``h_s`` the output layer's input and ``z_s`` its logits'
  cotangent (``[V]``) at position ``s``: ``E_i = sum_t onehot(k_t) e_t^T``
  and ``O_i = sum_s z_s h_s^T``, so

      <E_i, O_i> = sum_t e_t . O_i[k_t] = sum_{t,s} z_s[k_t] (e_t . h_s).

  ``B T S D`` multiply-adds (``T`` lookups, ``S`` output positions) against
  ``B V D`` to materialise either gradient.

  Args:
    lookup, output: ``(op, x, g, params)`` of the lookup (``x``: integer
      ids) and of the output layer (``x``: ``[..., D]`` hidden states,
      ``g``: ``[..., V]``), each in its op's layout
      (:func:`~gram_haiku._src.ops.factors.split_factors`).
    upper_bound: also return the rounding bound of the value.

  Returns:
    ``(value, bound)``: ``[B]``, and ``[B]`` with ``|fl(value) - <E_i,
    O_i>| <= bound`` (None unless ``upper_bound``): with ``e_n =
    norm_bounds.dot_error(n)`` and ``a_ts = fl(e_t . h_s)``,
    ``e_D sum |e_t| |h_s| |z_s[k_t]| + e_{TS} (1 + e_D) sum |a_ts z_s[k_t]|``
    (each ``a_ts`` is off by at most ``e_D |e_t| |h_s|``, and the ``T S``
    products are summed), rounded up for its own evaluation.
  """
  lop, ids, e, (table,) = lookup
  oop, h, z, _ = output
  style, scalar_ids = _lookup_style(lop)
  acc = kernels.accumulation_dtype(table.dtype, e.dtype, z.dtype)
  ids = _example_rows(lop, ids, 0)
  e = _example_rows(lop, e, e.shape[-1]).astype(acc)
  h = _example_rows(oop, h, h.shape[-1]).astype(acc)
  z = _example_rows(oop, z, z.shape[-1]).astype(acc)
  key, weight, _ = embed_lib.lookup_keys(ids, table.shape[0], style,
                                         scalar_ids)
  used = weight > 0
  # A dropped lookup's cotangent never reaches the table (even a NaN).
  e = jnp.where(used[:, :, None], e, 0)
  hp = lax.Precision.HIGHEST
  a = jnp.einsum("btd,bsd->bts", e, h, precision=hp)
  zk = jnp.take_along_axis(z, jnp.where(used, key, 0)[:, None, :], axis=2)
  zk = jnp.where(used[:, :, None], jnp.swapaxes(zk, 1, 2), 0)  # [B, T, S]
  prod = a * zk
  value = jnp.sum(prod, axis=(1, 2))
  if not upper_bound:
    return value, None
  t, s, dim = e.shape[1], h.shape[1], e.shape[2]
  ed = norm_bounds.dot_error(dim, acc, hp)
  ets = norm_bounds.dot_error(t * s, acc, hp)
  en, hn = norm_bounds.row_norms(e), norm_bounds.row_norms(h)
  terms = (ed * jnp.sum(en[:, :, None] * hn[:, None, :] * jnp.abs(zk),
                        axis=(1, 2)) +
           ets * (1 + ed) * jnp.sum(jnp.abs(prod), axis=(1, 2)))
  return value, terms * norm_bounds.rounding_factor(t * s + 16, acc)


def cross_rule(first, second):
  """The cross term's function for two applications of one table, by
  their ops (in program order), or None where none is known:
  :func:`lookup_output_cross` for an ``hk.Embed`` lookup (no wrapped
  ``one_hot``) and :func:`unembed`, either order."""
  if _lookup_style(first) is not None and is_unembed(second):
    return lookup_output_cross
  if _lookup_style(second) is not None and is_unembed(first):
    return lambda a, b, upper_bound: lookup_output_cross(b, a, upper_bound)
  return None
