"""``hk.Embed``'s lookup as a primitive whose backward pass also emits the Gram.

The forward pass is exactly ``hk.Embed.__call__``: ``embeddings[(ids,)]``
(``ARRAY_INDEX``) or ``dot(one_hot(ids, V), embeddings)`` (``ONE_HOT``).

Per-example gradient. With output cotangents ``d_it`` (``t`` runs over every
within-example position), the backward pass of lookup ``(i, t)`` adds
``d_it`` to the rows of a set determined by its *key* (normally the single
row ``key_it``): ``w(key)`` rows, 1 normally, 0 for a lookup without
gradient. Two lookups with the same key hit the same rows, two different
keys disjoint ones, so with ``g_i = sum_t d_it`` spread over those rows

    G[i, j] = sum_{t,s} [key_it = key_js] w(key_it) (d_it . d_js)        (E)

``key`` and ``w`` follow the gradient of the lookup (not
its forward pass):

* ``ARRAY_INDEX`` with an array of ids: ``jnp`` indexing first maps a
  negative id to ``id + V``; the gather then *clamps* an id still outside
  ``[0, V)`` (the forward pass returns the first or last row), but its
  transpose, a scatter-add, *drops* it: such a lookup has zero gradient
  (``w = 0``), as ``vmap(grad)`` of the same lookup gives. Unsigned ids are
  converted to ``int32`` without that mapping, as ``jnp`` does, so a
  ``uint32`` id ``>= 2**31`` is out of range too.
* ``ARRAY_INDEX`` with a *scalar* id (the module called under ``vmap`` over
  every axis of the ids): ``jnp`` uses ``dynamic_slice``, which clamps in
  the forward *and* the backward pass, so an out-of-range id has the
  gradient of the row it reads. The op records the rank of the ids it was
  called with and keeps that behaviour after batching.
* ``ONE_HOT``: ``one_hot`` compares the id with ``iota(V)`` *in the id's
  dtype*, so an id outside ``[0, V)`` gives a zero row (``w = 0``). When
  ``V`` exceeds the dtype's range (``int8``/``uint8``/``int16``/``uint16``
  ids) the iota wraps and one id matches ``w`` columns; (E) with that ``w``
  is still exact.

Ids that repeat within an example are summed before any product: (E) pairs
every position with every other, and the segment form below sums the rows
of an example sharing an id before squaring.

Three exact ways to evaluate (E), with ``B`` examples of ``T`` positions,
embedding width ``D`` and (effective) vocabulary ``V``:

* **ghost**: ``(d_i d_j^T) * mask`` summed, cost ``~B^2 T^2 D``, blocked over
  pairs of examples (rows, then columns too if one row does not fit) so
  that the ``(rows, T, cols, T)`` kernels stay under
  the plan's memory budget. Matmul-friendly; best for short
  examples.
* **dense** (``strategy="materialize"`` when it fits): scatter-add each
  example's rows into ``B x V x D``, then ``F diag(w) F^T``: cost
  ``~B T D + B^2 V D``. Never built when ``B V D`` would exceed the budget.
* **segment** (``strategy="materialize"`` otherwise): sort each example's
  keys, segment-sum its rows (its per-example gradient as ``<= T`` unique
  rows), then for each pair ``(i, j)`` look every unique key of ``i`` up in
  ``j``'s sorted keys (``searchsorted``) and dot the matching rows: cost
  ``~B T log T + B T D + B^2 T (D + log T)``, blocked over pairs of
  examples like the ghost form (the gathered rows are ``(cols, rows, T,
  D)``). A factor ``T`` cheaper than ghost for long examples, and
  independent of ``V``.

``strategy="auto"`` takes the cheapest by a cost count (gathers weighted
above matmul multiply-adds; :func:`gram_haiku._src.compute.cost_model.embed_method`). The diagonal (``mode="norms"``) is
``sum_{t,s} [key_it = key_is] w (d_it . d_is)`` (ghost, ``~B T^2 D``) or
``sum_u w_u |S_iu|^2`` over the segment sums (``~B T (D + log T)``).
``mode="per_example"`` (a module applied more than once) uses the default
``vmap`` of the lookup's VJP: ``B x V x D``, the size of the probe that mode
needs anyway.

The rule (:func:`embed_rule`) is pure functions of arrays;
:func:`gram_embed` binds it as a Gram op.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
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

LOOKUP_STYLES = ("ARRAY_INDEX", "ONE_HOT")

#: Key of a lookup with zero gradient; sorts before every real key.
_INVALID_KEY = -1
#: Key of the padding rows of the segment form; sorts after every real key.
_PAD_KEY = np.iinfo(np.int32).max


def embed_forward(ids, embeddings, lookup_style: str, precision=None,
                  scalar_ids: bool = False):
  """The computation of ``hk.Embed.__call__``: same values, same gradient.

  ``scalar_ids``: the module was called with one scalar id (e.g. under
  ``vmap`` over every axis of the ids) and ``ids`` holds such scalars
  stacked by this op's batching rule. ``jnp`` indexes a scalar by
  ``dynamic_slice``, whose gradient *clamps* an out-of-range id like its
  forward pass does, where an array of ids is a gather whose gradient drops
  it; the clamped index keeps the scalar semantics (same rows, so the same
  values bit for bit, and the same gradient).
  """
  if lookup_style == "ARRAY_INDEX":
    if scalar_ids:
      ids = scalar_index(ids, embeddings.shape[0])
    return jnp.asarray(embeddings)[(ids,)]
  if lookup_style == "ONE_HOT":
    one_hot_ids = jax.nn.one_hot(ids, embeddings.shape[0])
    return jnp.dot(one_hot_ids, embeddings, precision=precision)
  raise NotImplementedError(f"{lookup_style} is not supported by hk.Embed.")


def _index_dtype(dtype) -> Any:
  return jnp.int64 if jnp.dtype(dtype).itemsize == 8 else jnp.int32


def scalar_index(ids: jax.Array, vocab_size: int) -> jax.Array:
  """The row ``jnp`` reads for each *scalar* id: normalised, then clamped.

  As ``jnp``'s ``dynamic_slice`` path for a scalar index: an unsigned id is
  converted to ``int32`` first (so ``2**32 - 1`` is ``-1``), a negative id is
  taken from the end, and the result is clamped to ``[0, V)``.
  """
  v = int(vocab_size)
  if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
    idx = ids.astype(_index_dtype(ids.dtype))
    idx = lax.select(idx < 0, idx + jnp.asarray(v, idx.dtype), idx)
  else:
    idx = lax.select(ids < 0, ids + jnp.asarray(v, ids.dtype), ids)
  return jnp.clip(idx, 0, v - 1)


def lookup_keys(ids: jax.Array, vocab_size: int, lookup_style: str,
                scalar_ids: bool = False):
  """Which embedding row each lookup's gradient lands in, and how often.

  Args:
    ids: integer ids, any shape.
    vocab_size: ``V``, rows of the embedding matrix.
    lookup_style: ``"ARRAY_INDEX"`` or ``"ONE_HOT"``.
    scalar_ids: the ids were given to the layer one scalar at a time (see
      :func:`embed_forward`): ``ARRAY_INDEX`` clamps instead of dropping.

  Returns:
    ``(key, weight, num_keys)``: ``key`` (``int32``, shape of ``ids``) in
    ``[0, num_keys)``, or ``-1`` for a lookup whose gradient is zero;
    ``weight`` (``int32``) the number of embedding rows the lookup adds its
    cotangent to (0 or 1, except for a wrapped ``one_hot``; a function of
    ``key``); ``num_keys`` the number of distinct keys.
  """
  dtype = jnp.dtype(ids.dtype)
  v = int(vocab_size)
  if lookup_style == "ARRAY_INDEX" and scalar_ids:
    key = scalar_index(ids, v).astype(jnp.int32)
    return key, jnp.ones(ids.shape, jnp.int32), v
  if lookup_style == "ARRAY_INDEX":
    if jnp.issubdtype(dtype, jnp.signedinteger):
      # Exactly jnp's index normalisation (same dtype, so the same overflow
      # behaviour), then the range check the scatter-add applies.
      idx = lax.select(ids < 0, ids + jnp.asarray(v, dtype), ids)
      valid = (idx >= 0) & (idx < jnp.asarray(v, dtype))
    else:
      idx = ids.astype(_index_dtype(dtype))  # jnp converts, no normalising
      valid = (idx >= 0) & (idx < v)
    key = jnp.where(valid, idx, _INVALID_KEY).astype(jnp.int32)
    return key, valid.astype(jnp.int32), v
  if lookup_style != "ONE_HOT":
    raise NotImplementedError(f"{lookup_style} is not supported by hk.Embed.")
  info = jnp.iinfo(dtype)
  if v - 1 <= info.max:  # iota(V) in the ids' dtype does not wrap.
    valid = (ids >= 0) & (ids <= jnp.asarray(v - 1, dtype))
    key = jnp.where(valid, ids.astype(_index_dtype(dtype)),
                    _INVALID_KEY).astype(jnp.int32)
    return key, valid.astype(jnp.int32), v
  # iota wraps (a dtype of at most 16 bits): column c holds the value whose
  # two's-complement bit pattern is c mod 2**bits.
  period = 2 ** info.bits
  u = ids.astype(jnp.int32) & (period - 1)
  weight = jnp.where(u < v, (v - 1 - u) // period + 1, 0)
  key = jnp.where(weight > 0, u, _INVALID_KEY)
  return key, weight, min(v, period)


# -- ghost form ----------------------------------------------------------------


def ghost_gram(key, weight, d, cfg: KernelConfig):
  """(E) by the ghost form. ``key, weight: (B, T)``, ``d: (B, T, D)``.

  Blocked over pairs of examples so that the ``(rows, T, cols, T)`` kernel
  and mask stay under ``cfg.memory_budget_bytes``.
  """
  _, t, _ = d.shape
  acc = d.dtype

  def pairs(ki, wi, di, kj, dj):
    kd = jnp.einsum("itd,jsd->itjs", di, dj, precision=cfg.precision,
                    preferred_element_type=acc)
    match = ki[:, :, None, None] == kj[None, None, :, :]
    kd = jnp.where(match, kd, 0) * wi[:, :, None, None]
    return jnp.sum(kd, axis=(1, 3))
  per_pair = 3 * cost_model.size_hint(t) ** 2 * jnp.dtype(acc).itemsize
  # Symmetric: a pair of positions matches only at one key, whose weight
  # both share.
  return kernels.map_symmetric_pairs(pairs, (key, weight.astype(acc), d),
                                     (0, 2), per_pair, cfg)


def ghost_sq_norms(key, weight, d, cfg: KernelConfig):
  """Diagonal of (E) by the ghost form: ``~B T^2 D``."""
  b, t, _ = d.shape
  acc = d.dtype

  def rows(ki, wi, di):
    kd = jnp.einsum("itd,isd->its", di, di, precision=cfg.precision,
                    preferred_element_type=acc)
    match = ki[:, :, None] == ki[:, None, :]
    return jnp.sum(jnp.where(match, kd, 0) * wi[:, :, None], axis=(1, 2))
  per_row = 3 * cost_model.size_hint(t) ** 2 * jnp.dtype(acc).itemsize
  return kernels.map_row_blocks(
      rows, kernels.rows_per_block(b, per_row, cfg.memory_budget_bytes),
      (key, weight.astype(acc), d))


# -- per-example rows ----------------------------------------------------------


def dense_per_example(key, d, num_keys):
  """Per-example gradients ``(B, num_keys, D)`` by scatter-add (no weights)."""
  dim = d.shape[-1]
  rows = jnp.where(key >= 0, key, 0)  # d is zero where key < 0
  # One scatter per example: vmap keeps it sharding-friendly.
  return jax.vmap(lambda r, di: jnp.zeros((num_keys, dim), d.dtype)
                  .at[r].add(di))(rows, d)


def _key_weights(num_keys, vocab_size, lookup_style, ids_dtype, acc):
  """``w`` for every key ``0..num_keys-1`` (see :func:`lookup_keys`)."""
  keys = np.arange(num_keys)
  info = np.iinfo(ids_dtype)
  if lookup_style == "ONE_HOT" and vocab_size - 1 > info.max:
    period = 2 ** info.bits
    w = (vocab_size - 1 - keys) // period + 1
  else:
    w = np.ones_like(keys)
  return jnp.asarray(w, acc)


def dense_gram(key, d, key_weights, cfg: KernelConfig):
  f = dense_per_example(key, d, key_weights.shape[0])
  fw = f * key_weights[None, :, None]
  return kernels.gram_matmul(kernels.rows(fw), kernels.rows(f), cfg)


def segment_rows(key, weight, d):
  """Each example's gradient as its unique keys and summed rows.

  Returns ``(ukey, uweight, rows)``: ``ukey (B, T)`` sorted per example, the
  unused tail filled with a key larger than any real one; ``uweight (B, T)``
  their weights; ``rows (B, T, D)`` the sums of ``d`` over the positions
  sharing each key (zero in the tail).
  """
  b, t, _ = d.shape
  order = jnp.argsort(key, axis=1, stable=True)
  ks = jnp.take_along_axis(key, order, axis=1)
  ws = jnp.take_along_axis(weight, order, axis=1)
  ds = jnp.take_along_axis(d, order[:, :, None], axis=1)
  new = jnp.concatenate([jnp.ones((b, 1), bool), ks[:, 1:] != ks[:, :-1]],
                        axis=1)
  seg = jnp.cumsum(new, axis=1) - 1  # (B, T), in [0, T)

  def one(sg, ki, wi, di):
    # Every position of a segment has the same key and weight, so the
    # duplicate writes of .set agree.
    return (jnp.full((t,), _PAD_KEY, jnp.int32).at[sg].set(ki),
            jnp.zeros((t,), ws.dtype).at[sg].set(wi),
            jnp.zeros_like(di).at[sg].add(di))
  return jax.vmap(one)(seg, ks, ws, ds)


def segment_gram(key, weight, d, cfg: KernelConfig):
  """(E) by matching each example's unique keys against every other's.

  Blocked over pairs of examples so that the gathered ``(cols, rows, T, D)``
  rows stay under ``cfg.memory_budget_bytes``.
  """
  ukey, uweight, rows = segment_rows(key, weight, d)
  _, t, dim = rows.shape
  acc = rows.dtype
  uweight = uweight.astype(acc)
  def search_one(sorted_keys, q):  # searchsorted, side="left"
    if isinstance(t, int):
      return jnp.searchsorted(sorted_keys, q)
    # A symbolic length (jax.export), which jnp.searchsorted cannot take:
    # the count of smaller keys, every query against every key.
    return jnp.sum(sorted_keys[None, :] < q[:, None], axis=1)
  search = jax.vmap(search_one, in_axes=(0, None))

  def pairs(ki, wi, ri, kj, rj):
    r, c = ki.shape[0], kj.shape[0]
    pos = search(kj, ki.reshape(-1)).reshape(c, r, t)  # where, in kj[j]
    pos = jnp.minimum(pos, t - 1)
    found_key, other = jax.vmap(lambda k, rr, p: (k[p], rr[p]))(kj, rj, pos)
    hit = found_key == ki[None]  # (C, R, T)
    # other: (C, R, T, D), the rows of example j at those keys.
    dots = jnp.einsum("rtd,jrtd->jrt", ri, other, precision=cfg.precision)
    return jnp.sum(jnp.where(hit, dots, 0) * wi[None], axis=2).T  # (R, C)
  per_pair = cost_model.size_hint(t) * (2 * dim * jnp.dtype(acc).itemsize
                                       + 16)
  return kernels.map_symmetric_pairs(pairs, (ukey, uweight, rows), (0, 2),
                                     per_pair, cfg)


def segment_sq_norms(key, weight, d):
  _, uweight, rows = segment_rows(key, weight, d)
  return jnp.sum(jnp.sum(rows * rows, axis=-1) * uweight.astype(rows.dtype),
                 axis=1)


# -- the rule ------------------------------------------------------------------


def key_count(vocab_size: int, ids_dtype, lookup_style: str,
              scalar_ids: bool = False) -> int:
  """``num_keys`` of :func:`lookup_keys`, from the ids' dtype alone."""
  del scalar_ids  # (Scalar ids only change ARRAY_INDEX's keys, not V.)
  v = int(vocab_size)
  if lookup_style == "ONE_HOT":
    info = jnp.iinfo(ids_dtype)
    if v - 1 > info.max:  # iota(V) in the ids' dtype wraps.
      return min(v, 2 ** info.bits)
  return v


def _sizes(ids, g, example_dim: int):
  """``(B, T, D)``: examples, lookups per example, embedding width."""
  b = ids.shape[example_dim]
  others = ids.shape[:example_dim] + ids.shape[example_dim + 1:]
  return b, math.prod(others), g.shape[-1]


def cost(ids, g, params, example_dim: int, cfg: KernelConfig, *,
         mode: str = "gram", strategy: str = "auto", reuse: bool = True,
         lookup_style: str = "ARRAY_INDEX", scalar_ids: bool = False) -> str:
  """``"ghost"``, ``"dense"`` or ``"segment"``: the cost model's form of (E)
  for these shapes (:func:`cost_model.embed_method`)."""
  del reuse  # Nothing reuses the per-example gradients of a lookup.
  (embeddings,) = params
  b, t, dim = _sizes(ids, g, example_dim)
  acc = kernels.accumulation_dtype(embeddings.dtype, g.dtype)
  num_keys = key_count(embeddings.shape[0], ids.dtype, lookup_style,
                       scalar_ids)
  return cost_model.embed_method(
      b, t, dim, num_keys, jnp.dtype(acc).itemsize, mode=mode,
      strategy=strategy, cols=cfg.column_count(b),
      budget=cfg.memory_budget_bytes)


def _keys_and_rows(ids, g, embeddings, example_dim, lookup_style,
                   scalar_ids):
  acc = kernels.accumulation_dtype(embeddings.dtype, g.dtype)
  ids = jnp.moveaxis(ids, example_dim, 0)
  ids = kernels.rows(ids)
  d = jnp.moveaxis(g, example_dim, 0)
  d = kernels.rows(d, d.shape[-1])  # (B, T, M): one row per id
  key, weight, num_keys = lookup_keys(ids, embeddings.shape[0],
                                      lookup_style, scalar_ids)
  # A dropped lookup's cotangent never reaches the embeddings (even a NaN).
  d = jnp.where((weight > 0)[:, :, None], d.astype(acc), 0)
  return key, weight, d, num_keys, acc


def gram(ids, g, params, example_dim: int, cfg: KernelConfig, *,
         lookup_style: str = "ARRAY_INDEX",
         scalar_ids: bool = False) -> jax.Array:
  """``[B, B]`` Gram (E) of the embeddings' per-example gradients, by
  ``cfg.method`` (``"ghost"``, ``"dense"`` or ``"segment"``; None:
  :func:`cost`'s). ``ids``: integer ids, every axis leading."""
  (embeddings,) = params
  key, weight, d, num_keys, acc = _keys_and_rows(ids, g, embeddings,
                                                 example_dim, lookup_style,
                                                 scalar_ids)
  b, t, _ = d.shape
  if t == 0:
    return jnp.zeros((b, cfg.column_count(b)), acc)
  method = cfg.method or cost(ids, g, params, example_dim, cfg, mode="gram",
                              lookup_style=lookup_style,
                              scalar_ids=scalar_ids)
  if method == "ghost":
    # Where an example's ghost norm cancels (a key at several positions
    # with large, nearly opposite cotangents), its entries from the segment
    # sums instead.
    return kernels.loose_entries(_loose(key, weight, d, cfg),
                                 lambda: segment_gram(key, weight, d, cfg),
                                 ghost_gram(key, weight, d, cfg), cfg)
  if method == "dense":
    w = _key_weights(num_keys, embeddings.shape[0], lookup_style, ids.dtype,
                     acc)
    return dense_gram(key, d, w, cfg)
  return segment_gram(key, weight, d, cfg)


def sq_norms(ids, g, params, example_dim: int, cfg: KernelConfig, *,
             lookup_style: str = "ARRAY_INDEX",
             scalar_ids: bool = False) -> jax.Array:
  """``[B]`` diagonal of (E): ghost (``cfg.method == "ghost"``) or by the
  segment sums (any other method)."""
  (embeddings,) = params
  key, weight, d, _, acc = _keys_and_rows(ids, g, embeddings, example_dim,
                                          lookup_style, scalar_ids)
  b, t, _ = d.shape
  if t == 0:
    return jnp.zeros((b,), acc)
  method = cfg.method or cost(ids, g, params, example_dim, cfg, mode="norms",
                              lookup_style=lookup_style,
                              scalar_ids=scalar_ids)
  if cfg.upper_bound:
    return _sq_norm_bounds(key, weight, d, method, cfg)
  if method == "ghost":
    value = ghost_sq_norms(key, weight, d, cfg)
    # Per example (kernels.loose_fallback): no example's norm depends on
    # whether another's ghost norm cancels.
    return kernels.loose_fallback(_loose(key, weight, d, cfg, value),
                                  segment_sq_norms, value, (key, weight, d))
  return segment_sq_norms(key, weight, d)


def _ghost_slack(key, weight, d, cfg: KernelConfig):
  """The rounding bound of the ghost diagonal of (E)
  (:func:`gram_haiku._src.compute.norm_bounds.coarse_ghost_slack`; the keys'
  matches are exact)."""
  _, t, dim = d.shape
  return norm_bounds.coarse_ghost_slack(_triangle(key, weight, d), None, dim,
                                        t, d.dtype, cfg.precision)


def _loose(key, weight, d, cfg: KernelConfig, value=None):
  """``bool[B]``: where the ghost diagonal of (E) may have cancelled."""
  if value is None:
    value = ghost_sq_norms(key, weight, d, cfg)
  return norm_bounds.ghost(value, _ghost_slack(key, weight, d, cfg))[1]


def _triangle(key, weight, d):
  """``sum_t sqrt(w_t) |d_t|`` per example (``w_t``: the rows lookup ``t``
  adds to): at most the Frobenius norm of the absolute terms each entry of
  the per-example gradient sums."""
  del key
  return jnp.sum(jnp.sqrt(weight.astype(d.dtype)) * norm_bounds.row_norms(d),
                 axis=1)


def per_example_error(ids, g, params, example_dim: int, cfg: KernelConfig, *,
                      lookup_style: str = "ARRAY_INDEX",
                      scalar_ids: bool = False) -> jax.Array:
  """``[B]``: the rounding bound of the per-example gradients (each row a
  sum over the ``T`` lookups of its key) in norm units, ``e_T`` times
  :func:`_triangle`."""
  del cfg
  (embeddings,) = params
  key, weight, d, _, acc = _keys_and_rows(ids, g, embeddings, example_dim,
                                          lookup_style, scalar_ids)
  return norm_bounds.dot_error(d.shape[1], acc, lax.Precision.HIGHEST) * (
      _triangle(key, weight, d))


def _sq_norm_bounds(key, weight, d, method: str, cfg: KernelConfig):
  """Sound upper bounds of the diagonal of (E)
  (:mod:`gram_haiku._src.compute.norm_bounds`), with ``tri = sum_t sqrt(w_t)
  |d_t|``: the ghost value plus ``2 (e_D + e_{T^2}) tri^2`` where that is
  tight, else (that example's, :func:`kernels.loose_fallback`) the segment
  sums' bound: each summed row
  is off by at most ``e_T`` times the sum of its positions' ``|d_t|``;
  plus the allowance for results flushed to zero
  (:func:`gram_haiku._src.compute.norm_bounds.underflow_slack`)."""
  _, t, dim = d.shape
  acc = d.dtype
  tri = _triangle(key, weight, d)

  def segment(key, weight, d, tri):
    _, uweight, rows = segment_rows(key, weight, d)
    value = norm_bounds.sum_of_squares(
        rows * jnp.sqrt(uweight.astype(acc))[:, :, None])
    return norm_bounds.materialized(
        value, norm_bounds.squares_rel(t * dim, acc), tri, t, acc,
        lax.Precision.HIGHEST)

  if method != "ghost":
    out = segment(key, weight, d, tri)
  else:
    bound, loose = norm_bounds.ghost(ghost_sq_norms(key, weight, d, cfg),
                                     _ghost_slack(key, weight, d, cfg))
    # (The loose examples' segment bounds only: see kernels.loose_fallback.)
    out = kernels.loose_fallback(loose, segment, bound, (key, weight, d, tri))
  # Intermediates flushed to zero (norm_bounds' docstring: underflow): the
  # squares of a gradient below sqrt(tiny) flush, and with them the bound
  # (it was 0 for cotangents near 1e-36). The key matches are exact, so
  # the allowance is a linear map's with one input of the lookup's weight.
  mx = jnp.sqrt(jnp.max(weight, axis=1, initial=0).astype(acc))
  md = jnp.max(jnp.abs(d), axis=(1, 2), initial=0)
  return out + norm_bounds.underflow_slack(t, 1, dim, mx, md)


def factors_exact(ids, params, dtype) -> bool:
  """Ids cast to a float ``dtype`` look up the same rows while the
  vocabulary fits its mantissa: in-range ids are exact, and out-of-range
  ones stay out of range (they round away from the table)."""
  del ids
  vocab = params[0].shape[0]
  return vocab <= 2 ** (jnp.finfo(dtype).nmant + 1)


def embed_rule(lookup_style: str = "ARRAY_INDEX", precision=None,
               scalar_ids: bool = False) -> Rule:
  """``hk.Embed``'s rule, parameter ``(embeddings,)``: a lookup by
  ``lookup_style`` (``"ARRAY_INDEX"``, a gather, or ``"ONE_HOT"``, a
  one-hot matmul at ``precision``) of ids with any leading axes
  (``scalar_ids``: one id, no axes). ``feature_ndim=0`` (every axis of the
  ids is leading), sharding-aware; per-example gradients by the default
  ``vmap`` of the lookup's VJP (``B x V x D``, the size of the
  ``"per_example"`` probe anyway)."""
  style = dict(lookup_style=lookup_style, scalar_ids=scalar_ids)
  return Rule(
      forward=functools.partial(embed_forward, precision=precision, **style),
      param_names=("embeddings",), feature_ndim=0,
      gram=functools.partial(gram, **style),
      sq_norms=functools.partial(sq_norms, **style),
      per_example_error=functools.partial(per_example_error, **style),
      cost=functools.partial(cost, **style), factors_exact=factors_exact,
      sharding_aware=True)


def layer_rule(ids, lookup_style: str = "ARRAY_INDEX",
               precision=None) -> Rule:
  """:func:`embed_rule` for a lookup of these ``ids`` (checked: integer
  ids, a supported style; ``precision`` dropped where the lookup does not
  use it, so that equal lookups have equal rules).

  Raises:
    ValueError: for non-integer ids.
    NotImplementedError: for an unknown ``lookup_style``.
  """
  if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
    raise ValueError("gram_embed takes integer ids, got an array of "
                     f"{jnp.result_type(ids)}.")
  if lookup_style not in LOOKUP_STYLES:
    raise NotImplementedError(f"{lookup_style} is not supported by hk.Embed.")
  if lookup_style == "ARRAY_INDEX":
    precision = None  # Unused by the gather; keeps the rule canonical.
  return embed_rule(lookup_style=lookup_style, precision=precision,
                    scalar_ids=jnp.ndim(ids) == 0)


def gram_embed(ids: jax.Array, embeddings: jax.Array, probe: jax.Array, *,
               lookup_style: str = "ARRAY_INDEX",
               precision: lax.Precision | None = None, name: str = "embed",
               example_axis: ExampleAxisSpec | ExampleAxis = None,
               strategy: str = "auto", mode: str = "gram",
               memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
               plan: Optional[Plan] = None) -> jax.Array:
  """``hk.Embed``'s lookup whose backward pass writes the Gram into ``probe``.

  Args:
    ids: integer ids; every axis is a leading axis (the example axis, see
      ``example_axis``, and within-example axes such as the sequence).
    embeddings: ``[V, D]`` embedding matrix.
    probe: zeros: ``[B, B]`` for ``mode="gram"``, ``[B]`` for ``"norms"``,
      ``[B, V*D]`` for ``"per_example"``; float32 (float64 under x64).
    lookup_style: ``"ARRAY_INDEX"`` (gather) or ``"ONE_HOT"`` (one-hot
      matmul), as ``hk.EmbedLookupStyle``.
    precision: the ``jnp.dot`` precision of ``ONE_HOT`` (``hk.Embed``'s
      default is ``HIGHEST``); unused by ``ARRAY_INDEX``.
    name: module name used in error messages.
    example_axis: which axis is the example axis (as
      :func:`gram_haiku.ops.gram_linear`; axis 0 of ``ids`` by default).
    strategy: ``"auto"``, ``"ghost"`` or ``"materialize"`` (the ghost,
      dense and segment forms; see "Embeddings" in the Layers docs).
    mode: ``"gram"``, ``"norms"`` or ``"per_example"``.
    memory_budget_bytes, plan: as :func:`gram_haiku.ops.gram_linear`.

  Returns:
    ``ids.shape + (D,)``, exactly ``hk.Embed``'s output. The cotangent of
    ``probe`` is ``G[i, j] = sum_{t,s} [id_it = id_js] d_it . d_js`` over the
    lookups that have a gradient (an id outside ``[0, V)`` that the lookup
    clamps has none; see "Embeddings" in the Layers docs).

  Raises:
    ValueError: for non-integer ids, an unknown strategy or mode; at
      differentiation time when ``probe`` has the wrong shape.
  """
  if plan is None:
    plan = Plan.make(mode=mode, strategy=strategy, example_axis=example_axis,
                     memory_budget_bytes=memory_budget_bytes)
  ids = jnp.asarray(ids)
  return op_lib.bind(layer_rule(ids, lookup_style, precision), ids,
                     (embeddings,), probe, name=name, plan=plan)
