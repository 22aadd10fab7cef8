"""Attacks on the TPU program's ghost norms at ``HIGHEST`` at once (a
sequence of at least ``cost_model.HIGHEST_FIRST_POSITIONS`` positions
below ``HIGHEST``), run on this CPU: the CPU given an entry of that table
and a TPU's rounding counted (``_as_on_a_tpu``). Inside other transforms
(``jax.vmap`` over groups, ``layer_stack``, ``hk.remat``), through a
``Conv1D``'s patches and a tied embedding, with cancelling positions, large
offsets and tiny cotangents: every clip norm at or above the float64
per-example norm, each example's from its own data (bit for bit), and an
exported program keeps both platforms' branches (a symbolic sequence length
the default precision first)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import norm_bounds
from tests.test_clip_bound import _as_on_a_tpu
from tests.test_clip_bound import _float64_grads
from tests.test_clip_bound import _spy

B, T, N, M = 4, 32, 12, 6


def _on_the_tpu_branch(monkeypatch) -> list:
  """The CPU takes a TPU's branch from 16 positions, a TPU's rounding
  counted; the list records whether each ghost bound was loose."""
  _as_on_a_tpu(monkeypatch)
  monkeypatch.setitem(cost_model.HIGHEST_FIRST_POSITIONS, "cpu", T // 2)
  return _spy(norm_bounds, "ghost", monkeypatch,
              lambda out: np.asarray(out[1]))


def _inputs(kind, seed=0):
  """``(x, v)``: ``(B, T, N)`` inputs and ``(B, T, M)`` cotangents; the
  last example adversarial: ``pairs`` (equal inputs, nearly opposite
  cotangents), ``offset`` (inputs ``+-1e4`` on alternate positions, equal
  cotangents: the ghost products cancel by ``1e8``), ``tiny`` (cotangents
  ``1e-30``, every example)."""
  rng = np.random.RandomState(seed)
  x, v = rng.normal(size=(B, T, N)), rng.normal(size=(B, T, M))
  if kind == "pairs":
    x[-1, 1::2] = x[-1, ::2]
    v[-1, 1::2] = -v[-1, ::2] * (1 + 1e-6)
  elif kind == "offset":
    a = rng.normal(size=N)
    x[-1, ::2] += a * 1e4 / np.linalg.norm(a)
    x[-1, 1::2] -= a * 1e4 / np.linalg.norm(a)
    v[-1, 1::2] = v[-1, ::2]
  elif kind == "tiny":
    v = v * 1e-30
  return x.astype(np.float32), v.astype(np.float32)


def _linear(x):
  return hk.Linear(M, name="l")(x)


def _stack(x):
  h = hk.experimental.layer_stack(2)(
      lambda h: jnp.tanh(hk.Linear(N, name="l")(h)))(x)
  return hk.Linear(M, with_bias=False, name="o")(h)


def _remat(x):
  return hk.remat(_linear)(x)


def _conv(x):
  return hk.Conv1D(M, 3, name="c")(x)


def _tied(x):
  """Ids from the inputs' signs; a tied embedding and unembedding (the
  lookup's cotangents and the unembedding's inputs both over ``T``)."""
  ids = jnp.argmax(x[..., :M], axis=-1)
  e = hk.Embed(M, N, name="e")
  h = e(ids)
  return (h + hk.Linear(N, name="l")(h)) @ e.embeddings.T


def _step(body, x, v):
  """``(step, params, state, true)``: the jitted clip norms of
  ``sum(body(x) * v)`` tracked (ghost, default precision) and the float64
  per-example gradient norms of the plain model."""
  def loss_fn(x, v):
    with gram_haiku.track(strategy="ghost", gram_precision="default"):
      return jnp.sum(body(x) * v)
  f = hk.transform_with_state(loss_fn)
  params, state = f.init(jax.random.PRNGKey(0), x, v)
  clipped = gram_haiku.clipped_grad(f.apply, 1e9)
  step = jax.jit(lambda x, v: clipped(params, state, None, x, v)[1]
                 .grad_norms)
  true = np.linalg.norm(_float64_grads(
      lambda x, v: jnp.sum(body(x) * v), params, x, v), axis=1)
  return step, params, state, true


@pytest.mark.parametrize("body,kind", [
    (_remat, "offset"), (_stack, "pairs"), (_conv, "pairs"),
    (_tied, "pairs")])
def test_clip_norms_at_or_above_float64_in_loops_convs_and_tied_layers(
    body, kind, monkeypatch):
  """Through ``layer_stack``'s scan, ``hk.remat``, a ``Conv1D``'s patches
  and a tied embedding, the last example adversarial: every clip norm at
  or above the float64 norm; the ghost bounds formed once, at ``HIGHEST``
  (never a default-precision pass that is loose for every example)."""
  loose_seen = _on_the_tpu_branch(monkeypatch)
  x, v = _inputs(kind)
  if body is _tied:
    v = np.random.RandomState(1).normal(size=(B, T, M)).astype(np.float32)
    v[-1, 1::2] = -v[-1, ::2]
  step, _, _, true = _step(body, x, v)
  got = np.asarray(step(x, v), np.float64)
  jax.effects_barrier()
  assert np.all(got >= true), got / true
  assert loose_seen and not any(np.all(s) for s in loose_seen), loose_seen


def test_vmapped_groups_each_get_their_own_sound_clip_norms(monkeypatch):
  """``jax.vmap`` of the step over groups of examples (one cancelling, one
  offset, one of tiny cotangents): each group's clip norms at or above its
  own float64 norms, each ghost bound formed once per group."""
  loose_seen = _on_the_tpu_branch(monkeypatch)
  groups = [_inputs(k) for k in ("pairs", "offset", "tiny")]
  xs, vs = (np.stack(a) for a in zip(*groups))
  step, _, _, _ = _step(_linear, *groups[0])
  got = np.asarray(jax.jit(jax.vmap(step))(xs, vs), np.float64)
  jax.effects_barrier()
  assert len(loose_seen) == len(groups), loose_seen
  for g, (x, v) in enumerate(groups):
    _, _, _, true = _step(_linear, x, v)
    assert np.all(got[g] >= true), (g, got[g] / true)


@pytest.mark.parametrize("kind", ["offset", "tiny"])
def test_changing_one_example_leaves_the_others_clip_norms_bit_identical(
    kind, monkeypatch):
  """The first example replaced by an adversarial one (cancelling by
  ``1e8``; cotangents ``1e-30`` scaled by ``1e35``): the others' clip
  norms bit for bit, every one at or above its float64 norm."""
  _on_the_tpu_branch(monkeypatch)
  x, v = _inputs(kind)
  step, params, _, _ = _step(_linear, x, v)
  base = np.asarray(step(x, v))
  x2, v2 = x.copy(), v.copy()
  x2[0], v2[0] = x[-1] * 3, v[-1] * (1e35 if kind == "tiny" else -1)
  got = np.asarray(step(x2, v2))
  np.testing.assert_array_equal(got[1:], base[1:])
  true = np.linalg.norm(_float64_grads(
      lambda x, v: jnp.sum(_linear(x) * v), params, x2, v2), axis=1)
  assert np.all(got >= true), got / true


def test_an_exported_program_keeps_both_branches_and_a_symbolic_t_default(
    monkeypatch):
  """``jax.export`` for the CPU and a TPU at ``T = 128`` (the TPU's own
  entry): the TPU's program forms its products at ``HIGHEST`` only, the
  CPU's at the default precision first; the two-platform program called
  here is sound. With a symbolic ``T`` the TPU's program keeps the
  default precision first."""
  _as_on_a_tpu(monkeypatch)
  t = cost_model.HIGHEST_FIRST_POSITIONS["tpu"]
  rng = np.random.RandomState(0)
  x = rng.normal(size=(B, t, N)).astype(np.float32)
  v = rng.normal(size=(B, t, M)).astype(np.float32)
  x[-1, 1::2] = x[-1, ::2]
  v[-1, 1::2] = -v[-1, ::2] * (1 + 1e-6)
  step, _, _, true = _step(_linear, x, v)

  def below_highest(platforms, *args):
    dots = [line for line in jax.export.export(
        step, platforms=platforms)(*args).mlir_module().splitlines()
            if "stablehlo.dot_general" in line]
    assert dots, platforms
    return sum("HIGHEST" not in line for line in dots)
  assert below_highest(("tpu",), x, v) == 0
  assert below_highest(("cpu",), x, v) > 0
  (ts,) = jax.export.symbolic_shape("t", constraints=("t >= 2",))
  spec = (jax.ShapeDtypeStruct((B, ts, N), jnp.float32),
          jax.ShapeDtypeStruct((B, ts, M), jnp.float32))
  assert below_highest(("tpu",), *spec) > 0
  both = jax.export.export(step, platforms=("cpu", "tpu"))(x, v)
  got = np.asarray(both.call(x, v), np.float64)
  assert np.all(got >= true), got / true
