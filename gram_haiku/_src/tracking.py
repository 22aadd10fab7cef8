"""``gram_haiku.track()``: route Haiku layers to Gram-emitting primitives.

Inside the context, calls to supported modules' ``__call__`` are intercepted
with ``hk.intercept_methods`` and computed by a Gram op with the same
parameters (same names, shapes, dtypes and initialisers as the Haiku module),
plus a zero probe ``gram_probe`` kept in the module's ``hk.State``. The
gradient with respect to that state entry is the module's Gram.

Each supported module class has a *layer handler* registered with
:func:`register_layer` (see :mod:`gram_haiku._src.layers`): it re-creates the
module's parameters and calls :meth:`track.apply` with its Gram op.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
import warnings
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
from haiku._src import base as hk_base  # current_frame: one per transform call

from gram_haiku._src import discovery
from gram_haiku._src import errors
from gram_haiku._src import gram_math
from gram_haiku._src.example_axis import ExampleAxis, ExampleAxisSpec
from gram_haiku._src.ops import base

#: Name of the probe entry in each tracked module's ``hk.State``.
PROBE_NAME = "gram_probe"

_JAX_LOOPS = os.path.join("jax", "_src", "lax", "control_flow", "loops.py")
_HK_LAYER_STACK = os.path.join("haiku", "_src", "layer_stack.py")


def probe_dtype(*dtypes) -> jnp.dtype:
  """float32, or float64 for float64 inputs (under ``jax_enable_x64``)."""
  return gram_math.accumulation_dtype(*dtypes)


def _inside_shared_loop_body() -> bool:
  """Whether the current trace is a loop body that reuses its parameters.

  Walks the Python stack from the innermost frame: ``hk.layer_stack`` (a new
  slice of parameters per step) is fine; a JAX loop (``lax.scan``, ``map``,
  ``fori_loop``, ``while_loop``, and Haiku's wrappers of them) is not.
  """
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    filename = frame.f_code.co_filename
    if filename.endswith(_HK_LAYER_STACK):
      return False
    if filename.endswith(_JAX_LOOPS):
      return True
    frame = frame.f_back
  return False


#: module class -> handler(tracker, module, *args, **kwargs).
_HANDLERS: dict[type, Callable[..., Any]] = {}

TRACK_MODES = ("gram", "norms")
UNTRACKED_POLICIES = ("warn", "error", "ignore")

#: Parameters already warned about (``untracked="warn"`` warns once each).
_WARNED: set[str] = set()
_LOCAL = threading.local()


@dataclasses.dataclass(frozen=True)
class ParamCoverage:
  """How one parameter is covered by the Gram.

  Attributes:
    tracked: whether every use of the parameter is inside a Gram op.
    rule: the layer handler that tracks it (e.g. ``"linear"``), or None.
    module_type: the Haiku module class that reads it (``"(none)"`` for a
      bare ``hk.get_parameter`` outside any module).
  """
  tracked: bool
  rule: Optional[str]
  module_type: str


def current_tracker() -> Optional["track"]:
  """The innermost active :class:`track` context of this thread, or None."""
  stack = getattr(_LOCAL, "stack", None)
  return stack[-1] if stack else None


def register_layer(module_cls: type):
  """Decorator: ``handler(tracker, module, *args, **kwargs)`` replaces
  ``module_cls.__call__`` inside ``track()`` (exact class match).

  The handler reads the module's parameters and returns
  :meth:`track.apply` of a Gram op; see the worked example in the
  conformance docs (``conformance/examples/scaled_linear.py``). Registering
  a class again replaces its handler.
  """
  def decorate(handler):
    _HANDLERS[module_cls] = handler
    return handler
  return decorate


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

  A module applied more than once (called twice, or inside
  ``hk.dynamic_unroll``/``hk.scan``) has per-example gradient = sum over its
  applications. :func:`value_grad_and_gram` detects it and accumulates that
  module's per-example gradients (probe ``f32[B, P]``), so its Gram has
  every cross term. On the raw ``jax.grad`` path such a module is an error.

  Args:
    example_axis: which axis is the example axis (see ``docs/semantics.rst``). ``None``
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
      :attr:`Grams.coverage` and :attr:`Grams.complete` is False.

  Raises:
    ValueError: for a bad ``example_axis``, ``strategy``, ``mode`` or
      ``untracked``; when a tracked parameter is also used outside its
      tracked layer (e.g. ``h @ embed.embeddings.T``: use
      :func:`gram_haiku.unembed`); with ``untracked="error"``, at the first
      untracked parameter; on the raw path, when a tracked module is applied
      more than once; from the backward pass, when a probe does not match the
      example axis.
  """

  def __init__(self, *, example_axis: ExampleAxisSpec = None,
               strategy: str = "auto", mode: str = "gram",
               untracked: str = "warn"):
    self._example_axis = ExampleAxis.from_spec(example_axis)
    gram_math.choose_strategy(1, 1, 1, 1, 4, strategy)  # validates
    if mode not in TRACK_MODES:
      raise ValueError(f"track(mode={mode!r}): expected one of {TRACK_MODES}.")
    if untracked not in UNTRACKED_POLICIES:
      raise ValueError(f"track(untracked={untracked!r}): expected one of "
                       f"{UNTRACKED_POLICIES}.")
    self._strategy = strategy
    self._mode = mode
    self._untracked = untracked
    self._coverage: dict[str, ParamCoverage] = {}
    self._active_rule: Optional[str] = None
    # (id(Haiku frame), id(parameter)) -> (frame, parameter), for parameters
    # already used by a tracked layer in this context (holding the objects
    # keeps their ids unique).
    self._used: dict[tuple[int, int], tuple[object, jax.Array]] = {}
    self._stack: Optional[contextlib.ExitStack] = None

  @property
  def example_axis(self) -> ExampleAxis:
    return self._example_axis

  @property
  def strategy(self) -> str:
    return self._strategy

  def __enter__(self):
    if self._stack is not None:
      raise RuntimeError("gram_haiku.track() is not re-entrant; create a new "
                         "track() for each use.")
    if not hk_base.inside_transform():
      raise ValueError(errors.TRACK_OUTSIDE_TRANSFORM)
    _register_builtin_layers()
    self._used = {}
    self._coverage = {}
    self._stack = contextlib.ExitStack()
    self._stack.enter_context(hk.intercept_methods(self._intercept))
    self._stack.enter_context(hk.custom_getter(self._getter))
    _LOCAL.stack = getattr(_LOCAL, "stack", []) + [self]
    return self

  def __exit__(self, *exc):
    _LOCAL.stack = _LOCAL.stack[:-1]
    stack, self._stack = self._stack, None
    found = discovery.active()
    if found is not None:
      found.coverage.update(self._coverage)
    return stack.__exit__(*exc)

  def _intercept(self, next_f, args, kwargs, context):
    if context.method_name == "__call__":
      handler = _HANDLERS.get(context.orig_class)
      if handler is not None:
        with self.tracking_rule(handler.__name__):
          return handler(self, context.module, *args, **kwargs)
    return next_f(*args, **kwargs)

  @contextlib.contextmanager
  def tracking_rule(self, rule: str):
    """Parameters read inside this block are tracked by ``rule``."""
    previous, self._active_rule = self._active_rule, rule
    try:
      yield
    finally:
      self._active_rule = previous

  def _getter(self, next_getter, value, context):
    """Sees every parameter read: tracked (inside a handler) or not."""
    name = context.full_name
    module_type = (type(context.module).__name__ if context.module is not None
                   else "(none)")
    seen = self._coverage.get(name)
    if self._active_rule is not None:
      if seen is not None and not seen.tracked:
        raise ValueError(errors.MIXED_USE.format(
            param=name, module_type=module_type))
      self._coverage[name] = ParamCoverage(True, self._active_rule,
                                           module_type)
    else:
      if seen is not None and seen.tracked:
        raise ValueError(errors.MIXED_USE.format(
            param=name, module_type=module_type))
      self._coverage[name] = ParamCoverage(False, None, module_type)
      self._report_untracked(name, module_type)
    return next_getter(value)

  def _report_untracked(self, name: str, module_type: str) -> None:
    if self._untracked == "ignore":
      return
    if self._untracked == "error":
      raise ValueError(errors.UNTRACKED_PARAM.format(
          param=name, module_type=module_type))
    if name not in _WARNED:
      _WARNED.add(name)
      warnings.warn(errors.UNTRACKED_PARAM.format(
          param=name, module_type=module_type), UntrackedParameterWarning,
                    stacklevel=4)

  def _is_shared_use(self, params) -> bool:
    """Whether this application reuses parameters (sharing), else claims them.

    Keyed by the parameter value, not the module: Haiku re-creates modules
    by name (``hk.static_unroll``), while ``hk.layer_stack`` traces one
    module many times with a fresh parameter slice each time (no sharing),
    and runs nested init and apply transforms (one Haiku frame each).
    """
    frame = hk_base.current_frame()
    shared = _inside_shared_loop_body()
    for p in params:
      key = (id(frame), id(p))
      if key in self._used:
        shared = True
      self._used[key] = (frame, p)
    return shared

  def apply(self, op: Callable[..., jax.Array], module: hk.Module,
            x: jax.Array, params) -> jax.Array:
    """Applies a Gram op for ``module``: what a layer handler returns.

    A handler registered with :func:`register_layer` is called as
    ``handler(tracker, module, *args, **kwargs)`` in place of the module's
    ``__call__``; it reads the module's parameters (``hk.get_parameter``
    inside the handler, so that they are recorded as tracked by it) and
    returns ``tracker.apply(op, module, x, params)``.

    Args:
      op: ``op(x, *params, probe, *, name, example_axis, strategy, mode)``,
        e.g. a function calling :meth:`GramOp.apply` or a built-in binder
        such as :func:`gram_linear`.
      module: the Haiku module being called (its probe lives in its
        ``hk.State`` as ``gram_probe``; its name names the Gram in
        :attr:`Grams.by_layer`).
      x: the layer input, example axis first (or under ``vmap``).
      params: the module's parameters in the op's order (None for absent
        ones, e.g. no bias).

    Returns:
      ``op``'s output: the layer's output, exactly the untracked module's.

    Raises:
      ValueError: on the raw ``jax.grad`` path, if the module's parameters
        are used more than once (weight sharing needs
        :func:`value_grad_and_gram`).

    Detects parameter sharing, picks the probe mode (``"gram"``,
    ``"norms"`` or ``"per_example"`` for a shared module) and fetches or
    creates the probe in ``hk.State``.
    """
    name = module.module_name
    present = [p for p in params if p is not None]
    mode = self._mode
    if discovery.is_planned_shared(name):
      mode = "per_example"
    elif self._is_shared_use(present) and not hk.running_init():
      found = discovery.active()
      if found is not None:
        found.shared.add(name)
        mode = "per_example"
      elif _inside_shared_loop_body():
        raise ValueError(errors.LOOP_BODY.format(module=name))
      else:
        raise ValueError(errors.SHARED_LAYER.format(module=name))
    if discovery.active() is not None:
      discovery.active().modes[name] = self._mode
    # The probe lives in the module's own state, also when the op runs from
    # outside the module's methods (gram_haiku.unembed).
    with _module_scope(module):
      probe = self._probe(x, mode, sum(math.prod(p.shape) for p in present),
                          [p.dtype for p in present])
    return op(x, *params, probe, name=name, example_axis=self._example_axis,
              strategy=self._strategy, mode=mode)

  def _probe(self, x: jax.Array, mode: str, num_params: int, dtypes):
    # At init, per-example code under vmap cannot see B: the size here is a
    # placeholder that value_grad_and_gram / resize_probes corrects.
    size = x.shape[0] if x.ndim >= 2 else 1
    shape = base.probe_shape(mode, size, num_params)
    dtypes = [x.dtype, *dtypes] if base.is_float(x.dtype) else list(dtypes)
    # Under hk.transform (no state) Haiku itself raises NonEmptyStateError
    # after the function returns, telling the user to use
    # hk.transform_with_state.
    return hk.get_state(PROBE_NAME, shape, probe_dtype(*dtypes),
                        init=jnp.zeros)


def _module_scope(module: hk.Module):
  """Haiku's scope of ``module`` (state names resolve to its name)."""
  frame = hk_base.current_frame()
  stack = list(frame.module_stack)
  if stack and stack[-1].module is module:
    return contextlib.nullcontext()
  return frame.module(hk_base.ModuleState(module=module,
                                          method_name="__call__"))


class UntrackedParameterWarning(UserWarning):
  """A parameter read inside ``track()`` is not covered by any Gram op."""


def _register_builtin_layers():
  from gram_haiku._src import layers  # pylint: disable=g-import-not-at-top,unused-import
