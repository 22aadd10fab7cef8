"""``mesh=``: the ``shard_map`` built from one statement of the example split.

Under ``jax.shard_map`` a Gram op computes this device's rows of the global
Gram and gathers the other devices' column factors over the example mesh
axes (:mod:`gram_haiku._src.compute.example_sharding`). With the examples split over
several axes, ``P(("a", "b"))``, the gather must follow the order of that
``PartitionSpec`` entry, or the Gram's columns come out permuted. The body of
a ``shard_map`` cannot see that order: JAX's types there record *which* axes
a value varies over, as a set. So ``mesh_axes`` of several axes is accepted
only with ``mesh=``, where the transform builds the ``shard_map`` itself
(:func:`shard_examples`): the batch's ``in_specs``, the gather and the
``out_specs`` that assemble the Gram all come from the one ``mesh_axes``.

Outputs of the built ``shard_map``, per leaf:

* *rows*: the Grams, squared norms and per-example weights, this device's
  rows, assembled along axis 0 (``P(mesh_axes)``) into global arrays;
* *same on every device* (invariant over the mesh axes, e.g. the gradients
  of replicated parameters, which JAX's AD sums over devices): ``P()``;
* anything else that differs per device (each device's loss, BatchNorm
  statistics, an ``aux``): a new leading axis of size ``n``, one entry per
  device in the order of ``mesh_axes``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import example_sharding
from gram_haiku._src.core import errors
from gram_haiku._src.core.result import Grams
from gram_haiku._src.passes import batch_args

AxisNames = example_sharding.AxisNames
ROWS, SAME, PER_DEVICE = "rows", "same", "per_device"


def mark(tree: Any, rows: bool) -> Any:
  """``tree`` with every leaf replaced by ``rows`` (see :func:`shard_examples`'
  ``rows``)."""
  return jax.tree_util.tree_map(lambda _: rows, tree)


def example_axes_of(mesh_axes, mesh, fn_name: str) -> AxisNames:
  """The mesh axes the examples are split over, checked at transform time.

  ``mesh_axes`` normalised (:func:`example_sharding.normalize_axes`); with
  a ``mesh`` and no ``mesh_axes``, all of the mesh's axes in its order.

  Raises:
    ValueError: several axes without ``mesh`` (their order cannot be
      checked inside a ``shard_map`` built elsewhere), or axes the mesh
      does not have.
  """
  axes = example_sharding.normalize_axes(mesh_axes)
  if mesh is None:
    if len(axes) > 1:
      raise ValueError(errors.MESH_AXES_ORDER.format(fn=fn_name, axes=axes))
    return axes
  names = tuple(mesh.axis_names)
  if not axes:
    return names
  missing = [a for a in axes if a not in names]
  if missing:
    raise ValueError(errors.MESH_AXES_NOT_IN_MESH.format(
        fn=fn_name, axes=axes, names=names, missing=missing))
  return axes


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray))


def shard_examples(fn: Callable[..., Any], *, mesh, axes: AxisNames,
                   example_axes: Optional[Sequence[Optional[int]]],
                   rows: Callable[[Any], Any], fn_name: str,
                   row_kwargs: Sequence[str] = ()) -> Callable[..., Any]:
  """``fn`` (a transform's result, built with ``mesh_axes=axes``) run under
  a ``jax.shard_map`` over ``mesh`` that splits the examples over ``axes``.

  Args:
    fn: ``fn(params, state, rng, *args, **kwargs)``, called per device.
    mesh: a ``jax.sharding.Mesh``.
    axes: the mesh axes the examples are split over, in this order.
    example_axes: as in :func:`gram_haiku.value_grad_and_gram`; None splits
      axis 0 of every array of the positional batch arguments (not the
      ``rng``, unless ``hk.without_apply_rng`` put the first argument
      there).
    rows: ``out -> `` the same structure with True for the leaves that are
      this device's rows (see the module docstring).
    fn_name: for errors.
    row_kwargs: keyword arguments with one row per example (split over
      ``axes`` along axis 0); other keywords are replicated.

  Returns:
    ``fn(params, state, rng, *args, **kwargs)`` on the whole batch: the
    parameters, state and ``rng`` replicated (``P()``), the outputs global
    (see the module docstring), :class:`Grams` with ``mesh_axes == ()``.
  """
  entry = axes if len(axes) > 1 else axes[0]
  n = math.prod(mesh.shape[a] for a in axes)

  def sharded(params, state, rng, *args, **kwargs):
    bound = _bound_axes(axes)
    if bound:
      raise ValueError(errors.MESH_INSIDE_SHARD_MAP.format(fn=fn_name,
                                                           bound=bound))
    rng_in_batch = batch_args.rng_is_batch(rng, example_axes, len(args))
    batch = (rng, *args) if rng_in_batch else args
    given = None if example_axes is None else tuple(example_axes)
    leaf_axes = batch_args.leaf_example_axes(batch, {}, given)
    if not rng_in_batch:
      leaf_axes = [None] * len(jax.tree_util.tree_leaves(rng)) + leaf_axes
    row_kw = {k: kwargs.pop(k) for k in row_kwargs
              if kwargs.get(k) is not None}
    tree = ((rng, *args), kwargs, row_kw)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaf_axes += [None] * len(jax.tree_util.tree_leaves(kwargs))
    leaf_axes += [0] * len(jax.tree_util.tree_leaves(row_kw))
    arrays, specs = [], []
    for leaf, ax in zip(leaves, leaf_axes):
      if not _is_array(leaf):
        continue  # Python numbers and flags: passed as they are.
      if ax == batch_args.AUTO:
        ax = 0 if np.ndim(leaf) else None
      if ax is not None and np.shape(leaf)[ax] % n:
        raise ValueError(errors.MESH_SPLIT_SIZE.format(
            fn=fn_name, axes=axes, shape=tuple(np.shape(leaf)),
            size=np.shape(leaf)[ax], axis=ax, n=n))
      arrays.append(leaf)
      specs.append(P() if ax is None else P(*([None] * ax), entry))
    is_array = [_is_array(l) for l in leaves]

    def call(params, state, arrays):
      it = iter(arrays)
      full = [next(it) if a else l for l, a in zip(leaves, is_array)]
      (rng_, *args_), kwargs_, row_kw_ = jax.tree_util.tree_unflatten(
          treedef, full)
      out = fn(params, state, rng_, *args_, **kwargs_, **row_kw_)
      flags = jax.tree_util.tree_leaves(rows(out))
      out_leaves, out_tree = jax.tree_util.tree_flatten(out)
      out_leaves = [jnp.asarray(l) for l in out_leaves]
      kinds = [ROWS if f else SAME if not set(axes) & hx.varying_axes(l)
               else PER_DEVICE for l, f in zip(out_leaves, flags)]
      return out_leaves, out_tree, kinds

    found = {}

    def first(params, state, arrays):  # Learns each output's kind.
      out_leaves, found["tree"], found["kinds"] = call(params, state, arrays)
      return [hx.vary_over(l[None], axes) for l in out_leaves]

    in_specs = (P(), P(), specs)
    try:
      jax.eval_shape(jax.shard_map(first, mesh=mesh, in_specs=in_specs,
                                   out_specs=P(entry)), params, state, arrays)
    except TypeError as e:
      if "carry" not in str(e) or "vary" not in str(e).lower():
        raise
      raise TypeError(errors.MESH_SCAN_CARRY.format(
          fn=fn_name, axes=axes, error=str(e).split("\n")[0])) from e
    kinds = found["kinds"]
    # Rows are split along axis 0; per-device values along their new axis 0.
    out_specs = [P() if k == SAME else P(entry) for k in kinds]

    def body(params, state, arrays):
      out_leaves, _, _ = call(params, state, arrays)
      return [l[None] if k == PER_DEVICE else l
              for l, k in zip(out_leaves, kinds)]

    out = jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                        out_specs=out_specs)(params, state, arrays)
    out = jax.tree_util.tree_unflatten(found["tree"], out)
    return jax.tree_util.tree_map(
        lambda g: Grams(g.by_layer, g.sq_norms_by_layer, g.coverage) if
        isinstance(g, Grams) else g, out,
        is_leaf=lambda g: isinstance(g, Grams))

  return sharded


def _bound_axes(axes: AxisNames) -> tuple:
  """Those of ``axes`` bound by an enclosing ``shard_map`` here."""
  bound = []
  for a in axes:
    try:
      example_sharding.axes_size((a,))
    except NameError:
      continue
    bound.append(a)
  return tuple(bound)
