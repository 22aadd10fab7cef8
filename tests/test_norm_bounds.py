"""``norm_bounds.sum_of_squares``: both of its evaluations (a padded
reshape for small rows, a loop over blocks of column chunks for large
ones) are within :func:`norm_bounds.squares_rel` of the float64 sum, on
rows whose terms span many magnitudes, under ``jit`` and ``vmap``; and the
module's other rounding bounds (one division's,
:func:`norm_bounds.division_error`) against float64."""

import fractions
import re

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from gram_haiku._src.compute import norm_bounds


def _rows(b, p, seed):
  rng = np.random.RandomState(seed)
  scale = 10.0 ** rng.randint(-4, 5, size=(b, p))
  return (rng.normal(size=(b, p)) * scale + 1e3 * (rng.rand(b, 1) > 0.5)
          ).astype(np.float32)


@pytest.mark.parametrize("path", ["reshape", "loop", "blocks"])
@pytest.mark.parametrize("p", [65, 1000, 16384, 16385, 70001])
def test_both_evaluations_are_within_their_bound(p, path, monkeypatch):
  # loop: one chunk of k per step; blocks: three chunks per step, whole
  # chunks and a partial one left over where P allows.
  k = norm_bounds._split(p)[1]  # pylint: disable=protected-access
  monkeypatch.setattr(norm_bounds, "LOOP_BYTES", {
      "reshape": 1 << 40, "loop": 0, "blocks": 3 * 3 * k * 4}[path])
  a = _rows(3, p, seed=p)
  true = (a.astype(np.float64) ** 2).sum(1)
  rel = float(norm_bounds.squares_rel(p, jnp.float32))
  for fn in (jax.jit(norm_bounds.sum_of_squares),
             jax.vmap(lambda r: norm_bounds.sum_of_squares(r[None])[0])):
    got = np.asarray(fn(jnp.asarray(a)), np.float64)
    assert np.all(got * (1 + rel) >= true), (got, true, rel)
    assert np.all(got * (1 - rel) <= true), (got, true, rel)
  rows, k = norm_bounds._split(p)  # pylint: disable=protected-access
  assert rows * k >= p > (rows - 1) * k
  assert k <= 128 or k % 128 == 0  # lane-aligned chunks
  assert rel < 5 * 2.0 ** -24 * (2 * np.sqrt(p) + 128 + 8)


def test_large_rows_take_the_loop_and_multi_axis_rows_flatten():
  """Above ``LOOP_BYTES`` the lowered program loops over chunks (no
  ``(B, rows, k)`` reshape); a ``[B, n, m]`` input sums like its flattened
  ``[B, n m]`` rows."""
  a = jnp.asarray(_rows(2, 3 * 4099, seed=1))
  small = jax.jit(norm_bounds.sum_of_squares).lower(a).as_text()
  assert "while" not in small
  big = jax.ShapeDtypeStruct((64, norm_bounds.LOOP_BYTES // 64), jnp.float32)
  assert "while" in jax.jit(norm_bounds.sum_of_squares).lower(big).as_text()
  np.testing.assert_array_equal(
      norm_bounds.sum_of_squares(a.reshape(2, 3, 4099)),
      norm_bounds.sum_of_squares(a))


def test_the_fallback_round_is_not_hoisted_out_of_its_loop():
  """``kernels.run_if``'s round stays inside its loop in the compiled
  program (XLA's loop-invariant code motion hoisted a round that read only
  outside values, and the materialised fallback of every layer's norm
  bounds ran on every clipping step), and it gives ``fn(*operands)`` or
  ``otherwise``."""
  from gram_haiku._src.compute import kernels  # pylint: disable=g-import-not-at-top

  def f(pred, x, d):
    return kernels.run_if(
        pred, lambda x, d: jnp.einsum("bti,btj->bij", x, d).sum((1, 2)),
        jnp.full(x.shape[:1], -1.0), (x, d))
  x, d = jnp.ones((4, 8, 32)), jnp.ones((4, 8, 16))
  hlo = jax.jit(f).lower(jnp.array(False), x, d).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):].split("\n}")[0]
  assert "while/body" not in entry, entry
  np.testing.assert_array_equal(f(jnp.array(True), x, d), np.full(4, 8 * 512))
  np.testing.assert_array_equal(f(jnp.array(False), x, d), np.full(4, -1.0))


@pytest.mark.parametrize("m", [100, 8192, 32000 + 77])
def test_two_level_kernels_are_within_their_bound(m):
  """``norm_bounds.kernel``: each entry within ``kernel_error`` times the
  float64 ``|a_t| . |a_s|`` of the float64 kernel, on rows of many
  magnitudes riding on large offsets of either sign (one level below
  ``KERNEL_LEVEL_FEATURES``, two above, 55x tighter at 32000)."""
  a = _rows(2 * 3, m, seed=m).reshape(2, 3, m)
  a *= np.where(np.arange(3) % 2, -1.0, 1.0)[None, :, None]
  got = np.asarray(jax.jit(
      lambda a: norm_bounds.kernel(a, jax.lax.Precision.HIGHEST))(a),
                   np.float64)
  a64 = a.astype(np.float64)
  true = np.einsum("itm,ism->its", a64, a64)
  size = np.einsum("itm,ism->its", np.abs(a64), np.abs(a64))
  e = float(norm_bounds.kernel_error(m, jnp.float32, jax.lax.Precision.HIGHEST))
  assert np.all(np.abs(got - true) <= e * size)
  one = float(norm_bounds.dot_error(m, jnp.float32, jax.lax.Precision.HIGHEST))
  assert (e == one) == (norm_bounds.kernel_split(m) is None)
  if m > 30000:
    assert e < one / 50


def test_a_wide_output_layers_ghost_bound_is_tight(monkeypatch):
  """A linear map to ``M = 8192`` features (a vocabulary) at ``T = 192``
  positions, inputs sharing an offset and nearly orthogonal cotangents
  (logits' cotangents): one level's kernel bound (``e_M sum |kx| |d_t|
  |d_s|``, about ``M T u`` of the value) exceeds ``LOOSE`` and the
  materialised fallback would run; the two-level kernels' is tight, and
  an upper bound of the float64 norm."""
  from gram_haiku._src.compute import kernels  # pylint: disable=g-import-not-at-top
  rng = np.random.RandomState(0)
  t, n, m = 192, 16, 8192
  x = (rng.normal(size=(1, t, n)) + 30.0).astype(np.float32)
  d = rng.normal(size=(1, t, m)).astype(np.float32)
  cfg = kernels.KernelConfig(precision=jax.lax.Precision.HIGHEST,
                             upper_bound=True)

  def norms(x, d):  # (traced at each call)
    return jax.jit(lambda x, d: norm_bounds.ghost(
        *kernels.ghost_sq_norms(x, d, cfg, True)))(x, d)
  g = np.einsum("btn,btm->bnm", x.astype(np.float64), d.astype(np.float64))
  true = (g ** 2).sum((1, 2))
  bound, loose = norms(x, d)
  assert not np.any(loose)
  assert np.all(true <= np.asarray(bound, np.float64))
  assert np.all(np.asarray(bound, np.float64) <= true * 1.01)
  monkeypatch.setattr(norm_bounds, "KERNEL_LEVEL_FEATURES", 1 << 30)
  assert np.all(norms(x, d)[1])  # (one level: loose)


def _lowered_constants(fn, platform: str) -> set[float]:
  """The float constants of ``fn``'s program lowered for ``platform``
  (lowering needs no such device)."""
  text = jax.jit(fn).trace().lower(lowering_platforms=(platform,)).as_text()
  found = set()
  for literal in re.findall(r"dense<(0x[0-9A-F]+|[0-9.eE+-]+)>", text):
    if literal.startswith("0x"):  # (inf and nan, as their bits)
      kind = {10: np.uint32, 18: np.uint64}.get(len(literal))
      if kind is not None:
        found.add(float(np.array(int(literal, 16), kind).view(
            np.float32 if kind is np.uint32 else np.float64)))
      continue
    try:
      found.add(float(literal))
    except ValueError:
      pass
  return found


def test_a_division_is_counted_as_a_tpu_divides():
  """One float32 division's rounding: the unit roundoff where it is
  IEEE-rounded (this CPU: checked on divisions of random numbers), four
  times it in a program lowered for a TPU (a refined reciprocal); float64
  is IEEE everywhere."""
  u = float(jnp.finfo(jnp.float32).eps) / 2
  assert float(norm_bounds.division_error(jnp.float32)) == u
  rng = np.random.default_rng(0)
  a = rng.lognormal(0, 8, 10_000).astype(np.float32)
  b = rng.lognormal(0, 8, 10_000).astype(np.float32)
  got = np.asarray(jnp.asarray(a) / jnp.asarray(b), np.float64)
  exact = np.float64(a) / np.float64(b)
  assert np.max(np.abs(got - exact) / exact) <= u
  fn = lambda: norm_bounds.division_error(jnp.float32)
  f32 = lambda platform: {np.float32(c) for c in _lowered_constants(
      fn, platform)}  # (float32 literals print with 9 digits)
  assert np.float32(4 * u) in f32("tpu")
  assert np.float32(4 * u) not in f32("cpu")
  assert np.float32(u) in f32("cpu")
  u64 = float(jnp.finfo(jnp.float64).eps) / 2
  assert {np.float32(c) for c in _lowered_constants(
      lambda: norm_bounds.division_error(jnp.float64), "tpu")} == {
          np.float32(u64)}


def _exact_dot_error(n, dtype, precision, platform):
  """:func:`norm_bounds.dot_error` from its definition, in exact
  rationals (None: inf)."""
  u = fractions.Fraction(float(jnp.finfo(dtype).eps)) / 2
  if platform == "tpu" and jnp.dtype(dtype) != jnp.float64:
    u *= 4
  nu = (n + 1) * u
  if nu >= 1:
    return None
  extra = (fractions.Fraction(1, 128) if platform != "cpu" and
           precision != lax.Precision.HIGHEST else 0)
  return nu / (1 - nu) + extra


@pytest.mark.parametrize("platform", ["cpu", "tpu", "cuda"])
def test_rounding_constants_are_rounded_up_on_each_platform(platform):
  """The bounds' constants are literals of the program lowered for each
  platform, not arithmetic: ``dot_error`` is the least float32 at or above
  its exact value (a random draw of term counts, dtypes and precisions;
  inf where ``(n + 1) u >= 1``), and the same as the traced evaluation a
  symbolic size takes, up to that one's float32 rounding; the relative
  allowances of float64 sums stay float64 (float32 would round ``1 + 2 u
  k`` to 1)."""
  rng = np.random.default_rng(0)
  ns = [1, 65, 2 ** 24 - 2, 2 ** 26]
  ns += [int(n) for n in rng.integers(1, 1 << 22, 3)]
  for n in ns:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float64):
      for precision in (lax.Precision.HIGHEST, lax.Precision.DEFAULT):
        got = _lowered_constants(
            lambda: norm_bounds.dot_error(n, dtype, precision), platform)
        got = max(got - {0.0, 1.0, 2.0})  # (the index literals)
        want = _exact_dot_error(n, dtype, precision, platform)
        if want is None:
          assert got == np.inf, (n, dtype, precision)
          continue
        f = np.float32(got)
        assert fractions.Fraction(float(f)) >= want, (n, dtype, precision)
        below = np.nextafter(f, np.float32(0))
        assert fractions.Fraction(float(below)) < want, (n, dtype, precision)
        if platform == "cpu":
          traced = norm_bounds.dot_error(jnp.int32(n), dtype, precision)
          np.testing.assert_allclose(float(traced), float(f), rtol=5e-7)
          assert fractions.Fraction(float(traced)) >= want, (n, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_relative_allowances_keep_their_dtype(dtype):
  """``1 + 2 u k`` is a constant of the sum's own dtype, rounded up: in
  float32 it would be 1 for float64's ``u`` (the allowance lost)."""
  with jax.enable_x64(True):
    u = fractions.Fraction(float(jnp.finfo(dtype).eps)) / 2
    factor = norm_bounds.rounding_factor(37, dtype)
    assert np.asarray(factor).dtype == jnp.dtype(dtype)
    assert 1 + 74 * u <= fractions.Fraction(float(factor)) < (
        1 + 74 * u) * (1 + 2 * u)
    value = jnp.asarray([3.0], dtype)
    stored = norm_bounds.stored(value, norm_bounds.squares_rel(1000, dtype))
    assert stored.dtype == value.dtype and float(stored[0]) > 3.0
    sq = jnp.asarray([3.0], dtype)
    assert float(norm_bounds.norms_of_sq_sums(sq, 100)[0]) ** 2 > 3.0


def test_a_symbolic_size_keeps_float64_allowances_and_rounds_up():
  """The traced constants a symbolic size takes (``jax.export``) are those
  of a static one, rounded up: in float64, ``1 + 2 u k`` stayed float32
  (1: the allowance lost) and ``tiny``'s multiples flushed to 0 there;
  ``dot_error``'s division was rounded to nearest (below its value for
  about half the sizes); and a float64 ``dot_error`` was float32, so
  ``1 + e`` was 1 (the standardised bounds' factors)."""
  hi = lax.Precision.HIGHEST
  with jax.enable_x64(True):
    def constants(x):
      t, b = x.shape[1], x.shape[0]
      mx = jnp.max(x, axis=1)
      return (norm_bounds.rounding_factor(t + 4, x.dtype),
              norm_bounds.underflow_slack(t, 3, 4, mx, mx),
              norm_bounds.norms_of_sq_sums(jnp.zeros((b,), x.dtype), t),
              norm_bounds.squares_rel(t, x.dtype) + 1,
              norm_bounds.dot_error(t, x.dtype, hi) + 1)
    for dtype in (jnp.float32, jnp.float64):
      spec = jax.ShapeDtypeStruct(
          (2,) + jax.export.symbolic_shape("t"), dtype)
      exported = jax.export.export(jax.jit(constants))(spec)
      x = jnp.ones((2, 7), dtype)
      for sym, static in zip(exported.call(x), jax.jit(constants)(x)):
        assert sym.dtype == static.dtype == dtype
        np.testing.assert_allclose(sym, static, rtol=3e-7, atol=0)
        assert np.all(sym > (1 if sym.ndim == 0 else 0)), (dtype, sym)
    e = norm_bounds.dot_error(100, jnp.float64, hi)
    assert e.dtype == jnp.float64 and 1 + e > 1
