"""Pallas TPU kernels for the sequence ghost Gram and ghost norms.

For a linear map applied at ``T`` positions per example, with inputs
``x: (B, T, N)`` and output cotangents ``d: (B, T, M)`` (example axis
first), the Gram of the per-example weight gradients is

    G[i, j] = sum_{t,s} (x_it . x_js) (d_it . d_js)                     (1)

(:mod:`gram_haiku._src.compute.kernels`, equation (1)). Its XLA path
(:func:`gram_haiku._src.compute.kernels.ghost_gram`) forms the ``(rows, T, B, T)``
kernel blocks in HBM, within a memory budget. The kernels here never
write a kernel matrix to HBM: each program of the grid forms the x- and
d-kernels of one pair of tiles of ``be`` examples x ``tp`` positions on the
MXU, in VMEM, multiplies them elementwise, reduces the product over the
tiles' positions and accumulates it into its ``(be, be)`` output block.
HBM traffic is the inputs, read once per row tile, and the ``(B, B)``
output.

Tiling of :func:`ghost_gram_pallas` (see :func:`gram_tiles`):

* the inputs are zero-padded (``B`` to a multiple of ``be``, ``T`` of
  ``tp``, ``N`` and ``M`` of 128 lanes; zero rows and positions add
  nothing) and laid out as ``(B / be, T be, F)``: example block, then
  position-major rows, so that a tile of ``tp`` positions of a block is
  one contiguous ``(tp be, F)`` matrix whose rows are ``(position,
  example)`` (no relayout in the kernel, whatever the dtype's tiling);
* the grid is ``(pairs, tp tiles, tp tiles)``: ``pairs`` lists the
  ``nb (nb + 1) / 2`` pairs of example blocks ``I <= J`` (scalar-prefetched
  tables), then the row block's position tiles ``t`` and the column
  block's ``s``; on a diagonal pair ``I = J`` only ``t <= s`` is computed
  (the tile index of a skipped step repeats the previous one, so nothing
  is fetched for it). The kernel of a tile pair with its transposed pair
  (``s``, ``t``) is the transpose, so the diagonal blocks accumulate
  ``A = sum_{t < s} R_ts + 1/2 sum_t R_tt`` and ``G = U + U^T`` where
  ``U`` holds the upper blocks (``A`` on the diagonal): exactly
  symmetric, ``(nb + 1) / 2 nb`` of the products of the full grid, and
  half of them on one block of examples;
* a program computes ``K_x = X_t X_s^T`` and ``K_d = D_t D_s^T``
  (``(tp be, tp be)``, float32 accumulation on the MXU, at ``precision``),
  ``P = K_x * K_d`` (0 where either is 0: an ``inf`` kernel entry times a
  zero cotangent's gives 0, not NaN, as in
  :func:`gram_haiku._src.compute.kernels._product_of_kernels`), sums ``P``'s
  ``tp`` row groups (sublane-aligned slices), then its column groups:
  aligned 128-lane chunks, then within a chunk by lane rotations
  (``be < 128``: the ``128 / be`` groups of a chunk, ``log2(128 / be)``
  rolls), so no product leaves VMEM and no reduction goes through the MXU
  (an ``inf`` entry stays in its own entry). The output block is
  ``(be, 128)`` lanes of which the first ``be`` are kept.

:func:`ghost_cross_pallas` is the same kernel between two sets of
examples (rows from one, columns from the other: every pair of example
blocks and of position tiles, nothing mirrored), the block
:func:`gram_haiku.cross_gram` reads.

:func:`ghost_sq_norms_pallas` computes the diagonal ``G[i, i]`` one
example at a time, over its own position tiles (``T`` rounded up to 128 or
256 positions, so that each ``(tp, tp)`` kernel fills whole lanes) and the
pairs of them ``t <= s`` (off-diagonal tile pairs counted twice), up to 8
examples per program.

Every ``jax.experimental.pallas`` import of the package is in this module
and in :mod:`gram_haiku._src.compute.pallas_conv` (an experimental API),
which shares its dtype, precision and VMEM helpers. Interpret mode (``interpret=True``) runs the same
kernels on any backend, which is how the tests check them on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gram_haiku._src.compute.plan import DEFAULT_PRECISION

#: Lanes of a TPU vector register: the feature axes are padded to a
#: multiple of it, and an output block is this wide.
LANES = 128

#: Rows ``tp * be`` a tile aims at: each step fetches one column tile,
#: ``rows (N + M)`` elements, for ``rows^2 (N + M)`` multiply-adds, so the
#: MXU's work per byte is ``rows / itemsize``; a TPU v5e's MXUs do about
#: 120 bfloat16 multiply-adds per byte of HBM bandwidth, hence 512 rows
#: (128 per byte in float32, 256 in bfloat16). The ``(rows, rows)``
#: float32 kernels take 1 MiB each in VMEM.
TARGET_ROWS = 512

#: VMEM a kernel's double-buffered tiles and intermediates may take; the
#: kernel asks Mosaic for this plus a margin (a TPU v5e core has 128 MiB).
VMEM_BUDGET_BYTES = 40 * 2**20

#: The most VMEM a kernel asks for; a layer whose smallest tiles need more
#: (float32 features ``N + M`` beyond about 45,000) is refused.
VMEM_LIMIT_BYTES = 100 * 2**20

_TOO_WIDE = (
    "{}: the smallest tile of a layer of N + M = {} features needs {} MiB "
    "of VMEM, more than the {} MiB a kernel may take (the features are not "
    "tiled). Use kernels.ghost_gram / kernels.ghost_sq_norms (XLA) for it.")

_BAD_SHAPES = (
    "ghost_gram_pallas: expected x: (B, T, N) and d: (B, T, M) with the "
    "same B and T (example axis first; kernels.linear_factors gives them), "
    "got x{} and d{}.")

_BAD_DTYPE = (
    "ghost_gram_pallas: inputs must be float32 or bfloat16 (a TPU has no "
    "float64 MXU); got {} and {}. Use kernels.ghost_gram for float64.")


@dataclasses.dataclass(frozen=True)
class Tiles:
  """A kernel's tiling.

  Attributes:
    be: examples per block (Gram: a power of two from 8 to
      :data:`LANES`; norms: 1 to 8).
    tp: positions per tile (``tp * be`` a multiple of :data:`LANES`
      where ``be < LANES``).
    b: padded examples, a multiple of ``be``.
    t: padded positions, a multiple of ``tp``.
    n: padded input features, a multiple of :data:`LANES`.
    m: padded output features, a multiple of :data:`LANES`.
    vmem_bytes: the VMEM the kernel's tiles and intermediates take.
  """
  be: int
  tp: int
  b: int
  t: int
  n: int
  m: int
  vmem_bytes: int


def round_up(v: int, k: int) -> int:
  return -(-v // k) * k


def _pow2_at_least(v: int) -> int:
  return 1 << max(0, (v - 1).bit_length())


def sublanes(dtype) -> int:
  """Rows of a native tile: 8 for 32-bit, 16 for 16-bit types."""
  return 8 * 4 // jnp.dtype(dtype).itemsize


def _gram_vmem(be, tp, n, m, itemsize) -> int:
  rows = tp * be
  tiles = 2 * 2 * rows * (n + m) * itemsize  # rows and columns, 2 buffers
  return tiles + 4 * rows * rows * 4 + 2 * be * LANES * 4


def gram_tiles(b: int, t: int, n: int, m: int, dtype,
               block_examples: Optional[int] = None,
               block_positions: Optional[int] = None) -> Tiles:
  """The tiling of :func:`ghost_gram_pallas` for ``(B, T, N)``, ``(B, T, M)``.

  ``be``: the examples (at least 8) rounded up to a power of two, at most
  :data:`LANES`; ``tp``: enough positions for
  :data:`TARGET_ROWS` rows ``tp * be``, no more than ``T`` needs, fewer
  while the tiles exceed :data:`VMEM_BUDGET_BYTES`. ``block_examples`` and
  ``block_positions`` override the choice (tests, tuning).
  """
  itemsize = jnp.dtype(dtype).itemsize
  n_p, m_p = round_up(max(n, 1), LANES), round_up(max(m, 1), LANES)
  if block_examples is None:
    be = min(LANES, max(8, _pow2_at_least(b)))
  else:
    be = block_examples
  if be > LANES or LANES % be or be % 8:
    raise ValueError(
        f"ghost_gram_pallas: block_examples={be} must divide {LANES} and be "
        "a multiple of 8.")
  unit = LANES // be  # tp * be must be a multiple of 128 lanes
  if block_positions is None:
    tp = round_up(max(1, TARGET_ROWS // be), unit)
    tp = min(tp, round_up(t, unit))
    while tp > unit and _gram_vmem(be, tp, n_p, m_p, itemsize) > (
        VMEM_BUDGET_BYTES):
      tp = max(unit, round_up(tp // 2, unit))
  else:
    tp = block_positions
  if tp % unit:
    raise ValueError(
        f"ghost_gram_pallas: block_positions={tp} must be a multiple of "
        f"{unit} with {be} examples per block (a tile's rows fill whole "
        f"{LANES}-lane groups).")
  return Tiles(be=be, tp=tp, b=round_up(b, be), t=round_up(t, tp), n=n_p,
               m=m_p, vmem_bytes=_gram_vmem(be, tp, n_p, m_p, itemsize))


def _check(x, d, name: str):
  if x.ndim != 3 or d.ndim != 3 or x.shape[:2] != d.shape[:2]:
    raise ValueError(_BAD_SHAPES.format(tuple(x.shape),
                                        tuple(d.shape)).replace(
                                            "ghost_gram_pallas", name))
  ok = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
  if jnp.dtype(x.dtype) not in ok or jnp.dtype(d.dtype) not in ok:
    raise TypeError(_BAD_DTYPE.format(jnp.dtype(x.dtype).name,
                                      jnp.dtype(d.dtype).name).replace(
                                          "ghost_gram_pallas", name))


def compute_dtype(x, d, precision: lax.Precision, interpret: bool):
  """The dtype the kernel reads: bfloat16 where both inputs are, and where
  a TPU runs it at ``DEFAULT`` precision (one bfloat16 pass of the MXU, as
  XLA's ``DEFAULT`` float32 products on a TPU: the cast ahead of the
  kernel halves its HBM and VMEM traffic); else float32 (both cast)."""
  if x.dtype == d.dtype == jnp.bfloat16:
    return jnp.dtype(jnp.bfloat16)
  if precision == lax.Precision.DEFAULT and not interpret:
    return jnp.dtype(jnp.bfloat16)
  return jnp.dtype(jnp.float32)


def mxu_precision(precision) -> lax.Precision:
  """None: the library's default (:data:`plan.DEFAULT_PRECISION`). Mosaic
  has one bf16 pass (``DEFAULT``) and float32 products (``HIGHEST``);
  ``HIGH`` takes the latter."""
  if precision is None:
    return DEFAULT_PRECISION
  if isinstance(precision, str):
    precision = lax.Precision(precision.upper())
  if isinstance(precision, (tuple, list)):
    precision = max(precision, key=lambda p: p.value)
  if precision == lax.Precision.HIGH:
    return lax.Precision.HIGHEST
  return lax.Precision(precision)


def _product(kx, kd):
  """``kx * kd``, 0 where either is 0 (kernels._product_of_kernels)."""
  return jnp.where((kx == 0) | (kd == 0), jnp.zeros_like(kx), kx * kd)


def _dot_t(a, b, precision):
  """``a @ b.T`` accumulated in float32."""
  return lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                         precision=(precision, precision),
                         preferred_element_type=jnp.float32)


def _lane_groups_sum(r, be: int):
  """``r: (be, L)`` whose lanes are ``(position, example)`` with ``be``
  examples per group -> ``(be, 128)`` whose lane ``c`` (mod ``be``) holds
  the sum over positions of column ``c``."""
  chunks = r.shape[1] // LANES
  c = r[:, :LANES]
  for k in range(1, chunks):
    c = c + r[:, k * LANES:(k + 1) * LANES]
  shift = LANES // 2
  while shift >= be:
    # The chunk is periodic with period 2 * shift here, so either
    # direction of rotation adds the same lanes.
    c = c + pltpu.roll(c, shift, 1)
    shift //= 2
  return c


def _gram_kernel(pi_ref, pj_ref, xr_ref, dr_ref, xc_ref, dc_ref, o_ref, *,
                 be: int, tp: int, precision, symmetric: bool = True):
  p, t, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  bi, bj = pi_ref[p], pj_ref[p]

  @pl.when((t == 0) & (s == 0))
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)

  # Across two sets (not symmetric) every tile pair is computed once.
  @pl.when((bi < bj) | (t <= s) | (not symmetric))
  def _():
    prod = _product(_dot_t(xr_ref[...], xc_ref[...], precision),
                    _dot_t(dr_ref[...], dc_ref[...], precision))
    r = prod[:be]
    for k in range(1, tp):  # the row tile's positions
      r = r + prod[k * be:(k + 1) * be]
    r = _lane_groups_sum(r, be)
    if not symmetric:
      o_ref[...] += r
      return
    w = jnp.where((bi == bj) & (t == s), 0.5, 1.0).astype(jnp.float32)
    o_ref[...] += w * r


def ghost_gram_pallas(x: jax.Array, d: jax.Array, *, precision=None,
                      interpret: bool = False,
                      block_examples: Optional[int] = None,
                      block_positions: Optional[int] = None) -> jax.Array:
  """The Gram (1) of a linear map's per-example weight gradients, on a TPU.

  ``G[i, j] = sum_{t,s} (x_it . x_js)(d_it . d_js)`` without any
  ``(B T, B T)`` matrix in HBM (module docstring: tiling and grid).

  Args:
    x: ``f32[B, T, N]`` or ``bf16[B, T, N]`` layer inputs, example axis
      first.
    d: ``f32[B, T, M]`` or ``bf16[B, T, M]`` output cotangents. Mixed
      dtypes are both cast to float32.
    precision: the ``lax.Precision`` of the MXU products: ``HIGHEST``
      (float32 products; ``HIGH`` means the same) or ``DEFAULT`` (on a
      TPU, float32 inputs are rounded to bfloat16 ahead of the kernel:
      one MXU pass, as XLA's ``DEFAULT``; in interpret mode they stay
      float32). None: the library's default, ``HIGHEST``. bfloat16 inputs
      are multiplied exactly either way; every product accumulates in
      float32.
    interpret: run in Pallas interpret mode (any backend; the tests).
    block_examples, block_positions: override the tiling
      (:func:`gram_tiles`).

  Returns:
    ``f32[B, B]``, exactly symmetric.

  Raises:
    ValueError: shapes other than ``(B, T, N)``, ``(B, T, M)``; a tiling
      override that does not divide the lanes; features so wide that the
      smallest tile exceeds :data:`VMEM_LIMIT_BYTES`.
    TypeError: dtypes other than float32 and bfloat16.
  """
  return _ghost_pallas(x, d, None, None, precision, interpret,
                       block_examples, block_positions, "ghost_gram_pallas")


def ghost_cross_pallas(x: jax.Array, d: jax.Array, x2: jax.Array,
                       d2: jax.Array, *, precision=None,
                       interpret: bool = False,
                       block_examples: Optional[int] = None,
                       block_positions: Optional[int] = None) -> jax.Array:
  """The block of (1) between two sets of examples, on a TPU:
  ``G[i, q] = sum_{t,s} (x_it . x2_qs)(d_it . d2_qs)`` (the kernel of
  :func:`ghost_gram_pallas` over every pair of example blocks, rows from
  ``x, d``, columns from ``x2, d2``, nothing mirrored).

  Args:
    x, d: ``[B, T, N]``, ``[B, T, M]``: the rows' inputs and cotangents.
    x2, d2: ``[V, T, N]``, ``[V, T, M]``: the columns'.
    precision, interpret, block_examples, block_positions: as
      :func:`ghost_gram_pallas`.

  Returns:
    ``f32[B, V]``.

  Raises:
    As :func:`ghost_gram_pallas`, and ValueError where the two sets differ
    in anything but their number of examples.
  """
  _check(x2, d2, "ghost_cross_pallas")
  if x2.shape[1:] != x.shape[1:] or d2.shape[1:] != d.shape[1:]:
    raise ValueError(
        f"ghost_cross_pallas: the column set's shapes {tuple(x2.shape)}, "
        f"{tuple(d2.shape)} differ from the rows' {tuple(x.shape)}, "
        f"{tuple(d.shape)} in more than the number of examples.")
  return _ghost_pallas(x, d, x2, d2, precision, interpret, block_examples,
                       block_positions, "ghost_cross_pallas")


def _ghost_pallas(x, d, x2, d2, precision, interpret, block_examples,
                  block_positions, name: str) -> jax.Array:
  """:func:`ghost_gram_pallas` (``x2`` None: the symmetric Gram of ``x,
  d``) or :func:`ghost_cross_pallas` (the block against ``x2, d2``)."""
  _check(x, d, name)
  symmetric = x2 is None
  if symmetric:
    x2, d2 = x, d
  b, t, n = x.shape
  v = x2.shape[0]
  m = d.shape[-1]
  if b == 0 or v == 0 or t == 0 or n == 0 or m == 0:
    return jnp.zeros((b, v), jnp.float32)
  precision = mxu_precision(precision)
  dtype = max(compute_dtype(x, d, precision, interpret),
              compute_dtype(x2, d2, precision, interpret),
              key=lambda dt: dt.itemsize)  # float32 unless both say bf16
  if dtype == jnp.bfloat16:  # exact products in one pass
    precision = lax.Precision.DEFAULT
  tiles = gram_tiles(max(b, v), t, n, m, dtype, block_examples,
                     block_positions)
  be, tp = tiles.be, tiles.tp
  nt = tiles.t // tp
  rows_b, cols_b = round_up(b, be), round_up(v, be)
  nb, nc = rows_b // be, cols_b // be

  def layout(a, f, bp):  # (B, T, F) -> (B' / be, T' be, F') zero-padded
    a = jnp.pad(a.astype(dtype), ((0, bp - a.shape[0]), (0, tiles.t - t),
                                  (0, f - a.shape[-1])))
    a = jnp.transpose(a.reshape(bp // be, be, tiles.t, f), (0, 2, 1, 3))
    return a.reshape(bp // be, tiles.t * be, f)
  xt, dt = layout(x, tiles.n, rows_b), layout(d, tiles.m, rows_b)
  xc, dc = ((xt, dt) if symmetric else
            (layout(x2, tiles.n, cols_b), layout(d2, tiles.m, cols_b)))

  pairs = ([(i, j) for i in range(nb) for j in range(i, nb)] if symmetric
           else [(i, j) for i in range(nb) for j in range(nc)])
  pi = jnp.asarray([i for i, _ in pairs], jnp.int32)
  pj = jnp.asarray([j for _, j in pairs], jnp.int32)

  def row_map(p, t_, s_, pi_ref, pj_ref):
    del s_, pj_ref
    return pi_ref[p], t_, 0

  def col_map(p, t_, s_, pi_ref, pj_ref):
    # A skipped step (diagonal pair, t > s) names the tile of the step
    # before it (s = t), so nothing is fetched for it.
    if symmetric:
      s_ = jnp.where(pi_ref[p] == pj_ref[p], jnp.maximum(s_, t_), s_)
    return pj_ref[p], s_, 0

  def out_map(p, t_, s_, pi_ref, pj_ref):
    del t_, s_
    return pi_ref[p], pj_ref[p]

  spec = lambda f, index: pl.BlockSpec((pl.squeezed, tp * be, f), index)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(len(pairs), nt, nt),
      in_specs=[spec(tiles.n, row_map), spec(tiles.m, row_map),
                spec(tiles.n, col_map), spec(tiles.m, col_map)],
      out_specs=pl.BlockSpec((be, LANES), out_map))
  kernel = functools.partial(_gram_kernel, be=be, tp=tp, precision=precision,
                             symmetric=symmetric)
  itemsize = dtype.itemsize
  flops = 2 * len(pairs) * nt * nt * (tp * be) ** 2 * (tiles.n + tiles.m)
  out = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct((rows_b, nc * LANES), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=vmem_limit(tiles.vmem_bytes, name, n + m)),
      cost_estimate=pl.CostEstimate(
          flops=flops, transcendentals=0,
          bytes_accessed=(nb * nt + len(pairs) * nt * nt) * tp * be * (
              tiles.n + tiles.m) * itemsize + rows_b * nc * LANES * 4),
      interpret=interpret,
  )(pi, pj, xt, dt, xc, dc)
  u = out.reshape(nb, be, nc, LANES)[..., :be].reshape(rows_b, cols_b)
  if not symmetric:
    return u[:b, :v]
  # The (B', B') upper blocks; the lower ones were never written.
  upper = jnp.arange(nb)[:, None] <= jnp.arange(nb)[None, :]
  u = jnp.where(upper.repeat(be, 0).repeat(be, 1), u, 0.0)
  return (u + u.T)[:b, :b]


def vmem_limit(need: int, name: str, features: int) -> int:
  limit = max(32 * 2**20, need + 16 * 2**20)
  if limit > VMEM_LIMIT_BYTES:
    raise ValueError(_TOO_WIDE.format(name, features, need >> 20,
                                      VMEM_LIMIT_BYTES >> 20))
  return int(limit)


# -- The diagonal. ----------------------------------------------------------


def _norms_vmem(eb, tp, n, m, itemsize) -> int:
  return 2 * 2 * eb * tp * (n + m) * itemsize + 4 * tp * tp * 4


def norm_tiles(b: int, t: int, n: int, m: int, dtype,
               block_positions: Optional[int] = None):
  """``(examples per block, tiles)`` of :func:`ghost_sq_norms_pallas`:
  ``tp`` positions (``T`` rounded up to 128, at most 256: the ``(tp, tp)``
  kernels fill whole lanes), as many examples (up to 8) as fit
  :data:`VMEM_BUDGET_BYTES`. ``block_positions`` overrides ``tp`` (a
  multiple of 8 sublanes, 16 for bfloat16)."""
  itemsize = jnp.dtype(dtype).itemsize
  n_p, m_p = round_up(max(n, 1), LANES), round_up(max(m, 1), LANES)
  sub = sublanes(dtype)
  if block_positions is None:
    tp = min(round_up(t, LANES), 2 * LANES)
    if tp > LANES and _norms_vmem(1, tp, n_p, m_p, itemsize) > (
        VMEM_BUDGET_BYTES):
      tp = LANES
  else:
    tp = block_positions
  if tp % sub:
    raise ValueError(
        f"ghost_sq_norms_pallas: block_positions={tp} must be a multiple "
        f"of {sub} for {jnp.dtype(dtype).name}.")
  eb = 8
  while eb > 1 and _norms_vmem(eb, tp, n_p, m_p, itemsize) > (
      VMEM_BUDGET_BYTES):
    eb //= 2
  eb = min(eb, b)
  return eb, Tiles(be=eb, tp=tp, b=round_up(b, eb), t=round_up(t, tp),
                   n=n_p, m=m_p,
                   vmem_bytes=_norms_vmem(eb, tp, n_p, m_p, itemsize))


def _norms_kernel(xr_ref, dr_ref, xc_ref, dc_ref, o_ref, *, eb: int,
                  precision):
  t, s = pl.program_id(1), pl.program_id(2)

  @pl.when((t == 0) & (s == 0))
  def _():
    o_ref[...] = jnp.zeros_like(o_ref)

  @pl.when(t <= s)
  def _():
    # A tile pair and its transpose have the same sum: off-diagonal pairs
    # count twice.
    w = jnp.where(t == s, 1.0, 2.0).astype(jnp.float32)
    for e in range(eb):
      prod = _product(_dot_t(xr_ref[e], xc_ref[e], precision),
                      _dot_t(dr_ref[e], dc_ref[e], precision))
      v = jnp.sum(jnp.sum(prod, axis=0, keepdims=True), axis=1,
                  keepdims=True)  # (1, 1)
      o_ref[0, e:e + 1, :] += w * jnp.broadcast_to(v, (1, LANES))


def ghost_sq_norms_pallas(x: jax.Array, d: jax.Array, *, precision=None,
                          interpret: bool = False,
                          block_positions: Optional[int] = None
                          ) -> jax.Array:
  """The diagonal of (1): ``|g_i|^2 = sum_{t,s} (x_it . x_is)(d_it . d_is)``.

  Args and dtypes as :func:`ghost_gram_pallas`. Each program takes up to
  8 examples and one pair of ``tp``-position tiles ``t <= s`` (grid
  ``(example blocks, tiles, tiles)``), forming each example's ``(tp, tp)``
  kernels in VMEM.

  Returns:
    ``f32[B]``.

  Raises:
    As :func:`ghost_gram_pallas`.
  """
  _check(x, d, "ghost_sq_norms_pallas")
  b, t, n = x.shape
  m = d.shape[-1]
  if b == 0 or t == 0 or n == 0 or m == 0:
    return jnp.zeros((b,), jnp.float32)
  precision = mxu_precision(precision)
  dtype = compute_dtype(x, d, precision, interpret)
  if dtype == jnp.bfloat16:  # exact products in one pass
    precision = lax.Precision.DEFAULT
  eb, tiles = norm_tiles(b, t, n, m, dtype, block_positions)
  tp = tiles.tp
  ne, nt = tiles.b // eb, tiles.t // tp

  def pad(a, f):
    return jnp.pad(a.astype(dtype), ((0, tiles.b - b), (0, tiles.t - t),
                                     (0, f - a.shape[-1])))
  xp, dp = pad(x, tiles.n), pad(d, tiles.m)
  row = lambda f: pl.BlockSpec((eb, tp, f), lambda e, t_, s_: (e, t_, 0))
  col = lambda f: pl.BlockSpec(
      (eb, tp, f), lambda e, t_, s_: (e, jnp.maximum(s_, t_), 0))
  itemsize = dtype.itemsize
  out = pl.pallas_call(
      functools.partial(_norms_kernel, eb=eb, precision=precision),
      grid=(ne, nt, nt),
      in_specs=[row(tiles.n), row(tiles.m), col(tiles.n), col(tiles.m)],
      out_specs=pl.BlockSpec((1, eb, LANES), lambda e, t_, s_: (e, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((ne, eb, LANES), jnp.float32),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=vmem_limit(
              tiles.vmem_bytes, "ghost_sq_norms_pallas", n + m)),
      cost_estimate=pl.CostEstimate(
          flops=2 * tiles.b * tiles.t * tiles.t * (tiles.n + tiles.m),
          transcendentals=0,
          bytes_accessed=(nt + 1) * tiles.b * tiles.t * (
              tiles.n + tiles.m) * itemsize),
      interpret=interpret,
  )(xp, dp, xp, dp)
  return out[:, :, 0].reshape(-1)[:b]
