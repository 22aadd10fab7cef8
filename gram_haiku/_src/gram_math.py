"""Gram matrices of per-example weight gradients for linear-type layers.

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
whatever the input dtype, with ``Precision.HIGHEST`` so that float32 matmuls
are not silently done in TF32/bf16 passes on accelerators.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src import errors
from gram_haiku._src import example_sharding
from gram_haiku._src.example_sharding import columns

#: Largest per-block intermediate, in bytes, that a Gram kernel may build:
#: the ``(rows, T, B, T)`` kernel blocks of the ghost method and the
#: ``(B, N, M)`` per-example gradients of the materialised one.
MEMORY_BUDGET_BYTES = 256 * 2**20

STRATEGIES = ("auto", "ghost", "materialize")

_HIGHEST = lax.Precision.HIGHEST


def accumulation_dtype(*dtypes) -> jnp.dtype:
  """float32, or float64 when any input is float64 (under ``jax_enable_x64``)."""
  out = jnp.dtype(jnp.float32)
  for dt in dtypes:
    if jnp.dtype(dt) == jnp.float64:
      out = jnp.dtype(jnp.float64)
  return out


def to_example_major(a: jax.Array, example_dim: int) -> jax.Array:
  """``(..., F)`` with the example axis at ``example_dim`` -> ``(B, T, F)``.

  ``T`` is the product of every other leading axis (the within-example axes).
  """
  a = jnp.moveaxis(a, example_dim, 0)
  return a.reshape(a.shape[0], -1, a.shape[-1])


def rows_sharding(a: jax.Array, out_ndim: int):
  """``out_sharding`` for a contraction whose output rows are ``a``'s axis 0.

  Under a mesh with Explicit axes, a contraction between two operands that
  are both sharded along the example axis has no implied output sharding
  and must be given one: the output keeps ``a``'s example-axis sharding on
  its first axis (rows) and is replicated along the others. None otherwise.
  """
  spec = explicit_spec(a)
  if not spec or spec[0] is None:
    return None
  return jax.sharding.PartitionSpec(spec[0], *([None] * (out_ndim - 1)))


def explicit_spec(a: jax.Array):
  """``a``'s PartitionSpec under a mesh with Explicit axes, else None.

  Raises:
    ValueError: if ``a`` is sharded over Explicit mesh axes but no mesh is
      set (``jax.set_mesh``): JAX then cannot resolve the output shardings
      that the Gram contractions need.
  """
  sharding = getattr(jax.typeof(a), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  explicit = jax.sharding.AxisType.Explicit
  if mesh is None or not any(t == explicit
                             for t in getattr(mesh, "axis_types", ())):
    return None
  if jax.sharding.get_abstract_mesh().empty:
    raise ValueError(errors.EXPLICIT_MESH_NOT_SET.format(
        shape=tuple(a.shape), dtype=a.dtype, spec=sharding.spec,
        axes=dict(zip(mesh.axis_names, mesh.axis_sizes))))
  return sharding.spec


def reshard_like(value: jax.Array, spec) -> jax.Array:
  """``value`` resharded to ``spec`` (from :func:`explicit_spec`), if any."""
  if spec is None or explicit_spec(value) == spec:
    return value
  return jax.sharding.reshard(value, spec)


def example_sum(a: jax.Array) -> jax.Array:
  """``a.sum(axis=0)`` (the example axis), as a matrix-vector product.

  Summing materialised per-example gradients gives the weight gradient. On
  XLA's CPU backend a reduction over the leading axis of ``(B, N, M)`` ran
  about 3x slower than the matmul that produced it (``benchmarks``, LM
  layers), while ``ones(B) @ a`` runs at memory speed. ``HIGHEST``
  precision, so the sum is exact in float32 on accelerators too.
  """
  b = a.shape[0]
  flat = reshape_rows(a, (b, math.prod(a.shape[1:])))
  ones = jnp.ones((b,), a.dtype)
  out_sharding = (None if explicit_spec(a) is None
                  else jax.sharding.PartitionSpec(None))
  out = jnp.matmul(ones, flat, precision=_HIGHEST, out_sharding=out_sharding)
  return out.reshape(a.shape[1:])


def merge_leading(a: jax.Array, n: int) -> jax.Array:
  """Merges ``a``'s first ``n`` axes into one (a new axis of 1 for ``n=0``).

  Under an Explicit mesh the merged axis keeps the first axis's sharding
  (row-major merging keeps each shard contiguous when only the first axis is
  sharded), given as the reshape's ``out_sharding``.
  """
  shape = (math.prod(a.shape[:n]),) + tuple(a.shape[n:])
  spec = explicit_spec(a)
  if spec is None or n == 0:
    return a.reshape(shape)
  spec = tuple(spec) + (None,) * (a.ndim - len(spec))
  out = jax.sharding.PartitionSpec(spec[0], *spec[n:])
  return jnp.reshape(a, shape, out_sharding=out)


def reshape_rows(a: jax.Array, shape) -> jax.Array:
  """``a.reshape(shape)`` keeping axis 0 (and its sharding) as it is.

  Under an Explicit mesh a reshape needs its output sharding spelt out;
  this one keeps axis 0's and replicates the rest.
  """
  spec = explicit_spec(a)
  if spec is None:
    return a.reshape(shape)
  lead = spec[0] if len(spec) else None
  out = jax.sharding.PartitionSpec(lead, *([None] * (len(shape) - 1)))
  return jnp.reshape(a, shape, out_sharding=out)


def split_leading(a: jax.Array, lead: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`merge_leading`: axis 0 becomes ``lead``."""
  shape = tuple(lead) + tuple(a.shape[1:])
  spec = explicit_spec(a)
  if spec is None or not lead:
    return a.reshape(shape)
  spec = tuple(spec) + (None,) * (a.ndim - len(spec))
  out = jax.sharding.PartitionSpec(spec[0], *([None] * (len(lead) - 1)),
                                   *spec[1:])
  return jnp.reshape(a, shape, out_sharding=out)


#: Multiply-adds that one gathered byte is counted as, in the cost model of
#: a Gram whose columns come from other devices (``shard_map``): a rough
#: ratio of a device's arithmetic rate to its interconnect bandwidth. The
#: choice between methods only moves when their FLOPs are within this factor
#: of their traffic.
COMM_FLOPS_PER_BYTE = 16


def ghost_flops(b: int, t: int, n: int, m: int, cols: int = 0) -> int:
  """Multiply-adds of the ghost method for one linear-layer weight.

  ``b`` rows (local examples) against ``cols`` columns (default ``b``).
  """
  cols = cols or b
  if t == 1:
    return b * cols * (n + m) + b * cols
  return b * cols * t * t * (n + m + 1)


def materialize_flops(b: int, t: int, n: int, m: int, cols: int = 0) -> int:
  """Extra multiply-adds of the materialised method for one linear weight.

  Forming the per-example gradients costs ``B T N M``, but their sum is the
  weight gradient, which the op then does not compute again (it would cost
  the same ``B T N M``); what is extra is ``B N M`` for the sum and
  ``B^2 N M`` for ``F F^T`` (``b cols N M`` for a block of rows).
  """
  del t
  cols = cols or b
  return b * n * m + b * cols * n * m


def gathered_bytes(cols: int, t: int, n: int, m: int, acc_bytes: int,
                   method: str) -> int:
  """Bytes one device receives to form its rows, ``cols`` examples in all.

  The ghost method gathers inputs and cotangents, ``T (N + M)`` numbers per
  example; the materialised one the per-example gradients, ``N M``.
  """
  per_example = t * (n + m) if method == "ghost" else n * m
  return cols * per_example * acc_bytes


def choose_strategy(b: int, t: int, n: int, m: int, acc_bytes: int,
                    strategy: str = "auto") -> str:
  """Picks ``"ghost"`` or ``"materialize"`` for a ``(B, T, N) -> M`` layer.

  ``"auto"`` takes whichever needs fewer multiply-adds, except that the
  materialised method is never chosen when its ``B x N x M`` per-example
  gradients would exceed :data:`MEMORY_BUDGET_BYTES` (the ghost method is
  blocked and always fits). Under ``shard_map`` with examples split over
  ``n_dev`` devices (:mod:`gram_haiku._src.example_sharding`), ``b`` local
  rows meet ``B = n_dev b`` gathered columns, and each gathered byte adds
  :data:`COMM_FLOPS_PER_BYTE` to a method's cost.

  Raises:
    ValueError: for an unknown ``strategy``.
  """
  if strategy not in STRATEGIES:
    raise ValueError(
        f"Unknown Gram strategy {strategy!r}; expected one of {STRATEGIES}.")
  if strategy != "auto":
    return strategy
  cols = example_sharding.gathered_rows(b)
  n_dev = cols // b
  fits = cols * n * m * acc_bytes <= MEMORY_BUDGET_BYTES
  ghost = ghost_flops(b, t, n, m, cols)
  mat = materialize_flops(b, t, n, m, cols)
  if n_dev > 1:
    ghost += COMM_FLOPS_PER_BYTE * gathered_bytes(cols, t, n, m, acc_bytes,
                                                  "ghost")
    mat += COMM_FLOPS_PER_BYTE * gathered_bytes(cols, t, n, m, acc_bytes,
                                                "materialize")
  if fits and mat < ghost:
    return "materialize"
  return "ghost"


def _ghost_rows(xi, di, x, d):
  """Rows ``i`` of (1): ``xi: (R, T, N)``, ``x: (B, T, N)`` -> ``(R, B)``."""
  acc = x.dtype
  kx = jnp.einsum("itn,jsn->itjs", xi, x, precision=_HIGHEST,
                  preferred_element_type=acc,
                  out_sharding=rows_sharding(xi, 4))
  kd = jnp.einsum("itm,jsm->itjs", di, d, precision=_HIGHEST,
                  preferred_element_type=acc,
                  out_sharding=rows_sharding(di, 4))
  return jnp.einsum("itjs,itjs->ij", kx, kd, precision=_HIGHEST)


def blocked(arrays, size):
  """Pads the leading axis of each array to a multiple of ``size`` and
  splits it: ``(n, ...) -> (ceil(n / size), size, ...)``."""
  n = arrays[0].shape[0]
  n_blocks = math.ceil(n / size)
  pad = n_blocks * size - n
  out = []
  for a in arrays:
    a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
    out.append(a.reshape((n_blocks, size) + a.shape[1:]))
  return tuple(out)


def map_row_blocks(fn, rows: int, arrays):
  """``fn`` over blocks of ``rows`` leading entries of ``arrays``, stacked."""
  b = arrays[0].shape[0]
  if rows >= b:
    return fn(*arrays)
  out = lax.map(lambda blk: fn(*blk), blocked(arrays, rows))
  return out.reshape((-1,) + out.shape[2:])[:b]


def map_pair_blocks(fn, row_arrays, col_arrays, per_pair_bytes: int):
  """``G[i, j] = fn(rows i, columns j)`` in blocks within the memory budget.

  ``fn(*row_block, *col_block) -> (R, C)``; one ``(row, column)`` pair needs
  ``per_pair_bytes`` of intermediates. Rows are taken in blocks whose pairs
  with every column fit :data:`MEMORY_BUDGET_BYTES`; when not even one row
  does, one row at a time, its columns in blocks (``lax.map`` over both).
  The columns are :func:`columns` of ``col_arrays`` (every device's examples
  under ``shard_map``).
  """
  b = row_arrays[0].shape[0]
  col_arrays = tuple(columns(a) for a in col_arrays)
  c = col_arrays[0].shape[0]  # B; more than b under shard_map
  per_pair = max(per_pair_bytes, 1)
  if c * per_pair <= MEMORY_BUDGET_BYTES:
    rows = max(1, min(b, MEMORY_BUDGET_BYTES // (c * per_pair)))
    return map_row_blocks(lambda *r: fn(*r, *col_arrays), rows, row_arrays)
  cols = max(1, min(c, MEMORY_BUDGET_BYTES // per_pair))
  col_blocks = blocked(col_arrays, cols)

  def one_row(*r):
    out = lax.map(lambda cb: fn(*r, *cb), col_blocks)  # (n_blocks, 1, cols)
    return jnp.moveaxis(out, 0, 1).reshape(1, -1)[:, :c]
  return map_row_blocks(one_row, 1, row_arrays)


def _ghost_time_blocked(xi, di, xj, dj, tau: int):
  """:func:`_ghost_rows` summed over pairs of ``tau``-position blocks.

  For ``T`` so long that even one pair's ``(1, T, 1, T)`` kernels exceed the
  budget: (1) is a sum over ``(t, s)``, so it splits into blocks of
  positions; zero padding adds nothing.
  """
  t = xi.shape[1]
  nt = math.ceil(t / tau)
  pad = nt * tau - t

  def split(a):  # (R, T, F) -> (nt, R, tau, F)
    a = jnp.pad(a, ((0, 0), (0, pad), (0, 0)))
    return jnp.moveaxis(a.reshape(a.shape[0], nt, tau, a.shape[-1]), 1, 0)
  xib, dib, xjb, djb = split(xi), split(di), split(xj), split(dj)

  def body(acc, k):
    a, c = k // nt, k % nt
    return acc + _ghost_rows(xib[a], dib[a], xjb[c], djb[c]), None
  init = jnp.zeros((xi.shape[0], xj.shape[0]), xi.dtype)
  out, _ = lax.scan(body, init, jnp.arange(nt * nt))
  return out


def ghost_gram(x: jax.Array, d: jax.Array) -> jax.Array:
  """Weight Gram (1) by the ghost method.

  Args:
    x: ``(B, T, N)`` layer inputs, example axis first, in the accumulation
      dtype.
    d: ``(B, T, M)`` output cotangents, same dtype.

  Returns:
    ``(B, B)`` Gram in the dtype of ``x`` (``(b, B)`` rows under
    ``shard_map``). Never builds more than :data:`MEMORY_BUDGET_BYTES` of
    ``(rows, T, cols, T)`` kernel blocks at once: blocked over rows, then
    over columns (:func:`map_pair_blocks`), then over blocks of positions
    when one pair's ``(T, T)`` kernels alone exceed the budget.
  """
  _, t, _ = x.shape
  if t == 1:
    kx = gram_matmul(x[:, 0], x[:, 0])
    kd = gram_matmul(d[:, 0], d[:, 0])
    return kx * kd
  itemsize = jnp.dtype(x.dtype).itemsize
  per_pair = 2 * t * t * itemsize  # kx and kd for one pair (i, j)
  if per_pair <= MEMORY_BUDGET_BYTES:
    return map_pair_blocks(_ghost_rows, (x, d), (x, d), per_pair)
  tau = max(1, math.isqrt(MEMORY_BUDGET_BYTES // (2 * itemsize)))
  return map_pair_blocks(
      lambda xi, di, xj, dj: _ghost_time_blocked(xi, di, xj, dj, tau),
      (x, d), (x, d), 2 * tau * tau * itemsize)


def materialized_gram(x: jax.Array, d: jax.Array) -> jax.Array:
  """Weight Gram (1) from materialised per-example gradients ``x_i^T d_i``.

  Args and returns as :func:`ghost_gram`. Builds ``(B, N, M)`` per-example
  gradients; :func:`choose_strategy` only picks this when they fit
  :data:`MEMORY_BUDGET_BYTES`.
  """
  g = jnp.einsum("itn,itm->inm", x, d, precision=_HIGHEST)
  g = g.reshape(g.shape[0], -1)
  return gram_matmul(g, g)


def gram_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ columns(b).T`` for ``(B, P)`` factors at ``HIGHEST``.

  ``b`` holds the same examples as ``a``; under ``shard_map`` with examples
  split over mesh axes (:mod:`gram_haiku._src.example_sharding`) its rows
  are gathered from every device, giving this device's rows ``(b, B)`` of
  the Gram. Under an Explicit mesh the rows are sharded like ``a``.
  """
  return jnp.matmul(a, columns(b).T, precision=_HIGHEST,
                    out_sharding=rows_sharding(a, 2))


def per_example_linear_grads(x: jax.Array, d: jax.Array):
  """Per-example gradients ``(B, N, M)`` of ``w`` and ``(B, M)`` of ``b``.

  ``x: (B, T, N)`` and ``d: (B, T, M)`` in the accumulation dtype. At one
  position (``T = 1``, e.g. an RNN step) each is an outer product, written
  as a broadcast multiply that XLA fuses with whatever consumes it (the
  accumulation into a per-example probe: one pass over ``B x P``).
  """
  if x.shape[1] == 1:
    return x[:, 0, :, None] * d[:, 0, None, :], d[:, 0]
  gw = jnp.einsum("itn,itm->inm", x, d, precision=_HIGHEST)
  return gw, d.sum(axis=1)


def bias_gram(d: jax.Array) -> jax.Array:
  """Gram of per-example bias gradients ``sum_t d_it``: ``(B, T, M) -> (B, B)``."""
  s = d.sum(axis=1)
  return gram_matmul(s, s)


def linear_gram(x: jax.Array, d: jax.Array, *, example_dim: int,
                with_bias: bool, strategy: str = "auto") -> jax.Array:
  """Per-example gradient Gram of ``y = x @ w (+ b)``.

  Args:
    x: ``(..., N)`` layer input, any float dtype. The leading axes are the
      example axis (at ``example_dim``) and within-example axes.
    d: ``(..., M)`` cotangent of the output, same leading axes as ``x``.
    example_dim: position of the example axis among the leading axes.
    with_bias: add the bias term.
    strategy: ``"auto"``, ``"ghost"`` or ``"materialize"``.

  Returns:
    ``(B, B)`` Gram, float32 (float64 when an input is float64).
  """
  acc = accumulation_dtype(x.dtype, d.dtype)
  xm = to_example_major(x, example_dim).astype(acc)
  dm = to_example_major(d, example_dim).astype(acc)
  b, t, n = xm.shape
  m = dm.shape[-1]
  method = choose_strategy(b, t, n, m, jnp.dtype(acc).itemsize, strategy)
  gram = ghost_gram(xm, dm) if method == "ghost" else materialized_gram(xm, dm)
  if with_bias:
    gram = gram + bias_gram(dm)
  return gram


def ghost_sq_norms(x: jax.Array, d: jax.Array) -> jax.Array:
  """Diagonal of (1) by the ghost method: ``(B, T, N), (B, T, M) -> (B,)``.

  ``|g_i|^2 = sum_{t,s} (x_it . x_is)(d_it . d_is)``: cost ``~B T^2 (N+M)``.
  Examples are processed in blocks so that the ``(rows, T, T)`` kernels stay
  under :data:`MEMORY_BUDGET_BYTES`.
  """
  b, t, _ = x.shape
  if t == 1:
    return jnp.sum(x[:, 0] ** 2, -1) * jnp.sum(d[:, 0] ** 2, -1)

  def rows(xi, di):
    kx = jnp.einsum("itn,isn->its", xi, xi, precision=_HIGHEST)
    kd = jnp.einsum("itm,ism->its", di, di, precision=_HIGHEST)
    return jnp.sum(kx * kd, axis=(1, 2))
  itemsize = jnp.dtype(x.dtype).itemsize
  per_row = 2 * t * t * itemsize
  if per_row > MEMORY_BUDGET_BYTES:  # One example's kernels do not fit.
    tau = max(1, math.isqrt(MEMORY_BUDGET_BYTES // (2 * itemsize)))
    return map_row_blocks(
        lambda xi, di: _ghost_time_blocked(xi, di, xi, di, tau)[0], 1,
        (x, d))
  n_rows = max(1, min(b, MEMORY_BUDGET_BYTES // max(per_row, 1)))
  return map_row_blocks(rows, n_rows, (x, d))


def materialized_sq_norms(x: jax.Array, d: jax.Array) -> jax.Array:
  """Diagonal of (1) from per-example gradients: cost ``~B T N M``."""
  g = jnp.einsum("itn,itm->inm", x, d, precision=_HIGHEST)
  return jnp.sum(g * g, axis=(1, 2))


def choose_norms_strategy(b: int, t: int, n: int, m: int, acc_bytes: int,
                          strategy: str = "auto") -> str:
  """:func:`choose_strategy` for the diagonal only.

  Ghost costs ``B T^2 (N + M)`` multiply-adds. Materialised costs ``B T N
  M`` to form the per-example gradients, but their sum is the weight
  gradient, which the op then does not compute again: what is extra is
  ``B N M`` (squares and the sum). Materialised only within the memory
  budget.
  """
  if strategy != "auto":
    return choose_strategy(b, t, n, m, acc_bytes, strategy)
  fits = b * n * m * acc_bytes <= MEMORY_BUDGET_BYTES
  return "materialize" if fits and n * m < t * t * (n + m) else "ghost"


def linear_sq_norms(x: jax.Array, d: jax.Array, *, example_dim: int,
                    with_bias: bool, strategy: str = "auto") -> jax.Array:
  """Squared per-example gradient norms of ``y = x @ w (+ b)`` (diag of Gram).

  Same arguments as :func:`linear_gram`; returns ``(B,)``. This is the
  "ghost norm" of Goodfellow (2015) and Li et al. (2022): no ``B x B``
  term, so its cost is linear in ``B``.
  """
  acc = accumulation_dtype(x.dtype, d.dtype)
  xm = to_example_major(x, example_dim).astype(acc)
  dm = to_example_major(d, example_dim).astype(acc)
  b, t, n = xm.shape
  m = dm.shape[-1]
  strategy = choose_norms_strategy(b, t, n, m, jnp.dtype(acc).itemsize,
                                   strategy)
  out = (ghost_sq_norms(xm, dm) if strategy == "ghost"
         else materialized_sq_norms(xm, dm))
  if with_bias:
    out = out + jnp.sum(dm.sum(axis=1) ** 2, axis=-1)
  return out
