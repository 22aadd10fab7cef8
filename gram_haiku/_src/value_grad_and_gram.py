"""``value_grad_and_gram``: loss, parameter gradients and Grams in one pass."""

from __future__ import annotations

import dataclasses
import warnings
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src import ambient
from gram_haiku._src import batch_args
from gram_haiku._src import bookkeeping as bk
from gram_haiku._src import coverage as coverage_lib
from gram_haiku._src import dataflow
from gram_haiku._src import errors
from gram_haiku._src import example_flow
from gram_haiku._src import example_sharding
from gram_haiku._src import haiku_compat as hkc
from gram_haiku._src import hijax_compat as hx
from gram_haiku._src import kernels
from gram_haiku._src import loss_scale
from gram_haiku._src import plan as plan_lib
from gram_haiku._src import reparam
from gram_haiku._src import shard_examples
from gram_haiku._src import slots as slots_lib
from gram_haiku._src.coverage import ParamCoverage
from gram_haiku._src.ops import adapter
from gram_haiku._src.ops import factors
from gram_haiku._src.ops import op as op_lib
from gram_haiku._src.result import Grams
from gram_haiku._src.probes import PROBE_NAME
from gram_haiku._src.probes import SLOT_NAME

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


def _probe_ndim(probe, found: dataflow.Discovery, module: str) -> int:
  """Trailing axes of an init-time ``probe`` that are its own.

  The rest are stacked by ``hk.layer_stack``. ``init`` creates ``[n, n]``
  probes in ``"gram"`` mode and ``[n]`` in ``"norms"`` mode.
  """
  own = 2 if found.modes.get(module, "gram") == "gram" else 1
  return min(own, probe.ndim)


def resize_probes(state: State, batch_size: int, *, mode: str = "gram"
                  ) -> dict:
  """Returns ``state`` with every Gram probe replaced by ``zeros(B, B)``.

  For the raw path: ``jax.grad`` of a tracked loss with respect to the probes
  in ``state`` gives each module's Gram, and the probes must then be sized to
  the example axis (per-example code under ``hk.vmap`` cannot see ``B`` at
  init, so its probes start with a placeholder size).

  Args:
    state: Haiku state from ``init`` of a ``hk.transform_with_state``.
    batch_size: ``B``, the size of the example axis.
    mode: the ``track(mode=...)`` the probes were created under: ``"gram"``
      probes become ``[B, B]``, ``"norms"`` probes ``[B]``.

  Returns:
    A new state dict; other entries are untouched. Probes keep their dtype
    and any leading axes (``hk.layer_stack`` stacks one probe per layer).

  Raises:
    ValueError: if ``batch_size`` is not a positive int.
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or (
      batch_size < 1):
    raise ValueError(errors.BAD_BATCH_SIZE.format(value=batch_size))
  plan_lib.check_mode(mode)
  own = 2 if mode == "gram" else 1
  rest, probes = split_probes(state)
  probes = {m: jnp.zeros(tuple(p.shape[:p.ndim - own]) +
                         adapter.probe_shape(mode, batch_size, 0), p.dtype)
            for m, p in probes.items()}
  return merge_probes(rest, probes)


def _sum_leading(a, ndim: int):
  """Sums stacked per-layer results (``hk.layer_stack``) to ``ndim`` axes."""
  if a.ndim > ndim:  # (an empty batch's zero-size axes leave -1 unknown)
    lead = a.shape[:a.ndim - ndim]
    return a.reshape((math.prod(lead),) + a.shape[a.ndim - ndim:]).sum(0)
  return a


def _stacked_to_columns(f):
  """``[L..., B, P]`` per-example gradients of stacked layers -> ``[B, L P]``.

  ``hk.layer_stack`` stacks one probe per layer; each layer's parameters are
  distinct, so their per-example gradients are concatenated (not summed).
  """
  if f.ndim == 2:
    return f
  f = jnp.moveaxis(f, -2, 0)
  return f.reshape(f.shape[0], math.prod(f.shape[1:]))  # B may be 0


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


def per_example_of(found: dataflow.Discovery, m: str, f, leaves,
                   skip=frozenset()):
  """A shared module's accumulated per-example gradients ``f``, with respect
  to its parameter leaves: pulled back through its getter where its
  operands are a function of them (:mod:`gram_haiku._src.reparam`; leaves
  in ``skip`` get zeros)."""
  pb = found.pullbacks.get(m)
  if pb is None:
    return f
  return reparam.per_example(found.ops[m], pb, f, leaves, skip)


def _from_per_example(f, mode: str, axes: tuple[str, ...],
                      precision=kernels.DEFAULT_PRECISION):
  """Gram (or squared norms) of accumulated per-example gradients ``[B, P]``.

  Under ``shard_map`` (``axes``), this device's rows ``[b, B]``: the other
  devices' per-example gradients are gathered.
  """
  f = _stacked_to_columns(f)
  if mode == "norms":
    return jnp.sum(f * f, axis=-1)
  return kernels.gram_matmul(f, f, kernels.KernelConfig(column_axes=axes,
                                                        precision=precision))


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


def _check_mesh_axes(axes: tuple[str, ...]) -> int:
  """Number of devices over ``axes``, or a teaching error outside shard_map."""
  try:
    return example_sharding.axes_size(axes)
  except NameError as e:
    raise ValueError(errors.MESH_AXES_UNBOUND.format(axes=axes,
                                                     error=e)) from None


def _check_batch_split(axes: tuple[str, ...], probes, batch) -> None:
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
      axes=axes if len(axes) > 1 else repr(axes[0]),
      shapes=[tuple(jnp.shape(a)) for a in arrays],
      varying=sorted({ax for a in arrays for ax in hx.varying_axes(a)})))


def _coverage(params, seen: Mapping[str, ParamCoverage],
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
  for module, entries in params.items():
    for name in entries:
      full = f"{module}/{name}"
      if full not in seen and full in reached:
        # Read inside a lifted transform (hk.experimental.lift*): the
        # getters saw the inner name, which the lift's prefix extends.
        # (Only for a leaf that does reach a Gram op: an untracked module
        # whose name merely ends like a tracked one's is not tracked.)
        inner = [k for k in seen if full.endswith("/" + k)]
        if inner:
          seen = {**seen, full: seen[max(inner, key=len)]}
      if full in seen and not seen[full].tracked and (
          full in found.no_gradient):
        # Read only through stop_gradient: frozen, so it needs no rule.
        out[full] = ParamCoverage(True, "frozen", seen[full].module_type)
      elif full in pulled and not (full in seen and seen[full].tracked):
        # Read outside the layer, but only by its reparametrising getter:
        # its gradient is pulled back through the getter.
        out[full] = ParamCoverage(
            True, "reparametrised",
            seen[full].module_type if full in seen else "(none)")
      elif full in seen:
        out[full] = seen[full]
      elif full in found.untracked_uses:
        out[full] = ParamCoverage(False, None, "(outside track())")
      else:
        out[full] = ParamCoverage(True, "unused", "(unused)")
  return out


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
              example_axes=None, model_state=()):
  """One abstract trace of the loss (no FLOPs), read.

  ``loss(params, probes, rng, args, kwargs)``. Returns the
  :class:`~gram_haiku._src.dataflow.Discovery` of its program, the coverage
  its ``track()`` contexts saw, ``check_examples()``, which follows the
  examples (axis 0 of the batch's arrays) through the program
  (:func:`gram_haiku._src.example_flow.check`), and the program itself
  (its live jaxpr and the values of its constants). ``model_state``: the
  leaves of the Haiku state the loss closes over (an input of ``apply``,
  not data the user closed over).
  """
  arrays, array_axes, rebuild = batch_args.split_batch(
      (rng, *args), kwargs, example_axes)
  seen: dict = {}
  untracked: dict = {}

  def traced(p, q, a):
    (rng_, *args_), kwargs_ = rebuild(a)
    return loss(p, q, rng_, tuple(args_), kwargs_)
  raw_traced: set = set()
  with ambient.running(ambient.PassPlan(column_axes=axes, coverage=seen,
                                        untracked=untracked,
                                        raw_traced=raw_traced)):
    closed = jax.make_jaxpr(traced)(params, probes, arrays)
  live = hx.live_part(closed.jaxpr)  # what the loss depends on (no aux)
  probe_names = [m for m, _ in sorted(probes.items())]
  n_params = len(jax.tree_util.tree_leaves(params))
  assert len(jax.tree_util.tree_leaves(probes)) == len(probe_names)
  found = dataflow.discover(live, n_params, leaf_names(params),
                            probe_names, op_lib.RuleOp,
                            full_jaxpr=closed.jaxpr,
                            consts=dict(zip(closed.jaxpr.constvars,
                                            closed.consts)))
  found = dataclasses.replace(found, slot_counts={
      m: u for m, u in found.slot_counts.items()
      if found.ops[m].name not in raw_traced})
  for name, (policy, module_type) in sorted(untracked.items()):
    if name not in found.no_gradient:  # stop_gradient only: nothing to miss
      coverage_lib.report_untracked(name, policy, module_type)

  def check_examples(strict: bool = False) -> bool:
    """Follows the examples; True when every layer was verified
    (``strict``: see :func:`gram_haiku._src.example_flow.check`)."""
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
                                    if id(c) in own))
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
  return found, seen, check_examples, program


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
    found: the :class:`~gram_haiku._src.dataflow.Discovery` of its program.
    seen: the coverage its ``track()`` contexts reported.
    size: ``B``, the size of the example axis.
    n_devices: devices over the mesh axes (1 outside ``shard_map``).
  """
  rest: dict
  probes: dict
  given_probes: dict
  loss_of: Callable[..., Any]
  found: dataflow.Discovery
  seen: dict
  size: int
  n_devices: int


def _check_arguments(apply_fn, params, state) -> None:
  """Teaching errors for the usual slips in ``(params, state, rng, *batch)``:
  the apply of ``hk.transform`` (no state), the state left out, not a
  mapping, or swapped with the parameters."""
  if hkc.is_pure_apply(apply_fn):
    raise ValueError(errors.PURE_TRANSFORM_APPLY)
  if state is None:
    raise ValueError(errors.STATE_IS_NONE)
  if not isinstance(state, Mapping):
    raise ValueError(errors.STATE_NOT_A_MAPPING.format(
        type=type(state).__name__))
  if isinstance(params, Mapping) and not split_probes(state)[1]:
    in_params = sorted(m for m, v in params.items()
                       if isinstance(v, Mapping) and PROBE_NAME in v)
    if in_params:
      raise ValueError(errors.PARAMS_STATE_SWAPPED.format(
          modules=", ".join(map(repr, in_params[:3])) +
          (", ..." if len(in_params) > 3 else "")))


def trace_loss(apply_fn, has_aux: bool, params, state, rng, args, kwargs,
               axes: tuple[str, ...], *, strict: bool = False,
               example_axes=None) -> TracedLoss:
  """Traces the tracked loss of one call and checks what it says.

  ``strict``: refuse losses that read other examples' data (a privacy
  guarantee needs it; see :func:`gram_haiku._src.example_flow.check`).

  Raises:
    ValueError: the errors listed by :func:`value_grad_and_gram`.
  """
  _check_arguments(apply_fn, params, state)
  rest, probes = split_probes(state)
  if not probes:
    raise ValueError(errors.NO_PROBES)
  n_devices = _check_mesh_axes(axes)

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
    _check_batch_split(axes, probes, (args, kwargs))
  found, seen, check_examples, program = _discover(
      lambda *a: loss_of(*a)[0], params, probes, rng, args, kwargs, axes,
      example_axes, jax.tree_util.tree_leaves(rest))
  if not found.sizes:
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
          name, [name.rsplit("/", 1)[0]], use))
  size = _check_example_axes(found, check_examples(strict))
  if strict:  # A privacy guarantee: the loss must be a sum, not a mean.
    loss_scale.warn_if_mean("clipped_grad", *program, size)
  return TracedLoss(rest, probes, given_probes, loss_of, found, seen, size,
                    n_devices)


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


def value_grad_and_gram(apply_fn: Callable[..., Any], *, has_aux: bool = False,
                        return_state: bool = False,
                        mesh_axes: str | tuple[str, ...] | None = None,
                        example_axes: Optional[Sequence[Optional[int]]] = None,
                        mesh: Optional[jax.sharding.Mesh] = None
                        ) -> Callable[..., Any]:
  """Transforms a tracked ``apply`` into one returning loss, grads and Grams.

  Args:
    apply_fn: ``apply`` of ``hk.transform_with_state(f)``, where ``f`` calls
      its model inside ``gram_haiku.track()`` and returns a scalar loss.
    has_aux: ``f`` returns ``(loss, aux)``; ``value`` is then that pair, as
      with ``jax.value_and_grad(..., has_aux=True)``.
    return_state: also return the updated Haiku state (e.g. BatchNorm
      statistics), as ``(value, new_state)`` in place of ``value``.
    mesh_axes: for use inside ``jax.shard_map`` whose example axis is split
      over these mesh axes (a name or a tuple, in the order of the
      ``PartitionSpec`` entry that splits the examples). Each device then
      gets its rows ``f32[b, B]`` of the global Gram (``b`` local examples,
      ``B`` in all); ``out_specs=P(mesh_axes, None)`` assembles the
      ``(B, B)`` Gram. The other devices' Gram factors are gathered
      (``all_gather``); ``track(mode="norms")`` layers need none.
      ``value`` and ``grads`` are what ``jax.value_and_grad`` gives in the
      same ``shard_map``: with replicated parameters and VMA checking on,
      the gradients are all-reduced exactly as JAX's own AD does. See the
      "Distributed" docs page for layouts and communication cost. Several
      axes need ``mesh`` (inside a ``shard_map`` built elsewhere their
      order cannot be checked).
    example_axes: where the examples lie in the positional batch arguments
      (those after ``rng``): one entry per argument, an int (that axis of
      every array in it, e.g. 1 for a time-major ``(T, B, F)`` input) or
      None (an argument that holds no examples: a memory of ``B`` rows
      that every example reads). Default: axis 0 of every array whose
      leading size is the batch's, which cannot tell a time-major input or
      such a memory from the examples when the sizes agree (``T == B``).
      The tracked layers take their own example axis from ``track()``
      (``hk.vmap(..., in_axes=1)`` over a time-major input); this says
      where the check that follows the examples starts.
    mesh: a ``jax.sharding.Mesh``: the returned function then builds the
      ``jax.shard_map`` itself and is called outside it on the whole
      batch. The examples (``example_axes``, default axis 0 of every array
      of the batch arguments) are split over ``mesh_axes`` (default: every
      axis of ``mesh``), in that order, and the Gram is assembled in the
      same order; parameters, state and ``rng`` are replicated. The
      outputs are global: ``grams`` ``f32[B, B]``, ``grads`` (of the sum of
      the devices' losses) replicated, and ``value`` (each device's loss)
      ``f32[n]``; whatever else differs per device (``aux``, BatchNorm
      statistics in the new state) gains a leading axis of size ``n``, one
      entry per device in the order of ``mesh_axes``.

  Returns:
    ``fn(params, state, rng, *args, **kwargs) -> (value, grads, grams)``:
    ``value`` is the loss, ``grads`` its gradient with respect to ``params``
    (identical to untracked ``jax.grad`` up to float rounding), and ``grams``
    a :class:`Grams` with ``total: f32[B, B]``, ``by_layer`` and
    ``norms: f32[B]``. ``B`` is the size of the example axis at apply time,
    which may differ from init. Before the real pass, one abstract trace of
    the loss (``jax.make_jaxpr``, no FLOPs) is read: it sizes the probes,
    finds the modules whose parameters are used more than once, and follows
    the examples (axis 0 of every array argument of the batch's size)
    through the program.

  Raises:
    ValueError: if ``state`` holds no probe, if the loss is not a scalar, if
      ``mesh_axes`` are not axes of an enclosing ``shard_map`` (or, with
      ``mesh``, of the mesh), if there are several without ``mesh``, if
      ``mesh``'s devices cannot share the batch equally; from the
      traced program: a parameter transformed on its way to its layer
      where the transformation cannot be pulled back (see the "Weight
      sharing" section of the semantics docs) or also used outside every
      tracked layer, a layer input whose example
      axis is not the examples (or merges, reorders or mixes them), a loss
      that couples the examples, a tracked layer differentiated inside the
      loss, an ``example_axes`` that does not fit the batch, a loss
      returned as a tuple without ``has_aux``; or from the tracked layers
      (see :class:`gram_haiku.track`).
      Each message names the module or parameter and what to do.
  """
  axes = shard_examples.example_axes_of(mesh_axes, mesh,
                                       "value_grad_and_gram")

  def fn(params, state, rng, *args, **kwargs):
    t = trace_loss(apply_fn, has_aux, params, state, rng, args, kwargs, axes,
                   example_axes=example_axes)
    found, size, n_devices = t.found, t.size, t.n_devices

    seen = t.seen

    def run_pass(slotted):
      shapes, owns = {}, {}
      for m, p in t.probes.items():
        mode = ("per_example" if m in found.shared
                else found.modes.get(m, "gram"))
        own = adapter.probe_shape(mode, size, found.param_counts.get(m, 0))
        if mode == "gram":
          own = (size, size * n_devices)  # This device's rows.
        if m in slotted:
          own = (slotted[m], size,
                 factors.factor_width(found.ops[m].in_mode("factors")))
        shapes[m] = tuple(p.shape[:p.ndim - _probe_ndim(p, found, m)]) + own
        owns[m] = len(own)
      probes = {m: _rows_sharded(
          jnp.zeros(shapes[m], found.probe_dtypes.get(m, p.dtype)),
          found.example_specs.get(m), owns[m]) for m, p in t.probes.items()}
      if axes:  # Each device has its own rows: the probes vary over `axes`.
        probes = {m: hx.vary_over(p, axes) for m, p in probes.items()}
      modes = {n: "per_example" for n in found.shared_layer_names}
      slotted_names = frozenset(found.ops[m].name for m in slotted)
      modes.update({n: "factors" for n in slotted_names})
      slots = slots_lib.slot_state(slotted)

      def loss(params, probes):
        return t.loss_of(params, probes, rng, args, kwargs, slots)
      reads: dict = {}
      with ambient.running(ambient.PassPlan(column_axes=axes, modes=modes,
                                            slotted=slotted_names,
                                            frozen=found.frozen_layers,
                                            slot_reads=reads)):
        out = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, probes)
      return out, slots_lib.untrusted(
          out[0][1][1], slots, reads, {m: found.ops[m].name for m in slots})

    slotted, out = slots_lib.pass_with_slots(
        run_pass, slots_lib.slotted_modules(found, axes, params))
    (value, (aux, new_state)), (grads, probe_grads) = out
    if has_aux:
      value = (value, aux)
    new_state, used = restore_state(new_state, t.given_probes, slotted)
    leaves = jax.tree_util.tree_leaves(params)
    full, diag = {}, {}
    for m, g in probe_grads.items():
      mode = found.modes.get(m, "gram")
      if m in slotted:
        op = found.ops[m].in_mode("factors")
        g = slots_lib.from_slots(op, g, bk.op_params(op, leaves,
                                             found.param_leaves[m]),
                         mode, used[m], slotted[m])
      elif m in found.shared:
        g = _from_per_example(per_example_of(found, m, g, leaves), mode, axes,
                              found.ops[m].plan.precision)
      else:
        g = _sum_leading(g, 2 if mode == "gram" else 1)
      (full if mode == "gram" else diag)[m] = g
    grams = Grams(full, diag, _coverage(params, seen, found), axes)
    return ((value, new_state) if return_state else value), grads, grams

  if mesh is None:
    return fn
  return shard_examples.shard_examples(
      fn, mesh=mesh, axes=axes, example_axes=example_axes,
      fn_name="value_grad_and_gram",
      rows=lambda out: (shard_examples.mark(out[0], False),
                        shard_examples.mark(out[1], False),
                        shard_examples.mark(out[2], True)))
