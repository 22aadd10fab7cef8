"""The reference every Gram is checked against: ``F @ F.T``, and one
tolerance table.

``F[i]`` is the flattened gradient of example ``i``'s loss, each example
evaluated alone as a batch of one (a length-1 example axis is added inside
the mapped function, where the examples were, so that layers keep their
rank and layout), from
``jax.vmap(jax.grad(per_example_loss))`` of the *untracked* model: exact by
construction, at ``B x P`` memory. The tests, the conformance suite, the
benchmarks and the demo all compare with this one reference.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

#: dtype case -> ``(rtol, atol)``; ``atol`` is a fraction of the largest
#: reference entry. float32: the same sums in another order; bfloat16 and
#: float16: the layer computes in that dtype; "mixed": bfloat16 parameters
#: with float32 activations.
TOLERANCES = {
    "float32": (1e-4, 3e-5),
    "float64": (1e-10, 1e-12),
    "bfloat16": (2e-2, 2e-2),
    "float16": (1e-2, 1e-2),
    "mixed": (2e-2, 2e-2),
}


def _upcast(tree):
  def up(a):
    if jnp.issubdtype(jnp.result_type(a), jnp.inexact):
      return jnp.asarray(a).astype(jnp.promote_types(a.dtype, jnp.float32))
    return a
  return jax.tree.map(up, tree)


def per_example_grads(per_example_loss: Callable[..., Any], params, *batch,
                      in_axes=0, upcast: bool = False) -> jax.Array:
  """``F``: ``[B, P]`` flattened per-example gradients (traceable).

  Args:
    per_example_loss: ``loss(params, *example_batch) -> scalar`` of the
      untracked model, called on a batch of one example.
    params: the parameters (any pytree); ``P`` is their number of entries.
    *batch: the examples, example axis ``in_axes``.
    in_axes: the example axis of each array in ``batch`` (``jax.vmap``);
      each example is passed as a batch of one along that same axis (a
      time-major ``(T, B, F)`` batch, ``in_axes=1``: ``(T, 1, F)``).
    upcast: evaluate in at least float32 (parameters and float inputs
      cast up first); otherwise in the given dtypes, gradients then cast.

  Returns:
    ``F`` in float32 or wider (each gradient's dtype promoted with
    float32), rows in example order, columns in ``jax.tree.leaves(params)``
    order.
  """
  def loss_one(p, *example):
    example = jax.tree.map(lambda a: jnp.expand_dims(a, in_axes), example)
    return per_example_loss(p, *example)

  def flat(params, *batch):
    if upcast:
      params, batch = _upcast(params), _upcast(batch)
    grads = jax.vmap(jax.grad(loss_one),
                     in_axes=(None,) + (in_axes,) * len(batch))(params, *batch)
    leaves = jax.tree.leaves(grads)
    b = leaves[0].shape[0]
    return jnp.concatenate(
        [jnp.asarray(l, jnp.promote_types(l.dtype, jnp.float32)).reshape(
            b, math.prod(l.shape[1:]))  # (not -1: B may be 0)
         for l in leaves], axis=1)
  # Under jit: one compilation, not one per primitive (op-by-op dispatch).
  return jax.jit(flat)(params, *batch)


def reference_gram(per_example_loss: Callable[..., Any], params, *batch,
                   in_axes=0, upcast: bool = False) -> np.ndarray:
  """The reference Gram ``F @ F.T``: ``float64[B, B]`` numpy.

  Arguments as :func:`per_example_grads`. For ``loss = sum_i l_i`` (pass
  ``l_i`` as the per-example loss) this is exactly the Gram that
  :func:`gram_haiku.value_grad_and_gram` returns, up to rounding.
  """
  f = np.asarray(per_example_grads(per_example_loss, params, *batch,
                                   in_axes=in_axes, upcast=upcast),
                 np.float64)
  return f @ f.T


def jacobian_gram(per_example_losses: Callable[..., Any], params,
                  *args) -> np.ndarray:
  """``J @ J.T``: ``float64[B, B]`` numpy, ``J`` the Jacobian (by
  ``jax.jacrev``) of the ``[B]`` per-example losses of the whole batch with
  respect to the parameters, flattened in ``jax.tree.leaves`` order.

  The reference for models whose examples cannot be run one at a time (a
  closed-over input, noise drawn for the batch, rows indexed inside the
  model); where they can, it equals :func:`reference_gram`.

  Args:
    per_example_losses: ``f(params, *args) -> [B]``; ``loss = sum`` of it.
    params: the parameters (any pytree).
    *args: passed to ``per_example_losses`` after ``params``.
  """
  jac = jax.jacrev(per_example_losses)(params, *args)
  leaves = jax.tree.leaves(jac)
  b = leaves[0].shape[0]
  f = np.concatenate([np.asarray(l, np.float64).reshape(b, -1)
                      for l in leaves], axis=1)
  return f @ f.T


def weighted_sum(f, c, params):
  """``sum_i c_i g_i`` in the structure of ``params``, from the reference
  ``F`` (:func:`per_example_grads`, columns in leaf order) and ``c: [B]``,
  in float64 numpy."""
  total = np.asarray(c, np.float64) @ np.asarray(f, np.float64)
  leaves, treedef = jax.tree.flatten(params)
  out, start = [], 0
  for leaf in leaves:
    n = int(np.prod(np.shape(leaf)))
    out.append(total[start:start + n].reshape(np.shape(leaf)))
    start += n
  return jax.tree.unflatten(treedef, out)


def column_groups(params) -> dict[str, slice]:
  """``{module name: slice of F's columns}`` for a Haiku ``params`` dict
  (its leaves are ordered by module, then name)."""
  groups, start = {}, 0
  for module in sorted(params):
    n = sum(int(np.prod(np.shape(v))) for v in params[module].values())
    groups[module] = slice(start, start + n)
    start += n
  return groups


def clip_reference(norms, l2_clip_norm: float, function: str = "abadi",
                   gamma: float = 0.01) -> np.ndarray:
  """The reference clip weights, float64: ``min(1, C / |g|)`` (Abadi et
  al. 2016) or ``C / (|g| + gamma)`` (Bu et al. 2022)."""
  norms = np.asarray(norms, np.float64)
  if function == "automatic":
    return l2_clip_norm / (norms + gamma)
  with np.errstate(divide="ignore"):
    return np.minimum(1.0, l2_clip_norm / norms)


#: How far above the true norm a clip factor's norm bound may lie on
#: ordinary (not cancelling) data at the suite's sizes: the bounds of
#: :mod:`gram_haiku._src.compute.norm_bounds` are worst-case rounding bounds.
CLIP_BOUND_SLACK = 1e-3


def assert_sound_norms(bounds, ref_norms, *,
                       slack: float = CLIP_BOUND_SLACK) -> None:
  """Norm bounds a clip factor is computed from (``ClippedGradAux
  .grad_norms``, or the square roots of per-layer squared norms) against
  the reference norms: never below them (beyond float64's ``1e-9``), and
  at most ``slack`` above.

  Raises:
    AssertionError: for a bound below the true norm (a broken sensitivity
      bound) or a loose one.
  """
  bounds = np.asarray(bounds, np.float64)
  ref_norms = np.asarray(ref_norms, np.float64)
  low = bounds < ref_norms * (1 - 1e-9) - 1e-30
  if np.any(low):
    raise AssertionError(f"norm bounds below the true norms at "
                         f"{np.flatnonzero(low)}: {bounds[low]} < "
                         f"{ref_norms[low]}")
  np.testing.assert_array_less(bounds, ref_norms * (1 + slack) + 1e-30,
                               err_msg="norm bounds looser than the slack")


def relative_error(got, ref) -> float:
  """``max |got - ref| / max |ref|`` in float64."""
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def assert_gram_close(got, ref, dtype: str = "float32", *,
                      rtol: float | None = None, atol: float | None = None,
                      what: str = "Gram") -> None:
  """``got`` equals ``ref`` within the tolerance of ``dtype``.

  Args:
    got: the Gram (or norms) to check.
    ref: the reference, e.g. :func:`reference_gram`.
    dtype: a key of :data:`TOLERANCES`.
    rtol: overrides the table's ``rtol`` (and then ``atol = rtol``, unless
      it is at most float32's).
    atol: an absolute tolerance, overriding the table's (not scaled).
    what: names the quantity in the failure message.

  Raises:
    AssertionError: on a shape mismatch or a difference over tolerance.
  """
  table_rtol, atol_fraction = TOLERANCES[dtype]
  if rtol is not None and rtol > table_rtol:
    table_rtol, atol_fraction = rtol, rtol
  elif rtol is not None:
    table_rtol = rtol
  got = np.asarray(got, np.float64)
  ref = np.asarray(ref, np.float64)
  if got.shape != ref.shape:
    raise AssertionError(f"{what}: shape {got.shape}, reference "
                         f"{ref.shape}.")
  scale = max(np.abs(ref).max(), 1e-30) if ref.size else 1.0
  if atol is None:
    atol = atol_fraction * scale
  np.testing.assert_allclose(
      got, ref, rtol=table_rtol, atol=atol,
      err_msg=f"{what} differs from the reference F @ F.T ({dtype})")


def assert_probe_value_close(mode: str, value, ref, *,
                             norms_rtol: float) -> None:
  """A probe's cotangent in ``mode`` against the reference Gram ``ref``:
  the Gram itself (``"gram"``, :func:`assert_gram_close`), its diagonal
  (``"norms"``, to ``norms_rtol``), or per-example gradients ``F`` whose
  ``F @ F.T`` is the Gram (``"per_example"``: their order is not checked).

  Raises:
    AssertionError: as :func:`assert_gram_close`, or ValueError for an
      unknown ``mode``.
  """
  if mode == "gram":
    assert_gram_close(value, ref)
  elif mode == "norms":
    np.testing.assert_allclose(value, np.diag(ref), rtol=norms_rtol)
  elif mode == "per_example":
    value = np.asarray(value, np.float64)
    assert_gram_close(value @ value.T, ref)
  else:
    raise ValueError(f"Unknown mode {mode!r}.")


#: The float32 and bfloat16 rows of :data:`TOLERANCES`, by name.
RTOL_F32, ATOL_F32 = TOLERANCES["float32"]
RTOL_BF16 = TOLERANCES["bfloat16"][0]
