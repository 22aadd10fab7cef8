"""Every tracked layer and composite model (tests/layer_zoo.py), in every
batching style, against the reference; plus the coupled-example errors."""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku.conformance.plugin import thorough
from tests import layer_zoo
from gram_haiku._src.core.reference import assert_gram_close
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
