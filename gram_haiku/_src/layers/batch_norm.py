"""``hk.BatchNorm`` inside ``track()``.

In training mode (``is_training=True``, or ``test_local_stats=True``) batch
norm normalises each example with statistics of the whole batch, so every
example's loss depends on every other example: the per-example gradient
(the gradient of example ``i``'s loss with the others held fixed) is not
what the batch gradient decomposes into, and no Gram of per-example
gradients exists. Asking for one is an error, never a number:
:func:`gram_haiku.value_grad_and_gram` and the reweighting functions refuse
the layer as they trace it, and on the raw ``jax.grad`` path its op carries
the refusal, raised if its probe is differentiated. Everything else runs
as plain Haiku does: the forward pass with batch statistics (``pmean``
over ``cross_replica_axis``), the moving averages' updates, inference,
``jax.grad`` of the loss with respect to the parameters, under ``jit``,
``hk.scan``, ``hk.remat`` or ``jax.eval_shape``.

In evaluation mode the moving averages are constants, so the layer is an
affine map of each example: ``xhat = (x - mean) * rsqrt(var + eps)`` by
ordinary ops, then ``xhat * scale + offset`` through the Gram op (Haiku
computes ``(x - mean) * (scale * rsqrt(var + eps)) + offset``: equal up to
float rounding; so in training mode).
"""

import haiku as hk
import jax
import jax.numpy as jnp

from gram_haiku._src.core import errors
from gram_haiku._src.frontend.registry import register_layer
from gram_haiku._src.layers.norms import _affine
from gram_haiku._src.layers.norms import check_call_time_params


@register_layer(hk.BatchNorm)
def batch_norm(call, module: hk.BatchNorm, inputs, is_training,
               test_local_stats=False, scale=None, offset=None):
  """``hk.BatchNorm.__call__`` with the Gram op (refused where the batch
  statistics couple the examples)."""
  local_stats = is_training or test_local_stats
  coupled = None
  if local_stats:
    coupled = errors.BATCHNORM_TRAINING.format(
        module=module.module_name, is_training=is_training,
        test_local_stats=test_local_stats)
    call.check_coupled(coupled)
  check_call_time_params(module, scale, offset)
  channel_index = module.channel_index
  if channel_index < 0:
    channel_index += inputs.ndim
  if module.axis is not None:
    axis = module.axis
  else:
    axis = [i for i in range(inputs.ndim) if i != channel_index]
  if local_stats:  # Batch statistics, as Haiku computes them.
    mean = jnp.mean(inputs, axis, keepdims=True)
    mean_of_squares = jnp.mean(jnp.square(inputs), axis, keepdims=True)
    if module.cross_replica_axis:
      mean = jax.lax.pmean(
          mean, axis_name=module.cross_replica_axis,
          axis_index_groups=module.cross_replica_axis_index_groups)
      mean_of_squares = jax.lax.pmean(
          mean_of_squares, axis_name=module.cross_replica_axis,
          axis_index_groups=module.cross_replica_axis_index_groups)
    var = mean_of_squares - jnp.square(mean)
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
    out = _affine(call, xhat, scale_param, offset_param, coupled=coupled)
  if offset is not None:
    out = out + offset
  return out
