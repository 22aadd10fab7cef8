"""Flax linen and NNX models through ``gram_haiku.functional``: their
``apply`` (or ``nnx.merge``) is a plain-JAX loss over the parameter
pytree, every parameter covered by a program-level rule. Exact against
``F @ F.T`` of ``vmap(grad)`` (float64), and the same Gram as the Haiku
model with the same weights. Skipped without flax (``pip install
'gram_haiku[flax]'``)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku import functional as gf
from gram_haiku import testing

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

B, F, H, K = 6, 5, 7, 3


def _data(dtype=jnp.float64, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((B, F)), dtype),
          jnp.asarray(rng.integers(0, K, B), jnp.int32))


def _xent(logits, y):
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, y[:, None], -1).sum()


class _LinenMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(jnp.tanh(nn.Dense(H)(x)))
    return nn.Dense(K)(h)


class _NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.inner = nnx.Linear(F, H, rngs=rngs)
    self.norm = nnx.LayerNorm(H, rngs=rngs)
    self.out = nnx.Linear(H, K, rngs=rngs)

  def __call__(self, x):
    return self.out(self.norm(jnp.tanh(self.inner(x))))


def _check_reference(loss, params, x, y):
  _, grads, grams = jax.jit(gf.value_grad_and_gram(loss))(params, x, y)
  f = testing.per_example_grads(loss, params, x, y)
  np.testing.assert_allclose(grams.total, f @ f.T, rtol=1e-10, atol=1e-12)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10,
                                                       atol=1e-12),
               grads, jax.grad(loss)(params, x, y))
  assert grams.complete
  return grams


def test_linen_mlp_is_exact_and_the_same_as_haiku():
  with jax.enable_x64(True):
    x, y = _data()
    model = _LinenMLP()
    params = jax.tree.map(lambda a: a.astype(jnp.float64),
                          model.init(jax.random.PRNGKey(0), x)["params"])

    def loss(params, x, y):
      return _xent(model.apply({"params": params}, x), y)
    grams = _check_reference(loss, params, x, y)

    def haiku_loss(x, y):
      with gram_haiku.track():
        h = jnp.tanh(hk.Linear(H, name="dense_0")(x))
        h = hk.LayerNorm(-1, True, True, eps=1e-6, name="layer_norm_0")(h)
        return _xent(hk.Linear(K, name="dense_1")(h), y)
    f = hk.transform_with_state(haiku_loss)
    _, state = f.init(jax.random.PRNGKey(0), x, y)
    hparams = {"dense_0": {"w": params["Dense_0"]["kernel"],
                           "b": params["Dense_0"]["bias"]},
               "layer_norm_0": {"scale": params["LayerNorm_0"]["scale"],
                                "offset": params["LayerNorm_0"]["bias"]},
               "dense_1": {"w": params["Dense_1"]["kernel"],
                           "b": params["Dense_1"]["bias"]}}
    _, _, hgrams = gram_haiku.value_grad_and_gram(f.apply)(
        hparams, state, None, x, y)
    np.testing.assert_allclose(grams.total, hgrams.total, rtol=1e-10)


def test_nnx_mlp_through_split_and_merge_is_exact():
  with jax.enable_x64(True):
    x, y = _data(seed=1)
    graphdef, state = nnx.split(_NnxMLP(nnx.Rngs(0)), nnx.Param)
    state = jax.tree.map(lambda a: a.astype(jnp.float64), state)

    def loss(state, x, y):
      return _xent(nnx.merge(graphdef, state)(x), y)
    grams = _check_reference(loss, state, x, y)
    assert any("kernel" in name for name in grams.coverage)


def test_linen_cnn_and_embeddings_are_exact_and_clip_as_the_reference():
  class Net(nn.Module):

    @nn.compact
    def __call__(self, img, ids):
      h = nn.Conv(4, (3, 3))(img).mean(axis=(1, 2))
      e = self.param("table", nn.initializers.normal(), (11, 4))[ids]
      e = e + nn.Embed(11, 4)(ids)  # (a jitted jnp.take)
      return nn.Dense(K)(jnp.tanh(h + e.sum(axis=1)))

  with jax.enable_x64(True):
    rng = np.random.default_rng(2)
    img = jnp.asarray(rng.standard_normal((B, 6, 6, 2)))
    ids = jnp.asarray(rng.integers(0, 11, (B, 3)), jnp.int32)
    y = jnp.asarray(rng.integers(0, K, B), jnp.int32)
    model = Net()
    params = jax.tree.map(lambda a: a.astype(jnp.float64),
                          model.init(jax.random.PRNGKey(1), img, ids)
                          ["params"])

    def loss(params, img, ids, y):
      return _xent(model.apply({"params": params}, img, ids), y)
    _, _, grams = jax.jit(gf.value_grad_and_gram(loss))(params, img, ids, y)
    f = np.asarray(testing.per_example_grads(loss, params, img, ids, y))
    np.testing.assert_allclose(grams.total, f @ f.T, rtol=1e-10, atol=1e-12)
    norms = np.linalg.norm(f, axis=1)
    c = float(np.median(norms))
    clipped = jax.jit(gf.clipped_grad(loss, l2_clip_norm=c))(params, img,
                                                             ids, y)
    want = testing.weighted_sum(f, testing.clip_reference(norms, c), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9,
                                                         atol=1e-12),
                 clipped, want)
