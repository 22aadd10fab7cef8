"""``empirical_ntk``: the empirical neural tangent kernel per output, from
one Gram pass.

For a model ``f(params, x) -> [N, *O]`` the empirical NTK is
``Theta[(i, a), (j, b)] = <d f(x_i)_a / d params, d f(x_j)_b / d params>``
for examples ``i, j`` and output entries ``a, b`` (Jacot et al. 2018; the
finite-width kernel of Novak et al. 2022, "Fast Finite Width Neural Tangent
Kernel"). It is the Gram of per-"example" gradients where an example is a
pair ``(i, a)``: the batch is repeated ``P = prod(O)`` times, row
``r = i P + a`` keeps output entry ``a`` of example ``i``, and
:func:`gram_haiku.value_grad_and_gram` of the sum of the kept entries
returns ``Theta`` as its Gram (each row's loss depends on its own row
only, so the Gram's exactness carries over: sharing, loops and every
tracked layer). ``trace_axes`` and ``diagonal_axes`` then contract or keep
the diagonal of pairs of axes, with neural-tangents' conventions
(``nt.empirical_ntk_fn``): the result's shape is ``zip(f(x1).shape,
f(x2).shape)`` with each traced pair absent and each diagonal pair present
once.

Cost: one pass over ``(N1 + N2) P`` rows (``x2`` is concatenated to
``x1``), and a Gram of that size; the ``x1 x x2`` block is read from it.
A statistic over the batch that the model takes under ``stop_gradient``
is therefore taken over ``x1`` and ``x2`` together (use running
statistics for the kernel of the model at ``x1`` alone).
"""

from __future__ import annotations

import math
import numbers
import string
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src.api.value_grad_and_gram import value_grad_and_gram
from gram_haiku._src.core import errors
from gram_haiku._src.core import one_program
from gram_haiku._src.frontend import ambient


def _normalised(axes: int | Sequence[int], ndim: int,
                what: str) -> tuple[int, ...]:
  """``axes`` (one int is that one axis, as in neural-tangents; numpy
  integers count) as distinct non-negative axes of a rank-``ndim`` output.

  Raises:
    ValueError: for an axis out of range, not an int, or repeated.
  """
  is_int = lambda a: (isinstance(a, numbers.Integral) and
                      not isinstance(a, (bool, np.bool_)))
  if is_int(axes):
    axes = (axes,)
  out = []
  for a in axes:
    if not is_int(a) or not -ndim <= a < ndim:
      raise ValueError(errors.NTK_BAD_AXES.format(
          what=what, axes=tuple(axes), ndim=ndim))
    out.append(int(a) % ndim)
  if len(set(out)) != len(out):
    raise ValueError(errors.NTK_BAD_AXES.format(
        what=what, axes=tuple(axes), ndim=ndim))
  return tuple(out)


def _contract(full: jax.Array, ndim: int, trace: tuple[int, ...],
              diagonal: tuple[int, ...]) -> jax.Array:
  """``full``: ``[N1, *O, N2, *O]`` -> neural-tangents' layout: per output
  axis ``k`` (the batch axis is ``k = 0``) the pair ``(k1, k2)``, one axis
  when ``k`` is diagonal, none when traced."""
  letters = iter(string.ascii_letters)
  left = [next(letters) for _ in range(ndim)]
  right = [left[k] if k in trace or k in diagonal else next(letters)
           for k in range(ndim)]
  out = []
  for k in range(ndim):
    if k in trace:
      continue
    out.append(left[k])
    if k not in diagonal:
      out.append(right[k])
  spec = f"{''.join(left)}{''.join(right)}->{''.join(out)}"
  return jnp.einsum(spec, full, precision=jax.lax.Precision.HIGHEST)


def empirical_ntk(apply_fn: Callable[..., Any], *,
                  trace_axes: Optional[int | Sequence[int]] = None,
                  diagonal_axes: int | Sequence[int] = ()
                  ) -> Callable[..., Any]:
  """The empirical NTK of a tracked model, per output.

  Args:
    apply_fn: ``apply`` of ``hk.transform_with_state(f)``, where ``f(x)``
      calls its model inside ``gram_haiku.track()`` and returns the outputs
      ``[N, *O]``, example ``i``'s output depending on example ``i`` alone
      (a per-example model: no batch statistics).
    trace_axes: axes of ``f(x)`` (``0`` the examples, negative from the end)
      whose pair is summed over (one int: that axis): ``(-1,)`` sums over
      the logits, ``()`` keeps every output pair, ``0`` sums over the
      pairs of example ``i`` of ``x1`` with example ``i`` of ``x2``
      (``x2`` then None or as long as ``x1``). Default (None): ``(-1,)``, as in
      neural-tangents, where ``f(x)`` has an axis after the examples';
      ``()`` for a ``[N]`` output (one number per example), whose last
      axis is the examples' own.
    diagonal_axes: axes of ``f(x)`` whose pair keeps only its diagonal
      (one int: that axis):
      ``(0,)`` gives each example's kernel with itself only (``x2`` must
      then be None or as long as ``x1``).

  Returns:
    ``ntk_fn(params, state, x1, x2=None, rng=None)``, traceable (``jit``
    it): ``x1`` and ``x2`` are pytrees whose leaves have the examples on
    axis 0 (``x2=None``: ``x2 = x1``); the kernel in ``f``'s output dtype
    promoted with float32, of shape ``zip(f(x1).shape, f(x2).shape)``
    without the traced pairs and with one axis per diagonal pair: for
    ``f(x): [N, K]``, ``[N1, N2]`` by default, ``[N1, N2, K, K]`` with
    ``trace_axes=()``, ``[N1, N2, K]`` with ``trace_axes=(),
    diagonal_axes=(-1,)``. ``rng`` is given to ``apply_fn`` as it is (each
    of the ``P`` copies of an example draws its own randomness: use a
    deterministic model).

  Raises:
    ValueError: for axes outside ``f(x)``'s rank, repeated or both traced
      and diagonal; for a diagonal or traced batch axis with
      ``N1 != N2``; for an ``x2`` of another structure or dtypes than
      ``x1``'s; and when some trainable parameter is not covered by a Gram
      rule (its part of the kernel would be missing): the message lists
      them.
  """
  def ntk_fn(params, state, x1, x2=None, rng=None):
    n1 = _examples(x1, "x1")
    with ambient.plain_haiku():
      out = jax.eval_shape(apply_fn, params, state, rng, x1)[0]
    ndim = len(out.shape)
    trace = _normalised(
        trace_axes if trace_axes is not None else (-1,) if ndim > 1 else (),
        ndim, "trace_axes")
    diagonal = _normalised(diagonal_axes, ndim, "diagonal_axes")
    if set(trace) & set(diagonal):
      raise ValueError(errors.NTK_BAD_AXES.format(
          what="trace_axes and diagonal_axes", axes=(trace, diagonal),
          ndim=ndim))
    n2 = n1 if x2 is None else _examples(x2, "x2")
    if x2 is not None:
      kinds = [[(jnp.result_type(a), jnp.shape(a)[1:])
                for a in jax.tree.leaves(x)] for x in (x1, x2)]
      if (jax.tree.structure(x1) != jax.tree.structure(x2)
          or [k[0] for k in kinds[0]] != [k[0] for k in kinds[1]]):
        raise ValueError(errors.NTK_X2_MISMATCH.format(
            x1=[f"{d}{list(s)}" for d, s in kinds[0]],
            x2=[f"{d}{list(s)}" for d, s in kinds[1]]))
    for what, axes in (("diagonal_axes", diagonal), ("trace_axes", trace)):
      if 0 in axes and n1 != n2:  # (pairs example i of x1 with i of x2)
        raise ValueError(errors.NTK_PAIRED_BATCH.format(what=what, n1=n1,
                                                        n2=n2))
    x = x1 if x2 is None else jax.tree.map(
        lambda a, b: jnp.concatenate([a, b]), x1, x2)
    n = n1 if x2 is None else n1 + n2
    shape = tuple(out.shape[1:])
    p = math.prod(shape)
    rows = jax.tree.map(lambda a: jnp.repeat(a, p, axis=0), x)
    keep = jnp.tile(jnp.eye(p, dtype=out.dtype), (n, 1))

    def kept_entries(params, state, rng, rows, keep):
      y, state = apply_fn(params, state, rng, rows)
      return jnp.sum(y.reshape(y.shape[0], p) * keep), state

    _, _, grams = value_grad_and_gram(kept_entries)(params, state, rng, rows,
                                                    keep)
    if not grams.complete:
      raise ValueError(errors.NTK_UNTRACKED.format(
          names=", ".join(grams.untracked)))
    g = grams.total
    if x2 is not None:
      g = g[:n1 * p, n1 * p:]
    full = g.reshape((n1,) + shape + (n2,) + shape)
    return _contract(full, ndim, trace, diagonal)

  return one_program.compiled_when_eager(
      ntk_fn, "the function empirical_ntk returned")


def _examples(x, name: str) -> int:
  leaves = jax.tree.leaves(x)
  sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
  if not leaves or len(sizes) != 1 or None in sizes:
    raise ValueError(errors.NTK_BAD_BATCH.format(
        name=name, shapes=[jnp.shape(a) for a in leaves]))
  return sizes.pop()
