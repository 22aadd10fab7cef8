"""The batch arguments of a pass, and where their examples lie.

``example_axes`` (of :func:`gram_haiku.value_grad_and_gram` and the
functions built on it) gives, per positional batch argument, the axis of
every array in it that holds the examples, or None for an argument without
examples. Without it every array follows :data:`AUTO`.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np

from gram_haiku._src.core import errors


#: An array whose examples lie along axis 0 if its leading size is the
#: batch's (the default rule of ``example_axes``).
AUTO = "auto"


def leaf_example_axes(args, kwargs, example_axes) -> list:
  """Per leaf of ``(args, kwargs)``: its example axis (an int,
  normalised), None (no examples), or :data:`AUTO`.

  ``args`` are the positional batch arguments after ``rng``, and
  ``example_axes`` one int or None per argument (see
  :func:`value_grad_and_gram`), or None (:data:`AUTO` for every leaf).
  Raises a teaching error for anything else.
  """
  if example_axes is not None:
    ok = isinstance(example_axes, (tuple, list)) and all(
        a is None or (isinstance(a, int) and not isinstance(a, bool))
        for a in example_axes)
    if not ok or len(example_axes) != len(args):
      raise ValueError(errors.BAD_EXAMPLE_AXES.format(
          got=example_axes, n=len(args)))
  out = []
  for k, arg in enumerate(args):
    for leaf in jax.tree_util.tree_leaves(arg):
      ax = AUTO if example_axes is None else example_axes[k]
      if isinstance(ax, int):
        ndim = np.ndim(leaf)
        if not -ndim <= ax < ndim:
          raise ValueError(errors.EXAMPLE_AXIS_OUT_OF_RANGE.format(
              k=k, axis=ax, shape=np.shape(leaf)))
        ax %= ndim
      out.append(ax)
  out.extend(AUTO for _ in jax.tree_util.tree_leaves(kwargs))
  return out


def example_size(a, axis):
  """The size of array ``a``'s example axis ``axis`` (see
  :func:`leaf_example_axes`), or None."""
  if axis is None or not np.ndim(a):
    return None
  return np.shape(a)[0 if axis == AUTO else axis]


def rng_is_batch(rng, example_axes, n_args: int) -> bool:
  """Whether the ``rng`` position of ``fn(params, state, rng, *args)``
  holds a batch argument: ``hk.without_apply_rng`` moves the first one
  there.

  ``n_args``: the positional arguments after the ``rng`` position. With
  ``example_axes`` it says so itself (one entry per argument, the ``rng``
  position counted); without, the ``rng`` position holds a batch argument
  only if it holds an array that is not a key: a typed key
  (``jax.random.key``), a legacy raw key (``uint32[2]``, what
  ``jax.random.PRNGKey`` and ``hk.PRNGSequence`` give) and None are the
  ``rng``, which never holds examples and never sets the batch size (a
  legacy key's size 2 would otherwise be taken for one).
  """
  if example_axes is not None and len(example_axes) == n_args + 1:
    return True
  if example_axes is not None:
    return False
  leaves = jax.tree_util.tree_leaves(rng)
  return len(leaves) == 1 and all(
      isinstance(l, (jax.Array, np.ndarray)) and np.ndim(l) > 0 and not
      jax.dtypes.issubdtype(l.dtype, jax.dtypes.prng_key) and
      l.dtype != np.uint32 for l in leaves)


def split_batch(args, kwargs, example_axes=None):
  """The batch's arrays, their example axes (:func:`leaf_example_axes`),
  and ``rebuild(arrays) -> (args, kwargs)``.

  Arrays become inputs of the discovery trace (so that the examples can be
  followed through it); everything else (flags, Python numbers) stays as
  given. ``args`` starts with the ``rng`` position, which
  ``hk.without_apply_rng`` transforms fill with the first batch argument
  (:func:`rng_is_batch`); an ``rng`` itself gets the axis None: no
  examples, and no say in the batch size.
  """
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  if rng_is_batch(args[0], example_axes, len(args) - 1):
    # hk.without_apply_rng: the rng position holds the first argument.
    leaf_axes = leaf_example_axes(args, kwargs, example_axes)
  else:
    leaf_axes = ([None] * len(jax.tree_util.tree_leaves(args[0])) +
                 leaf_example_axes(args[1:], kwargs, example_axes))
  is_array = [isinstance(l, (jax.Array, np.ndarray)) and not
              jax.dtypes.issubdtype(l.dtype, jax.dtypes.prng_key)
              for l in leaves]
  arrays = [l for l, a in zip(leaves, is_array) if a]
  axes = [ax for ax, a in zip(leaf_axes, is_array) if a]

  def rebuild(new_arrays):
    it = iter(new_arrays)
    full = [next(it) if a else l for l, a in zip(leaves, is_array)]
    return jax.tree_util.tree_unflatten(treedef, full)
  return arrays, axes, rebuild


def candidate_example_axes(rng, args, batch: int, limit: int = 64) -> list:
  """The ``example_axes`` that could be given for ``fn(params, state, rng,
  *args)`` with ``batch`` examples: per positional batch argument (the
  ``rng`` position too where :func:`rng_is_batch` says it holds one), an
  axis where every array of it has ``batch`` entries, or None; at least
  one entry not None. Empty where there would be more than ``limit``.
  For messages that say which declaration fits the program."""
  positions = ((rng, *args) if rng_is_batch(rng, None, len(args))
               else tuple(args))
  options = []
  for arg in positions:
    shapes = [np.shape(l) for l in jax.tree_util.tree_leaves(arg)
              if isinstance(l, (jax.Array, np.ndarray))]
    ndim = min((len(s) for s in shapes), default=0)
    axes = [k for k in range(ndim) if all(s[k] == batch for s in shapes)]
    options.append(axes + [None])
  if np.prod([len(o) for o in options]) > limit:
    return []
  return [c for c in itertools.product(*options)
          if any(a is not None for a in c)]
