"""The one place that touches Haiku's private modules and attributes.

gram_haiku's layer handlers repeat the Haiku modules' ``__call__`` with the
same checks and the same parameters, and a few of those steps are private in
Haiku (the padding rule of transposed convolutions, the shape rule of
``hk.Bias``, the state of ``hk.GroupNorm``). Every such name is read here and
nowhere else, so that a Haiku release that moves one means editing this
module only; ``tests/test_compat.py`` checks that each still exists.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Optional

import haiku as hk
from haiku._src import base as _base
from haiku._src import bias as _bias
from haiku._src import conv as _conv
from haiku._src import layer_norm as _layer_norm
from haiku._src import utils as _utils

__all__ = [
    "current_frame",
    "outermost_frame",
    "outermost_frame_id",
    "stored_parameters",
    "stored_state",
    "inside_transform",
    "innermost_transform_is_pure",
    "is_pure_apply",
    "inside_raw_jax_transform",
    "running_init",
    "module_scope",
    "compute_adjusted_padding",
    "calculate_bias_shape",
    "to_abs_axes",
    "error_if_param_axis_not_explicit",
    "param_axis_passed_explicitly",
    "assert_minimum_rank",
    "initialize_group_norm",
]

#: Haiku's padding of a transposed convolution with an ``output_shape``.
compute_adjusted_padding = _conv.compute_adjusted_padding
#: ``hk.Bias``'s bias shape from the input shape and ``bias_dims``.
calculate_bias_shape = _bias.calculate_bias_shape
#: ``hk.LayerNorm``'s normalisation of an ``axis`` argument.
to_abs_axes = _layer_norm.to_abs_axes
#: Haiku's rank check (``hk.Bias``).
assert_minimum_rank = _utils.assert_minimum_rank


def current_frame():
  """Haiku's current frame (one per call of a transformed function)."""
  return _base.current_frame()


def outermost_frame():
  """The frame of the outermost running transformed function: Haiku's
  lifted transforms (``hk.remat``, ``hk.vmap``, ``hk.cond``, ...) and
  nested transforms push their frames above it."""
  return list(_base.frame_stack)[-1]  # The stack iterates from the top.


def outermost_frame_id() -> int:
  """The number Haiku gave the outermost running frame (one per call of a
  transformed function, never reused): what identifies that call without
  holding its frame (and so its parameters, state and rng) alive."""
  return outermost_frame().frame_id


def stored_parameters(module_name: str) -> list:
  """The values Haiku holds for module ``module_name``'s parameters in the
  current frame: what ``hk.get_parameter`` hands to the custom getters."""
  return list(_base.current_frame().params.get(module_name, {}).values())


def stored_state(name: str) -> Any:
  """The value Haiku holds for the current module's state entry ``name``
  in the current frame (None where there is none): what ``hk.get_state``
  hands to the custom state getters, before any of them changes it."""
  entry = _base.current_frame().state[_base.current_name()].get(name)
  return None if entry is None else entry.current


def inside_transform() -> bool:
  """Whether the caller runs inside ``hk.transform`` (a Haiku frame)."""
  return _base.inside_transform()


def _codes(*fns) -> frozenset:
  return frozenset(f.__code__ for f in fns)


_WITH_STATE = hk.transform_with_state(lambda: None)
#: The code of ``init``/``apply`` of every ``hk.transform_with_state``: the
#: one Haiku core that opens a frame for a transformed function.
_WITH_STATE_CODES = _codes(_WITH_STATE.init, _WITH_STATE.apply)
#: The code of ``init``/``apply`` of ``hk.without_state`` (which
#: ``hk.transform`` is built on) and of ``hk.transform`` itself: the
#: wrappers that refuse any state after the function returns.
_PURE_CODES = _codes(hk.without_state(_WITH_STATE).init,
                     hk.without_state(_WITH_STATE).apply,
                     hk.transform(lambda: None).init,
                     hk.transform(lambda: None).apply)


def innermost_transform_is_pure() -> Optional[str]:
  """Whether the innermost running transformed function is one of
  ``hk.transform``/``hk.without_state`` (whose state must stay empty):
  ``"outer"`` when it is the outermost transform, ``"nested"`` when it
  runs inside another (``hk.lift`` of an inner ``hk.transform``), None
  when it has state (or nothing runs).

  Haiku's frame cannot tell (its state is an empty dict either way); the
  Python stack can: the ``init``/``apply`` of ``hk.transform_with_state``
  that opened the frame is called by the pure wrapper's own.
  """
  frame = sys._getframe(1)  # pylint: disable=protected-access
  kind, cores = None, 0
  while frame is not None:
    if frame.f_code in _WITH_STATE_CODES:
      cores += 1
      if cores == 1:
        caller = frame.f_back
        if caller is None or caller.f_code not in _PURE_CODES:
          return None
        kind = "outer"
      else:
        return "nested"
    frame = frame.f_back
  return kind


def is_pure_apply(fn: Callable[..., Any]) -> bool:
  """Whether ``fn`` is the ``apply`` (or ``init``) of ``hk.transform`` or
  ``hk.without_state``: no state in, none out."""
  return getattr(fn, "__code__", None) in _PURE_CODES


def running_init() -> bool:
  """Whether the caller runs inside a transformed function's ``init``
  (False outside every Haiku transform)."""
  return _base.inside_transform() and hk.running_init()


def inside_raw_jax_transform() -> bool:
  """Whether the caller is traced by a JAX transform opened inside the
  Haiku frame without Haiku's lifted version (``jax.lax.scan`` rather than
  ``hk.scan``, ``jax.vmap`` rather than ``hk.vmap``): Haiku state set there
  would leak that transform's tracers. Haiku's lifted transforms record
  the JAX trace they open (the check of ``hk.config(check_jax_usage=True)``
  compares the same two levels)."""
  frame = _base.current_frame()
  return _base.JaxTraceLevel.current() != frame.jax_trace_stack.peek()


def error_if_param_axis_not_explicit() -> bool:
  """Haiku's switch requiring ``param_axis`` for a non-final LayerNorm axis."""
  return bool(_layer_norm.ERROR_IF_PARAM_AXIS_NOT_EXPLICIT)


def param_axis_passed_explicitly(module: hk.LayerNorm) -> bool:
  """Whether ``hk.LayerNorm``/``hk.RMSNorm`` was given ``param_axis``."""
  return bool(module._param_axis_passed_explicitly)  # pylint: disable=protected-access


def initialize_group_norm(module: hk.GroupNorm, x: Any, channels: int):
  """``hk.GroupNorm``'s first-call set-up of its shapes (rank, groups)."""
  module._initialize(x, channels)  # pylint: disable=protected-access


def module_scope(module: hk.Module):
  """Haiku's scope of ``module``: state names resolve to its name.

  A Gram op may run for a module from outside the module's methods
  (:func:`gram_haiku.unembed`); its probe still lives in that module's
  ``hk.State``.
  """
  frame = _base.current_frame()
  stack = list(frame.module_stack)
  if stack and stack[-1].module is module:
    return contextlib.nullcontext()
  return frame.module(_base.ModuleState(module=module,
                                        method_name="__call__"))
