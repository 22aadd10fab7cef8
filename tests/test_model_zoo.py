"""The model zoo (``tests/model_zoo.py``) run unmodified inside
``gram_haiku.track()``.

Where every parameter is covered today (bare positions, class tokens and
logit scales by the program-level rules): the Gram against ``F @ F.T`` of
``vmap(grad)`` of the untracked model (float64), and ``clipped_grad``
against jax-privacy's ``clipped_grad`` (float32). Where not: exactly the
listed parameters are reported untracked (``Grams.complete`` False,
listed in ``coverage``), and ``clipped_grad`` refuses, naming them: never
a silently partial clip.
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.core import reference
from tests import model_zoo

jp_clipping = pytest.importorskip("jax_privacy.clipping")

pytestmark = pytest.mark.filterwarnings(
    "ignore:optax.global_norm is deprecated:DeprecationWarning")

C = 0.5


def _transformed(model, untracked="ignore"):
  def loss(*batch):
    with gram_haiku.track(untracked=untracked):
      return model.net(*batch).sum()
  return hk.transform_with_state(loss)


@functools.lru_cache(maxsize=None)
def _init(name):
  """A zoo model's tracked transform and its jitted init, made once per
  process: the tests that draw the model's parameters (with their own
  seeds, the same shapes) share one traced and compiled init."""
  f = _transformed(_BY_NAME[name])
  return f, jax.jit(f.init)


def _setup(model, seed=0):
  f, init = _init(model.name)
  batch = tuple(jnp.asarray(a) for a in model.batch(seed))
  params, state = init(jax.random.PRNGKey(seed), *batch)
  return f, params, state, batch


def _ids(models):
  return [m.name for m in models]


_BY_NAME = {m.name: m for m in model_zoo.ZOO}
COVERED = [m for m in model_zoo.ZOO if m.covered]
UNTRACKED = [m for m in model_zoo.ZOO if m.untracked]
REFUSED = [m for m in model_zoo.ZOO if m.refused]


@pytest.mark.parametrize("model", COVERED, ids=_ids(COVERED))
def test_a_covered_model_gives_the_reference_gram(model):
  f, params, state, batch = _setup(model)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, *batch)
  assert grams.complete
  plain = hk.transform(lambda *b: model.net(*b).sum())
  ref = reference.reference_gram(
      lambda p, *ex: plain.apply(p, None, *ex), params, *batch, upcast=True)
  reference.assert_gram_close(grams.total, ref)


@pytest.mark.parametrize("model", COVERED, ids=_ids(COVERED))
def test_a_covered_model_clips_like_jax_privacy(model):
  f, params, state, batch = _setup(model, seed=1)
  loss = lambda *a: f.apply(*a)[0]
  argnums = tuple(range(3, 3 + len(batch)))
  theirs = jp_clipping.clipped_grad(loss, l2_clip_norm=C,
                                    batch_argnums=argnums)
  ours = gram_haiku.clipped_grad(loss, l2_clip_norm=C, batch_argnums=argnums)
  want = jax.jit(theirs)(params, state, None, *batch)
  got = jax.jit(ours)(params, state, None, *batch)
  assert (jax.tree_util.tree_structure(got) ==
          jax.tree_util.tree_structure(want))
  scale = max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    # Clip factors from sound upper bounds: at most their excess below.
    np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3 * scale)


#: Models whose bare parameters the program-level rules cover.
PROGRAM = [m for m in COVERED if m.name in (
    "gpt_haiku_example", "gpt_tied_output", "vit_class_token",
    "two_tower_logit_scale")]


@pytest.mark.parametrize("model", PROGRAM, ids=_ids(PROGRAM))
def test_bare_parameters_are_covered_under_untracked_error(model):
  """``track(untracked="error")``: the Gram is complete and the float64
  reference, and ``clipped_grad`` is the float64 reference's clipped sum
  (against jax-privacy: test_a_covered_model_clips_like_jax_privacy, which
  runs these models too)."""
  strict = _transformed(model, untracked="error")
  with jax.enable_x64(True):
    up = lambda a: a.astype(jnp.float64) if a.dtype == jnp.float32 else a
    batch = tuple(up(jnp.asarray(a)) for a in model.batch(2))
    plain = hk.transform(lambda *b: model.net(*b).sum())

    def setup(key, *batch):  # One program: the init and the reference F.
      params, state = strict.init(key, *batch)
      params = jax.tree.map(up, params)
      return params, state, reference.per_example_grads(
          lambda p, *ex: plain.apply(p, None, *ex), params, *batch)
    params, state, f = jax.jit(setup)(jax.random.PRNGKey(2), *batch)
    f = np.asarray(f)
    _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(strict.apply))(
        params, state, None, *batch)
    assert grams.complete
    reference.assert_gram_close(grams.total, f @ f.T, "float64")
    argnums = tuple(range(3, 3 + len(batch)))
    got = jax.jit(gram_haiku.clipped_grad(
        lambda *a: strict.apply(*a)[0], l2_clip_norm=C,
        batch_argnums=argnums))(params, state, None, *batch)
    c = reference.clip_reference(np.sqrt(np.sum(f * f, axis=1)), C)
    want = reference.weighted_sum(f, c, params)
    scale = max(float(np.max(np.abs(w))) for w in jax.tree.leaves(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9 * scale)


@pytest.mark.parametrize("model", UNTRACKED, ids=_ids(UNTRACKED))
def test_an_uncovered_parameter_is_reported_and_clipping_refuses(model):
  f, params, state, batch = _setup(model)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, *batch)
  untracked = sorted(k for k, c in grams.coverage.items() if not c.tracked)
  assert not grams.complete
  assert untracked == sorted(model.untracked)
  loss = lambda *a: f.apply(*a)[0]
  clipped = gram_haiku.clipped_grad(
      loss, l2_clip_norm=C, batch_argnums=tuple(range(3, 3 + len(batch))))
  with pytest.raises(ValueError) as e:
    clipped(params, state, None, *batch)
  for name in model.untracked:
    assert name in str(e.value)
  strict = _transformed(model, untracked="error")
  with pytest.raises(ValueError) as e:
    gram_haiku.value_grad_and_gram(strict.apply)(params, state, None, *batch)
  assert any(name in str(e.value) for name in model.untracked)


@pytest.mark.parametrize("model", REFUSED, ids=_ids(REFUSED))
def test_a_use_that_cannot_be_reported_is_refused_everywhere(model):
  """Refused as soon as the model is traced inside ``track()``: its init
  already (so there is no state to give any entry point)."""
  f = _transformed(model)
  batch = tuple(jnp.asarray(a) for a in model.batch(0))
  with pytest.raises(ValueError, match=model.refused):
    jax.jit(f.init)(jax.random.PRNGKey(0), *batch)
