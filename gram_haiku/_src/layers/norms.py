"""Normalisation layers and ``hk.Bias`` inside ``track()``.

Each handler repeats the Haiku module's ``__call__`` (same checks, same
parameters: names, shapes, dtypes, initialisers and creation order; same
normalisation ops) and routes only the learnable elementwise affine part
through its rule (:func:`gram_haiku._src.ops.affine.affine_rule`). The
normalised input ``xhat`` is computed by ordinary JAX ops, so the
normalisation's own gradient reaches the input as it does in Haiku.

* ``hk.LayerNorm`` (and ``hk.InstanceNorm``, a subclass whose ``__call__``
  is LayerNorm's, so the interceptor reports ``orig_class = hk.LayerNorm``):
  Haiku computes ``(scale * rsqrt(var + eps)) * (x - mean) + offset``; the
  tracked layer computes ``(rsqrt(var + eps) * (x - mean)) * scale +
  offset``: equal up to float rounding (``xhat`` formed in the dtype the
  scale promotes it to, as Haiku's product is). Without a ``scale``
  parameter the output is bit-identical.
* ``hk.RMSNorm``: Haiku computes ``x * scale * rsqrt(ms + eps)``; the
  tracked layer ``(x * rsqrt(ms + eps)) * scale`` (float rounding; the
  product in the scale's wider dtype, as Haiku's).
* ``hk.GroupNorm``: the same operations in the same order (bit-identical).
* ``hk.Bias``: the same operations (bit-identical); ``multiplier`` must be
  None or a static scalar.

A ``scale``/``offset`` passed at call time is an input, not a parameter of
the module: it is applied by ordinary JAX ops (exactly as in Haiku) and has
no Gram. A module with no parameter (``create_scale=create_offset=False``)
runs as plain Haiku, without a probe.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src.compat import haiku_compat as hkc
from gram_haiku._src.frontend.registry import register_layer
from gram_haiku._src.ops import affine as affine_op
from gram_haiku._src.ops.affine import static_multiplier


def _affine(call, x, scale, offset, offset_multiplier=None, coupled=None):
  """``x * scale + offset`` (parameters, either may be None) via the Gram op
  (``coupled``: see :meth:`gram_haiku.LayerCall.apply`)."""
  x = jnp.asarray(x)
  rule, scale, offset = affine_op.layer_rule(
      x, scale, offset, offset_multiplier, call.module.module_name)
  return call.apply(rule, x, (scale, offset), coupled=coupled)


def check_call_time_params(module, scale, offset):
  """Haiku's check: no call-time scale/offset where the module creates one."""
  if module.create_scale and scale is not None:
    raise ValueError(
        "Cannot pass `scale` at call time if `create_scale=True`.")
  if module.create_offset and offset is not None:
    raise ValueError(
        "Cannot pass `offset` at call time if `create_offset=True`.")


def _promoted(a, scale):
  """``a`` in the dtype of its product with ``scale``: Haiku multiplies the
  scale in before the normalised input is formed, so a wider scale (float32
  parameters, a bfloat16 input) promotes the normalisation's terms first;
  forming ``xhat`` in the input's dtype would round it (2^-9 in bfloat16),
  a model other than Haiku's."""
  return a.astype(jnp.result_type(a, scale))


def _param_shape(param_axis, inputs):
  """LayerNorm/RMSNorm: the stored shape of the scale and offset."""
  param_axis = hkc.to_abs_axes(param_axis, inputs.ndim)
  if param_axis == (inputs.ndim - 1,):
    # Haiku stores the non-broadcast shape for param_axis=-1.
    return (inputs.shape[-1],)
  return tuple((inputs.shape[i] if i in param_axis else 1)
               for i in range(inputs.ndim))


@register_layer(hk.LayerNorm)
def layer_norm(call, module: hk.LayerNorm, inputs, scale=None,
               offset=None):
  """``hk.LayerNorm.__call__`` (also ``hk.InstanceNorm``) with the Gram op."""
  inputs = jnp.asarray(inputs)
  check_call_time_params(module, scale, offset)

  axis = hkc.to_abs_axes(module.axis, inputs.ndim)
  mean = jnp.mean(inputs, axis=axis, keepdims=True)
  if module.use_fast_variance:
    mean_of_squares = jnp.mean(jnp.square(inputs), axis=axis, keepdims=True)
    variance = mean_of_squares - jnp.square(mean)
  else:
    variance = jnp.var(inputs, axis=axis, keepdims=True)

  if ((module.create_scale or module.create_offset) and
      not hkc.param_axis_passed_explicitly(module)):
    if (hkc.error_if_param_axis_not_explicit() and
        axis != (inputs.ndim - 1,)):
      raise ValueError("When axis is not the final dimension we require "
                       "you to also pass `param_axis` in the ctor."
                       f" axis={axis} ndim={inputs.ndim}")

  param_shape = _param_shape(module.param_axis, inputs)
  scale_p = offset_p = None
  if module.create_scale:
    scale_p = hk.get_parameter("scale", param_shape, inputs.dtype,
                               init=module.scale_init)
  elif scale is None:
    scale = np.array(1., dtype=inputs.dtype)
  if module.create_offset:
    offset_p = hk.get_parameter("offset", param_shape, inputs.dtype,
                                init=module.offset_init)
  elif offset is None:
    offset = np.array(0., dtype=inputs.dtype)

  if jax.config.jax_numpy_rank_promotion != "allow":
    # As Haiku: broadcast explicitly (the parameters are broadcast in the op).
    if scale is not None:
      scale = jnp.broadcast_to(scale, inputs.shape)
    if offset is not None:
      offset = jnp.broadcast_to(offset, inputs.shape)
    mean = jnp.broadcast_to(mean, inputs.shape)

  eps = jax.lax.convert_element_type(module.eps, variance.dtype)
  rinv = jax.lax.rsqrt(variance + eps)
  centred = inputs - mean
  if scale_p is None:
    xhat = (scale * rinv) * centred  # Haiku's `inv * (inputs - mean)`.
    if offset_p is None:
      return xhat + offset
    return _affine(call, xhat, None, offset_p)
  xhat = _promoted(rinv, scale_p) * _promoted(centred, scale_p)
  if offset_p is None:
    return _affine(call, xhat, scale_p, None) + offset
  return _affine(call, xhat, scale_p, offset_p)


@register_layer(hk.RMSNorm)
def rms_norm(call, module: hk.RMSNorm, inputs):
  """``hk.RMSNorm.__call__`` with the Gram op for its scale."""
  inputs = jnp.asarray(inputs)
  axis = module.axis
  if isinstance(axis, slice):
    axis = tuple(range(inputs.ndim)[axis])
  param_shape = _param_shape(module.param_axis, inputs)
  scale = None
  if module.create_scale:
    scale = hk.get_parameter("scale", param_shape, inputs.dtype,
                             init=module.scale_init)
  mean_squared = jnp.mean(jnp.square(inputs), axis=axis, keepdims=True)
  mean_squared = jnp.broadcast_to(mean_squared, inputs.shape)
  rinv = jax.lax.rsqrt(mean_squared + module.eps)
  if scale is None:
    return inputs * 1. * rinv  # Exactly Haiku's.
  return _affine(call, _promoted(inputs, scale) * _promoted(rinv, scale),
                 scale, None)


@register_layer(hk.GroupNorm)
def group_norm(call, module: hk.GroupNorm, x, scale=None, offset=None):
  """``hk.GroupNorm.__call__`` with the Gram op for its scale and offset."""
  if module.rank is not None and x.ndim != module.rank:
    raise ValueError(
        "The rank of the inputs cannot change between calls, the"
        f" original call was rank={module.rank} but this call was "
        f"rank={x.ndim}.")
  check_call_time_params(module, scale, offset)

  channels = x.shape[module.channel_index]
  if channels % module.groups != 0:
    raise ValueError(
        "The number of channels must be divisible by the number of groups, "
        f"was channels={channels}, groups={module.groups}")
  if module.rank is None:
    hkc.initialize_group_norm(module, x, channels)

  dtype = x.dtype
  if module.channel_index == -1:
    params_shape = (x.shape[-1],)
  else:
    assert module.channel_index == 1
    params_shape = (x.shape[1],) + (1,) * (module.rank - 2)
  scale_p = offset_p = None
  if module.create_scale:
    scale_p = hk.get_parameter("scale", params_shape, dtype,
                               module.scale_init)
  if module.create_offset:
    offset_p = hk.get_parameter("offset", params_shape, dtype,
                                module.offset_init)

  x = x.reshape(module.group_shape)
  mean = jnp.mean(x, module.axis, keepdims=True)
  var = jnp.var(x, module.axis, keepdims=True)
  x = (x - mean) * jax.lax.rsqrt(var + module.eps)
  x = x.reshape(module.first_input_shape)

  if scale is not None:  # Given at call time: an input, not a parameter.
    x = x * jax.lax.broadcast_to_rank(scale, x.ndim)
  if scale_p is not None or offset_p is not None:
    x = _affine(call, x, scale_p, offset_p)
  if offset is not None:
    x = x + jax.lax.broadcast_to_rank(offset, x.ndim)
  return x


@register_layer(hk.Bias)
def bias(call, module: hk.Bias, inputs, multiplier=None):
  """``hk.Bias.__call__`` with the Gram op (``multiplier`` a static scalar)."""
  hkc.assert_minimum_rank(inputs, 2)
  if module.output_size is not None and module.output_size != inputs.shape[1:]:
    raise ValueError(
        f"Input shape must be {(-1,) + tuple(module.output_size)} not"
        f" {inputs.shape}"
    )
  multiplier = static_multiplier(multiplier)
  module.bias_shape = hkc.calculate_bias_shape(inputs.shape,
                                                   module.bias_dims)
  module.input_size = inputs.shape[1:]
  b = hk.get_parameter("b", module.bias_shape, inputs.dtype,
                       init=module.b_init)
  return _affine(call, inputs, None, b, offset_multiplier=multiplier)
