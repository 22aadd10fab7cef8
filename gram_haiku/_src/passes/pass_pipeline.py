"""The one pass pipeline: trace, decide what each module keeps, run, read.

Every public function that runs a tracked loss's backward pass
(:func:`gram_haiku.value_grad_and_gram`, :func:`gram_haiku.reweighted_grad`,
:func:`gram_haiku.clipped_grad`) is a composition of these steps:

1. :func:`trace`: one abstract trace of the loss, read
   (:mod:`gram_haiku._src.passes.pass_trace`).
2. :func:`participants` and :func:`decide`: from the traced program and the
   :class:`Objective` (Grams, norms, reweighting, per-layer or all-layer
   clipping), which modules take part and each one's :class:`Store`: what
   its probe's cotangent holds after the pass.
3. :func:`run`: the one backward pass (traced once more where a module's
   slots cannot be trusted, :func:`gram_haiku._src.passes.slots.pass_with_slots`),
   with the caller's probes put back into the new state.
4. The readers: :func:`read_grams` (each module's Gram or squared norms from
   its store) and :func:`recontract` (``sum_i c_i g_i`` of every parameter
   from the same stores, for a reweighting objective).

The decisions reach the ops through :class:`gram_haiku._src.frontend.ambient.PassPlan`
(by module, each with its layer name; decisions only); what ``track()``
sees while the pass is traced comes back in a
:class:`gram_haiku._src.frontend.ambient.PassLog`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src.analysis import reparam
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import explicit_mesh
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute import plan as plan_lib
from gram_haiku._src.core import errors
from gram_haiku._src.core.result import Grams
from gram_haiku._src.frontend import ambient
from gram_haiku._src.ops import factors as factors_lib
from gram_haiku._src.passes import batch_args
from gram_haiku._src.passes import bookkeeping as bk
from gram_haiku._src.passes import parts as parts_lib
from gram_haiku._src.passes import program_pass
from gram_haiku._src.passes import slots as slots_lib
from gram_haiku._src.passes import standardised
from gram_haiku._src.passes.pass_trace import coverage_of
from gram_haiku._src.passes.pass_trace import leaf_names
from gram_haiku._src.passes.pass_trace import restore_state
from gram_haiku._src.passes.pass_trace import trace_loss as trace
from gram_haiku._src.passes.pass_trace import TracedLoss

__all__ = ["Store", "Objective", "GRAMS", "Pass", "trace", "participants",
           "decide", "run", "open_stores", "read_grams", "recontract",
           "coverage_of", "leaf_names", "live_program", "program_sizes"]


class Store:
  """What a module keeps through the pass: what its probe's cotangent holds.

  The one vocabulary of the pipeline (plain strings, so that they print and
  compare as the op modes of :data:`gram_haiku._src.compute.plan.Mode` do).

  Attributes:
    NOTHING: the module takes no part (every parameter frozen, or not
      applied): its probe is passed as given and not differentiated.
    GRAM: ``[B, B]`` (``[b, B]``, this device's rows, under ``shard_map``),
      formed inside the op's backward rule.
    NORMS: ``[B]`` squared per-example gradient norms, likewise.
    PER_EXAMPLE: ``[B, P]`` flattened per-example gradients, summed over the
      module's applications (plus a column for their rounding bound in a
      clipping pass, :attr:`gram_haiku._src.compute.plan.Plan.upper_bound`).
    FACTORS: ``[B, K]`` book-keeping factors of one application (input and
      output cotangent per example), re-contracted after the pass.
    SLOTS: ``[U, B, K]``: the factors of each of ``U`` applications, one
      slot each (:mod:`gram_haiku._src.passes.slots`).
    PARTS: ``([B, K_1], ..., [B, K_U])``: the factors of each of ``U``
      applications by different rules, in a probe of their own each (a
      tied embedding; :mod:`gram_haiku._src.passes.parts`).
    CLIP: ``[B]`` squared norms, while the module clips its own parameters'
      gradients inside its backward rule (per-layer clipping).
  """
  NOTHING = "nothing"
  GRAM = "gram"
  NORMS = "norms"
  PER_EXAMPLE = "per_example"
  FACTORS = "factors"
  SLOTS = "slots"
  CLIP = "clip"
  PARTS = "parts"
  ALL = (NOTHING, GRAM, NORMS, PER_EXAMPLE, FACTORS, SLOTS, CLIP, PARTS)


#: The op mode (:attr:`Plan.mode`) a store's op runs in, where it is not
#: the one its ``track()`` context gave it (``GRAM``, ``NORMS``).
_OP_MODE = {Store.PER_EXAMPLE: "per_example", Store.FACTORS: "factors",
            Store.SLOTS: "factors", Store.CLIP: "clip",
            Store.PARTS: "factors"}
#: The trailing axes of a store's probe that hold the store (the rest are
#: ``hk.layer_stack``'s); the examples are the first of them.
#: (A store that is an op mode has its probe's axes, ``PROBE_NDIM``; slots
#: stack ``[B, K]`` factors; parts are a tuple of ``[B, K_u]`` factors,
#: never stacked.)
_OWN_NDIM = {**plan_lib.PROBE_NDIM, Store.SLOTS: 2, Store.PARTS: 2}
#: The stores re-contracted from factors after the pass.
_OF_FACTORS = frozenset({Store.FACTORS, Store.SLOTS})


def _narrower(op, dtype) -> bool:
  """Whether a float parameter of ``op`` is narrower than ``dtype``."""
  return dtype is not None and any(
      a is not None and kernels.is_float(a.dtype) and
      jnp.promote_types(a.dtype, dtype) != a.dtype for a in op.param_avals)


@dataclasses.dataclass(frozen=True)
class Objective:
  """What a pass is for.

  Attributes:
    recontract: every parameter's ``sum_i c_i g_i`` is re-contracted from
      the stores once ``c`` is known (:func:`gram_haiku.reweighted_grad`,
      :func:`gram_haiku.clipped_grad`): the parameters are not
      differentiated by the pass (except those of ``CLIP`` modules) and
      every module keeps factors or per-example gradients. False: the
      plain gradient comes from the pass and each module forms its Gram
      (or norms) in its backward rule (:func:`gram_haiku.value_grad_and_gram`).
    needs: ``"gram"`` or ``"norms"``: what the readers give for every
      module; None: what each module's ``track(mode=...)`` asks for.
    upper_bound: a clipping pass: the norms are sound upper bounds
      (:attr:`gram_haiku._src.compute.plan.Plan.upper_bound`).
    frozen: full names (``module/name``) of the parameter leaves declared
      frozen (``frozen=``): no gradient, no term in the Grams.
    parts: a module applied once by each of several rules (a tied
      embedding) may keep each application's factors (``PARTS``) where
      norms are read; False: per-example gradients (the Gram blocks of
      :func:`gram_haiku.cross_gram`).
    blocks: Gram blocks are read from the stores after the pass
      (:func:`read_cross`): every module keeps factors or per-example
      gradients, also those clipped per layer (never ``CLIP``, which
      keeps only norms).
    clips: per-layer clipping: module -> its
      :class:`~gram_haiku._src.compute.plan.Clip` (every module that takes part;
      known once :func:`participants` has said which do, see
      :meth:`with_clips`); empty for one weight vector for all modules
      (all-layer clipping, reweighting).
    sum_dtype: the re-contracted sum's dtype (``clipped_grad``'s
      ``dtype``), or None for the parameters'. A module clipped per layer
      whose parameters are narrower keeps factors (never ``CLIP``, whose
      sum is the backward rule's cotangent, in the parameters' dtype: a
      float16 layer's sum would overflow there).
  """
  recontract: bool = False
  needs: Optional[str] = None
  upper_bound: bool = False
  frozen: frozenset = frozenset()
  clips: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  parts: bool = True
  blocks: bool = False
  sum_dtype: Any = None

  def with_clips(self, clips: Mapping[str, Any]) -> "Objective":
    """This objective, clipping each module of ``clips`` per layer."""
    return dataclasses.replace(self, clips=dict(clips))

  def wants(self, found, module: str) -> str:
    """``Store.GRAM`` or ``Store.NORMS``: what is read for ``module``."""
    return self.needs or found.modes.get(module, Store.GRAM)


#: The objective of :func:`gram_haiku.value_grad_and_gram`.
GRAMS = Objective()


@dataclasses.dataclass
class Pass:
  """What one run of the pass gives (:func:`run`).

  Attributes:
    value: the loss.
    aux: the loss function's aux output (None without ``has_aux``).
    state: the new Haiku state, with the caller's probes put back.
    stores: module -> its :class:`Store` (every module with a probe).
    cotangents: module -> its probe's cotangent (the modules that keep
      something).
    param_grads: parameter leaf index -> its gradient from the pass, for
      the differentiated leaves (all of them unless the objective
      re-contracts; then those of ``CLIP`` modules).
    slotted: module -> number of slots, for the ``SLOTS`` modules.
    slots_used: module -> its slot counter after the pass.
    program: the parameters covered by program-level rules
      (:mod:`gram_haiku._src.analysis.program_rules`) that keep
      per-example gradients: their name (a ``PER_EXAMPLE`` entry of
      ``stores``) -> ``(leaf index, [B, P] per-example gradients, [B]
      rounding bound or None)``.
    program_factors: those whose one site is a linear Gram op that kept
      factors (their ``FACTORS`` entry of ``stores`` and ``cotangents``):
      name -> ``(leaf index, op, flip)`` (``flip``: the op's weight is the
      leaf transposed). (Those that formed their Gram or norms there are
      ``GRAM`` or ``NORMS`` entries, like a module's.)
  """
  value: Any
  aux: Any
  state: Any
  stores: Mapping[str, str]
  cotangents: Mapping[str, jax.Array]
  param_grads: Mapping[int, jax.Array]
  slotted: Mapping[str, int]
  slots_used: Mapping[str, Any]
  program: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  program_factors: Mapping[str, tuple] = dataclasses.field(
      default_factory=dict)


def _init_ndim(probe, found, module: str) -> int:
  """Trailing axes of an init-time ``probe`` that are its own.

  The rest are stacked by ``hk.layer_stack``. ``init`` creates ``[n, n]``
  probes in ``"gram"`` mode and ``[n]`` in ``"norms"`` mode (the module's
  ``track(mode=...)``, the store it keeps by default).
  """
  return min(plan_lib.PROBE_NDIM[found.modes.get(module, Store.GRAM)],
             probe.ndim)


# -- which modules take part --------------------------------------------------


def _frozen(found, names, frozen_names) -> tuple[set, dict]:
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
  """``found`` with each module's op planned with its frozen operands.

  Raises:
    ValueError: for two ``live`` modules under one layer name with
      different frozen operands (``track()`` sees only the layer name).
  """
  for name, modules in found.by_layer(live).items():
    first, *others = sorted(modules)
    for m in others:
      if frozen.get(first, ()) != frozen.get(m, ()):
        # Two modules (state keys) that see one layer name (one inside a
        # nested transform): the pass plans by name, so it cannot tell them.
        raise ValueError(errors.FROZEN_NAME_CLASH.format(
            name=name, first=first, second=m,
            first_frozen=[found.ops[first].param_names[k]
                          for k in frozen.get(first, ())],
            second_frozen=[found.ops[m].param_names[k]
                           for k in frozen.get(m, ())]))
  ops = {m: op.with_plan(frozen=frozen.get(m, ()))
         for m, op in found.ops.items()}
  return dataclasses.replace(found, ops=ops)


def participants(t: TracedLoss, objective: Objective, params
                 ) -> tuple[TracedLoss, list[str]]:
  """``(t, live)``: the modules that keep something through the pass, and
  ``t`` with their ops planned with their frozen operands.

  For Grams every module with a probe takes part (as found). To
  re-contract, a module takes part where its op was applied and some
  parameter it reads is not frozen (declared ``objective.frozen``, or
  reached by no parameter leaf).
  """
  if not objective.recontract:
    return t, sorted(t.probes)
  names = leaf_names(params)
  cold, frozen_ops = _frozen(t.found, names, objective.frozen)
  live = sorted(m for m in t.probes if m in t.found.ops and m not in cold)
  found = _with_frozen(t.found, frozen_ops, live)
  return dataclasses.replace(t, found=found), live


# -- what each module keeps ---------------------------------------------------


def _is_standardised(t: TracedLoss, m: str) -> bool:
  """Whether module ``m``'s kernel is a marked weight standardisation read
  in closed form (:mod:`gram_haiku._src.passes.standardised`)."""
  op = t.found.ops.get(m)
  return op is not None and standardised.applies(op, t.found.pullbacks.get(m))


def _standardised_store(t: TracedLoss, m: str, objective: Objective,
                        ambiguous: set) -> bool:
  """Whether module ``m`` keeps factors for the closed form of its weight
  standardisation instead of ``B x P`` per-example gradients: applied
  once, not stacked, sharded, gathered or read in Gram blocks, its input
  exact in the probe's dtype, not told to materialise, and its factors
  the smaller store
  (:func:`~gram_haiku._src.compute.cost_model.bookkeeping_method`; else
  its per-example gradients are kept and pulled back in closed form)."""
  if not _is_standardised(t, m):
    return False
  found, p = t.found, t.probes[m]
  op = found.ops[m]
  exact = op.factors_exact(found.probe_dtypes.get(m, p.dtype))
  return (found.applications.get(m, 1) == 1 and
          p.ndim == _init_ndim(p, found, m) and
          m not in found.example_specs and m not in ambiguous and
          not t.axes and not objective.blocks and exact and
          op.plan.strategy != "materialize" and
          (op.plan.strategy == "ghost" or cost_model.bookkeeping_method(
              op.num_params(), factors_lib.factor_width(op), exact)
           == "factors"))


def _store_of(t: TracedLoss, m: str, objective: Objective, live, slotted,
              ambiguous: set, parted) -> str:
  """What module ``m`` keeps through the pass (see :func:`decide`)."""
  found = t.found
  if m not in live:
    return Store.NOTHING
  if m in slotted:
    return Store.SLOTS
  if m in t.program.tracked.values():
    # Some parameter of it is used outside it too: the program-level
    # rules' per-example gradients of that use are added to its own.
    return Store.PER_EXAMPLE
  if _standardised_store(t, m, objective, ambiguous):
    # A weight standardisation: its norms, Gram and update in closed form
    # from the factors (never clipped inside its rule, which sees only
    # the standardised kernel).
    return Store.FACTORS
  if not objective.recontract:
    # The op forms its Gram (or norms) in its backward rule; a module
    # applied more than once accumulates its per-example gradients, whose
    # Gram has the cross terms between applications.
    if m in found.shared:
      return Store.PER_EXAMPLE
    return found.modes.get(m, Store.GRAM)
  op, p = found.ops[m], t.probes[m]
  stacked = p.ndim > _init_ndim(p, found, m)
  if (m in parted and not stacked and m not in ambiguous and objective.parts
      and objective.wants(found, m) == Store.NORMS and
      not set(op.plan.frozen)):
    return Store.PARTS
  if (m in found.shared or stacked or m in found.example_specs or
      m in ambiguous or found.applications.get(m, 1) > 1):
    # Several applications (also alternatives, e.g. hk.cond branches): each
    # has its own input layout, and only per-example gradients add up.
    return Store.PER_EXAMPLE
  if (m in objective.clips and not objective.blocks and
      not _narrower(op, objective.sum_dtype)):
    return Store.CLIP
  if not set(op.plan.frozen) <= set(op.droppable):
    # After the pass only the parameter leaves are known, not the values
    # of frozen operands the rule reads: keep per-example gradients.
    return Store.PER_EXAMPLE
  if t.axes and objective.needs == Store.GRAM:
    return Store.PER_EXAMPLE  # The Gram's columns are gathered from F rows.
  exact = op.factors_exact(found.probe_dtypes.get(m, p.dtype))
  if op.plan.strategy == "materialize" or not exact:
    return Store.PER_EXAMPLE  # track(strategy=...) also chooses the store.
  if op.plan.strategy == "ghost":
    return Store.FACTORS
  return cost_model.bookkeeping_method(
      op.num_params(), factors_lib.factor_width(op), exact)


def decide(t: TracedLoss, objective: Objective, live: Sequence[str],
           slotted: Mapping[str, int]) -> dict[str, str]:
  """Module -> its :class:`Store`, for every module with a probe.

  Args:
    t: the traced loss (after :func:`participants`).
    objective: what the pass is for.
    live: the modules that take part (:func:`participants`); the others
      keep ``NOTHING``.
    slotted: module -> number of applications, for the modules applied at
      every step of a loop that keep each application's factors in a slot
      (:func:`gram_haiku._src.passes.slots.slotted_modules`): ``SLOTS``.

  For Grams a module keeps its Gram or norms (its ``track(mode=...)``), or
  its per-example gradients where it is applied more than once. To
  re-contract, a module applied more than once (or stacked by
  ``hk.layer_stack``, sharded by an Explicit mesh, or sharing its layer
  name with another module) keeps per-example gradients; otherwise it
  clips in its backward rule (``objective.clips``, unless blocks are
  read: ``objective.blocks``), or keeps factors or
  per-example gradients: per-example gradients where a frozen operand the
  rule reads cannot be rebuilt after the pass, the full Gram's columns are
  gathered over a mesh, the input does not survive the probe's dtype or
  ``track(strategy="materialize")``; factors with ``strategy="ghost"``;
  else the smaller of the two
  (:func:`gram_haiku._src.compute.cost_model.bookkeeping_method`).
  """
  # The modules that share their layer name with another one. (For Grams,
  # a module never applied takes part: it has no op, so no layer name.)
  ambiguous = {m for ms in t.found.by_layer(live).values() if len(ms) > 1
               for m in ms}
  parted = parts_lib.parted_modules(t.found, t.axes, t.found.probe_dtypes)
  return {m: _store_of(t, m, objective, live, slotted, ambiguous, parted)
          for m in sorted(t.probes)}


# -- the pass -----------------------------------------------------------------


def _rows_sharded(probe, example_spec, own_ndim: int):
  """Under an Explicit mesh, a probe sharded by rows like the examples.

  The Gram (the probe's cotangent) then comes out with the same layout:
  row ``i`` on the devices that hold example ``i``, columns replicated.
  ``own_ndim``: the probe's own trailing axes (the rest are stacked by
  ``hk.layer_stack``).
  """
  if example_spec is None:
    return probe
  lead = probe.ndim - own_ndim
  spec = jax.sharding.PartitionSpec(*([None] * lead), example_spec,
                                    *([None] * (own_ndim - 1)))
  return jax.sharding.reshard(probe, spec)


def _probe_shape(t: TracedLoss, m: str, store: str, slotted,
                 upper_bound: bool) -> tuple:
  """The shape of the probe that receives module ``m``'s ``store``: its
  init-time probe's leading (``hk.layer_stack``) axes, then the store's;
  for ``PARTS`` a tuple of shapes, one probe per application."""
  p, op, size = t.probes[m], t.found.ops.get(m), t.size
  lead = tuple(p.shape[:p.ndim - _init_ndim(p, t.found, m)])
  if store == Store.GRAM:
    own = (size, size * t.n_devices)  # This device's rows.
  elif store == Store.SLOTS:
    own = (slotted[m], size, factors_lib.factor_width(op))
  elif store == Store.PER_EXAMPLE:
    # A clipping pass's per-example store has one more column: the bound
    # of its rows' rounding error (Plan.upper_bound).
    own = (size, op.num_params() + int(upper_bound))
  elif store == Store.FACTORS:
    own = (size, factors_lib.factor_width(op))
  elif store == Store.PARTS:  # (never stacked: one shape per application)
    return parts_lib.probe_shapes(t.found.parts[m], size)
  else:  # NORMS, CLIP
    own = (size,)
  return lead + own


def _fresh_probe(t: TracedLoss, m: str, store: str, shape, mask):
  """The pass's probe of module ``m``: zeros to receive its store, or for
  ``CLIP`` each example's weight (the padding mask)."""
  dtype = t.found.probe_dtypes.get(m, t.probes[m].dtype)
  if store == Store.CLIP:
    probe = jnp.broadcast_to(mask.astype(dtype), shape)
  elif store == Store.PARTS:  # A tuple: one probe per application (on one
    return tuple(jnp.zeros(s, dtype) for s in shape)  # device, unsharded).
  else:
    probe = jnp.zeros(shape, dtype)
  probe = _rows_sharded(probe, t.found.example_specs.get(m), _OWN_NDIM[store])
  # Each device has its own rows: the probes vary over the mesh axes.
  return hx.vary_over(probe, t.axes) if t.axes else probe


def _pass_plan(t: TracedLoss, objective: Objective, stores, slotted
               ) -> ambient.PassPlan:
  """What ``track()`` is told for the pass: each module that keeps
  something other than its context's own mode, or has frozen operands,
  with its layer name (the one place it is attached)."""
  modules = {}
  for m, s in stores.items():
    op = t.found.ops.get(m)
    if op is None:
      continue  # (never applied: nothing to tell)
    told = ambient.ModulePass(
        layer=op.name, mode=_OP_MODE.get(s),
        clip=objective.clips[m] if s == Store.CLIP else None,
        slotted=m in slotted,
        frozen=op.plan.frozen or (),  # (as discover and participants planned)
        parts=(parts_lib.layout(t.found.parts[m]) if s == Store.PARTS
               else ()))
    if told.mode is not None or told.slotted or told.frozen:
      modules[m] = told
  return ambient.PassPlan(column_axes=t.axes, modules=modules,
                          upper_bound=objective.upper_bound)


def run(t: TracedLoss, objective: Objective, params, rng, args, kwargs, *,
        live: Sequence[str], mask=None) -> Pass:
  """Runs the one backward pass of the traced loss.

  Args:
    t, live: from :func:`participants`.
    objective: what the pass is for.
    params, rng, args, kwargs: the call's.
    mask: ``(B,)`` weights of the examples (a padding mask), the probes of
      ``CLIP`` modules; None for ones.

  Returns:
    A :class:`Pass`. Every module's store is decided by :func:`decide`;
    modules applied at every step of a loop start with ``SLOTS``, and the
    pass is traced once more without the slots it cannot trust.
  """
  found = t.found
  leaves, treedef = jax.tree_util.tree_flatten(params)
  names = leaf_names(params)
  if mask is None:
    mask = jnp.ones((t.size,), jnp.float32)
  program = live_program(t, objective)
  arrays, _, rebuild = batch_args.split_batch((rng, *args), kwargs)

  def attempt(slotted):
    stores = decide(t, objective, live, slotted)
    kept = {m: s for m, s in stores.items() if s != Store.NOTHING}
    diff_probes = {m: _fresh_probe(t, m, s, _probe_shape(
        t, m, s, slotted, objective.upper_bound), mask)
                   for m, s in kept.items()}
    fixed_probes = {m: p for m, p in t.probes.items() if m not in kept}
    if objective.recontract:
      # Only the parameters of layers that clip inside their backward rule
      # are differentiated: every other gradient is re-contracted after
      # the pass.
      diff_idx = sorted({k for m, s in kept.items() if s == Store.CLIP
                         for k in found.param_leaves[m]
                         if k is not None and names[k] not in
                         objective.frozen})
    else:
      diff_idx = list(range(len(leaves)))
    slots = slots_lib.slot_state(slotted)

    def traced(all_leaves, diff_probes, arrays):
      (rng_, *args_), kwargs_ = rebuild(arrays)
      p = jax.tree_util.tree_unflatten(treedef, list(all_leaves))
      return t.loss_of(p, {**fixed_probes, **diff_probes}, rng_,
                       tuple(args_), kwargs_, slots)

    def loss(diff_leaves, diff_probes):
      full = list(leaves)
      for k, v in zip(diff_idx, diff_leaves):
        full[k] = v
      p = jax.tree_util.tree_unflatten(treedef, full)
      return t.loss_of(p, {**fixed_probes, **diff_probes}, rng, args,
                       kwargs, slots)

    log = ambient.PassLog()
    with ambient.running(_pass_plan(t, objective, stores, slotted), log):
      if program.sites or program.leaves:  # (no sites: B = 0)
        value, cts, kept_program = program_pass.value_and_grad(
            traced, leaves, diff_idx, diff_probes, arrays, program,
            objective.upper_bound, _ghost(t, objective))
        out = (value, cts)
      else:
        kept_program = None
        out = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            [leaves[k] for k in diff_idx], diff_probes)
    return (stores, diff_idx, out, kept_program), slots_lib.untrusted(
        out[0][1][1], slots, log.slot_reads)

  slotted = {m: u for m, u in slots_lib.slotted_modules(
      found, t.axes, params).items()
              if m in live and m not in t.program.tracked.values()}
  slotted, (stores, diff_idx, out, kept) = slots_lib.pass_with_slots(
      attempt, slotted)
  (value, (aux, new_state)), (param_cts, cotangents) = out
  new_state, used = restore_state(new_state, t.given_probes, slotted)
  param_grads = dict(zip(diff_idx, param_cts))
  stores, by_name, cotangents = dict(stores), {}, dict(cotangents)
  for k, f in (kept.per_example.items() if kept is not None else ()):
    if k in param_grads:  # The parameter's gradient: its examples' sum.
      param_grads[k] = param_grads[k] + bk.to_leaf(jnp.sum(f, axis=0),
                                                   leaves[k])
    if k in t.program.tracked:  # Used by a tracked module too: its part.
      m = t.program.tracked[k]
      cotangents[m] = _add_to_module(t, m, k, cotangents[m], kernels.rows(f),
                                     kept.error.get(k))
      continue
    name = program.leaves[k]
    stores[name] = Store.PER_EXAMPLE
    by_name[name] = (k, kernels.rows(f), kept.error.get(k))
  factored = {}
  for k, v in (kept.formed.items() if kept is not None else ()):
    name = program.leaves[k]
    stores[name] = Store.NORMS if v.ndim == 1 else Store.GRAM
    cotangents[name] = v
  for k, (op, f, flip) in (kept.factors.items() if kept is not None else ()):
    name = program.leaves[k]
    stores[name] = Store.FACTORS
    cotangents[name] = f
    factored[name] = (k, op, flip)
  return Pass(value, aux, new_state, stores, cotangents, param_grads,
              slotted, used, by_name, factored)


def _ghost(t: TracedLoss, objective: Objective) -> Optional[str]:
  """What a program-level parameter whose one site is a linear product
  keeps (:func:`gram_haiku._src.passes.program_pass.value_and_grad`):
  factors to re-contract, else its Gram or norms; None (per-example
  gradients) where the examples are sharded over a mesh (the Gram's
  columns gathered under ``shard_map``, or Explicit mesh axes)."""
  if t.axes or explicit_mesh.under_explicit_mesh():
    return None
  if objective.recontract:
    return Store.FACTORS
  return objective.needs or Store.GRAM


def _add_to_module(t: TracedLoss, m: str, k: int, store, f, error):
  """Module ``m``'s ``PER_EXAMPLE`` store ``[B, P]`` (``[B, P + 1]`` with
  its rows' rounding bound) with parameter leaf ``k``'s per-example
  gradients from program-level rules, ``f: [B, |leaf|]`` (their rounding
  bound ``error: [B]`` or None), added to the columns of the op's
  operand that is the leaf: the leaf's per-example gradient is the sum of
  the module's part and the outside uses'. (The one place the two meet:
  every reader, Grams, norms, bounds, re-contraction and cross blocks,
  reads the sum.)"""
  op = t.found.ops[m]
  start = 0
  for a, leaf in zip(op.param_avals, t.found.param_leaves[m]):
    if a is None:
      continue
    if leaf == k:
      break
    start += math.prod(a.shape)
  stop = start + f.shape[-1]
  total = store[:, start:stop] + f.astype(store.dtype)
  store = store.at[:, start:stop].set(total)
  if error is not None:  # The bound of a sum: the sum of the bounds, and
    # the rounding of the sum.
    store = store.at[:, -1].set(norm_bounds.of_sum(
        store[:, -1], error.astype(store.dtype), total))
  return store


def live_program(t: TracedLoss, objective: Objective):
  """``t.program`` without the sites whose parameters are all frozen
  (``objective.frozen``; they keep nothing)."""
  prog = t.program
  sites = tuple(s for s in prog.sites
                if any(prog.leaves[k] not in objective.frozen
                       for k in s.leaves))
  leaves = {k: n for k, n in prog.leaves.items()
            if any(k in s.leaves for s in sites) or (
                not prog.sites and n not in objective.frozen)}  # (B = 0)
  return dataclasses.replace(prog, sites=sites, leaves=leaves)


def program_sizes(t: TracedLoss, objective: Objective, leaves
                  ) -> dict[str, int]:
  """Name -> number of entries, of the parameters that program-level rules
  cover and that are not frozen (per-layer clipping's layers)."""
  prog = live_program(t, objective)
  return {n: int(math.prod(jnp.shape(leaves[k])))
          for k, n in prog.leaves.items()
          if n not in objective.frozen and k not in prog.tracked}


# -- reading the stores -------------------------------------------------------


def per_example_of(found, m: str, f, leaves, skip=frozenset()):
  """A module's accumulated per-example gradients ``f``, with respect to
  its parameter leaves: pulled back through its getter where its operands
  are a function of them (:mod:`gram_haiku._src.analysis.reparam`; leaves in
  ``skip`` get zeros)."""
  pb = found.pullbacks.get(m)
  if pb is None:
    return f
  if standardised.applies(found.ops[m], pb) and f.ndim == 2:
    return standardised.per_example(found.ops[m], pb, f, leaves, skip)
  return reparam.per_example(found.ops[m], pb, f, leaves, skip)


def _sum_leading(a, ndim: int):
  """Sums stacked per-layer results (``hk.layer_stack``) to ``ndim`` axes."""
  if a.ndim > ndim:  # (an empty batch's zero-size axes leave -1 unknown)
    lead = a.shape[:a.ndim - ndim]
    return a.reshape((math.prod(lead),) + a.shape[a.ndim - ndim:]).sum(0)
  return a


def stacked_to_columns(f):
  """``[L..., B, P]`` per-example gradients of stacked layers -> ``[B, L P]``.

  ``hk.layer_stack`` stacks one probe per layer; each layer's parameters are
  distinct, so their per-example gradients are concatenated (not summed).
  """
  if f.ndim == 2:
    return f
  f = jnp.moveaxis(f, -2, 0)
  return f.reshape(f.shape[0], math.prod(f.shape[1:]))  # B may be 0


def _from_per_example(f, want: str, axes: tuple[str, ...],
                      precision=kernels.DEFAULT_PRECISION, row_split=None):
  """Gram (or squared norms) of accumulated per-example gradients ``[B, P]``.

  Under ``shard_map`` (``axes``), this device's rows ``[b, B]``: the other
  devices' per-example gradients are gathered. ``row_split``: the block
  ``G[:s, s:]``.
  """
  f = stacked_to_columns(f)
  if want == Store.NORMS:
    return jnp.sum(f * f, axis=-1)
  return kernels.gram_matmul(f, f, kernels.KernelConfig(
      column_axes=axes, precision=precision, row_split=row_split))


def _split_slack(store, upper_bound: bool):
  """``(per-example gradients, [B] rounding bound)`` of a per-example store:
  in a clipping pass its last column is the bound of each row's rounding
  error (:attr:`gram_haiku._src.compute.plan.Plan.upper_bound`), summed here over
  ``hk.layer_stack``'s layers (whose gradients are concatenated); else
  ``(store, None)``."""
  if not upper_bound:
    return store, None
  slack = store[..., -1]
  lead = math.prod(slack.shape[:-1])
  return store[..., :-1], slack.reshape(lead, slack.shape[-1]).sum(0)


def open_stores(t: TracedLoss, p: Pass, leaves) -> dict:
  """``{module: (rule, x, g, op params)}`` of the modules that kept
  factors; a slotted module's ``U`` applications are one application of
  ``rule`` (:func:`gram_haiku._src.passes.slots.open_slots`)."""
  out = {}
  for m, (k, op, flip) in p.program_factors.items():
    w = leaves[k].T if flip else leaves[k]
    out[m] = (op, *factors_lib.split_factors(op, p.cotangents[m]),
              (w.astype(op.param_avals[0].dtype), None))
  for m, s in sorted(p.stores.items()):
    op = t.found.ops.get(m)
    if m in p.program_factors:
      continue
    if s == Store.FACTORS and _is_standardised(t, m):
      out[m] = (op, *factors_lib.split_factors(op, p.cotangents[m]),
                standardised.operands(op, t.found.pullbacks[m], leaves))
      continue
    if s == Store.FACTORS:
      opened = (op, *factors_lib.split_factors(op, p.cotangents[m]))
    elif s == Store.SLOTS:
      opened = slots_lib.open_slots(op, p.cotangents[m])
    elif s == Store.PARTS:
      out[m] = parts_lib.open_parts(t.found.parts[m], p.cotangents[m],
                                    leaves, t.found.param_leaves[m])
      continue
    else:
      continue
    out[m] = (*opened, bk.op_params(op, leaves, t.found.param_leaves[m]))
  return out


def _read_one(t: TracedLoss, m: str, store: str, g, want: str, opened,
              p: Pass, leaves, skip, upper_bound: bool, row_split=None):
  """Module ``m``'s Gram (``want == GRAM``; its block ``G[:s, s:]`` with
  ``row_split``) or squared norms, from its ``store`` ``g``."""
  bound = upper_bound and want == Store.NORMS
  if m in p.program:  # A program-level rule's per-example gradients.
    _, f, slack = p.program[m]
    if bound:
      return norm_bounds.of_rows(f, slack)
    return _from_per_example(f, want, t.axes, row_split=row_split)
  if store == Store.PARTS:
    return parts_lib.sq_norms(opened[m], bound)
  if store == Store.FACTORS and _is_standardised(t, m):
    return standardised.read(*opened[m][:1], t.found.pullbacks[m],
                             *opened[m][1:], leaves, want, bound, skip,
                             row_split)
  if store in _OF_FACTORS:
    val = bk.from_factors(*opened[m], want, bound, row_split,
                          () if row_split is None else t.axes)
    if store == Store.SLOTS:
      val = slots_lib.guard_slots(val, p.slots_used[m], p.slotted[m])
    return val
  if store == Store.PER_EXAMPLE:
    g, slack = _split_slack(g, upper_bound)
    pb = t.found.pullbacks.get(m)
    if bound and _is_standardised(t, m) and g.ndim == 2:  # (closed form)
      return norm_bounds.of_rows(*standardised.per_example_bound(
          t.found.ops[m], pb, g, leaves, slack, skip))
    if bound and pb is not None:  # Its rounding bound, pulled back.
      slack = reparam.per_example_error(t.found.ops[m], pb, g, leaves,
                                        slack, m)
      if g.ndim == 2:  # The pulled-back rows' norms, block by block.
        sq, p = reparam.sq_sums(t.found.ops[m], pb, g, leaves, skip)
        return norm_bounds.of_sq_sums(sq, p, g.dtype, slack)
    f = per_example_of(t.found, m, g, leaves, skip)
    if bound:  # The stored gradients, with their rounding bound.
      return norm_bounds.of_rows(stacked_to_columns(f), slack)
    return _from_per_example(f, want, t.axes, t.found.ops[m].plan.precision,
                             row_split)
  if store == Store.CLIP:
    return g  # The squared norms.
  return _sum_leading(g, _OWN_NDIM[store])  # GRAM, NORMS: formed already.


def read_cross(t: TracedLoss, p: Pass, leaves, opened, row_split: int,
               skip=frozenset(), summed: bool = False,
               upper_bound: bool = False,
               row_sums: Optional[dict] = None) -> dict:
  """``{module: [s, B - s]}``: each module's Gram block ``G[:s, s:]``
  between the first ``s`` examples and the others, from what it kept in a
  re-contracting pass (factors, slots or per-example gradients), formed
  without the rest of the Gram (:func:`gram_haiku.cross_gram`).
  ``summed``: ``{module: [s]}``, the block's row sums ``<g_i, sum_q g_q>``,
  formed without the block
  (:func:`~gram_haiku._src.passes.bookkeeping.query_summed_from_factors`).
  Under ``shard_map`` (``t.axes``) each device's first ``s`` examples are
  the rows and the others those of every device (gathered, in the order
  of the axes; summed for ``summed``): this device's rows of the global
  block. ``upper_bound``: the pass's (:attr:`Objective.upper_bound`): its
  per-example stores carry a rounding-bound column, left out here (the
  block is the exact one). ``row_sums``: a dict that receives, for each
  factor store whose block is formed from materialised per-example
  gradients (:func:`~gram_haiku._src.passes.bookkeeping.materializes_block`),
  ``{operand: sum over the first s examples}``: the update where their
  weights are all 1, for :func:`recontract` (``known``)."""
  out = {}
  for m, store in sorted(p.stores.items()):
    if store == Store.NOTHING:
      continue
    if (not summed and row_sums is not None and store == Store.FACTORS and
        m not in p.program and bk.materializes_block(
            *opened[m], row_split, t.axes)):
      out[m], row_sums[m] = bk.block_and_row_sums(*opened[m], row_split,
                                                   t.axes)
    elif not summed:
      out[m] = _read_one(t, m, store, p.cotangents.get(m), Store.GRAM,
                         opened, p, leaves, skip, upper_bound, row_split)
    elif store in _OF_FACTORS:
      val = bk.query_summed_from_factors(*opened[m], row_split, t.axes,
                                         store == Store.FACTORS)
      if store == Store.SLOTS:
        val = slots_lib.guard_slots(val, p.slots_used[m], p.slotted[m])
      out[m] = val
    else:  # Per-example gradients: a program-level rule's, or PER_EXAMPLE.
      f = (p.program[m][1] if m in p.program else stacked_to_columns(
          per_example_of(t.found, m, _split_slack(
              p.cotangents[m], upper_bound)[0], leaves, skip)))
      h = jnp.sum(f[row_split:], axis=0)
      if t.axes:  # Every device's queries.
        h = bk.sum_over_devices(h, t.axes, f)
      out[m] = jnp.matmul(f[:row_split], h,
                          precision=kernels.DEFAULT_PRECISION)
  return out


def read_grams(t: TracedLoss, p: Pass, objective: Objective, leaves,
               opened, coverage, skip=frozenset()) -> Grams:
  """Each module's Gram (or squared norms) from what it kept.

  Args:
    t, p: the traced loss and its pass.
    objective: what the pass is for: with ``upper_bound``, squared norms
      are sound upper bounds, from which clip factors are computed
      (:mod:`gram_haiku._src.compute.norm_bounds`): of the exact gradient of kept
      factors, or of the kept per-example gradients, which are what is
      summed.
    leaves: the parameter leaves.
    opened: :func:`open_stores`.
    coverage: :attr:`Grams.coverage`.
    skip: indices of frozen leaves (of reparametrised layers, whose
      operands mix leaves).
  """
  full, diag = {}, {}
  for m, store in sorted(p.stores.items()):
    if store == Store.NOTHING:
      continue
    want = objective.wants(t.found, m)
    val = _read_one(t, m, store, p.cotangents.get(m), want, opened, p, leaves,
                    skip, objective.upper_bound)
    (full if want == Store.GRAM and store != Store.CLIP else diag)[m] = val
  return Grams(full, diag, coverage, t.axes)


def recontract(t: TracedLoss, p: Pass, objective: Objective, leaves,
               opened, weights: Mapping[str, jax.Array], padded: bool,
               skip=frozenset(), rows: Optional[int] = None,
               known: Optional[Mapping[str, dict]] = None) -> list:
  """Every parameter leaf's ``sum_i c_i g_i`` (zero for frozen ones, and for
  the frozen leaves ``skip`` of reparametrised layers), from the stores and
  each module's weights ``c``; ``CLIP`` modules' from the pass itself.
  ``padded``: some rows may be padding, whose values may be anything.
  ``rows``: only the first ``rows`` examples have non-zero weights (a
  cross pass's training examples): factors are re-contracted on them.
  ``known``: module -> ``{operand: its sum_i c_i g_i}`` formed already
  (:func:`read_cross`'s ``row_sums``), used as it is. A slotted module's
  gradients are NaN unless every slot was written. The sums are in
  ``objective.sum_dtype`` (None: each leaf's): the re-contractions, formed
  in the accumulation dtype, are cast to it and added in it (jax-privacy's
  ``dtype``: a float16 model's sum over a batch may overflow float16)."""
  dtype = objective.sum_dtype
  to_leaf = functools.partial(bk.to_leaf, dtype=dtype)
  grads = [jnp.zeros(l.shape, l.dtype if dtype is None else dtype)
           for l in leaves]
  for k, ct in p.param_grads.items():
    grads[k] = ct.astype(grads[k].dtype)  # Clipped inside the backward rule.
  for m, store in sorted(p.stores.items()):
    op, idx = t.found.ops.get(m), t.found.param_leaves.get(m)
    if m in p.program:  # A program-level rule's per-example gradients.
      k, f, _ = p.program[m]
      if k not in skip:
        c = weights[m].astype(f.dtype)
        if padded:  # (rows of weight 0 may hold anything)
          f = jnp.where((c != 0)[:, None], f, 0)
        grads[k] = grads[k] + to_leaf(c @ f, leaves[k])
      continue
    if m in p.program_factors:  # A linear site's factors.
      k, _, flip = p.program_factors[m]
      if k not in skip:
        ct = bk.recontract_factors(
            *opened[m], weights[m], padded,
            None if rows is None else (0, rows), dtype)[0]
        grads[k] = grads[k] + to_leaf(ct.T if flip else ct, leaves[k])
      continue
    if store == Store.PARTS:  # (weights beyond `rows` are zero)
      cts = parts_lib.recontract(opened[m], weights[m], padded, dtype)
    elif known is not None and m in known:
      cts = known[m]
    elif store in _OF_FACTORS:
      cts = bk.recontract_factors(
          *opened[m], weights[m], padded,
          None if rows is None or store != Store.FACTORS else (0, rows),
          dtype)
      if store == Store.FACTORS and _is_standardised(t, m):
        for k, ct in standardised.pull_back_sum(
            op, t.found.pullbacks[m], cts, leaves).items():
          if k not in skip:
            grads[k] = grads[k] + to_leaf(ct, leaves[k])
        continue
    elif store == Store.PER_EXAMPLE:
      g = _split_slack(p.cotangents[m], objective.upper_bound)[0]
      cts = bk.recontract_per_example(op, g, weights[m])
      pb = t.found.pullbacks.get(m)
      if pb is not None:  # With respect to the leaves its getter reads.
        pulled = (standardised.pull_back_sum(op, pb, cts, leaves)
                  if _is_standardised(t, m) and g.ndim == 2 else
                  reparam.summed(op, pb, cts, leaves, m))
        for k, ct in pulled.items():
          if k not in skip:
            grads[k] = grads[k] + to_leaf(ct, leaves[k])
        continue
    else:
      continue
    for k, ct in cts.items():
      if idx[k] is not None:
        grads[idx[k]] = grads[idx[k]] + to_leaf(ct, leaves[idx[k]])
  for m in p.slotted:  # NaN, never a sum missing some applications.
    for k in t.found.param_leaves[m]:
      if k is not None:
        grads[k] = slots_lib.guard_slots(grads[k], p.slots_used[m],
                                         p.slotted[m])
  return grads
