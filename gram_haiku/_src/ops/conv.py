"""N-d convolutions (``hk.ConvND``, ``hk.ConvNDTranspose``) as Gram primitives.

The forward pass is exactly the Haiku module's: ``lax.conv_general_dilated``
with Haiku's dimension numbers (for a transposed conv, the very call that
``lax.conv_transpose`` makes), then the bias.
The probe's cotangent is the per-example gradient Gram of ``w`` and ``b`` (or
its diagonal, or the per-example gradients; see
:mod:`gram_haiku._src.ops.op`). The rule (:func:`conv_rule`) is pure
functions of arrays and a static :class:`ConvSpec`; :func:`gram_conv` and
:func:`gram_conv_transpose` bind it as a Gram op.

**Math.** A convolution is a linear layer applied to *im2col patches*. With kernel
spatial shape ``K`` (``nK = prod(K)`` taps), ``C`` input and ``O`` output
channels, stride ``s``, kernel dilation (rate) ``r``, input (lhs) dilation
``l`` and padding, the patch of output position ``p`` is::

    X~[i, p, (k, c)] = pad(dilate_l(x_i))[s * p + r * k, c]

(:func:`im2col` builds it from strided slices, one per tap, concatenated
along the channels: features ordered tap-major ``(k, c)``), and the output
is ``y[i, p, o] = sum_{k,c} X~[i, p, (k, c)] W[k, c, o] + b[o]``. With
``F`` feature groups (``C = F Cg``, ``O = F Og``) output channel ``o`` of
group ``f`` only reads input channels of group ``f``: the patch features
``(k, f, cg)`` are regrouped as ``(f, (k, cg))``, so group ``f``'s
weight ``W_f: [nK Cg, Og]`` is a linear layer on ``X~_f`` with output
cotangent ``D_f = dL/dy[..., f Og:(f+1) Og]``, applied at every output
position and every within-example axis ``t``. The per-example gradients are
``g_if = sum_{t,p} X~_f[i,t,p]^T D_f[i,t,p]`` and ``g_ib = sum_{t,p}
D[i,t,p]``, and::

    G[i, j] = sum_f sum_{(t,p),(t',p')} (X~_f[i,t,p] . X~_f[j,t',p'])
                                         (D_f[i,t,p] . D_f[j,t',p'])
              + D_b[i] . D_b[j],       D_b[i] = sum_{t,p} D[i,t,p]

which is :func:`kernels.linear_gram` per group (ghost or materialised),
summed over groups, plus the bias term. The Gram is invariant to any
permutation of the kernel's entries, so only the grouping of patch features
matters, not their order relative to the kernel layout.

**Transposed convolution.** ``lax.conv_transpose`` (``transpose_kernel=False``,
as Haiku calls it) *is* ``conv_general_dilated`` with unit window strides,
input dilation ``l = stride`` and explicit padding (for ``"SAME"``/``"VALID"``
the padding of ``lax``'s ``_conv_transpose_padding``; explicit pairs are the
padding of the dilated input). Its weight ``[K..., O, C]`` is read with
Haiku's transposed dimension numbers (out-feature axis ``O``), so the same
patch formula applies with those arguments, one feature group. The op's
forward pass makes that ``conv_general_dilated`` call itself, so the patches
are built from exactly the arguments the output was computed with.

Cost (``B`` examples, ``T`` within-example positions including output
positions, ``Cg nK`` patch features and ``Og`` outputs per group): the
patches take ``B T C nK`` memory (im2col; the materialised method forms
them a block of examples at a time, no larger than the layer's input, see
:func:`gram_haiku._src.compute.cost_model.patch_block`); ghost ~``F B^2 T^2 (Cg nK +
Og)`` multiply-adds in row blocks bounded by the plan's memory budget;
materialised ~``B T C nK Og + B^2 C nK Og`` with ``B x P`` memory. ``"auto"``
picks the cheaper by :func:`gram_haiku._src.compute.cost_model.conv_method`. The diagonal
(``mode="norms"``) costs ~``B T^2 (C nK + O)`` (ghost) or ``B T C nK Og``.

Sources: Goodfellow (2015), "Efficient per-example gradient computations";
Rochette, Manoel & Tramel (2019), "Efficient per-example gradient computations
in convolutional neural networks" (per-example conv gradients from patches);
Bu et al. (2022), "Scalable and efficient training of large convolutional
neural networks with differential privacy" (ghost norms of convolutions via
unfolded inputs, and the ghost/materialise choice per layer).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from typing import Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import explicit_mesh
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute.example_axis import ExampleAxis
from gram_haiku._src.compute.example_axis import ExampleAxisSpec
from gram_haiku._src.compute.kernels import KernelConfig
from gram_haiku._src.compute.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.compute.plan import Plan
from gram_haiku._src.ops import op as op_lib
from gram_haiku._src.rules import rule as rule_lib
from gram_haiku._src.rules.rule import Rule

Padding = Union[str, Sequence[tuple[int, int]]]

_CHANNELS_FIRST = re.compile(r"^NC[^C]*$")
_CHANNELS_LAST = re.compile(r"^N[^C]*C$")


def channels_last_of(data_format: str) -> bool:
  """Haiku's data-format rule: ``channels_last``/``N...C`` or
  ``channels_first``/``NC...``."""
  if data_format == "channels_last" or _CHANNELS_LAST.match(data_format):
    return True
  if data_format == "channels_first" or _CHANNELS_FIRST.match(data_format):
    return False
  raise ValueError(
      f"Unrecognised data_format={data_format!r}: expected 'channels_last', "
      "'channels_first', 'N...C' or 'NC...'.")


def dimension_numbers(n: int, channels_last: bool,
                      transpose: bool) -> lax.ConvDimensionNumbers:
  """Haiku's dimension numbers (``haiku._src.conv.to_dimension_numbers``)."""
  nd = n + 2
  if channels_last:
    image = (0, nd - 1) + tuple(range(1, nd - 1))
  else:
    image = (0, 1) + tuple(range(2, nd))
  if transpose:
    kernel = (nd - 2, nd - 1) + tuple(range(nd - 2))
  else:
    kernel = (nd - 1, nd - 2) + tuple(range(nd - 2))
  return lax.ConvDimensionNumbers(lhs_spec=image, rhs_spec=kernel,
                                  out_spec=image)


def _tuple(v, n: int, what: str) -> tuple[int, ...]:
  try:
    v = tuple(int(a) for a in v)
  except TypeError:  # a scalar
    return (int(v),) * n
  if len(v) == 1:
    return v * n
  if len(v) != n:
    raise ValueError(f"{what} must be an int or a sequence of length {n}, "
                     f"got {v}.")
  return v


def _padding(padding, n: int):
  """A hashable padding: the string as given, or ``n`` ``(lo, hi)`` pairs."""
  if isinstance(padding, str):
    return padding
  pads = tuple(tuple(int(a) for a in p) for p in padding)
  if len(pads) != n or any(len(p) != 2 for p in pads):
    raise ValueError(f"padding must be 'SAME', 'VALID' or {n} (low, high) "
                     f"pairs, got {padding!r}.")
  return pads


def _transpose_pads(kernel: Sequence[int], strides: Sequence[int], padding):
  """The explicit padding ``lax.conv_transpose`` hands to the forward conv.

  Mirrors ``jax._src.lax.convolution.conv_transpose`` with
  ``use_consistent_padding=False`` and no kernel dilation (what Haiku calls):
  ``"SAME"``/``"VALID"`` are converted, anything else is passed through.
  """
  if not (isinstance(padding, str) and padding in ("SAME", "VALID")):
    return padding
  pads = []
  for k, s in zip(kernel, strides):
    if padding == "SAME":
      pad_len = k + s - 2
      pad_a = k - 1 if s > k - 1 else int(math.ceil(pad_len / 2))
    else:
      pad_len = k + s - 2 + max(k - s, 0)
      pad_a = k - 1
    pads.append((pad_a, pad_len - pad_a))
  return tuple(pads)


def _effective_kernel(kernel: Sequence[int], rhs_dilation: Sequence[int]):
  return tuple(0 if k == 0 else (k - 1) * r + 1
               for k, r in zip(kernel, rhs_dilation))


def explicit_pads(spatial: Sequence[int], kernel: Sequence[int],
                  window_strides: Sequence[int], padding: Padding,
                  rhs_dilation: Sequence[int]) -> tuple[tuple[int, int], ...]:
  """``padding`` (``"SAME"``, ``"VALID"`` or pairs) as ``(low, high)`` pairs
  of an input of ``spatial`` size, as ``conv_general_dilated`` resolves it
  (before any input dilation)."""
  if isinstance(padding, str):
    return tuple(lax.padtype_to_pads(
        spatial, _effective_kernel(kernel, rhs_dilation), window_strides,
        padding))
  return tuple(tuple(p) for p in padding)


def im2col(x, kernel: Sequence[int], *, window_strides: Sequence[int],
           padding: Padding, lhs_dilation: Sequence[int],
           rhs_dilation: Sequence[int]) -> jax.Array:
  """The im2col patches of ``x: [N, *spatial, C]`` (channels last), by slices.

  Returns ``[N, *out_spatial, nK * C]`` with features ordered tap-major
  ``(k, c)``, the kernel taps ``k`` row-major: the features of
  ``lax.conv_general_dilated_patches`` (which orders them ``(c, k)``) in
  another order, at ``conv_general_dilated``'s output positions. Built as
  one padded (and, for ``lhs_dilation``, interior-padded) copy of ``x`` and
  one strided ``lax.slice`` per tap, concatenated along the channels: pure
  data movement, where the patches convolution of ``lax`` is a one-hot
  grouped convolution (3.5 to 4x slower on CPU). The tap-major order keeps
  the channels the minor axis throughout: the channel-major order needs a
  ``[..., C, nK]`` stack, which a TPU lays out with its two small minor
  axes padded to (8, 128) tiles and then copies into the matrix layout
  (a TPU v5e profile of the benchmarks' CNN: 75 us of relayout copies in
  a 550 us Gram step).

  ``padding`` is ``"SAME"``, ``"VALID"`` or ``(low, high)`` pairs (negative
  allowed), resolved as ``conv_general_dilated`` resolves it.
  """
  n = len(kernel)
  eff_kernel = _effective_kernel(kernel, rhs_dilation)
  pads = explicit_pads(x.shape[1:1 + n], kernel, window_strides, padding,
                       rhs_dilation)
  # (A pad of a symbolic size, jax.export's, stays symbolic.)
  dim = lambda v: v if not isinstance(v, (int, np.integer)) else int(v)
  config = ([(0, 0, 0)] + [(dim(lo), dim(hi), int(l) - 1) for (lo, hi), l in
                           zip(pads, lhs_dilation)] + [(0, 0, 0)])
  xp = lax.pad(x, jnp.zeros((), x.dtype), config)
  # A symbolic size (jax.export) is taken to leave an output position, as
  # the layer's own convolution does.
  out = tuple(((size - e) // s + 1) if not isinstance(size, int)
              else max(0, (size - e) // s + 1) for size, e, s in
              zip(xp.shape[1:1 + n], eff_kernel, window_strides))
  features = x.shape[-1] * math.prod(kernel)
  if features == 0 or any(isinstance(o, int) and o == 0 for o in out):
    # Nothing to slice.
    return jnp.zeros((x.shape[0],) + out + (features,), x.dtype)
  taps = []
  for tap in itertools.product(*(range(k) for k in kernel)):
    start = tuple(t * r for t, r in zip(tap, rhs_dilation))
    limit = tuple(a + (o - 1) * s + 1
                  for a, o, s in zip(start, out, window_strides))
    taps.append(lax.slice(xp, (0,) + start + (0,),
                          (xp.shape[0],) + limit + (xp.shape[-1],),
                          (1,) + tuple(window_strides) + (1,)))
  return jnp.concatenate(taps, axis=-1)  # [N, *out, (k, c)]


@dataclasses.dataclass(frozen=True)
class ConvSpec:
  """A convolution's static configuration (hashable): the op's params.

  Attributes:
    num_spatial_dims: ``N``, the spatial axes.
    channels_last: the data format (``N...C`` if True, else ``NC...``).
    transpose: ``hk.ConvNDTranspose`` (kernel ``[*K, O, C]``) if True.
    stride, padding, rate, feature_group_count, precision: as the Haiku
      module (``stride`` and ``rate`` as ``N``-tuples; ``padding`` a string
      or ``N`` pairs).
  """
  num_spatial_dims: int
  channels_last: bool = True
  transpose: bool = False
  stride: tuple[int, ...] = (1,)
  padding: Padding = "SAME"
  rate: tuple[int, ...] = (1,)
  feature_group_count: int = 1
  precision: Optional[lax.Precision] = None

  @property
  def feature_ndim(self) -> int:
    return self.num_spatial_dims + 1

  @property
  def groups(self) -> int:
    """Feature groups of the patch matrix (one for a transposed conv)."""
    return 1 if self.transpose else self.feature_group_count

  @property
  def dn(self) -> lax.ConvDimensionNumbers:
    return dimension_numbers(self.num_spatial_dims, self.channels_last,
                             self.transpose)

  def conv_args(self, kernel_spatial):
    """``conv_general_dilated`` arguments of the op as one plain conv."""
    ones = (1,) * self.num_spatial_dims
    if self.transpose:
      return dict(window_strides=ones,
                  padding=_transpose_pads(kernel_spatial, self.stride,
                                          self.padding),
                  lhs_dilation=self.stride, rhs_dilation=ones)
    return dict(window_strides=self.stride, padding=self.padding,
                lhs_dilation=ones, rhs_dilation=self.rate)

  def lead_ndim(self, a) -> int:
    """Leading axes of ``a`` (example and within-example axes)."""
    return a.ndim - self.feature_ndim


def _flatten_lead(spec: ConvSpec, a):
  lead = tuple(a.shape[:spec.lead_ndim(a)])
  return explicit_mesh.merge_leading(a, len(lead)), lead


# -- the convolution -----------------------------------------------------------


def conv_forward(x, w, b, *, spec: ConvSpec):
  """The Haiku module's output: ``conv_general_dilated`` with Haiku's
  dimension numbers over the merged leading axes, then the bias.

  For a transposed conv this is the ``conv_general_dilated`` call that
  ``lax.conv_transpose`` makes (Haiku calls it with
  ``transpose_kernel=False``); the Gram's patches use the same arguments.
  """
  xb, lead = _flatten_lead(spec, x)
  n = spec.num_spatial_dims
  if xb.dtype != w.dtype:
    # Haiku creates ``w`` in the input's dtype, so this never fires for a
    # Haiku module; called directly with mixed dtypes (e.g. bfloat16
    # parameters, float32 activations) the op promotes like ``jnp.dot``
    # where lax.conv_general_dilated would refuse.
    dtype = jnp.promote_types(xb.dtype, w.dtype)
    xb, w = xb.astype(dtype), w.astype(dtype)
  out = lax.conv_general_dilated(
      xb, w, dimension_numbers=spec.dn,
      feature_group_count=1 if spec.transpose else spec.feature_group_count,
      precision=spec.precision, **spec.conv_args(tuple(w.shape[:n])))
  if b is not None:
    out = out + jnp.broadcast_to(b, out.shape)
  return explicit_mesh.split_leading(out, lead)


# -- the Gram ------------------------------------------------------------------


def _patches_and_cotangents(spec: ConvSpec, x, g, w, acc):
  """Patches ``(lead.., T, F, Cg|K|)`` and cotangents ``(lead.., T, F, Og)``.

  ``T`` is the number of output positions, ``F`` the feature groups; both
  in the accumulation dtype ``acc``, channels last.
  """
  n = spec.num_spatial_dims
  xb, lead = _flatten_lead(spec, x.astype(acc))
  gb, _ = _flatten_lead(spec, g.astype(acc))
  if not spec.channels_last:
    xb = jnp.moveaxis(xb, 1, -1)
    gb = jnp.moveaxis(gb, 1, -1)
  kernel = tuple(w.shape[:n])
  patches = im2col(xb, kernel, **spec.conv_args(kernel))
  if patches.shape[:-1] != gb.shape[:-1]:
    raise AssertionError(  # A bug here, never a silent Gram.
        f"gram_haiku conv rule ({spec}): patches {patches.shape} do not "
        f"match the output cotangent {gb.shape}.")
  groups = spec.groups
  t = math.prod(patches.shape[1:-1])
  kernels.check_mergeable(t, patches.shape)
  # Split the merged leading axis first: under an Explicit mesh only that
  # axis may be sharded, and the second reshape then leaves it alone.
  patches = explicit_mesh.split_leading(patches, lead)
  gb = explicit_mesh.split_leading(gb, lead)
  # Features (k, f, cg) regrouped as (f, (k, cg)); with one group a
  # transpose of a unit axis, which moves no data.
  taps = math.prod(kernel)
  cg = patches.shape[-1] // (taps * groups)
  patches = explicit_mesh.reshape_rows(patches, lead + (t, taps, groups, cg))
  patches = jnp.swapaxes(patches, -3, -2)
  patches = explicit_mesh.reshape_rows(patches, lead + (t, groups, taps * cg))
  gb = explicit_mesh.reshape_rows(
      gb, lead + (t, groups, gb.shape[-1] // groups))
  return patches, gb


def cost(x, g, params, example_dim: int, cfg: KernelConfig, *,
         mode: str = "gram", strategy: str = "auto", reuse: bool = True,
         spec: ConvSpec) -> str:
  """The cost model's method (:func:`cost_model.conv_method`) for the
  patches and cotangents of these shapes: ``B`` examples, ``T`` positions
  (within-example times output positions), ``F`` groups of ``n = C/F |K|``
  patch features and ``m = O/F`` outputs."""
  del reuse  # A conv's diagonal never reuses (see conv_method).
  w = params[0]
  nd = spec.num_spatial_dims
  lead = x.shape[:spec.lead_ndim(x)]
  bsz = lead[example_dim]
  if spec.channels_last:
    c, o, out_spatial = x.shape[-1], g.shape[-1], g.shape[-nd - 1:-1]
  else:
    c, o, out_spatial = x.shape[-nd - 1], g.shape[-nd - 1], g.shape[-nd:]
  groups = spec.groups
  n = c * math.prod(w.shape[:nd]) // groups
  m = o // groups
  t = math.prod(lead) * math.prod(out_spatial) // max(bsz, 1)
  acc = rule_lib.accumulation_dtype(x, params)
  return cost_model.conv_method(
      bsz, t, n, m, groups, jnp.dtype(acc).itemsize, mode=mode,
      strategy=strategy, cols=cfg.column_count(bsz),
      budget=cfg.memory_budget_bytes)


def _grouped(p, d, example_dim, with_bias: bool, method: str, mode: str,
             cfg: KernelConfig):
  """The Gram (or its diagonal) group by group (``method`` ghost or
  ``materialize_by_group``), plus the bias term."""
  norms = mode == "norms"
  groups = p.shape[-2]
  per_group = "ghost" if method == "ghost" else "materialize"
  fn = kernels.linear_sq_norms if norms else kernels.linear_gram

  def one(pd):
    xm, dm = kernels.linear_factors(pd[0], pd[1], example_dim)
    return fn(xm, dm, with_bias=False, method=per_group, cfg=cfg)
  if groups == 1:
    out = one((p[..., 0, :], d[..., 0, :]))
  else:
    out = lax.map(one, (jnp.moveaxis(p, -2, 0),
                        jnp.moveaxis(d, -2, 0))).sum(axis=0)
  if with_bias:
    dm = kernels.to_example_major(
        d.reshape(d.shape[:-2] + (d.shape[-2] * d.shape[-1],)), example_dim)
    db = dm.sum(axis=1)
    if norms and cfg.upper_bound:
      out = out + kernels.bias_sq_norm_bounds(dm, cfg.precision)
    else:
      out = out + (jnp.sum(db * db, axis=1) if norms else
                   kernels.gram_matmul(db, db, cfg))
  return out


def _triangle(spec: ConvSpec, x, g, kernel, example_dim, with_bias: bool,
              acc):
  """``(tri, T)``: per example, ``sum_{t,f} |p_tf| |d_tf|`` over the ``T``
  output positions ``t`` and groups ``f`` (plus ``sum_t |d_t|`` for the
  bias), at most the Frobenius norm of the absolute terms that each entry
  of the per-example gradients sums over its ``T`` positions
  (:mod:`gram_haiku._src.compute.norm_bounds`), rounded up.

  No patches are formed: a patch's squared norm is the sum of the squared
  entries in its window, a window sum (``lax.reduce_window``: adds only)
  of the padded input's per-position squared norms of each group's
  channels, so this costs a few passes over the input whichever kernel
  forms the per-example gradients."""
  n = spec.num_spatial_dims
  xb, lead = _flatten_lead(spec, x.astype(acc))
  gb, _ = _flatten_lead(spec, g.astype(acc))
  if not spec.channels_last:
    xb, gb = jnp.moveaxis(xb, 1, -1), jnp.moveaxis(gb, 1, -1)
  groups = spec.groups
  cg, m = xb.shape[-1] // groups, gb.shape[-1] // groups
  sq = jnp.sum(jnp.square(xb.reshape(xb.shape[:-1] + (groups, cg))), -1)
  args = spec.conv_args(kernel)
  pads = explicit_pads(xb.shape[1:1 + n], kernel, args["window_strides"],
                       args["padding"], args["rhs_dilation"])
  sq = lax.pad(sq, jnp.zeros((), sq.dtype),
               ((0, 0, 0),) + tuple((lo, hi, l - 1) for (lo, hi), l in zip(
                   pads, args["lhs_dilation"])) + ((0, 0, 0),))
  # A concrete zero (not a traced one) makes this ``reduce_window_sum``,
  # which is linear (transposable) like the patch path it replaces: the
  # bound differentiates, as the rule's other outputs do.
  sq = lax.reduce_window(
      sq, np.zeros((), sq.dtype), lax.add, (1,) + tuple(kernel) + (1,),
      (1,) + tuple(args["window_strides"]) + (1,), "VALID",
      window_dilation=(1,) + tuple(args["rhs_dilation"]) + (1,))
  if sq.shape[:-1] != gb.shape[:-1]:
    raise AssertionError(  # A bug here, never a silent bound.
        f"gram_haiku conv rule ({spec}): patch norms {sq.shape} do not "
        f"match the output cotangent {gb.shape}.")
  pn = norm_bounds.norms_of_sq_sums(sq, math.prod(kernel) * cg)
  dn = norm_bounds.row_norms(gb.reshape(gb.shape[:-1] + (groups, m)))
  terms = pn * dn  # [N, *out, F]
  if with_bias:
    terms = jnp.concatenate([terms, norm_bounds.row_norms(gb)[..., None]],
                            axis=-1)
  terms = kernels.rows(jnp.moveaxis(
      explicit_mesh.split_leading(terms, lead), example_dim, 0))
  positions = terms.shape[1] // (groups + int(with_bias))
  return norm_bounds.rounded_up_sum(terms, 1), positions


def _materialized_bound(f, spec: ConvSpec, x, g, kernel, example_dim,
                        with_bias: bool, acc, cfg: KernelConfig):
  """Sound upper bounds of the squared norms of materialised per-example
  gradients ``f: [B, P]`` (:func:`gram_haiku._src.compute.norm_bounds.materialized`
  with :func:`_triangle`)."""
  tri, t = _triangle(spec, x, g, kernel, example_dim, with_bias, acc)
  return norm_bounds.of_rows(
      f, norm_bounds.dot_error(t, f.dtype, cfg.precision) * tri)


def per_example_error(x, g, params, example_dim: int, cfg: KernelConfig, *,
                      spec: ConvSpec) -> jax.Array:
  """``[B]``: the rounding bound of the materialised per-example gradients
  in norm units, ``e_T`` times :func:`_triangle` (``T`` the output
  positions of one example; window sums of the input, no patches). It
  reads only the input the layer reads: an inf or NaN in columns a
  negative padding crops or a stride skips leaves it finite (the closed
  form ``sqrt(|K|) |x_i| |d_i|`` it replaces read the whole input, which
  made such an example's bound NaN and dropped it from the clipped
  sum)."""
  w, b = params
  acc = rule_lib.accumulation_dtype(x, params)
  tri, t = _triangle(spec, x, g, tuple(w.shape[:spec.num_spatial_dims]),
                     example_dim, b is not None, acc)
  return norm_bounds.dot_error(t, acc, cfg.precision) * tri * (1 + 1e-6)


def _patch_matrix(spec: ConvSpec, w):
  """The kernel as the matrix that multiplies the patches: ``[F, n, m]``.

  ``conv(x, w) == patches(x) @ W`` per feature group ``f``, with the
  patch features of a group ordered (kernel position, input channel), as
  :func:`im2col` and :func:`_patches_and_cotangents` order them;
  ``n = |K| C/F``, ``m = O/F``. Pure transposes and reshapes, so its VJP
  maps a sum of per-example gradients in patch layout back to the kernel's
  layout.
  """
  rhs = spec.dn.rhs_spec  # (out, in, *spatial) positions in w
  wt = jnp.transpose(w, tuple(rhs[2:]) + (rhs[1], rhs[0]))
  out = wt.shape[-1]
  wt = wt.reshape(-1, spec.groups, out // spec.groups)  # [(k, cg), f, j]
  return jnp.moveaxis(wt, 1, 0)


def _per_example(p, d, example_dim, with_bias: bool, precision):
  """Per-example gradients from patches and cotangents, every group at once.

  Returns ``(per, db)``: ``per: [B, F, n, m]`` for the kernel in patch
  layout (see :func:`_patch_matrix`) and ``db: [B, O]`` for the bias
  (channel ``o = f m + j``), or None without a bias.
  """
  groups, n, m = p.shape[-2], p.shape[-1], d.shape[-1]
  pm = kernels.rows(jnp.moveaxis(p, example_dim, 0), groups, n)
  dm = kernels.rows(jnp.moveaxis(d, example_dim, 0), groups, m)
  per = jnp.einsum("itfn,itfm->ifnm", pm, dm,
                   precision=precision)
  db = kernels.rows(dm.sum(axis=1)) if with_bias else None
  return per, db


def _example_block(spec: ConvSpec, x, p, example_dim):
  """Examples per block of the per-example gradients, or None for all at
  once (see :func:`gram_haiku._src.compute.cost_model.patch_block`). Blocked only
  with the examples as the one leading axis, a known number of them (not a
  symbolic size from ``jax.export``), outside explicit sharding."""
  if (example_dim != 0 or spec.lead_ndim(x) != 1 or
      not isinstance(x.shape[0], int) or
      explicit_mesh.explicit_spec(x) is not None):
    return None
  block = cost_model.patch_block(
      x.shape[0], p.size * jnp.dtype(p.dtype).itemsize,
      x.size * jnp.dtype(x.dtype).itemsize)
  return None if block >= x.shape[0] else block


def _to_kernel_layout(spec: ConvSpec, w, like):
  """The map from patch layout ``[F, n, m]`` back to ``w``'s layout: the
  VJP of :func:`_patch_matrix` (varying like ``like`` in shard_map)."""
  _, vjp = jax.vjp(functools.partial(_patch_matrix, spec),
                   hx.vary_like(w.astype(like.dtype), like))
  return lambda a: vjp(a)[0]


def _pallas_platforms(spec: ConvSpec, x, g, w, example_dim: int, acc,
                      cfg: KernelConfig) -> tuple[str, ...]:
  """The platforms of :func:`cost_model.pallas_conv_grads_platforms` (the
  layers the kernel was measured faster on) on which the per-example
  gradients run as the kernel of :mod:`gram_haiku._src.compute.pallas_conv`:
  a 2-d convolution, not transposed (no input dilation), of one feature
  group; the examples the one leading axis, on one device (not under
  ``shard_map``'s columns or an Explicit mesh); every size known; float32
  or bfloat16; a layout whose program fits VMEM. ``()``: the patch
  path."""
  n = spec.num_spatial_dims
  if (n != 2 or spec.transpose or spec.groups != 1 or
      example_dim != 0 or spec.lead_ndim(x) != 1 or cfg.column_axes or
      explicit_mesh.under_explicit_mesh() or
      explicit_mesh.explicit_spec(x) is not None or
      jnp.dtype(acc) not in (jnp.dtype(jnp.float32),
                             jnp.dtype(jnp.bfloat16)) or
      not all(isinstance(v, int) for v in (*x.shape, *g.shape))):
    return ()
  kernel = tuple(w.shape[:n])
  xs, gs = x.shape, g.shape
  if not spec.channels_last:
    xs, gs = (xs[0], *xs[2:], xs[1]), (gs[0], *gs[2:], gs[1])
  args = spec.conv_args(kernel)
  platforms = cost_model.pallas_conv_grads_platforms(
      xs[-1], gs[1] * gs[2], all(s == 1 for s in args["window_strides"]))
  if not platforms:
    return ()
  from gram_haiku._src.compute import pallas_conv  # pylint: disable=g-import-not-at-top
  try:
    pallas_conv.plan(xs, gs, kernel, args["window_strides"],
                     explicit_pads(xs[1:3], kernel, args["window_strides"],
                                   args["padding"], args["rhs_dilation"]),
                     args["rhs_dilation"], acc)
  except ValueError:
    return ()
  return platforms


def _pallas_per_example(spec: ConvSpec, w, with_bias: bool, acc,
                        cfg: KernelConfig, platform: str):
  """``(x, g, p, d) -> (per, db)`` as the patch path's, the kernel
  gradients by :func:`pallas_conv.per_example_conv_grads_pallas` (in
  interpret mode off a TPU), never reading the patches ``p``. Its JVP is
  the patch path's (the kernel has none)."""
  from gram_haiku._src.compute import pallas_conv  # pylint: disable=g-import-not-at-top
  n = spec.num_spatial_dims
  kernel = tuple(w.shape[:n])
  args = spec.conv_args(kernel)

  @jax.custom_jvp
  def per_example(x, g):
    xb, gb = x.astype(acc), g.astype(acc)
    if not spec.channels_last:
      xb, gb = jnp.moveaxis(xb, 1, -1), jnp.moveaxis(gb, 1, -1)
    pads = explicit_pads(xb.shape[1:1 + n], kernel, args["window_strides"],
                         args["padding"], args["rhs_dilation"])
    per = pallas_conv.per_example_conv_grads_pallas(
        xb, gb, kernel, strides=args["window_strides"], padding=pads,
        rhs_dilation=args["rhs_dilation"], precision=cfg.precision,
        interpret=platform != "tpu")
    return per[:, None].astype(acc)  # [B, F = 1, n, m]

  @per_example.defjvp
  def _(primals, tangents):
    def patches(x, g):
      pe, de = _patches_and_cotangents(spec, x, g, w, acc)
      return _per_example(pe, de, 0, False, cfg.precision)[0]
    return jax.jvp(patches, primals, tangents)

  def fn(x, g, p, d):
    del p
    db = kernels.rows(d.sum(axis=1)) if with_bias else None
    return per_example(x, g), db
  return fn


def probe_cotangent_and_grads(x, g, params, example_dim: int, mode: str,
                              wanted, cfg: KernelConfig, *, spec: ConvSpec):
  """The probe's value by ``mode``; materialised per-example gradients
  also give ``dw`` and ``db``.

  Where the cost model forms per-example gradients from the patches
  (``B T n m`` multiply-adds, what the plain kernel gradient costs), their
  sum is the kernel gradient: it is mapped back to the kernel's layout and
  returned, and the op does not run the kernel's VJP as well. So a
  materialised Gram or squared norm costs only ``B n m`` (or ``B^2 n m``)
  on top of the plain backward pass.
  """
  e = example_dim
  w, b = params
  acc = rule_lib.accumulation_dtype(x, params)
  p, d = _patches_and_cotangents(spec, x, g, w, acc)
  method = cfg.method or cost(x, g, params, e, cfg, mode=mode, spec=spec)
  if method != "materialize":
    return _grouped(p, d, e, b is not None, method, mode, cfg), {}
  block = _example_block(spec, x, p, e)

  def whole(x, g, p, d):
    del x, g
    return _per_example(p, d, e, b is not None, cfg.precision)

  def blocked(x, g, p, d):
    del p, d
    def one(xg):  # One example: its patches, its gradient (under vmap).
      pe, de = _patches_and_cotangents(spec, xg[0][None], xg[1][None], w,
                                       acc)
      per_e, db_e = _per_example(pe, de, 0, b is not None, cfg.precision)
      return per_e[0], None if db_e is None else db_e[0]
    return lax.map(one, (x, g), batch_size=block)

  def patch_path(x, g, p, d):
    if block is None:
      return whole(x, g, p, d)
    if p.size * jnp.dtype(p.dtype).itemsize > cfg.memory_budget_bytes:
      return blocked(x, g, p, d)
    # Blocks save memory at the cost of a loop over them: on the CPU the
    # loop is free (its steps are as large as the patches of the whole
    # batch would be), on a GPU it serialises small kernels (the
    # benchmarks' CNN on an H200: full Gram 1.84x a plain step blocked,
    # 1.24x whole; DP step 1.58x and 1.26x). So the patches are blocked
    # on the CPU only, unless they exceed the memory budget. Both
    # branches are traced; the compiler keeps the one of its platform.
    return lax.platform_dependent(x, g, p, d, cpu=blocked, default=whole)

  # The Pallas kernel (no patches in HBM) where it was measured faster.
  platforms = _pallas_platforms(spec, x, g, w, e, acc, cfg)
  if platforms:
    per, db = lax.platform_dependent(
        x, g, p, d, default=patch_path,
        **{pf: _pallas_per_example(spec, w, b is not None, acc, cfg, pf)
           for pf in platforms})
  else:
    per, db = patch_path(x, g, p, d)
  flat = per
  if mode == "per_example":
    # In the kernel's own layout, like every op's per-example gradients.
    flat = jax.vmap(_to_kernel_layout(spec, w, per))(per)
  f = kernels.rows(flat)
  if db is not None:
    f = jnp.concatenate([f, db], axis=1)
  if mode == "norms" and cfg.upper_bound:
    value = _materialized_bound(f, spec, x, g,
                                tuple(w.shape[:spec.num_spatial_dims]), e,
                                b is not None, acc, cfg)
  else:
    value = kernels.probe_value(mode, f, cfg)
  provided = {}
  if 0 in wanted:
    # Varying like the sum inside shard_map (the caller all-reduces).
    total = kernels.example_sum(per, cfg.precision)
    provided[0] = _to_kernel_layout(spec, w, total)(total).astype(w.dtype)
  if 1 in wanted and b is not None:
    provided[1] = kernels.example_sum(db, cfg.precision).reshape(
        b.shape).astype(b.dtype)
  return value, provided


def gram(x, g, params, example_dim: int, cfg: KernelConfig, *,
         spec: ConvSpec) -> jax.Array:
  """``[B, B]`` Gram of the per-example gradients of ``w`` and ``b``, by
  ``cfg.method`` (None: :func:`cost`'s)."""
  return probe_cotangent_and_grads(x, g, params, example_dim, "gram", (),
                                   cfg, spec=spec)[0]


def sq_norms(x, g, params, example_dim: int, cfg: KernelConfig, *,
             spec: ConvSpec) -> jax.Array:
  """``[B]`` squared per-example gradient norms."""
  return probe_cotangent_and_grads(x, g, params, example_dim, "norms", (),
                                   cfg, spec=spec)[0]


def conv_rule(**spec_fields) -> Rule:
  """The rule of ``hk.ConvND`` (``transpose=False``) or
  ``hk.ConvNDTranspose`` (``transpose=True``), parameters ``(w, b)``.

  Keywords (the fields of :class:`ConvSpec`), already normalised:
  ``num_spatial_dims`` (``N``), ``channels_last``, ``transpose``,
  ``stride`` and ``rate`` (``N``-tuples), ``padding`` (``"SAME"``,
  ``"VALID"`` or ``N`` ``(low, high)`` pairs), ``feature_group_count`` and
  ``precision``, as the Haiku module's (:func:`gram_conv` and
  :func:`gram_conv_transpose` take Haiku's own arguments). Sharding-aware;
  the bias is droppable (a None bias is no bias); per-example gradients of
  a frozen bias's kernel by the default ``vmap`` of the VJP."""
  spec = ConvSpec(**spec_fields)
  bind = lambda fn: functools.partial(fn, spec=spec)
  return Rule(forward=bind(conv_forward), param_names=("w", "b"),
              feature_ndim=spec.feature_ndim, gram=bind(gram),
              sq_norms=bind(sq_norms),
              probe_cotangent_and_grads=bind(probe_cotangent_and_grads),
              per_example_error=bind(per_example_error),
              cost=bind(cost), droppable=(1,), sharding_aware=True)


def layer_rule(w_shape, *, transpose: bool, stride, padding, rate,
               feature_group_count, data_format, precision,
               name: str) -> Rule:
  """:func:`conv_rule` from ``hk.ConvND``'s (or ``hk.ConvNDTranspose``'s)
  arguments, checked and made hashable, for a kernel of shape ``w_shape``.

  Raises:
    ValueError: for a kernel of rank below 3, a bad
      ``feature_group_count``, ``stride``, ``rate``, ``padding`` or
      ``data_format``.
  """
  n = len(w_shape) - 2
  if n < 1:
    raise ValueError(f"{name}: the kernel must have rank >= 3 "
                     f"([*kernel, in, out]), got shape {tuple(w_shape)}.")
  if not isinstance(feature_group_count, int) or feature_group_count < 1:
    raise ValueError(f"{name}: feature_group_count must be a positive int, "
                     f"got {feature_group_count!r}.")
  return conv_rule(
      num_spatial_dims=n, channels_last=channels_last_of(data_format),
      transpose=transpose, stride=_tuple(stride, n, "stride"),
      padding=_padding(padding, n), rate=_tuple(rate, n, "rate"),
      feature_group_count=feature_group_count, precision=precision)


def _conv_op(x, w, b, probe, *, transpose, stride, padding, rate,
             feature_group_count, data_format, precision, name, plan):
  rule = layer_rule(jnp.shape(w), transpose=transpose, stride=stride,
                    padding=padding, rate=rate,
                    feature_group_count=feature_group_count,
                    data_format=data_format, precision=precision, name=name)
  return op_lib.bind(rule, x, (w, b), probe, name=name, plan=plan)


def gram_conv(x: jax.Array, w: jax.Array, b: Optional[jax.Array],
              probe: jax.Array, *, stride: Union[int, Sequence[int]] = 1,
              padding: Padding = "SAME", rate: Union[int, Sequence[int]] = 1,
              feature_group_count: int = 1,
              data_format: str = "channels_last",
              precision: Optional[lax.Precision] = None, name: str = "conv",
              example_axis: ExampleAxisSpec | ExampleAxis = None,
              strategy: str = "auto", mode: str = "gram",
              memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
              plan: Optional[Plan] = None) -> jax.Array:
  """``hk.ConvND``'s convolution; its backward pass puts the Gram in ``probe``.

  Args:
    x: ``[..., *spatial, C]`` (channels last) or ``[..., C, *spatial]``
      input; its leading axes are the example axis and within-example axes.
      Any float dtype; if it differs from ``w``'s, both are promoted (as
      ``jnp.dot`` does; Haiku always creates ``w`` in the input's dtype).
    w: ``[*kernel, C // feature_group_count, O]`` kernel (Haiku's layout).
    b: ``[O]`` bias (``[O, 1, ..., 1]`` channels first, as Haiku), or None.
    probe: zeros, ``[B, B]`` (``"gram"``), ``[B]`` (``"norms"``) or ``[B, P]``
      (``"per_example"``); float32, float64 under x64.
    stride, padding, rate, feature_group_count, data_format: as
      ``hk.ConvND`` (``padding`` ``"SAME"``, ``"VALID"`` or ``N`` pairs).
    precision: passed to ``lax.conv_general_dilated`` as Haiku does.
    name, example_axis, strategy, mode, memory_budget_bytes, plan: as
      :func:`gram_haiku.ops.gram_linear`.

  Returns:
    Exactly ``hk.ConvND``'s output. The probe's cotangent is the Gram of the
    per-example gradients of ``w`` and ``b`` (or its diagonal, or them).
  """
  if plan is None:
    plan = Plan.make(mode=mode, strategy=strategy, example_axis=example_axis,
                     memory_budget_bytes=memory_budget_bytes)
  return _conv_op(x, w, b, probe, transpose=False, stride=stride,
                  padding=padding, rate=rate,
                  feature_group_count=feature_group_count,
                  data_format=data_format, precision=precision, name=name,
                  plan=plan)


def gram_conv_transpose(x: jax.Array, w: jax.Array, b: Optional[jax.Array],
                        probe: jax.Array, *,
                        stride: Union[int, Sequence[int]] = 1,
                        padding: Padding = "SAME",
                        data_format: str = "channels_last",
                        precision: Optional[lax.Precision] = None,
                        name: str = "conv_transpose",
                        example_axis: ExampleAxisSpec | ExampleAxis = None,
                        strategy: str = "auto", mode: str = "gram",
                        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
                        plan: Optional[Plan] = None) -> jax.Array:
  """``hk.ConvNDTranspose``'s ``lax.conv_transpose`` with the Gram in ``probe``.

  Args:
    x: ``[..., *spatial, C]`` or ``[..., C, *spatial]`` input.
    w: ``[*kernel, O, C]`` kernel (Haiku's transposed layout).
    b: ``[O]`` (``[O, 1, ..., 1]`` channels first) or None.
    padding: ``"SAME"``, ``"VALID"`` (the forward conv's padding, as
      ``lax.conv_transpose``) or ``N`` explicit pairs (padding of the
      stride-dilated input, as ``lax.conv_transpose``; Haiku's
      ``output_shape`` produces such pairs).
    Others: as :func:`gram_conv`.

  Returns:
    Exactly ``hk.ConvNDTranspose``'s output; the probe's cotangent as
    :func:`gram_conv`.
  """
  if plan is None:
    plan = Plan.make(mode=mode, strategy=strategy, example_axis=example_axis,
                     memory_budget_bytes=memory_budget_bytes)
  return _conv_op(x, w, b, probe, transpose=True, stride=stride,
                  padding=padding, rate=1, feature_group_count=1,
                  data_format=data_format, precision=precision, name=name,
                  plan=plan)
