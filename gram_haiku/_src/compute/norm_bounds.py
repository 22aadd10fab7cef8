"""Sound upper bounds of per-example squared gradient norms in floating point.

A clip factor ``c_i = min(1, C / |g_i|)`` bounds example ``i``'s
contribution by ``C`` only if the norm it is computed from is not below the
true ``|g_i|``. Floating point can break that:

* **ghost norms cancel.** For a layer applied at ``T`` positions,
  ``|g_i|^2 = sum_{t,s} (x_t . x_s)(d_t . d_s)`` (``x_t`` the input and
  ``d_t`` the output cotangent at position ``t``). Each kernel entry is
  computed with an absolute error up to ``gamma_N |x_t| |x_s|``, so the
  sum has an absolute error up to about ``(N + M + T^2) u tri^2``, with

      tri_i = sum_t |x_t| |d_t|  >=  |g_i|                          (T)

  When the positions' terms are large and nearly cancel (an input with a
  large common offset, ``x_1 = a + u``, ``x_2 = -a + u``), ``tri_i`` is
  many times ``|g_i|`` and the float32 ghost value can be far below the
  truth, even negative.
* **materialised per-example gradients** ``ghat_i = sum_t x_t^T d_t`` carry
  an absolute error up to ``gamma_T tri_i`` (entry by entry, ``gamma_T``
  times ``sum_t |x_tn| |d_tm|``, whose Frobenius norm is at most
  ``tri_i``): linear in the cancellation, not quadratic.

So, with ``e_n = gamma_{n+1} = (n + 1) u / (1 - (n + 1) u)`` the error
factor of an ``n``-term dot product (:func:`dot_error`; ``u`` the unit
roundoff of the products, bfloat16's rounding added below
``Precision.HIGHEST``) and ``xx_ts = |x_t| |x_s|``, ``dd_ts = |d_t| |d_s|``:

    ghost:  |g|^2 <= ghost + e_N sum xx |kd| + e_M sum |kx| dd
                           + e_N e_M tri^2 + s_T (1 + e_N + e_M)
                             sum |kx kd|                              (G)
    materialised:  |g| <= |ghat| sqrt(1 + r_P) + e_T tri              (M)

with ``s_T = 2 e_T (1 + e_T)`` the rounding bound of the sum of the ``T^2``
products in two levels (:func:`two_level_sum`), ``r_P`` the rounding bound of
a sum of ``P`` squares, about
``4 u sqrt(P)`` as :func:`sum_of_squares` forms it in two levels
(Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2002,
section 3.1: ``|fl(x . y) - x . y| <= gamma_n |x| . |y|`` in any order of
summation). ``tri`` and the row norms are sums of non-negative terms,
rounded up by their own bounds. A kernel over many features (a vocabulary's logits
cotangent) is formed in two levels, chunks of about ``sqrt(M)`` features
summed in a loop (:func:`kernel`), and its ``e_M`` is then
:func:`kernel_error`'s, about ``2 sqrt(M) u`` instead of ``M u``.

A kernel asked for bounds (``KernelConfig.upper_bound``) returns, for
each example, (G) where it is tight (its slack below :data:`LOOSE` of the
value) and otherwise (M), from the materialised per-example gradients
formed at run time where some example needs them (a loop of zero or one
rounds, :func:`gram_haiku._src.compute.kernels.loose_fallback`): the
choice is the example's own, so that no example changes another's clip
factor. Kept per-example gradients carry
(M)'s ``e_T tri`` term in a column of their own
(``Rule.per_example_error``). Every clip factor of
:func:`gram_haiku.clipped_grad` is computed from such a bound; the Grams
and norms :func:`gram_haiku.value_grad_and_gram` reports are the nearest
estimates (the materialised form where a ghost value is loose).

**Underflow.** The rounding model above is relative; a result below the
dtype's smallest normal number (``tiny``, about ``1e-38`` in float32) may
be flushed to zero, an absolute error. An example whose inputs are tiny
(``1e-21``) and whose cotangents are huge (``1e19``: a regression target
an adversary chose) has a representable gradient (``1e-2``) while its
squared entries, row norms and ghost kernel entries flush to zero, so
(G) would give it a bound of 0 and a weight of 1. So:

* :func:`row_norms` (hence ``tri``) adds ``2 n tiny`` to its sums of
  squares (:func:`norms_of_sq_sums`), so a row of tiny entries has a norm
  bounded from above, not 0;
* a linear map's bound (``kernels._bounded_linear_sq_norms``, which the
  convolutions' ghost norms use too) adds :func:`underflow_slack`, every
  flushed intermediate's worst effect from the example's largest input
  and cotangent entries: negligible on ordinary data, and large (or inf)
  for an example whose tiny inputs meet huge cotangents.

Limits: a rule's own ``sq_norms`` must honour ``cfg.upper_bound`` (the
built-in ones do); a reparametrising getter's pull-back maps a kept
per-example gradient's rounding bound, which is carried in the layer's
operand space, by its Jacobian, which is not bounded here. The
underflow allowances cover the linear, convolution and embedding
layers' norms, every allowance built from :func:`row_norms` or
:func:`of_sq_sums`, and a getter's generic pull-back (its VJP's flushed
results and folded constants,
:mod:`gram_haiku._src.analysis.linear_bound`); a weight
standardisation's closed form and the normalisation layers' ghost terms
count rounding only, and were checked against float64 with cotangents of
``1e-40`` and ``1e-37`` (``tests/test_clip_bound.py``: every layer of the
zoo; an embedding's bound, without its allowance, was 0 there).
"""

from __future__ import annotations

import fractions
import math

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from gram_haiku._src.compute import cost_model

#: A ghost bound whose slack exceeds this fraction of the value is loose:
#: the kernel then forms the materialised bound for that example (a ghost
#: bound kept is at most ``sqrt(1 + LOOSE)``, about 3%, above the norm;
#: tighter bounds than the worst case would switch less often).
LOOSE = 2.0 ** -4


#: The platforms the bounds tell apart (:func:`per_platform`): a CPU, a TPU,
#: and any other (a GPU).
PLATFORMS = ("cpu", "tpu", "other")


def _kind(dtype):
  """The dtype of the bounds' constants for sums in ``dtype``: float64 for
  float64 (float32 would round its allowances ``1 + 2 u k`` to 1, and its
  ``tiny`` to 0), float32 else (and where x64 is off, float64 being
  float32 then)."""
  return (np.float64 if jax.dtypes.canonicalize_dtype(dtype) == np.float64
          else np.float32)


def _rounded_up(x, dtype=jnp.float32):
  """The least float32 (float64 for a ``dtype`` of float64, whose
  allowances float32 would round away: :func:`_kind`) at or above ``x``,
  an exact rational (``fractions.Fraction``, an int) or inf."""
  kind = _kind(dtype)
  if isinstance(x, float) and not math.isfinite(x):
    return kind(x)
  x = fractions.Fraction(x)
  f = kind(float(x))
  while fractions.Fraction(float(f)) < x:
    f = np.nextafter(f, kind(np.inf))
  return f


def per_platform(value, dtype=jnp.float32) -> jax.Array:
  """A float32 constant (float64 for sums in float64: :func:`_kind`;
  scalar, or a vector of several) that depends on the
  platform the program is compiled for: ``value(platform)`` for each of
  :data:`PLATFORMS`, an exact rational (or inf) or a list of them, rounded
  up. One ``lax.platform_dependent`` of literals where the
  platforms differ, a literal where they agree: the bounds' constants are
  not arithmetic in the traced program."""
  def constant(platform):
    v = value(platform)
    return (np.array([_rounded_up(w, dtype) for w in v], _kind(dtype))
            if isinstance(v, (list, tuple)) else _rounded_up(v, dtype))
  cpu, tpu, other = (constant(p) for p in PLATFORMS)
  if np.array_equal(cpu, tpu) and np.array_equal(cpu, other):
    return jnp.asarray(cpu)
  return lax.platform_dependent(cpu=lambda: jnp.asarray(cpu),
                                tpu=lambda: jnp.asarray(tpu),
                                default=lambda: jnp.asarray(other))


def _static(*sizes) -> bool:
  return all(isinstance(n, (int, np.integer)) for n in sizes)


def _roundoff_on(dtype, platform: str) -> fractions.Fraction:
  """:func:`_op_roundoff`'s value on ``platform``, exactly."""
  u = _exact_u(dtype)
  return 4 * u if platform == "tpu" and jnp.dtype(dtype) != jnp.float64 else u


def _dot_error_on(n: int, dtype, precision, platform: str):
  """:func:`dot_error`'s value on ``platform``: an exact rational, or
  inf."""
  nu = (int(n) + 1) * _roundoff_on(dtype, platform)
  if nu >= 1:
    return math.inf
  out = nu / (1 - nu)
  if precision != lax.Precision.HIGHEST and platform != "cpu":
    out += fractions.Fraction(1, 2 ** 7)
  return out


def dot_error(n, dtype, precision) -> jax.Array:
  """``e`` with ``|fl(a . b) - a . b| <= e |a| . |b|`` for ``n``-term dot
  products accumulated in ``dtype`` at ``precision``, in any order of
  summation: ``gamma_{n+1} = (n + 1) u / (1 - (n + 1) u)`` (one rounding
  per product, ``n - 1`` per sum, one spare), ``u`` the accumulation's
  unit roundoff (float32 at ``Precision.HIGHEST`` counted as
  ``4 * 2^-24`` in a program compiled for a TPU, which forms such products
  from several bfloat16 passes; IEEE float32 elsewhere), plus ``2^-7``
  below ``HIGHEST`` in a program compiled for a TPU or GPU, which may round
  each factor to bfloat16 (or TF32) first (XLA's CPU backend multiplies
  float32 in float32 at every precision). A float32 scalar (float64 for
  ``dtype`` float64, so that ``1 + e`` keeps it: :func:`_kind`; inf where
  ``(n + 1) u >= 1``), rounded up: a constant per platform
  (:func:`per_platform`) for a static ``n``."""
  if _static(n):
    return per_platform(lambda p: _dot_error_on(n, dtype, precision, p),
                        dtype)
  # Traced (a symbolic n): nu and 1 - nu are exact (a power of two times an
  # integer below 1 / u), the division and the sum each rounded to nearest,
  # so each result is moved up one ulp.
  kind = _kind(dtype)
  up = lambda v: lax.nextafter(v, jnp.asarray(jnp.inf, kind))
  nu = (count(n, dtype) + 1) * _op_roundoff(dtype)
  out = jnp.where(nu < 1, up(nu / jnp.maximum(1 - nu, 1e-30)), jnp.inf)
  if precision != lax.Precision.HIGHEST:  # (XLA's CPU dots stay float32.)
    out = up(out + lax.platform_dependent(
        cpu=lambda: jnp.asarray(0, kind),
        default=lambda: jnp.asarray(2.0 ** -7, kind)))
  return out


def division_error(dtype) -> jax.Array:
  """``e`` with ``|fl(a / b) - a / b| <= e |a / b|`` for one division in
  ``dtype``: the unit roundoff ``u`` where division is IEEE-rounded, and
  ``4 u`` in a program compiled for a TPU, which divides by a refined
  reciprocal (the same allowance :func:`dot_error` makes for its float32
  products). A float32 scalar."""
  return _op_roundoff(dtype)


def _op_roundoff(dtype) -> jax.Array:
  """The unit roundoff of one operation in ``dtype`` as the bounds count
  it: ``u``, and ``4 u`` below float64 in a program compiled for a TPU
  (float32 products from bfloat16 passes, division by a refined
  reciprocal). A float32 scalar (float64 for float64: :func:`_kind`)."""
  return per_platform(lambda p: _roundoff_on(dtype, p), dtype)


def count(n, dtype=jnp.float32):
  """A size (an int, or a symbolic size under ``jax.export``) as a float32
  scalar (float64 for a ``dtype`` of float64: :func:`_kind`): a constant
  for an int (arithmetic on it is not traced)."""
  kind = _kind(dtype)
  if _static(n):
    return kind(n)
  return jnp.asarray(n).astype(kind)


def _elementwise_u(dtype) -> float:
  return float(jnp.finfo(dtype).eps) / 2


def _exact_u(dtype) -> fractions.Fraction:
  return fractions.Fraction(float(jnp.finfo(dtype).eps)) / 2


def underflow_slack(t, n, m, mx: jax.Array, md: jax.Array) -> jax.Array:
  """``[B]``: the absolute allowance, in squared-norm units, for
  intermediate results flushed to zero in a linear map's bound (G) or (M)
  over ``T`` positions, ``N`` inputs and ``M`` outputs, from upper bounds
  ``mx`` and ``md`` of each example's largest input and cotangent entries
  (its largest row norms: :func:`row_norms`). With a
  flushed result off by at most ``tiny``: a kernel entry ``x_t . x_s`` by
  ``2 N tiny`` (its products and partial sums), so a product of kernel
  entries by ``2 N tiny |kd| + 2 M tiny |kx| + tiny <= 2 N M tiny (mx^2 +
  md^2) + tiny``; the ``T^2`` products, their sums and the slack's own
  terms at most twice that; a materialised entry by ``2 T tiny``, its
  squared norm by less (``2 |g| 2 T sqrt(N M) tiny`` with ``|g| <= T
  sqrt(N M) mx md``). So ``8 T^2 tiny ((N M + N + M)(mx^2 + md^2) + 1)``:
  negligible on ordinary data, and large (or inf) exactly for an example
  whose tiny inputs meet huge cotangents, which is then clipped harder."""
  # The tiny factor first: ``(N M + N + M) sq`` alone overflowed (to an
  # inf bound) for row norms near 1e18 whose allowance is about 1e3.
  tiny = fractions.Fraction(float(jnp.finfo(mx.dtype).tiny))
  sq = jnp.square(mx) + jnp.square(md)
  if _static(t, n, m):
    return (_rounded_up(8 * tiny * t * t * (n * m + n + m), mx.dtype) * sq +
            _rounded_up(8 * tiny * t * t, mx.dtype))
  n, m, t = (count(k, mx.dtype) for k in (n, m, t))
  scale = 8 * float(tiny) * jnp.square(t)
  return scale * (n * m + n + m) * sq + scale


def row_norms(a: jax.Array) -> jax.Array:
  """``|a_t|`` over the last axis, rounded up by its own rounding bound
  (:func:`norms_of_sq_sums`)."""
  return norms_of_sq_sums(jnp.sum(jnp.square(a), axis=-1), a.shape[-1])


def norms_of_sq_sums(sq: jax.Array, n) -> jax.Array:
  """Norms from sums ``sq`` of ``n`` squares each, summed in any order (in
  ``sq``'s dtype, exact adds), rounded up by their rounding bound: the
  squares and the sum are within ``(1 + u)^(n + 1)`` of the exact value,
  below ``1 + 2 u (n + 4)``, plus ``2 n tiny`` for the squares and partial
  sums flushed to zero (a row of entries near ``1e-21`` has squares below
  float32's ``tiny``: its norm is then bounded by ``sqrt(2 n tiny)``,
  about ``1.5e-19 sqrt(n)``, not by 0)."""
  return jnp.sqrt((sq + _flushed_squares(n, sq.dtype)) *
                  _sum_rounding(n, sq.dtype))


def _flushed_squares(n, dtype):
  """``2 n tiny`` rounded up: the most that a sum of ``n`` squares in
  ``dtype`` loses to squares and partial sums flushed to zero."""
  tiny = fractions.Fraction(float(jnp.finfo(dtype).tiny))
  return (_rounded_up(2 * tiny * int(n), dtype) if _static(n)
          else 2 * float(tiny) * count(n, dtype))


def _sum_rounding(n, dtype):
  """``1 + 2 u (n + 4)``: above the rounding of a sum of ``n`` nonnegative
  terms in any order (and of their squares), ``(1 + u)^(n + 1)``."""
  return rounding_factor(n + 4, dtype)


def rounding_factor(k, dtype):
  """``1 + 2 u k`` in ``dtype``'s unit roundoff ``u``: a relative allowance
  of ``k`` roundings, as a constant rounded up (float64 for ``dtype``
  float64, float32 else; traced for a symbolic ``k``)."""
  if _static(k):
    return _rounded_up(1 + 2 * _exact_u(dtype) * int(k), dtype)
  return 1 + 2 * _elementwise_u(dtype) * count(k, dtype)


def rounded_up_sum(terms: jax.Array, axis) -> jax.Array:
  """The sum of nonnegative ``terms`` over ``axis``, in any order, rounded up
  by its rounding bound (``n`` terms: ``1 + 2 u (n + 4)``)."""
  axes = (axis,) if isinstance(axis, int) else tuple(axis)
  n = math.prod(terms.shape[a] for a in axes)
  return jnp.sum(terms, axis=axis) * _sum_rounding(n, terms.dtype)


def of_sum(err_a: jax.Array, err_b: jax.Array, s: jax.Array) -> jax.Array:
  """``[B]``: the rounding bound (norm units) of rows ``s = fl(a + b)``
  of two per-example gradients off by at most ``err_a`` and ``err_b``:
  ``err_a + err_b + (u / (1 - u)) |s|`` (each entry of the sum rounded
  once, ``|fl(x + y) - (x + y)| <= u/(1 - u) |fl(x + y)|``), rounded up.
  ``s: [B, N]``."""
  u = _elementwise_u(s.dtype)
  total = err_a + err_b + 2 * u * row_norms(s)
  return total * (1 + 4 * u)


def triangle(x: jax.Array, d: jax.Array) -> jax.Array:
  """(T): ``sum_t |x_t| |d_t|`` per example, ``x: (B, T, N)``,
  ``d: (B, T, M)`` -> ``(B,)``, rounded up (see the module docstring)."""
  return rounded_up_sum(row_norms(x.astype(d.dtype)) * row_norms(d), 1)


def two_level_sum(p: jax.Array) -> jax.Array:
  """``sum_{t,s} p_ts`` per example of ``p: (R, T, T)``, in two levels
  kept apart (``lax.optimization_barrier``): each row's ``T`` terms, then
  the ``T`` row sums. Its rounding error is at most
  ``2 e_T (1 + e_T) sum |p_ts|`` (``e_T = dot_error(T)``) in any order of
  summation within a level, where one sum of ``T^2`` terms has
  ``e_{T^2}``: ``T / 2`` times less at ``T`` positions."""
  return jnp.sum(lax.optimization_barrier(jnp.sum(p, axis=-1)), axis=-1)


def ghost_slack(kx: jax.Array, kd: jax.Array, xn: jax.Array, dn: jax.Array,
                n, m, dtype, precision, by_kernel: bool = False) -> jax.Array:
  """The rounding bound of a ghost value ``sum_{t,s} kx_ts kd_ts`` per
  example summed by :func:`two_level_sum`, from the computed kernels
  ``kx, kd: (R, T, T)`` and the row norms ``xn, dn: (R, T)``
  (:func:`row_norms`) of ``N``-wide inputs and ``M``-wide cotangents, with
  ``e_k = dot_error(k)`` (``by_kernel``: ``e_N``, ``e_M`` are
  :func:`kernel_error`'s, the kernels formed by :func:`kernel`) and
  ``s_T = 2 e_T (1 + e_T)`` (the two levels' summation):

      e_N sum |x_t||x_s||kd_ts| + e_M sum |kx_ts||d_t||d_s|
        + e_N e_M tri^2 + s_T (1 + e_N + e_M) sum |kx_ts kd_ts|

  (each computed kernel entry is off by at most ``e_N |x_t||x_s|``, resp.
  ``e_M |d_t||d_s|``, and the ``T^2`` products are summed), rounded up by
  ``(1 + 16 u)`` for its own evaluation. Tighter than ``(e_N + e_M +
  e_{T^2}) tri^2`` where the positions are not aligned.
  """
  t = kx.shape[-1]
  xx = xn[:, :, None] * xn[:, None, :]
  dd = dn[:, :, None] * dn[:, None, :]
  akx, akd = jnp.abs(kx), jnp.abs(kd)

  def coefficients(en, em, e1):  # (float64 per platform, or traced)
    return [en, em, en * em, 2 * e1 * (1 + e1) * (1 + en + em)]
  if _static(n, m, t):
    error_on = _kernel_error_on if by_kernel else _dot_error_on
    c = per_platform(lambda p: coefficients(
        error_on(n, dtype, precision, p), error_on(m, dtype, precision, p),
        _dot_error_on(t, dtype, lax.Precision.HIGHEST, p)), dtype)
  else:
    error = kernel_error if by_kernel else dot_error
    c = jnp.stack(coefficients(error(n, dtype, precision),
                               error(m, dtype, precision),
                               dot_error(t, dtype, lax.Precision.HIGHEST)))
  terms = (c[0] * jnp.sum(xx * akd, axis=(1, 2)) +
           c[1] * jnp.sum(akx * dd, axis=(1, 2)) +
           c[2] * jnp.sum(xx * dd, axis=(1, 2)) +
           c[3] * jnp.sum(akx * akd, axis=(1, 2)))
  return terms * (1 + 16 * _elementwise_u(terms.dtype))


#: Lanes of a TPU vector register: a level-one chunk of more terms is a
#: multiple of this, so that :func:`sum_of_squares`'s and :func:`kernel`'s
#: chunks start on a lane boundary.
_LANES = 128

#: A ghost kernel over more features than this is formed in two levels
#: (:func:`kernel`): one level's rounding bound grows with the features
#: summed per entry, and that of a tied output layer's logits cotangent
#: (``M = 32000``) made every GPT step's ghost bound loose (its ``e_M``
#: term 0.1 of the value off a TPU, 0.4 on one, against :data:`LOOSE`),
#: and the materialised fallback ran one example at a time.
KERNEL_LEVEL_FEATURES = 8192

#: The fewest features per chunk of a two-level kernel: fewer, larger dot
#: products for about the same bound (``(k + C) u`` is flat near its
#: minimum, ``k = sqrt(m)``).
KERNEL_CHUNK = 4 * _LANES


def kernel_split(m):
  """``(chunks, k)`` of :func:`kernel` over ``m`` features, or None for one
  level (fewer than :data:`KERNEL_LEVEL_FEATURES`, or a symbolic count):
  ``k`` at least about ``sqrt(m)`` (a multiple of 128 above 128: a TPU's
  lanes) and :data:`KERNEL_CHUNK`, up to twice that where a larger ``k``
  divides ``m`` (no shorter last chunk: 640 for 32000),
  ``chunks = ceil(m / k)``."""
  if not isinstance(m, int) or m < KERNEL_LEVEL_FEATURES:
    return None
  k = max(math.isqrt(m - 1) + 1, KERNEL_CHUNK)
  step = 1
  if k > _LANES:
    k, step = -(-k // _LANES) * _LANES, _LANES
  k = next((c for c in range(k, 2 * k + 1, step) if m % c == 0), k)
  return -(-m // k), k


def kernel_error(m, dtype, precision) -> jax.Array:
  """``e`` with ``|fl(k_ts) - a_t . a_s| <= e |a_t| . |a_s|`` for an entry of
  :func:`kernel` over ``m`` features: :func:`dot_error` of ``m`` for one
  level; for two, ``e_k + e_C (1 + e_k)`` with ``e_k`` the chunks' dot
  products' and ``e_C`` the sum of the ``C`` chunk values' (each value off
  by at most ``e_k`` times its chunk's ``|a_t| . |a_s|``; the sum of the
  values, at most ``(1 + e_k)`` times those, rounded in any order)."""
  if _static(m):
    return per_platform(lambda p: _kernel_error_on(m, dtype, precision, p),
                        dtype)
  return dot_error(m, dtype, precision)  # (one level: kernel_split)


def _kernel_error_on(m: int, dtype, precision, platform: str) -> float:
  """:func:`kernel_error`'s value on ``platform``, in float64."""
  split = kernel_split(m)
  if split is None:
    return _dot_error_on(m, dtype, precision, platform)
  chunks, k = split
  ek = _dot_error_on(k, dtype, precision, platform)
  ec = _dot_error_on(chunks, dtype, lax.Precision.HIGHEST, platform)
  return ek + ec * (1 + ek)


def kernel(a: jax.Array, precision) -> jax.Array:
  """``k_ts = a_t . a_s`` per row of ``a: (R, T, M)`` -> ``(R, T, T)``:
  one ``dot_general`` below :data:`KERNEL_LEVEL_FEATURES` features, else
  in two levels (:func:`kernel_split`): a loop over the chunks of ``k``
  features, each chunk's kernel (kept apart,
  ``lax.optimization_barrier``) added to the running sum, then the
  shorter last chunk's, so that :func:`kernel_error` bounds its rounding
  (``(k + C) u`` against ``m u``: 45 times less for ``m = 32000``). Same
  multiply-adds, no copy of ``a`` (each chunk a slice) and one
  ``(R, T, T)`` sum held."""
  split = kernel_split(a.shape[-1])
  if split is None:
    return jnp.einsum("itm,ism->its", a, a, precision=precision)
  _, k = split
  m = a.shape[-1]

  def chunk(c):
    return lax.optimization_barrier(
        jnp.einsum("itk,isk->its", c, c, precision=precision))

  full = m // k
  out = lax.fori_loop(
      0, full, lambda i, acc: acc + chunk(
          lax.dynamic_slice_in_dim(a, i * k, k, axis=2)),
      jnp.zeros(a.shape[:2] + a.shape[1:2], a.dtype))
  if full * k < m:
    out = out + chunk(a[:, :, full * k:])
  return out


def ghost(value: jax.Array, slack: jax.Array):
  """(G): ``(bound, loose)`` from a ghost value ``[B]`` and its rounding
  bound (:func:`ghost_slack`, or ``2 (N + M + T^2 + 8) u tri^2``).
  ``loose``: ``bool[B]``, where the slack exceeds :data:`LOOSE` of the
  value."""
  base = jnp.maximum(value, 0)
  return base + slack, slack > LOOSE * base


def coarse_ghost_slack(tri: jax.Array, n, m, t, dtype,
                       precision) -> jax.Array:
  """The ghost value's rounding bound from :func:`triangle` alone:
  ``2 (e_N + e_M + e_{T^2}) tri^2`` (see :func:`ghost_slack`; the factor 2
  covers its second-order terms while each ``e`` is below 1/2). ``n=None``:
  the input kernel is exact (an embedding's key matches), ``e_N = 0``."""
  def total(error):  # error(k, precision): exact per platform, or traced
    e = error(m, precision) + error(t * t, lax.Precision.HIGHEST)
    return e if n is None else e + error(n, precision)
  if _static(m, t) and (n is None or _static(n)):
    e = per_platform(lambda p: total(
        lambda k, prec: _dot_error_on(k, dtype, prec, p)), dtype)
  else:
    e = total(lambda k, prec: dot_error(k, dtype, prec))
  return 2 * e * jnp.square(tri)


#: Per-example rows of more bytes than this are summed by a loop over
#: column chunks rather than through a padded ``(B, rows, k)`` reshape:
#: on a TPU that reshape of a ``[B, P]`` array is a relayout, which for the
#: per-example gradients of a tied 32000 x 768 embedding (``B = 16``) took
#: 49 ms and 3 GB of temp memory against 6.3 ms and none for the loop
#: (one v5e chip, 2026-12-06). The two levels, and so :func:`squares_rel`,
#: are the same either way.
LOOP_BYTES = 1 << 24


def _split(p):
  """``(rows, k)`` of the two-level sum of ``p`` terms, or None for one
  level (few terms, or a symbolic count): ``k`` about ``sqrt(p)`` (a
  multiple of 128 above 128), ``rows = ceil(p / k)``."""
  if not isinstance(p, int) or p <= 64:
    return None
  k = math.isqrt(p - 1) + 1
  if k > _LANES:
    k = -(-k // _LANES) * _LANES
  return -(-p // k), k


def squares_rel(p, dtype):
  """The relative rounding bound of :func:`sum_of_squares` of ``p`` terms
  in ``dtype``: ``2 u (rows + k + 4)`` for its two levels (``2 u (p + 2)``
  for one)."""
  split = _split(p)
  if _static(p):
    terms = p if split is None else sum(split) + 2
    return _rounded_up(2 * _exact_u(dtype) * (int(terms) + 2), dtype)
  return 2 * _elementwise_u(dtype) * (count(p, dtype) + 2)


def sum_in_two_levels(a: jax.Array) -> jax.Array:
  """The sum of ``a: [B, P]`` over its last axis in :func:`sum_of_squares`'
  two levels (the partial sums kept apart), so that its rounding is at most
  ``squares_rel(P) sum |a|`` in any order of summation within a level (a
  sum of ``k`` terms is off by at most ``gamma_{k-1}`` of its absolute
  sum; two levels of ``k`` and ``rows`` terms by ``gamma_{k + rows - 2}``)."""
  p = a.shape[-1]
  split = _split(p)
  if split is None:
    return jnp.sum(a, axis=-1)
  rows, k = split
  a = jnp.pad(a, [(0, 0), (0, rows * k - p)])
  part = jnp.sum(a.reshape((a.shape[0], rows, k)), axis=-1)
  return jnp.sum(lax.optimization_barrier(part), axis=-1)


def sum_of_squares(a: jax.Array) -> jax.Array:
  """The sum of the squares of ``a`` over its axes after the first, in two
  levels of about ``sqrt(P)`` terms each, the partial sums kept apart
  (``lax.optimization_barrier``), so that :func:`squares_rel` bounds its
  rounding in any order of summation within a level (one level of ``P``
  terms would only give ``2 u P``)."""
  a = a.reshape(a.shape[:1] + (math.prod(a.shape[1:]),))
  p = a.shape[-1]
  split = _split(p)
  if split is not None and (cost_model.size_hint(a.shape[0]) * p *
                            jnp.dtype(a.dtype).itemsize > LOOP_BYTES):
    return _chunked_sum_of_squares(a, split[1])
  return sum_in_two_levels(jnp.square(a))


def _chunked_sum_of_squares(a: jax.Array, k: int) -> jax.Array:
  """:func:`sum_of_squares` of ``a: [B, P]`` as a loop over blocks of ``m``
  column chunks of ``k`` (``m k`` columns, about :data:`LOOP_BYTES` per
  block): each chunk summed alone (the first level), its ``m`` sums then
  added to the running sum (the second level, in another order, which
  :func:`squares_rel` allows), and the remainder, with no reshape of the
  whole array (:data:`LOOP_BYTES`). One chunk per step would be ``P / k``
  steps (about ``sqrt(P)``: 4923 for a 32000 x 768 table), each too small
  to keep a TPU busy: 31 ms of a 69 ms clipping step on one v5e chip."""
  p = a.shape[-1]
  full = p // k
  row_bytes = cost_model.size_hint(a.shape[0]) * k * jnp.dtype(
      a.dtype).itemsize
  m = max(1, min(full, LOOP_BYTES // max(row_bytes, 1)))
  blocks = full // m

  def chunks(c, acc):  # c: [B, n k], n whole chunks
    part = jnp.sum(jnp.square(c.reshape(c.shape[:1] + (-1, k))), axis=-1)
    return acc + jnp.sum(lax.optimization_barrier(part), axis=-1)
  out = lax.fori_loop(
      0, blocks, lambda i, acc: chunks(
          lax.dynamic_slice_in_dim(a, i * (m * k), m * k, axis=1), acc),
      jnp.zeros(a.shape[:1], a.dtype))
  if blocks * m < full:  # (fewer than m whole chunks left)
    out = chunks(a[:, blocks * m * k:full * k], out)
  if full * k < p:
    out = out + jnp.sum(jnp.square(a[:, full * k:]), axis=-1)
  return out


def materialized(value: jax.Array, rel, tri: jax.Array, positions,
                 dtype, precision) -> jax.Array:
  """(M), squared: the bound of ``|g|^2`` from ``|ghat|^2`` (``value``,
  with the relative rounding bound ``rel`` of its sum of squares, see
  :func:`sum_of_squares`) and the per-example sum of the absolute terms
  (``tri``) over the ``positions`` summed per entry, each entry a
  ``positions``-term dot product (:func:`dot_error`)."""
  norm = jnp.sqrt(jnp.maximum(value, 0) * (1 + rel))
  slack = dot_error(positions, dtype, precision) * tri
  return jnp.square(norm + slack)


def stored(value: jax.Array, rel) -> jax.Array:
  """The bound of ``|f|^2`` from the sum of squares of stored numbers
  ``f`` (per-example gradients that are themselves the summed quantity)
  with the relative rounding bound ``rel`` (:func:`sum_of_squares`)."""
  return value * (1 + rel)


def of_rows(f: jax.Array, err=None) -> jax.Array:
  """``[B]``: the bound of ``|g_i|^2`` from materialised per-example
  gradients ``f: [B, P]`` that are off by at most ``err: [B]`` (norm
  units; None: ``f`` is what is summed), ``(|f_i| sqrt(1 + r_P) +
  err_i)^2``: (M) with ``err = e_T tri``."""
  return of_sq_sums(sum_of_squares(f), f.shape[1], f.dtype, err)


def of_sq_sums(sq: jax.Array, p, dtype, err=None) -> jax.Array:
  """:func:`of_rows` from the rows' sums of squares ``sq: [B]``
  (:func:`sum_of_squares` of rows of ``p`` entries of ``dtype``), formed
  elsewhere (block by block); plus ``2 p tiny`` for the squares and
  partial sums flushed to zero, as :func:`norms_of_sq_sums` (a getter's
  pull-back ``1e-30 f`` has rows whose squares all flush: its bound was
  0)."""
  value = stored(sq + _flushed_squares(p, sq.dtype), squares_rel(p, dtype))
  if err is None:
    return value
  return jnp.square(jnp.sqrt(value) + err.astype(value.dtype))
