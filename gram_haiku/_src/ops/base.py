"""``GramOp``: a Gram-emitting primitive's rule (what it computes).

How the op is a JAX primitive (forward, backward, ``vmap``, remat) is the
adapter's (:mod:`gram_haiku._src.ops.adapter`); this class says what the
backward pass writes into the probe.

A Gram op computes ``y = forward(x, *params)`` for one layer and takes one
more input, the zero *probe*, which the forward pass ignores. In the backward
pass the op gives ``x`` and the parameters their ordinary cotangents and gives
the probe, depending on ``mode``:

* ``"gram"``: probe ``[B, B]``, cotangent ``G[i, j] = <g_i, g_j>``, the Gram
  of the per-example gradients ``g_i`` of the op's parameters;
* ``"norms"``: probe ``[B]``, cotangent ``|g_i|^2`` (the diagonal only);
* ``"per_example"``: probe ``[B, P]`` (``P`` = number of parameter entries),
  cotangent the flattened per-example gradients themselves. Used for a
  module applied more than once: JAX's AD sums the cotangents of every
  application into the one probe, which gives the per-example gradient of
  the shared parameters, cross terms included; the Gram is formed after the
  backward pass.
* ``"factors"``: probe ``[B, K]``, cotangent the layer's book-keeping
  factors: each example's input and output cotangent, flattened
  (:meth:`GramOp.factor_matrix`). After the pass the Gram, the norms and any
  reweighted gradient ``sum_i c_i g_i`` are formed from them by this rule
  (:mod:`gram_haiku._src.bookkeeping`), with no second backward pass.
* ``"clip"``: probe ``[B]`` holding each example's weight ``m_i`` (1, or 0
  for a padded row); cotangent the squared norms, while the parameters get
  ``sum_i m_i c_i g_i`` with ``c_i`` from the plan's
  :class:`~gram_haiku._src.plan.Clip` and this layer's own norm
  (per-layer clipping inside the backward rule: no stored factors).

Under ``vmap`` the batching rule rebuilds the op with the mapped axis at the
front of ``x``, so the backward rule sees every example at once (a
``custom_vjp`` would see one). :mod:`gram_haiku._src.example_axis` says which
leading axis of ``x`` is the example axis.

A subclass sets ``param_names`` and ``feature_ndim`` (the trailing axes of
``x`` that one application consumes; the axes before them are the example
axis and within-example axes) and implements ``forward``, which must accept
any number of leading axes. The default Gram forms the per-example gradients
by ``vmap`` over the example axis of the parameters' VJP: exact for any
layer, at ``B x P`` memory; subclasses override :meth:`GramOp.gram` and
:meth:`GramOp.sq_norms` with cheaper formulas where they have one.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src import errors
from gram_haiku._src import explicit_mesh
from gram_haiku._src import hijax_compat as hx
from gram_haiku._src import kernels
from gram_haiku._src.example_axis import ExampleAxis
from gram_haiku._src.example_axis import ExampleAxisSpec
from gram_haiku._src.kernels import KernelConfig
from gram_haiku._src.ops import adapter
from gram_haiku._src.ops.adapter import aval_of  # noqa: F401
from gram_haiku._src.ops.adapter import is_float
from gram_haiku._src.ops.adapter import probe_shape  # noqa: F401
from gram_haiku._src.ops.adapter import struct
from gram_haiku._src.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.plan import Plan


def clip_weights(sq_norms, clip) -> jax.Array:
  """``c_i`` of a :class:`~gram_haiku._src.plan.Clip` from squared norms.

  ``"abadi"``: ``min(1, C / |g_i|)``; ``"automatic"``: ``C / (|g_i| +
  gamma)``. A norm of zero gives 1 (``"abadi"``); a norm that is not finite
  gives 0, so that such an example contributes nothing.
  """
  norm = jnp.sqrt(jnp.maximum(sq_norms, 0))
  c = jnp.asarray(clip.l2_clip_norm, norm.dtype)
  if clip.function == "automatic":
    w = c / (norm + jnp.asarray(clip.gamma, norm.dtype))
  else:
    w = jnp.where(norm > c, c / jnp.where(norm > 0, norm, 1), 1)
  return jnp.where(jnp.isfinite(norm), w, 0).astype(norm.dtype)


class GramOp(adapter.Adapter):
  """Base class of Gram-emitting primitives; see the module docstring.

  Inputs: ``x``, then one input per name in ``param_names`` (None for an
  absent one, e.g. no bias), then the probe. Output: ``forward(x, *params)``.
  Static parameters: ``name`` (the layer's, for messages), ``plan`` (a
  :class:`~gram_haiku._src.plan.Plan`: every decision the op acts on) and
  the layer's own configuration (e.g. ``precision``), readable as
  attributes in :meth:`forward`.
  """

  #: Names of the parameter inputs, in order (used in error messages).
  param_names: tuple[str, ...] = ()
  #: Trailing axes of ``x`` consumed by one application of the layer.
  feature_ndim: int = 1

  def __init__(self, x_aval, param_avals: Sequence[Any], probe_aval, *,
               name: str, plan: Plan, **layer_params):
    if len(param_avals) != len(self.param_names):
      raise TypeError(f"{type(self).__name__} takes parameters "
                      f"{self.param_names}, got {len(param_avals)}.")
    if not isinstance(plan, Plan):
      raise TypeError(f"{type(self).__name__}: plan must be a Plan, got "
                      f"{plan!r}.")
    self.in_avals = (x_aval, *param_avals, probe_aval)
    self.params = dict(name=name, plan=plan, **layer_params)
    self.name = name
    self.plan = plan
    self.__dict__.update(layer_params)  # forward() reads its layer params
    out = jax.eval_shape(self.forward, struct(x_aval),
                         *[struct(a) for a in param_avals])
    if not isinstance(out, jax.ShapeDtypeStruct):
      raise TypeError(
          f"{type(self).__name__}.forward (layer {name!r}) must return one "
          f"array, got {jax.tree.structure(out)}. A Gram op has one output; "
          "compute other results outside the op from its output.")
    self.out_aval = x_aval.update(shape=out.shape, dtype=out.dtype,
                                  weak_type=out.weak_type)
    super().__init__()

  @property
  def mode(self) -> str:
    return self.plan.mode

  @property
  def strategy(self) -> str:
    return self.plan.strategy

  @property
  def example_axis(self) -> ExampleAxis:
    return self.plan.example_axis

  # -- what a subclass provides ----------------------------------------------

  def forward(self, x, *params):
    """The plain layer: the same ops as the Haiku module, any leading axes."""
    raise NotImplementedError(
        f"{type(self).__name__} must define forward(self, x, *params): the "
        "layer's output from its input and parameters (see GramOp).")

  #: Whether :meth:`gram` handles a sharded example axis itself: gathering
  #: its column factors (``cfg.columns``) under ``shard_map`` and giving its
  #: contractions row shardings under Explicit meshes. If False (the
  #: default, for your own rules), the Gram of a sharded example axis is
  #: formed from per-example gradients instead (exact, at ``B x P``
  #: memory), and ``gram`` only ever sees one device's whole batch.
  sharding_aware: bool = False

  #: Parameters (indices into ``param_names``) whose terms :meth:`gram`,
  #: :meth:`sq_norms`, :meth:`per_example_grads` and
  #: :meth:`probe_cotangent_and_grads` leave out, exactly, when given None
  #: for them, and whose values the VJP of every other parameter does not
  #: read (``x @ w + b``: both). A frozen parameter (``Plan.frozen``) among
  #: them costs nothing; for any other, the Gram of the layer's trainable
  #: parameters is formed from their exact per-example gradients instead
  #: (``B x P`` memory for those parameters). Default: none.
  droppable: tuple[int, ...] = ()

  def gram(self, x, g, params, example_dim: int,
           cfg: KernelConfig) -> jax.Array:
    """``(B, B)`` Gram of the per-example parameter gradients.

    Args:
      x: the op's input, example axis at ``example_dim``.
      g: the output cotangent, same leading axes.
      params: the parameter inputs (None for absent ones).
      example_dim: position of the example axis.
      cfg: the columns to gather and the memory budget (see
        :class:`~gram_haiku._src.kernels.KernelConfig`); without
        :attr:`sharding_aware` its ``column_axes`` are always empty.

    Returns:
      The Gram in the accumulation dtype (float32, float64 for float64).
    """
    f = self._flat_per_example(x, g, params, example_dim)
    return kernels.gram_matmul(f, f, cfg)

  def sq_norms(self, x, g, params, example_dim: int,
               cfg: KernelConfig) -> jax.Array:
    """``(B,)`` squared norms of the per-example gradients (diag of Gram)."""
    del cfg
    f = self._flat_per_example(x, g, params, example_dim)
    return jnp.sum(f * f, axis=1)

  def per_example_grads(self, x, g, params, example_dim: int):
    """Per-example gradients ``(B, *p.shape)`` for each present parameter.

    Exact for any layer: ``vmap`` over the example axis of the VJP of
    ``forward`` with respect to the parameters, at one example's input
    (within-example axes included, so they are summed over). Computed in the
    accumulation dtype.
    """
    return self._vjp_per_example(
        x, g, params, example_dim,
        [i for i, p in enumerate(params) if p is not None])

  def _vjp_per_example(self, x, g, params, example_dim: int, which):
    """:meth:`per_example_grads` (by ``vmap`` of the VJP) of the parameters
    ``params[i]``, ``i`` in ``which``; the others are held fixed."""
    acc = self.accumulation_dtype()
    live = [hx.vary_like(params[i].astype(acc), x, g) for i in which]
    xm = jnp.moveaxis(x, example_dim, 0)
    if is_float(xm.dtype):
      xm = xm.astype(acc)
    gm = jnp.moveaxis(g, example_dim, 0).astype(acc)

    def one(xi, gi):
      def fwd(*ps):
        full = list(params)
        for i, p in zip(which, ps):
          full[i] = p
        full = [None if p is None else p.astype(acc) for p in full]
        return self.forward(xi, *full).astype(acc)
      _, vjp = jax.vjp(fwd, *live)
      return vjp(gi)
    return jax.vmap(one)(xm, gm)

  @classmethod
  def apply(cls, x, params: Sequence[Any], probe, *, name: str,
            plan: Optional[Plan] = None,
            example_axis: ExampleAxisSpec | ExampleAxis = None,
            mode: str = "gram", strategy: str = "auto",
            memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
            **layer_params):
    """Binds the op to these inputs: ``y = forward(x, *params)``.

    The one binder of every Gram op (the public ``gram_*`` functions and the
    layer handlers go through it).

    Args:
      x: the layer input (example axis and within-example axes first).
      params: one array (or None) per name in ``param_names``.
      probe: zeros, ``[B, B]`` (``"gram"``), ``[B]`` (``"norms"``) or
        ``[B, P]`` (``"per_example"``), float32 (float64 under x64).
      name: the layer's name, used in error messages.
      plan: the op's decisions; when given, the four arguments below are
        ignored. ``track()`` passes the plan it resolved.
      example_axis: ``None`` (outermost vmap, else axis 0 of ``x``), ``0``
        (the input's own leading axis) or a vmap ``axis_name``.
      mode: ``"gram"``, ``"norms"`` or ``"per_example"``.
      strategy: ``"auto"``, ``"ghost"`` or ``"materialize"``.
      memory_budget_bytes: the largest intermediate a kernel builds at once.
      **layer_params: the subclass's own static parameters (hashable).

    Raises:
      ValueError: for an unknown ``mode`` or ``strategy``, a bad
        ``example_axis`` or budget; at differentiation time for a probe of
        the wrong shape (see the module docstring).
    """
    if plan is None:
      plan = Plan.make(mode=mode, strategy=strategy, example_axis=example_axis,
                       memory_budget_bytes=memory_budget_bytes)
    op = cls(aval_of(x), tuple(aval_of(p) for p in params), aval_of(probe),
             name=name, plan=plan, **layer_params)
    return op(x, *params, probe)

  # -- helpers ---------------------------------------------------------------

  @property
  def x_aval(self):
    return self.in_avals[0]

  @property
  def param_avals(self):
    return self.in_avals[1:-1]

  @property
  def probe_aval(self):
    return self.in_avals[-1]

  def accumulation_dtype(self) -> jnp.dtype:
    dts = [a.dtype for a in self.in_avals[:-1]
           if a is not None and is_float(a.dtype)]
    return kernels.accumulation_dtype(*dts)

  def num_params(self) -> int:
    return sum(math.prod(a.shape) for a in self.param_avals if a is not None)

  def num_trainable_params(self) -> int:
    """:meth:`num_params` less the frozen ones (``Plan.frozen``)."""
    return sum(math.prod(a.shape) for i, a in enumerate(self.param_avals)
               if a is not None and i not in (self.plan.frozen or ()))

  def lead_shape(self, x_shape) -> tuple[int, ...]:
    return tuple(x_shape[:len(x_shape) - self.feature_ndim])

  def rebuild(self, x_aval, example_axis: ExampleAxis) -> "GramOp":
    """The same op for a new ``x`` type and example axis (batching rule)."""
    kwargs = dict(self.params)
    kwargs["plan"] = self.plan.replace(example_axis=example_axis)
    return type(self)(x_aval, self.param_avals, self.probe_aval, **kwargs)

  def _flat_per_example(self, x, g, params, example_dim):
    grads = self.per_example_grads(x, g, params, example_dim)
    return jnp.concatenate([kernels.rows(a) for a in grads], axis=1)

  def example_size(self, x_shape=None) -> int:
    """Size of the example axis in ``x`` (default: the op's input type).

    Raises:
      ValueError: when the example axis cannot be found (a named vmap axis
        that does not enclose the layer, or an input without leading axes).
    """
    if x_shape is None:
      x_shape = self.x_aval.shape
    position = self.example_axis.resolved_position()
    if position is None:
      raise ValueError(errors.NAMED_AXIS_NOT_FOUND.format(
          module=self.name, axis=self.example_axis.name))
    lead = self.lead_shape(x_shape)
    if position >= len(lead):
      raise ValueError(errors.NO_EXAMPLE_AXIS.format(
          module=self.name, shape=tuple(x_shape),
          rule=self.example_axis.describe()))
    return lead[position]

  def probe_cotangent_and_grads(self, x, g, params, wanted,
                                cfg: KernelConfig):
    """The probe's cotangent, and parameter cotangents found on the way.

    Args:
      x, g, params, cfg: as in :meth:`gram`.
      wanted: indices (into ``params``) of the parameters whose ordinary
        cotangent is needed.

    Returns:
      ``(value, provided)``: the probe's cotangent (Gram, squared norms or
      per-example gradients, by ``mode``) and ``{index: cotangent}`` for
      parameters whose ordinary gradient the subclass computed anyway (the
      sum of materialised per-example gradients), in the parameter's dtype,
      so that it is not computed twice. The default provides none.
    """
    del wanted
    return self._probe_cotangent(x, g, params, cfg), {}

  # -- the modes every rule gets (no subclass hook) ----------------------------

  def with_plan(self, **changes) -> "GramOp":
    """This op (same inputs) with its plan's fields changed."""
    plan = self.plan.replace(**changes)
    if plan == self.plan:
      return self
    return type(self)(self.x_aval, self.param_avals, self.probe_aval,
                      **{**self.params, "plan": plan})

  def in_mode(self, mode: str) -> "GramOp":
    """This op with its plan's mode set to ``mode`` (same inputs)."""
    return self.with_plan(mode=mode,
                          clip=self.plan.clip if mode == "clip" else None)

  def probe_width(self) -> int:
    """The second axis of a ``"per_example"`` (``P``) or ``"factors"``
    (``K``) probe."""
    if self.mode == "factors":
      return self.factor_width()
    return self.num_params()

  def factor_width(self) -> int:
    """``K``: entries per example of the input plus the output cotangent."""
    total = math.prod(self.x_aval.shape) + math.prod(self.out_aval.shape)
    return total // max(self.example_size(), 1)

  def from_factors_strategy(self, mode: str, x, g) -> str:
    """The strategy for this layer's Gram or norms formed from its kept
    factors after a reweighted pass (:mod:`gram_haiku._src.bookkeeping`),
    where no materialised per-example gradient is reused for the weight
    gradient. Default: the plan's."""
    del mode, x, g
    return self.strategy

  def factors_exact(self, dtype) -> bool:
    """Whether the input survives a cast to the float ``dtype`` of a
    ``"factors"`` probe: float inputs do; integer inputs only where a rule
    bounds them (an embedding's ids, by its vocabulary size)."""
    return is_float(self.x_aval.dtype)

  def factor_matrix(self, x, g) -> jax.Array:
    """``[B, K]``: per example, the flattened input then output cotangent,
    in the accumulation dtype (the ``"factors"`` mode's cotangent)."""
    e = self.example_axis.resolved_position()
    acc = self.accumulation_dtype()
    xm = jnp.moveaxis(x, e, 0)
    gm = jnp.moveaxis(g, e, 0)
    return jnp.concatenate([kernels.rows(xm).astype(acc),
                            kernels.rows(gm).astype(acc)], axis=1)

  def split_factors(self, f):
    """Inverse of :meth:`factor_matrix`: ``(x, g)`` in the op's layout
    (``x`` in its own dtype, ``g`` in the accumulation dtype)."""
    e = self.example_axis.resolved_position()
    xs = list(self.x_aval.shape)
    gs = list(self.out_aval.shape)
    b = xs[e]
    moved = lambda s: [s[e]] + s[:e] + s[e + 1:]
    n = math.prod(xs) // max(b, 1)
    x = f[:, :n].reshape(moved(xs)).astype(self.x_aval.dtype)
    g = f[:, n:].reshape(moved(gs))
    return jnp.moveaxis(x, 0, e), jnp.moveaxis(g, 0, e)

  def scale_examples(self, g, c):
    """``c_i g_i`` along the example axis; rows with ``c_i == 0`` are exact
    zeros (also where ``g_i`` is not finite)."""
    e = self.example_axis.resolved_position()
    shape = [1] * g.ndim
    shape[e] = g.shape[e]
    c = c.reshape(shape)
    return jnp.where(c != 0, g * c.astype(g.dtype), jnp.zeros((), g.dtype))

  def reweighted_param_grads(self, x, g, params, c, wanted,
                             mask_inputs: bool = True) -> dict:
    """``{i: sum_e c_e g_e}`` for the parameters ``params[i]``, ``i`` in
    ``wanted``: the layer's own weight VJP with its output cotangent
    scaled per example (exact for every rule: the per-example gradient is
    linear in the example's output cotangent).

    Rows with ``c_e == 0`` have their output cotangent zeroed, even where
    it is not finite. ``mask_inputs``: zero those rows of the input too (a
    padded row may hold anything, even NaN, and ``NaN * 0`` is NaN), at the
    cost of a masked copy of ``x``; without padding every row is a real
    example, whose input is what ``jax.grad`` would see as well."""
    gs = self.scale_examples(g.astype(self.accumulation_dtype()), c)
    if mask_inputs and is_float(x.dtype):
      x = self.scale_examples(x, (c != 0).astype(x.dtype))
    cts = self.forward_vjp(x, params, gs, False, list(wanted))
    return dict(zip(wanted, cts))

  def products(self, x, g, params, wanted, cfg: KernelConfig):
    """:meth:`probe_cotangent_and_grads` of the trainable parameters only:
    those in ``Plan.frozen`` have no gradient, so they have no term in the
    Gram or the norms, and zero columns among the per-example gradients.
    ``params[i]`` may be None for a frozen one when :attr:`droppable` holds
    it (after the pass, where only the parameter leaves are known)."""
    frozen = [i for i in self.plan.frozen or ()
              if self.param_avals[i] is not None]
    if not frozen:
      return self.probe_cotangent_and_grads(x, g, params, wanted, cfg)
    wanted = [i for i in wanted if i not in frozen]
    keep = [i for i, a in enumerate(self.param_avals)
            if a is not None and i not in frozen]
    e = self.example_axis.resolved_position()
    acc = self.accumulation_dtype()
    if not keep:  # A frozen layer: no term at all.
      b = x.shape[e]
      shape = {"gram": (b, cfg.column_count(b)), "norms": (b,)}.get(
          self.mode, (b, self.num_params()))
      return hx.vary_like(jnp.zeros(shape, acc), x, g), {}
    if set(frozen) <= set(self.droppable):
      masked = [None if i in frozen else p for i, p in enumerate(params)]
      if self.mode != "per_example":
        return self.probe_cotangent_and_grads(x, g, masked, wanted, cfg)
      f = self._flat_per_example(x, g, masked, e)
    else:
      grads = self._vjp_per_example(x, g, params, e, keep)
      f = jnp.concatenate([kernels.rows(a) for a in grads], axis=1)
      if self.mode != "per_example":
        return self.probe_value(f, cfg), {}
    # Zero columns for the frozen parameters, so that the store keeps the
    # layout of every parameter (see :meth:`probe_width`).
    cols, start = [], 0
    for i, a in enumerate(self.param_avals):
      if a is None:
        continue
      n = math.prod(a.shape)
      if i in frozen:
        cols.append(jnp.zeros((f.shape[0], n), f.dtype))
      else:
        cols.append(f[:, start:start + n])
        start += n
    return jnp.concatenate(cols, axis=1), {}

  def backward_products(self, x, g, params, wanted, cfg: KernelConfig,
                        weights=None):
    """The probe's cotangent and parameter cotangents, by mode (the
    adapter's one call into the rule in the backward pass)."""
    if self.mode == "factors":
      return self.factor_matrix(x, g), {}
    if self.mode == "clip":
      sq = self.in_mode("norms").products(x, g, params, (), cfg)[0]
      c = clip_weights(sq, self.plan.clip) * weights.astype(sq.dtype)
      wanted = [i for i in wanted if i not in (self.plan.frozen or ())]
      provided = self.reweighted_param_grads(x, g, params, c, wanted)
      return sq, {i: hx.reduce_to_type_of(ct, params[i]).astype(
          params[i].dtype) for i, ct in provided.items()}
    return self.products(x, g, params, wanted, cfg)

  def probe_value(self, f, cfg: KernelConfig) -> jax.Array:
    """The probe's cotangent from flattened per-example gradients ``[B, P]``:
    their Gram (``"gram"``), squared norms (``"norms"``) or themselves."""
    if self.mode == "norms":
      return jnp.sum(f * f, axis=1)
    if self.mode == "gram":
      return kernels.gram_matmul(f, f, cfg)
    return f

  def _probe_cotangent(self, x, g, params, cfg: KernelConfig):
    value = self._rule_value(x, g, params, cfg)
    b = self.example_size(x.shape)
    want = {"gram": (b, cfg.column_count(b)), "norms": (b,)}.get(self.mode)
    if want is not None and tuple(value.shape) != want:
      method, what = (("gram", "(B, B) Gram") if self.mode == "gram" else
                      ("sq_norms", "(B,) squared norms"))
      raise ValueError(
          f"gram_haiku: {type(self).__name__}.{method} for layer "
          f"{self.name!r} returned shape {tuple(value.shape)}, expected "
          f"{want} (B = {b} examples, input shape {tuple(x.shape)}).\n"
          f"What to do: return the {what} of the per-example gradients; "
          "the conformance suite (the conformance package) checks a "
          "rule's shapes.")
    return value

  def _rule_value(self, x, g, params, cfg: KernelConfig):
    e = self.example_axis.resolved_position()
    if self.mode == "gram":
      if not self.sharding_aware and (
          cfg.column_axes or explicit_mesh.explicit_spec(x) is not None):
        # A subclass's own `gram` sees one device's examples and knows no
        # mesh: use the exact per-example path, which gathers its columns
        # (shard_map) and places its rows (Explicit meshes).
        return GramOp.gram(self, x, g, params, e, cfg)
      return self.gram(x, g, params, e, cfg)
    if self.mode == "norms":
      return self.sq_norms(x, g, params, e, cfg)
    return self._flat_per_example(x, g, params, e)

