"""``clipped_grad``: DP-SGD's clipped gradient sum in one backward pass.

The per-example gradients ``g_i`` are clipped, ``g_i -> c_i g_i``, and
summed: ``sum_i c_i g_i / normalize_by``.

* ``clipping="all-layer"``: ``c_i`` from the global norm ``|g_i|`` over
  every parameter (Abadi et al. 2016), computed from the Grams' diagonal of
  the same pass and re-contracted from each layer's book-keeping store
  (:func:`gram_haiku.reweighted_grad`).
* ``clipping="per-layer"``: each tracked module ``l`` clips its own
  parameters' gradient to ``C_l`` inside its backward rule (no stored
  factors; a module applied more than once keeps its slots or per-example
  gradients and is clipped after the pass). The sum then has norm at most
  ``sqrt(sum_l C_l^2)`` per example (McMahan et al. 2018, per-layer
  clipping). One number ``C`` is split over the layers by ``layer_split``
  (:func:`split_threshold`).

Clip functions: ``"abadi"``: ``c_i = min(1, C / |g_i|)``; ``"automatic"``:
``c_i = C / (|g_i| + gamma)`` (Bu et al. 2022, "Automatic clipping:
differentially private deep learning made easier and stronger"). Either way
``|c_i g_i| <= C``.

Formal guarantees: for batches that differ in one example, the clipped sum
moves by at most ``C`` (``sqrt(sum_l C_l^2)`` per-layer) before
``normalize_by``, in floating point: every clip factor is computed from a
sound upper bound of the example's norm (:mod:`gram_haiku._src.norm_bounds`:
ghost norms cancel in float32), and an example whose norm is not finite
gets weight 0 with its rows masked (jax-privacy's ``nan_safe``).

The result is jax-privacy's ``BoundedSensitivityCallable`` (its
``sensitivity()`` is what jax-privacy's noise calibration and accounting
read), with the conventions of ``jax_privacy.clipping.clipped_grad``
(``l2_clip_norm``, ``normalize_by``, ``is_padding_example``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src import errors
from gram_haiku._src import reweight
from gram_haiku._src import shard_examples
from gram_haiku._src.ops.modes import clip_weights
from gram_haiku._src.plan import Clip
from gram_haiku._src.result import Grams

CLIPPINGS = ("all-layer", "per-layer")
LAYER_SPLITS = ("equal", "by_size")

Thresholds = Union[float, Mapping[str, float]]
#: How one per-layer threshold ``C`` is split over the tracked modules.
LayerSplit = Union[str, Callable[[Mapping[str, int]], Mapping[str, float]]]


def _check_split(split) -> None:
  if not (callable(split) or split in LAYER_SPLITS):
    raise ValueError(f"gram_haiku.clipped_grad: layer_split={split!r}: "
                     f"expected one of {LAYER_SPLITS} or a function.")


def split_threshold(total: float, sizes: Mapping[str, int],
                    split: LayerSplit) -> dict[str, float]:
  """Per-layer thresholds ``C_l`` with ``sqrt(sum_l C_l^2) == total``.

  Args:
    total: ``C``, the bound of the whole clipped per-example gradient.
    sizes: module name -> number of trainable (not frozen) parameters it tracks.
    split: ``"equal"`` (``C_l = C / sqrt(L)``, McMahan et al. 2018),
      ``"by_size"`` (``C_l = C sqrt(P_l / P)``: each layer's share of the
      squared bound is its share of the parameters), or a function
      ``sizes -> {module: w_l}`` of non-negative weights, at least one
      positive, giving ``C_l = C w_l / sqrt(sum_l w_l^2)``.

  Raises:
    ValueError: for an unknown split, or weights that miss a module, are
      negative or not finite, or are all zero.
  """
  modules = sorted(sizes)
  if split == "equal":
    weights = {m: 1.0 for m in modules}
  elif split == "by_size":
    weights = {m: math.sqrt(sizes[m]) for m in modules}
  elif callable(split):
    got = dict(split(dict(sizes)))
    missing = [m for m in modules if m not in got]
    bad = {m: got[m] for m in modules if m in got and (
        isinstance(got[m], bool) or not isinstance(got[m], (int, float)) or
        not math.isfinite(got[m]) or got[m] < 0)}
    if missing or bad or not any(got[m] > 0 for m in modules):
      problem = (f"layer_split returned no weight for {missing}" if missing
                 else f"layer_split returned weights {bad} (each must be a "
                 "finite number >= 0)" if bad
                 else "layer_split returned only zero weights")
      raise ValueError(errors.PER_LAYER_THRESHOLDS.format(
          problem=problem, modules=modules))
    weights = {m: float(got[m]) for m in modules}
  else:
    _check_split(split)
  norm = math.sqrt(sum(w * w for w in weights.values())) or 1.0
  # (A zero weight is a zero threshold, also for C = inf: no clipping.)
  return {m: total * w / norm if w else 0.0 for m, w in weights.items()}


class ClippedGradAux(NamedTuple):
  """The auxiliary output of :func:`clipped_grad`'s callable.

  Per-example fields are not privatised: handle them with care (as
  jax-privacy's ``AuxiliaryOutput``).

  Attributes:
    values: the loss (``(loss, aux)`` of ``apply_fn`` with ``has_aux``).
    aux: ``apply_fn``'s aux output, or None.
    grad_norms: ``f32[B]``, each example's gradient norm before clipping
      (over every parameter): the sound upper bound its clip factor was
      computed from (at most about ``1e-4`` above the exact norm on
      ordinary data; see :mod:`gram_haiku._src.norm_bounds`).
    fraction_clipped: ``f32[]``, the fraction of the real (non-padding)
      examples whose gradient was scaled down (``"per-layer"``: in any
      layer); under ``shard_map`` (``mesh_axes``) over every device's
      examples, the same on each device.
    weights: module name -> ``f32[B]``, the ``c_i`` each module's gradient
      was formed with (0 for padding rows).
    grams: the :class:`~gram_haiku.Grams` of the pass (per-layer squared
      norms).
    state: the updated Haiku state.
  """
  values: Any
  aux: Any
  grad_norms: jax.Array
  fraction_clipped: jax.Array
  weights: Mapping[str, jax.Array]
  grams: Grams
  state: Any


def _bounded_sensitivity_callable():
  try:
    from jax_privacy import clipping as jp_clipping  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError(errors.NEEDS_JAX_PRIVACY.format(error=e)) from None
  return jp_clipping.BoundedSensitivityCallable


def _check_threshold(value, what: str, allow_inf: bool = False) -> float:
  """A positive number (a Python, NumPy or concrete 0-d JAX scalar), or
  ``inf`` where ``allow_inf`` (no clipping); else a ``ValueError``."""
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
        f"gram_haiku.clipped_grad: {what} is a traced value. The thresholds "
        "are static (each value compiles its own program): pass a number, "
        "outside jit.")
  if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(
      value) == 0 and (jnp.issubdtype(value.dtype, jnp.integer) or
                       jnp.issubdtype(value.dtype, jnp.floating)):
    value = value.item()
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      value > 0) or not (math.isfinite(value) or allow_inf):
    finite = "" if allow_inf else ", finite"
    raise ValueError(f"gram_haiku.clipped_grad: {what} must be a positive"
                     f"{finite} number, got {value!r}.")
  return float(value)


def clipped_grad(apply_fn: Callable[..., Any], l2_clip_norm: Thresholds, *,
                 clipping: str = "all-layer", clip_fn: str = "abadi",
                 gamma: float = 0.01, normalize_by: float = 1.0,
                 has_aux: bool = False,
                 mesh_axes: str | tuple[str, ...] | None = None,
                 frozen: reweight.Frozen = None,
                 layer_split: LayerSplit = "equal",
                 example_axes: Optional[Sequence[Optional[int]]] = None,
                 mesh: Optional[jax.sharding.Mesh] = None):
  """The sum of clipped per-example gradients, in one backward pass.

  Args:
    apply_fn: ``apply`` of ``hk.transform_with_state(f)``, where ``f`` runs
      its model inside ``gram_haiku.track()`` and returns ``sum_i l_i`` (a
      *sum* of per-example losses: a mean would clip ``g_i / B``).
    l2_clip_norm: ``C`` (units of the gradient norm), a positive number
      known when the step is built (Python, NumPy or concrete JAX scalar;
      ``inf`` with ``"abadi"``: no clipping, infinite sensitivity). With
      ``clipping="per-layer"`` also a dict ``{module name: C_l}`` with
      one entry per tracked module and no other; one number ``C`` is then
      split over the ``L`` tracked modules by ``layer_split``, so that the
      bound is ``C`` either way.
    clipping: ``"all-layer"`` (the global norm) or ``"per-layer"``.
    clip_fn: ``"abadi"`` (``min(1, C/|g|)``) or ``"automatic"``
      (``C / (|g| + gamma)``).
    gamma: the stabiliser of automatic clipping.
    normalize_by: the clipped sum is divided by it (e.g. the expected batch
      size); the sensitivity is divided too.
    has_aux: ``f`` returns ``(loss, aux)``.
    mesh_axes: as in :func:`gram_haiku.value_grad_and_gram` (inside
      ``shard_map``; the clipped sum is summed over devices).
    frozen: parameters with zero gradient (see
      :func:`gram_haiku.reweighted_grad`).
    layer_split: per-layer clipping with one number ``C``: ``"equal"``
      (``C_l = C / sqrt(L)``), ``"by_size"`` (``C_l = C sqrt(P_l / P)``)
      or a function ``{module: number of parameters} -> {module: w_l}``
      of non-negative weights (``C_l = C w_l / sqrt(sum w^2)``); see
      :func:`split_threshold`. ``P_l``: the trainable entries of the
      module's parameters in ``params`` (an ``hk.layer_stack`` module's
      whole stack).
    example_axes: as in :func:`gram_haiku.value_grad_and_gram`.
    mesh: as in :func:`gram_haiku.value_grad_and_gram`: ``g`` builds its
      own ``shard_map`` and takes the whole batch (``is_padding_example``
      split with it); ``grad_norms``, ``weights`` and ``grams`` come back
      global, ``values`` with one entry per device.

  Returns:
    A ``jax_privacy.clipping.BoundedSensitivityCallable`` ``g`` with
    ``g.l2_norm_bound = C / normalize_by`` (per-layer: ``sqrt(sum_l C_l^2)
    / normalize_by``) and ``has_aux=True``:
    ``g(params, state, rng, *args, is_padding_example=None, **kwargs) ->
    (grads, ClippedGradAux)``. ``is_padding_example``: ``bool[B]``, rows
    that contribute nothing (Poisson sampling at a fixed shape).

  Raises:
    ValueError: for a bad option, threshold or ``frozen=`` (see
      :func:`gram_haiku.reweighted_grad`); from the pass, for a
      trainable parameter no Gram rule covers, an example coupling (e.g.
      ``hk.BatchNorm`` in training mode), and the
      errors of :func:`gram_haiku.value_grad_and_gram`. Each would silently
      break the privacy guarantee.
    ImportError: without jax-privacy (``pip install 'gram_haiku[dp]'``).
  """
  if clipping not in CLIPPINGS:
    raise ValueError(f"clipping={clipping!r}: expected one of {CLIPPINGS}.")
  Clip(1.0, clip_fn, gamma)  # Validates clip_fn and gamma.
  normalize_by = _check_threshold(normalize_by, "normalize_by")
  per_layer = clipping == "per-layer"
  if isinstance(l2_clip_norm, Mapping):
    if not per_layer:
      raise ValueError("gram_haiku.clipped_grad: a dict of thresholds is "
                       "per-layer clipping; pass clipping='per-layer', or "
                       "one number for all-layer clipping.")
    thresholds = {k: _check_threshold(v, f"l2_clip_norm[{k!r}]",
                                      allow_inf=clip_fn == "abadi")
                  for k, v in l2_clip_norm.items()}
    bound = math.sqrt(sum(v * v for v in thresholds.values()))
  else:
    thresholds = None
    bound = _check_threshold(l2_clip_norm, "l2_clip_norm",
                             allow_inf=clip_fn == "abadi")
  total = float(bound)
  axes = shard_examples.example_axes_of(mesh_axes, mesh, "clipped_grad")

  _check_split(layer_split)
  if thresholds is not None and layer_split != "equal":
    raise ValueError("gram_haiku.clipped_grad: layer_split splits one "
                     "number l2_clip_norm; with a dict of thresholds, leave "
                     "it out.")

  def layer_clips(sizes: Mapping[str, int]) -> dict[str, Clip]:
    modules = sorted(sizes)
    if thresholds is None:
      each = split_threshold(total, sizes, layer_split)
      return {m: Clip(each[m], clip_fn, gamma) for m in modules}
    missing = [m for m in modules if m not in thresholds]
    if missing:
      raise ValueError(errors.PER_LAYER_THRESHOLDS.format(
          problem=f"no threshold for {missing}", modules=modules))
    extra = sorted(k for k in thresholds if k not in sizes)
    if extra:
      # Their thresholds would count in the sensitivity (the noise) while
      # bounding no gradient: a misspelt name, or a module all frozen.
      raise ValueError(errors.PER_LAYER_THRESHOLDS.format(
          problem=f"thresholds for {extra}, which track no trainable "
          "parameter (their thresholds would only inflate the sensitivity, "
          "so the noise)", modules=modules))
    return {m: Clip(thresholds[m], clip_fn, gamma) for m in modules}

  global_clip = Clip(total, clip_fn, gamma)

  def fun(params, state, rng, *args, is_padding_example=None, **kwargs):
    mask = None
    if is_padding_example is not None:
      pad = jnp.asarray(is_padding_example)
      if pad.dtype != jnp.bool_:
        raise ValueError(errors.PADDING_MASK_DTYPE.format(dtype=pad.dtype))
      mask = 1.0 - pad.astype(jnp.float32)
    kw = dict(fn_name="clipped_grad", needs="norms", has_aux=has_aux,
              axes=axes, frozen=frozen, example_weights=mask, privacy=True,
              example_axes=example_axes)
    if per_layer:
      r = reweight.run(apply_fn, params, state, rng, args, kwargs,
                       clips=layer_clips, **kw)
      clips = r.clips
      clipped = jnp.zeros(r.grams.sq_norms.shape, bool)
      for m, sq in r.grams.sq_norms_by_layer.items():
        clipped |= sq > clips[m].l2_clip_norm ** 2
    else:
      r = reweight.run(apply_fn, params, state, rng, args, kwargs,
                       weight_fn=lambda g: clip_weights(g.sq_norms,
                                                             global_clip),
                       **kw)
      clipped = r.grams.norms > total
    real = jnp.ones(clipped.shape) if mask is None else mask
    counts = jnp.stack([jnp.sum(clipped * real), jnp.sum(real)])
    if axes:  # Every device's examples, as the clipped sum is.
      counts = jax.lax.psum(counts, axes)
    fraction = counts[0] / jnp.maximum(counts[1], 1)
    grads = r.grads
    if normalize_by != 1.0:
      grads = jax.tree_util.tree_map(lambda g: g / normalize_by, grads)
    values, aux = (r.value, r.value[1]) if has_aux else (r.value, None)
    return grads, ClippedGradAux(values, aux, r.grams.norms, fraction,
                                 r.weights, r.grams, r.state)

  if mesh is not None:
    fun = shard_examples.shard_examples(
        fun, mesh=mesh, axes=axes, example_axes=example_axes,
        fn_name="clipped_grad", row_kwargs=("is_padding_example",),
        rows=lambda out: (shard_examples.mark(out[0], False),
                          out[1]._replace(**{
                              k: shard_examples.mark(v, k in _ROWS)
                              for k, v in out[1]._asdict().items()})))
  callable_type = _bounded_sensitivity_callable()
  return callable_type(fun, total / normalize_by, True)


# The fields of ClippedGradAux with one row per example.
_ROWS = ("grad_norms", "weights", "grams")
