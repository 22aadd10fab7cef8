"""``hk.Conv{1,2,3}D``, ``hk.Conv{1,2,3}DTranspose`` and
``hk.DepthwiseConv{1,2,3}D`` inside ``track()``.

``hk.Conv1D/2D/3D`` inherit ``__call__`` from ``hk.ConvND`` and the
transposed ones from ``hk.ConvNDTranspose``; ``hk.intercept_methods`` reports
the class that *defines* the method (``context.orig_class``), so the handlers
are registered on the two base classes (and, harmlessly, on the subclasses,
in case a Haiku release defines ``__call__`` there). Each handler re-creates
the parameters exactly as the module's ``__call__`` does (names ``w``/``b``,
shapes, dtypes, initialisers, creation order) and runs the Gram op.

A weight ``mask`` is applied as Haiku applies it, ``w * mask`` before the
convolution: the op then receives a function of the parameter, so the
parameter's per-example gradients are pulled back through it
(:mod:`gram_haiku._src.analysis.reparam`: ``mask * dl_i / d(w * mask)``, exact, at
``B x P`` memory for the layer).
"""

import haiku as hk
import jax.numpy as jnp
import numpy as np

from gram_haiku._src.compat import haiku_compat as hkc
from gram_haiku._src.frontend.registry import register_layer
from gram_haiku._src.ops import conv as conv_op

DEPTHWISE_BIAS = (
    "gram_haiku.track(): module {module!r} ({cls}) has a bias with "
    "data_format={data_format!r}. Haiku gives the bias the shape [O, 1, 1] "
    "for every rank, so with the channels first in {n}-D it broadcasts "
    "along a spatial axis instead of over the channels (a Haiku quirk), "
    "which the Gram rule does not model.\n"
    "What to do: use a channels-last data_format, or with_bias=False and "
    "an hk.Bias after the convolution.")


def _check_rank(module, inputs, what):
  unbatched_rank = module.num_spatial_dims + 1
  allowed_ranks = [unbatched_rank, unbatched_rank + 1]
  if inputs.ndim not in allowed_ranks:
    raise ValueError(f"Input to {what} needs to have rank in {allowed_ranks},"
                     f" but input has shape {inputs.shape}.")


def _channel_axis(module, inputs) -> int:
  """The channel axis of ``inputs``, batched or not (Haiku's rule)."""
  if module.channel_index == -1:
    return inputs.ndim - 1
  return inputs.ndim - module.num_spatial_dims - 1


def _bias(module, dtype):
  if not module.with_bias:
    return None
  if module.channel_index == -1:
    bias_shape = (module.output_channels,)
  else:
    bias_shape = (module.output_channels,) + (1,) * module.num_spatial_dims
  return hk.get_parameter("b", bias_shape, dtype, init=module.b_init)


def _default_w_init(fan_in_shape):
  """Haiku's default kernel initialiser for a fan-in of that shape."""
  return hk.initializers.TruncatedNormal(
      stddev=1. / np.sqrt(np.prod(fan_in_shape)))


def _masked(module, w):
  """``w * module.mask`` as the module's ``__call__`` computes it."""
  if module.mask is None:
    return w
  if module.mask.shape != w.shape:
    raise ValueError("Mask needs to have the same shape as weights. "
                     f"Shapes are: {module.mask.shape}, {w.shape}")
  return w * module.mask


@register_layer(hk.ConvND)
def conv_nd(call, module: hk.ConvND, inputs, *, precision=None):
  """``hk.ConvND.__call__`` with the convolution's rule (same parameters)."""
  inputs = jnp.asarray(inputs)
  _check_rank(module, inputs, "ConvND")
  channels = inputs.shape[_channel_axis(module, inputs)]
  groups = module.feature_group_count
  if channels % groups != 0:
    raise ValueError(f"Inputs channels {channels} should be a multiple of "
                     f"feature_group_count {groups}")
  w_shape = tuple(module.kernel_shape) + (channels // groups,
                                          module.output_channels)
  w_init = (_default_w_init(w_shape[:-1]) if module.w_init is None
            else module.w_init)
  w = _masked(module, hk.get_parameter("w", w_shape, inputs.dtype,
                                      init=w_init))
  b = _bias(module, inputs.dtype)
  rule = conv_op.layer_rule(
      w.shape, transpose=False, stride=module.stride, padding=module.padding,
      rate=module.kernel_dilation, feature_group_count=groups,
      data_format=module.data_format, precision=precision,
      name=module.module_name)
  return call.apply(rule, inputs, (w, b))


@register_layer(hk.ConvNDTranspose)
def conv_nd_transpose(call, module: hk.ConvNDTranspose, inputs, *,
                      precision=None):
  """``hk.ConvNDTranspose.__call__`` with the transposed convolution's
  rule."""
  inputs = jnp.asarray(inputs)
  _check_rank(module, inputs, "ConvNDTranspose")
  channel_axis = _channel_axis(module, inputs)
  input_channels = inputs.shape[channel_axis]
  w_shape = tuple(module.kernel_shape) + (module.output_channels,
                                          input_channels)
  w_init = (_default_w_init(tuple(module.kernel_shape) + (input_channels,))
            if module.w_init is None else module.w_init)
  w = _masked(module, hk.get_parameter("w", w_shape, inputs.dtype,
                                      init=w_init))

  padding = module.padding
  if module.output_shape is not None:
    n = module.num_spatial_dims
    if module.channel_index == -1:
      input_shape = inputs.shape[inputs.ndim - n - 1:-1]
    else:
      input_shape = inputs.shape[inputs.ndim - n:]
    padding = tuple(map(
        lambda i, o, k, s: hkc.compute_adjusted_padding(i, o, k, s,
                                                        module.padding),
        input_shape, module.output_shape, module.kernel_shape, module.stride))
  b = _bias(module, inputs.dtype)
  rule = conv_op.layer_rule(
      w.shape, transpose=True, stride=module.stride, padding=padding, rate=1,
      feature_group_count=1, data_format=module.data_format,
      precision=precision, name=module.module_name)
  return call.apply(rule, inputs, (w, b))


def depthwise_conv(call, module, inputs):
  """``hk.DepthwiseConv{1,2,3}D.__call__`` with the convolution's rule: one
  feature group per input channel, ``channel_multiplier`` outputs each
  (same parameters, same convolution)."""
  inputs = jnp.asarray(inputs)
  channel_index = hk.get_channel_index(module.data_format)
  channels = inputs.shape[channel_index]
  w_shape = tuple(module.kernel_shape) + (
      1, module.channel_multiplier * channels)
  w_init = (_default_w_init(w_shape[:-1]) if module.w_init is None
            else module.w_init)
  w = hk.get_parameter("w", w_shape, inputs.dtype, init=w_init)
  b = None
  if module.with_bias:
    n = len(module.kernel_shape)
    if channel_index != -1 and n != 2:
      # Haiku's bias is [O, 1, 1] whatever the rank: channels first in 1-D
      # or 3-D, it broadcasts along a spatial axis, not the channels.
      raise NotImplementedError(DEPTHWISE_BIAS.format(
          module=module.module_name, cls=type(module).__name__, n=n,
          data_format=module.data_format))
    b_shape = ((module.channel_multiplier * channels,) if channel_index == -1
               else (module.channel_multiplier * channels, 1, 1))
    b = hk.get_parameter("b", b_shape, inputs.dtype, init=module.b_init)
  rule = conv_op.layer_rule(
      w.shape, transpose=False, stride=module.stride, padding=module.padding,
      rate=module.rhs_dilation, feature_group_count=channels,
      data_format=module.data_format, precision=None,
      name=module.module_name)
  return call.apply(rule, inputs, (w, b))


for _cls in (hk.DepthwiseConv1D, hk.DepthwiseConv2D, hk.DepthwiseConv3D):
  register_layer(_cls)(depthwise_conv)
for _cls in (hk.Conv1D, hk.Conv2D, hk.Conv3D):
  register_layer(_cls)(conv_nd)
for _cls in (hk.Conv1DTranspose, hk.Conv2DTranspose, hk.Conv3DTranspose):
  register_layer(_cls)(conv_nd_transpose)
