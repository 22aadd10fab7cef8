"""``norm_bounds.sum_of_squares``: both of its evaluations (a padded
reshape for small rows, a loop over blocks of column chunks for large
ones) are
within :func:`norm_bounds.squares_rel` of the float64 sum, on rows whose
terms span many magnitudes, under ``jit`` and ``vmap``."""

import jax
import jax.numpy as jnp
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
