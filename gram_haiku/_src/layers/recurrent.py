"""``hk.GRU`` inside ``track()``: one exact Gram op per step.

``hk.GRU`` reads its weights with bare ``hk.get_parameter`` and slices
``w_h`` and ``b`` into two matmuls each, so it has no ``hk.Linear`` for
``track()`` to intercept. The handler re-creates its parameters exactly and
runs the whole cell as one :class:`~gram_haiku._src.rules.rule.Rule` that is
only a ``forward`` (exact per-example gradients of ``w_i``, ``w_h`` and
``b`` by the rule's default; inside ``hk.dynamic_unroll`` each step keeps
its factors in a slot, and the per-example gradients are formed once after
the pass, see :mod:`gram_haiku._src.passes.slots`). ``hk.LSTM`` and
``hk.VanillaRNN`` need no handler: they are made of ``hk.Linear``.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp

from gram_haiku._src.compute import explicit_mesh
from gram_haiku._src.frontend.registry import register_layer
from gram_haiku._src.rules.rule import Rule


def gru_cell(xh, w_i, w_h, b, *, input_size: int, hidden_size: int,
             dtypes=None):
  """The GRU update of ``hk.GRU`` on ``xh = concat([inputs, state], -1)``.

  ``dtypes``: ``(inputs dtype, state dtype)``, when ``xh`` concatenates
  them in the wider one: each part is cast back first (a no-op where they
  agree), so that every product runs in the dtypes ``hk.GRU`` gives it."""
  x, h = xh[..., :input_size], xh[..., input_size:]
  if dtypes is not None:
    x, h = x.astype(dtypes[0]), h.astype(dtypes[1])
  n2 = 2 * hidden_size
  gx = jnp.matmul(x, w_i)
  zr = gx[..., :n2] + jnp.matmul(h, w_h[:, :n2])
  zr = zr + jnp.broadcast_to(b[:n2], zr.shape)
  z, r = jnp.split(jax.nn.sigmoid(zr), 2, axis=-1)
  ah = jnp.matmul(r * h, w_h[:, n2:])
  a = jnp.tanh(gx[..., n2:] + ah + jnp.broadcast_to(b[n2:], ah.shape))
  return (1 - z) * h + z * a


@register_layer(hk.GRU)
def gru(call, module: hk.GRU, inputs, state):
  """``hk.GRU.__call__`` as one Gram op (same parameters, same update)."""
  inputs = jnp.asarray(inputs)
  state = jnp.asarray(state)
  if inputs.ndim not in (1, 2):
    raise ValueError("GRU input must be rank-1 or rank-2.")
  input_size = inputs.shape[-1]
  hidden = module.hidden_size
  w_i = hk.get_parameter("w_i", [input_size, 3 * hidden], inputs.dtype,
                         init=module.w_i_init)
  w_h = hk.get_parameter("w_h", [hidden, 3 * hidden], inputs.dtype,
                         init=module.w_h_init)
  b = hk.get_parameter("b", [3 * hidden], inputs.dtype, init=module.b_init)
  # hk.GRU multiplies the state in its own dtype (a float32 state with
  # bfloat16 inputs gives a float32 output): both are concatenated in the
  # wider dtype, which holds each exactly, and cast back in the cell.
  wide = jnp.result_type(inputs.dtype, state.dtype)
  # Under a mesh with Explicit axes the state (a replicated initial state)
  # may be laid out unlike the inputs (rows over the examples' axis), and
  # a concatenation needs one layout: the state takes the inputs' rows, as
  # hk.GRU's sum of the two products does.
  if inputs.ndim == state.ndim:
    state = explicit_mesh.reshard_like(
        state, explicit_mesh.rows_sharding(inputs, state.ndim))
  xh = jnp.concatenate([inputs.astype(wide), state.astype(wide)], axis=-1)
  dtypes = (inputs.dtype, state.dtype)
  rule = Rule(forward=functools.partial(gru_cell, input_size=input_size,
                                        hidden_size=hidden, dtypes=dtypes),
              param_names=("w_i", "w_h", "b"), feature_ndim=1)
  out = call.apply(rule, xh, (w_i, w_h, b))
  return out, out
