"""``gram_conv`` and ``gram_conv_transpose`` (``hk.ConvND[Transpose]``).

Each op's ``plain`` is an independent untracked computation: plain
``lax.conv_general_dilated`` / ``lax.conv_transpose`` with Haiku's dimension
numbers on the flattened leading axes. Mixed dtypes are promoted as the op
does (Haiku itself always creates ``w`` in the input's dtype).
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src.ops.conv import dimension_numbers
from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec
from gram_haiku.conformance.registry import register
from gram_haiku.ops import gram_conv
from gram_haiku.ops import gram_conv_transpose

# name -> configuration. ``spatial``: one example's spatial shape; ``c``/``o``:
# input/output channels; ``kernel``: kernel spatial shape.
_CONFIGS = {
    "conv1d": dict(spatial=(5,), c=2, o=3, kernel=(3,)),
    "conv1d_ncw_valid_dilated_nobias": dict(
        spatial=(7,), c=2, o=2, kernel=(2,), rate=2, padding="VALID",
        channels_last=False, bias=False),
    "conv2d_strided_grouped": dict(
        spatial=(5, 4), c=4, o=4, kernel=(3, 2), stride=2, groups=2),
    "conv2d_nchw_explicit_padding": dict(
        spatial=(4, 4), c=3, o=3, kernel=(2, 3), stride=(1, 2),
        padding=((1, 0), (2, 1)), channels_last=False, groups=3),
    "conv2d_transpose": dict(
        spatial=(3, 2), c=2, o=2, kernel=(2, 3), stride=2, padding="VALID",
        transpose=True),
    "conv3d_transpose_ncdhw_nobias": dict(
        spatial=(2, 2, 2), c=2, o=2, kernel=(2, 2, 2), stride=(2, 1, 2),
        transpose=True, bias=False, channels_last=False),
}


def _full(cfg):
  out = dict(stride=1, rate=1, padding="SAME", groups=1, channels_last=True,
             bias=True, transpose=False)
  out.update(cfg)
  return out


def _params(cfg, key, dtype):
  k1, k2 = jax.random.split(key)
  n = len(cfg["spatial"])
  if cfg["transpose"]:
    w_shape = cfg["kernel"] + (cfg["o"], cfg["c"])
  else:
    w_shape = cfg["kernel"] + (cfg["c"] // cfg["groups"], cfg["o"])
  fan_in = math.prod(w_shape[:-1])
  p = {"w": (normal(k1, w_shape, jnp.float32) / math.sqrt(fan_in)
             ).astype(dtype)}
  if cfg["bias"]:
    b_shape = (cfg["o"],) if cfg["channels_last"] else (cfg["o"],) + (1,) * n
    p["b"] = normal(k2, b_shape, dtype)
  return p


def _example_shape(cfg):
  sp = cfg["spatial"]
  return sp + (cfg["c"],) if cfg["channels_last"] else (cfg["c"],) + sp


def _plain(cfg):
  n = len(cfg["spatial"])
  dn = dimension_numbers(n, cfg["channels_last"], cfg["transpose"])
  tup = lambda v: (v,) * n if isinstance(v, int) else tuple(v)

  def plain(p, x):
    lead = x.shape[:x.ndim - n - 1]
    xb = x.reshape((math.prod(lead),) + x.shape[len(lead):])
    w = p["w"]
    dtype = jnp.promote_types(xb.dtype, w.dtype)
    xb, w = xb.astype(dtype), w.astype(dtype)
    if cfg["transpose"]:
      out = lax.conv_transpose(xb, w, tup(cfg["stride"]), cfg["padding"],
                               dimension_numbers=dn)
    else:
      out = lax.conv_general_dilated(
          xb, w, tup(cfg["stride"]), cfg["padding"],
          rhs_dilation=tup(cfg["rate"]), dimension_numbers=dn,
          feature_group_count=cfg["groups"])
    if "b" in p:
      out = out + p["b"]
    return out.reshape(lead + out.shape[1:])
  return plain


def _apply(cfg):
  data_format = "channels_last" if cfg["channels_last"] else "channels_first"

  def apply(p, probe, x, **kw):
    if cfg["transpose"]:
      return gram_conv_transpose(x, p["w"], p.get("b"), probe,
                                 stride=cfg["stride"], padding=cfg["padding"],
                                 data_format=data_format, **kw)
    return gram_conv(x, p["w"], p.get("b"), probe, stride=cfg["stride"],
                     padding=cfg["padding"], rate=cfg["rate"],
                     feature_group_count=cfg["groups"],
                     data_format=data_format, **kw)
  return apply


def _register(name, cfg):
  cfg = _full(cfg)
  shape = _example_shape(cfg)
  register(OpSpec(
      name=name,
      make_params=lambda key, dtype: _params(cfg, key, dtype),
      make_example=lambda key, lead, dtype: normal(key, tuple(lead) + shape,
                                                   dtype),
      apply=_apply(cfg),
      plain=_plain(cfg)))


for _name, _cfg in _CONFIGS.items():
  _register(_name, _cfg)
