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

Formal guarantees: for batches that differ in one example added or removed
(or replaced by one that contributes nothing), the clipped sum moves by at
most ``C`` (``sqrt(sum_l C_l^2)`` per-layer) before ``normalize_by``, in
floating point (``2 C`` for one replaced by another: jax-privacy's
``sensitivity(REPLACE_ONE)``): every clip factor is computed from a
sound upper bound of the example's norm (:mod:`gram_haiku._src.compute.norm_bounds`:
ghost norms cancel in float32), and an example whose norm is not finite
gets weight 0 with its rows masked (jax-privacy's ``nan_safe``).

The result is jax-privacy's ``BoundedSensitivityCallable`` (its
``sensitivity()`` is what jax-privacy's noise calibration and accounting
read). :func:`clipped_grad` takes the arguments of
``jax_privacy.clipping.clipped_grad`` and returns its structure (bare
gradients, or jax-privacy's ``AuxiliaryOutput`` with per-example fields),
so that a jax-privacy user switches by changing the import; the options
that need per-example gradients or a per-example vmap
(``pre_clipping_transform``, ``microbatch_size``, ``prng_argnum``,
``spmd_axis_name``, ``keep_batch_dim=False``) are refused with a message
that names what to use here. ``full_aux=True`` returns this library's
:class:`ClippedGradAux` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src.api import reweight
from gram_haiku._src.api import shard_examples
from gram_haiku._src.compat import haiku_compat as hkc
from gram_haiku._src.compute.plan import Clip
from gram_haiku._src.core import errors
from gram_haiku._src.core import one_program
from gram_haiku._src.core.result import Grams
from gram_haiku._src.frontend import plain_jax
from gram_haiku._src.frontend.probes import PROBE_NAME
from gram_haiku._src.ops.modes import clip_weights
from gram_haiku._src.passes.pass_trace import split_probes

CLIPPINGS = ("all-layer", "per-layer")
LAYER_SPLITS = ("equal", "by_size")

Thresholds = Union[float, Mapping[str, float]]
#: How one per-layer threshold ``C`` is split over the tracked modules.
LayerSplit = Union[str, Callable[[Mapping[str, int]], Mapping[str, float]]]


def check_split(split) -> None:
  """Raises a ``ValueError`` for a ``layer_split`` that is neither one of
  :data:`LAYER_SPLITS` nor a function."""
  if not (callable(split) or split in LAYER_SPLITS):
    raise ValueError(f"gram_haiku.clipped_grad: layer_split={split!r}: "
                     f"expected one of {LAYER_SPLITS} or a function.")


def split_threshold(total: float, sizes: Mapping[str, int],
                    split: LayerSplit, fn: str = "clipped_grad"
                    ) -> dict[str, float]:
  """Per-layer thresholds ``C_l`` with ``sqrt(sum_l C_l^2) == total``.

  Args:
    total: ``C``, the bound of the whole clipped per-example gradient.
    sizes: module name -> number of trainable (not frozen) parameters it tracks.
    split: ``"equal"`` (``C_l = C / sqrt(L)``, McMahan et al. 2018),
      ``"by_size"`` (``C_l = C sqrt(P_l / P)``: each layer's share of the
      squared bound is its share of the parameters), or a function
      ``sizes -> {module: w_l}`` of non-negative weights, at least one
      positive, giving ``C_l = C w_l / sqrt(sum_l w_l^2)``.
    fn: the transform that was called, for errors.

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
    weights = _split_weights(split, sizes, modules, fn)
  else:
    check_split(split)
  norm = math.sqrt(sum(w * w for w in weights.values())) or 1.0
  # (A zero weight is a zero threshold, also for C = inf: no clipping.)
  return {m: total * w / norm if w else 0.0 for m, w in weights.items()}


def _split_weights(split: Callable[[Mapping[str, int]], Mapping[str, float]],
                   sizes: Mapping[str, int], modules: list[str],
                   fn: str = "clipped_grad") -> dict[str, float]:
  """The weights ``w_l`` a ``layer_split`` function gives the ``modules``.

  Raises:
    ValueError: for weights that miss a module, are negative or not finite,
      or are all zero.
  """
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
        fn=fn, problem=problem, modules=modules))
  return {m: float(got[m]) for m in modules}


class ClippedGradAux(NamedTuple):
  """The auxiliary output of :func:`clipped_grad`'s callable with
  ``full_aux=True`` (or the form ``clipped_grad(apply, C)``).

  Per-example fields are not privatised: handle them with care (as
  jax-privacy's ``AuxiliaryOutput``).

  Attributes:
    values: the loss (``(loss, aux)`` of ``apply_fn`` with ``has_aux``).
    aux: ``apply_fn``'s aux output, or None.
    grad_norms: ``f32[B]``, each example's gradient norm before clipping
      (over every parameter): the sound upper bound its clip factor was
      computed from (at most about ``1e-4`` above the exact norm on
      ordinary data; see :mod:`gram_haiku._src.compute.norm_bounds`).
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


def _check_threshold(value, what: str, allow_inf: bool = False,
                     allow_zero: bool = False, allow_traced: bool = False):
  """A positive number (a Python, NumPy or concrete 0-d JAX scalar), ``0``
  where ``allow_zero`` (a zero gradient), ``inf`` where ``allow_inf`` (no
  clipping), a traced scalar where ``allow_traced`` (returned as is); else a
  ``ValueError``."""
  if isinstance(value, jax.core.Tracer):
    if allow_traced and jnp.ndim(value) == 0:
      return value
    raise ValueError(
        f"gram_haiku.clipped_grad: {what} is a traced value. The thresholds "
        "are static (each value compiles its own program): pass a number, "
        "outside jit.")
  if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(
      value) == 0 and (jnp.issubdtype(value.dtype, jnp.integer) or
                       jnp.issubdtype(value.dtype, jnp.floating)):
    value = value.item()
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
      value > 0 or (allow_zero and value == 0)) or not (
          math.isfinite(value) or allow_inf):
    finite = "" if allow_inf else ", finite"
    zero = " or 0" if allow_zero else ""
    raise ValueError(f"gram_haiku.clipped_grad: {what} must be a positive"
                     f"{finite} number{zero}, got {value!r}.")
  return float(value)


class _Unset:
  """A default that tells "not given" from every value."""

  def __repr__(self) -> str:
    return "<not given>"


_UNSET: Any = _Unset()


def _int_tuple(value) -> Optional[tuple[int, ...]]:
  """``value`` as a tuple of ints (an int is a 1-tuple), or None if it is
  not an int or a sequence of ints."""
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return (int(value),)
  if isinstance(value, (str, bytes, Mapping)):
    return None
  try:
    items = tuple(value)
  except TypeError:
    return None
  if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool)
             for i in items):
    return None
  return tuple(int(i) for i in items)


def _check_batch_argnums(batch_argnums, example_axes) -> Optional[
    tuple[int, ...]]:
  """jax-privacy's ``batch_argnums`` checked against
  ``fun(params, state, rng, *batch)``: None (our default rule) or a tuple
  of argument numbers 3 and up."""
  if batch_argnums is None:
    return None
  batch = _int_tuple(batch_argnums)
  problem = None
  if batch is None:
    problem = "expected an int or a sequence of ints"
  elif not batch:
    problem = "it is empty (batch_argnums must not be empty: one argument "\
        "at least holds the examples)"
  elif min(batch) < 0:
    problem = "argument numbers must be >= 0"
  elif 0 in batch:
    problem = ("it overlaps argnums=0, the parameters (no gradient is "
               "taken for arguments with a batch axis)")
  elif {1, 2} & set(batch):
    which = min({1, 2} & set(batch))
    problem = (f"argument {which} is Haiku's "
               f"{'state' if which == 1 else 'rng'}")
  elif example_axes is not None:
    problem = ("example_axes= is given too: give one of them "
               "(batch_argnums=(3, 4) is example_axes=(0, 0), one entry per "
               "argument after rng)")
  if problem:
    raise ValueError(errors.JAXP_BATCH_ARGNUMS.format(
        batch_argnums=batch_argnums, problem=problem))
  return tuple(sorted(set(batch)))


def _batch_example_axes(batch: tuple[int, ...], args) -> tuple:
  """The ``example_axes`` (one entry per argument after rng) of
  ``batch_argnums``, after jax-privacy's checks of the call's arguments."""
  if max(batch) >= len(args):
    raise ValueError(errors.JAXP_BATCH_ARGS.format(
        problem=f"batch_argnums names argument {max(batch)}, but fun was "
        f"given {len(args)} positional arguments"))
  sizes = {i: sorted({int(jnp.shape(x)[0]) if jnp.ndim(x) else None
                      for x in jax.tree_util.tree_leaves(args[i])},
                     key=str) for i in batch}
  flat = {n for s in sizes.values() for n in s}
  if len(flat) > 1 or None in flat:
    raise ValueError(errors.JAXP_BATCH_ARGS.format(
        problem="the batch arguments' leading (Batch axis) sizes differ or "
        f"are missing: {sizes} (argument number: sizes)"))
  (b,) = flat
  for i in range(3, len(args)):
    if i not in batch and any(jnp.ndim(x) and jnp.shape(x)[0] == b
                              for x in jax.tree_util.tree_leaves(args[i])):
      raise ValueError(errors.JAXP_SHARED_ARGUMENT.format(i=i, b=b))
  return tuple(0 if i in batch else None for i in range(3, len(args)))


def _returns_state(out, has_aux: bool, state) -> bool:
  """Whether ``out`` is a Haiku apply's ``(loss or (loss, aux), new
  state)``: a pair whose second entry is a state holding the probes (a
  tracked model's state always does), or, for a model with no probe (its
  parameters all bare ``hk.get_parameter`` inside ``track()``), a state
  of the same modules as the ``state`` it was given (``{}`` for ``{}``)."""
  if not (isinstance(out, tuple) and len(out) == 2 and
          isinstance(out[1], Mapping)):
    return False
  if not any(isinstance(v, Mapping) and PROBE_NAME in v
             for v in out[1].values()) and not (
                 isinstance(state, Mapping) and
                 set(out[1]) == set(state) and
                 all(isinstance(v, Mapping) for v in out[1].values())):
    return False
  return not has_aux or isinstance(out[0], (tuple, list))


def _as_apply(fun, has_aux: bool):
  """``fun`` as a Haiku apply returning ``(out, new_state)``.

  jax-privacy's users pass the loss alone (``lambda *a: f.apply(*a)[0]``
  drops the state): the state it was given then stands for the new state
  (the pass sees that no slot counter came back advanced and keeps the
  per-example gradients of a module applied more than once instead). The
  apply of ``hk.transform`` is passed on as is (the pass names the fix)."""
  if hkc.is_pure_apply(fun) or plain_jax.is_bare(fun):
    return fun

  def apply(params, state, rng, *args, **kwargs):
    out = fun(params, state, rng, *args, **kwargs)
    return out if _returns_state(out, has_aux, state) else (out, state)
  return apply


def _without_probes(aux):
  """``aux`` without the Gram probes where it is a Haiku state (``f.apply``
  with ``has_aux=True`` reads the new state as the aux, as jax-privacy
  does): they are this library's own entries, ``[B, B]`` each, and every
  example's copy of them would take ``B^3`` numbers per tracked layer."""
  if not (isinstance(aux, Mapping) and
          all(isinstance(v, Mapping) for v in aux.values())):
    return aux
  return split_probes(aux)[0]


def _per_example_forward(apply_fn, has_aux: bool, args, kwargs,
                         example_axes, size: int):
  """``(values, aux)`` of ``apply_fn`` run on each example alone, vmapped
  over the examples with a batch axis of size 1, as jax-privacy computes
  its per-example ``values`` and ``aux`` (``keep_batch_dim=True``: an aux
  leaf of shape ``(B, 1, ...)`` comes back ``(B, ...)``). Forward only."""
  params, state, rng, *batch = args
  leaves, treedef = jax.tree_util.tree_flatten(batch)
  axes = []
  for i, arg in enumerate(batch):
    ax = example_axes[i] if example_axes is not None and i < len(
        example_axes) else _UNSET
    for leaf in jax.tree_util.tree_leaves(arg):
      if ax is _UNSET:  # The default rule: axis 0 where the size is B's.
        axes.append(0 if jnp.ndim(leaf) and jnp.shape(leaf)[0] == size
                    else None)
      else:
        axes.append(None if ax is None or not jnp.ndim(leaf) else
                    ax % jnp.ndim(leaf))

  def one(*rows):
    full = [r if ax is None else jnp.expand_dims(r, ax)
            for r, ax in zip(rows, axes)]
    out, _ = apply_fn(params, state, rng,
                      *jax.tree_util.tree_unflatten(treedef, full), **kwargs)
    value, aux = out if has_aux else (out, None)
    return value, _without_probes(aux)

  values, aux = jax.vmap(one, in_axes=tuple(axes))(*leaves)
  squeeze = lambda x: (jnp.squeeze(x, 1) if jnp.ndim(x) >= 2 and
                       jnp.shape(x)[1] == 1 else x)
  return values, jax.tree_util.tree_map(squeeze, aux)


def clipped_grad(fun: Callable[..., Any], argnums: Any = _UNSET,
                 has_aux: bool = False, *,
                 l2_clip_norm: Any = _UNSET,
                 rescale_to_unit_norm: bool = False,
                 normalize_by: float = 1.0,
                 batch_argnums: Optional[Union[int, Sequence[int]]] = None,
                 keep_batch_dim: bool = True,
                 return_values: bool = False,
                 return_grad_norms: bool = False,
                 pre_clipping_transform: Optional[Callable[[Any], Any]] = None,
                 microbatch_size: Optional[int] = None,
                 nan_safe: bool = True,
                 dtype: Any = None,
                 prng_argnum: Optional[int] = None,
                 spmd_axis_name: Optional[str] = None,
                 full_aux: bool = False,
                 clipping: str = "all-layer", clip_fn: str = "abadi",
                 gamma: float = 0.01,
                 mesh_axes: str | tuple[str, ...] | None = None,
                 frozen: reweight.Frozen = None,
                 layer_split: LayerSplit = "equal",
                 example_axes: Optional[Sequence[Optional[int]]] = None,
                 mesh: Optional[jax.sharding.Mesh] = None):
  """The sum of clipped per-example gradients, in one backward pass.

  Takes the arguments of ``jax_privacy.clipping.clipped_grad`` and returns
  what it returns, so that switching is a change of import; ``fun`` is a
  tracked Haiku ``apply`` (see below), and a few of jax-privacy's options
  cannot be honoured in one pass: they raise a ``ValueError`` that names
  what to use instead. One difference of meaning: jax-privacy evaluates
  ``fun`` on one example at a time, where a mean over the batch and a sum
  agree; here ``fun`` sees the whole batch, so it must return the *sum*
  of the per-example losses (a mean divides every gradient by ``B``: a
  :class:`MeanLossWarning` says so). jax-privacy's options, in this
  function:

  ============================  ================================================
  jax-privacy                   here
  ============================  ================================================
  ``argnums``                   ``0`` or ``(0,)`` (the parameters; a tuple
                                returns ``(grads,)``); others refused
  ``has_aux``                   the same
  ``l2_clip_norm``              the same; ``0`` gives a zero gradient; traced
                                under ``jit`` with ``clipping="all-layer"``
  ``rescale_to_unit_norm``      the same (the sum divided by ``C``, as
                                ``normalize_by=C``); needs ``0 < C < inf``
  ``normalize_by``              the same
  ``batch_argnums``             argument numbers 3 and up (default: every
                                argument after ``rng``: ``example_axes``)
  ``keep_batch_dim``            ``True`` (fun takes the whole batch);
                                ``False`` refused
  ``return_values``             the same: per-example, in jax-privacy's
                                ``AuxiliaryOutput``
  ``return_grad_norms``         the same (the sound norm bounds)
  ``nan_safe``                  always on: an example whose gradient is not
                                finite gets weight 0 (``False`` changes
                                nothing)
  ``dtype``                     the clipped sum's dtype
  ``pre_clipping_transform``    refused: no per-example gradient is formed
                                (per-layer weights: ``clipping="per-layer"``)
  ``microbatch_size``           refused: no per-example gradient to bound
  ``prng_argnum``               refused: one ``rng`` (argument 2) for the batch
  ``spmd_axis_name``            refused: ``mesh_axes=`` or ``mesh=``
  ============================  ================================================

  The per-example gradients ``g_i`` are those of the terms of a *sum*
  ``sum_i l_i``: jax-privacy calls ``fun`` on each example alone (a batch
  of 1), where a mean and a sum agree; here ``fun`` runs once on the whole
  batch, so its loss must be the sum (a mean would clip ``g_i / B``; a
  :class:`~gram_haiku.MeanLossWarning` says so when it can tell).

  Args:
    fun: ``apply`` of ``hk.transform_with_state(f)``, where ``f`` runs its
      model inside ``gram_haiku.track()`` and returns ``sum_i l_i``, or
      ``(sum_i l_i, aux)`` with ``has_aux``; or a function of the same
      arguments that returns what ``f`` returns, without the state (e.g.
      ``lambda *a: f.apply(*a)[0]``: the form jax-privacy's
      ``clipped_grad`` takes, so one function serves both; a model state
      other than the probes is then not updated). Called ``fun(params,
      state, rng, *batch, **kwargs)``. jax-privacy's reading of
      ``f.apply`` itself with ``has_aux=True`` and a scalar ``f`` (the new
      state as the aux) holds here too.
    argnums: the argument differentiated: ``0`` (the default) or ``(0,)``.
      ``clipped_grad(fun, C)`` with a number or dict ``C`` and no
      ``l2_clip_norm=`` is this library's earlier form: it means
      ``l2_clip_norm=C, full_aux=True``.
    has_aux: ``f`` returns ``(loss, aux)``.
    l2_clip_norm: ``C`` (units of the gradient norm): a number ``>= 0``
      (Python, NumPy or concrete JAX scalar; ``0``: a zero gradient;
      ``inf`` with ``"abadi"``: no clipping, infinite sensitivity), or a
      traced scalar under ``jit`` (``clipping="all-layer"``; a negative
      one acts as 0). With ``clipping="per-layer"`` also a dict
      ``{module name: C_l}`` with one positive entry per tracked module and
      no other; one number ``C`` is then split over the ``L`` tracked
      modules by ``layer_split``, so that the bound is ``C`` either way.
    rescale_to_unit_norm: divide the clipped sum by ``C`` (sensitivity
      ``1 / normalize_by``). ``C`` must be positive and finite; a traced
      ``C <= 0`` gives a zero gradient (jax-privacy's limit ``C -> 0``,
      each ``g_i / |g_i|``, is ``clip_fn="automatic"`` here).
    normalize_by: the clipped sum is divided by it (e.g. the expected batch
      size); the sensitivity is divided too.
    batch_argnums: which positional arguments hold the examples (on axis 0),
      numbered as ``fun``'s: 3 and up. None: the rule of ``example_axes``.
    keep_batch_dim: must be True (``fun`` takes a batch).
    return_values: the aux's ``values``: each example's loss ``l_i``,
      ``[B]``, from a forward pass of each example alone (vmapped), as
      jax-privacy computes them: with randomness (dropout) they are not
      the losses of the batch pass the gradient was clipped for (the same
      ``rng`` drives every example's pass, as in jax-privacy without
      ``prng_argnum``).
    return_grad_norms: the aux's ``grad_norms``: ``f32[B]``, each example's
      gradient norm before clipping, the sound upper bound its clip factor
      was computed from (at most about ``1e-4`` relative above the exact
      norm on ordinary data; ``inf`` or NaN for an example whose gradient
      is not finite).
    pre_clipping_transform, microbatch_size, prng_argnum, spmd_axis_name:
      must be None (see the table).
    nan_safe: accepted; an example whose gradient is not finite always gets
      weight 0 (jax-privacy's ``nan_safe=True`` zeroes its non-finite
      entries instead; both keep the bound).
    dtype: the dtype of the clipped sum (None: the parameters'); a wider
      one is summed in, not cast to after the sum (as jax-privacy casts
      each per-example gradient): float16 parameters' sum in float32
      neither overflows nor is rounded to float16.
    full_aux: return ``(grads, ClippedGradAux)`` (this library's richer
      aux: the whole batch's value and aux, the norms, the fraction
      clipped, the weights, the Grams, the new Haiku state) in place of
      jax-privacy's structure.
    clipping: ``"all-layer"`` (the global norm) or ``"per-layer"``.
    clip_fn: ``"abadi"`` (``min(1, C/|g|)``) or ``"automatic"``
      (``C / (|g| + gamma)``).
    gamma: the stabiliser of automatic clipping.
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
      global, ``ClippedGradAux.values`` with one entry per device.

  Returns:
    A ``jax_privacy.clipping.BoundedSensitivityCallable`` ``g`` with
    ``g.l2_norm_bound = C / normalize_by`` (per-layer: ``sqrt(sum_l C_l^2)
    / normalize_by``; ``1 / normalize_by`` with ``rescale_to_unit_norm``):
    ``g(params, state, rng, *batch, is_padding_example=None, **kwargs)``
    returns ``grads`` (structured like ``params``), or, with ``has_aux``,
    ``return_values`` or ``return_grad_norms``, ``(grads,
    jax_privacy.clipping.AuxiliaryOutput(values, grad_norms, aux))`` with
    per-example fields (None where not asked for; ``values`` and ``aux``
    come from a forward pass per example, vmapped, as jax-privacy's do:
    about one forward pass more); with ``full_aux`` (or the earlier form),
    ``(grads, ClippedGradAux)``. ``g.has_aux`` says whether an aux comes
    back. ``is_padding_example``: ``bool[B]``, rows that contribute
    nothing (Poisson sampling at a fixed shape).

  Raises:
    ValueError: for a bad or refused option, threshold or ``frozen=`` (see
      :func:`gram_haiku.reweighted_grad`); from the pass, for a
      trainable parameter no Gram rule covers, an example coupling (e.g.
      ``hk.BatchNorm`` in training mode), and the
      errors of :func:`gram_haiku.value_grad_and_gram`. Each would silently
      break the privacy guarantee.
    ImportError: without jax-privacy (``pip install 'gram_haiku[dp]'``).
  """
  apply_fn = _as_apply(fun, has_aux)
  l2_clip_norm, grads_tuple, full_aux = _resolve_form(argnums, l2_clip_norm,
                                                      full_aux)
  batch = _check_batch_argnums(batch_argnums, example_axes)
  _refuse_jax_privacy_options(
      keep_batch_dim=keep_batch_dim,
      pre_clipping_transform=pre_clipping_transform,
      microbatch_size=microbatch_size, prng_argnum=prng_argnum,
      spmd_axis_name=spmd_axis_name, nan_safe=nan_safe)
  out_dtype = None if dtype is None else jnp.dtype(dtype)
  _check_full_aux(full_aux, return_values, return_grad_norms)
  if clipping not in CLIPPINGS:
    raise ValueError(f"clipping={clipping!r}: expected one of {CLIPPINGS}.")
  Clip(1.0, clip_fn, gamma)  # Validates clip_fn and gamma.
  normalize_by = _check_threshold(normalize_by, "normalize_by")
  per_layer = clipping == "per-layer"
  thresholds, total = _clip_norms(l2_clip_norm, per_layer, clip_fn)
  if rescale_to_unit_norm and not isinstance(total, jax.core.Tracer) and (
      not 0 < total < math.inf):
    raise ValueError(errors.JAXP_RESCALE.format(c=total))
  axes = shard_examples.example_axes_of(mesh_axes, mesh, "clipped_grad")
  check_split(layer_split)
  if thresholds is not None and layer_split != "equal":
    raise ValueError("gram_haiku.clipped_grad: layer_split splits one "
                     "number l2_clip_norm; with a dict of thresholds, leave "
                     "it out.")
  s = _Setup(apply_fn=apply_fn, has_aux=has_aux, grads_tuple=grads_tuple,
             full_aux=full_aux, batch=batch, return_values=return_values,
             return_grad_norms=return_grad_norms,
             rescale_to_unit_norm=rescale_to_unit_norm, frozen=frozen,
             example_axes=example_axes, mesh=mesh, layer_split=layer_split,
             clip_fn=clip_fn, gamma=gamma, per_layer=per_layer,
             thresholds=thresholds, total=total, normalize_by=normalize_by,
             out_dtype=out_dtype, axes=axes)
  default_fn = _per_device(s, example_axes) if s.batch is None else None
  callable_type = _bounded_sensitivity_callable()
  jp_aux_type = None
  if s.jp_aux:
    from jax_privacy import clipping as jp_clipping  # pylint: disable=g-import-not-at-top
    jp_aux_type = jp_clipping.AuxiliaryOutput

  def g(*args, is_padding_example=None, **kwargs):
    return _call(s, default_fn, jp_aux_type, args, is_padding_example,
                 kwargs)

  sensitivity_bound = 1.0 if rescale_to_unit_norm else s.total
  eager = one_program.compiled_when_eager(
      g, "the function clipped_grad returned")
  return callable_type(eager, sensitivity_bound / s.normalize_by,
                       bool(s.full_aux or s.jp_aux))


@dataclasses.dataclass(frozen=True, eq=False)
class _Setup:
  """What :func:`clipped_grad`'s arguments come to, checked: read by the
  callable it returns (:func:`_call`).

  Attributes (the arguments of the same name, checked, except):
    apply_fn: ``fun`` as a Haiku apply (:func:`_as_apply`).
    grads_tuple: ``argnums`` is a tuple: the gradients come back in one.
    batch: ``batch_argnums``, checked (None: ``example_axes``' rule).
    per_layer: ``clipping == "per-layer"``.
    thresholds: per-layer clipping with a dict: module -> ``C_l``, checked;
      else None.
    total: ``C`` (the bound of all layers together): a float, or a traced
      scalar (all-layer clipping under ``jit``; a NaN or negative one is 0).
    out_dtype: ``dtype`` as a NumPy dtype, or None.
    axes: the mesh axes of the examples (``mesh_axes=`` or ``mesh=``).
  """
  apply_fn: Callable[..., Any]
  has_aux: bool
  grads_tuple: bool
  full_aux: bool
  batch: Optional[tuple[int, ...]]
  return_values: bool
  return_grad_norms: bool
  rescale_to_unit_norm: bool
  frozen: Any
  example_axes: Any
  mesh: Any
  layer_split: Any
  clip_fn: str
  gamma: float
  per_layer: bool
  thresholds: Optional[Mapping[str, float]]
  total: Any
  normalize_by: float
  out_dtype: Any
  axes: tuple

  @property
  def traced(self) -> bool:
    """``C`` is a traced value (under ``jit``)."""
    return isinstance(self.total, jax.core.Tracer)

  @property
  def jp_aux(self) -> bool:
    """jax-privacy's ``AuxiliaryOutput`` comes back with the gradients."""
    return self.has_aux or self.return_values or self.return_grad_norms


def _resolve_form(argnums, l2_clip_norm, full_aux: bool
                  ) -> tuple[Any, bool, bool]:
  """``(l2_clip_norm, grads_tuple, full_aux)`` of the call's form:
  jax-privacy's (``argnums`` ``0`` or ``(0,)``) or the earlier
  ``clipped_grad(apply, C)`` (the rich aux, as before).

  Raises:
    TypeError: without ``l2_clip_norm`` in either form.
    ValueError: for ``argnums`` other than the parameters.
  """
  if l2_clip_norm is _UNSET:
    if argnums is _UNSET:
      raise TypeError("gram_haiku.clipped_grad() missing the keyword "
                      "argument 'l2_clip_norm' (the clip norm C).")
    l2_clip_norm, argnums, full_aux = argnums, 0, True
  if argnums is _UNSET:
    argnums = 0
  if _int_tuple(argnums) != (0,):
    raise ValueError(errors.JAXP_ARGNUMS.format(argnums=argnums))
  return (l2_clip_norm, not isinstance(argnums, (int, np.integer)),
          full_aux)


def _check_full_aux(full_aux: bool, return_values: bool,
                    return_grad_norms: bool) -> None:
  """Raises where ``full_aux`` (this library's aux) is asked for with
  jax-privacy's per-example fields."""
  if full_aux and (return_values or return_grad_norms):
    given = " and ".join(n for n, v in (("return_values", return_values),
                                        ("return_grad_norms",
                                         return_grad_norms)) if v)
    raise ValueError(errors.JAXP_FULL_AUX_WITH.format(given=given))


def _refuse_jax_privacy_options(*, keep_batch_dim, pre_clipping_transform,
                                microbatch_size, prng_argnum,
                                spmd_axis_name, nan_safe) -> None:
  """Raises for jax-privacy's options that one backward pass over the
  batch cannot honour (see :func:`clipped_grad`'s table)."""
  refused = (
      (keep_batch_dim is not True, lambda: errors.JAXP_KEEP_BATCH_DIM),
      (pre_clipping_transform is not None,
       lambda: errors.JAXP_PRE_CLIPPING_TRANSFORM),
      (microbatch_size is not None,
       lambda: errors.JAXP_MICROBATCH_SIZE.format(size=microbatch_size)),
      (prng_argnum is not None,
       lambda: errors.JAXP_PRNG_ARGNUM.format(argnum=prng_argnum)),
      (spmd_axis_name is not None,
       lambda: errors.JAXP_SPMD_AXIS_NAME.format(name=spmd_axis_name)),
      (not isinstance(nan_safe, bool),
       lambda: f"gram_haiku.clipped_grad: nan_safe={nan_safe!r}: expected "
       "True or False."),
  )
  for bad, message in refused:
    if bad:
      raise ValueError(message())


def _clip_norms(l2_clip_norm, per_layer: bool, clip_fn: str
                ) -> tuple[Optional[dict], Any]:
  """``(thresholds, total)`` (:class:`_Setup`) of ``l2_clip_norm``.

  Raises:
    ValueError: for a bad threshold, a traced one with per-layer clipping,
      or a dict of them with all-layer clipping.
  """
  if isinstance(l2_clip_norm, jax.core.Tracer) and per_layer:
    raise ValueError(errors.JAXP_TRACED_PER_LAYER)
  if isinstance(l2_clip_norm, Mapping):
    if not per_layer:
      raise ValueError("gram_haiku.clipped_grad: a dict of thresholds is "
                       "per-layer clipping; pass clipping='per-layer', or "
                       "one number for all-layer clipping.")
    thresholds = {k: _check_threshold(v, f"l2_clip_norm[{k!r}]",
                                      allow_inf=clip_fn == "abadi")
                  for k, v in l2_clip_norm.items()}
    return thresholds, math.sqrt(sum(v * v for v in thresholds.values()))
  bound = _check_threshold(l2_clip_norm, "l2_clip_norm",
                           allow_inf=clip_fn == "abadi", allow_zero=True,
                           allow_traced=True)
  if isinstance(bound, jax.core.Tracer):
    # (A traced NaN, e.g. a diverged adaptive estimate, acts as 0, like a
    # negative one: a zero gradient, never an unclipped one.)
    return None, jnp.where(bound > 0, bound, 0.0)
  return None, float(bound)


def _layer_clips(s: _Setup, sizes: Mapping[str, int]) -> dict[str, Clip]:
  """Per-layer clipping: module -> its :class:`Clip` (:func:`layer_clips`
  of the setup's thresholds)."""
  return layer_clips(sizes, s.thresholds, s.total, s.layer_split, s.clip_fn,
                     s.gamma)


def layer_clips(sizes: Mapping[str, int], thresholds: Optional[Mapping],
                total: float, layer_split: LayerSplit = "equal",
                clip_fn: str = "abadi", gamma: float = 0.01,
                fn: str = "clipped_grad") -> dict[str, Clip]:
  """Per-layer clipping: module -> its :class:`Clip`, for the modules that
  take part (``sizes``: their trainable parameter counts): ``thresholds``
  ``{module: C_l}`` (checked numbers), or None: ``total`` split over them
  by ``layer_split`` (:func:`split_threshold`). ``fn``: the transform, for
  errors.

  Raises:
    ValueError: where a dict of thresholds misses a module or names one
      that tracks no trainable parameter.
  """
  modules = sorted(sizes)
  if thresholds is None:
    each = split_threshold(total, sizes, layer_split, fn)
    return {m: Clip(each[m], clip_fn, gamma) for m in modules}
  missing = [m for m in modules if m not in thresholds]
  if missing:
    raise ValueError(errors.PER_LAYER_THRESHOLDS.format(
        fn=fn, problem=f"no threshold for {missing}", modules=modules))
  extra = sorted(k for k in thresholds if k not in sizes)
  if extra:
    # Their thresholds would count in the sensitivity (the noise) while
    # bounding no gradient: a misspelt name, or a module all frozen.
    raise ValueError(errors.PER_LAYER_THRESHOLDS.format(
        fn=fn, problem=f"thresholds for {extra}, which track no trainable "
        "parameter (their thresholds would only inflate the sensitivity, "
        "so the noise)", modules=modules))
  return {m: Clip(thresholds[m], clip_fn, gamma) for m in modules}


def _global_clip(s: _Setup):
  """All-layer clipping's clip. A traced threshold cannot be a
  :class:`Clip` (a static description); the weights only read these three
  fields."""
  if s.traced:
    return types.SimpleNamespace(l2_clip_norm=s.total, function=s.clip_fn,
                                 gamma=s.gamma)
  return Clip(s.total, s.clip_fn, s.gamma)


def _padding_weights(is_padding_example) -> Optional[jax.Array]:
  """``f32[B]``: 0 for a padding row, 1 for the others; None for none.

  Raises:
    ValueError: for a mask that is not boolean.
  """
  if is_padding_example is None:
    return None
  pad = jnp.asarray(is_padding_example)
  if pad.dtype != jnp.bool_:
    raise ValueError(errors.PADDING_MASK_DTYPE.format(dtype=pad.dtype))
  return 1.0 - pad.astype(jnp.float32)


def _clip_pass(s: _Setup, pass_example_axes, params, state, rng, args,
               kwargs, is_padding_example):
  """One device's ``(clipped sum, ClippedGradAux)``: the pass of
  :func:`gram_haiku._src.api.reweight.run`, clipping all layers together
  (weights from the norms) or each one in its backward rule."""
  mask = _padding_weights(is_padding_example)
  kw = dict(fn_name="clipped_grad", needs="norms", has_aux=s.has_aux,
            axes=s.axes, frozen=s.frozen, example_weights=mask, privacy=True,
            example_axes=pass_example_axes, dtype=s.out_dtype)
  if s.per_layer:
    r = reweight.run(s.apply_fn, params, state, rng, args, kwargs,
                     clips=functools.partial(_layer_clips, s), **kw)
    clipped = jnp.zeros(r.grams.sq_norms.shape, bool)
    for m, sq in r.grams.sq_norms_by_layer.items():
      clipped |= sq > r.clips[m].l2_clip_norm ** 2
  else:
    clip = _global_clip(s)
    r = reweight.run(s.apply_fn, params, state, rng, args, kwargs,
                     weight_fn=lambda g: clip_weights(g.sq_norms, clip), **kw)
    clipped = r.grams.norms > s.total
  real = jnp.ones(clipped.shape) if mask is None else mask
  counts = jnp.stack([jnp.sum(clipped * real), jnp.sum(real)])
  if s.axes:  # Every device's examples, as the clipped sum is.
    counts = jax.lax.psum(counts, s.axes)
  fraction = counts[0] / jnp.maximum(counts[1], 1)
  grads = r.grads
  if s.normalize_by != 1.0:
    grads = jax.tree_util.tree_map(lambda g: g / s.normalize_by, grads)
  aux = r.value[1] if s.has_aux else None
  return grads, ClippedGradAux(r.value, aux, r.grams.norms, fraction,
                               r.weights, r.grams, r.state)


def _per_device(s: _Setup, pass_example_axes):
  """``fn(params, state, rng, *args, is_padding_example=None, **kwargs)``:
  :func:`_clip_pass`, in its own ``shard_map`` where ``s.mesh`` is given."""

  def fn(params, state, rng, *args, is_padding_example=None, **kwargs):
    return _clip_pass(s, pass_example_axes, params, state, rng, args, kwargs,
                      is_padding_example)

  if s.mesh is None:
    return fn
  return shard_examples.shard_examples(
      fn, mesh=s.mesh, axes=s.axes, example_axes=pass_example_axes,
      fn_name="clipped_grad", row_kwargs=("is_padding_example",),
      rows=lambda out: (shard_examples.mark(out[0], False),
                        out[1]._replace(**{
                            k: shard_examples.mark(v, k in _ROWS)
                            for k, v in out[1]._asdict().items()})))


def _finish_grads(s: _Setup, grads):
  """The clipped sum as returned: divided by ``C`` where rescaled to unit
  norm, cast to ``dtype``, in a tuple where ``argnums`` is one."""
  if s.rescale_to_unit_norm:
    inv = (jnp.where(s.total > 0, 1 / jnp.where(s.total > 0, s.total, 1), 0)
           if s.traced else 1 / s.total)
    grads = jax.tree_util.tree_map(lambda x: (x * inv).astype(x.dtype), grads)
  if s.out_dtype is not None:
    grads = jax.tree_util.tree_map(lambda x: x.astype(s.out_dtype), grads)
  return (grads,) if s.grads_tuple else grads


def _call(s: _Setup, default_fn, jp_aux_type, args, is_padding_example,
          kwargs):
  """A call of :func:`clipped_grad`'s callable: the clipped sum, with the
  aux asked for (jax-privacy's ``AuxiliaryOutput``, or
  :class:`ClippedGradAux` with ``full_aux``).

  Raises:
    ValueError: for fewer than ``(params, state, rng)``.
  """
  if len(args) < 3:
    raise ValueError(errors.CLIPPED_GRAD_ARGUMENTS.format(n=len(args)))
  pass_axes, fn = s.example_axes, default_fn
  if s.batch is not None:
    pass_axes = _batch_example_axes(s.batch, args)
    fn = _per_device(s, pass_axes)
  extra = {} if is_padding_example is None else dict(
      is_padding_example=is_padding_example)
  grads, rich = fn(*args, **kwargs, **extra)
  grads = _finish_grads(s, grads)
  if s.full_aux:
    return grads, rich
  if not s.jp_aux:
    return grads
  values = aux = None
  if s.return_values or s.has_aux:
    values, aux = _per_example_forward(
        s.apply_fn, s.has_aux, args, kwargs, pass_axes,
        int(jnp.shape(rich.grad_norms)[0]))
  return grads, jp_aux_type(
      values=values if s.return_values else None,
      grad_norms=rich.grad_norms if s.return_grad_norms else None,
      aux=aux if s.has_aux else None)


# The fields of ClippedGradAux with one row per example.
_ROWS = ("grad_norms", "weights", "grams")
