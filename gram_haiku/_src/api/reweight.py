"""``reweighted_grad``: ``sum_i c_i g_i``, ``c`` chosen from the same pass.

One backward pass of the tracked loss. Each tracked layer runs its op in a
book-keeping mode instead of its Gram mode: it keeps its factors or its
per-example gradients (:mod:`gram_haiku._src.passes.bookkeeping`), or clips its own
parameter gradients inside its backward rule (``"clip"``, per-layer
clipping). The parameters themselves are not differentiated by the pass
(except those of ``"clip"`` layers), so the plain weight gradient is never
formed. After the pass the Grams (or norms) come from what the layers kept,
``c = weight_fn(grams)``, and every parameter's ``sum_i c_i g_i`` is
re-contracted from the same stores. :func:`run` is that composition of the
pass pipeline (:mod:`gram_haiku._src.passes.pass_pipeline`), shared by
:func:`reweighted_grad` and :func:`gram_haiku.clipped_grad`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src.api import shard_examples
from gram_haiku._src.compute.plan import Clip
from gram_haiku._src.core import errors
from gram_haiku._src.core import one_program
from gram_haiku._src.core.result import Grams
from gram_haiku._src.frontend.coverage import ParamCoverage
from gram_haiku._src.ops.modes import clip_weights
from gram_haiku._src.passes import pass_pipeline as pipeline

#: What ``weight_fn`` is given: full Grams or their diagonals only.
Needs = Literal["norms", "gram"]
NEEDS = ("norms", "gram")

#: ``frozen=``: parameter names (``"module/name"``) or module names, a
#: Haiku-style predicate ``(module_name, name, value) -> bool``, or a
#: boolean mask shaped like (a prefix of) the parameters.
Frozen = Any


@dataclasses.dataclass
class PassResult:
  """What one reweighted pass gives.

  Attributes:
    value: the loss (``(loss, aux)`` with ``has_aux``).
    state: the updated Haiku state.
    grads: ``sum_i c_i g_i`` for every parameter (zero for frozen ones).
    grams: the :class:`Grams` of the pass (``needs`` says full or norms).
    weights: module name -> the ``(B,)`` weights its gradient was formed
      with (one vector for all modules unless clipped per layer).
    modes: module name -> what the layer kept, its
      :class:`~gram_haiku._src.passes.pass_pipeline.Store` (``"factors"``,
      ``"slots"``: the factors of each of its applications, or
      ``"per_example"``) or ``"clip"``; modules that keep nothing are left
      out.
    clips: module name -> its :class:`~gram_haiku._src.compute.plan.Clip` under
      per-layer clipping (empty otherwise).
    cross: with ``cross_rows=s``, ``(blocks, summed)``: module name -> its
      Gram block ``[s, B - s]`` between the first ``s`` examples and the
      others, and -> the block's row sums ``[s]``, formed without it
      (:func:`~gram_haiku._src.passes.pass_pipeline.read_cross`); else None.
  """
  value: Any
  state: Any
  grads: Any
  grams: Grams
  weights: Mapping[str, jax.Array]
  modes: Mapping[str, str]
  clips: Mapping[str, Clip] = dataclasses.field(default_factory=dict)
  cross: Optional[tuple[Mapping[str, jax.Array],
                        Mapping[str, jax.Array]]] = None


def frozen_leaves(frozen: Frozen, params) -> set[str]:
  """Full names (``module/name``) of the frozen parameter leaves."""
  names = pipeline.leaf_names(params)
  if frozen is None:
    return set()
  if isinstance(frozen, (bool, np.bool_)):
    raise ValueError(
        f"gram_haiku: frozen={frozen!r}: frozen= takes 'module/name' or "
        "module names, a predicate (module_name, name, value) -> bool, or a "
        "boolean mask shaped like the parameters ({module: True}), not one "
        "boolean.")
  if callable(frozen):
    out = set()
    for module, entries in params.items():
      for name, value in entries.items():
        if frozen(module, name, value):
          out.add(f"{module}/{name}")
    return out
  if isinstance(frozen, Mapping):
    return _frozen_mask_leaves(frozen, params)
  if isinstance(frozen, str):
    frozen = (frozen,)
  wanted = set(frozen)
  out = {n for n in names if n in wanted or n.rsplit("/", 1)[0] in wanted}
  unknown = sorted(w for w in wanted if not any(
      n == w or n.rsplit("/", 1)[0] == w for n in names))
  if unknown:
    raise ValueError(f"gram_haiku: frozen={sorted(wanted)} names "
                     f"{unknown}, which are neither parameters nor modules "
                     f"of params (they are {names}).")
  return out


def _frozen_mask_leaves(mask: Mapping, params) -> set[str]:
  """A boolean mask shaped like (a prefix of) ``params``, as optax's
  ``masked`` takes: ``{module: True}`` or ``{module: {name: True}}``; True
  is frozen, a module or leaf left out is not."""
  out = set()
  for module, entry in mask.items():
    if module not in params:
      raise ValueError(
          f"gram_haiku: the frozen= mask names module {module!r}, which is "
          f"not a module of params (they are {sorted(params)}).")
    leaves = params[module]
    if isinstance(entry, Mapping):
      items = list(entry.items())
    else:
      items = [(name, entry) for name in leaves]
    for name, flag in items:
      if name not in leaves:
        raise ValueError(
            f"gram_haiku: the frozen= mask names {module}/{name}, which is "
            f"not a parameter of params (module {module!r} has "
            f"{sorted(leaves)}).")
      if not isinstance(flag, (bool, np.bool_)):
        raise ValueError(
            f"gram_haiku: the frozen= mask holds {flag!r} "
            f"({type(flag).__name__}) at {module}/{name}; a mask holds "
            "Python booleans (True: frozen). To name parameters, pass "
            "'module/name' strings; to decide from values, a predicate "
            "(module_name, name, value) -> bool.")
      if flag:
        out.add(f"{module}/{name}")
  return out


def _check_complete(fn_name: str, coverage, frozen: set[str],
                    privacy: bool) -> None:
  missing = sorted(k for k, c in coverage.items()
                   if not c.tracked and k not in frozen)
  if missing:
    why = "; ".join(f"{k}: read by {coverage[k].module_type}"
                    for k in missing)
    raise ValueError(errors.REWEIGHT_UNTRACKED.format(
        fn=fn_name, params=missing, why=why,
        privacy=(" (a privacy guarantee would silently break)"
                 if privacy else "")))


def _trainable_sizes(found, live, leaves, names, frozen_names
                     ) -> dict[str, int]:
  """Module name -> the number of trainable parameters it tracks, counted
  on the parameter leaves it reads (directly, or through a reparametrising
  getter's pull-back), each leaf once, frozen ones left out.

  Counted on the leaves, not on the op's operands: inside ``hk.layer_stack``
  the op sees one layer's slice of a ``[L, ...]`` leaf. A leaf counts once
  however often the module reads it (a module called several times). A
  module whose operands reach no leaf at all keeps its op's count.
  """
  out = {}
  for m in live:
    ks = {k for k in found.param_leaves.get(m, ()) if k is not None}
    pull = found.pullbacks.get(m)
    if pull is not None:
      ks |= set(pull.leaves)
    ks = {k for k in ks if names[k] not in frozen_names}
    out[m] = (sum(int(math.prod(jnp.shape(leaves[k]))) for k in sorted(ks))
              if ks else found.ops[m].num_trainable_params())
  return out


def _check_not_all_frozen(fn_name: str, names: Sequence[str],
                          frozen_names: set[str]) -> None:
  """Raises where ``frozen=`` freezes every parameter leaf (``names``)."""
  if names and frozen_names >= set(names):
    raise ValueError(
        f"gram_haiku.{fn_name}: frozen= freezes every parameter "
        f"({sorted(names)}): every gradient would be zero and there is no "
        "per-example gradient to weight or clip.\nWhat to do: leave at "
        "least one parameter unfrozen, or skip the update.")


def _mask(example_weights: Optional[jax.Array], size: int) -> jax.Array:
  """``(B,)`` factors of every weight: ``example_weights`` (a padding mask),
  or ones.

  Raises:
    ValueError: for ``example_weights`` of another shape.
  """
  if example_weights is None:
    return jnp.ones((size,), jnp.float32)
  if jnp.shape(example_weights) != (size,):
    raise ValueError(errors.PADDING_MASK_SHAPE.format(
        shape=jnp.shape(example_weights), size=size))
  return example_weights


def _weights(grams: Grams, weight_fn, objective, mask: jax.Array,
             kept: Sequence[str], size: int) -> dict[str, jax.Array]:
  """Module -> the ``(B,)`` weights its gradient is formed with: one
  ``c = weight_fn(grams)`` for all, or each module's clip weights from its
  own norms (per-layer clipping, ``objective.clips``), times ``mask``.

  Raises:
    ValueError: for a ``weight_fn`` result that is not ``(B,)`` floats.
  """
  if weight_fn is None:
    return {m: clip_weights(grams.sq_norms_by_layer[m],
                            objective.clips[m]) * mask for m in kept}
  c = jnp.asarray(weight_fn(grams))
  if c.shape != (size,) or not jnp.issubdtype(c.dtype, jnp.floating):
    raise ValueError(errors.WEIGHTS_SHAPE.format(
        got=f"{c.dtype}{list(c.shape)}", size=size))
  return {m: c * mask.astype(c.dtype) for m in kept}


def run(apply_fn, params, state, rng, args, kwargs, *, fn_name: str,
        needs: str, has_aux: bool, axes: tuple[str, ...], frozen: Frozen,
        weight_fn: Optional[Callable[[Grams], jax.Array]] = None,
        clips: Optional[Callable[[Mapping[str, int]],
                                 Mapping[str, Clip]]] = None,
        example_weights: Optional[jax.Array] = None,
        privacy: bool = False, example_axes=None,
        cross_rows: Optional[int] = None,
        unit_rows: bool = False, dtype=None) -> PassResult:
  """One reweighted pass (see the module docstring): the pass pipeline
  (:mod:`gram_haiku._src.passes.pass_pipeline`) with a re-contracting objective.

  Exactly one of ``weight_fn`` (one ``c`` for every module, from the Grams)
  and ``clips`` (per-layer clipping: ``clips({module: number of
  parameters}) -> {module: Clip}``) is given. ``example_weights``: ``(B,)``
  factors every ``c`` is multiplied by (a padding mask), or None.
  ``privacy``: the completeness and example-flow checks a privacy
  guarantee needs. ``cross_rows``: also read each module's Gram block
  between the first ``cross_rows`` examples and the others
  (:attr:`PassResult.cross`). ``unit_rows``: the weights are 1 on those
  first ``cross_rows`` examples and 0 on the others, whatever the Grams
  (a cross pass without clipping): where a block is formed from
  materialised per-example gradients, their sum is the update (no
  re-contraction of those factors). ``dtype``: the summed gradient's
  dtype (None: the parameters'), formed without rounding to the
  parameters' dtype first.
  """
  frozen_names = frozen_leaves(frozen, params)
  t = pipeline.trace(apply_fn, has_aux, params, state, rng, args, kwargs,
                     axes, strict=privacy, example_axes=example_axes,
                     sum_for=None if cross_rows is None else "cross_gram",
                     frozen=frozenset(frozen_names), fn_name=fn_name)
  leaves, treedef = jax.tree_util.tree_flatten(params)
  names = pipeline.leaf_names(params)
  _check_not_all_frozen(fn_name, names, frozen_names)
  coverage = pipeline.coverage_of(params, t.seen, t.found)
  _check_complete(fn_name, coverage, frozen_names, privacy)
  objective = pipeline.Objective(recontract=True, needs=needs,
                                 upper_bound=privacy,
                                 frozen=frozenset(frozen_names),
                                 parts=cross_rows is None,
                                 blocks=cross_rows is not None,
                                 sum_dtype=dtype)
  t, live = pipeline.participants(t, objective, params)
  if clips is not None:
    objective = objective.with_clips(clips({
        **_trainable_sizes(t.found, live, leaves, names, frozen_names),
        **pipeline.program_sizes(t, objective, leaves)}))
  mask = _mask(example_weights, t.size)
  p = pipeline.run(t, objective, params, rng, args, kwargs, live=live,
                   mask=mask)
  value = (p.value, p.aux) if has_aux else p.value
  for name in frozen_names:
    coverage[name] = ParamCoverage(True, "frozen", coverage[name].module_type)
  opened = pipeline.open_stores(t, p, leaves)
  skip = frozenset(k for k, n in enumerate(names) if n in frozen_names)
  grams = pipeline.read_grams(t, p, objective, leaves, opened, coverage, skip)
  kept = [m for m, s in p.stores.items() if s != pipeline.Store.NOTHING]
  weights = _weights(grams, weight_fn, objective, mask, kept, t.size)
  # Rows with weight 0 (padding, or an example whose norm is not finite
  # under clipping) may hold anything, even NaN: their inputs are masked.
  known = {} if unit_rows and cross_rows is not None else None
  cross = (None if cross_rows is None else tuple(
      pipeline.read_cross(t, p, leaves, opened, cross_rows, skip, summed,
                          objective.upper_bound,
                          row_sums=None if summed else known)
      for summed in (False, True)))
  grads = pipeline.recontract(t, p, objective, leaves, opened, weights,
                              example_weights is not None or privacy, skip,
                              rows=cross_rows, known=known)
  return PassResult(value, p.state,
                    jax.tree_util.tree_unflatten(treedef, grads), grams,
                    weights, {m: p.stores[m] for m in kept},
                    dict(objective.clips), cross)


def check_needs(needs) -> None:
  if needs not in NEEDS:
    raise ValueError(f"needs={needs!r}: expected one of {NEEDS}.")


def reweighted_grad(apply_fn: Callable[..., Any],
                    weight_fn: Callable[[Grams], jax.Array], *,
                    needs: str = "norms", has_aux: bool = False,
                    return_state: bool = False,
                    mesh_axes: str | tuple[str, ...] | None = None,
                    frozen: Frozen = None,
                    example_axes: Optional[Sequence[Optional[int]]] = None,
                    mesh: Optional[jax.sharding.Mesh] = None
                    ) -> Callable[..., Any]:
  """Transforms a tracked ``apply`` into one returning ``sum_i c_i g_i``.

  ``c = weight_fn(grams)`` is computed from the Grams of the same backward
  pass, and the gradient ``sum_i c_i g_i`` of every parameter is formed
  without a second backward pass: each tracked layer keeps its
  book-keeping factors (input and output cotangent) or its per-example
  gradients, whichever is smaller, and is re-contracted once ``c`` is
  known (Bu et al. 2023, the book-keeping trick; see
  :mod:`gram_haiku._src.passes.bookkeeping`). Exact for every tracked layer,
  shared modules, :func:`gram_haiku.unembed`, ``hk.layer_stack`` and scans
  included. Any linear combination of per-example gradients is such a
  ``c``: clipping (:func:`gram_haiku.clipped_grad`), reweighting, dropping
  examples whose gradient disagrees with the batch.

  Args:
    apply_fn: ``apply`` of ``hk.transform_with_state(f)``, where ``f`` runs
      its model inside ``gram_haiku.track()`` and returns the scalar loss
      ``sum_i l_i`` (a mean scales every ``g_i`` by ``1/B``).
    weight_fn: ``grams -> f32[B]``, the weights ``c``; traced (jit-able).
      Given a :class:`Grams` whose ``norms``/``sq_norms`` are exact, and
      whose ``total`` exists when ``needs="gram"``.
    needs: ``"norms"`` (default; costs linear in ``B``) or ``"gram"`` (the
      full ``[B, B]`` Grams, e.g. for cosines between examples).
    has_aux, return_state, mesh_axes: as in
      :func:`gram_haiku.value_grad_and_gram`. Under ``shard_map``
      ``weight_fn`` sees this device's rows and returns its ``(b,)``
      weights; the gradients are summed over devices.
    frozen: parameters with zero gradient that need no Gram rule:
      ``"module/name"`` or module names, a predicate
      ``(module_name, name, value) -> bool``, or a boolean mask shaped
      like (a prefix of) ``params`` (``{module: True}`` or
      ``{module: {name: True}}``, as ``optax.masked`` takes; left out
      means not frozen). Parameters the loss does not
      differentiate (closed over, read through ``stop_gradient``) are
      frozen as well. Frozen parameters have no term in the Grams.
    example_axes: as in :func:`gram_haiku.value_grad_and_gram`.
    mesh: as in :func:`gram_haiku.value_grad_and_gram` (the function builds
      its ``shard_map``; ``c`` comes back as the global ``f32[B]``).

  Returns:
    ``fn(params, state, rng, *args, **kwargs) -> (value, grads, grams, c)``
    (``((value, new_state), grads, grams, c)`` with ``return_state``):
    ``grads`` has the structure of ``params``, ``c`` is ``f32[B]``.

  Raises:
    ValueError: for a trainable parameter no Gram rule covers (its
      per-example gradient is unknown), a ``frozen=`` that names no
      parameter, is one boolean, is a mask of anything but booleans or
      freezes every parameter, a
      ``weight_fn`` result that is not ``(B,)`` floats, and every error of
      :func:`gram_haiku.value_grad_and_gram`.
  """
  check_needs(needs)
  axes = shard_examples.example_axes_of(mesh_axes, mesh, "reweighted_grad")

  def fn(params, state, rng, *args, **kwargs):
    r = run(apply_fn, params, state, rng, args, kwargs,
            fn_name="reweighted_grad", needs=needs, has_aux=has_aux,
            axes=axes, frozen=frozen, weight_fn=weight_fn,
            example_axes=example_axes)
    c = next(iter(r.weights.values())) if r.weights else None
    value = (r.value, r.state) if return_state else r.value
    return value, r.grads, r.grams, c

  if mesh is not None:
    fn = shard_examples.shard_examples(
        fn, mesh=mesh, axes=axes, example_axes=example_axes,
        fn_name="reweighted_grad",
        rows=lambda out: (shard_examples.mark(out[:2], False),
                          shard_examples.mark(out[2:], True)))
  return one_program.compiled_when_eager(
      fn, "the function reweighted_grad returned")
