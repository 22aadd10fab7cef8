"""``reweighted_grad``: ``sum_i c_i g_i``, ``c`` chosen from the same pass.

One backward pass of the tracked loss. Each tracked layer runs its op in a
book-keeping mode instead of its Gram mode: it keeps its factors or its
per-example gradients (:mod:`gram_haiku._src.bookkeeping`), or clips its own
parameter gradients inside its backward rule (``"clip"``, per-layer
clipping). The parameters themselves are not differentiated by the pass
(except those of ``"clip"`` layers), so the plain weight gradient is never
formed. After the pass the Grams (or norms) come from what the layers kept,
``c = weight_fn(grams)``, and every parameter's ``sum_i c_i g_i`` is
re-contracted from the same stores.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src import ambient
from gram_haiku._src import bookkeeping as bk
from gram_haiku._src import cost_model
from gram_haiku._src import errors
from gram_haiku._src import hijax_compat as hx
from gram_haiku._src import norm_bounds
from gram_haiku._src import reparam
from gram_haiku._src import shard_examples
from gram_haiku._src import slots as slots_lib
from gram_haiku._src import value_grad_and_gram as vgg
from gram_haiku._src.coverage import ParamCoverage
from gram_haiku._src.ops import adapter
from gram_haiku._src.ops import factors as factors_lib
from gram_haiku._src.ops.modes import clip_weights
from gram_haiku._src.plan import Clip
from gram_haiku._src.result import Grams

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
    modes: module name -> what the layer kept (``"factors"``,
      ``"slots"``: the factors of each of its applications, or
      ``"per_example"``) or ``"clip"``.
    clips: module name -> its :class:`~gram_haiku._src.plan.Clip` under
      per-layer clipping (empty otherwise).
  """
  value: Any
  state: Any
  grads: Any
  grams: Grams
  weights: Mapping[str, jax.Array]
  modes: Mapping[str, str]
  clips: Mapping[str, Clip] = dataclasses.field(default_factory=dict)


def frozen_leaves(frozen: Frozen, params) -> set[str]:
  """Full names (``module/name``) of the frozen parameter leaves."""
  names = vgg.leaf_names(params)
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


def _mode_of(module: str, op, stacked: bool, found, ambiguous: set,
             needs: str, axes, per_layer: bool, dtype) -> str:
  """What a layer keeps through the pass (see the module docstring)."""
  if (module in found.shared or stacked or module in found.example_specs or
      op.name in ambiguous or found.applications.get(module, 1) > 1):
    # Several applications (also alternatives, e.g. hk.cond branches): each
    # has its own input layout, and only per-example gradients add up.
    return "per_example"
  if per_layer:
    return "clip"
  if not set(op.plan.frozen) <= set(op.droppable):
    # After the pass only the parameter leaves are known, not the values
    # of frozen operands the rule reads: keep per-example gradients.
    return "per_example"
  if axes and needs == "gram":
    return "per_example"  # The Gram's columns are gathered from F rows.
  exact = op.factors_exact(dtype)
  if op.plan.strategy == "materialize" or not exact:
    return "per_example"  # track(strategy=...) also chooses the store.
  if op.plan.strategy == "ghost":
    return "factors"
  return cost_model.bookkeeping_method(
      op.num_params(), factors_lib.factor_width(op), exact)


def _frozen(found, names, frozen_names: set) -> tuple[set, dict]:
  """``(cold, frozen)``: the tracked modules whose parameters are all
  frozen (or that have none), which keep nothing; and for the others,
  module -> the indices of their op's frozen parameter operands: declared
  ``frozen=``, or reached by no parameter leaf (the discovered op's
  ``Plan.frozen``)."""
  cold, frozen = set(), {}
  for m, idx in found.param_leaves.items():
    op = found.ops[m]
    mine = {k for k, a in enumerate(op.param_avals) if a is not None}
    off = set(op.plan.frozen or ()) | {
        k for k in mine if idx[k] is not None and names[idx[k]] in
        frozen_names}
    if not mine - off:
      cold.add(m)
    elif off:
      frozen[m] = tuple(sorted(off))
  return cold, frozen


def _with_frozen(found, frozen: dict, live):
  """``found`` with the ops of the ``live`` modules planned with their
  frozen operands, and those operands by layer name."""
  layers: dict = {}
  owners: dict = {}
  for m in live:
    name = found.ops[m].name
    mine = frozen.get(m, ())
    if layers.setdefault(name, mine) != mine:
      # Two modules (state keys) that see one layer name (one inside a
      # nested transform): the pass plans by name, so it cannot tell them.
      first = owners[name]
      raise ValueError(errors.FROZEN_NAME_CLASH.format(
          name=name, first=first, second=m,
          first_frozen=[found.ops[first].param_names[k]
                        for k in layers[name]],
          second_frozen=[found.ops[m].param_names[k] for k in mine]))
    owners.setdefault(name, m)
  ops = {m: op.with_plan(frozen=frozen.get(m, ()))
         for m, op in found.ops.items()}
  return dataclasses.replace(found, ops=ops, frozen_layers={
      n: ks for n, ks in layers.items() if ks})


def _stores(t: vgg.TracedLoss, live, needs: str, axes, layer_clips,
            slotted, upper_bound: bool):
  """``(modes, probe shapes)``: what each live module keeps in the pass.

  ``slotted``: modules applied several times that keep each application's
  factors in a slot of a ``[U, B, K]`` probe (mode ``"slots"``; see
  :func:`gram_haiku._src.slots.slotted_modules`).
  """
  found = t.found
  by_name: dict[str, set] = {}
  for m in live:
    by_name.setdefault(found.ops[m].name, set()).add(m)
  ambiguous = {n for n, ms in by_name.items() if len(ms) > 1}
  modes, shapes = {}, {}
  for m in live:
    op, p = found.ops[m], t.probes[m]
    lead = tuple(p.shape[:p.ndim - vgg._probe_ndim(p, found, m)])  # pylint: disable=protected-access
    dtype = found.probe_dtypes.get(m, p.dtype)
    if m in slotted:
      modes[m] = "slots"
      shapes[m] = (slotted[m], t.size, factors_lib.factor_width(op))
      continue
    modes[m] = _mode_of(m, op, bool(lead), found, ambiguous, needs, axes,
                        m in layer_clips, dtype)
    # A clipping pass's per-example store has one more column: the bound
    # of its rows' rounding error (Plan.upper_bound).
    width = op.num_params() + int(upper_bound) if (
        modes[m] == "per_example") else factors_lib.factor_width(op)
    shapes[m] = lead + adapter.probe_shape(modes[m], t.size, width)
  return modes, shapes


def _fresh_probe(t: vgg.TracedLoss, m: str, mode: str, shape, mask, axes):
  """The pass's probe of module ``m``: zeros to receive its store, or in
  ``"clip"`` mode each example's weight (the padding mask)."""
  dtype = t.found.probe_dtypes.get(m, t.probes[m].dtype)
  if mode == "clip":
    probe = jnp.broadcast_to(mask.astype(dtype), shape)
  else:
    probe = jnp.zeros(shape, dtype)
  own = 1 if mode == "clip" else 2
  probe = vgg._rows_sharded(probe, t.found.example_specs.get(m), own)  # pylint: disable=protected-access
  return hx.vary_over(probe, axes) if axes else probe


def _open_factors(t: vgg.TracedLoss, live, modes, stores, leaves) -> dict:
  """``{module: (rule, x, g, op params)}`` of the modules that kept
  factors; a slotted module's ``U`` applications are one application of
  ``rule`` (:func:`gram_haiku._src.slots.open_slots`)."""
  out = {}
  for m in live:
    op = t.found.ops[m]
    if modes[m] == "factors":
      opened = (op, *factors_lib.split_factors(op, stores[m]))
    elif modes[m] == "slots":
      opened = slots_lib.open_slots(op, stores[m])
    else:
      continue
    out[m] = (*opened, bk.op_params(op, leaves, t.found.param_leaves[m]))
  return out


def _grams(t: vgg.TracedLoss, live, modes, stores, factors, needs: str,
           axes, coverage, slots_used, slotted, leaves, skip,
           upper_bound: bool) -> Grams:
  """Each live module's Gram (or squared norms) from what it kept; ``skip``:
  frozen leaves (of reparametrised layers, whose operands mix leaves).
  ``upper_bound``: squared norms as sound upper bounds, from which clip
  factors are computed (:mod:`gram_haiku._src.norm_bounds`): of the exact
  gradient of kept factors, or of the kept per-example gradients, which
  are what is summed."""
  want = "gram" if needs == "gram" else "norms"
  bound = upper_bound and want == "norms"
  full, diag = {}, {}
  for m in live:
    g = stores[m]
    if modes[m] in ("factors", "slots"):
      val = bk.from_factors(*factors[m], want, bound)
      if modes[m] == "slots":
        val = slots_lib.guard_slots(val, slots_used[m], slotted[m])
    elif modes[m] == "per_example":
      g, slack = _split_slack(g, upper_bound)
      f = vgg.per_example_of(t.found, m, g, leaves, skip)
      pb = t.found.pullbacks.get(m)
      if bound and pb is not None:  # Its rounding bound, pulled back.
        slack = reparam.per_example_error(t.found.ops[m], pb, g, leaves,
                                          slack, m)
      if bound:  # The stored gradients, with their rounding bound.
        val = norm_bounds.of_rows(
            vgg._stacked_to_columns(f), slack)  # pylint: disable=protected-access
      else:
        val = vgg._from_per_example(  # pylint: disable=protected-access
            f, want, axes, t.found.ops[m].plan.precision)
    else:
      val = g  # "clip": the squared norms.
    (full if want == "gram" and modes[m] != "clip" else diag)[m] = val
  return Grams(full, diag, coverage, axes)


def _split_slack(store, upper_bound: bool):
  """``(per-example gradients, [B] rounding bound)`` of a per-example store:
  in a clipping pass its last column is the bound of each row's rounding
  error (:attr:`gram_haiku._src.plan.Plan.upper_bound`), summed here over
  ``hk.layer_stack``'s layers (whose gradients are concatenated); else
  ``(store, None)``."""
  if not upper_bound:
    return store, None
  slack = store[..., -1]
  lead = math.prod(slack.shape[:-1])
  return store[..., :-1], slack.reshape(lead, slack.shape[-1]).sum(0)


def _recontract(t: vgg.TracedLoss, live, modes, stores, factors, weights,
                leaves, diff_idx, clip_grads, padded: bool, skip,
                upper_bound: bool) -> list:
  """Every parameter leaf's ``sum_i c_i g_i`` (zero for frozen ones, and for
  the frozen leaves ``skip`` of reparametrised layers).
  ``padded``: some rows may be padding, whose values may be anything."""
  grads = [jnp.zeros_like(l) for l in leaves]
  for k, ct in zip(diff_idx, clip_grads):
    grads[k] = ct  # Clipped inside the backward rule.
  for m in live:
    op, g, idx = t.found.ops[m], stores[m], t.found.param_leaves[m]
    if modes[m] in ("factors", "slots"):
      cts = bk.recontract_factors(*factors[m], weights[m], padded)
    elif modes[m] == "per_example":
      g = _split_slack(g, upper_bound)[0]
      cts = bk.recontract_per_example(op, g, weights[m])
      pb = t.found.pullbacks.get(m)
      if pb is not None:  # With respect to the leaves its getter reads.
        for k, ct in reparam.summed(op, pb, cts, leaves, m).items():
          if k not in skip:
            grads[k] = grads[k] + bk.to_leaf(ct, leaves[k])
        continue
    else:
      continue
    for k, ct in cts.items():
      if idx[k] is not None:
        grads[idx[k]] = grads[idx[k]] + bk.to_leaf(ct, leaves[idx[k]])
  return grads


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


def run(apply_fn, params, state, rng, args, kwargs, *, fn_name: str,
        needs: str, has_aux: bool, axes: tuple[str, ...], frozen: Frozen,
        weight_fn: Optional[Callable[[Grams], jax.Array]] = None,
        clips: Optional[Callable[[Mapping[str, int]],
                                 Mapping[str, Clip]]] = None,
        example_weights: Optional[jax.Array] = None,
        privacy: bool = False, example_axes=None) -> PassResult:
  """One reweighted pass (see the module docstring).

  Exactly one of ``weight_fn`` (one ``c`` for every module, from the Grams)
  and ``clips`` (per-layer clipping: ``clips({module: number of
  parameters}) -> {module: Clip}``) is given. ``example_weights``: ``(B,)``
  factors every ``c`` is multiplied by (a padding mask), or None.
  ``privacy``: the completeness and example-flow checks a privacy
  guarantee needs.
  """
  t = vgg.trace_loss(apply_fn, has_aux, params, state, rng, args, kwargs,
                     axes, strict=privacy, example_axes=example_axes)
  found = t.found
  leaves, treedef = jax.tree_util.tree_flatten(params)
  names = vgg.leaf_names(params)
  frozen_names = frozen_leaves(frozen, params)
  if names and frozen_names >= set(names):
    raise ValueError(
        f"gram_haiku.{fn_name}: frozen= freezes every parameter "
        f"({sorted(names)}): every gradient would be zero and there is no "
        "per-example gradient to weight or clip.\nWhat to do: leave at "
        "least one parameter unfrozen, or skip the update.")
  coverage = vgg._coverage(params, t.seen, found)  # pylint: disable=protected-access
  _check_complete(fn_name, coverage, frozen_names, privacy)
  cold, frozen_ops = _frozen(found, names, frozen_names)
  live = sorted(m for m in t.probes if m in found.ops and m not in cold)
  found = _with_frozen(found, frozen_ops, live)
  t = dataclasses.replace(t, found=found)
  layer_clips = (dict(clips(_trainable_sizes(found, live, leaves, names,
                                             frozen_names)))
                 if clips is not None else {})
  slotted = {m: u for m, u in slots_lib.slotted_modules(
      found, axes, params).items() if m in live}
  if example_weights is not None and jnp.shape(example_weights) != (t.size,):
    raise ValueError(errors.PADDING_MASK_SHAPE.format(
        shape=jnp.shape(example_weights), size=t.size))
  mask = (jnp.ones((t.size,), jnp.float32) if example_weights is None
          else example_weights)

  def run_pass(slotted):
    modes, shapes = _stores(t, live, needs, axes, layer_clips, slotted,
                            privacy)
    diff_probes = {m: _fresh_probe(t, m, modes[m], shapes[m], mask, axes)
                   for m in live}
    fixed_probes = {m: p for m, p in t.probes.items()
                    if m not in diff_probes}
    # Only the parameters of layers that clip inside their backward rule
    # are differentiated: every other gradient is re-contracted after the
    # pass.
    diff_idx = sorted({k for m in live if modes[m] == "clip"
                       for k in found.param_leaves[m]
                       if k is not None and names[k] not in frozen_names})
    slots = slots_lib.slot_state(slotted)

    def loss(diff_leaves, diff_probes):
      full = list(leaves)
      for k, v in zip(diff_idx, diff_leaves):
        full[k] = v
      p = jax.tree_util.tree_unflatten(treedef, full)
      return t.loss_of(p, {**fixed_probes, **diff_probes}, rng, args,
                       kwargs, slots)

    pass_plan = ambient.PassPlan(
        column_axes=axes,
        modes={found.ops[m].name: "factors" if modes[m] == "slots"
               else modes[m] for m in live},
        clips={found.ops[m].name: layer_clips[m] for m in live
               if modes[m] == "clip"},
        slotted=frozenset(found.ops[m].name for m in slotted),
        frozen=found.frozen_layers, slot_reads={}, upper_bound=privacy)
    with ambient.running(pass_plan):
      out = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
          [leaves[k] for k in diff_idx], diff_probes)
    return (modes, diff_idx, out), slots_lib.untrusted(
        out[0][1][1], slots, pass_plan.slot_reads,
        {m: found.ops[m].name for m in slots})

  slotted, (modes, diff_idx, out) = slots_lib.pass_with_slots(run_pass,
                                                              slotted)
  (value, (aux, new_state)), (clip_grads, stores) = out
  if has_aux:
    value = (value, aux)
  new_state, slots_used = vgg.restore_state(new_state, t.given_probes, slotted)
  for name in frozen_names:
    coverage[name] = ParamCoverage(True, "frozen", coverage[name].module_type)
  factors = _open_factors(t, live, modes, stores, leaves)
  skip = frozenset(k for k, n in enumerate(names) if n in frozen_names)
  grams = _grams(t, live, modes, stores, factors, needs, axes, coverage,
                 slots_used, slotted, leaves, skip, privacy)
  if weight_fn is not None:
    c = jnp.asarray(weight_fn(grams))
    if c.shape != (t.size,) or not jnp.issubdtype(c.dtype, jnp.floating):
      raise ValueError(errors.WEIGHTS_SHAPE.format(
          got=f"{c.dtype}{list(c.shape)}", size=t.size))
    weights = {m: c * mask.astype(c.dtype) for m in live}
  else:
    weights = {m: clip_weights(grams.sq_norms_by_layer[m],
                                    layer_clips[m]) * mask for m in live}
  # Rows with weight 0 (padding, or an example whose norm is not finite
  # under clipping) may hold anything, even NaN: their inputs are masked.
  grads = _recontract(t, live, modes, stores, factors, weights, leaves,
                      diff_idx, clip_grads,
                      example_weights is not None or privacy, skip, privacy)
  for m in slotted:  # NaN, never a sum missing some applications.
    for k in found.param_leaves[m]:
      if k is not None:
        grads[k] = slots_lib.guard_slots(grads[k], slots_used[m], slotted[m])
  return PassResult(value, new_state,
                    jax.tree_util.tree_unflatten(treedef, grads), grams,
                    weights, modes, layer_clips)


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
  :mod:`gram_haiku._src.bookkeeping`). Exact for every tracked layer,
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

  if mesh is None:
    return fn
  return shard_examples.shard_examples(
      fn, mesh=mesh, axes=axes, example_axes=example_axes,
      fn_name="reweighted_grad",
      rows=lambda out: (shard_examples.mark(out[:2], False),
                        shard_examples.mark(out[2:], True)))
