"""``hk.BatchNorm`` inside ``track()``.

In training mode (``is_training=True``, or ``test_local_stats=True``) batch
norm normalises each example with statistics of the whole batch, so every
example's loss depends on every other example: the per-example gradient
(the gradient of example ``i``'s loss with the others held fixed) is not
what the batch gradient decomposes into, and no Gram of per-example
gradients exists. That is an error, never a number (at ``init``, where
nothing is differentiated, it runs with batch statistics as Haiku does, so
that parameters, moving averages and the probe get created).

In evaluation mode the moving averages are constants, so the layer is an
affine map of each example: ``xhat = (x - mean) * rsqrt(var + eps)`` by
ordinary ops, then ``xhat * scale + offset`` through the Gram op (Haiku
computes ``(x - mean) * (scale * rsqrt(var + eps)) + offset``: equal up to
float rounding).
"""

import haiku as hk
import jax
import jax.numpy as jnp

from gram_haiku._src import errors
from gram_haiku._src.layers.norms import _affine
from gram_haiku._src.layers.norms import check_call_time_params
from gram_haiku._src.registry import register_layer


@register_layer(hk.BatchNorm)
def batch_norm(call, module: hk.BatchNorm, inputs, is_training,
               test_local_stats=False, scale=None, offset=None):
  """``hk.BatchNorm.__call__`` in evaluation mode, with the Gram op."""
  local_stats = is_training or test_local_stats
  if local_stats and not hk.running_init():
    raise ValueError(errors.BATCHNORM_TRAINING.format(
        module=module.module_name, is_training=is_training,
        test_local_stats=test_local_stats))
  check_call_time_params(module, scale, offset)
  channel_index = module.channel_index
  if channel_index < 0:
    channel_index += inputs.ndim
  if module.axis is not None:
    axis = module.axis
  else:
    axis = [i for i in range(inputs.ndim) if i != channel_index]
  if local_stats:  # init only: batch statistics, as Haiku computes them.
    mean = jnp.mean(inputs, axis, keepdims=True)
    var = jnp.mean(jnp.square(inputs), axis, keepdims=True) - jnp.square(mean)
    if is_training:
      module.mean_ema(mean)
      module.var_ema(var)
  else:
    mean = module.mean_ema.average.astype(inputs.dtype)
    var = module.var_ema.average.astype(inputs.dtype)
  w_shape = [1 if i in axis else inputs.shape[i] for i in range(inputs.ndim)]
  dtype = inputs.dtype
  scale_param = offset_param = None
  if module.create_scale:
    scale_param = hk.get_parameter("scale", w_shape, dtype, module.scale_init)
  if module.create_offset:
    offset_param = hk.get_parameter("offset", w_shape, dtype,
                                    module.offset_init)
  eps = jax.lax.convert_element_type(module.eps, var.dtype)
  xhat = (inputs - mean) * jax.lax.rsqrt(var + eps)
  if scale is not None:  # A call-time input: no Gram, plain ops.
    xhat = xhat * scale
  if scale_param is None and offset_param is None:
    out = xhat
  else:
    out = _affine(call, xhat, scale_param, offset_param)
  if offset is not None:
    out = out + offset
  return out
