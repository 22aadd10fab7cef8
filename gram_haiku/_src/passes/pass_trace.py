"""Tracing a tracked loss: the first step of every pass.

One abstract trace of the loss (``jax.make_jaxpr``, no FLOPs) is read
(:mod:`gram_haiku._src.analysis.dataflow`, :mod:`gram_haiku._src.analysis.example_flow`):
the example axis and its size, which modules are applied more than once,
which parameters reach which layer and through what, and whether the
examples stay apart. :func:`trace_loss` returns it as a
:class:`TracedLoss`; :mod:`gram_haiku._src.passes.pass_pipeline` then decides what
each module keeps and runs the pass.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src.analysis import dataflow
from gram_haiku._src.analysis import example_flow
from gram_haiku._src.analysis import loss_scale
from gram_haiku._src.analysis import program_rules
from gram_haiku._src.compat import haiku_compat as hkc
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import example_sharding
from gram_haiku._src.compute import plan as plan_lib
from gram_haiku._src.core import errors
from gram_haiku._src.frontend import ambient
from gram_haiku._src.frontend import coverage as coverage_lib
from gram_haiku._src.frontend import plain_jax
from gram_haiku._src.frontend.coverage import ParamCoverage
from gram_haiku._src.frontend.probes import PROBE_NAME
from gram_haiku._src.frontend.probes import SLOT_NAME
from gram_haiku._src.ops import op as op_lib
from gram_haiku._src.passes import batch_args

State = Mapping[str, Mapping[str, Any]]


def split_probes(state: State) -> tuple[dict, dict]:
  """Splits Haiku state into ``(other state, {module: probe})``."""
  rest, probes = {}, {}
  for module, entries in state.items():
    other = {k: v for k, v in entries.items() if k != PROBE_NAME}
    if PROBE_NAME in entries:
      probes[module] = entries[PROBE_NAME]
    if other:
      rest[module] = other
  return rest, probes


def merge_probes(rest: State, probes: Mapping[str, Any]) -> dict:
  """Inverse of :func:`split_probes`."""
  out = {m: dict(v) for m, v in rest.items()}
  for module, probe in probes.items():
    out.setdefault(module, {})[PROBE_NAME] = probe
  return out


def _check_example_axes(found: dataflow.Discovery, verified: bool) -> int:
  """The one example-axis size of the model, or a teaching error.

  ``verified``: the examples were followed to every tracked layer's example
  axis in the traced program, so layers that take a vmap axis and layers
  that take their input's axis 0 are known to agree.
  """
  vmapped = sorted(m for m, v in found.vmapped.items() if v)
  explicit = sorted(m for m, v in found.vmapped.items() if not v)
  if vmapped and explicit and not verified:
    raise ValueError(errors.AMBIGUOUS_EXAMPLE_AXIS.format(
        vmapped=", ".join(vmapped), explicit=", ".join(explicit)))
  if len(set(found.sizes.values())) > 1:
    raise ValueError(errors.MIXED_EXAMPLE_SIZES.format(sizes=found.sizes))
  return next(iter(found.sizes.values()))


def _bare_batch_size(args, kwargs, example_axes) -> int:
  """``B`` of a loss with no tracked layer: the one example size of its
  batch arguments (the size the examples are followed at), or a teaching
  error."""
  arrays, array_axes, _ = batch_args.split_batch((None, *args), kwargs,
                                                 example_axes)
  sizes = sorted({batch_args.example_size(a, ax)
                  for a, ax in zip(arrays, array_axes)} - {None})
  if len(sizes) == 1:
    return sizes[0]
  raise ValueError(errors.BARE_BATCH_SIZE.format(
      sizes=sizes, shapes=[tuple(jnp.shape(a)) for a in arrays]))


def _check_mesh_axes(axes: tuple[str, ...], fn_name: str) -> int:
  """Number of devices over ``axes``, or a teaching error outside shard_map."""
  try:
    return example_sharding.axes_size(axes)
  except NameError as e:
    raise ValueError(errors.MESH_AXES_UNBOUND.format(
        fn=fn_name, axes=axes, error=e)) from None


def _check_batch_split(axes: tuple[str, ...], probes, batch,
                       fn_name: str) -> None:
  """Inside ``shard_map`` with VMA checking (the probes then vary over
  ``axes``), some batch input must vary over every axis of ``axes``;
  otherwise a teaching error. Without VMA checking nothing can tell."""
  if not probes or not set(axes) <= hx.varying_axes(
      next(iter(probes.values()))):
    return
  arrays = [a for a in jax.tree.leaves(batch) if jnp.ndim(a)]
  if not arrays or any(set(axes) <= hx.varying_axes(a) for a in arrays):
    return
  raise ValueError(errors.BATCH_NOT_SPLIT.format(
      fn=fn_name, axes=axes if len(axes) > 1 else repr(axes[0]),
      shapes=[tuple(jnp.shape(a)) for a in arrays],
      varying=sorted({ax for a in arrays for ax in hx.varying_axes(a)})))


def coverage_of(params, seen: Mapping[str, ParamCoverage],
              found: dataflow.Discovery) -> dict:
  """Coverage of every trainable parameter (see :attr:`Grams.coverage`).

  ``seen``: what the ``track()`` contexts' getters saw; a parameter they
  did not see but that the loss uses (a module outside every ``track()``
  block) is untracked, not unused.
  """
  names = leaf_names(params)
  pulled = {names[k] for pb in found.pullbacks.values() for k in pb.leaves}
  # The leaves that some Gram op reads as a parameter (the dataflow's
  # finding, whatever the getters saw).
  reached = {names[k] for leaves in found.param_leaves.values()
             for k in leaves if k is not None}
  out = {}
  for full in names:  # ("module/name" for Haiku's; any pytree's paths)
    if full not in seen and full in reached:
      seen = _seen_inside_lift(seen, full)
    out[full] = _coverage_of_leaf(full, seen, found, pulled)
  return out


def _seen_inside_lift(seen: Mapping[str, ParamCoverage], full: str
                      ) -> Mapping[str, ParamCoverage]:
  """``seen`` with ``full`` (a leaf that reaches a Gram op) as the getters
  saw it inside a lifted transform (``hk.experimental.lift*``): under the
  inner name, which the lift's prefix extends. (Only for a leaf that does
  reach a Gram op: an untracked module whose name merely ends like a
  tracked one's is not tracked.)"""
  inner = [k for k in seen if full.endswith("/" + k)]
  if not inner:
    return seen
  return {**seen, full: seen[max(inner, key=len)]}


def _coverage_of_leaf(full: str, seen: Mapping[str, ParamCoverage],
                      found: dataflow.Discovery, pulled: set
                      ) -> ParamCoverage:
  """The coverage of parameter leaf ``full`` (see :func:`coverage_of`)."""
  if full in seen and not seen[full].tracked and full in found.no_gradient:
    # Read only through stop_gradient: frozen, so it needs no rule.
    return ParamCoverage(True, "frozen", seen[full].module_type)
  if full in pulled and not (full in seen and seen[full].tracked):
    # Read outside the layer, but only by its reparametrising getter: its
    # gradient is pulled back through the getter.
    return ParamCoverage(True, "reparametrised",
                         seen[full].module_type if full in seen else "(none)")
  if full in seen:
    return seen[full]
  if full in found.untracked_uses:
    return ParamCoverage(False, None, "(outside track())")
  return ParamCoverage(True, "unused", "(unused)")


def leaf_names(params) -> list[str]:
  """``module/param`` names of the parameter leaves, in leaf order.

  Haiku's immutable ``FlatMap`` flattens without its keys in the path; it
  is named through the plain dict of the same leaves (checked to flatten
  in the same order).
  """
  if isinstance(params, Mapping) and not isinstance(params, dict):
    plain = {m: dict(v) if isinstance(v, Mapping) else v
             for m, v in params.items()}
    if [id(a) for a in jax.tree.leaves(plain)] == [
        id(a) for a in jax.tree.leaves(params)]:
      params = plain
  names = []
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    names.append("/".join(str(getattr(k, "key", getattr(k, "idx", k)))
                          for k in path))
  return names


def _discover(loss, params, probes, rng, args, kwargs, axes,
              example_axes=None, model_state=(), frozen=frozenset(),
              bare: bool = False):
  """One abstract trace of the loss (no FLOPs), read.

  ``loss(params, probes, rng, args, kwargs)``. Returns the
  :class:`~gram_haiku._src.analysis.dataflow.Discovery` of its program, the coverage
  its ``track()`` contexts saw, ``check_examples()``, which follows the
  examples (axis 0 of the batch's arrays) through the program
  (:func:`gram_haiku._src.analysis.example_flow.check`), and the program itself
  (its live jaxpr and the values of its constants). ``model_state``: the
  leaves of the Haiku state the loss closes over (an input of ``apply``,
  not data the user closed over). ``bare``: every parameter leaf is bare
  (a plain-JAX loss, :mod:`gram_haiku._src.api.functional`): one that no
  program-level rule covers is an error, as under
  ``track(untracked="error")``.
  """
  arrays, array_axes, rebuild = batch_args.split_batch(
      (rng, *args), kwargs, example_axes)

  def traced(p, q, a):
    (rng_, *args_), kwargs_ = rebuild(a)
    return loss(p, q, rng_, tuple(args_), kwargs_)
  log = ambient.PassLog()
  with ambient.running(ambient.PassPlan(column_axes=axes), log):
    closed = jax.make_jaxpr(traced)(params, probes, arrays)
  seen, untracked = log.coverage, log.untracked
  live = hx.live_part(closed.jaxpr)  # what the loss depends on (no aux)
  probe_names = [m for m, _ in sorted(probes.items())]
  n_params = len(jax.tree_util.tree_leaves(params))
  assert len(jax.tree_util.tree_leaves(probes)) == len(probe_names)
  found = dataflow.discover(live, n_params, leaf_names(params),
                            probe_names, op_lib.RuleOp,
                            full_jaxpr=closed.jaxpr,
                            consts=dict(zip(closed.jaxpr.constvars,
                                            closed.consts)))
  # A module applied inside a raw JAX transform keeps no slots (its slot
  # counter cannot live in Haiku state there).
  raw = {m for layer, ms in found.by_layer().items()
         if layer in log.raw_traced for m in ms}
  found = dataclasses.replace(found, slot_counts={
      m: u for m, u in found.slot_counts.items() if m not in raw})
  names = leaf_names(params)
  # No gradient (read through stop_gradient only, or declared frozen=):
  # nothing to miss, so neither a rule nor a report.
  gradless = set(found.no_gradient) | set(frozen)
  # A parameter that a tracked module reads and a use outside every Gram
  # op reads too (a tied output): covered where the outside uses have
  # rules, its parts added (see Discovery.mixed).
  mixed = [k for k, n in enumerate(names)
           if n in found.mixed and n not in gradless]
  sites = program_rules.find(
      live, n_params, sorted(mixed + [
          k for k, n in enumerate(names)
          if n in found.untracked_uses and n not in gradless]),
      op_lib.RuleOp, tracked=mixed)
  deferred = {}  # reported once the program-level rules are resolved
  if bare:
    untracked = {n: ("error", coverage_lib.BARE_MODULE_TYPE) for n in names
                 if n in found.untracked_uses}
  for name, (policy, module_type) in sorted(untracked.items()):
    if name in seen and seen[name].tracked:
      continue  # (read by a tracked layer too: the program decides)
    if name in found.untracked_uses and name not in gradless:
      deferred[name] = (policy, module_type)
    elif name not in gradless:  # stop_gradient only: nothing to miss
      coverage_lib.report_untracked(name, policy, module_type)

  def check_examples(strict: bool = False, observed=None) -> bool:
    """Follows the examples; True when every layer was verified
    (``strict``: see :func:`gram_haiku._src.analysis.example_flow.check`);
    the states of the variables ``observed`` (keys) are written into it."""
    leading = {batch_args.example_size(a, ax)
               for a, ax in zip(arrays, array_axes)
               } - {None}
    sizes = set(found.sizes.values())
    if len(sizes) == 1 and sizes <= leading:
      batch = next(iter(sizes))
    elif len(leading) == 1:
      batch = next(iter(leading))
    elif strict and found.sizes:
      # No one size of the batch: nothing could be followed, which a
      # privacy guarantee cannot rest on.
      raise ValueError(errors.BATCH_SIZE_UNKNOWN.format(
          leading=sorted(leading), sizes=sorted(sizes)))
    else:
      return False  # No one size of the batch: nothing to follow.
    own = {id(a) for a in model_state}

    def follow(array_axes):
      states = [example_flow.CONST] * (n_params + len(probe_names))
      for a, ax in zip(arrays, array_axes):
        size = batch_args.example_size(a, ax)
        if isinstance(ax, int) and size != batch:
          raise ValueError(errors.EXAMPLE_AXIS_SIZE.format(
              shape=np.shape(a), axis=ax, size=size, batch=batch))
        states.append(example_flow.Ex(0 if ax == batch_args.AUTO else ax)
                      if size == batch else example_flow.CONST)
      return example_flow.check(live, states, batch, op_lib.RuleOp,
                                consts=dict(zip(closed.jaxpr.constvars,
                                                closed.consts)),
                                strict=strict,
                                model_state=frozenset(
                                    v for v, c in zip(closed.jaxpr.constvars,
                                                      closed.consts)
                                    if id(c) in own),
                                observed=observed)
    try:
      return follow(array_axes)
    except ValueError as e:
      if example_axes is not None:
        raise
      # Under the default rule: say which declaration fits, where one
      # follows more arguments than any other (a time-major input, T == B).
      fits = []
      for cand in batch_args.candidate_example_axes(rng, args, batch):
        try:
          with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            follow(batch_args.split_batch((rng, *args), kwargs, cand)[1])
        except ValueError:
          continue
        fits.append(cand)
      # (Of those, the ones that follow the most arguments: None for the
      # labels fits too, and says less.)
      most = max((sum(a is not None for a in c) for c in fits), default=0)
      fits = [c for c in fits if sum(a is not None for a in c) == most]
      if len(fits) != 1:
        raise
      raise ValueError(str(e) + errors.EXAMPLE_AXES_THAT_FIT.format(
          axes=fits[0])) from None
  program = (live, dict(zip(closed.jaxpr.constvars, closed.consts)))
  return found, seen, check_examples, program, (sites, deferred)


@dataclasses.dataclass
class TracedLoss:
  """A tracked loss, traced once (no FLOPs) and read.

  Attributes:
    rest: the Haiku state without its probes.
    probes: ``{module: probe}`` from the state (varying over the mesh axes
      inside ``shard_map``).
    given_probes: the same as the caller gave them (what the new state
      holds, so that it can be fed back as given).
    loss_of: ``loss_of(params, probes, rng, args, kwargs, extra=None) ->
      (value, (aux, new_state))``; ``extra``: more state entries, ``{module:
      {name: value}}`` (the slot counters of slotted probes).
    found: the :class:`~gram_haiku._src.analysis.dataflow.Discovery` of its program.
    seen: the coverage its ``track()`` contexts reported.
    size: ``B``, the size of the example axis.
    n_devices: devices over the mesh axes (1 outside ``shard_map``).
    axes: the mesh axes the examples are split over (``shard_map``), or
      ``()``.
    program: the program-level rules of the parameters no tracked module
      covers (:mod:`gram_haiku._src.analysis.program_rules`).
  """
  rest: dict
  probes: dict
  given_probes: dict
  loss_of: Callable[..., Any]
  found: dataflow.Discovery
  seen: dict
  size: int
  n_devices: int
  axes: tuple[str, ...] = ()
  program: program_rules.Program = dataclasses.field(
      default_factory=program_rules.Program)


def _check_arguments(apply_fn, params, state) -> None:
  """Teaching errors for the usual slips in ``(params, state, rng, *batch)``:
  the apply of ``hk.transform`` (no state), the state left out, not a
  mapping, or swapped with the parameters, and a parameter leaf that is
  not floating point (an integer or a boolean: no gradient)."""
  if hkc.is_pure_apply(apply_fn):
    raise ValueError(errors.PURE_TRANSFORM_APPLY)
  if state is None:
    raise ValueError(errors.STATE_IS_NONE)
  if not isinstance(state, Mapping):
    raise ValueError(errors.STATE_NOT_A_MAPPING.format(
        what=errors.describe(state)))
  leaves = jax.tree_util.tree_leaves(params)
  bad = [(n, a) for n, a in zip(leaf_names(params), leaves)
         if not jnp.issubdtype(jnp.result_type(a), jnp.inexact)]
  if bad:
    raise ValueError(errors.PARAM_NOT_FLOAT.format(
        names=", ".join(repr(n) for n, _ in bad[:3]) +
        (", ..." if len(bad) > 3 else ""),
        dtypes=", ".join(str(jnp.result_type(a)) for _, a in bad[:3])))
  if isinstance(params, Mapping) and not split_probes(state)[1]:
    in_params = sorted(m for m, v in params.items()
                       if isinstance(v, Mapping) and PROBE_NAME in v)
    if in_params:
      raise ValueError(errors.PARAMS_STATE_SWAPPED.format(
          modules=", ".join(map(repr, in_params[:3])) +
          (", ..." if len(in_params) > 3 else "")))


def trace_loss(apply_fn, has_aux: bool, params, state, rng, args, kwargs,
               axes: tuple[str, ...], *, strict: bool = False,
               example_axes=None,
               sum_for: Optional[str] = None,
               frozen: frozenset = frozenset(),
               fn_name: str = "value_grad_and_gram") -> TracedLoss:
  """Traces the tracked loss of one call and checks what it says.

  ``strict``: refuse losses that read other examples' data (a privacy
  guarantee needs it; see :func:`gram_haiku._src.analysis.example_flow.check`).
  ``frozen``: full names of parameters declared frozen (``frozen=``): no
  gradient, so no untracked report and no program rule.
  ``fn_name``: the public function, for errors.
  ``sum_for``: the public function whose result needs the loss to be a sum
  over the examples, warned for a mean (``strict`` implies
  ``"clipped_grad"``; :func:`gram_haiku._src.analysis.loss_scale.warn_if_mean`).
  A plain-JAX loss (``apply_fn`` a
  :class:`~gram_haiku._src.frontend.plain_jax.BareLoss`) has no tracked
  layer and no probe: every parameter leaf needs a program-level rule, and
  ``B`` is read from the batch arguments.

  Raises:
    ValueError: the errors listed by :func:`value_grad_and_gram`.
  """
  _check_arguments(apply_fn, params, state)
  bare = plain_jax.is_bare(apply_fn)
  rest, probes = split_probes(state)
  # No probe: no layer was tracked. Inside track() (its getters saw the
  # parameters: bare hk.get_parameter weights alone) every use is read
  # from the program and B from the batch; with no track() at all, the
  # model was not run inside it (NO_PROBES, below).
  no_layers = bare or not probes
  n_devices = _check_mesh_axes(axes, fn_name)

  def loss_of(params, probes, rng, args, kwargs, extra=None):
    state = merge_probes(rest, probes)
    for m, entries in (extra or {}).items():
      state.setdefault(m, {}).update(entries)
    out, new_state = apply_fn(params, state, rng, *args, **kwargs)
    if not has_aux and isinstance(out, (tuple, list)):
      raise ValueError(errors.LOSS_IS_A_TUPLE.format(n=len(out)))
    value, aux = out if has_aux else (out, None)
    if jnp.shape(value) != ():
      raise ValueError(errors.NOT_SCALAR.format(
          shape=jnp.shape(value), dtype=jnp.result_type(value)))
    return value, (aux, new_state)

  given_probes = probes
  if axes:  # Each device has its own rows: the probes vary over `axes`.
    probes = {m: hx.vary_over(p, axes) for m, p in probes.items()}
    _check_batch_split(axes, probes, (args, kwargs), fn_name)
  found, seen, check_examples, program, (sites, deferred) = _discover(
      lambda *a: loss_of(*a)[0], params, probes, rng, args, kwargs, axes,
      example_axes, jax.tree_util.tree_leaves(rest), frozen, bare)
  if not probes and not bare and not seen:
    raise ValueError(errors.NO_PROBES)
  if not found.sizes and not no_layers:
    arrays, array_axes, _ = batch_args.split_batch(
        (None, *args), kwargs, example_axes)
    sizes = [batch_args.example_size(a, ax)
             for a, ax in zip(arrays, array_axes)]
    if any(n is not None for n in sizes) and all(
        n == 0 for n in sizes if n is not None):
      raise ValueError(errors.EMPTY_BATCH_NO_LAYERS.format(
          shapes=[tuple(jnp.shape(a)) for a in arrays]))
    raise ValueError(errors.NO_FORWARD_USE.format(
        modules=", ".join(sorted(probes))))
  for name, use in sorted(found.untracked_uses.items()):
    if name in seen and seen[name].tracked:
      # Read by a tracked layer whose output the loss does not use, and
      # used by the loss elsewhere (module.params_dict(), a closure).
      raise ValueError(dataflow.also_untracked_message(
          name, [name.rsplit("/", 1)[0]], use, errors.MIXED_OUTPUT_UNUSED))
  observed = dict.fromkeys(program_rules.observed_keys(sites))
  verified = check_examples(strict, observed)
  size = (_check_example_axes(found, verified) if found.sizes else
          _bare_batch_size(args, kwargs, example_axes))
  names = leaf_names(params)
  rules = program_rules.resolve(sites, observed, size, names, {
      k: found.mixed[n][0] for k, n in enumerate(names) if n in found.mixed})
  if not probes and not bare and not rules.leaves:
    raise ValueError(errors.NO_GRAM_TO_FORM)
  _check_mixed(found, rules, probes, frozen)
  seen = _with_program(seen, rules, deferred)
  # A privacy guarantee (or a block across two sets): a sum, not a mean.
  sum_for = "clipped_grad" if strict else sum_for
  if sum_for is not None:
    loss_scale.warn_if_mean(sum_for, *program, size)
  return TracedLoss(rest, probes, given_probes, loss_of, found, seen, size,
                    n_devices, axes, rules)


def _check_mixed(found: dataflow.Discovery, rules: program_rules.Program,
                 probes, frozen) -> None:
  """Refuses each parameter that a tracked module reads and a use outside
  every Gram op reads too (:attr:`Discovery.mixed`), unless program-level
  rules cover the outside uses and the module can keep per-example
  gradients to which theirs are added: applied once or more outside a
  loop (a loop's uses have no rule), not stacked by ``hk.layer_stack``,
  not reparametrised by a getter, reading the leaf as one of its
  parameters.

  Raises:
    ValueError: naming the parameter, the module, the outside use and
      why, with the fix (``gram_haiku.unembed`` for a tied output).
  """
  for name, (m, use) in sorted(found.mixed.items()):
    if name in frozen:
      continue  # (no gradient: nothing to miss)
    if name in found.no_gradient:
      continue
    covered = [k for k, n in rules.leaves.items() if n == name]
    why = rules.refused.get(name, "" if covered else errors.MIXED_NO_SITE)
    if not why:
      probe = probes[m]
      own = min(plan_lib.PROBE_NDIM[found.modes.get(m, "gram")], probe.ndim)
      if probe.ndim > own:
        why = errors.MIXED_STACKED
      elif m in found.pullbacks:
        why = errors.MIXED_REPARAMETRISED
      elif list(found.param_leaves[m]).count(covered[0]) != 1:
        why = errors.MIXED_OPERANDS
    if why:
      raise ValueError(dataflow.also_untracked_message(name, [m], use, why))


def _with_program(seen, rules: program_rules.Program, deferred) -> dict:
  """``seen`` with the parameters the program-level rules cover marked
  tracked by them; the other ``deferred`` untracked reads reported, with
  why no rule covers them.

  Raises:
    ValueError: under ``track(untracked="error")``, for a parameter no
      rule covers.
  """
  seen = dict(seen)
  for k, name in rules.leaves.items():
    rule = rules.rules_of(k)
    if k in rules.tracked and name in seen:  # (its module's rule, and more)
      rule = f"{seen[name].rule} + {rule}"
    # (The type of the module that read it: none seen outside track().)
    seen[name] = ParamCoverage(True, rule,
                               seen[name].module_type if name in seen
                               else deferred[name][1] if name in deferred
                               else "(outside track())")
  for name, (policy, module_type) in sorted(deferred.items()):
    if name not in rules.leaves.values():
      coverage_lib.report_untracked(name, policy, module_type,
                                    rules.refused.get(name, ""))
  return seen


def restore_state(new_state, probes: Mapping[str, Any],
                  slotted: Mapping[str, int]):
  """``(state, slots used)``: the pass's new state with the slot counters
  removed and every probe replaced by the caller's own (the pass sizes
  probes to its stores: ``[U, B, K]`` slots, ``[B, P]`` per-example
  gradients), so that the state can be fed back as given."""
  new_state = {m: dict(v) for m, v in new_state.items()}
  used = {m: new_state.get(m, {}).pop(SLOT_NAME, None) for m in slotted}
  for m, p in probes.items():
    if PROBE_NAME in new_state.get(m, {}):
      new_state[m][PROBE_NAME] = p
  return new_state, used
