"""``hk.Linear`` inside ``track()``: the same parameters, the Gram op."""

import haiku as hk
import jax.numpy as jnp
import numpy as np

from gram_haiku._src.frontend.registry import register_layer
from gram_haiku._src.ops.linear import linear_rule


@register_layer(hk.Linear)
def linear(call, module: hk.Linear, inputs, *, precision=None):
  """``hk.Linear.__call__`` with its rule (same parameters)."""
  if not inputs.shape:
    raise ValueError("Input must not be scalar.")
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
    b = hk.get_parameter("b", [module.output_size], dtype, init=module.b_init)
  return call.apply(linear_rule(precision), inputs, (w, b))
