"""The example-flow analysis's rules: one plain function per primitive, in
one table (:data:`RULES`, keyed by primitive, in the style of JAX's
``primitive_batchers``).

Each rule ``rule(ctx, eqn, ins) -> outs`` maps the states
(:mod:`gram_haiku._src.analysis.flow_states`) of a primitive's inputs to those of
its outputs; ``ctx`` is the analysis's context (the interpreter of
:mod:`gram_haiku._src.analysis.example_flow`: the batch size, ``strict``, the
current equation's dependences on the parameters, and the helpers that
record what the rules find). A primitive without a rule gives ``UNKNOWN``
where the examples reach it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional

import numpy as np

from gram_haiku._src.analysis.flow_states import CONST
from gram_haiku._src.analysis.flow_states import Ex
from gram_haiku._src.analysis.flow_states import MIXED
from gram_haiku._src.analysis.flow_states import Rows
from gram_haiku._src.analysis.flow_states import rows_of as _rows_of
from gram_haiku._src.analysis.flow_states import shape as _shape
from gram_haiku._src.analysis.flow_states import SUM
from gram_haiku._src.analysis.flow_states import UNKNOWN
from gram_haiku._src.analysis.flow_states import with_rows as _with_rows
from gram_haiku._src.compat import hijax_compat as hx


# -- layout, reductions and ops along one axis --------------------------------
# Layout (broadcasts, transposes, reshapes), reductions and ops along one axis
# (cumulative sums, sorts, splits, stacks, FFTs, concatenation, padding,
# ``top_k``).


def _broadcast_in_dim(ctx, eqn, ins):
  s = ins[0]
  if isinstance(s, Ex):
    dim = eqn.params["broadcast_dimensions"][s.dim]
    before = _shape(eqn.invars[0])[s.dim]
    after = _shape(eqn.outvars[0])[dim]
    if before != after:
      # A length-1 example axis repeated (``q[None]`` of one row met with
      # a batch): every row is that one row's.
      return [ctx._reorder(dataclasses.replace(s, dim=dim),
                            ("broadcast", ctx.eqn_key(eqn)))]
    return [dataclasses.replace(s, dim=dim)]
  return [s]


def _transpose(ctx, eqn, ins):
  s = ins[0]
  if isinstance(s, Ex):
    return [dataclasses.replace(
        s, dim=list(eqn.params["permutation"]).index(s.dim))]
  return [s]


def _squeeze(ctx, eqn, ins):
  s = ins[0]
  if isinstance(s, Ex):
    dims = [d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"]]
    if s.dim in dims:
      # One example's values (``h[0]``) with no example axis left: a
      # linear combination of the examples, like a sum over them.
      return [ctx._combined(s, SUM)]
    return [dataclasses.replace(s, dim=s.dim - sum(d < s.dim for d in dims))]
  return [s]


def _expand_dims(ctx, eqn, ins):
  s = ins[0]
  if isinstance(s, Ex):
    dim = s.dim
    for d in sorted(eqn.params["dimensions"]):
      if d <= dim:
        dim += 1
    return [dataclasses.replace(s, dim=dim)]
  return [s]


def _reshape(ctx, eqn, ins):
  s = ins[0]
  if not isinstance(s, Ex):
    return [s]
  old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
  dims = eqn.params.get("dimensions")
  if dims is not None:
    # The operand's axes read in the order ``dims`` (order="F"): a
    # transpose, then a row-major reshape.
    s = dataclasses.replace(s, dim=list(dims).index(s.dim))
    old = tuple(old[d] for d in dims)
  # Row-major: the example factor (B, or a candidate's own size) has
  # stride `stride`.
  size = old[s.dim] // (s.inner * s.outer)
  stride = s.inner * math.prod(old[s.dim + 1:])
  if size == 0 or stride == 0:
    return [UNKNOWN]  # Empty: nothing to follow.
  for k in range(len(new)):
    suffix = math.prod(new[k + 1:])
    if stride % suffix == 0 and (suffix * new[k]) % (stride * size) == 0:
      inner = stride // suffix
      return [dataclasses.replace(s, dim=k, inner=inner,
                                  outer=new[k] // (inner * size))]
  if (s.inner == s.outer == 1 and s.tag is None and
      ctx.log.split_examples is None):
    # The examples' rows split into (b, k): perhaps k views of each of b
    # examples (augmentation multiplicity), which the errors then name.
    lead = math.prod(old[:s.dim])
    for k in range(len(new) - 1):
      if (math.prod(new[:k]) == lead and new[k] * new[k + 1] == size and
          1 < new[k + 1] < size):
        ctx.log.split((size, new[k], new[k + 1], ctx.user_line(eqn)))
        break
  return [MIXED]


def _reduce(ctx, eqn, ins, linear: bool):
  s = ins[0]
  axes = tuple(eqn.params["axes"])
  if isinstance(s, Ex):
    if s.dim in axes:
      return [ctx._combined(s, SUM if linear else MIXED)]
    return [dataclasses.replace(s, dim=s.dim - sum(a < s.dim for a in axes))]
  if s == SUM and not linear:
    return [MIXED]
  return [s]


def _reduce_sum(ctx, eqn, ins):
  return _reduce(ctx, eqn, ins, linear=True)


def _reduce_max(ctx, eqn, ins):
  return _reduce(ctx, eqn, ins, linear=False)


_reduce_prod = _reduce_max
_reduce_or = _reduce_max
_argmin = _reduce_max


def _along(ctx, eqn, ins, axis_param, on_examples):
  """Ops acting along one axis: ``on_examples(s)`` when it is the
  examples' axis."""
  s = ins[0]
  if not isinstance(s, Ex):
    return [s if s != SUM else MIXED] * len(eqn.outvars)
  axes = eqn.params[axis_param]
  axes = axes if isinstance(axes, (tuple, list)) else (axes,)
  ndim = len(_shape(eqn.invars[0]))
  out = (ctx._combined(s, on_examples(s))
         if s.dim in [a % ndim for a in axes] else s)
  return [out] * len(eqn.outvars)


def _cumsum(ctx, eqn, ins):
  # Prefix sums over the examples: linear combinations of them.
  return _along(ctx, eqn, ins, "axis", lambda s: SUM)


def _cumprod(ctx, eqn, ins):
  return _along(ctx, eqn, ins, "axis", lambda s: MIXED)


def _rev(ctx, eqn, ins):
  size = lambda s: _shape(eqn.invars[0])[s.dim]
  return _along(ctx, eqn, ins, "dimensions", lambda s: ctx._pick(
      s, range(size(s) - 1, -1, -1), size(s)))


def _sort(ctx, eqn, ins):
  states = [s for s in ins if s != CONST]
  out = states[0]
  for s in states[1:]:
    out = ctx.join(out, s)
  if out == SUM:
    # Linear combinations of the examples (segment sums) in order of
    # value: what follows (the largest) is a choice among them.
    return [MIXED] * len(eqn.outvars)
  if isinstance(out, Ex) and out.dim == eqn.params["dimension"]:
    if any(ctx._deps[:eqn.params["num_keys"]]):
      # Rows ordered by values that depend on the parameters: what
      # follows (the last row, a weighted sum) is a choice among the
      # examples, like a maximum (jnp.sort(l)[-1]); refused as one.
      return [MIXED] * len(eqn.outvars)
    out = ctx._reorder(out, ("sort", ctx.eqn_key(eqn)))  # by the data
  return [out] * len(eqn.outvars)


def _split(ctx, eqn, ins):
  s = ins[0]
  if isinstance(s, Ex) and s.dim == eqn.params["axis"]:
    size = _shape(eqn.invars[0])[s.dim]
    starts = (0,) + tuple(itertools.accumulate(eqn.params["sizes"]))
    return [ctx._pick(s, range(starts[k], starts[k + 1]), size)
            for k in range(len(eqn.outvars))]
  return [s] * len(eqn.outvars)


def _stack(ctx, eqn, ins):
  axis = eqn.params["axis"]
  out = CONST
  for x in ins:
    out = ctx.join(out, x)
  if isinstance(out, Ex) and out.dim >= axis:
    out = dataclasses.replace(out, dim=out.dim + 1)
  return [out]


def _unstack(ctx, eqn, ins):
  s = ins[0]
  axis = eqn.params["axis"] % len(_shape(eqn.invars[0]))
  n = len(eqn.outvars)
  if isinstance(s, Ex):
    if s.dim == axis:  # One example per output.
      return [ctx._combined(s, SUM)] * n
    return [dataclasses.replace(s, dim=s.dim - (s.dim > axis))] * n
  return [s] * n


def _fft(ctx, eqn, ins):
  s = ins[0]
  ndim = len(_shape(eqn.invars[0]))
  transformed = range(ndim - len(eqn.params["fft_lengths"]), ndim)
  if isinstance(s, Ex) and s.dim in transformed:
    return [ctx._combined(s, MIXED)]
  return [s if s != SUM else MIXED]


def _concatenate(ctx, eqn, ins):
  dim = eqn.params["dimension"]
  if dim == len(_shape(eqn.outvars[0])) - 1:
    # Perhaps an index array (x[rows, cols]): its columns' sources.
    ctx._pieces[(ctx.site, id(eqn.outvars[0]))] = [
        (s, v, _shape(v)[dim]) for s, v in zip(ins, eqn.invars)]
  if any(isinstance(s, Ex) and s.dim == dim for s in ins):
    return [_concatenate_examples(ctx, eqn, ins, dim)]
  out = CONST
  for s in ins:
    out = ctx.join(out, s)
  return [out]


def _concatenate_examples(ctx, eqn, ins, dim: int):
  """A concatenation along the examples' axis of some operand."""
  if any(s in (MIXED, SUM) for s in ins):
    return MIXED
  if any(s == UNKNOWN for s in ins):
    return UNKNOWN
  rows = [_rows_of(x, _shape(v)[dim]) if isinstance(x, Ex) and
          x.dim == dim else None for x, v in zip(ins, eqn.invars)]
  first = ins[0]
  if all(r is not None for r in rows) and all(
      (x.dim, x.inner, x.outer) == (first.dim, first.inner, first.outer)
      for x in ins):
    # Pieces whose rows are known, put back together (h[:2], h[2:]).
    return _with_rows(first, (r for piece in rows for r in piece), ctx.batch)
  real = None
  for x in ins:
    if isinstance(x, Ex) and x.tag is not None:
      ctx.log.reordered(x.tag)  # A candidate's rows among others.
      ctx._combined(x, CONST)
    elif isinstance(x, Ex) and real is None:
      real = x
  return (CONST if real is None else
          ctx._reorder(real, ("concat", ctx.eqn_key(eqn))))


def _pad(ctx, eqn, ins):
  s = ins[0]
  if isinstance(s, Ex) and tuple(eqn.params["padding_config"][s.dim]) != (
      0, 0, 0):
    return [MIXED]
  return [ctx.join(s, ins[1]) if ins[1] != CONST else s]


def _top_k(ctx, eqn, ins):
  s = ins[0]
  if isinstance(s, Ex) and s.dim == len(_shape(eqn.invars[0])) - 1:
    return [MIXED] * len(eqn.outvars)  # the top examples of the batch
  return [s if s != SUM else MIXED] * len(eqn.outvars)


# -- subsets and writes -------------------------------------------------------
# Subsets and writes: slices, gathers, scatters and ``dynamic_update_slice``.


def _dynamic_update_slice(ctx, eqn, ins):
  operand, update, *index = ins
  if any(i != CONST for i in index):
    return [MIXED if MIXED in ins else UNKNOWN]
  shape, update_shape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
  full = [u == n for u, n in zip(update_shape, shape)]
  return [_write(ctx, operand, update, full, list(range(len(shape))))]


def _rows_by_data_index(ctx, eqn, operand: Ex, indices: Ex, dn):
  """A gather of the parameters' rows by an index array holding data
  (``logp[rows, labels]``): does each index row pick its own example's
  row? Returns True when the row column is known (on the host) to be
  ``0 .. B - 1`` along the examples' axis: the output then holds the
  operand's rows in the operand's order, each read with its own
  example's data (its label). Otherwise each output row pairs a row of
  the outputs picked by the index with the data of the index's own row
  (``logp[arange(B)[::-1], labels]``, ``logp.ravel()[i * C + labels]``):
  recorded as a pairing with other examples' data (refused), unless the
  rows are picked by the index alone (``out[idx]``: rows in an order the
  program does not show, checked where they meet data; returns None).
  """
  k = list(dn.start_index_map).index(operand.dim)
  n = _shape(eqn.invars[1])[-1]
  merged = operand.inner != 1 or operand.outer != 1
  cols = ctx.index_columns(eqn.invars[1], n)
  if cols is not None and not merged:
    _, rows = cols[k]
    if rows is not None and _picks_own_rows(rows, indices.dim, ctx.batch):
      ctx.check_pairing(eqn, operand.order, indices.order)
      return True
    if len(cols) == 1 or all(s == CONST for j, (s, _) in enumerate(cols)
                             if j != k):
      return None  # Rows picked by the index alone: out[idx], x[idx, 0].
  elif n == 1 and not merged:
    return None
  ctx.check_pairing(eqn, ("gather", ctx.eqn_key(eqn)), indices.order)
  return None


def _scatter(ctx, eqn, ins):
  operand, indices, updates = ins[:3]
  if indices != CONST or len(ins) != 3:
    if not any(ctx._deps):
      # Input data written by per-example indices (one-hot labels with
      # .at[arange(B), labels].set(1.0)): data of several examples, which
      # the interpreter treats as data (and refuses under ``strict``).
      return [MIXED]
    return [MIXED if MIXED in ins else UNKNOWN]
  dn = eqn.params["dimension_numbers"]
  if getattr(dn, "operand_batching_dims", ()):
    return [UNKNOWN]
  ndim = len(_shape(eqn.invars[0]))
  indexed = set(dn.scatter_dims_to_operand_dims) | set(
      dn.inserted_window_dims)
  window = [k for k in range(ndim) if k not in dn.inserted_window_dims]
  # Operand axis -> update axis, for the axes written whole (window axes
  # that no index selects).
  full = [k not in indexed for k in range(ndim)]
  to_update = [dn.update_window_dims[window.index(k)] if k in window
               else None for k in range(ndim)]
  out = _write(ctx, operand, updates, full, to_update)
  if (out == MIXED and eqn.primitive.name == "scatter-add" and
      operand == CONST and isinstance(updates, Ex)):
    rows = _segments_by_example(ctx, eqn, updates)
    if rows is not None:
      return [rows]
    # Rows of the examples added into constant-indexed places
    # (jax.ops.segment_sum of per-token losses into per-example ones): a
    # linear combination of the examples' values, so a sum of it is a sum
    # of per-example terms; a nonlinear function of it is not known to
    # be one.
    return [ctx._combined(updates, SUM)]
  return [out]


def _segments_by_example(ctx, eqn, updates: Ex) -> Optional[Ex]:
  """A segment sum whose every segment holds one example's rows.

  ``jax.ops.segment_sum(per_token, ids, num_segments=B)`` (a scatter-add
  into zeros) with ``ids`` known on the host (:mod:`const_eval`): where
  each segment gathers rows of one example only, and each example fills
  one segment, the result holds the examples along the segments' axis,
  one row each (in the order the ids give), so a per-example weight or
  any function of a row stays per-example. Else None (the caller keeps the
  result a sum over the examples).
  """
  ids = _segment_ids(ctx, eqn, updates)
  if ids is None:
    return None
  dn = eqn.params["dimension_numbers"]
  seg_axis = dn.scatter_dims_to_operand_dims[0]
  num_segments = _shape(eqn.invars[0])[seg_axis]
  size = _shape(eqn.invars[2])[updates.dim]
  if (num_segments != ctx.batch or ids.shape[0] != size or
      size != updates.outer * ctx.batch * updates.inner):
    return None
  if ids.min() < 0 or ids.max() >= num_segments:
    return None  # dropped or clipped, by the scatter's mode
  owner = _segment_owners(ids, (np.arange(size) // updates.inner) %
                          ctx.batch, num_segments, ctx.batch)
  if owner is None:
    return None
  # The operand's axes other than the segments' are the update's window
  # axes, in order: the segments' axis takes the examples.
  s = Ex(dim=seg_axis)
  return _with_rows(s, (owner[k] for k in range(num_segments)), ctx.batch)


def _segment_ids(ctx, eqn, updates: Ex):
  """A scatter's segment ids (one per row of the updates' examples' axis,
  known on the host), where it is a segment sum of rows of the examples in
  the batch's order; else None."""
  dn = eqn.params["dimension_numbers"]
  ids = ctx._value_of(eqn.invars[1])
  if (ids is None or updates.tag is not None or updates.order is not None
      or len(dn.scatter_dims_to_operand_dims) != 1
      or tuple(dn.inserted_window_dims) != tuple(
          dn.scatter_dims_to_operand_dims)
      or getattr(dn, "operand_batching_dims", ())
      or updates.dim in dn.update_window_dims):
    return None
  scatter_axes = [d for d in range(len(_shape(eqn.invars[2])))
                  if d not in dn.update_window_dims]
  if scatter_axes != [updates.dim] or ids.ndim != 2 or ids.shape[1] != 1:
    return None
  return ids[:, 0].astype(np.int64)


def _segment_owners(ids, example, num_segments: int, batch: int):
  """Segment -> the one example whose rows it gathers, where each segment
  gathers one example's rows and each example fills one segment; else
  None."""
  owner = {}
  for seg, ex in zip(ids.tolist(), example.tolist()):
    if owner.setdefault(seg, ex) != ex:
      return None  # a segment mixing examples
  if sorted(owner) != list(range(num_segments)) or sorted(
      owner.values()) != list(range(batch)):
    return None
  return owner


def _write(ctx, operand, update, full, to_update):
  """``operand`` with ``update`` written into part of it (a scatter, a
  dynamic_update_slice). ``full[k]``: operand axis ``k`` is written whole
  (no index selects along it); ``to_update[k]``: the update's axis that
  fills operand axis ``k`` (None if none)."""
  if update == CONST:
    # Constants written into some rows: each row is still its own
    # example's (or constant); into all rows of an axis the same.
    return operand
  if not isinstance(update, Ex):
    return MIXED if update in (MIXED, SUM) else UNKNOWN
  dims = [k for k, u in enumerate(to_update) if u == update.dim]
  if len(dims) != 1 or not full[dims[0]]:
    # The examples written at selected rows (a permutation, a subset).
    return MIXED
  written = dataclasses.replace(update, dim=dims[0])
  if operand == CONST:
    return written
  return ctx.join(operand, written)


def _slice(ctx, eqn, ins):
  s = ins[0]
  if isinstance(s, Ex):
    start = eqn.params["start_indices"][s.dim]
    limit = eqn.params["limit_indices"][s.dim]
    strides = eqn.params["strides"]
    step = strides[s.dim] if strides else 1
    size = _shape(eqn.invars[0])[s.dim]
    if (start, limit, step) != (0, size, 1):
      # A subset of the examples, or reordered.
      return [ctx._pick(s, range(start, limit, step), size)]
  return [s]


def _dynamic_slice(ctx, eqn, ins):
  s = ins[0]
  if any(i != CONST for i in ins[1:]):
    return [MIXED if MIXED in ins else UNKNOWN]  # data-dependent start
  if isinstance(s, Ex):
    full = _shape(eqn.invars[0])[s.dim] == eqn.params["slice_sizes"][s.dim]
    if full:
      return [s]
    # The same rows wherever the start indices are equal by construction
    # (equal constants; one value read twice).
    return [ctx._reorder(s, (
        "dynamic_slice", _shape(eqn.invars[0])[s.dim],
        eqn.params["slice_sizes"][s.dim],
        tuple(ctx.origin(v) for v in eqn.invars[1:])))]
  return [s]


def _gather(ctx, eqn, ins):
  operand, indices = ins[0], ins[1]
  if MIXED in (operand, indices):
    return [MIXED]
  if UNKNOWN in (operand, indices) or SUM in (operand, indices):
    return [UNKNOWN if SUM not in (operand, indices) else MIXED]
  if isinstance(indices, Ex):
    return [_gather_by_example_indices(ctx, eqn, operand, indices)]
  return [_gather_by_constant_indices(ctx, eqn, operand)]


def _gather_out_dim(eqn, d: int) -> Optional[int]:
  """The output position of a gather's indices axis ``d`` (output dims not
  in ``offset_dims`` follow the indices' dims but the last, the index
  vector, in order); None for the index vector."""
  dn = eqn.params["dimension_numbers"]
  out_ndim = len(_shape(eqn.outvars[0]))
  idx_ndim = len(_shape(eqn.invars[1]))
  batch_dims = [k for k in range(out_ndim) if k not in dn.offset_dims]
  return batch_dims[d] if d < idx_ndim - 1 and d < len(batch_dims) else None


def _gather_by_example_indices(ctx, eqn, operand, indices: Ex):
  """A gather whose indices hold the examples."""
  dn = eqn.params["dimension_numbers"]
  op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  out = _gather_out_dim(eqn, indices.dim)
  if out is None:
    return MIXED
  if operand == CONST:  # a table looked up by per-example ids
    return dataclasses.replace(indices, dim=out)
  e = operand.dim
  if e in dn.start_index_map and eqn.params["slice_sizes"][e] != 1:
    return MIXED  # Each index picks a window of several examples' rows.
  if (ctx._deps[0] and not ctx._deps[1] and operand.tag is None and
      indices.tag is None and e in dn.start_index_map):
    own = _rows_by_data_index(ctx, eqn, operand, indices, dn)
    if own is not None:
      return dataclasses.replace(operand, dim=out)
  aligned = (e in op_batching and
             idx_batching[op_batching.index(e)] == indices.dim and
             operand.order == indices.order)
  if operand.tag is not None and indices.tag is None:
    # A candidate meets the examples (indices): settled here.
    ctx.log.verdict(operand.tag, aligned)
    return dataclasses.replace(indices, dim=out)
  if aligned:  # take_along_axis: each example indexes its own row.
    return dataclasses.replace(operand, dim=out)
  if e in dn.start_index_map:
    # Rows picked by per-example indices (x[perm], o[arange(B), t]):
    # one example each, in an order the program does not show.
    return ctx._reorder(dataclasses.replace(operand, dim=out),
                        ("gather", ctx.origin(eqn.invars[1]),
                         str(eqn.params.get("mode"))))
  return MIXED


def _gather_by_constant_indices(ctx, eqn, operand: Ex):
  """A gather of the examples' rows by constant indices."""
  dn = eqn.params["dimension_numbers"]
  collapsed = tuple(getattr(dn, "collapsed_slice_dims", ()))
  op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  if operand.dim in op_batching:
    # Batched along the examples (take_along_axis with constant indices):
    # each example indexes its own row.
    out = _gather_out_dim(eqn, idx_batching[op_batching.index(operand.dim)])
    return UNKNOWN if out is None else dataclasses.replace(operand, dim=out)
  if operand.dim in dn.start_index_map or operand.dim in collapsed:
    batch_dims = [k for k in range(len(_shape(eqn.outvars[0])))
                  if k not in dn.offset_dims]
    if tuple(dn.start_index_map) == (operand.dim,) and batch_dims and (
        operand.dim in collapsed):
      return ctx._reorder(dataclasses.replace(operand, dim=batch_dims[0]),
                          ("gather", ctx.origin(eqn.invars[1]),
                           str(eqn.params.get("mode"))))
    return MIXED
  full = eqn.params["slice_sizes"][operand.dim] == _shape(
      eqn.invars[0])[operand.dim]
  if not full:
    return MIXED
  kept = [d for d in range(len(_shape(eqn.invars[0])))
          if d not in collapsed and d not in op_batching]
  return dataclasses.replace(operand,
                             dim=dn.offset_dims[kept.index(operand.dim)])


# -- contractions and windows -------------------------------------------------
# Contractions and windows: ``dot_general``, convolutions, ``reduce_window``.


def _dot_roles(eqn, ins) -> list[tuple]:
  """Per operand of a ``dot_general``: ``("plain", state)`` where it does
  not hold the examples, else ``(role, position, state)`` for the role of
  its examples' axis: ``"contracted"`` (its position among the contracting
  dims), ``"batch"`` (among the batch dims) or ``"free"`` (its output
  axis)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lnd, rnd = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
  lfree = [d for d in range(lnd) if d not in lc and d not in lb]
  rfree = [d for d in range(rnd) if d not in rc and d not in rb]
  # Output axes: the batch dims, the lhs's free dims, the rhs's.
  free_at = (len(lb), len(lb) + len(lfree))
  roles = []
  for side, s, contract, batch, free in ((0, ins[0], lc, lb, lfree),
                                         (1, ins[1], rc, rb, rfree)):
    if not isinstance(s, Ex):
      roles.append(("plain", s))
    elif s.dim in contract:
      roles.append(("contracted", list(contract).index(s.dim), s))
    elif s.dim in batch:
      roles.append(("batch", list(batch).index(s.dim), s))
    else:
      roles.append(("free", free_at[side] + free.index(s.dim), s))
  return roles


def _dot_of_one(ctx, role: tuple):
  """A ``dot_general`` where one operand holds the examples (the other is
  constant)."""
  kind, pos, s = role
  if kind == "contracted":
    return ctx._combined(s, SUM)
  return dataclasses.replace(s, dim=pos)


def _dot_of_two(ctx, ex: list[tuple]):
  """A ``dot_general`` where both operands hold examples."""
  (k1, p1, s1), (k2, p2, s2) = ex
  if (s1.tag is None) != (s2.tag is None):
    # A candidate meets the examples: right only along a shared batch dim.
    cand, real = (ex[0], ex[1]) if s1.tag is not None else (ex[1], ex[0])
    right = cand[0] == real[0] == "batch" and cand[1] == real[1]
    ctx.log.verdict(cand[2].tag, right)
    kind, pos, s = real
    return SUM if kind == "contracted" else dataclasses.replace(s, dim=pos)
  # The same examples (in the same order, merged alike) paired by one
  # batch or contracting dimension; each operand may hold them on an axis
  # of its own (q (B, T, D) against keys (T, B, D), batch dims (0, 1)).
  same = dataclasses.replace(s1, dim=0) == dataclasses.replace(s2, dim=0)
  if k1 == k2 == "batch" and p1 == p2 and same:
    return dataclasses.replace(s1, dim=p1)
  if k1 == k2 == "contracted" and p1 == p2 and same:
    return SUM  # sum_i f(x_i) g(x_i)
  return MIXED  # e.g. x x^T over the batch: pairs of examples


def _dot_general(ctx, eqn, ins):
  roles = _dot_roles(eqn, ins)
  plain = [r[1] for r in roles if r[0] == "plain"]
  if MIXED in plain:
    return [MIXED]
  if UNKNOWN in plain:
    return [UNKNOWN]
  if SUM in plain:
    # A sum over the examples times constants is still one; times one
    # example's values (or another sum) it is not.
    return [SUM if plain.count(CONST) == 1 else MIXED]
  ex = [r for r in roles if r[0] != "plain"]
  if not ex:
    return [CONST]
  if len(ex) == 1:
    return [_dot_of_one(ctx, ex[0])]
  return [_dot_of_two(ctx, ex)]


def _conv_general_dilated(ctx, eqn, ins):
  lhs, rhs = ins[0], ins[1]
  dn = eqn.params["dimension_numbers"]
  if (lhs == CONST and isinstance(rhs, Ex) and rhs.dim == dn.rhs_spec[0]
      and eqn.params.get("feature_group_count", 1) == 1
      and eqn.params.get("batch_group_count", 1) == 1):
    # Per-example kernels (jax.vmap of a convolution whose kernel is an
    # example's): the examples lie along the kernel's output features, and
    # output feature o reads kernel feature o alone.
    return [dataclasses.replace(rhs, dim=dn.out_spec[1])]
  if rhs not in (CONST,):
    return [MIXED if rhs == MIXED or isinstance(rhs, Ex) else UNKNOWN]
  if not isinstance(lhs, Ex):
    return [lhs]
  if lhs.dim != dn.lhs_spec[0] or eqn.params.get("batch_group_count", 1) != 1:
    return [MIXED]
  return [dataclasses.replace(lhs, dim=dn.out_spec[0])]


def _reduce_window(ctx, eqn, ins):
  s = ins[0]
  if not isinstance(s, Ex):
    return [s if s != SUM else MIXED] * len(eqn.outvars)
  d = s.dim
  window = eqn.params["window_dimensions"][d]
  stride = eqn.params["window_strides"][d]
  pad = tuple(eqn.params["padding"][d])
  if (window, stride, pad) != (1, 1, (0, 0)):
    return [MIXED] * len(eqn.outvars)  # pooling across examples
  return [s] * len(eqn.outvars)


def _rounds(carry) -> int:
  """Rounds enough for a loop's carries to reach their fixed point: each
  round that changes something moves a carry up the lattice (``CONST`` <
  ``Ex`` < ``SUM``/``UNKNOWN`` < ``MIXED``, at most four steps each)."""
  return 4 * len(carry) + 2


# -- control flow: branches joined, loop carries to a fixed point -------------
# ``cond``, ``scan`` and ``while``: branches joined, loop carries to a fixed
# point.


def _carried(ctx, eqn, outs):
  """A loop body's carries as the next round reads them. Rows reordered
  by a key of this round's values (``dynamic_slice`` at the loop counter,
  rows picked by an index computed in the body) are not in the next
  round's order of the same key: they get a key of their own, so that a
  row carried over a round meets another round's data as another order
  (``prev`` from round ``t - 1`` with ``y[t]``)."""
  fixed = []
  for k, s in enumerate(outs):
    if (isinstance(s, Ex) and s.order is not None and
        not isinstance(s.order, Rows)):
      s = dataclasses.replace(s, order=("carried", ctx.eqn_key(eqn), k))
    fixed.append(s)
  return fixed


def _cond(ctx, eqn, ins):
  index, ops = ins[0], ins[1:]
  deps = list(ctx._deps)  # follow() below moves ctx._deps on
  outs = None
  for branch in hx.cond_branches(eqn):
    res = ctx.follow(branch, ops, deps[1:], site=ctx.eqn_key(eqn))
    outs = (res if outs is None else
            [ctx.join(a, b) for a, b in zip(outs, res)])
  if index in (SUM, MIXED) or (ctx.strict and index != CONST):
    # One branch for the whole batch, chosen from values that depend on
    # several examples (or on values not shown to be one example's):
    # each example alone could take another one. Under ``strict`` that
    # holds for a constant chosen so as well (a scale picked by example
    # 0's data is other examples' data for every example).
    outs = [MIXED if o != CONST or ctx.strict else o for o in outs]
  elif index == UNKNOWN:
    outs = [ctx.join(o, UNKNOWN) if o != CONST else o for o in outs]
  return outs


def _scan(ctx, eqn, ins):
  body, n_consts, n_carry, _ = hx.scan_parts(eqn)
  consts, carry, xs = (ins[:n_consts], ins[n_consts:n_consts + n_carry],
                       ins[n_consts + n_carry:])
  sliced = []
  for s in xs:
    if isinstance(s, Ex):
      # Scanning over the examples, one per step: each step sees one
      # example's values, a linear combination of the examples (so a
      # carry that accumulates them, or a layer applied to them, mixes
      # the examples).
      if s.dim == 0:
        ctx.log.looped_over_examples()
      sliced.append(ctx._combined(s, SUM) if s.dim == 0 else
                    dataclasses.replace(s, dim=s.dim - 1))
    else:
      sliced.append(s)
  deps = list(ctx._deps)  # follow() below moves ctx._deps on
  body_deps = (list(deps[:n_consts]) + [True] * n_carry +
               list(deps[n_consts + n_carry:]))

  def step(carry):
    outs = ctx.follow(body, list(consts) + carry + sliced, body_deps,
                      site=ctx.eqn_key(eqn))
    return outs, [ctx.join(a, b) for a, b in
                  zip(carry, _carried(ctx, eqn, outs[:n_carry]))]

  # The carries' fixed point (every round's findings kept: they only
  # accumulate).
  outs, carry, reached = ctx.fixed_point(step, list(carry), _rounds(carry),
                                         every_round=True)
  if not reached:
    carry = [MIXED] * n_carry  # Not reached (see _rounds).
  ys = [dataclasses.replace(s, dim=s.dim + 1) if isinstance(s, Ex) else s
        for s in outs[n_carry:]]
  return list(carry) + ys


def _while(ctx, eqn, ins):
  """A ``while_loop``: the body's carries to a fixed point, and the
  number of rounds, which the condition decides from its constants and
  the carries (:meth:`_rounds_state`). Where that number depends on the
  examples, so does every carry the body changes: per example where the
  condition is one per example along the carries' examples' axis (a
  ``while_loop`` under ``vmap``: each row stops on its own condition,
  later rounds leave it as it was), otherwise on every example
  (``MIXED``)."""
  cond, cond_n, body, body_n = hx.while_parts(eqn)
  cond_consts = ins[:cond_n]
  consts, carry = ins[cond_n:cond_n + body_n], ins[cond_n + body_n:]
  deps = list(ctx._deps)  # follow() below moves ctx._deps on
  n = len(carry)
  # A carry the body hands on as it is keeps its value, however many
  # rounds run (a fori_loop's upper bound).
  kept = [body.outvars[k] is body.invars[body_n + k] for k in range(n)]
  site = ctx.eqn_key(eqn)
  # The condition reads a carry as dependent on the parameters where it
  # starts so or the body may make it so (the body reads them as such).
  body_deps = any(deps[cond_n:cond_n + body_n])
  cond_deps = list(deps[:cond_n]) + [d or body_deps
                                     for d in deps[cond_n + body_n:]]
  step_deps = list(deps[cond_n:cond_n + body_n]) + [True] * n

  def step(carry):
    ctx.notes_into(cond.invars, eqn.invars[:cond_n] +
                   eqn.invars[cond_n + body_n:], site)
    pred = ctx.follow(cond, list(cond_consts) + carry, cond_deps,
                      site=site)[0]
    rounds = _rounds_state(ctx, pred)
    outs = ctx.follow(body, list(consts) + carry, step_deps, site=site)
    new = [ctx.join(a, b) for a, b in zip(carry, _carried(ctx, eqn, outs))]
    if rounds != CONST:
      new = [s if keep else ctx.join(s, rounds)
             for s, keep in zip(new, kept)]
    return rounds, new

  # The carries' fixed point (every round's findings kept).
  rounds, carry, reached = ctx.fixed_point(step, list(carry),
                                           _rounds(carry) + 2,
                                           every_round=True)
  if not reached:
    carry = [MIXED] * n  # Not reached (see _rounds).
  if rounds == MIXED:
    where = f"{eqn.primitive.name}{ctx.user_line(eqn)}"
    for v, keep in zip(eqn.outvars, kept):
      if not keep:
        ctx._add_notes(v, frozenset({("loop", where)}))
  return list(carry)


def _rounds_state(ctx, pred):
  """What a ``while_loop``'s number of rounds depends on, from its
  condition's state ``pred``: ``CONST`` (no example), ``pred`` itself
  where it holds one condition per example along an axis (a batched
  ``while``: its carries are selected row by row), else ``MIXED``
  (several examples, one example's entry for all, or not known)."""
  if pred == CONST:
    return CONST
  if isinstance(pred, Ex):
    return pred
  return MIXED


def _picks_own_rows(rows, dim: int, batch: int) -> bool:
  """Whether index values ``rows`` (the index array's batch shape) are
  ``0 .. batch - 1`` along ``dim``, whatever the other axes."""
  if rows.ndim <= dim or rows.shape[dim] != batch:
    return False
  want = np.arange(batch).reshape((batch,) + (1,) * (rows.ndim - dim - 1))
  return bool(np.all(rows == want))


def rule_names() -> dict:
  """Primitive name -> rule (see :data:`RULES`)."""
  scatter = {f"scatter{sep}{kind}": _scatter for sep in "-_"
             for kind in ("add", "mul", "min", "max")}
  return {
      # layout, reductions and ops along one axis
      "broadcast_in_dim": _broadcast_in_dim, "transpose": _transpose,
      "squeeze": _squeeze, "expand_dims": _expand_dims, "reshape": _reshape,
      "reduce_sum": _reduce_sum, "reduce_max": _reduce_max,
      "reduce_min": _reduce_max, "reduce_prod": _reduce_max,
      "reduce_and": _reduce_max, "reduce_or": _reduce_max,
      "argmax": _reduce_max, "argmin": _reduce_max,
      "cumsum": _cumsum, "cumprod": _cumprod, "cummax": _cumprod,
      "cummin": _cumprod, "cumlogsumexp": _cumprod,
      "rev": _rev, "sort": _sort, "split": _split, "stack": _stack,
      "unstack": _unstack, "fft": _fft, "concatenate": _concatenate,
      "pad": _pad, "top_k": _top_k,
      # subsets and writes
      "dynamic_update_slice": _dynamic_update_slice, "scatter": _scatter,
      **scatter, "slice": _slice, "dynamic_slice": _dynamic_slice,
      "gather": _gather,
      # contractions and windows
      "dot_general": _dot_general,
      "conv_general_dilated": _conv_general_dilated,
      "reduce_window": _reduce_window, "reduce_window_sum": _reduce_window,
      "reduce_window_max": _reduce_window,
      "reduce_window_min": _reduce_window,
      # control flow
      "cond": _cond, "scan": _scan, "while": _while,
  }


#: The example-flow rules, by primitive (``rule(flow, eqn, ins) -> outs``,
#: ``flow`` the interpreter's context): one grep shows the table.
RULES = hx.rule_table(rule_names())
