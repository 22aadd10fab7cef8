"""``gram_affine``: the learnable part of ``hk.LayerNorm``/``RMSNorm``/
``GroupNorm``/``InstanceNorm`` (``xhat * scale + offset``) and ``hk.Bias``.

The op takes the already normalised input, so its conformance is that of the
elementwise affine map; ``plain`` is ``x * scale + offset * multiplier``,
the parameters broadcast over ``x``'s trailing axes. Configurations: per-channel scale and offset (the
norms), scale only (``RMSNorm``), a parameter stored at full rank with
leading size-1 axes (``LayerNorm(param_axis=...)``, ``BatchNorm``) and a
broadcast axis, and a scalar bias with a multiplier (``hk.Bias(bias_dims=[])``
called with ``multiplier=-1``).
"""

import jax

from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec
from gram_haiku.conformance.registry import register
from gram_haiku.ops import gram_affine

# name -> (feature shape of one application, scale shape, offset shape,
# offset multiplier).
_CONFIGS = {
    "affine_scale_offset": ((4,), (4,), (4,), None),
    "affine_scale": ((4,), (4,), None, None),
    "affine_full_rank_broadcast": ((3, 2), (1, 3, 1), (1, 3, 2), None),
    "bias_scalar_times": ((4,), None, (), -1),
}


def _make_params(s_shape, o_shape):
  def make(key, dtype):
    k1, k2 = jax.random.split(key)
    p = {}
    if s_shape is not None:
      p["scale"] = normal(k1, s_shape, dtype)
    if o_shape is not None:
      p["offset"] = normal(k2, o_shape, dtype)
    return p
  return make


def _trailing(p):
  """``p`` without its leading size-1 axes: it broadcasts over ``x``'s
  trailing axes only, so one application keeps its shape (as the op)."""
  shape = list(p.shape)
  while shape and shape[0] == 1:
    shape.pop(0)
  return p.reshape(shape)


def _plain(mult):
  def plain(p, x):
    out = x
    if "scale" in p:
      out = out * _trailing(p["scale"])
    if "offset" in p:
      offset = _trailing(p["offset"])
      out = out + (offset if mult is None else offset * mult)
    return out
  return plain


def _apply(name, mult):
  def apply(p, probe, x, **kw):
    return gram_affine(x, p.get("scale"), p.get("offset"), probe,
                       offset_multiplier=mult, name=name, **kw)
  return apply


for _name, (_feat, _s, _o, _mult) in _CONFIGS.items():
  register(OpSpec(
      name=_name,
      make_params=_make_params(_s, _o),
      make_example=(lambda feat: lambda key, lead, dtype: normal(
          key, tuple(lead) + feat, dtype))(_feat),
      apply=_apply(_name, _mult),
      plain=_plain(_mult)))
