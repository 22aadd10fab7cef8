"""An eager call of a returned callable runs as one compiled program.

``value_grad_and_gram(apply)(params, state, rng, *batch)`` called outside
``jax.jit`` would otherwise run its pass one primitive at a time: every
primitive with new shapes traced, lowered and compiled on its own (hundreds
of small programs for the first call: a two-layer MLP's ``clipped_grad``
took 2.1 s of CPU eagerly against 0.2 s jitted, jax 0.10.2, 2-core CPU).
:func:`compiled_when_eager` wraps such a callable: called with concrete
arguments, it runs under ``jax.jit`` (one trace, one program, cached for
later calls with the same shapes); called inside a trace (``jit``,
``vmap``, ``grad``: a tracer among its arguments) it is the function
itself.

What stays as it was eagerly: array leaves (``jax.Array``, NumPy arrays
and scalars) are the program's inputs; every other leaf (a Python bool,
int, float or string, a callable) is a static argument, so that a model's
Python control flow on it (``if is_training:``) runs as eagerly. A call
with a leaf that cannot be hashed runs eagerly, one primitive at a time,
as before. Outputs that are not traced values (a string or a Python
number in an aux) come back as they are, as eagerly, not as arrays. A
call that needs concrete values while it runs (NumPy on
traced values, a Python ``if`` on an array: in a model, or in a
``weight_fn`` that reads the Grams with NumPy, a rule that reads its
arrays' values) fails to trace; it then runs eagerly, as before, and so
does every later call with the same static values (the same op, for a Gram
op's backward products).
``jax.disable_jit()`` runs it eagerly too.

A Python number that changes from call to call (a step counter passed to
the model) therefore compiles a new program for each of its values; from
the :data:`RECOMPILES`-th value on, a :class:`RecompileWarning` names the
argument and says to pass it as an array, or to call under ``jax.jit``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable
import warnings

import jax
import numpy as np

from gram_haiku._src.core import warning_site

_ARRAYS = (jax.Array, np.ndarray, np.generic)

#: JAX's errors for a concrete value asked of a traced one: what ran
#: eagerly may raise them under ``jit``.
_NEEDS_VALUES = (jax.errors.ConcretizationTypeError,
                 jax.errors.TracerArrayConversionError,
                 jax.errors.TracerBoolConversionError,
                 jax.errors.TracerIntegerConversionError)


_NUMBERS = (int, float, complex)

#: The number of static values of one call shape (the same arrays'
#: shapes and dtypes, the same kinds of static leaves) from which an eager
#: call warns that it keeps compiling (:class:`RecompileWarning`).
RECOMPILES = 8


class RecompileWarning(UserWarning):
  """An eager call of a gram_haiku callable compiled a new program for
  each new value of a Python number among its arguments (a static value,
  part of the compiled program's key). Passing the number as an
  array (``jnp.asarray(step)``) makes it an input of one program; calling
  under ``jax.jit`` does the same."""


def _varying(treedef, statics) -> list[str]:
  """The paths (``args[5]``, ``kwargs['step']``) of the static leaves whose
  values differ among ``statics`` (static parts of one call shape)."""
  leaves = jax.tree_util.tree_unflatten(treedef, list(range(
      treedef.num_leaves)))
  paths = {i: jax.tree_util.keystr(path).replace("[0]", "args", 1)
           .replace("[1]", "kwargs", 1)
           for path, i in jax.tree_util.tree_flatten_with_path(leaves)[0]}
  first, *rest = statics
  return [paths[i] for k, (i, _, v) in enumerate(first)
          if any(other[k][2] != v for other in rest)]


def _signature(arrays) -> tuple:
  """The shapes and (canonical) dtypes of a call's array inputs, concrete
  or traced alike: what, with the static part, decides the output's
  structure."""
  return tuple((tuple(np.shape(a)), str(jax.dtypes.canonicalize_dtype(
      a.dtype, allow_extended_dtype=True))) for a in arrays)


def compiled_when_eager(fn: Callable[..., Any],
                        name: str = "") -> Callable[..., Any]:
  """``fn``, run as one jitted program when called with concrete arguments.

  Args:
    fn: a function of pytrees of arrays and static Python values, whose
      outputs are pytrees of arrays (what ``jax.jit`` returns).
    name: what a :class:`RecompileWarning` calls it (default: its
      ``__name__``), e.g. ``"the function clipped_grad returned"``.

  Returns:
    A function with ``fn``'s signature and results. Its jitted form is made
    once, so repeated eager calls with the same shapes, dtypes and static
    values reuse one compiled program.
  """

  # Per call signature (static part, inputs' shapes and dtypes): the
  # output's structure and its leaves that are not traced values (a string
  # or a Python number in an aux), which come back as they are, not as
  # arrays: jit returns arrays only.
  outputs = {}

  def run(treedef, static, *dynamic):
    key = (treedef, static, _signature(dynamic))
    leaves, dynamic = [], iter(dynamic)
    static = dict((i, v) for i, _, v in static)
    for i in range(treedef.num_leaves):
      leaves.append(static[i] if i in static else next(dynamic))
    args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    out, out_tree = jax.tree_util.tree_flatten(fn(*args, **kwargs))
    traced = [isinstance(leaf, jax.core.Tracer) for leaf in out]
    outputs[key] = (out_tree, tuple(None if t else leaf
                                    for leaf, t in zip(out, traced)))
    return [leaf for leaf, t in zip(out, traced) if t]

  def rebuild(key, arrays):
    out_tree, kept = outputs[key]
    arrays = iter(arrays)
    return jax.tree_util.tree_unflatten(
        out_tree, [next(arrays) if leaf is None else leaf for leaf in kept])

  label = name or getattr(fn, "__name__", "a callable")
  jitted = jax.jit(run, static_argnums=(0, 1))
  needs_values = set()  # The static parts of calls that needed values.
  # Per call shape (treedef, the static leaves but for the values of
  # Python numbers, the arrays' signature): the static parts compiled for
  # it, until it has warned.
  variants = {}

  def count(treedef, static, signature):
    shape = (treedef, tuple((i, t, None if t in _NUMBERS else v)
                            for i, t, v in static), signature)
    seen = variants.setdefault(shape, {})
    if seen is None:  # (Warned already.)
      return
    seen[static] = None
    if len(seen) >= RECOMPILES:
      variants[shape] = None
      where = ", ".join(_varying(treedef, list(seen))) or "its arguments"
      warnings.warn(
          f"gram_haiku: {label} was called "
          f"eagerly (outside jax.jit) with {len(seen)} different values of "
          f"the Python number(s) at {where}, and compiled a new program for "
          "each: a Python value is static in an eager call, so that the "
          "model's Python control flow on it runs as it would eagerly. Pass "
          "it as an array (jnp.asarray(value)) to reuse one program, or "
          "call the function under jax.jit.", RecompileWarning,
          stacklevel=warning_site.user_stacklevel())

  @functools.wraps(fn)
  def call(*args, **kwargs):
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
      return fn(*args, **kwargs)
    static, dynamic = [], []
    for i, leaf in enumerate(leaves):
      if isinstance(leaf, _ARRAYS):
        dynamic.append(leaf)
      else:  # (The type too: 1, 1.0 and True hash alike.)
        static.append((i, type(leaf), leaf))
    static = tuple(static)
    try:
      if (treedef, static) in needs_values:
        return fn(*args, **kwargs)
    except TypeError:  # (Unhashable.)
      return fn(*args, **kwargs)
    signature = _signature(dynamic)
    count(treedef, static, signature)
    try:
      arrays = jitted(treedef, static, *dynamic)
    except _NEEDS_VALUES:  # (Raised while tracing: nothing ran.)
      needs_values.add((treedef, static))
      return fn(*args, **kwargs)
    return rebuild((treedef, static, signature), arrays)

  return call
