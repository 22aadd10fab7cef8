"""Ops given as a bare :class:`gram_haiku.Rule` (``OpSpec.from_rule``): the
GRU cell (``hk.GRU``) and the tied output layer (``gram_haiku.unembed``),
both with the rule defaults' exact per-example gradients."""

import functools

import jax
import jax.numpy as jnp

from gram_haiku import Rule
from gram_haiku._src.layers.recurrent import gru_cell
from gram_haiku._src.layers.tied import _unembed
from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec
from gram_haiku.conformance.registry import register

_IN, _HID, _V = 3, 4, 6


def _gru_params(key, dtype):
  k = jax.random.split(key, 3)
  return {"w_i": normal(k[0], (_IN, 3 * _HID), dtype),
          "w_h": normal(k[1], (_HID, 3 * _HID), dtype),
          "b": normal(k[2], (3 * _HID,), dtype)}


_GRU = Rule(forward=functools.partial(gru_cell, input_size=_IN,
                                      hidden_size=_HID),
            param_names=("w_i", "w_h", "b"), feature_ndim=1)

register(OpSpec.from_rule(
    _GRU, name="gru_cell", make_params=_gru_params,
    make_example=lambda key, lead, dtype: normal(key, lead + (_IN + _HID,),
                                                 dtype)))

_UNEMBED = Rule(forward=functools.partial(_unembed, precision=None),
                param_names=("embeddings",), feature_ndim=1)

register(OpSpec.from_rule(
    _UNEMBED, name="unembed",
    make_params=lambda key, dtype: {"embeddings": normal(key, (_V, _HID),
                                                         dtype)},
    make_example=lambda key, lead, dtype: normal(key, lead + (_HID,), dtype),
    plain=lambda p, x: jnp.dot(x, p["embeddings"].T)))
