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
  (:func:`~gram_haiku._src.ops.factors.factor_matrix`). After the pass the
  Gram, the norms and any reweighted gradient ``sum_i c_i g_i`` are formed
  from them by this rule (:mod:`gram_haiku._src.bookkeeping`), with no
  second backward pass.
* ``"clip"``: probe ``[B]`` holding each example's weight ``m_i`` (1, or 0
  for a padded row); cotangent the squared norms, while the parameters get
  ``sum_i m_i c_i g_i`` with ``c_i`` from the plan's
  :class:`~gram_haiku._src.plan.Clip` and this layer's own norm
  (per-layer clipping inside the backward rule: no stored factors).

How each mode is formed from the op's hooks (``gram``, ``sq_norms``,
``per_example_grads``, ``probe_cotangent_and_grads``) or its rule's
functions is the same for every op: :mod:`gram_haiku._src.ops.modes`.

Under ``vmap`` the batching rule rebuilds the op with the mapped axis at the
front of ``x``, so the backward rule sees every example at once (a
``custom_vjp`` would see one). :mod:`gram_haiku._src.example_axis` says which
leading axis of ``x`` is the example axis.

A layer's rule is best given as pure functions, a
:class:`~gram_haiku._src.rule.Rule`, bound by
:class:`~gram_haiku._src.ops.function.GramFunction` (every built-in layer
is). This class is also the lower-level interface: a subclass sets
``param_names`` and ``feature_ndim`` (the trailing axes of ``x`` that one
application consumes; the axes before them are the example axis and
within-example axes) and implements ``forward``, which must accept any
number of leading axes. The default Gram forms the per-example gradients by
``vmap`` over the example axis of the parameters' VJP (exact for any layer,
at ``B x P`` memory; :mod:`gram_haiku._src.rule` holds that default, once,
for rules and subclasses alike); subclasses override :meth:`GramOp.gram`
and :meth:`GramOp.sq_norms` with cheaper formulas where they have one.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src import errors
from gram_haiku._src import kernels
from gram_haiku._src import rule as rule_lib
from gram_haiku._src.example_axis import ExampleAxis
from gram_haiku._src.example_axis import ExampleAxisSpec
from gram_haiku._src.kernels import KernelConfig
from gram_haiku._src.ops import adapter
from gram_haiku._src.ops import modes
from gram_haiku._src.ops.adapter import aval_of  # noqa: F401
from gram_haiku._src.ops.adapter import is_float
from gram_haiku._src.ops.adapter import probe_shape  # noqa: F401
from gram_haiku._src.ops.adapter import struct
from gram_haiku._src.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.plan import Plan
from gram_haiku._src.rule import Rule


class GramOp(adapter.Adapter):
  """Base class of Gram-emitting primitives (the lower-level interface;
  a :class:`~gram_haiku.Rule` bound by :class:`~gram_haiku.GramFunction` is
  the shorter one).

  Inputs: ``x``, then one input per name in ``param_names`` (None for an
  absent one, e.g. no bias), then the probe. Output: ``forward(x, *params)``.
  Static parameters: ``name`` (the layer's, for messages), ``plan`` (a
  :class:`~gram_haiku._src.plan.Plan`: every decision the op acts on) and
  the layer's own configuration (e.g. ``precision``), readable as
  attributes in :meth:`forward`.
  """

  #: The op's :class:`~gram_haiku._src.rule.Rule`, where it is bound from
  #: one (:class:`~gram_haiku._src.ops.function.GramFunction`); None for a
  #: subclass that implements the hooks below itself.
  rule: Optional[Rule] = None
  #: Names of the parameter inputs, in order (used in error messages).
  param_names: tuple[str, ...] = ()
  #: Trailing axes of ``x`` consumed by one application of the layer.
  feature_ndim: int = 1

  def __init__(self, x_aval, param_avals: Sequence[Any], probe_aval, *,
               name: str, plan: Plan, **layer_params):
    # forward() and the rule read the layer params: set them first.
    self.params = dict(name=name, plan=plan, **layer_params)
    self.__dict__.update(layer_params)
    if len(param_avals) != len(self.param_names):
      raise TypeError(f"{type(self).__name__} takes parameters "
                      f"{self.param_names}, got {len(param_avals)}.")
    if not isinstance(plan, Plan):
      raise TypeError(f"{type(self).__name__}: plan must be a Plan, got "
                      f"{plan!r}.")
    self.in_avals = (x_aval, *param_avals, probe_aval)
    self.name = name
    self.plan = plan
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
  def layer_params(self) -> dict[str, Any]:
    """The layer's own static parameters (every op param but ``name`` and
    ``plan``): what a built-in layer builds its rule from."""
    return {k: v for k, v in self.params.items() if k not in ("name", "plan")}

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
    return rule_lib.gram_from_per_example(self.per_example_grads, x, g,
                                          params, example_dim, cfg)

  def sq_norms(self, x, g, params, example_dim: int,
               cfg: KernelConfig) -> jax.Array:
    """``(B,)`` squared norms of the per-example gradients (diag of Gram);
    with ``cfg.upper_bound``, of the per-example gradients as computed
    (the rounding of their sum of squares only)."""
    return rule_lib.sq_norms_from_per_example(self.per_example_grads, x, g,
                                              params, example_dim, cfg)

  def per_example_grads(self, x, g, params, example_dim: int):
    """Per-example gradients ``(B, *p.shape)`` for each present parameter.

    Exact for any layer: ``vmap`` over the example axis of the VJP of
    ``forward`` with respect to the parameters, at one example's input
    (within-example axes included, so they are summed over). Computed in
    the accumulation dtype.
    """
    return self.vjp_per_example(
        x, g, params, example_dim,
        [i for i, p in enumerate(params) if p is not None])

  def vjp_per_example(self, x, g, params, example_dim: int, which):
    """:meth:`per_example_grads` (by ``vmap`` of the VJP) of the parameters
    ``params[i]``, ``i`` in ``which``; the others are held fixed (see
    :func:`gram_haiku._src.rule.per_example_grads_by_vjp`)."""
    return rule_lib.per_example_grads_by_vjp(
        self.forward, x, g, params, example_dim, which,
        acc=self.accumulation_dtype())

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
        the wrong shape (its shape for each ``mode``: ``probe`` above).
    """
    if plan is None:
      plan = Plan.make(mode=mode, strategy=strategy, example_axis=example_axis,
                       memory_budget_bytes=memory_budget_bytes)
    complex_operands = [
        f"{what} {jnp.dtype(a.dtype).name}{list(a.shape)}"
        for what, a in [("input", x)] + [("parameter", p) for p in params]
        if a is not None and jnp.issubdtype(a.dtype, jnp.complexfloating)]
    if complex_operands and plan.refusal is None:
      # The forward pass (inference, plain gradients) is unaffected.
      plan = plan.replace(refusal=errors.COMPLEX_OPERANDS.format(
          module=name, operands=", ".join(complex_operands)))
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
    if position >= len(lead) and len(x_shape) >= 2 and any(
        a is not None and len(a.shape) == len(x_shape)
        for a in self.param_avals):
      raise ValueError(errors.PARAMS_SPAN_EXAMPLE_AXIS.format(
          module=self.name, shape=tuple(x_shape), position=position,
          feature_ndim=self.feature_ndim,
          params=", ".join(f"{n}{list(a.shape)}" for n, a in zip(
              self.param_names, self.param_avals) if a is not None)))
    if position >= len(lead):
      raise ValueError(errors.NO_EXAMPLE_AXIS.format(
          module=self.name, shape=tuple(x_shape),
          rule=self.example_axis.describe()))
    return lead[position]

  def probe_cotangent_and_grads(self, x, g, params, wanted,
                                cfg: KernelConfig):
    """The probe's cotangent, and parameter cotangents found on the way.

    Args:
      x, g, params, cfg: as in :meth:`gram`; ``cfg.method`` holds the
        method the rule's cost function chose for this application.
      wanted: indices (into ``params``) of the parameters whose ordinary
        cotangent is needed.

    Returns:
      ``(value, provided)``: the probe's cotangent (Gram, squared norms or
      per-example gradients, by ``mode``) and ``{index: cotangent}`` for
      parameters whose ordinary gradient was computed anyway (the sum of
      materialised per-example gradients), in the parameter's dtype, so
      that it is not computed twice. By default
      :func:`gram_haiku._src.ops.modes.rule_products`: the rule's fused
      function where it has one, else :meth:`gram`, :meth:`sq_norms` or
      :meth:`per_example_grads` by mode (providing none).
    """
    return modes.rule_products(self, x, g, params, wanted, cfg)

  # -- the same op with another plan ------------------------------------------
  # (What each mode computes from the hooks above is
  # :mod:`gram_haiku._src.ops.modes`', for every rule alike.)

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

  # -- book-keeping hooks (see :mod:`gram_haiku._src.ops.factors`) -------------

  def factors_exact(self, dtype) -> bool:
    """Whether the input survives a cast to the float ``dtype`` of a
    ``"factors"`` probe: float inputs do; integer inputs only where a rule
    bounds them (an embedding's ids, by its vocabulary size)."""
    if self.rule is not None and self.rule.factors_exact is not None:
      return self.rule.factors_exact(self.x_aval, self.param_avals, dtype)
    return is_float(self.x_aval.dtype)
