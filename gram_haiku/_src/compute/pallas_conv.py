"""A Pallas TPU kernel for a convolution's per-example kernel gradients.

For a 2-d convolution, channels last, one feature group and no input
dilation, with stride ``s``, kernel dilation (rate) ``r`` and the input
``x_i`` of example ``i`` zero-padded as the layer pads it, the gradient of
example ``i``'s loss with respect to the kernel is

    g_i[k, c, o] = sum_p xpad_i[s p + r k, c] d_i[p, o]                 (1)

over the output positions ``p``, ``k`` the kernel taps (row-major), ``d_i``
the output cotangents. In the patch layout of
:mod:`gram_haiku._src.ops.conv` (features ``(k, c)``, tap-major) this is
``X~_i^T D_i``. XLA's path forms the im2col patches ``X~`` in HBM, ``|K| /
s^2`` times the input (9x for a 3x3 kernel), a block of examples at a time
in a loop. The kernel here never writes a patch: each program reads the
padded input of its examples into VMEM once and, for every tap, multiplies
the tap's window ``[Ho Wo, C]`` of it by the cotangents ``[Ho Wo, O]`` on
the MXU (the contraction runs over the output positions), writing the
``[C, O]`` block of (1) for that tap. HBM traffic: the input, the
cotangents and the ``[B, |K| C, O]`` result, each once.

Layout (done by XLA ahead of the kernel):

* **stride**: the padded input is split into ``s x s`` phases
  ``xpad[a::s, b::s]``. Tap ``(ky, kx)`` reads phase ``(r ky mod s, r kx mod
  s)`` at offset ``(r ky div s, r kx div s)``: a stride-1 window. Only the
  phases a tap reads are kept (a 1x1 stride-2 kernel reads one, a quarter of
  the input). With ``s = 1`` this is a reshape, no copy.
* **width**: the output width is padded to a whole sublane tile (8 rows of
  float32, 16 of bfloat16; zero cotangent columns add nothing), so a window
  ``[Ho, Wo', C]`` is a ``[Ho Wo', C]`` matrix without relayout. The
  window's column offset is either taken in VMEM (``shift="kernel"``: an
  unaligned sublane slice per tap) or done by XLA ahead of the kernel
  (``shift="input"``: one copy of each phase per distinct column offset,
  ``kw`` copies of the input for stride 1, and a slice along the untiled
  row axis in the kernel). Which is faster is measured
  (``python -m benchmarks.pallas_conv``); :data:`DEFAULT_SHIFT`.
* **channels**: fewer than 8 input channels are padded to 8 (the sublanes of
  a ``[C, O]`` block; the zero rows are dropped from the result).

The grid runs over blocks of ``be`` examples (as many as make ``be Ho Wo``
reach :data:`TARGET_ROWS` positions, within :data:`VMEM_BUDGET_BYTES`).
Products accumulate in float32 at ``precision`` (``HIGHEST``: float32
products; ``DEFAULT`` on a TPU: the inputs are rounded to bfloat16 ahead of
the kernel, one MXU pass, as XLA's ``DEFAULT``), with the dtype, precision
and VMEM rules of :mod:`gram_haiku._src.compute.pallas_ghost`.

Interpret mode (``interpret=True``) runs the same kernel on any backend,
which is how the tests check it on the CPU against (1) in float64 and
against the patch path. Sources: Rochette, Manoel & Tramel (2019),
"Efficient per-example gradient computations in convolutional neural
networks" (per-example kernel gradients from the unfolded input); the
phase split of a strided convolution is the polyphase decomposition.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gram_haiku._src.compute import pallas_ghost
from gram_haiku._src.compute.pallas_ghost import round_up

#: Output positions ``be Ho Wo`` a program aims at: a program's products
#: are ``|K|`` matrices ``[C, be Ho Wo] x [be Ho Wo, O]``; fewer positions
#: leave the per-program overhead (about 0.35 us) and the MXU's fill
#: uncovered (an 8x8 layer: 8 examples a program).
TARGET_ROWS = 512

#: The most examples a program takes (its loop over them is unrolled).
MAX_BLOCK_EXAMPLES = 8

#: VMEM a program's double-buffered blocks and intermediates may take.
VMEM_BUDGET_BYTES = 40 * 2**20

#: Where the window's column offset is taken (module docstring):
#: ``"kernel"`` or ``"input"``.
SHIFTS = ("kernel", "input")
DEFAULT_SHIFT = "kernel"

#: How a program multiplies: ``"window_t"``, each tap's window transposed
#: against the cotangents (contraction over the sublanes of both);
#: ``"d_t"``, the cotangents transposed once (ahead of the kernel) against
#: each window, the MXU's own layout, the result ``[O, C]`` transposed
#: after; ``"d_t_stacked"``, as ``"d_t"`` with the windows side by side,
#: one product. The default is the form compiled and measured on a TPU
#: v5e (:data:`gram_haiku._src.compute.cost_model.PALLAS_CONV_MIN_CHANNELS`);
#: the other two ran in interpret mode only (``python -m
#: benchmarks.conv_kernels --kernel pallas_s,pallas_d`` measures them).
FORMS = ("window_t", "d_t", "d_t_stacked")
DEFAULT_FORM = "window_t"

_BAD = (
    "per_example_conv_grads_pallas: {}. It takes x: [B, H, W, C] and d: "
    "[B, Ho, Wo, O] (channels last, one feature group, no input dilation) "
    "with Ho, Wo the output size of the padded input; use the patch path "
    "(gram_haiku._src.ops.conv) for anything else.")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The kernel's layout of one convolution (:func:`plan`).

  Attributes:
    taps: per tap ``(q, oy, ox)``: the input slab ``q`` it reads and the
      window's row and column offset in it.
    slabs: per slab ``(a, b, shift)``: the phase (row, column) and, with
      ``shift="input"``, the column offset taken ahead of the kernel.
    rows, cols: a slab's rows and columns ``Hq, Wq``.
    crop: the layer's negative high padding of the rows and columns
      (``<= 0``, else 0), applied with the low padding first: the
      sublane-padded window width reads past the last output column,
      which must find zeros there, not the input the layer crops (whose
      inf or NaN times a zero cotangent would be NaN).
    pads: the ``(low, high)`` padding of the rows and columns, ``high``
      applied after the crop, that makes the input ``s Hq`` by ``s Wq0``
      (high may be negative: rows no tap reads are dropped), ``Wq0`` the
      phase width before a shift.
    read: None, or per column of the padded input whether the layer reads
      it: where a stride or rate skips input columns that the padded
      window width reads, the others are zeroed ahead of the kernel (an
      inf or NaN the layer never reads must not reach the products).
    ho, wo, wo_p: output rows, columns, columns padded to the sublane tile.
    c_p: input channels padded (at least 8).
    be: examples per program.
    vmem_bytes: the VMEM a program takes.
  """
  taps: tuple[tuple[int, int, int], ...]
  slabs: tuple[tuple[int, int, int], ...]
  rows: int
  cols: int
  crop: tuple[int, int]
  pads: tuple[tuple[int, int], tuple[int, int]]
  read: Optional[tuple[bool, ...]]
  ho: int
  wo: int
  wo_p: int
  c_p: int
  be: int
  vmem_bytes: int


def _vmem(be, slabs, rows, cols, c, rows_d, o, taps, itemsize) -> int:
  lanes = lambda v: round_up(v, pallas_ghost.LANES)
  x = be * slabs * rows * round_up(cols, 8) * lanes(c) * itemsize
  d = be * rows_d * lanes(o) * itemsize
  out = be * taps * round_up(c, 8) * lanes(o) * 4
  window = rows_d * lanes(c) * 4 + round_up(c, 8) * lanes(o) * 4
  return 2 * (x + d + out) + 2 * window


def plan(x_shape: Sequence[int], d_shape: Sequence[int],
         kernel: Sequence[int], strides: Sequence[int],
         pads: Sequence[tuple[int, int]], rhs_dilation: Sequence[int],
         dtype, shift: str = DEFAULT_SHIFT,
         block_examples: Optional[int] = None) -> Plan:
  """The layout of (1) for ``x: [B, H, W, C]`` and ``d: [B, Ho, Wo, O]``
  (module docstring), ``pads`` the layer's explicit ``(low, high)``
  padding.

  Raises:
    ValueError: shapes other than those, an output size that is not the
      padded input's, a ``shift`` not in :data:`SHIFTS`, or a layer whose
      program would exceed :data:`pallas_ghost.VMEM_LIMIT_BYTES` with one
      example.
  """
  if len(x_shape) != 4 or len(d_shape) != 4 or x_shape[0] != d_shape[0]:
    raise ValueError(_BAD.format(f"got x{tuple(x_shape)}, d{tuple(d_shape)}"))
  if shift not in SHIFTS:
    raise ValueError(_BAD.format(f"shift={shift!r} is not one of {SHIFTS}"))
  b, h, w, c = x_shape
  _, ho, wo, o = d_shape
  kh, kw = kernel
  (sh, sw), (rh, rw) = strides, rhs_dilation
  for size, lo_hi, k, s, r, out in ((h, pads[0], kh, sh, rh, ho),
                                    (w, pads[1], kw, sw, rw, wo)):
    padded = size + lo_hi[0] + lo_hi[1]
    want = max(0, (padded - (k - 1) * r - 1) // s + 1)
    if want != out:
      raise ValueError(_BAD.format(
          f"an input of {size} padded by {tuple(lo_hi)} gives {want} "
          f"outputs of a {k}-tap kernel (stride {s}, rate {r}), but d has "
          f"{out}"))
  sub = pallas_ghost.sublanes(dtype)
  wo_p = round_up(max(wo, 1), sub)
  oys = [(rh * ky) // sh for ky in range(kh)]
  oxs = [(rw * kx) // sw for kx in range(kw)]
  rows = max(oys) + ho
  cols0 = max(oxs) + wo_p
  tap_slab = {}
  taps = []
  for ky, kx in itertools.product(range(kh), range(kw)):
    a, bb = (rh * ky) % sh, (rw * kx) % sw
    oy, ox = oys[ky], oxs[kx]
    key = (a, bb, ox if shift == "input" else 0)
    q = tap_slab.setdefault(key, len(tap_slab))
    taps.append((q, oy, 0 if shift == "input" else ox))
  cols = wo_p if shift == "input" else cols0
  c_p = max(c, 8)
  itemsize = jnp.dtype(dtype).itemsize
  need = lambda be: _vmem(be, len(tap_slab), rows, cols, c_p, ho * wo_p, o,
                          kh * kw, itemsize)
  if block_examples is None:
    be = max(1, min(MAX_BLOCK_EXAMPLES, b, TARGET_ROWS // max(ho * wo_p, 1)))
    while be > 1 and need(be) > VMEM_BUDGET_BYTES:
      be //= 2
  else:
    be = block_examples
  if need(be) + 16 * 2**20 > pallas_ghost.VMEM_LIMIT_BYTES:
    raise ValueError(_BAD.format(
        f"one program needs {need(be) >> 20} MiB of VMEM, more than the "
        f"{pallas_ghost.VMEM_LIMIT_BYTES >> 20} MiB a kernel may take"))
  crop = tuple(min(hi, 0) for _, hi in pads)
  pads_out = tuple((lo, s * n - size - cut - lo) for (lo, _), s, n, size, cut
                   in zip(pads, strides, (rows, cols0), (h, w), crop))
  # The padded input's columns the layer reads, and those the windows of
  # the padded width read that hold input (not padding) without it.
  read = {sw * j + rw * kx for j in range(wo) for kx in range(kw)}
  lo_w = pads[1][0]
  data = range(max(lo_w, 0), lo_w + w + crop[1])
  stray = any(sw * j + rw * kx not in read and sw * j + rw * kx in data
              for j in range(wo, wo_p) for kx in range(kw))
  read = tuple(col in read for col in range(sw * cols0)) if stray else None
  return Plan(taps=tuple(taps), slabs=tuple(tap_slab), rows=rows, cols=cols,
              crop=crop, pads=pads_out, read=read, ho=ho, wo=wo, wo_p=wo_p,
              c_p=c_p, be=be,
              vmem_bytes=need(be))


def _slabs(x, p: Plan, strides) -> jax.Array:
  """``x: [B, H, W, C]`` -> ``[B, Q, Hq, Wq, C']``: the padded input's
  phases (and, with ``shift="input"``, column shifts) the taps read."""
  sh, sw = strides
  (lo_h, hi_h), (lo_w, hi_w) = p.pads
  zero = jnp.zeros((), x.dtype)
  c = x.shape[-1]
  if any(p.crop):  # Low padding and crop first (the layer's padded size).
    x = lax.pad(x, zero, ((0, 0, 0),) + tuple(
        (lo, cut, 0) if cut else (0, 0, 0)
        for (lo, _), cut in zip(p.pads, p.crop)) + ((0, 0, 0),))
    lo_h, lo_w = (0 if cut else lo for (lo, _), cut in zip(p.pads, p.crop))
  xp = lax.pad(x, zero, ((0, 0, 0), (lo_h, hi_h, 0), (lo_w, hi_w, 0),
                         (0, p.c_p - c, 0)))
  if p.read is not None:
    xp = jnp.where(jnp.asarray(p.read)[None, None, :, None], xp, zero)
  b, c = xp.shape[0], xp.shape[-1]
  cols0 = xp.shape[2] // sw
  phases = xp.reshape(b, p.rows, sh, cols0, sw, c)
  out = []
  for a, bb, shift in p.slabs:
    ph = phases[:, :, a, :, bb, :]
    out.append(ph[:, :, shift:shift + p.cols] if (shift or p.cols != cols0)
               else ph)
  return jnp.stack(out, axis=1)


def _per_example_conv_kernel(x_ref, d_ref, o_ref, *, taps, ho, wo_p, be,
                             precision, form):
  dot = functools.partial(lax.dot_general, precision=(precision, precision),
                          preferred_element_type=jnp.float32)
  for e in range(be):
    d = d_ref[e]
    windows = []
    for q, oy, ox in taps:
      window = x_ref[e, q, oy:oy + ho, ox:ox + wo_p, :]
      windows.append(window.reshape(ho * wo_p, window.shape[-1]))
    if form == "window_t":  # [C, T] x [T, O] per tap
      for k, window in enumerate(windows):
        o_ref[e, k] = dot(window, d, (((0,), (0,)), ((), ())))
    elif form == "d_t":  # [O, T] x [T, C] per tap
      for k, window in enumerate(windows):
        o_ref[e, k] = dot(d, window, (((1,), (0,)), ((), ())))
    else:  # "d_t_stacked": [O, T] x [T, |K| C], one product
      o_ref[e] = dot(d, jnp.concatenate(windows, axis=1),
                     (((1,), (0,)), ((), ())))


def per_example_conv_grads_pallas(
    x: jax.Array, d: jax.Array, kernel: Sequence[int], *,
    strides: Sequence[int] = (1, 1),
    padding: Sequence[tuple[int, int]] = ((0, 0), (0, 0)),
    rhs_dilation: Sequence[int] = (1, 1), precision=None,
    interpret: bool = False, shift: str = DEFAULT_SHIFT,
    form: str = DEFAULT_FORM,
    block_examples: Optional[int] = None) -> jax.Array:
  """The per-example kernel gradients (1) of a 2-d convolution, on a TPU.

  Args:
    x: ``f32[B, H, W, C]`` or ``bf16[...]``: the layer's input, channels
      last, example axis first.
    d: ``[B, Ho, Wo, O]``: the output cotangents (mixed dtypes are both
      cast to float32).
    kernel: ``(kh, kw)``, the kernel's spatial shape.
    strides, rhs_dilation: the layer's window strides and kernel dilation.
    padding: the layer's explicit ``(low, high)`` padding of the rows and
      the columns (negative crops; ``lax.padtype_to_pads`` resolves
      ``"SAME"`` and ``"VALID"``).
    precision: the MXU products' ``lax.Precision``, as
      :func:`gram_haiku._src.compute.pallas_ghost.ghost_gram_pallas`
      (None: ``HIGHEST``).
    interpret: Pallas interpret mode (any backend; the tests).
    shift, form, block_examples: override the layout (:func:`plan`,
      :data:`FORMS`; tests and the benchmark).

  Returns:
    ``f32[B, kh kw C, O]``: example ``i``'s gradient in the patch layout of
    :mod:`gram_haiku._src.ops.conv` (features ``(tap, channel)``, taps
    row-major).

  Raises:
    ValueError: as :func:`plan`.
    TypeError: dtypes other than float32 and bfloat16.
  """
  ok = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
  if jnp.dtype(x.dtype) not in ok or jnp.dtype(d.dtype) not in ok:
    raise TypeError(
        "per_example_conv_grads_pallas: inputs must be float32 or bfloat16 "
        f"(a TPU has no float64 MXU); got {jnp.dtype(x.dtype).name} and "
        f"{jnp.dtype(d.dtype).name}. Use the patch path for float64.")
  precision = pallas_ghost.mxu_precision(precision)
  dtype = pallas_ghost.compute_dtype(x, d, precision, interpret)
  if dtype == jnp.bfloat16:
    precision = lax.Precision.DEFAULT
  kernel, strides = tuple(kernel), tuple(strides)
  p = plan(x.shape, d.shape, kernel, strides, tuple(map(tuple, padding)),
           tuple(rhs_dilation), dtype, shift, block_examples)
  b, c, o = x.shape[0], x.shape[-1], d.shape[-1]
  taps = len(p.taps)
  if b == 0 or c == 0 or o == 0 or p.ho == 0 or p.wo == 0:
    return jnp.zeros((b, taps * c, o), jnp.float32)
  xs = _slabs(x.astype(dtype), p, strides)
  dp = jnp.pad(d.astype(dtype), ((0, 0), (0, 0), (0, p.wo_p - p.wo), (0, 0)))
  dp = dp.reshape(b, p.ho * p.wo_p, o)
  b_p = round_up(b, p.be)
  if b_p != b:
    xs = jnp.pad(xs, ((0, b_p - b),) + ((0, 0),) * 4)
    dp = jnp.pad(dp, ((0, b_p - b), (0, 0), (0, 0)))
  if form not in FORMS:
    raise ValueError(_BAD.format(f"form={form!r} is not one of {FORMS}"))
  if form != "window_t":
    dp = jnp.swapaxes(dp, 1, 2)  # [B, O, T]
  out_block = {"window_t": (taps, p.c_p, o), "d_t": (taps, o, p.c_p),
               "d_t_stacked": (o, taps * p.c_p)}[form]
  kern = functools.partial(_per_example_conv_kernel, taps=p.taps, ho=p.ho, wo_p=p.wo_p,
                           be=p.be, precision=precision, form=form)
  q = len(p.slabs)
  itemsize = jnp.dtype(dtype).itemsize
  zeros = (0,) * len(out_block)
  out = pl.pallas_call(
      kern,
      grid=(b_p // p.be,),
      in_specs=[
          pl.BlockSpec((p.be, q, p.rows, p.cols, p.c_p),
                       lambda i: (i, 0, 0, 0, 0)),
          pl.BlockSpec((p.be,) + dp.shape[1:], lambda i: (i, 0, 0)),
      ],
      out_specs=pl.BlockSpec((p.be,) + out_block, lambda i: (i,) + zeros),
      out_shape=jax.ShapeDtypeStruct((b_p,) + out_block, jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel",),
          vmem_limit_bytes=max(32 * 2**20, p.vmem_bytes + 16 * 2**20)),
      cost_estimate=pl.CostEstimate(
          flops=2 * b_p * taps * p.ho * p.wo_p * p.c_p * o,
          transcendentals=0,
          bytes_accessed=(xs.size + dp.size) * itemsize +
          b_p * taps * p.c_p * o * 4),
      interpret=interpret,
  )(xs, dp)
  if form == "d_t":
    out = jnp.swapaxes(out, 2, 3)
  elif form == "d_t_stacked":
    out = jnp.swapaxes(out, 1, 2).reshape(b_p, taps, p.c_p, o)
  return out[:b, :, :c, :].reshape(b, taps * c, o)
