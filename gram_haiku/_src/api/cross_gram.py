"""``cross_gram``: the Gram block between training examples and queries,
in the training step's one backward pass.

``G[i, q] = <g_i, h_q>``: ``g_i`` the gradient of training example ``i``'s
loss, ``h_q`` that of query ``q``'s (e.g. a validation example under the
same loss). The queries are appended to the batch, so that every tracked
layer sees both sets in one pass of the re-contracting pipeline
(:func:`gram_haiku._src.api.reweight.run`): each layer keeps its factors or
per-example gradients, the block ``G[:B, B:]`` is formed from them alone
(every Gram kernel takes its rows and columns through
:class:`~gram_haiku._src.compute.kernels.KernelConfig`, here with
``row_split = B``: ghost products ``(X_t X_q^T) o (D_t D_q^T)`` for linear
layers, never the ``(B + V)^2`` Gram), and the parameters' gradient is
re-contracted with weight 1 on the training examples and 0 on the queries
(whose rows are masked: they never enter the update), or, with
``l2_clip_norm``, with the clip factors of the training examples. A
separate query loss is picked by the loss itself, per row, from the flag
``query_flag`` names. Under ``shard_map`` (``mesh_axes``, ``mesh``) the
queries are split as the examples are and each device's rows meet every
device's queries, gathered as the Gram's columns are. The sources of the
uses: TracIn (Pruthi et al. 2020) sums ``<g_i, h_q>`` over checkpoints;
In-Run Data Shapley (Wang et al. 2024) its first-order term per step.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src.api import clipping as clipping_lib
from gram_haiku._src.api import reweight
from gram_haiku._src.api import shard_examples
from gram_haiku._src.compute.plan import Clip
from gram_haiku._src.core import errors
from gram_haiku._src.core import one_program
from gram_haiku._src.core.result import CrossGrams
from gram_haiku._src.frontend import ambient
from gram_haiku._src.ops.modes import clip_weights


def _concatenated(args, queries, example_axes):
  """Each argument with its queries appended along its example axis
  (``example_axes[k]``, default 0; None: shared, taken from ``args``);
  the queries of an argument must have its structure, shapes off that
  axis and dtypes (as JAX takes them: a NumPy float64 is float32 without
  x64)."""
  if not isinstance(queries, (tuple, list)) or len(queries) != len(args):
    raise ValueError(errors.CROSS_QUERIES.format(
        n=len(args), got=type(queries).__name__ if not isinstance(
            queries, (tuple, list)) else f"{len(queries)} arguments"))
  axes = (list(example_axes) if example_axes is not None
          else [0] * len(args))
  out, sizes = [], set()
  for k, (a, q) in enumerate(zip(args, queries)):
    if axes[k] is None:
      out.append(a)
      continue
    ax = axes[k]
    a_leaves, q_leaves = jax.tree.leaves(a), jax.tree.leaves(q)
    if jax.tree.structure(a) != jax.tree.structure(q) or any(
        jnp.ndim(x) <= ax or jnp.ndim(x) != jnp.ndim(y) or
        tuple(jnp.shape(x)[:ax]) + tuple(jnp.shape(x)[ax + 1:]) !=
        tuple(jnp.shape(y)[:ax]) + tuple(jnp.shape(y)[ax + 1:])
        for x, y in zip(a_leaves, q_leaves)):
      raise ValueError(errors.CROSS_QUERY_SHAPES.format(
          k=k, axis=ax, args=[jnp.shape(x) for x in a_leaves],
          queries=[jnp.shape(y) for y in q_leaves]))
    dtypes = ([jnp.result_type(x) for x in a_leaves],
              [jnp.result_type(y) for y in q_leaves])
    if dtypes[0] != dtypes[1]:
      raise ValueError(errors.CROSS_QUERY_DTYPES.format(
          k=k, args=[str(d) for d in dtypes[0]],
          queries=[str(d) for d in dtypes[1]]))
    sizes |= {(jnp.shape(x)[ax], jnp.shape(y)[ax])
              for x, y in zip(a_leaves, q_leaves)}
    out.append(jax.tree.map(lambda x, y: jnp.concatenate([x, y], axis=ax),
                            a, q))
  if len(sizes) != 1:
    raise ValueError(errors.CROSS_SIZES.format(sizes=sorted(sizes)))
  (b, v), = sizes
  return tuple(out), b, v


def cross_gram(apply_fn: Callable[..., Any], *, has_aux: bool = False,
               return_state: bool = False, frozen: reweight.Frozen = None,
               example_axes: Optional[Sequence[Optional[int]]] = None,
               mesh_axes: str | tuple[str, ...] | None = None,
               mesh: Optional[jax.sharding.Mesh] = None,
               query_flag: Optional[str] = None,
               l2_clip_norm: Optional[float | Mapping[str, float]] = None,
               clipping: str = "all-layer",
               layer_split: clipping_lib.LayerSplit = "equal"
               ) -> Callable[..., Any]:
  """Transforms a tracked ``apply`` into a training step that also returns
  the Gram block between its examples and a set of queries.

  Args:
    apply_fn: ``apply`` of ``hk.transform_with_state(f)``, where ``f`` runs
      its model inside ``gram_haiku.track()`` and returns the scalar loss
      ``sum_i l_i`` (a sum: a mean over the joint batch would scale the
      update; :class:`gram_haiku.MeanLossWarning` says so when it can
      tell). The queries' gradients are those of the same loss, unless
      ``query_flag`` gives them their own.
    has_aux, return_state: as in :func:`gram_haiku.value_grad_and_gram`
      (the value, aux and state are those of the training examples alone,
      from one more forward pass of them where they are used: a model
      that draws from ``rng``, e.g. dropout, draws there for ``B`` rows
      and in the pass for ``B + V``).
    frozen: as in :func:`gram_haiku.reweighted_grad`.
    example_axes: per positional argument, the axis its examples are on
      (default 0 for every argument; None: not per-example, shared by both
      sets, taken from ``args``).
    mesh_axes: for use inside ``jax.shard_map`` with the examples split
      over these mesh axes, as in :func:`gram_haiku.value_grad_and_gram`,
      the queries split the same way (each device holds ``b`` of the ``B``
      training examples and ``v`` of the ``V`` queries, along the same
      example axes): each device gets its rows ``f32[b, V]`` of the
      global block, against every device's queries (their factors are
      gathered in the order of the devices over ``mesh_axes``, as the
      Gram's columns are); ``out_specs=P(mesh_axes, None)`` assembles the
      ``(B, V)`` block. ``query_summed`` and ``sq_norms`` are the local
      ``f32[b]`` (``query_summed`` against the sum over every device's
      queries), ``grads`` those of every device's training examples (as
      :func:`gram_haiku.reweighted_grad` gives them) and ``value`` this
      device's loss. Several axes need ``mesh``.
    mesh: a ``jax.sharding.Mesh``: the function builds the ``shard_map``
      itself, as :func:`gram_haiku.value_grad_and_gram` does, and is
      called outside it on the whole batch and all the queries, both
      split over ``mesh_axes`` (default every axis of the mesh; ``B``
      must be a multiple of the number of devices ``n``; ``V`` need not
      be: the queries are then padded with copies of the last one up to
      the next multiple, whose columns are dropped, and ``query_summed``
      is the block's row sums). ``cross`` comes back global
      (``f32[B, V]``), ``grads`` replicated, ``value`` ``f32[n]`` (each
      device's loss).
    query_flag: the name of a keyword argument of ``f`` through which it
      is told which rows are queries, so that it can give them a separate
      query loss (e.g. a validation loss): in the pass ``f`` gets
      ``query_flag=`` ``bool[B + V]``, False on the training rows and True
      on the queries (the rows in the order of the concatenated
      arguments), and returns ``sum_r l_r`` with ``l_r`` row ``r``'s
      training loss where the flag is False and its query loss where it
      is True (``jnp.where(flag, query_loss, train_loss).sum()``: the rows
      go through the network once, together); in the value's forward
      pass it gets ``bool[B]``, all False. Then ``h_q`` is the gradient of
      query ``q``'s query loss, ``g_i`` that of example ``i``'s training
      loss, and the update is unchanged (the queries' rows are masked
      out). As always with ``jnp.where``, a branch that is not finite on
      the rows it does not select (e.g. ``log(0)``) makes the gradient
      NaN: keep both losses finite on every row.
    l2_clip_norm: ``C``: ``grads`` is then the clipped sum
      ``sum_i min(1, C / |g_i|) g_i`` over the training examples (the
      queries never enter it), ``|g_i|`` a sound upper bound of the norm,
      as :func:`gram_haiku.clipped_grad` (``clipping="all-layer"``)
      computes it, under its completeness and example-flow checks;
      ``sq_norms`` are then those bounds (what the clip factors were
      computed from). The blocks are of the *unclipped* ``g_i``: the
      clipped gradients' block is ``total`` times
      ``min(1, C / sqrt(sq_norms))`` by row. Noise and accounting are the
      caller's (jax-privacy), as with ``clipped_grad``.
    clipping: ``"all-layer"`` (the global norm) or ``"per-layer"``, as
      :func:`gram_haiku.clipped_grad`'s: each module's part of ``g_i``
      clipped to its own ``C_l`` (``min(1, C_l / |g_i^l|)``, ``|g_i^l|``
      a sound bound of the module's norm); ``l2_clip_norm`` is then one
      number ``C``, split over the tracked modules by ``layer_split``, or
      a dict ``{module: C_l}`` with one positive entry per tracked module
      and no other; ``sq_norms`` are then the modules' bounds (summed in
      ``sq_norms``, by module in ``sq_norms_by_layer``).
    layer_split: as :func:`gram_haiku.clipped_grad`'s: ``"equal"``
      (``C_l = C / sqrt(L)``), ``"by_size"`` or a function.

  Returns:
    ``fn(params, state, rng, *args, queries) -> (value, grads, cross)``
    (``((value, new_state), grads, cross)`` with ``return_state``):
    ``queries`` is a tuple of the query arguments, one per argument of
    ``args`` (the same structure; ``V`` examples where ``args`` has
    ``B``); ``value`` and ``grads`` are those of the training examples
    alone, to float rounding (the queries' rows are masked out of the
    update);
    ``cross`` is a :class:`gram_haiku.CrossGrams`: ``by_layer[m]``
    ``f32[B, V]`` and ``total`` ``f32[B, V]`` (float64 when the layers
    compute in float64), ``total[i, q] = <g_i, h_q>``, and
    ``query_summed`` ``f32[B]``, ``<g_i, sum_q h_q>``, formed without the
    block, and ``sq_norms`` ``f32[B]``, the training examples' own
    ``|g_i|^2`` (under ``jit`` only what is used is computed). Traceable:
    ``jit`` it.

    The blocks come from one forward pass of the ``B + V`` rows together:
    a statistic over the batch that the model takes under
    ``stop_gradient`` (allowed: no gradient couples the examples) is
    then taken over the training rows and the queries, and the ``g_i``
    are those of that joint forward pass. For the training batch's own
    forward pass, take such a statistic over the training rows alone
    (weighted by ``~flag`` through ``query_flag``) or use running
    statistics.

  Raises:
    ValueError: for queries that do not match the arguments (count,
      structure, shapes off the example axis, dtypes, one ``B`` and one
      ``V``),
      a ``query_flag`` that is not an identifier or is passed by the
      caller too, an ``l2_clip_norm`` that is not a non-negative number
      (per layer: positive numbers, one per tracked module), an unknown
      ``clipping`` or ``layer_split``,
      for a trainable parameter that no Gram rule covers (its part of
      every product would be missing), and every error of
      :func:`gram_haiku.reweighted_grad` (``mesh_axes`` and ``mesh``
      included).
  """
  axes = shard_examples.example_axes_of(mesh_axes, mesh, "cross_gram")
  clip, clips = _clips(l2_clip_norm, clipping, layer_split)
  if query_flag is not None and not (isinstance(query_flag, str) and
                                     query_flag.isidentifier()):
    raise ValueError(errors.CROSS_QUERY_FLAG.format(got=repr(query_flag)))

  def fn(params, state, rng, *args, queries, **kwargs):
    if query_flag is not None and query_flag in kwargs:
      raise ValueError(errors.CROSS_QUERY_FLAG_GIVEN.format(
          name=query_flag))
    rows, b, v = _concatenated(args, queries, example_axes)
    mask = jnp.concatenate([jnp.ones((b,), jnp.float32),
                            jnp.zeros((v,), jnp.float32)])
    flagged = kwargs if query_flag is None else {
        **kwargs, query_flag: jnp.arange(b + v) >= b}
    weight_fn = (None if clips is not None else
                 (lambda grams: mask) if clip is None else
                 (lambda grams: clip_weights(grams.sq_norms, clip) * mask))
    clipped = clip is not None or clips is not None
    r = reweight.run(apply_fn, params, state, rng, rows, flagged,
                     fn_name="cross_gram", needs="norms", has_aux=has_aux,
                     axes=axes, frozen=frozen, weight_fn=weight_fn,
                     clips=clips, example_weights=mask, privacy=clipped,
                     example_axes=example_axes, cross_rows=b,
                     unit_rows=not clipped)
    # The training examples' own value (and aux, state): the pass's is of
    # both sets. Under jit, unused, it is not computed.
    if query_flag is not None:
      kwargs = {**kwargs, query_flag: jnp.zeros((b,), bool)}
    with ambient.plain_haiku():
      out, new_state = apply_fn(params, state, rng, *args, **kwargs)
    value = (out, new_state) if return_state else out
    blocks, summed = r.cross
    sq = {m: s[:b] for m, s in r.grams.sq_norms_by_layer.items()}
    return value, r.grads, CrossGrams(blocks, summed, sq, r.grams.coverage)

  if mesh is None:
    return one_program.compiled_when_eager(
        fn, "the function cross_gram returned")

  def joint(params, state, rng, *args_and_queries, **kwargs):
    n = len(args_and_queries) // 2  # The queries as arguments: split too.
    return fn(params, state, rng, *args_and_queries[:n],
              queries=tuple(args_and_queries[n:]), **kwargs)
  sharded = shard_examples.shard_examples(
      joint, mesh=mesh, axes=axes, fn_name="cross_gram",
      example_axes=None if example_axes is None else 2 * tuple(example_axes),
      rows=lambda out: (shard_examples.mark(out[:2], False),
                        shard_examples.mark(out[2], True)))

  devices = math.prod(mesh.shape[a] for a in axes)

  def on_mesh(params, state, rng, *args, queries, **kwargs):
    if not isinstance(queries, (tuple, list)) or len(queries) != len(args):
      _concatenated(args, queries, example_axes)  # Its error.
    queries, v = _padded_queries(queries, example_axes, devices)
    value, grads, cross = sharded(params, state, rng, *args, *queries,
                                  **kwargs)
    if v is None:
      return value, grads, cross
    blocks = {m: blk[:, :v] for m, blk in cross.by_layer.items()}
    return value, grads, CrossGrams(
        blocks, {m: jnp.sum(blk, axis=1) for m, blk in blocks.items()},
        cross.sq_norms_by_layer, cross.coverage)
  return one_program.compiled_when_eager(
      on_mesh, "the function cross_gram returned")


def _clips(l2_clip_norm, clipping: str, layer_split):
  """``(clip, clips)``: all-layer clipping's :class:`Clip` (or None), and
  per-layer clipping's ``clips`` for :func:`reweight.run` (``{module:
  number of parameters} -> {module: Clip}``; or None), checked.

  Raises:
    ValueError: for an unknown ``clipping`` or ``layer_split``, a
      threshold that is not a non-negative number (positive per layer), or
      a dict of them with all-layer clipping.
  """
  if clipping not in clipping_lib.CLIPPINGS:
    raise ValueError(errors.CROSS_CLIPPING.format(
        got=repr(clipping), options=clipping_lib.CLIPPINGS))
  clipping_lib.check_split(layer_split)
  if l2_clip_norm is None:
    return None, None
  if clipping == "all-layer":
    if isinstance(l2_clip_norm, Mapping):
      raise ValueError(errors.CROSS_CLIPPING.format(
          got="'all-layer' with a dict of thresholds",
          options=clipping_lib.CLIPPINGS))
    return Clip(l2_clip_norm), None
  if isinstance(l2_clip_norm, Mapping):
    if layer_split != "equal":
      raise ValueError(errors.CROSS_CLIPPING.format(
          got="'per-layer' with a dict of thresholds and a layer_split "
          "(which splits one number)", options=clipping_lib.CLIPPINGS))
    thresholds = {m: Clip(c).l2_clip_norm for m, c in l2_clip_norm.items()}
    if not all(c > 0 for c in thresholds.values()):
      raise ValueError(errors.PER_LAYER_THRESHOLDS.format(
          fn="cross_gram", problem=f"thresholds {l2_clip_norm} (each must "
          "be positive)", modules=sorted(thresholds)))
    total = None
  else:
    thresholds, total = None, Clip(l2_clip_norm).l2_clip_norm
  return None, lambda sizes: clipping_lib.layer_clips(
      sizes, thresholds, total, layer_split, fn="cross_gram")


def _padded_queries(queries, example_axes, devices: int):
  """``(queries, None)`` where their number ``V`` is a multiple of
  ``devices`` (or not one number: the pass's own checks say so); else
  ``(padded, V)``: each query argument with copies of its last query
  appended along its example axis up to the next multiple. A padding
  query is a query like any other (finite wherever the real ones are),
  its columns of the block are dropped, and no query reaches the
  update: exact."""
  axes = (list(example_axes) if example_axes is not None
          else [0] * len(queries))
  sizes = {jnp.shape(y)[ax] for q, ax in zip(queries, axes)
           if ax is not None for y in jax.tree.leaves(q)
           if jnp.ndim(y) > ax}
  if len(sizes) != 1:
    return queries, None
  v, = sizes
  if v == 0 or v % devices == 0:
    return queries, None
  extra = devices - v % devices

  def pad(y, ax):
    last = jax.lax.slice_in_dim(y, v - 1, v, axis=ax)
    return jnp.concatenate([y, jnp.repeat(last, extra, axis=ax)], axis=ax)
  return tuple(q if ax is None else jax.tree.map(lambda y, ax=ax: pad(y, ax), q)
               for q, ax in zip(queries, axes)), v

