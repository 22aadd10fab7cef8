"""Kernels: Gram matrices of per-example weight gradients of linear maps.

For a linear map ``y_t = x_t @ W`` applied at ``T`` within-example positions
``t`` (sequence steps, spatial positions, inner vmap axes), the per-example
gradient of ``W`` for example ``i`` is ``g_i = sum_t x_it^T d_it`` where
``d_it = dL/dy_it`` is the output cotangent. Its Gram matrix is

    G[i, j] = <g_i, g_j>_F = sum_{t,s} (x_it . x_js) (d_it . d_js)        (1)

Two ways to evaluate (1):

* **ghost** (Goodfellow 2015, "Efficient per-example gradient computations";
  Li et al. 2022, "Large language models can be strong differentially private
  learners", ghost clipping): contract the two kernel matrices
  ``K_x = X X^T`` and ``K_d = D D^T`` over positions. Cost ``~B^2 T^2 (N+M)``
  multiply-adds, memory ``B T B T`` per block of rows.
* **materialise**: form ``g_i`` (``B x N x M``), then ``F F^T``.
  Cost ``~B T N M + B^2 N M``, memory ``B N M``.

The bias gradient is ``sum_t d_it``, so its Gram is ``D_b D_b^T`` with
``D_b[i] = sum_t d_it``.

Everything here accumulates in at least float32 (float64 for float64 inputs),
whatever the input dtype, at ``KernelConfig.precision``: ``HIGHEST`` by
default, so that float32 matmuls are not silently done in TF32/bf16 passes
on accelerators (``track(gram_precision="default")`` trades that for
speed).

Every kernel takes what it needs as arguments: the shapes come from its
inputs, the method from :mod:`gram_haiku._src.compute.cost_model` (decided once per
application by the op), and a :class:`KernelConfig` says over which mesh axes
the Gram's columns are gathered and how much memory a block may take.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import example_sharding
from gram_haiku._src.compute import explicit_mesh
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute.explicit_mesh import rows_sharding
from gram_haiku._src.compute.plan import DEFAULT_MEMORY_BUDGET_BYTES
from gram_haiku._src.compute.plan import DEFAULT_PRECISION


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """What a Gram kernel needs beyond its inputs.

  Attributes:
    column_axes: mesh axes (inside ``shard_map``) whose devices hold the
      other examples: the Gram's column factors are gathered over them and
      the kernel returns this device's rows ``(b, B)``. ``()``: one device
      holds every example.
    memory_budget_bytes: the largest intermediate a kernel builds at once.
    method: the method a rule's functions use (``"ghost"``,
      ``"materialize"``, ...), as the rule's cost function decided it once
      for this application (:mod:`gram_haiku._src.ops.modes`); None: not
      decided yet (a rule's function then consults its cost function).
    precision: the ``lax.Precision`` of every product a kernel forms
      (:attr:`gram_haiku._src.compute.plan.Plan.precision`).
    upper_bound: squared norms are wanted as sound upper bounds of the
      exact values (a clip factor's input; see
      :mod:`gram_haiku._src.compute.norm_bounds`), not as the nearest estimate.
    row_split: a block across two sets of examples: the Gram's rows are
      the first ``row_split`` examples of the factors and its columns the
      others, ``G[:s, s:]`` (:func:`gram_haiku.cross_gram`: training
      examples against queries); None: the whole Gram. Every Gram kernel
      takes its rows through :meth:`rows` and its columns through
      :meth:`columns`, so a rule's ``gram`` gives the block unchanged.
  """
  column_axes: tuple[str, ...] = ()
  memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
  method: Optional[str] = None
  precision: lax.Precision = DEFAULT_PRECISION
  upper_bound: bool = False
  row_split: Optional[int] = None

  def replace(self, **changes) -> "KernelConfig":
    return dataclasses.replace(self, **changes)

  def rows(self, a: jax.Array) -> jax.Array:
    """The row factor of a Gram: ``a`` (example axis 0), its first
    :attr:`row_split` examples where there is a split."""
    return a if self.row_split is None else a[:self.row_split]

  def columns(self, a: jax.Array) -> jax.Array:
    """The column factor of a Gram: ``a`` (example axis 0) from every device.

    ``f[b, ...] -> f[B, ...]`` by a tiled ``all_gather`` over
    :attr:`column_axes`; ``a`` itself when there are none; the examples
    after :attr:`row_split` where there is a split.
    """
    if self.row_split is not None:
      a = a[self.row_split:]
    axes = self.column_axes
    if not axes:
      return a
    return lax.all_gather(a, axes if len(axes) > 1 else axes[0], axis=0,
                          tiled=True)

  def row_count(self, rows: int) -> int:
    """Rows of a Gram block of factors with ``rows`` local examples."""
    return rows if self.row_split is None else self.row_split

  def column_count(self, rows: int) -> int:
    """Columns of a Gram block of factors with ``rows`` local examples."""
    if self.row_split is not None:
      rows = rows - self.row_split
    return rows * example_sharding.axes_size(self.column_axes)


#: The configuration of a single-device Gram with the default budget.
LOCAL = KernelConfig()


def accumulation_dtype(*dtypes) -> jnp.dtype:
  """float32, or float64 when any input is float64 (under ``jax_enable_x64``)."""
  out = jnp.dtype(jnp.float32)
  for dt in dtypes:
    if jnp.dtype(dt) == jnp.float64:
      out = jnp.dtype(jnp.float64)
  return out


def is_float(dtype) -> bool:
  """Whether ``dtype`` is a floating (or complex) type: bfloat16 and float8
  included, which numpy's own ``issubdtype`` does not count as inexact."""
  return jnp.issubdtype(dtype, jnp.inexact)


def check_mergeable(n, shape) -> None:
  """Raises a clear error where ``jax.export``'s shape polymorphism cannot
  merge a layer's within-example positions into the one axis its Gram
  sums over: ``n`` positions (of an array of ``shape``), a product of
  symbolic sizes such as ``(h - 2) (w - 2)`` that JAX cannot prove
  non-negative from the bounds of each. Known sizes pass unchecked.

  Raises:
    ValueError: naming the constraint to add.
  """
  if isinstance(n, int):
    return
  try:
    bool(n >= 0)
  except Exception as e:  # pylint: disable=broad-except
    if type(e).__name__ != "InconclusiveDimensionOperation":
      raise
    raise ValueError(
        f"gram_haiku: a tracked layer has {n} positions per example (an "
        f"array of shape {tuple(shape)}), a product of symbolic sizes "
        "(jax.export) that JAX cannot prove non-negative, so it cannot "
        "merge them into the one axis the Gram sums over.\n"
        f"What to do: add the constraint \"{n} >= 1\" to "
        "jax.export.symbolic_shape(..., constraints=...), or export with "
        "all but one of those sizes fixed.") from None


def rows(a: jax.Array, *tail: int) -> jax.Array:
  """``a: (B, ...)`` as ``(B, n, *tail)``: ``reshape(B, -1, *tail)`` that
  also holds for an empty batch (``B = 0``) or an empty tail (a layer
  without inputs: zero features), where ``-1`` is undefined. With an empty
  tail, ``a``'s own trailing axes are the tail and ``n`` merges the rest.

  Raises:
    ValueError: where ``n`` is symbolic and cannot be merged
      (:func:`check_mergeable`).
  """
  k = len(tail)
  if (k and all(isinstance(v, int) for v in tail) and math.prod(tail) == 0
      and tuple(a.shape[a.ndim - k:]) == tuple(tail)):
    n = math.prod(a.shape[1:a.ndim - k])
  else:
    n = math.prod(a.shape[1:]) // max(math.prod(tail), 1)
  check_mergeable(n, a.shape)
  return a.reshape((a.shape[0], n) + tuple(tail))


def to_example_major(a: jax.Array, example_dim: int) -> jax.Array:
  """``(..., F)`` with the example axis at ``example_dim`` -> ``(B, T, F)``.

  ``T`` is the product of every other leading axis (the within-example axes).
  """
  a = jnp.moveaxis(a, example_dim, 0)
  return rows(a, a.shape[-1])



def example_sum(a: jax.Array,
                precision: lax.Precision = DEFAULT_PRECISION) -> jax.Array:
  """``a.sum(axis=0)`` (the example axis), as a matrix-vector product.

  Summing materialised per-example gradients gives the weight gradient. On
  XLA's CPU backend a reduction over the leading axis of ``(B, N, M)`` ran
  about 3x slower than the matmul that produced it (``benchmarks``, LM
  layers), while ``ones(B) @ a`` runs at memory speed. At ``HIGHEST``
  precision (default) the sum is exact in float32 on accelerators too.
  """
  b = a.shape[0]
  flat = explicit_mesh.reshape_rows(a, (b, math.prod(a.shape[1:])))
  ones = jnp.ones((b,), a.dtype)
  out_sharding = (None if explicit_mesh.explicit_spec(a) is None
                  else jax.sharding.PartitionSpec(None))
  out = jnp.matmul(ones, flat, precision=precision, out_sharding=out_sharding)
  return out.reshape(a.shape[1:])



def _ghost_rows(xi, di, x, d, precision):
  """Rows ``i`` of (1): ``xi: (R, T, N)``, ``x: (B, T, N)`` -> ``(R, B)``."""
  acc = x.dtype
  kx = jnp.einsum("itn,jsn->itjs", xi, x, precision=precision,
                  preferred_element_type=acc,
                  out_sharding=rows_sharding(xi, 4))
  kd = jnp.einsum("itm,jsm->itjs", di, d, precision=precision,
                  preferred_element_type=acc,
                  out_sharding=rows_sharding(di, 4))
  return jnp.sum(_product_of_kernels(kx, kd), axis=(1, 3))



def blocked(arrays, size):
  """Pads the leading axis of each array to a multiple of ``size`` and
  splits it: ``(n, ...) -> (ceil(n / size), size, ...)``; ``n`` may be
  symbolic (``jax.export``)."""
  n = arrays[0].shape[0]
  n_blocks = (n + size - 1) // size
  pad = n_blocks * size - n
  out = []
  for a in arrays:
    a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    out.append(a.reshape((n_blocks, size) + a.shape[1:]))
  return tuple(out)



def rows_per_block(n_rows, per_row_bytes: int, budget: int) -> int:
  """Rows of a block of ``n_rows`` whose intermediates, ``per_row_bytes``
  each, fit ``budget`` bytes: at least 1, at most ``n_rows`` (a symbolic
  count as :data:`cost_model.SYMBOLIC_SIZE`). The one rule of every loop
  over blocks of examples (:func:`map_row_blocks`)."""
  return max(1, min(cost_model.size_hint(n_rows),
                    budget // max(per_row_bytes, 1)))


def map_row_blocks(fn, rows: int, arrays):
  """``fn`` over blocks of ``rows`` leading entries of ``arrays``, stacked
  (``fn`` may return a pytree of arrays, each with the rows leading).
  A symbolic number of entries counts as :data:`cost_model.SYMBOLIC_SIZE`
  in the choice to block."""
  b = arrays[0].shape[0]
  if rows >= cost_model.size_hint(b):
    return fn(*arrays)
  out = lax.map(lambda blk: fn(*blk), blocked(arrays, rows))
  return jax.tree.map(lambda o: o.reshape((-1,) + o.shape[2:])[:b], out)



def map_row_slices(fn, rows: int, arrays):
  """``fn`` over blocks of at most ``rows`` leading entries of ``arrays``,
  ``fn`` giving a pytree of arrays with the entries leading (``(B,)``:
  one value per entry; ``(B, ...)``: a row per entry). Unlike
  :func:`map_row_blocks` it reads the blocks in place (dynamic slices; the
  blocks are of one size, as even as their number allows, and the last
  starts early and overlaps, recomputing entries), without a padded copy
  of every array: for the rare fallbacks of :func:`run_if`, and for rows
  as large as the inputs (a getter's pull-back)."""
  b = arrays[0].shape[0]
  if not isinstance(b, int) or rows >= b:
    return fn(*arrays)
  n_blocks = -(-b // rows)
  rows = -(-b // n_blocks)

  def body(i, out):
    start = jnp.minimum(i * rows, b - rows)
    blk = [lax.dynamic_slice_in_dim(a, start, rows) for a in arrays]
    return jax.tree.map(
        lambda o, v: lax.dynamic_update_slice_in_dim(o, v.astype(o.dtype),
                                                     start, 0),
        out, fn(*blk))
  first = jax.eval_shape(fn, *[a[:rows] for a in arrays])
  out = jax.tree.map(lambda s: hx.vary_like(
      jnp.zeros((b,) + s.shape[1:], s.dtype), *arrays), first)
  return lax.fori_loop(0, n_blocks, body, out)


def map_pair_blocks(fn, row_arrays, col_arrays, per_pair_bytes: int,
                    cfg: KernelConfig):
  """``G[i, j] = fn(rows i, columns j)`` in blocks within the memory budget.

  ``fn(*row_block, *col_block) -> (R, C)``; one ``(row, column)`` pair needs
  ``per_pair_bytes`` of intermediates. Rows are taken in blocks whose pairs
  with every column fit ``cfg.memory_budget_bytes``; when not even one row
  does, one row at a time, its columns in blocks (``lax.map`` over both).
  The columns are ``cfg.columns`` of ``col_arrays`` (every device's examples
  under ``shard_map``).
  """
  row_arrays = tuple(cfg.rows(a) for a in row_arrays)
  b = row_arrays[0].shape[0]
  budget = cfg.memory_budget_bytes
  col_arrays = tuple(cfg.columns(a) for a in col_arrays)
  c = col_arrays[0].shape[0]  # B; more than b under shard_map
  if b == 0 or c == 0:  # An empty batch: nothing to block.
    return fn(*row_arrays, *col_arrays)
  per_pair = max(per_pair_bytes, 1)
  b_hint, c_hint = cost_model.size_hint(b), cost_model.size_hint(c)
  if c_hint * per_pair <= budget:
    rows = max(1, min(b_hint, budget // (c_hint * per_pair)))
    return map_row_blocks(lambda *r: fn(*r, *col_arrays), rows, row_arrays)
  cols = max(1, min(c_hint, budget // per_pair))
  col_blocks = blocked(col_arrays, cols)

  def one_row(*r):
    out = lax.map(lambda cb: fn(*r, *cb), col_blocks)  # (n_blocks, 1, cols)
    return jnp.moveaxis(out, 0, 1).reshape(1, -1)[:, :c]
  return map_row_blocks(one_row, 1, row_arrays)



def map_symmetric_pairs(fn, arrays, col_index: tuple[int, ...],
                        per_pair_bytes: int, cfg: KernelConfig):
  """:func:`map_pair_blocks` for a symmetric kernel of one set of examples.

  ``fn(*row_block, *col_block) -> (R, C)`` with the rows ``arrays`` and
  the columns ``arrays[k] for k in col_index``, and ``G[i, j] = G[j, i]``.
  Where :func:`uses_symmetry` holds and the program is compiled for the
  CPU, the pairs of example blocks ``I <= J`` only (10 of 16), one after
  the other in a ``lax.scan`` (so that one pair's intermediates, within the
  memory budget, are live at a time), each diagonal block averaged with
  its transpose (a sum over pairs of positions is symmetric only up to
  rounding), the lower blocks mirrored; elsewhere :func:`map_pair_blocks`
  over all pairs.
  """
  def pairs(*blocks):
    rows, cols = blocks[:len(arrays)], blocks[len(arrays):]
    return map_pair_blocks(fn, rows, tuple(cols[k] for k in col_index),
                           per_pair_bytes, cfg)
  if not uses_symmetry(cfg, *arrays):
    return pairs(*arrays, *arrays)
  return lax.platform_dependent(
      *arrays, cpu=lambda *a: _scanned_upper_blocks(pairs, a),
      default=lambda *a: pairs(*a, *a))


def _scanned_upper_blocks(fn, arrays) -> jax.Array:
  """:func:`symmetric_blocks` with the block pairs in a ``lax.scan`` and
  each diagonal block averaged with its transpose (halves first: no
  overflow of the sum); the examples zero-padded to ``n`` equal blocks (the
  padding's rows and columns are dropped at the end)."""
  b = arrays[0].shape[0]
  n = max(1, min(SYMMETRIC_BLOCKS, b))
  size = -(-b // n)
  split = blocked(arrays, size)  # (n, size, ...) each
  upper = [(i, j) for i in range(n) for j in range(i, n)]
  rows = jnp.asarray([i for i, _ in upper])
  cols = jnp.asarray([j for _, j in upper])

  def one(_, ij):
    i, j = ij
    g = fn(*(a[i] for a in split), *(a[j] for a in split))
    return None, jnp.where(i == j, 0.5 * g + 0.5 * g.T, g)
  _, out = lax.scan(one, None, (rows, cols))  # (pairs, size, size)
  index = {ij: k for k, ij in enumerate(upper)}
  return _from_upper_blocks(lambda i, j: out[index[i, j]], n)[:b, :b]


def _from_upper_blocks(block, n: int) -> jax.Array:
  """The ``n x n`` block matrix whose upper blocks ``I <= J`` are
  ``block(I, J)`` and whose lower ones mirror them: ``G[J, I] = G[I, J]^T``."""
  return jnp.block([[block(i, j) if i <= j else block(j, i).T
                     for j in range(n)] for i in range(n)])


def _ghost_time_blocked(xi, di, xj, dj, tau: int, precision):
  """:func:`_ghost_rows` summed over pairs of ``tau``-position blocks.

  For ``T`` so long that even one pair's ``(1, T, 1, T)`` kernels exceed the
  budget: (1) is a sum over ``(t, s)``, so it splits into blocks of
  positions; zero padding adds nothing.
  """
  t = xi.shape[1]
  nt = (t + tau - 1) // tau  # ceil(t / tau), also for a symbolic t
  pad = nt * tau - t

  def split(a):  # (R, T, F) -> (nt, R, tau, F)
    a = jnp.pad(a, ((0, 0), (0, pad), (0, 0)))
    return jnp.moveaxis(a.reshape(a.shape[0], nt, tau, a.shape[-1]), 1, 0)
  xib, dib, xjb, djb = split(xi), split(di), split(xj), split(dj)

  def over_rows(acc, row_block):  # One block of positions of the rows...
    def over_cols(acc, col_block):  # ...against each block of the columns'.
      return acc + _ghost_rows(*row_block, *col_block, precision), None
    return lax.scan(over_cols, acc, (xjb, djb))[0], None
  init = jnp.zeros((xi.shape[0], xj.shape[0]), xi.dtype)
  return lax.scan(over_rows, init, (xib, dib))[0]



#: The fewest examples for which a Gram compiled for the CPU is formed by
#: :func:`symmetric_blocks` (only its upper block triangle). Measured on a
#: 2-core CPU, the MLP 784-512-512-10's layer Grams took 0.69-0.77x the full
#: products' time at ``B = 1024 ... 4096`` and no less at ``B <= 512``,
#: where the extra passes over the ``[B, B]`` blocks eat the saved products.
#: On a TPU v5e the same blocks saved 0-5% at ``HIGHEST`` and cost 10-40%
#: more at ``DEFAULT`` precision (the products are cheap there and the
#: passes are not), so other platforms keep the full products.
SYMMETRIC_MIN_ROWS = 1024

#: Blocks per side in :func:`symmetric_blocks`: 10 products of 16, at
#: ``(B/4)^2`` each (8 per side measured no faster, with 3.6x the ops).
SYMMETRIC_BLOCKS = 4


def uses_symmetry(cfg: KernelConfig, *arrays: jax.Array) -> bool:
  """Whether a Gram of ``arrays`` (rows = columns) is formed by
  :func:`symmetric_gram`'s blocks when compiled for the CPU: on one device's
  examples (no gathered columns, no Explicit sharding) and at least
  :data:`SYMMETRIC_MIN_ROWS` of them, a known number (a symbolic batch
  size, from ``jax.export``, keeps the full products)."""
  b = arrays[0].shape[0]
  return (not cfg.column_axes and cfg.row_split is None and isinstance(b, int)
          and b >= SYMMETRIC_MIN_ROWS
          and all(explicit_mesh.explicit_spec(a) is None for a in arrays))


def symmetric_gram(fn, arrays) -> jax.Array:
  """``fn(*arrays, *arrays)``, from :func:`symmetric_blocks` where the
  program is compiled for the CPU (``lax.platform_dependent``: the choice is
  made when lowering, and the other platforms get the full products).
  The caller checks :func:`uses_symmetry` first."""
  return lax.platform_dependent(
      *arrays, cpu=lambda *a: symmetric_blocks(fn, a),
      default=lambda *a: fn(*a, *a))


def symmetric_blocks(fn, arrays, n_blocks: Optional[int] = None
                     ) -> jax.Array:
  """``G[i, j] = fn(rows i, rows j)`` for a symmetric ``fn``, from its upper
  block triangle.

  The examples are cut into ``n_blocks`` nearly equal blocks; ``fn`` is
  evaluated on the ``n (n + 1) / 2`` pairs of blocks ``I <= J`` and
  ``G[J, I] = G[I, J]^T``: ``(n + 1) / 2n`` of the products (10 of 16 for
  ``n = 4``), and ``G`` is exactly symmetric.

  Args:
    fn: ``fn(*row_block, *col_block) -> (R, C)``, with
      ``fn(a, b) = fn(b, a)^T`` (a Gram kernel of the pair's examples).
    arrays: the factors, example axis first, all with ``B`` rows.
    n_blocks: blocks per side; None: :data:`SYMMETRIC_BLOCKS`.

  Returns:
    ``(B, B)``.
  """
  b = arrays[0].shape[0]
  n = max(1, min(SYMMETRIC_BLOCKS if n_blocks is None else n_blocks, b))
  bounds = [round(k * b / n) for k in range(n + 1)]

  def block(a, k):
    return a[bounds[k]:bounds[k + 1]]
  upper = {}
  for i in range(n):
    for j in range(i, n):
      upper[i, j] = fn(*(block(a, i) for a in arrays),
                       *(block(a, j) for a in arrays))
  return _from_upper_blocks(lambda i, j: upper[i, j], n)


def _product_of_kernels(kx: jax.Array, kd: jax.Array) -> jax.Array:
  """``kx * kd``, 0 where either is 0: a zero cotangent (a masked-out or
  padding row) gives a zero gradient even where the input's kernel
  overflowed (``inf * 0``), as the per-example gradient ``x^T d`` does."""
  return jnp.where((kx == 0) | (kd == 0), jnp.zeros_like(kx), kx * kd)


def ghost_gram(x: jax.Array, d: jax.Array, cfg: KernelConfig) -> jax.Array:
  """Weight Gram (1) by the ghost method.

  Args:
    x: ``(B, T, N)`` layer inputs, example axis first, in the accumulation
      dtype.
    d: ``(B, T, M)`` output cotangents, same dtype.

  Returns:
    ``(B, B)`` Gram in the dtype of ``x`` (``(b, B)`` rows under
    ``shard_map``). Never builds more than ``cfg.memory_budget_bytes`` of
    ``(rows, T, cols, T)`` kernel blocks at once: blocked over rows, then
    over columns (:func:`map_pair_blocks`), then over blocks of positions
    when one pair's ``(T, T)`` kernels alone exceed the budget.
  """
  _, t, _ = x.shape
  if t == 1:
    return _one_position_ghost_gram(x[:, 0], d[:, 0], False, cfg)
  # Examples spread over devices (shard_map's columns, an Explicit mesh,
  # whose sharding types the kernel's own ops do not carry): XLA's path,
  # which lays its blocks out over the mesh.
  spread = bool(cfg.column_axes) or explicit_mesh.under_explicit_mesh()
  platforms = cost_model.pallas_ghost_gram_platforms(x, d, spread)
  if not platforms:
    return _xla_ghost_gram(x, d, cfg)
  # The Pallas kernel where the cost model measured it faster (one branch
  # per platform, the others lowered only for their own platforms).
  xla = lambda x, d: _xla_ghost_gram(x, d, cfg)

  def pallas(platform):
    @jax.custom_jvp
    def gram(x, d):
      from gram_haiku._src.compute import pallas_ghost  # pylint: disable=g-import-not-at-top
      interpret = platform != "tpu"
      if cfg.row_split is not None:  # A block across two sets.
        return pallas_ghost.ghost_cross_pallas(
            cfg.rows(x), cfg.rows(d), cfg.columns(x), cfg.columns(d),
            precision=cfg.precision, interpret=interpret).astype(x.dtype)
      return pallas_ghost.ghost_gram_pallas(
          x, d, precision=cfg.precision, interpret=interpret).astype(x.dtype)

    @gram.defjvp
    def _(primals, tangents):  # The kernel has no JVP: XLA's path's.
      return jax.jvp(xla, primals, tangents)
    return gram
  return lax.platform_dependent(x, d, default=xla,
                                **{p: pallas(p) for p in platforms})


def _xla_ghost_gram(x: jax.Array, d: jax.Array,
                    cfg: KernelConfig) -> jax.Array:
  """:func:`ghost_gram` by XLA's ops, in blocks within the memory
  budget."""
  _, t, _ = x.shape
  itemsize = jnp.dtype(x.dtype).itemsize
  budget = cfg.memory_budget_bytes
  t_hint = cost_model.size_hint(t)
  per_pair = 2 * t_hint * t_hint * itemsize  # kx and kd for one pair (i, j)
  precision = cfg.precision
  if per_pair <= budget:
    return map_symmetric_pairs(
        lambda xi, di, xj, dj: _ghost_rows(xi, di, xj, dj, precision),
        (x, d), (0, 1), per_pair, cfg)
  tau = max(1, math.isqrt(budget // (2 * itemsize)))
  return map_symmetric_pairs(
      lambda xi, di, xj, dj: _ghost_time_blocked(xi, di, xj, dj, tau,
                                                 precision),
      (x, d), (0, 1), 2 * tau * tau * itemsize, cfg)



def _one_position_ghost_gram(x: jax.Array, d: jax.Array, with_bias: bool,
                             cfg: KernelConfig) -> jax.Array:
  """(1) at one position, ``x: (B, N)``, ``d: (B, M)``: ``K_x * K_d``, plus
  the bias Gram ``K_d`` when ``with_bias``; block by block (one pass per
  block for both terms) where :func:`symmetric_gram` takes the blocks."""
  def combine(kx, kd):
    out = _product_of_kernels(kx, kd)
    return out + kd if with_bias else out
  if uses_symmetry(cfg, x, d):
    dot = lambda a, b: jnp.matmul(a, b.T, precision=cfg.precision)
    return symmetric_gram(
        lambda xi, di, xj, dj: combine(dot(xi, xj), dot(di, dj)), (x, d))
  return combine(gram_matmul(x, x, cfg), gram_matmul(d, d, cfg))


def materialized_gram(x: jax.Array, d: jax.Array,
                      cfg: KernelConfig) -> jax.Array:
  """Weight Gram (1) from materialised per-example gradients ``x_i^T d_i``.

  Args and returns as :func:`ghost_gram`. Builds the ``(B, N, M)``
  per-example gradients where their ``cols x N x M`` numbers fit
  ``cfg.memory_budget_bytes``; else their slices ``(B, N, M_c)`` over
  chunks of the output features, one chunk at a time (a loop), summing
  the chunks' Grams: ``F F^T = sum_c F_c F_c^T`` over any split of the
  columns of ``F``. Same multiply-adds, ``M / M_c`` times less memory.
  """
  m = d.shape[-1]
  chunk = materialized_chunk(x, d, cfg)

  def one(dc):
    g = rows(jnp.einsum("itn,itm->inm", x, dc, precision=cfg.precision))
    return gram_matmul(g, g, cfg)
  if chunk >= m:
    return one(d)
  k = -(-m // chunk)
  if k * chunk > m:  # Zero columns: nothing in any example's gradient.
    d = jnp.pad(d, ((0, 0), (0, 0), (0, k * chunk - m)))
  return lax.fori_loop(
      1, k, lambda c, acc: acc + one(lax.dynamic_slice_in_dim(
          d, c * chunk, chunk, axis=2)),
      one(d[..., :chunk]))


def materialized_chunk(x: jax.Array, d: jax.Array, cfg: KernelConfig) -> int:
  """Output features per chunk of :func:`materialized_gram`: all ``M``
  where the ``(cols, N, M)`` per-example gradients fit the budget; else
  ``M`` split evenly into as few chunks as fit (a divisor of ``M`` where
  one is at least half that size: no padding), at least one feature; a
  symbolic ``M`` is never chunked."""
  m = d.shape[-1]
  if not isinstance(m, int):
    return m
  most = int(max(1, cfg.memory_budget_bytes //
                 max(_per_feature_bytes(x, d, cfg), 1)))
  if most >= m:
    return m
  even = -(-m // -(-m // most))  # ceil(m / fewest chunks)
  divisor = max(k for k in range(1, even + 1) if m % k == 0)
  return divisor if 2 * divisor >= even else even



def gram_matmul(a: jax.Array, b: jax.Array,
                cfg: KernelConfig = LOCAL) -> jax.Array:
  """``a @ cfg.columns(b).T`` for ``(B, P)`` factors at ``cfg.precision``.

  ``b`` holds the same examples as ``a``; under ``shard_map`` with examples
  split over ``cfg.column_axes`` its rows
  are gathered from every device, giving this device's rows ``(b, B)`` of
  the Gram. Under an Explicit mesh the rows are sharded like ``a``.
  """
  if b is a and uses_symmetry(cfg, a):
    return symmetric_gram(
        lambda ai, aj: jnp.matmul(ai, aj.T, precision=cfg.precision), (a,))
  return jnp.matmul(cfg.rows(a), cfg.columns(b).T, precision=cfg.precision,
                    out_sharding=rows_sharding(a, 2))



def probe_value(mode: str, f: jax.Array, cfg: KernelConfig) -> jax.Array:
  """A probe's cotangent from flattened per-example gradients ``f: [B, P]``:
  their Gram ``[B, B]`` (``mode="gram"``; this device's rows ``[b, B]``
  when ``cfg`` gathers columns), squared norms ``[B]`` (``"norms"``), or
  ``f`` itself (``"per_example"``)."""
  if mode == "norms":
    if cfg.upper_bound:
      return norm_bounds.of_rows(f)
    return jnp.sum(f * f, axis=1)
  if mode == "gram":
    return gram_matmul(f, f, cfg)
  return f


def per_example_linear_grads(x: jax.Array, d: jax.Array, with_bias: bool,
                             precision: lax.Precision = DEFAULT_PRECISION
                             ) -> jax.Array:
  """Per-example gradients of ``w`` and ``b`` as one ``(B, N (+1), M)`` array.

  ``x: (B, T, N)`` and ``d: (B, T, M)`` in the accumulation dtype. With a
  bias, the input gets a constant feature 1 (``[x, 1]``), so row ``N`` is
  ``sum_t d`` (the bias gradient) and ``reshape(B, -1)`` is the flattened
  ``(w, b)`` gradient, ``w`` first. Concatenating two separate gradients
  instead would copy the ``B x P`` result once more, a pass that XLA does
  not fuse with the product (nor with its accumulation into a per-example
  probe in a loop). At one position (``T = 1``, e.g. an RNN step) it is an
  outer product, a broadcast multiply that XLA fuses with its consumer.
  """
  if with_bias:
    # ones_like keeps x's sharding (rows placed on an Explicit mesh); a
    # layer of no inputs (N = 0) has no column to take it from.
    one = (jnp.ones_like(x[..., :1]) if x.shape[-1] != 0 else
           jnp.ones(x.shape[:-1] + (1,), x.dtype))
    x = jnp.concatenate([x, one], axis=-1)
  if x.shape[1] == 1:
    return x[:, 0, :, None] * d[:, 0, None, :]
  return jnp.einsum("itn,itm->inm", x, d, precision=precision)


def bias_gram(d: jax.Array, cfg: KernelConfig) -> jax.Array:
  """Gram of per-example bias gradients ``sum_t d_it``: ``(B, T, M) -> (B, B)``."""
  s = d.sum(axis=1)
  return gram_matmul(s, s, cfg)



def linear_factors(x: jax.Array, d: jax.Array, example_dim: int):
  """``x: (..., N)`` and ``d: (..., M)`` as ``(B, T, N)``, ``(B, T, M)`` in the
  accumulation dtype (float32, float64 when an input is float64)."""
  acc = accumulation_dtype(x.dtype, d.dtype)
  return (to_example_major(x, example_dim).astype(acc),
          to_example_major(d, example_dim).astype(acc))


def linear_gram(x: jax.Array, d: jax.Array, *, with_bias: bool, method: str,
                cfg: KernelConfig) -> jax.Array:
  """Per-example gradient Gram of ``y = x @ w (+ b)``.

  Args:
    x: ``(B, T, N)`` layer inputs, example axis first, in the accumulation
      dtype (:func:`linear_factors`).
    d: ``(B, T, M)`` output cotangents, same dtype.
    with_bias: add the bias term.
    method: ``"ghost"`` or ``"materialize"`` (from the cost model).
    cfg: columns and memory budget.

  Returns:
    ``(B, B)`` Gram in the dtype of ``x`` (``(b, B)`` rows when
    ``cfg.column_axes`` gathers the columns).
  """
  if method == "ghost" and x.shape[1] == 1:
    return _one_position_ghost_gram(x[:, 0], d[:, 0], with_bias, cfg)
  if method != "ghost":
    gram = materialized_gram(x, d, cfg)
  elif _materialized_fits(x, d, cfg):
    # Where some example's ghost norm cancels (its rounding bound over
    # LOOSE of its value), its row and column of the ghost Gram are noise:
    # the materialised Gram's entries there.
    loose = norm_bounds.ghost(*ghost_sq_norms(x, d, cfg, True))[1]
    gram = loose_entries(loose, lambda: materialized_gram(x, d, cfg),
                         ghost_gram(x, d, cfg), cfg)
  else:
    gram = ghost_gram(x, d, cfg)
  if with_bias:
    gram = gram + bias_gram(d, cfg)
  return gram


def ghost_sq_norms(x: jax.Array, d: jax.Array, cfg: KernelConfig,
                   with_slack: bool = False):
  """Diagonal of (1) by the ghost method: ``(B, T, N), (B, T, M) -> (B,)``.

  ``|g_i|^2 = sum_{t,s} (x_it . x_is)(d_it . d_is)``: cost ``~B T^2 (N+M)``.
  Examples are processed in blocks so that the ``(rows, T, T)`` kernels stay
  under ``cfg.memory_budget_bytes``. ``with_slack``: also each value's
  rounding bound (:func:`gram_haiku._src.compute.norm_bounds.ghost_slack`), as
  ``(values, slacks)``.
  """
  b, t, n = x.shape
  m = d.shape[-1]
  acc = d.dtype
  if t == 1:
    xs, ds = jnp.sum(x[:, 0] ** 2, -1), jnp.sum(d[:, 0] ** 2, -1)
    value = _product_of_kernels(xs, ds)
    if not with_slack:
      return value
    return value, norm_bounds.ghost_slack(
        xs[:, None, None], ds[:, None, None], jnp.sqrt(xs)[:, None],
        jnp.sqrt(ds)[:, None], n, m, acc, lax.Precision.HIGHEST)

  def rows(xi, di):
    if with_slack:  # (wide kernels in two levels: norm_bounds.kernel)
      kx = norm_bounds.kernel(xi, cfg.precision)
      kd = norm_bounds.kernel(di, cfg.precision)
    else:
      kx = jnp.einsum("itn,isn->its", xi, xi, precision=cfg.precision)
      kd = jnp.einsum("itm,ism->its", di, di, precision=cfg.precision)
    prod = _product_of_kernels(kx, kd)
    if not with_slack:
      return jnp.sum(prod, axis=(1, 2))
    # In two levels, which ghost_slack bounds (T / 2 times tighter than
    # one sum of T^2 terms: at T = 256 on a TPU one level's bound exceeded
    # LOOSE on ordinary MLP layers, and every step fell back to
    # materialising their per-example gradients).
    value = norm_bounds.two_level_sum(prod)
    slack = norm_bounds.ghost_slack(
        kx.astype(acc), kd.astype(acc), norm_bounds.row_norms(xi.astype(acc)),
        norm_bounds.row_norms(di.astype(acc)), n, m, acc, cfg.precision,
        by_kernel=True)
    return jnp.stack([value.astype(acc), slack.astype(acc)], axis=1)
  itemsize = jnp.dtype(x.dtype).itemsize
  budget = cfg.memory_budget_bytes
  t_hint = cost_model.size_hint(t)
  # The kernels, and with the slack its (rows, T, T) terms.
  per_row = (6 if with_slack else 2) * t_hint * t_hint * itemsize
  if per_row > budget:  # One example's kernels do not fit.
    tau = max(1, math.isqrt(budget // (2 * itemsize)))
    value = map_row_blocks(
        lambda xi, di: _ghost_time_blocked(xi, di, xi, di, tau,
                                           cfg.precision)[0], 1,
        (x, d))
    if not with_slack:
      return value
    return value, norm_bounds.coarse_ghost_slack(
        norm_bounds.triangle(x, d), n, m, t, acc, cfg.precision)
  out = map_row_blocks(rows, rows_per_block(b, per_row, budget), (x, d))
  return (out[:, 0], out[:, 1]) if with_slack else out


def materialized_sq_norms(x: jax.Array, d: jax.Array,
                          precision: lax.Precision = DEFAULT_PRECISION
                          ) -> jax.Array:
  """Diagonal of (1) from per-example gradients: cost ``~B T N M``."""
  g = jnp.einsum("itn,itm->inm", x, d, precision=precision)
  return jnp.sum(g * g, axis=(1, 2))


def linear_sq_norms(x: jax.Array, d: jax.Array, *, with_bias: bool,
                    method: str, cfg: KernelConfig) -> jax.Array:
  """Squared per-example gradient norms of ``y = x @ w (+ b)`` (diag of Gram).

  Same arguments as :func:`linear_gram`; returns ``(B,)``. This is the
  "ghost norm" of Goodfellow (2015) and Li et al. (2022): no ``B x B``
  term, so its cost is linear in ``B``.
  """
  if cfg.upper_bound:
    return _bounded_linear_sq_norms(x, d, with_bias, method, cfg)
  if method != "ghost":
    out = materialized_sq_norms(x, d, cfg.precision)
  elif x.shape[1] == 1:
    out = ghost_sq_norms(x, d, cfg)
  else:
    # The best estimate: where an example's ghost norm cancels (see
    # :mod:`gram_haiku._src.compute.norm_bounds`), its materialised norm
    # (per example: no norm depends on another example's cancelling).
    fallback = functools.partial(_materialized_sq_norms_blocked, cfg=cfg)
    out = _sequence_ghost_precision(
        lambda c: _ghost_or_fallback(x, d, c, fallback, bounds=False), cfg,
        x.shape[1])
  if with_bias:
    out = out + jnp.sum(d.sum(axis=1) ** 2, axis=-1)
  return out


def linear_sq_norm_bounds_of(f: jax.Array, x: jax.Array, d: jax.Array,
                             with_bias: bool, precision) -> jax.Array:
  """Sound upper bounds of the squared norms of a linear map's per-example
  gradients ``f: [B, P]``, materialised from ``x: (B, T, N)`` and ``d: (B,
  T, M)`` (with the bias's ``sum_t d_t`` among them where ``with_bias``):
  :func:`gram_haiku._src.compute.norm_bounds.materialized`, each entry a sum over
  the ``T`` positions."""
  tri = norm_bounds.triangle(x, d)
  if with_bias:
    tri = tri + jnp.sum(norm_bounds.row_norms(d), axis=1)
  return norm_bounds.of_rows(
      f, norm_bounds.dot_error(x.shape[1], f.dtype, precision) * tri)


def bias_sq_norm_bounds(d: jax.Array, precision) -> jax.Array:
  """Sound upper bounds of ``|sum_t d_t|^2``, ``d: (B, T, M)`` -> ``(B,)``
  (:func:`gram_haiku._src.compute.norm_bounds.materialized` with ``x_t = 1``)."""
  _, t, m = d.shape
  tri = jnp.sum(norm_bounds.row_norms(d), axis=1)
  return norm_bounds.materialized(
      norm_bounds.sum_of_squares(d.sum(axis=1)),
      norm_bounds.squares_rel(m, d.dtype), tri, t, d.dtype,
      lax.Precision.HIGHEST)


def _per_feature_bytes(x, d, cfg: KernelConfig) -> int:
  """Bytes of the ``(cols, N)`` per-example gradients of one output
  feature (:func:`materialized_gram` forms ``M`` or a chunk of them)."""
  return (cfg.column_count(cost_model.size_hint(x.shape[0])) *
          cost_model.size_hint(x.shape[-1]) * jnp.dtype(d.dtype).itemsize)


def _materialized_fits(x, d, cfg: KernelConfig) -> bool:
  """Whether the ``(cols, N, M)`` per-example gradients of
  :func:`materialized_gram` fit the memory budget, unchunked."""
  return (_per_feature_bytes(x, d, cfg) * cost_model.size_hint(d.shape[-1])
          <= cfg.memory_budget_bytes)


def any_example(flags: jax.Array, cfg: KernelConfig) -> jax.Array:
  """Whether any of ``flags: bool[b]`` holds, over every device's examples
  (``cfg.column_axes``): a scalar bool, the same on every device (a branch
  on it may gather columns)."""
  out = jnp.any(flags)
  if cfg.column_axes:
    axes = cfg.column_axes
    out = lax.pmax(out.astype(jnp.int32),
                   axes if len(axes) > 1 else axes[0]) > 0
  return out


def loose_entries(loose: jax.Array, fallback, gram: jax.Array,
                  cfg: KernelConfig) -> jax.Array:
  """The Gram ``gram`` (``(b, B)``: :meth:`KernelConfig.rows` against
  :meth:`KernelConfig.columns`) with each entry whose row or column example
  is ``loose`` (``bool[b]``, this device's examples: its ghost norm
  cancels) taken from ``fallback()`` (the same block by a method that does
  not cancel); ``fallback`` runs only where some example, on any device,
  is loose (one branch on every device).

  Per entry, never for the whole Gram, as :func:`loose_fallback` per
  example: an entry between two examples whose ghost products do not
  cancel must not depend on whether a third example's do."""
  def replaced():  # (the columns' flags gathered only where it runs)
    pair = cfg.rows(loose)[:, None] | cfg.columns(loose)[None, :]
    return jnp.where(pair, fallback().astype(gram.dtype), gram)
  return lax.cond(any_example(loose, cfg), replaced, lambda: gram)


def run_if(pred: jax.Array, fn, otherwise: jax.Array,
           operands: tuple = ()) -> jax.Array:
  """``fn(*operands)`` where the scalar ``pred`` holds, else ``otherwise``
  (same type), as a loop of zero or one rounds: unlike ``lax.cond``, whose
  operands XLA kept in copies in the models measured (CNN clipping step:
  +21 MB of temp memory for a branch that never ran). Not differentiable
  (a loop with a traced trip count): for the clipping pass's norm bounds,
  which nothing differentiates.

  ``operands`` enter the round tied to the loop's counter
  (``lax.optimization_barrier``), so that nothing computed from them is
  loop-invariant: XLA's loop-invariant code motion otherwise hoisted a
  round that reads only values from outside the loop in front of it, and
  the fallback ran on every step (a GPT clipping step materialised every
  linear layer's and the tied output layer's per-example gradients; found
  in the compiled HLO, 2026-12-06). ``fn`` must read the arrays it works on
  from its arguments, not from its closure.
  """
  def body(i, _):
    _, tied = lax.optimization_barrier((i, tuple(operands)))
    return fn(*tied)
  return lax.fori_loop(0, pred.astype(jnp.int32), body, otherwise)


def loose_fallback(loose: jax.Array, fn, bound: jax.Array,
                   operands: tuple = ()) -> jax.Array:
  """Each example's value: ``fn(*operands)`` (the fallback, ``[B]``: a
  tighter bound, or a norm that does not cancel) where ``loose: bool[B]``,
  else its ``bound: [B]`` (a ghost bound or norm); ``fn`` runs (by
  :func:`run_if`) only where some example is loose.

  Per example, never for the whole batch: an example's clip factor (and
  its reported norm) must depend on that example alone. A batch-wide
  switch let one example whose ghost norm cancels change every other
  example's bound (from its ghost bound, up to ``sqrt(1 + LOOSE)`` above
  its norm, to the tighter fallback), so adding it moved the clipped sum by
  more than ``C`` (up to 1.86 C with 31 other examples;
  ``tests/test_clip_bound.py``)."""
  def pick(loose_, bound_, *ops):
    return jnp.where(loose_, fn(*ops).astype(bound_.dtype), bound_)
  return run_if(jnp.any(loose), pick, bound, (loose, bound, *operands))


#: The memory a fallback from cancelling ghost norms to materialised ones
#: forms at once (blocks of examples): it runs rarely, so it is kept small,
#: since XLA reserves a conditional branch's memory whether or not it runs.
FALLBACK_BYTES = 1 << 21


def _materialized_sq_norms_blocked(x, d, cfg: KernelConfig) -> jax.Array:
  """:func:`materialized_sq_norms` in blocks of examples of at most
  :data:`FALLBACK_BYTES` (the fallback where ghost norms cancel), at
  ``HIGHEST`` (rare, and where the products cancel the precision that
  keeps them)."""
  n, m = x.shape[-1], d.shape[-1]
  itemsize = jnp.dtype(d.dtype).itemsize
  budget = min(cfg.memory_budget_bytes, FALLBACK_BYTES)
  per_row = cost_model.size_hint(n) * cost_model.size_hint(m) * itemsize
  rows = max(1, budget // max(per_row, 1))
  return map_row_slices(
      lambda xi, di: materialized_sq_norms(xi, di, lax.Precision.HIGHEST),
      rows, (x, d))


def _sequence_ghost_precision(fn, cfg: KernelConfig, t) -> jax.Array:
  """``fn(cfg)``, the ghost norms of a sequence of ``t`` positions at
  ``cfg``'s precision, except where ``cfg`` is below ``HIGHEST`` on the
  platforms of :func:`cost_model.highest_first_platforms`, which get
  ``fn`` of ``cfg`` at ``HIGHEST`` (``lax.platform_dependent``: chosen
  when lowering, the other platforms' programs unchanged)."""
  platforms = cost_model.highest_first_platforms(t)
  if cfg.precision == lax.Precision.HIGHEST or not platforms:
    return fn(cfg)
  high = dataclasses.replace(cfg, precision=lax.Precision.HIGHEST)
  return lax.platform_dependent(default=lambda: fn(cfg),
                                **{p: lambda: fn(high) for p in platforms})


def _ghost_or_fallback(x, d, cfg: KernelConfig, materialised, *,
                       bounds: bool) -> jax.Array:
  """Each example's ghost bound (``bounds``; else its ghost value) at
  ``cfg``'s precision where that is tight; else, below ``HIGHEST``, the
  same at ``HIGHEST`` (a TPU's bfloat16 passes count ``2^-7`` of each
  product: at ``T = 256`` a GPT's output layer was loose for every
  example, and materialising its per-example gradients one example at a
  time made the clipping step 2.7x a plain step instead of 1.8x,
  2026-12-07); else (its products cancel) ``materialised(x, d)``'s:
  ``[B]``. Per example, as :func:`loose_fallback`: each example's value
  is from its own data, and each fallback runs only where some example
  is loose."""
  value, slack = ghost_sq_norms(x, d, cfg, True)
  bound, loose = norm_bounds.ghost(value, slack)
  fallback = materialised
  if cfg.precision != lax.Precision.HIGHEST:
    high = dataclasses.replace(cfg, precision=lax.Precision.HIGHEST)
    fallback = lambda x, d: _ghost_or_fallback(x, d, high, materialised,
                                               bounds=bounds)
  return loose_fallback(loose, fallback, bound if bounds else value, (x, d))


def _bounded_linear_sq_norms(x, d, with_bias: bool, method: str,
                             cfg: KernelConfig) -> jax.Array:
  """Sound upper bounds of the squared norms of :func:`linear_sq_norms`
  (:mod:`gram_haiku._src.compute.norm_bounds`): each example's ghost value
  plus its rounding bound (G) where that is tight, else (below
  ``HIGHEST``, :func:`_ghost_or_fallback`) the same at ``HIGHEST``
  where that is, else its materialised bound (M), formed in blocks of
  examples within the memory budget."""
  b, t, n = x.shape
  m = d.shape[-1]
  acc = d.dtype
  itemsize = jnp.dtype(acc).itemsize

  def materialised(budget: int, precision, x, d):
    per_row = cost_model.size_hint(n) * cost_model.size_hint(m) * itemsize
    rows = max(1, budget // max(per_row, 1))
    value = map_row_slices(
        lambda xi, di: norm_bounds.sum_of_squares(jnp.einsum(
            "itn,itm->inm", xi, di, precision=precision)), rows, (x, d))
    return norm_bounds.materialized(
        value, norm_bounds.squares_rel(n * m, acc), norm_bounds.triangle(x, d),
        t, acc, precision)

  if method != "ghost":
    out = materialised(cfg.memory_budget_bytes, cfg.precision, x, d)
  elif isinstance(t, int) and t == 1:
    # One position: nothing cancels, the ghost bound is tight.
    out = norm_bounds.ghost(*ghost_sq_norms(x, d, cfg, True))[0]
  else:
    # The fallback (rare: cancelling examples) in small blocks, at HIGHEST
    # (its bound counts each product's rounding against the unsigned sum
    # over positions: below HIGHEST a TPU's 2^-7 of it put a cancelling
    # example's bound 1e3 to 1e5 times above its norm).
    fallback = functools.partial(
        materialised, min(cfg.memory_budget_bytes, FALLBACK_BYTES),
        lax.Precision.HIGHEST)
    out = _sequence_ghost_precision(
        lambda c: _ghost_or_fallback(x, d, c, fallback, bounds=True), cfg, t)
  # Intermediates flushed to zero (norm_bounds' docstring: underflow),
  # from each example's largest row norms, bounds of its largest input and
  # cotangent entries: the ghost bound's and the triangle's own row norms
  # (the same expressions, one read of x and d where XLA merges them; the
  # largest entries were two more reads: the ViT's clipping step on a TPU
  # v5e took 18.59 against 18.68 ms at B = 128, 2026-12-07). An overflow
  # met by a flushed zero (inf * 0) is an inf bound, not NaN, unless the
  # example's inputs or cotangents hold a NaN.
  mx = jnp.max(norm_bounds.row_norms(x.astype(acc)), axis=1, initial=0)
  md = jnp.max(norm_bounds.row_norms(d), axis=1, initial=0)
  out = out + norm_bounds.underflow_slack(t, n, m, mx, md)
  out = jnp.where(jnp.isnan(out) & ~jnp.isnan(mx) & ~jnp.isnan(md),
                  jnp.inf, out)
  if with_bias:
    out = out + bias_sq_norm_bounds(d, cfg.precision)
  return out
