"""``gram_haiku.track()``: route Haiku layers to Gram-emitting primitives.

Inside the context, calls to supported modules' ``__call__`` are intercepted
with ``hk.intercept_methods`` and computed by a Gram op with the same
parameters (same names, shapes, dtypes and initialisers as the Haiku module),
plus a zero probe ``gram_probe`` kept in the module's ``hk.State``. The
gradient with respect to that state entry is the module's Gram.

Each supported module class has a *layer handler* (see
:mod:`gram_haiku._src.frontend.registry`). The handler gets a :class:`LayerCall`, the
narrow object through which it applies its layer's
:class:`~gram_haiku._src.rules.rule.Rule`: :meth:`LayerCall.apply` resolves the
op's :class:`~gram_haiku._src.compute.plan.Plan` (from the context's
options and the running ``value_grad_and_gram`` pass), fetches or creates
the probe (:mod:`gram_haiku._src.frontend.probes`) and binds the rule
(:func:`gram_haiku._src.ops.op.bind`). On the raw
``jax.grad`` path, where no traced program says how a module is used, the
op carries :mod:`gram_haiku._src.frontend.raw_path`'s refusals.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import haiku as hk
import jax

from gram_haiku._src.compat import haiku_compat as hkc
from gram_haiku._src.compute.example_axis import ExampleAxis, ExampleAxisSpec
from gram_haiku._src.compute.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.compute.plan import DEFAULT_PRECISION
from gram_haiku._src.compute.plan import Plan
from gram_haiku._src.compute.plan import PrecisionSpec
from gram_haiku._src.compute.plan import to_precision
from gram_haiku._src.core import errors
from gram_haiku._src.frontend import ambient
from gram_haiku._src.frontend import coverage as coverage_lib
from gram_haiku._src.frontend import probes
from gram_haiku._src.frontend import raw_path
from gram_haiku._src.frontend import registry
from gram_haiku._src.frontend.coverage import Coverage
from gram_haiku._src.ops import op as op_lib
from gram_haiku._src.rules.rule import Rule
from gram_haiku._src.rules.rule import rule_name

TRACK_MODES = ("gram", "norms")

# (The deprecated form of LayerCall.apply: see ambient.deprecated_form_site.)
op_lib.read_deprecated_form_site_with(ambient.deprecated_form_site_now)

DEPRECATED_BINDER = (
    "gram_haiku: LayerCall.apply for module {module!r} was given a function "
    "that binds a Gram op; that form is deprecated and will be removed in "
    "the next release.\nWhat to do: pass the layer's gram_haiku.Rule: "
    "`call.apply(rule, x, params)` (the built-in binders' rules: "
    "gram_haiku.ops.linear_rule, ...).")


def current_tracker() -> Optional["track"]:
  """The innermost active :class:`track` context of this thread, or None."""
  return ambient.current().tracker


class LayerCall:
  """What a layer handler applies its layer's rule through.

  A handler registered with :func:`gram_haiku.register_layer` is called as
  ``handler(call, module, *args, **kwargs)`` in place of the module's
  ``__call__``. It reads the module's parameters (``hk.get_parameter``
  inside the handler, so that they are recorded as tracked by it) and
  returns ``call.apply(rule, x, params)`` with the layer's
  :class:`gram_haiku.Rule`.

  Attributes:
    module: the Haiku module being called.
  """

  def __init__(self, tracker: "track", module: hk.Module):
    self._tracker = tracker
    self.module = module

  def apply(self, rule: Rule, x: jax.Array, params, *,
            coupled: Optional[str] = None) -> jax.Array:
    """Binds the layer's rule for the module: what a layer handler returns.

    Args:
      rule: the layer's :class:`gram_haiku.Rule` (the built-in layers' are
        plain rules too, e.g. ``hk.Linear``'s
        ``gram_haiku.ops.linear_rule(precision)``). Deprecated:
        a function ``op(x, *params, probe, *, name, plan)`` that binds a
        Gram op itself (warns; pass its rule instead).
      x: the layer input, example axis first (or under ``vmap``).
      params: the module's parameters in the rule's order
        (``rule.param_names``; None for absent ones, e.g. no bias).
      coupled: why this application mixes the examples in its forward pass
        (a teaching error, e.g. ``hk.BatchNorm`` with batch statistics), or
        None. Such an application has no per-example gradients: asking for
        its Gram (:func:`gram_haiku.value_grad_and_gram`, the reweighting
        functions, or ``jax.grad`` of its probe) raises it as a
        ``ValueError``; the forward pass, inference and plain parameter
        gradients run as in plain Haiku.

    Returns:
      ``rule.forward(x, *params)``: the layer's output, exactly the
      untracked module's.

    Raises:
      TypeError: if ``params`` is not a tuple or list of arrays and Nones,
        or ``rule`` is neither a :class:`gram_haiku.Rule` nor a function.
      ValueError: on the raw ``jax.grad`` path, if the module's parameters
        are used more than once (weight sharing needs
        :func:`gram_haiku.value_grad_and_gram`).
    """
    if not isinstance(params, (tuple, list)) or not all(
        p is None or hasattr(p, "shape") for p in params):
      raise TypeError(
          f"LayerCall.apply for module {self.module.module_name!r}: params "
          f"must be a tuple of the op's parameters (arrays, or None for an "
          f"absent one), in the op's order; got {type(params).__name__}.")
    if not isinstance(rule, Rule):
      if not callable(rule):
        raise TypeError(
            f"LayerCall.apply for module {self.module.module_name!r}: the "
            f"first argument is the layer's gram_haiku.Rule, got "
            f"{type(rule).__name__}.")
      warnings.warn(DEPRECATED_BINDER.format(
          module=self.module.module_name), DeprecationWarning, stacklevel=2)
    return self._tracker._apply(rule, self.module, x, params, coupled)  # pylint: disable=protected-access

  def check_coupled(self, reason: str) -> None:
    """Declares that this application mixes the examples (``reason``, a
    teaching error): raised as a ``ValueError`` where Grams are asked for
    (:func:`gram_haiku.value_grad_and_gram` and the reweighting functions;
    not at ``init``). For a handler that may apply no op (e.g. a batch norm
    without a scale or an offset); one that does passes ``coupled=`` to
    :meth:`apply` as well, for the raw ``jax.grad`` path."""
    self._tracker._check_coupled(reason)  # pylint: disable=protected-access


class track(contextlib.ContextDecorator):  # pylint: disable=invalid-name
  """Context manager: tracked layers emit per-example gradient Grams.

  Use it inside the function given to ``hk.transform_with_state``:

  >>> import haiku as hk, jax, jax.numpy as jnp, gram_haiku
  >>> def loss_fn(x, y):
  ...   with gram_haiku.track():
  ...     out = hk.nets.MLP([8, 3])(x)
  ...   return ((out - y) ** 2).sum()
  >>> f = hk.transform_with_state(loss_fn)
  >>> x, y = jnp.ones((4, 5)), jnp.ones((4, 3))
  >>> params, state = f.init(jax.random.PRNGKey(0), x, y)
  >>> loss, grads, grams = gram_haiku.value_grad_and_gram(f.apply)(
  ...     params, state, None, x, y)
  >>> grams.total.shape
  (4, 4)

  Tracked modules: those with a registered layer handler (``hk.Linear``, so
  also ``hk.nets.MLP`` and the projections of ``hk.MultiHeadAttention``; see
  the API docs for the full list). Each gets a probe ``gram_probe`` in its
  ``hk.State``: ``f32[B, B]`` zeros (``f64`` for ``f64`` inputs) whose
  gradient is that module's Gram ``G[i, j] = <g_i, g_j>`` over its
  parameters. Forward values are exactly those of the untracked module;
  without differentiation of the probes nothing extra is computed.

  A module applied more than once (called twice, inside
  ``hk.dynamic_unroll``/``hk.scan``, in two ``track()`` blocks) has
  per-example gradient = sum over its applications.
  :func:`value_grad_and_gram` finds it in the traced program and
  accumulates that module's per-example gradients (probe ``f32[B, P]``), so
  its Gram has every cross term. On the raw ``jax.grad`` path such a module
  is an error.

  Args:
    example_axis: which axis is the example axis (see the Semantics page of
      the documentation). ``None``
      (default): the outermost ``vmap`` inside the differentiated function,
      else axis 0 of the layer input. ``0``: the layer input's own leading
      axis; every ``vmap`` is then a within-example axis. A string: the
      ``vmap``/``hk.vmap`` with that ``axis_name`` (layers outside every
      vmap use their input's axis 0).
    strategy: ``"auto"`` (cheaper of ghost and materialised by a FLOP count),
      ``"ghost"`` or ``"materialize"``.
    mode: ``"gram"`` (default): the full ``[B, B]`` Gram. ``"norms"``: only
      its diagonal, the squared per-example gradient norms (probe ``f32[B]``,
      cost linear in ``B``: what DP-SGD clipping needs).
    untracked: what to do when a parameter is read inside the context but
      outside every tracked layer (its module has no Gram rule, or a bare
      ``hk.get_parameter``): ``"warn"`` (default, once per parameter),
      ``"error"`` or ``"ignore"``. Either way it is listed as untracked in
      :attr:`Grams.coverage` and :attr:`Grams.complete` is False. Under
      :func:`gram_haiku.value_grad_and_gram` (and the reweighting
      functions) a parameter the loss reads only through
      ``stop_gradient`` has no gradient: it is covered as ``"frozen"`` and
      not reported. Nothing is reported during ``init``.
    memory_budget_bytes: the largest intermediate (bytes) a Gram kernel
      builds at once (default 256 MiB); larger Grams are computed in blocks.
    gram_precision: the ``jax.lax.Precision`` (or its name) of the products
      that form the Grams and squared norms (and, where a kernel
      materialises per-example gradients for them, those and the weight
      gradients summed from them). ``"highest"`` (default):
      float32-exact on every backend. ``"default"``: the backend's fastest
      matmul (one bf16 pass on a TPU, TF32 on a recent GPU), relative error
      about ``1e-3`` there; on a CPU both are the same. The layers' own
      forward and backward products keep their ``precision`` argument.

  Raises:
    ValueError: for a bad option; when a tracked parameter is also used
      outside its tracked layer (e.g. ``h @ embed.embeddings.T``: use
      :func:`gram_haiku.unembed`); with ``untracked="error"``, at the first
      untracked parameter of an apply (after tracing, under
      :func:`gram_haiku.value_grad_and_gram`); on the raw path, when a
      tracked module is applied more than once; from the backward pass,
      when a probe does not match the example axis.
  """

  def __init__(self, *, example_axis: ExampleAxisSpec = None,
               strategy: str = "auto", mode: str = "gram",
               untracked: str = "warn",
               memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
               gram_precision: PrecisionSpec = DEFAULT_PRECISION):
    if mode not in TRACK_MODES:
      raise ValueError(f"track(mode={mode!r}): expected one of {TRACK_MODES}.")
    try:
      precision = to_precision(gram_precision)
    except ValueError as e:
      raise ValueError(
          f"track(gram_precision={gram_precision!r}): {e}") from None
    self._plan = Plan.make(mode=mode, strategy=strategy,
                           example_axis=example_axis,
                           memory_budget_bytes=memory_budget_bytes,
                           precision=precision)
    self._untracked = untracked
    self._coverage = Coverage(untracked)
    self._pass: Optional[ambient.PassPlan] = None
    self._log: Optional[ambient.PassLog] = None
    self._stack: Optional[contextlib.ExitStack] = None

  @property
  def example_axis(self) -> ExampleAxis:
    return self._plan.example_axis

  @property
  def strategy(self) -> str:
    return self._plan.strategy

  def __enter__(self):
    if self._stack is not None:
      raise RuntimeError("gram_haiku.track() is not re-entrant; create a new "
                         "track() for each use.")
    if not hkc.inside_transform():
      raise ValueError(errors.TRACK_OUTSIDE_TRANSFORM)
    now = ambient.current()
    self._pass, self._log = now.pass_plan, now.pass_log
    # Under a pass the traced program tells which untracked reads matter
    # (those with a gradient): it reports them (see PassLog.untracked).
    # `init` computes no Gram: the first apply reports.
    self._coverage = Coverage(
        self._untracked, active=self._innermost,
        defer=self._pass is not None or hkc.running_init())
    self._stack = contextlib.ExitStack()
    ambient.push_tracker(self)
    if self._pass is not None and self._pass.disabled:
      return self  # Plain Haiku (gram_haiku.verify's reference).
    self._stack.enter_context(hk.intercept_methods(self._intercept))
    self._stack.enter_context(hk.custom_getter(self._coverage.getter))
    return self

  def __exit__(self, *exc):
    ambient.pop_tracker(self)
    stack, self._stack = self._stack, None
    if self._log is not None:
      self._log.saw(self._coverage.seen)
      coverage_lib.merge_deferred(self._log.untracked,
                                  self._coverage.deferred)
    self._pass = self._log = None
    return stack.__exit__(*exc)

  def _innermost(self) -> bool:
    """Whether this is the innermost active context (whose options apply)."""
    return ambient.current().tracker is self

  def _intercept(self, next_f, args, kwargs, context):
    if context.method_name == "__call__" and self._innermost():
      # The module's own class first: a registered subclass that inherits
      # __call__ (context.orig_class is the class defining it).
      handler = (registry.handler_for(type(context.module)) or
                 registry.handler_for(context.orig_class))
      if handler is not None:
        with self._coverage.tracking_rule(handler.__name__):
          return handler(LayerCall(self, context.module), context.module,
                         *args, **kwargs)
    return next_f(*args, **kwargs)

  def tracking_rule(self, rule: str):
    """Parameters read inside this block are tracked by ``rule``."""
    return self._coverage.tracking_rule(rule)

  def _resolve_plan(self, told: Optional[ambient.ModulePass]) -> Plan:
    """The op's plan: this context's options, and the running pass's
    (``told``: what it tells the module, or None)."""
    if self._pass is None:  # The raw jax.grad path.
      return self._plan
    plan = self._plan.replace(column_axes=self._pass.column_axes,
                              frozen=told.frozen if told else (),
                              upper_bound=self._pass.upper_bound)
    if told is not None and told.mode is not None:
      plan = plan.replace(mode=told.mode, clip=told.clip)
    return plan

  def _check_coupled(self, reason: str) -> None:
    """Raises ``reason`` where a pass asks for Grams (not at ``init``)."""
    if self._pass is not None and not hkc.running_init():
      raise ValueError(reason)

  def _apply(self, rule, module: hk.Module, x, params,
             coupled: Optional[str] = None):
    name = module.module_name
    present = [p for p in params if p is not None]
    if coupled is not None:
      self._check_coupled(coupled)
    # The one place the layer name is looked up: what the pass tells the
    # module it belongs to (and that module's state name).
    state_name, told = (self._pass.told(name) if self._pass is not None
                         else None) or (None, None)
    plan = self._resolve_plan(told)
    at_init = hkc.running_init()
    # The probe lives in the module's own state, also when the op runs from
    # outside the module's methods (gram_haiku.unembed).
    if self._log is not None and hkc.inside_raw_jax_transform():
      self._log.applied_in_raw_transform(name)
    pure = hkc.innermost_transform_is_pure()
    if pure is not None:
      raise ValueError((errors.TRACK_IN_PURE_TRANSFORM if pure == "outer" else
                        errors.TRACK_IN_LIFTED_PURE_TRANSFORM).format(
                            module=name))
    with hkc.module_scope(module):
      if told is not None and told.parts:
        probe = probes.part(rule_name(rule) if isinstance(rule, Rule) else
                            None, told.parts)
      elif told is not None and told.slotted:
        probe = probes.next_slot(None if self._log is None else
                                 self._log.slot_reads_of(state_name))
      else:
        probe = probes.module_probe(x, plan.mode,
                                    sum(math.prod(p.shape) for p in present),
                                    [p.dtype for p in present])
    refusal = None
    if self._pass is None:
      # The raw jax.grad path: refused only if the probe is differentiated
      # (under a pass, the traced program decides; `coupled` raised above).
      refusal = raw_path.refusal(module, present, probe, coupled=coupled)
    if isinstance(rule, Rule):
      return op_lib.bind(rule, x, params, probe, name=name, plan=plan,
                         refusal=refusal, at_init=at_init)
    with ambient.deprecated_form_site(refusal, at_init):
      return rule(x, *params, probe, name=name, plan=plan)
