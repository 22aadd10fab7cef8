"""The hijax adapter: how a Gram op is a JAX primitive, and nothing else.

:class:`Adapter` implements ``jax.experimental.hijax.VJPHiPrimitive`` for
every Gram op: ``expand`` (the forward pass), ``jvp``, ``vjp_fwd`` and
``vjp_bwd`` (the backward pass, where the probe's cotangent is written),
``batch`` (the ``vmap`` rule that moves the mapped axis to the front of the
input, so that the backward rule sees every example) and ``remat``, plus the
probe protocol's checks (shape, mesh variance, ref accumulators). What the
op computes comes from its rule (:class:`gram_haiku._src.ops.op.RuleOp`
binds one): ``forward``, ``example_size``, ``num_params``, and the probe's
value by :func:`gram_haiku._src.ops.modes.backward_products`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import example_sharding
from gram_haiku._src.compute import explicit_mesh
from gram_haiku._src.compute.plan import PROBE_NDIM
from gram_haiku._src.compute.kernels import is_float
from gram_haiku._src.compute.kernels import KernelConfig
from gram_haiku._src.core import errors
from gram_haiku._src.core import one_program
from gram_haiku._src.ops import modes


def aval_of(x) -> Any:
  """``jax.typeof(x)``, or None for an absent (None) input."""
  return None if x is None else jax.typeof(x)


def struct(aval) -> Optional[jax.ShapeDtypeStruct]:
  if aval is None:
    return None
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def probe_shape(mode: str, size: int, width: int) -> tuple[int, ...]:
  """The probe shape that ``mode`` needs for ``size`` examples.

  ``width``: the number of parameter entries (``"per_example"``) or the
  book-keeping factor width (``"factors"``); unused otherwise.
  """
  if PROBE_NDIM[mode] == 1:  # "norms", "clip"
    return (size,)
  return (size, size if mode == "gram" else width)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ProbeFacts:
  """What ``vjp_fwd`` learns about the probe, carried to ``vjp_bwd``.

  A static pytree node (no array leaves): JAX carries it in the residuals'
  tree structure.

  Attributes:
    wanted: whether the probe is differentiated (its cotangent is needed).
    shape: the probe's shape: ``(B, B)``, ``(B,)``, ``(B, P)``, or this
      device's rows ``(b, B)`` under ``shard_map``.
    dtype: the probe's dtype name (``"float32"``, ``"float64"``).
    spec: the probe's ``PartitionSpec`` under a mesh with Explicit axes,
      else None; the cotangent is resharded to it.
    column_axes: mesh axes the Gram's columns are gathered over (``()``:
      none).
  """
  wanted: bool
  shape: tuple[int, ...]
  dtype: str
  spec: Any
  column_axes: tuple[str, ...]


#: :func:`modes.backward_products`, as one compiled program when the
#: backward pass runs eagerly (``jax.grad`` outside ``jit``: its arguments
#: are arrays, not tracers), the op and kernel configuration static: op by
#: op, each of the rule's products is a program traced, lowered and
#: compiled on its own (the eager cases of the conformance suite: 22.1 ->
#: 15.3 CPU-s cold with this). Inside a trace, for an op that cannot be
#: hashed, or a rule that reads its arrays' values in Python, it is the
#: function itself (:func:`gram_haiku._src.core.one_program.
#: compiled_when_eager`).
_backward_products = one_program.compiled_when_eager(
    modes.backward_products)


class Adapter(hx.VJPHiPrimitive):
  """``VJPHiPrimitive`` methods shared by every Gram op (see the module
  docstring). A subclass provides the rule."""

  # -- forward ---------------------------------------------------------------

  def expand(self, x, *rest):
    return self.forward(x, *rest[:-1])  # The probe only has a cotangent.

  def jvp(self, primals, tangents):
    if not hx.is_zero(tangents[-1]):
      # The probe is being differentiated: this JVP will be transposed (e.g.
      # by jax.checkpoint), and the Gram only exists in the backward rule.
      return hx.jvp_by_vjp(self, primals, tangents)
    if hx.is_differentiated(primals[-1]):
      # Forward mode inside a function whose probes an outer transform
      # differentiates (jax.jvp within the loss, tangent propagation): the
      # layer runs as its plain computation here, so this use's share of
      # the Gram would be lost.
      raise ValueError(errors.FORWARD_MODE_INSIDE.format(module=self.name))
    args, dots = list(primals[:-1]), tangents[:-1]
    live = [i for i, (a, t) in enumerate(zip(args, dots))
            if a is not None and not hx.is_zero(t)]
    if not live:
      out = self.forward(*args)
      return out, hx.Zero(self.out_aval.to_tangent_aval())

    def f(*live_args):
      full = list(args)
      for i, a in zip(live, live_args):
        full[i] = a
      return self.forward(*full)
    return jax.jvp(f, [args[i] for i in live], [dots[i] for i in live])

  def lin(self, nzs_in, x, *rest):
    """``jax.linearize``: the forward pass, and the layer's inputs as the
    residuals of its linear map (:meth:`linearized`)."""
    if nzs_in[-1]:
      # The probe only has a cotangent: forward mode cannot carry the Gram.
      raise ValueError(errors.PROBE_LINEARIZED.format(module=self.name))
    return self.forward(x, *rest[:-1]), (x, tuple(rest[:-1]))

  def linearized(self, residuals, *tangents):
    """The layer's JVP at the linearisation point (the probe's tangent is
    zero)."""
    x, params = residuals
    probe_tangent = hx.Zero(self.probe_aval.to_tangent_aval())
    _, out = self.jvp((x, *params, None), (*tangents[:-1], probe_tangent))
    return out

  # -- reverse mode ----------------------------------------------------------

  def vjp_fwd(self, nzs_in, x, *rest):
    params, probe = rest[:-1], rest[-1]
    out = self.forward(x, *params)
    wanted = bool(nzs_in[-1])
    columns = ()
    if not wanted and hx.is_differentiated(probe):
      # An outer transform differentiates the probe, but this application
      # is differentiated inside it (jax.grad within the loss): its
      # contribution to the Gram would be lost.
      raise ValueError(errors.HIGHER_ORDER.format(module=self.name))
    if wanted and self.refusal is not None:
      raise ValueError(self.refusal)
    if wanted:
      size = self.example_size(x.shape)
      columns = example_sharding.column_axes(probe, size, self.mode,
                                             self.plan.column_axes, self.name)
      self._check_probe_varies(x, probe)
      expected = probe_shape(self.mode, size, modes.probe_width(self))
      if columns:  # shard_map: this device's rows of the global Gram.
        expected = (size, size * example_sharding.axes_size(columns))
      if tuple(probe.shape) != expected:
        raise ValueError(errors.PROBE_SHAPE_MISMATCH.format(
            module=self.name, expected=expected, got=tuple(probe.shape),
            x_shape=tuple(x.shape), rule=self.example_axis.describe(),
            mode=self.mode))
    facts = ProbeFacts(wanted=wanted, shape=tuple(probe.shape),
                       dtype=jnp.dtype(probe.dtype).name,
                       spec=explicit_mesh.explicit_spec(probe),
                       column_axes=tuple(columns))
    # "clip" mode: the probe's value is each example's weight (1, or 0 for
    # a padded row), read by the backward rule.
    weights = probe if self.mode == "clip" else None
    return out, (x, tuple(params), facts, weights)

  def vjp_bwd(self, res, g, x_acc, *rest_accs):
    if hx.is_zero(g):
      return
    x, params, facts, weights = res
    param_accs, probe_acc = rest_accs[:-1], rest_accs[-1]
    wanted = [i for i, (p, acc) in enumerate(zip(params, param_accs))
              if p is not None and hx.wants_cotangent(acc)]
    want_x = is_float(x.dtype) and hx.wants_cotangent(x_acc)
    if facts.wanted and hx.wants_cotangent(probe_acc):
      self._check_wholly_differentiated(params, wanted)
      dtype = jnp.dtype(facts.dtype)
      self._check_probe_ref(probe_acc, facts.shape, dtype)
      cfg = KernelConfig(column_axes=facts.column_axes,
                         memory_budget_bytes=self.plan.memory_budget_bytes,
                         precision=self.plan.precision)
      if 0 in facts.shape:
        # No examples (an empty Poisson-sampled batch): an empty Gram; the
        # parameters get their ordinary (zero) cotangents below.
        value, provided = jnp.zeros(facts.shape, dtype), {}
      else:
        value, provided = _backward_products(self, x, g, params, wanted,
                                             cfg, weights)
      value = explicit_mesh.reshard_like(value.astype(dtype), facts.spec)
      probe_acc.accum(value)
      for i, ct in provided.items():
        param_accs[i].accum(hx.reduce_to_type_of(ct, params[i]))
      wanted = [i for i in wanted if i not in provided]
    if wanted or want_x:
      self._accumulate_cotangents(x, params, g, want_x, wanted, x_acc,
                                  param_accs)

  def _check_wholly_differentiated(self, params, wanted) -> None:
    """Where nothing says which parameters are frozen (``Plan.frozen`` is
    None), the Gram covers all of them: refuse a layer whose parameters are
    differentiated only in part, whose Gram would hold the others' terms."""
    if self.plan.frozen is not None or not wanted:
      return
    floats = [i for i, p in enumerate(params)
              if p is not None and is_float(p.dtype)]
    if len(wanted) < len(floats):
      raise ValueError(errors.PARTLY_DIFFERENTIATED.format(
          module=self.name,
          wanted=[self.param_names[i] for i in wanted],
          others=[self.param_names[i] for i in floats if i not in wanted]))

  def _accumulate_cotangents(self, x, params, g, want_x, wanted, x_acc,
                             param_accs):
    """Ordinary cotangents, by JAX's own VJP of ``forward``."""
    idx = ([0] if want_x else []) + [i + 1 for i in wanted]
    accs = [x_acc, *param_accs]
    for i, ct in zip(idx, self.forward_vjp(x, params, g, want_x, wanted)):
      accs[i].accum(ct)

  def forward_vjp(self, x, params, g, want_x: bool, wanted) -> list:
    """Cotangents of ``x`` (if ``want_x``) and of ``params[i]`` for ``i`` in
    ``wanted``, in that order, by JAX's own VJP of ``forward``.

    So shapes, dtypes and weak types are exactly those an untracked layer
    gets; under ``jit`` the recomputed primal output is dead code. ``g``
    is cast to that output's dtype (the layer's own, unless ``x`` or the
    parameters are given cast up, e.g. to accumulate in float32).
    """
    idx = ([0] if want_x else []) + [i + 1 for i in wanted]
    # A frozen parameter known only as absent (after the pass, see
    # Rule.droppable) is held at zero: no wanted cotangent reads it.
    args = [x, *[jnp.zeros(a.shape, a.dtype) if p is None and a is not None
                 else p for p, a in zip(params, self.param_avals)]]

    def f(*live):
      full = list(args)
      for i, a in zip(idx, live):
        full[i] = a
      return self.forward(*full)
    y, vjp = jax.vjp(f, *[args[i] for i in idx])
    return list(vjp(g.astype(y.dtype)))

  def _check_probe_varies(self, x, probe):
    """Inside ``shard_map`` the probe varies wherever the examples do."""
    missing = hx.varying_axes(x) - hx.varying_axes(probe)
    if missing:
      axes = example_sharding.in_mesh_order(missing)
      raw = {"gram": "(B_local, B) and in_specs=P({s}, None)",
             "norms": "(B_local,) and in_specs=P({s})",
             "clip": "(B_local,) and in_specs=P({s})",
             "per_example": "(B_local, P) and in_specs=P({s}, None)",
             "factors": "(B_local, K) and in_specs=P({s}, None)"}
      suggest = axes if len(axes) > 1 else repr(axes[0])
      raise ValueError(errors.PROBE_NOT_VARYING.format(
          module=self.name, x_shape=tuple(x.shape), x_axes=axes,
          probe_shape=tuple(probe.shape),
          probe_axes=example_sharding.in_mesh_order(
              hx.varying_axes(probe)),
          suggest=suggest, raw=raw[self.mode].format(s=suggest)))

  def _check_probe_ref(self, acc, shape, dtype):
    ref_type = hx.accumulator_ref_type(acc)
    if ref_type is None:
      return
    ref_shape, ref_dtype = ref_type
    if tuple(ref_shape) != tuple(shape) or jnp.dtype(ref_dtype) != dtype:
      raise ValueError(errors.PROBE_REF_TYPE.format(
          module=self.name, expected=f"{dtype.name}{list(shape)}",
          got=f"{jnp.dtype(ref_dtype).name}{list(ref_shape)}"))

  # -- vmap ------------------------------------------------------------------

  def batch(self, axis_data, args, dims):
    x, *params, probe = args
    x_dim, *param_dims, probe_dim = dims
    if self.at_init and (probe_dim is not None or any(
        d is not None for d in param_dims)):
      # At init nothing is differentiated, so the layer runs plainly: a
      # probe mapped by a per-example hk.cond is refused when the Gram is
      # taken (below), and parameters mapped by hk.vmap(split_rng=True) or
      # created under a per-example hk.cond are refused by Haiku itself,
      # after the layer has run, with the advice that fits.
      if x_dim is None and all(d is None for d in param_dims):
        return self.forward(x, *params), None
      return jax.vmap(self.forward, in_axes=(x_dim, *param_dims))(
          x, *params), 0
    if probe_dim is not None:
      raise ValueError(errors.PROBE_BATCHED.format(
          module=self.name, shape=tuple(probe.shape), dim=probe_dim))
    batched_params = [n for n, d in zip(self.param_names, param_dims)
                      if d is not None]
    if batched_params:
      raise NotImplementedError(errors.PARAMS_BATCHED.format(
          module=self.name, params=batched_params))
    if x_dim is None:
      if not self.example_axis.may_be_examples(hx.axis_name(axis_data)):
        # A within-example vmap along which the input does not vary: neither
        # does the output, and its cotangent sums over the axis.
        return self(x, *params, probe), None
      # Perhaps the examples' own vmap (the default rule cannot tell until
      # the outermost one has fired), and the input is the same for every
      # example (positions from jnp.arange, a learned memory): each example
      # still has its own gradient, through its own output cotangent. The
      # input is broadcast along the axis so that the layer has one; along a
      # within-example axis the broadcast is exact too (the cotangents sum).
      x = jnp.broadcast_to(x, (hx.axis_size(axis_data),) + tuple(x.shape))
      x_dim = 0
    x = jnp.moveaxis(x, x_dim, 0)
    op = self.rebuild(jax.typeof(x),
                      self.example_axis.after_vmap(hx.axis_name(axis_data)))
    return op(x, *params, probe), 0

  # -- checkpointing -----------------------------------------------------------

  def remat(self, policy, *args):
    del policy  # Gram layers are cheap to recompute; always rematerialise.
    return self(*args), self
