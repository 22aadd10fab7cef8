"""``gram_haiku.track()``: route Haiku layers to Gram-emitting primitives.

Inside the context, calls to ``hk.Linear.__call__`` are intercepted with
``hk.intercept_methods`` and computed by :func:`gram_linear` with the same
parameters (same names, shapes, dtypes and initialisers as ``hk.Linear``), plus
a zero probe ``gram_probe: f32[B, B]`` kept in the module's ``hk.State``. The
gradient with respect to that state entry is the module's Gram.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from haiku._src import base as hk_base  # current_frame: one per transform call

from gram_haiku._src import errors
from gram_haiku._src import gram_math
from gram_haiku._src.example_axis import ExampleAxis, ExampleAxisSpec
from gram_haiku._src.ops.linear import gram_linear

#: Name of the probe entry in each tracked module's ``hk.State``.
PROBE_NAME = "gram_probe"

_JAX_LOOPS = os.path.join("jax", "_src", "lax", "control_flow", "loops.py")
_HK_LAYER_STACK = os.path.join("haiku", "_src", "layer_stack.py")


def probe_dtype(x_dtype) -> jnp.dtype:
  """float32, or float64 for float64 inputs (under ``jax_enable_x64``)."""
  return gram_math.accumulation_dtype(x_dtype)


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

  Tracked modules: ``hk.Linear`` (so also ``hk.nets.MLP`` and the projections
  of ``hk.MultiHeadAttention``). Each gets a probe ``gram_probe`` in its
  ``hk.State``: ``f32[B, B]`` zeros (``f64`` for ``f64`` inputs) whose gradient
  is that module's Gram ``G[i, j] = <g_i, g_j>`` over its ``w`` and ``b``.
  Forward values are exactly those of the untracked module; without
  differentiation of the probes nothing extra is computed.

  Args:
    example_axis: which axis is the example axis (DESIGN.md §2). ``None``
      (default): the outermost ``vmap`` inside the differentiated function,
      else axis 0 of the layer input. ``0``: the layer input's own leading
      axis; every ``vmap`` is then a within-example axis. A string: the
      ``vmap``/``hk.vmap`` with that ``axis_name``.
    strategy: ``"auto"`` (cheaper of ghost and materialised by a FLOP count),
      ``"ghost"`` or ``"materialize"``.

  Raises:
    ValueError: for a bad ``example_axis`` or ``strategy``; when a tracked
      module is called twice in one context or inside a ``lax.scan``-style
      loop body (its Gram would need cross terms); from the backward pass,
      when a probe does not match the example axis.
  """

  def __init__(self, *, example_axis: ExampleAxisSpec = None,
               strategy: str = "auto"):
    self._example_axis = ExampleAxis.from_spec(example_axis)
    gram_math.choose_strategy(1, 1, 1, 1, 4, strategy)  # validates
    self._strategy = strategy
    # (id(Haiku frame), id(parameter)) -> (frame, parameter), for parameters
    # already used by a tracked layer in this context (holding the objects
    # keeps their ids unique).
    self._used: dict[tuple[int, int], tuple[object, jax.Array]] = {}
    self._stack: Optional[contextlib.ExitStack] = None

  def __enter__(self):
    if self._stack is not None:
      raise RuntimeError("gram_haiku.track() is not re-entrant; create a new "
                         "track() for each use.")
    self._used = {}
    self._stack = contextlib.ExitStack()
    self._stack.enter_context(hk.intercept_methods(self._intercept))
    return self

  def __exit__(self, *exc):
    stack, self._stack = self._stack, None
    return stack.__exit__(*exc)

  def _intercept(self, next_f, args, kwargs, context):
    if context.method_name == "__call__" and context.orig_class is hk.Linear:
      return self._linear(context.module, *args, **kwargs)
    return next_f(*args, **kwargs)

  def _claim(self, name: str, param: jax.Array) -> None:
    """Refuses a parameter that a tracked layer already used (sharing).

    Keyed by the parameter value, not the module: Haiku re-creates modules
    by name (``hk.static_unroll``), while ``hk.layer_stack`` traces one
    module many times with a fresh parameter slice each time (no sharing),
    and runs nested init and apply transforms (one Haiku frame each).
    """
    frame = hk_base.current_frame()
    key = (id(frame), id(param))
    if key in self._used:
      raise ValueError(errors.SHARED_LAYER.format(module=name))
    if _inside_shared_loop_body():
      raise ValueError(errors.LOOP_BODY.format(module=name))
    self._used[key] = (frame, param)

  def _probe(self, x: jax.Array) -> jax.Array:
    # At init, per-example code under vmap cannot see B: the size here is a
    # placeholder that value_grad_and_gram / resize_probes corrects.
    size = x.shape[0] if x.ndim >= 2 else 1
    # Under hk.transform (no state) Haiku itself raises NonEmptyStateError
    # after the function returns, telling the user to use
    # hk.transform_with_state.
    return hk.get_state(PROBE_NAME, (size, size), probe_dtype(x.dtype),
                        init=jnp.zeros)

  def _linear(self, module: hk.Linear, inputs, *, precision=None):
    """``hk.Linear.__call__`` with the Gram primitive (same parameters)."""
    if not inputs.shape:
      raise ValueError("Input must not be scalar.")
    name = module.module_name
    inputs = jnp.asarray(inputs)
    input_size = module.input_size = inputs.shape[-1]
    dtype = inputs.dtype
    w_init = module.w_init
    if w_init is None:
      w_init = hk.initializers.TruncatedNormal(stddev=1. / np.sqrt(input_size))
    w = hk.get_parameter("w", [input_size, module.output_size], dtype,
                         init=w_init)
    b = None
    if module.with_bias:
      b = hk.get_parameter("b", [module.output_size], dtype,
                           init=module.b_init)
    self._claim(name, w)
    probe = self._probe(inputs)
    return gram_linear(inputs, w, b, probe, name=name,
                       example_axis=self._example_axis, precision=precision,
                       strategy=self._strategy)
