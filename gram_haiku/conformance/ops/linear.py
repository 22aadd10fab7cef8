"""``gram_linear`` (``hk.Linear``), with and without bias."""

import jax
import jax.numpy as jnp

from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec
from gram_haiku.conformance.registry import register
from gram_haiku.ops import gram_linear

_N, _M = 5, 3


def _linear_params(with_bias):
  def make(key, dtype):
    k1, k2 = jax.random.split(key)
    p = {"w": normal(k1, (_N, _M), dtype)}
    if with_bias:
      p["b"] = normal(k2, (_M,), dtype)
    return p
  return make


def _linear_plain(p, x):
  out = jnp.dot(x, p["w"])
  if "b" in p:
    out = out + p["b"]
  return out


for _bias in (True, False):
  register(OpSpec(
      name="linear" if _bias else "linear_nobias",
      make_params=_linear_params(_bias),
      make_example=lambda key, lead, dtype: normal(key, lead + (_N,), dtype),
      apply=lambda p, probe, x, **kw: gram_linear(x, p["w"], p.get("b"),
                                                  probe, **kw),
      plain=_linear_plain))
