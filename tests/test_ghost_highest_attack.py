"""Attacks on the ghost norms formed below ``HIGHEST`` (a TPU's bfloat16
passes, counted on any platform by ``_as_on_a_tpu``): each loose example's
ghost norm is formed again at ``HIGHEST`` and materialised only where it is
still loose there. Against float64 per-example gradients of the untracked
model: clip norms never below them (cancelling positions, large offsets,
tiny cotangents, bfloat16 inputs and parameters, a bias, several layers),
each example's clip norm from its own data only, and the reported norms
within float32 rounding where nothing cancels."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from tests.test_clip_bound import _as_on_a_tpu
from tests.test_clip_bound import _float64_norms


def _body(layers: int, with_bias: bool, width: int = 8):
  def body(x):
    h = x
    for i in range(layers):
      h = hk.Linear(width, with_bias=with_bias, name=f"l{i}")(h)
      if i + 1 < layers:
        h = jnp.tanh(h)
    return h
  return body


def _setup(x, v, layers=1, with_bias=False, param_dtype=jnp.float32,
           mode="gram", width=8, **track):
  """``(f, params, state, true)``: the tracked model (ghost, default
  precision) and the float64 per-example gradient norms of the plain one."""
  body = _body(layers, with_bias, width)

  def loss_fn(x, v):
    with gram_haiku.track(strategy="ghost", gram_precision="default",
                          mode=mode, **track):
      return jnp.sum(body(x).astype(jnp.float32) * v)
  f = hk.transform_with_state(loss_fn)
  params, state = f.init(jax.random.PRNGKey(0), x, v)
  params = jax.tree.map(lambda a: a.astype(param_dtype), params)
  true = _float64_norms(body, params, np.asarray(x, np.float32), v)
  return f, params, state, true


def _clip_norms(f, params, state, x, v):
  _, aux = jax.jit(gram_haiku.clipped_grad(f.apply, 1e9))(
      params, state, None, x, v)
  return np.asarray(aux.grad_norms, np.float64)


def _reported(f, params, state, x, v):
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, v)
  return np.asarray(grams.norms, np.float64)


def _inputs(kind, b=6, t=64, n=16, m=8, seed=0):
  rng = np.random.RandomState(seed)
  x = rng.normal(size=(b, t, n))
  v = rng.normal(size=(b, t, m))
  if kind == "pairs":  # every example's positions cancel in opposite pairs
    for i in range(b):
      x[i, 1::2] = x[i, ::2]
      v[i, 1::2] = -v[i, ::2] * (1 + 10.0 ** -(i + 1))
  elif kind == "half_pairs":  # half the examples cancel
    for i in range(0, b, 2):
      x[i, 1::2] = x[i, ::2]
      v[i, 1::2] = -v[i, ::2] * (1 + 1e-5)
  elif kind == "offset":  # inputs ~1e4 plus a small variation
    x = 1e4 + rng.normal(size=(b, t, n)) * 1e-1
    v[:, 1::2] = -v[:, ::2] * (1 + 1e-4)
  elif kind == "offset_sign":  # +a/-a offset positions
    a = rng.normal(size=n)
    a *= 1e4 / np.linalg.norm(a)
    x[:, ::2] += a
    x[:, 1::2] -= a
  elif kind == "tiny":  # cotangents near float32's underflow
    v = v * 1e-36
  elif kind == "small":  # squares of cotangent entries flushed to zero
    v = v * 1e-18
  elif kind == "smallish":  # squares of cotangent entries near 1e-30
    v = v * 1e-15
  elif kind == "one_pair":  # one pair of positions far above the rest
    a = rng.normal(size=n) * 1e3
    x[:, 0] += a
    x[:, 1] += a
    v[:, 1] = -v[:, 0]
  elif kind == "tiny_pairs":
    x[:, 1::2] = x[:, ::2]
    v[:, 1::2] = -v[:, ::2] * (1 + 1e-3)
    v = v * 1e-35
  return x.astype(np.float32), v.astype(np.float32)


KINDS = ["plain", "pairs", "half_pairs", "offset", "offset_sign", "tiny",
         "tiny_pairs", "small", "one_pair"]


@pytest.mark.parametrize("layers,with_bias", [(1, False), (1, True),
                                              (3, True)])
@pytest.mark.parametrize("kind", KINDS)
def test_clip_norms_sound(kind, layers, with_bias, monkeypatch):
  """Every clip norm at or above the float64 norm: cancelling pairs of
  positions, large offsets, tiny cotangents, a bias, three layers."""
  _as_on_a_tpu(monkeypatch)
  x, v = _inputs(kind)
  f, params, state, true = _setup(x, v, layers, with_bias)
  got = _clip_norms(f, params, state, x, v)
  ratio = got / np.where(true > 0, true, 1)
  assert np.all(got >= true), (got, true, ratio)


@pytest.mark.parametrize("kind", ["pairs", "offset", "offset_sign",
                                  "tiny_pairs"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_one_example_changes_only_its_own_clip_norm(kind, with_bias,
                                                    monkeypatch):
  """One example replaced by a loose one (or a loose batch's by a plain
  one): every other example's clip norm the same to the bit."""
  _as_on_a_tpu(monkeypatch)
  x, v = _inputs("plain", seed=1)
  xa, va = _inputs(kind, seed=2)
  f, params, state, _ = _setup(x, v, 2, with_bias)
  base = _clip_norms(f, params, state, x, v)
  for j in (0, 3, 5):
    x2, v2 = x.copy(), v.copy()
    x2[j], v2[j] = xa[j], va[j]
    got = _clip_norms(f, params, state, x2, v2)
    others = np.arange(len(base)) != j
    np.testing.assert_array_equal(got[others], base[others])
  # and the reverse: an adversarial batch with one plain example swapped
  base = _clip_norms(f, params, state, xa, va)
  x2, v2 = xa.copy(), va.copy()
  x2[2], v2[2] = x[2], v[2]
  got = _clip_norms(f, params, state, x2, v2)
  others = np.arange(len(base)) != 2
  np.testing.assert_array_equal(got[others], base[others])


@pytest.mark.parametrize("kind", ["pairs", "half_pairs", "offset"])
def test_one_example_changes_only_its_own_reported_norm(kind, monkeypatch):
  """Likewise the reported norms (``mode="norms"``)."""
  _as_on_a_tpu(monkeypatch)
  x, v = _inputs("plain", seed=1)
  xa, va = _inputs(kind, seed=2)
  f, params, state, _ = _setup(x, v, 2, True, mode="norms")
  base = _reported(f, params, state, x, v)
  x2, v2 = x.copy(), v.copy()
  x2[0], v2[0] = xa[0], va[0]
  got = _reported(f, params, state, x2, v2)
  np.testing.assert_array_equal(got[1:], base[1:])


@pytest.mark.parametrize("t", [32, 64, 256])
@pytest.mark.parametrize("layers,with_bias", [(1, False), (3, True)])
@pytest.mark.parametrize("kind", ["plain", "offset_sign", "smallish"])
def test_reported_norms_within_float32_rounding(kind, layers, with_bias, t,
                                                monkeypatch):
  """Where nothing cancels, the reported norms (loose below ``HIGHEST``,
  taken at it) within float32 rounding of the float64 norms."""
  _as_on_a_tpu(monkeypatch)
  x, v = _inputs(kind, t=t)
  f, params, state, true = _setup(x, v, layers, with_bias, mode="norms")
  got = _reported(f, params, state, x, v)
  np.testing.assert_allclose(got, true, rtol=1e-4 if kind != "offset_sign"
                             else 1e-3)


@pytest.mark.parametrize("kind", ["plain", "pairs", "offset", "one_pair"])
@pytest.mark.parametrize("mode", ["gram", "norms"])
def test_time_blocked_ghost_norms(kind, mode, monkeypatch):
  """A memory budget under one example's (T, T) kernels: the time-blocked
  ghost norms and their coarse slack, loose below HIGHEST and at it."""
  _as_on_a_tpu(monkeypatch)
  x, v = _inputs(kind, t=128)
  f, params, state, true = _setup(x, v, 2, True, mode=mode,
                                  memory_budget_bytes=1 << 14)
  if mode == "gram":
    got = _clip_norms(f, params, state, x, v)
    assert np.all(got >= true), got / true
  else:
    got = _reported(f, params, state, x, v)
    if kind in ("plain", "one_pair"):
      np.testing.assert_allclose(got, true, rtol=1e-4)


@pytest.mark.parametrize("with_bias", [False, True])
def test_clip_norms_sound_bfloat16_one_layer(with_bias, monkeypatch):
  """bfloat16 inputs and parameters of one layer whose loss is linear in its
  output: the float64 gradient of the same values is the true one."""
  _as_on_a_tpu(monkeypatch)
  for kind in ("plain", "pairs", "offset_sign", "one_pair"):
    x, v = _inputs(kind)
    xb = jnp.asarray(x, jnp.bfloat16)
    # (cotangents of a bfloat16 output are rounded to bfloat16: values that
    # are, so that the float64 gradient is the program's)
    v = np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32))
    f, params, state, true = _setup(xb, v, 1, with_bias, jnp.bfloat16)
    got = _clip_norms(f, params, state, xb, v)
    assert np.all(got >= true), (kind, got / true)


@pytest.mark.parametrize("t", [32, 96])
def test_clip_norms_sound_across_the_highest_threshold(t, monkeypatch):
  """Cancellation swept finely (1e-1 to 1e-7 of each pair) so that some
  examples sit near the loose threshold at ``HIGHEST``: every clip norm at
  or above the float64 norm, and each example's independent of the rest
  (the batch reversed gives the same norms reversed)."""
  _as_on_a_tpu(monkeypatch)
  rng = np.random.RandomState(3)
  b, n, m = 25, 16, 8
  x = rng.normal(size=(b, t, n))
  v = rng.normal(size=(b, t, m))
  x[:, 1::2] = x[:, ::2] + rng.normal(size=(b, t // 2, n)) * 1e-3
  eps = np.logspace(-1, -7, b)
  v[:, 1::2] = -v[:, ::2] * (1 + eps[:, None, None])
  x, v = x.astype(np.float32), v.astype(np.float32)
  f, params, state, true = _setup(x, v, 1, True)
  got = _clip_norms(f, params, state, x, v)
  assert np.all(got >= true), got / true
  rev = _clip_norms(f, params, state, x[::-1].copy(), v[::-1].copy())
  np.testing.assert_array_equal(rev[::-1], got)


@pytest.mark.parametrize("kind", ["pairs", "offset", "one_pair"])
def test_adding_an_example_changes_no_other_clip_norm(kind, monkeypatch):
  """A batch with one more (loose) example: the others' clip norms as
  before, to the bit (the same program's rounding per example) or, where
  the batch size changes the compiled blocks, within float32 rounding and
  never below the float64 norms."""
  _as_on_a_tpu(monkeypatch)
  x, v = _inputs("plain", seed=1)
  xa, va = _inputs(kind, seed=2)
  f, params, state, true = _setup(x, v, 2, True)
  base = _clip_norms(f, params, state, x, v)
  got = _clip_norms(f, params, state, np.concatenate([x, xa[:1]]),
                    np.concatenate([v, va[:1]]))
  np.testing.assert_array_equal(got[:-1], base)


@pytest.mark.parametrize("mode", ["gram", "norms"])
def test_wide_layer_fallback_in_blocks(mode, monkeypatch):
  """A layer whose per-example gradients (512 x 512) fill the fallback's
  blocks two examples at a time: loose examples across block boundaries,
  an odd batch; sound, and the others' norms unchanged by one added."""
  _as_on_a_tpu(monkeypatch)
  x, v = _inputs("half_pairs", b=5, t=32, n=512, m=512, seed=4)
  f, params, state, true = _setup(x, v, 1, True, mode=mode, width=512)
  run = _clip_norms if mode == "gram" else _reported
  got = run(f, params, state, x, v)
  if mode == "gram":
    assert np.all(got >= true), got / true
  else:
    np.testing.assert_allclose(got[1::2], true[1::2], rtol=1e-4)
  xa, va = _inputs("pairs", b=1, t=32, n=512, m=512, seed=5)
  more = run(f, params, state, np.concatenate([x, xa]),
             np.concatenate([v, va]))
  np.testing.assert_array_equal(more[:-1], got)
