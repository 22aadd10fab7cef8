"""``RuleOp``: the one Gram-emitting primitive; it binds any :class:`Rule`.

How the op is a JAX primitive (forward, backward, ``vmap``, remat) is the
adapter's (:mod:`gram_haiku._src.ops.adapter`); what it computes is its
:class:`~gram_haiku._src.rules.rule.Rule`'s, a static parameter of the op (hashed
into the ``jit`` cache key and printed in the jaxpr, with the layer's
``name`` and its :class:`~gram_haiku._src.compute.plan.Plan`). Every layer, built-in
or a third party's, is a rule bound by :func:`bind`; there is no op class
per layer.

A Gram op computes ``y = rule.forward(x, *params)`` for one layer and takes
one more input, the zero *probe*, which the forward pass ignores. In the
backward pass the op gives ``x`` and the parameters their ordinary
cotangents and gives the probe, depending on ``mode``:

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
  from them by this rule (:mod:`gram_haiku._src.passes.bookkeeping`), with no
  second backward pass.
* ``"clip"``: probe ``[B]`` holding each example's weight ``m_i`` (1, or 0
  for a padded row); cotangent the squared norms, while the parameters get
  ``sum_i m_i c_i g_i`` with ``c_i`` from the plan's
  :class:`~gram_haiku._src.compute.plan.Clip` and this layer's own norm
  (per-layer clipping inside the backward rule: no stored factors).

How each mode is formed from the rule's functions (and their defaults,
:mod:`gram_haiku._src.rules.rule`) is the same for every rule:
:mod:`gram_haiku._src.ops.modes`.

Under ``vmap`` the batching rule rebuilds the op with the mapped axis at the
front of ``x``, so the backward rule sees every example at once (a
``custom_vjp`` would see one). :mod:`gram_haiku._src.compute.example_axis` says which
leading axis of ``x`` is the example axis.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src.compute import kernels
from gram_haiku._src.compute.example_axis import ExampleAxis
from gram_haiku._src.compute.example_axis import ExampleAxisSpec
from gram_haiku._src.compute.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.compute.plan import Plan
from gram_haiku._src.core import errors
from gram_haiku._src.ops import adapter
from gram_haiku._src.ops.adapter import aval_of
from gram_haiku._src.ops.adapter import is_float
from gram_haiku._src.ops.adapter import struct
from gram_haiku._src.rules.rule import Rule
from gram_haiku._src.rules.rule import rule_name


class RuleOp(adapter.Adapter):
  """The Gram op of one application of a :class:`Rule` (bound by
  :func:`bind`).

  Inputs: ``x``, then one input per name in ``rule.param_names`` (None for
  an absent one, e.g. no bias), then the probe. Output:
  ``rule.forward(x, *params)``. Static parameters: ``name`` (the layer's,
  for messages), ``plan`` (a :class:`~gram_haiku._src.compute.plan.Plan`: every
  decision the op acts on), ``rule``, and two facts about where this
  application runs (not decisions):

  * ``refusal``: why it has no correct Gram (a module applied more than
    once on the raw ``jax.grad`` path, a layer that mixes the examples,
    complex operands), raised as a ``ValueError`` if its probe is
    differentiated; None otherwise. The forward pass and the other
    gradients are unaffected.
  * ``at_init``: it runs inside a Haiku ``init``, where nothing is
    differentiated: parameters mapped by a vmap (which Haiku itself
    refuses there, with its own advice) are let through.
  """

  def __init__(self, x_aval, param_avals: Sequence[Any], probe_aval, *,
               name: str, plan: Plan, rule: Rule,
               refusal: Optional[str] = None, at_init: bool = False):
    if not isinstance(rule, Rule):
      raise TypeError(f"gram_haiku: the Gram op of layer {name!r} binds a "
                      f"gram_haiku.Rule, got {type(rule).__name__}.")
    if not isinstance(plan, Plan):
      raise TypeError(f"gram_haiku: the Gram op of layer {name!r}: plan "
                      f"must be a Plan, got {plan!r}.")
    if len(param_avals) != len(rule.param_names):
      raise TypeError(f"gram_haiku: {rule_name(rule)} (layer {name!r}) "
                      f"takes parameters {rule.param_names}, got "
                      f"{len(param_avals)}.")
    if refusal is not None and not isinstance(refusal, str):
      raise TypeError(f"gram_haiku: the Gram op of layer {name!r}: refusal "
                      f"must be None or a message, got {refusal!r}.")
    self.params = dict(name=name, plan=plan, rule=rule, refusal=refusal,
                       at_init=bool(at_init))
    self.rule = rule
    self.refusal = refusal
    self.at_init = bool(at_init)
    self.in_avals = (x_aval, *param_avals, probe_aval)
    self.name = name
    self.plan = plan
    out = jax.eval_shape(rule.forward, struct(x_aval),
                         *[struct(a) for a in param_avals])
    if not isinstance(out, jax.ShapeDtypeStruct):
      raise TypeError(
          f"gram_haiku: the forward of {rule_name(rule)} (layer {name!r}) "
          f"must return one array, got {jax.tree.structure(out)}. A Gram op "
          "has one output; compute other results outside the op from its "
          "output.")
    self.out_aval = x_aval.update(shape=out.shape, dtype=out.dtype,
                                  weak_type=out.weak_type)
    super().__init__()

  # -- the rule's fields, read by the adapter, the modes and the analyses ----

  @property
  def param_names(self) -> tuple[str, ...]:
    return self.rule.param_names

  @property
  def feature_ndim(self) -> int:
    return self.rule.feature_ndim

  @property
  def droppable(self) -> tuple[int, ...]:
    return self.rule.droppable

  @property
  def sharding_aware(self) -> bool:
    return self.rule.sharding_aware

  @property
  def kind(self) -> str:
    """The rule's short name (``linear``, ``conv``...), for messages."""
    return rule_name(self.rule)

  def forward(self, x, *params):
    """The plain layer: ``rule.forward``."""
    return self.rule.forward(x, *params)

  # -- the plan ---------------------------------------------------------------

  @property
  def mode(self) -> str:
    return self.plan.mode

  @property
  def strategy(self) -> str:
    return self.plan.strategy

  @property
  def example_axis(self) -> ExampleAxis:
    return self.plan.example_axis

  # -- types ------------------------------------------------------------------

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

  def factors_exact(self, dtype) -> bool:
    """Whether the input survives a cast to the float ``dtype`` of a
    ``"factors"`` probe: float inputs do; integer inputs only where the
    rule bounds them (an embedding's ids, by its vocabulary size)."""
    if self.rule.factors_exact is not None:
      return self.rule.factors_exact(self.x_aval, self.param_avals, dtype)
    return is_float(self.x_aval.dtype)

  # -- the same op with another type or plan ----------------------------------
  # (What each mode computes from the rule: :mod:`gram_haiku._src.ops.modes`.)

  def rebuild(self, x_aval, example_axis: ExampleAxis) -> "RuleOp":
    """The same op for a new ``x`` type and example axis (batching rule)."""
    return type(self)(x_aval, self.param_avals, self.probe_aval,
                      name=self.name,
                      plan=self.plan.replace(example_axis=example_axis),
                      rule=self.rule, refusal=self.refusal,
                      at_init=self.at_init)

  def with_plan(self, **changes) -> "RuleOp":
    """This op (same inputs) with its plan's fields changed."""
    plan = self.plan.replace(**changes)
    if plan == self.plan:
      return self
    return type(self)(self.x_aval, self.param_avals, self.probe_aval,
                      name=self.name, plan=plan, rule=self.rule,
                      refusal=self.refusal, at_init=self.at_init)

  def in_mode(self, mode: str) -> "RuleOp":
    """This op with its plan's mode set to ``mode`` (same inputs)."""
    return self.with_plan(mode=mode,
                          clip=self.plan.clip if mode == "clip" else None)


def bind(rule: Rule, x, params: Sequence[Any], probe, *, name: str,
         plan: Optional[Plan] = None,
         example_axis: ExampleAxisSpec | ExampleAxis = None,
         mode: str = "gram", strategy: str = "auto",
         memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
         refusal: Optional[str] = None, at_init: bool = False) -> jax.Array:
  """Binds ``rule`` to these inputs as a Gram op: ``y = rule.forward(x,
  *params)``, and the probe's cotangent is the rule's Gram (or its
  diagonal, or the per-example gradients, by ``mode``).

  The one binder of every Gram op: the public ``gram_*`` functions of
  :mod:`gram_haiku.ops` and :meth:`gram_haiku.LayerCall.apply` go through
  it.

  Args:
    rule: the layer's :class:`gram_haiku.Rule`.
    x: the layer input (example axis and within-example axes first).
    params: one array (or None) per name in ``rule.param_names``.
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
    refusal, at_init: where this application runs (:class:`RuleOp`):
      ``track()`` passes them; a binder of its own leaves them out.

  Returns:
    ``rule.forward(x, *params)``.

  Raises:
    TypeError: for a ``rule`` that is not a :class:`gram_haiku.Rule`, the
      wrong number of parameters, or a ``forward`` that does not return one
      array.
    ValueError: for an unknown ``mode`` or ``strategy``, a bad
      ``example_axis`` or budget; at differentiation time for a probe of
      the wrong shape (its shape for each ``mode``: ``probe`` above).
  """
  if plan is None:
    plan = Plan.make(mode=mode, strategy=strategy, example_axis=example_axis,
                     memory_budget_bytes=memory_budget_bytes)
  bridged = _deprecated_form_site()
  if bridged is not None:  # (see read_deprecated_form_site_with)
    refusal, at_init = refusal or bridged[0], at_init or bridged[1]
  complex_operands = [
      f"{what} {jnp.dtype(a.dtype).name}{list(a.shape)}"
      for what, a in [("input", x)] + [("parameter", p) for p in params]
      if a is not None and jnp.issubdtype(a.dtype, jnp.complexfloating)]
  if complex_operands and refusal is None:
    # The forward pass (inference, plain gradients) is unaffected.
    refusal = errors.COMPLEX_OPERANDS.format(
        module=name, operands=", ".join(complex_operands))
  op = RuleOp(aval_of(x), tuple(aval_of(p) for p in params), aval_of(probe),
              name=name, plan=plan, rule=rule, refusal=refusal,
              at_init=at_init)
  return op(x, *params, probe)


# The deprecated form of LayerCall.apply (a function that binds a Gram op
# itself, given only `name` and `plan`) cannot pass `refusal` and `at_init`
# on to the bind inside it. `track()` holds them for the duration of that
# call (in its ambient state, gram_haiku._src.frontend.ambient) and installs
# the reader here; `bind` reads them for an op bound without them. Removed
# with the deprecated form.
_deprecated_form_site: Callable[[], Optional[tuple[Optional[str], bool]]] = (
    lambda: None)


def read_deprecated_form_site_with(
    reader: Callable[[], Optional[tuple[Optional[str], bool]]]) -> None:
  """Installs ``reader() -> (refusal, at_init) or None``: what an op bound
  inside a deprecated binder function given to ``LayerCall.apply`` gets."""
  global _deprecated_form_site
  _deprecated_form_site = reader
