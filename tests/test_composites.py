"""Every tracked layer and composite model (tests/layer_zoo.py), in every
batching style, against the reference; plus the coupled-example errors."""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku import testing
from gram_haiku.conformance.plugin import thorough
from tests import layer_zoo
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import assert_sound_norms
from gram_haiku._src.core.reference import RTOL_BF16
from tests import problems

#: The one entry that runs eagerly (op by op) by default: eager dispatch
#: compiles every operation on its own, about 5x a jitted case's time.
EAGER_DEFAULT = "Bias"


def _cases():
  """Every entry in every style with ``--conformance-thorough``; by default
  each entry in one jitted style, taken in turn, so that each style runs on
  about a third of the entries, and one entry eagerly (the conformance
  suite runs every op at every vmap depth, and tests/test_track.py the
  eager and jitted paths side by side)."""
  cases = []
  for i, e in enumerate(layer_zoo.ENTRIES):
    jitted = [s for s in e.styles if s != "eager"] or list(e.styles)
    for s in e.styles:
      if thorough() or s == jitted[i % len(jitted)] or (
          s == "eager" and e.name == EAGER_DEFAULT):
        cases.append(pytest.param(e.name, s, id=f"{e.name}-{s}"))
  return cases


CASES = _cases()


@pytest.mark.parametrize("name,style", CASES)
def test_layer_matches_reference(name, style):
  entry = layer_zoo.BY_NAME[name]
  grams, ref, value, plain_value, grads, plain_grads = layer_zoo.run(
      entry, style, seed=layer_zoo.seed_of(name))
  assert grams.complete, grams.untracked
  if layer_zoo.is_low_precision(entry):
    assert_gram_close(grams.total, ref, rtol=RTOL_BF16)
    return
  assert_gram_close(grams.total, ref)
  np.testing.assert_allclose(value, plain_value, rtol=1e-5)
  chex.assert_trees_all_close(grads, plain_grads, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("test_local_stats", [False, True])
def test_batch_norm_training_is_an_error(test_local_stats):
  x = problems.normal(jax.random.PRNGKey(0), (4, 3))
  def loss(x):
    with gram_haiku.track():
      bn = hk.BatchNorm(True, True, 0.9)
      return jnp.sum(bn(x, is_training=not test_local_stats,
                        test_local_stats=test_local_stats))
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)  # init runs plain
  with pytest.raises(ValueError, match="per-example gradients .*undefined"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x)


# -- configurations other libraries' per-example-gradient suites use ----------
# (Opacus' per-layer grad_sample tests, jax-privacy's clipped_grad models,
# Haiku users' reports) that the zoo above does not hold: each model's
# per-example losses ``[B]``, batch-major; the Gram and the all-layer clipped
# sum against the float64 Jacobian of those losses (the reference for a
# model whose dropout mask is drawn for the whole batch).


def _deep_rnn(x):  # (B, T, F): hk.DeepRNN, batch-major dynamic_unroll.
  core = hk.DeepRNN([hk.LSTM(3), jax.nn.relu, hk.GRU(2)])
  out, _ = hk.dynamic_unroll(core, x, core.initial_state(x.shape[0]),
                             time_major=False)
  return jnp.sum(jnp.tanh(out) ** 2, axis=(1, 2))


def _conv_lstm(x):  # (B, T, W, C): a convolution applied at every step.
  core = hk.Conv1DLSTM((x.shape[2],), 2, 3)
  out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1),
                             core.initial_state(x.shape[0]))
  return jnp.sum(jnp.tanh(out) ** 2, axis=(0, 2, 3))


def _mlp_dropout(x):
  h = hk.nets.MLP([5, 3], activation=jnp.tanh, activate_final=True)(
      x, dropout_rate=0.25, rng=hk.next_rng_key())
  return jnp.sum(jnp.tanh(h) ** 2, axis=-1)


def _attention_sizes_and_mask(x):
  # key, value and model sizes all differ; values other than the keys; a
  # padding mask per example (lengths read from the input).
  t = x.shape[1]
  lengths = 1 + jnp.argmax(x[:, :, 0], axis=1)
  mask = jnp.arange(t)[None, None, None, :] < lengths[:, None, None, None]
  out = hk.MultiHeadAttention(
      2, 3, value_size=5, model_size=7,
      w_init=hk.initializers.VarianceScaling(0.5))(x, x, jnp.sin(x),
                                                   mask=mask)
  return jnp.sum(jnp.tanh(out) ** 2, axis=(1, 2))


SUITE_CONFIGS = {
    "deep_rnn_batch_major": (_deep_rnn, (4, 3, 2)),
    "conv1d_lstm": (_conv_lstm, (4, 3, 5, 2)),
    "mlp_dropout_activate_final": (_mlp_dropout, (4, 5)),
    "attention_sizes_and_mask": (_attention_sizes_and_mask, (4, 4, 6)),
}


@pytest.mark.parametrize("name", sorted(SUITE_CONFIGS))
def test_configurations_of_other_suites(name):
  losses, shape = SUITE_CONFIGS[name]
  x = problems.normal(jax.random.PRNGKey(layer_zoo.seed_of(name)), shape)
  rng = jax.random.PRNGKey(3)

  def tracked(x):
    with gram_haiku.track(untracked="error"):
      return jnp.sum(losses(x))
  f = hk.transform_with_state(tracked)
  plain = hk.transform(losses)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(1), x)
  jac = jax.jit(jax.jacrev(lambda p: plain.apply(p, rng, x)))(params)
  flat = np.concatenate([np.asarray(l, np.float64).reshape(shape[0], -1)
                         for l in jax.tree.leaves(jac)], axis=1)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, rng, x)
  assert_gram_close(grams.total, flat @ flat.T)
  norms = np.linalg.norm(flat, axis=1)
  assert np.all(norms > 0), norms  # (else the case tests less)
  c = float(np.median(norms))
  grads, aux = jax.jit(gram_haiku.clipped_grad(f.apply, c))(
      params, state, rng, x)
  bounds = np.asarray(aux.grad_norms, np.float64)
  assert_sound_norms(bounds, norms)
  want = testing.weighted_sum(flat, testing.clip_reference(bounds, c), params)
  chex.assert_trees_all_close(
      jax.tree.map(lambda a: np.asarray(a, np.float64), grads), want,
      rtol=1e-4, atol=1e-5 * max(np.abs(l).max()
                                 for l in jax.tree.leaves(want)))
