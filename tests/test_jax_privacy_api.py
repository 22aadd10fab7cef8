"""``gram_haiku.clipped_grad`` as a drop-in for jax-privacy's ``clipped_grad``.

The scenarios of jax-privacy's own ``clipped_grad`` tests (its
``tests/gradient_clipping_test.py``), adapted to tracked Haiku models: each
calls ``jax_privacy.clipping.clipped_grad`` (which vmaps the loss over the
examples, a batch of one each) and ``gram_haiku.clipped_grad`` with the same
arguments, and asserts the same outputs: the values, the pytree structure
(jax-privacy's ``AuxiliaryOutput`` with its ``None`` fields) and the dtypes;
where it makes sense also against a float64 reference clipped from
``vmap(grad)``. Both get the loss as ``lambda *a: f.apply(*a)[0]`` (the
function jax-privacy takes; gram_haiku also takes ``f.apply`` itself). The
losses are sums over the examples (jax-privacy's scenarios use means, which
agree with sums on its batches of one; gram_haiku runs the whole batch).

The options gram_haiku cannot honour are refused with a message that names
what to use instead; those messages are tested at the end.
"""

import dp_accounting
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.core import errors
from gram_haiku._src.core.reference import per_example_grads

jp_clipping = pytest.importorskip("jax_privacy.clipping")

# jax-privacy's own clipped_grad calls optax.global_norm (deprecated in
# optax); that warning is theirs.
pytestmark = pytest.mark.filterwarnings(
    "ignore:optax.global_norm is deprecated:DeprecationWarning")

RELATIONS = (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
             dp_accounting.NeighboringRelation.REPLACE_ONE,
             dp_accounting.NeighboringRelation.REPLACE_SPECIAL)


# -- Models ---------------------------------------------------------------

def _quadratic(with_aux: bool = False):
  """jax-privacy's quadratic loss ``0.5 (p - x_i)^2``, summed: ``hk.Bias``
  holds ``p`` (its gradient for example i is ``p - x_i``)."""
  def loss(x):
    with gram_haiku.track():
      d = hk.Bias(name="p")(-x)
    value = 0.5 * jnp.sum(d ** 2)
    return (value, {"key": jnp.mean(x, axis=0)}) if with_aux else value
  f = hk.transform_with_state(loss)
  x = jnp.array([[1.0], [4.0], [7.0]])
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  params = {"p": {"b": jnp.array([2.0])}}
  return f, params, state, x


def _logistic():
  """jax-privacy's logistic regression: pytree parameters and two batch
  arguments (``hk.Linear``; one-hot targets)."""
  def loss(inputs, targets):
    with gram_haiku.track():
      logits = hk.Linear(2, name="linear")(inputs)
    return -jnp.sum(jax.nn.log_softmax(logits) * targets)
  f = hk.transform_with_state(loss)
  inputs = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
  targets = jnp.array([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), inputs, targets)
  return f, params, state, inputs, targets


def _mlp(seed: int, b: int = 8, with_aux: bool = False):
  """A random MLP regression (two tracked layers) on random data."""
  def loss(x, y):
    with gram_haiku.track():
      out = hk.nets.MLP([5, 3], activation=jnp.tanh)(x)
    per = jnp.sum((out - y) ** 2, axis=-1)
    value = jnp.sum(per)
    return (value, {"out": out, "per": per}) if with_aux else value
  f = hk.transform_with_state(loss)
  kx, ky, kp = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (b, 4))
  y = jax.random.normal(ky, (b, 3))
  params, state = jax.jit(f.init)(kp, x, y)
  return f, params, state, x, y


def _both(f, *args, **kwargs):
  """The same function and arguments to jax-privacy's clipped_grad and to
  ours: the loss without Haiku's state, as jax-privacy takes it."""
  loss = lambda *a: f.apply(*a)[0]
  theirs = jp_clipping.clipped_grad(loss, *args, **kwargs)
  ours = gram_haiku.clipped_grad(loss, *args, **kwargs)
  return theirs, ours


def _assert_same(got, want, rtol=1e-5, atol=1e-6):
  """Same structure, shapes, dtypes and (within tolerance) values."""
  assert (jax.tree_util.tree_structure(got) ==
          jax.tree_util.tree_structure(want)), (got, want)
  assert type(got) is type(want)
  for g, w in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    assert jnp.shape(g) == jnp.shape(w), (jnp.shape(g), jnp.shape(w))
    assert jnp.result_type(g) == jnp.result_type(w), (
        jnp.result_type(g), jnp.result_type(w))
    np.testing.assert_allclose(np.asarray(g, np.float64),
                               np.asarray(w, np.float64), rtol=rtol,
                               atol=atol)


def _jit(fn):
  """``fn`` called under ``jax.jit`` (keyword arguments traced too): one
  compile per call instead of one per primitive, as a training step runs it."""
  return lambda *args, **kwargs: jax.jit(
      lambda args, kwargs: fn(*args, **kwargs))(args, kwargs)


def _assert_same_callable(ours, theirs):
  assert type(ours) is type(theirs)
  assert ours.has_aux == theirs.has_aux
  assert ours.l2_norm_bound == theirs.l2_norm_bound
  for relation in RELATIONS:
    assert ours.sensitivity(relation) == theirs.sensitivity(relation)


def _reference(f, params, state, args, c, pad=None):
  """float64: ``sum_i min(1, C / |g_i|) g_i`` from ``vmap(grad)`` of each
  example's loss (NaN/inf gradients give the example weight 0), and the
  norms ``|g_i|``."""
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    a64 = [jnp.asarray(a, jnp.float64) for a in args]

    def one(p, *example):
      out = f.apply(p, state, None, *[e[None] for e in example])[0]
      return out[0] if isinstance(out, tuple) else out
    grads = jax.jit(jax.vmap(jax.grad(one), in_axes=(None,) + (0,) * len(
        a64)))(p64, *a64)
    sq = sum(jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1)
             for g in jax.tree.leaves(grads))
    norms = jnp.sqrt(sq)
    w = jnp.where(norms > c, c / jnp.where(norms > 0, norms, 1), 1.0)
    w = jnp.where(jnp.isfinite(norms), w, 0.0)
    if pad is not None:
      w = jnp.where(pad, 0.0, w)
    total = jax.tree.map(
        lambda g: jnp.tensordot(w, jnp.where(
            (w > 0).reshape((-1,) + (1,) * (g.ndim - 1)), g, 0), axes=1),
        grads)
    return (jax.tree.map(np.asarray, total), np.asarray(norms))


# -- jax-privacy's scenarios ---------------------------------------------

def test_basic_clipped_sum():
  """Per-example gradients 1, -2, -5 (p = 2, x = 1, 4, 7) clipped to 2.5:
  1 - 2 - 2.5 = -3.5."""
  f, params, state, x = _quadratic()
  theirs, ours = _both(f, argnums=0, batch_argnums=3, l2_clip_norm=2.5,
                       rescale_to_unit_norm=False)
  want = _jit(theirs)(params, state, None, x)
  got = _jit(ours)(params, state, None, x)
  _assert_same(got, want)
  np.testing.assert_allclose(got["p"]["b"], [-3.5], atol=1e-6)
  _assert_same_callable(ours, theirs)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_low_precision_under_jit(dtype):
  f, params, state, x = _quadratic()
  params = jax.tree.map(lambda a: a.astype(dtype), params)
  x = x.astype(dtype)
  theirs, ours = _both(f, argnums=0, batch_argnums=3, l2_clip_norm=2.5)
  want = jax.jit(theirs)(params, state, None, x)
  got = jax.jit(ours)(params, state, None, x)
  _assert_same(got, want, rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(np.float32(got["p"]["b"][0]), -3.5, atol=1e-2)


def test_rescale_to_unit_norm():
  f, params, state, x = _quadratic()
  theirs, ours = _both(f, argnums=0, batch_argnums=3, l2_clip_norm=2.5,
                       rescale_to_unit_norm=True)
  got = _jit(ours)(params, state, None, x)
  _assert_same(got, _jit(theirs)(params, state, None, x))
  np.testing.assert_allclose(got["p"]["b"], [-3.5 / 2.5], atol=1e-6)
  _assert_same_callable(ours, theirs)
  assert ours.sensitivity() == 1.0


def test_padding_examples_under_jit():
  f, params, state, x = _quadratic()
  theirs, ours = _both(f, argnums=0, batch_argnums=3, l2_clip_norm=2.5,
                       rescale_to_unit_norm=True)
  theirs, ours = jax.jit(theirs), jax.jit(ours)
  for pad, want_b in (([False] * 3, -3.5 / 2.5), ([True] * 3, 0.0),
                      ([False, True, True], 1.0 / 2.5)):
    pad = jnp.array(pad)
    got = _jit(ours)(params, state, None, x, is_padding_example=pad)
    _assert_same(got, _jit(theirs)(params, state, None, x,
                                   is_padding_example=pad))
    np.testing.assert_allclose(got["p"]["b"], [want_b], atol=1e-6)


def test_padding_rows_keep_their_values_and_norms():
  """Padded rows add nothing to the sum; their values and norms are still
  reported, as jax-privacy's are."""
  f, params, state, x, y = _mlp(11, b=6, with_aux=True)
  pad = jnp.array([False, True, False, False, True, False])
  theirs, ours = _both(f, 0, True, l2_clip_norm=0.8, batch_argnums=(3, 4),
                       return_values=True, return_grad_norms=True)
  got = jax.jit(ours)(params, state, None, x, y, is_padding_example=pad)
  _assert_same(got, jax.jit(theirs)(params, state, None, x, y,
                                    is_padding_example=pad),
               rtol=2e-5, atol=1e-6)
  want, norms = _reference(f, params, state, (x, y), 0.8, pad=pad)
  _assert_same(got[0], jax.tree.map(lambda a: a.astype(np.float32), want),
               rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(got[1].grad_norms, norms, rtol=1e-5)


def test_has_aux_gives_per_example_aux():
  f, params, state, x = _quadratic(with_aux=True)
  theirs, ours = _both(f, argnums=0, has_aux=True, batch_argnums=3,
                       l2_clip_norm=10.0)
  got = _jit(ours)(params, state, None, x)
  want = _jit(theirs)(params, state, None, x)
  _assert_same(got, want)
  grads, aux = got
  assert isinstance(aux, jp_clipping.AuxiliaryOutput)
  assert aux.values is None and aux.grad_norms is None
  # One row per example (jax-privacy squeezes the batch axis of one).
  np.testing.assert_allclose(aux.aux["key"], x[:, 0])
  np.testing.assert_allclose(grads["p"]["b"], [1.0 - 2.0 - 5.0], atol=1e-6)
  _assert_same_callable(ours, theirs)


def test_return_grad_norms():
  f, params, state, x = _quadratic()
  theirs, ours = _both(f, argnums=0, batch_argnums=3, l2_clip_norm=10.0,
                       rescale_to_unit_norm=False, return_grad_norms=True)
  grads, aux = got = _jit(ours)(params, state, None, x)
  _assert_same(got, _jit(theirs)(params, state, None, x))
  np.testing.assert_allclose(aux.grad_norms, [1.0, 2.0, 5.0], rtol=1e-5)
  assert aux.values is None and aux.aux is None
  np.testing.assert_allclose(grads["p"]["b"], [1.0 - 2.0 - 5.0], atol=1e-6)
  assert ours.has_aux and theirs.has_aux


@pytest.mark.parametrize("with_aux", [True, False])
def test_return_values(with_aux):
  f, params, state, x = _quadratic(with_aux=with_aux)
  theirs, ours = _both(f, argnums=0, has_aux=with_aux, batch_argnums=3,
                       l2_clip_norm=10.0, rescale_to_unit_norm=False,
                       return_values=True)
  got = _jit(ours)(params, state, None, x)
  _assert_same(got, _jit(theirs)(params, state, None, x))
  np.testing.assert_allclose(got[1].values, [0.5, 2.0, 12.5], rtol=1e-6)
  assert (got[1].aux is not None) == with_aux


def test_pytree_params_and_two_batch_arguments_under_jit():
  f, params, state, inputs, targets = _logistic()
  theirs, ours = _both(f, argnums=0, batch_argnums=(3, 4), l2_clip_norm=1.0,
                       rescale_to_unit_norm=False)
  got = jax.jit(ours)(params, state, None, inputs, targets)
  _assert_same(got, jax.jit(theirs)(params, state, None, inputs, targets))
  assert (jax.tree_util.tree_structure(got) ==
          jax.tree_util.tree_structure(params))
  want, _ = _reference(f, params, state, (inputs, targets), 1.0)
  _assert_same(got, jax.tree.map(lambda a: a.astype(np.float32), want),
               rtol=1e-5, atol=1e-6)


def test_positional_form_and_tuple_argnums():
  """``clipped_grad(fun, argnums, has_aux, l2_clip_norm=...)`` as jax's
  grad takes them: a tuple ``argnums`` returns a tuple of gradients."""
  f, params, state, x = _quadratic(with_aux=True)
  theirs, ours = _both(f, (0,), True, l2_clip_norm=2.5, batch_argnums=(3,))
  got = _jit(ours)(params, state, None, x)
  _assert_same(got, _jit(theirs)(params, state, None, x))
  assert isinstance(got[0], tuple) and len(got[0]) == 1


# -- Beyond jax-privacy's own scenarios: edge cases and random draws -------

def test_zero_clip_norm_is_a_zero_gradient():
  f, params, state, x, y = _mlp(1)
  theirs, ours = _both(f, l2_clip_norm=0.0, batch_argnums=(3, 4),
                       return_grad_norms=True)
  got = _jit(ours)(params, state, None, x, y)
  _assert_same(got, _jit(theirs)(params, state, None, x, y), rtol=1e-4)
  assert not any(np.any(g) for g in jax.tree.leaves(got[0]))
  _assert_same_callable(ours, theirs)
  assert ours.sensitivity() == 0.0


def test_traced_clip_norm_under_jit():
  """As jax-privacy's: the clip norm may be a traced value (e.g. adaptive
  clipping); the sensitivity is then traced too."""
  f, params, state, x, y = _mlp(2)

  def step(make, c):
    g = make(f, l2_clip_norm=c, batch_argnums=(3, 4), normalize_by=4.0)
    return g(params, state, None, x, y), g.sensitivity()

  theirs = lambda f, **kw: jp_clipping.clipped_grad(
      lambda *a: f.apply(*a)[0], **kw)
  ours = lambda f, **kw: gram_haiku.clipped_grad(f.apply, **kw)
  for c in (0.3, 0.0, -1.0):
    got = jax.jit(lambda c: step(ours, c))(c)
    want = jax.jit(lambda c: step(theirs, c))(c)
    if c >= 0:
      _assert_same(got, want, rtol=1e-5, atol=1e-7)
  # A negative traced norm clips to zero in both; its sensitivity is 0 here
  # (jax-privacy reports the negative c / normalize_by).
  _assert_same(got[0], want[0], rtol=0, atol=0)
  assert float(got[1]) == 0.0 and float(want[1]) == -0.25
  # A traced NaN (a diverged adaptive estimate) acts as 0: a zero
  # gradient with sensitivity 0, never the unclipped sum.
  grads, sens = jax.jit(lambda c: step(ours, c))(jnp.nan)
  assert all(float(jnp.max(jnp.abs(g))) == 0.0
             for g in jax.tree.leaves(grads)) and float(sens) == 0.0
  # A static norm compiles the same sum.
  got = jax.jit(lambda c: step(ours, c))(0.3)[0]
  static = gram_haiku.clipped_grad(f.apply, l2_clip_norm=0.3,
                                   batch_argnums=(3, 4), normalize_by=4.0)
  _assert_same(got, jax.jit(static)(params, state, None, x, y), rtol=1e-5,
               atol=1e-7)


def test_traced_clip_norm_with_rescale():
  f, params, state, x, y = _mlp(3)
  kw = dict(l2_clip_norm=None, rescale_to_unit_norm=True,
            batch_argnums=(3, 4))

  def run(make, c):
    return make(f, **{**kw, "l2_clip_norm": c})(params, state, None, x, y)
  got = jax.jit(lambda c: run(lambda f, **k: gram_haiku.clipped_grad(
      f.apply, **k), c))(0.5)
  want = jax.jit(lambda c: run(lambda f, **k: jp_clipping.clipped_grad(
      lambda *a: f.apply(*a)[0], **k), c))(0.5)
  _assert_same(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_draws_against_jax_privacy_and_float64(seed):
  """Random MLPs and batches, a clip norm at the median norm: values, norms
  and aux per example, and the clipped sum, against jax-privacy and a
  float64 reference."""
  f, params, state, x, y = _mlp(10 + seed, b=7, with_aux=True)
  _, norms = _reference(f, params, state, (x, y), np.inf)
  c = float(np.median(norms))
  theirs, ours = _both(f, 0, True, l2_clip_norm=c, normalize_by=3.0,
                       batch_argnums=(3, 4), return_values=True,
                       return_grad_norms=True)
  got = jax.jit(ours)(params, state, None, x, y)
  _assert_same(got, jax.jit(theirs)(params, state, None, x, y), rtol=2e-5,
               atol=1e-6)
  want, norms = _reference(f, params, state, (x, y), c)
  _assert_same(got[0], jax.tree.map(lambda a: (a / 3.0).astype(np.float32),
                                    want), rtol=2e-5, atol=1e-6)
  # The clip factors come from sound upper bounds of the norms.
  assert np.all(np.asarray(got[1].grad_norms, np.float64) >= norms * (1 -
                                                                      1e-7))
  _assert_same_callable(ours, theirs)


def test_default_batch_arguments_and_dtype():
  """Without batch_argnums every argument after rng holds examples (here
  both); ``dtype`` sets the sum's dtype."""
  f, params, state, x, y = _mlp(4)
  for dtype in (jnp.float32, jnp.bfloat16):
    got = _jit(gram_haiku.clipped_grad(f.apply, l2_clip_norm=0.5,
                                       dtype=dtype))(params, state, None, x, y)
    want = _jit(jp_clipping.clipped_grad(
        lambda *a: f.apply(*a)[0], l2_clip_norm=0.5, dtype=dtype,
        batch_argnums=(3, 4)))(params, state, None, x, y)
    _assert_same(got, want, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5,
                 atol=1e-2 if dtype == jnp.bfloat16 else 1e-6)


@pytest.mark.parametrize("strategy,clipping", [
    ("ghost", "all-layer"), ("materialize", "all-layer"),
    ("ghost", "per-layer")])
def test_a_float16_models_sum_in_float32_does_not_overflow(strategy,
                                                            clipping):
  """jax-privacy casts each per-example gradient to ``dtype`` before the
  sum, so ``dtype=float32`` keeps a float16 model's sum over the batch
  from overflowing. The re-contraction ran the layer's VJP in float16 and
  cast the result up: every weight entry was inf (64 examples, each
  clipped to C = 1e4, summing to 1.2e5 > 65504) where jax-privacy gives
  1.2e5. Against the float64 sum of the exact per-example gradients
  ``x_i^T v_i`` (a linear loss, inputs exact in float16)."""
  rng = np.random.RandomState(0)
  b, c = 64, 1e4
  x = jnp.asarray(np.abs(rng.normal(size=(b, 2, 6))) * 30 + 30, jnp.float16)
  v = jnp.asarray(rng.normal(size=(b, 2, 5)) * 2 + 20, jnp.float16)

  def loss_fn(x, v):
    with gram_haiku.track(strategy=strategy):
      out = hk.Linear(5, with_bias=False, name="layer")(x)
    return jnp.sum((out * v).astype(jnp.float32))
  f = hk.transform_with_state(loss_fn)
  params, state = f.init(jax.random.PRNGKey(0), x, v)
  params = jax.tree.map(lambda a: a.astype(jnp.float16), params)
  got = _jit(gram_haiku.clipped_grad(f.apply, l2_clip_norm=c, clipping=clipping,
                                     dtype=jnp.float32))(
                                         params, state, None, x, v)
  g = np.einsum("btn,btm->bnm", np.asarray(x, np.float64),
                np.asarray(v, np.float64))
  norms = np.sqrt((g ** 2).sum((1, 2)))
  want = (np.minimum(1, c / norms)[:, None, None] * g).sum(0)
  assert np.abs(want).max() > 65504
  assert got["layer"]["w"].dtype == jnp.float32
  np.testing.assert_allclose(got["layer"]["w"], want, rtol=1e-5)


@pytest.mark.parametrize("clipping", ["all-layer", "per-layer"])
def test_a_float16_tied_embeddings_sum_in_float32_does_not_overflow(
    clipping):
  """As above, for an embedding tied to the output layer
  (:func:`gram_haiku.unembed`), whose two applications keep factors of
  their own (``PARTS``): their re-contractions ran in float16 too (the
  sum's entries reach 4.6e5). Against the float64 per-example gradients
  weighted by the step's own clip factors."""
  rng = np.random.RandomState(0)
  b, c = 64, 3e4
  ids = jnp.asarray(rng.randint(0, 7, size=(b, 3)), jnp.int32)
  y = jnp.asarray(rng.normal(size=(b, 3, 7)) * 50 + 200, jnp.float16)

  def body(ids, y):
    e = hk.Embed(7, 6, name="embed")
    return jnp.sum((gram_haiku.unembed(e, e(ids)) * y).astype(jnp.float32))

  def loss_fn(ids, y):
    with gram_haiku.track():
      return body(ids, y)
  f = hk.transform_with_state(loss_fn)
  params, state = f.init(jax.random.PRNGKey(0), ids, y)
  params = jax.tree.map(lambda a: (a * 30).astype(jnp.float16), params)
  got, aux = _jit(gram_haiku.clipped_grad(
      f.apply, c, clipping=clipping, dtype=jnp.float32))(
          params, state, None, ids, y)
  plain = hk.transform(body)
  with jax.enable_x64(True):
    grads = np.asarray(per_example_grads(
        lambda p, i, yy: plain.apply(p, None, i, yy),
        jax.tree.map(lambda a: np.asarray(a, np.float64), params),
        np.asarray(ids), np.asarray(y, np.float64)), np.float64)
  (weights,) = aux.weights.values()
  want = (np.asarray(weights, np.float64)[:, None] * grads).sum(0)
  assert np.abs(want).max() > 65504
  # float32 sums of 192 products each (the reference's float32 row).
  np.testing.assert_allclose(np.ravel(got["embed"]["embeddings"]), want,
                             rtol=1e-4, atol=3e-5 * np.abs(want).max())


def test_huge_norm_example_moves_the_sum_by_at_most_c():
  """An adversarial example (inputs and target ~1e6): its gradient (norm
  ~1e12) enters at norm C, as in jax-privacy; replacing it moves the sum
  by at most the REPLACE_ONE sensitivity."""
  f, params, state, x, y = _mlp(5)
  big_x, big_y = x.at[2].set(1e6), y.at[2].set(-1e6)
  theirs, ours = _both(f, l2_clip_norm=1.0, batch_argnums=(3, 4),
                       return_grad_norms=True)
  got = _jit(ours)(params, state, None, big_x, big_y)
  want = _jit(theirs)(params, state, None, big_x, big_y)
  _assert_same(got[0], want[0], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got[1].grad_norms, want[1].grad_norms,
                             rtol=1e-4)
  ref, _ = _reference(f, params, state, (big_x, big_y), 1.0)
  _assert_same(got[0], jax.tree.map(lambda a: a.astype(np.float32), ref),
               rtol=1e-4, atol=1e-5)
  base = _jit(ours)(params, state, None, x, y)[0]
  moved = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - b) ** 2)
                      for a, b in zip(jax.tree.leaves(got[0]),
                                      jax.tree.leaves(base))))
  assert moved <= ours.sensitivity(RELATIONS[1]) * (1 + 1e-6)


@pytest.mark.parametrize("nan_safe", [True, False])
def test_nan_example_contributes_nothing(nan_safe):
  """A NaN in one example's input: jax-privacy's ``nan_safe=True`` zeroes
  its (all-NaN) gradient, and so does gram_haiku, whose non-finite
  examples always get weight 0 (``nan_safe=False`` changes nothing here,
  where jax-privacy's sum would be NaN)."""
  f, params, state, x, y = _mlp(6)
  bad = x.at[4].set(jnp.nan)
  theirs, ours = _both(f, l2_clip_norm=1.0, batch_argnums=(3, 4),
                       return_values=True, return_grad_norms=True,
                       nan_safe=nan_safe)
  got = _jit(ours)(params, state, None, bad, y)
  want = _jit(theirs)(params, state, None, bad, y)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(got[0]))
  if nan_safe:
    _assert_same(got[0], want[0], rtol=1e-5, atol=1e-6)
  # The clipped sum of the other examples.
  keep = jnp.arange(x.shape[0]) != 4
  rest = _jit(ours)(params, state, None, x, y, is_padding_example=~keep)
  _assert_same(got[0], rest[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.isnan(got[1].values),
                                np.isnan(want[1].values))
  assert not np.isfinite(got[1].grad_norms[4])
  np.testing.assert_allclose(got[1].grad_norms[keep],
                             want[1].grad_norms[keep], rtol=1e-4)


def test_full_aux_and_the_earlier_form():
  """``full_aux=True`` keeps this library's ClippedGradAux; the earlier
  form ``clipped_grad(apply, C)`` means ``l2_clip_norm=C, full_aux=True``."""
  f, params, state, x, y = _mlp(7)
  bare = gram_haiku.clipped_grad(f.apply, l2_clip_norm=0.5)(
      params, state, None, x, y)
  for fn in (gram_haiku.clipped_grad(f.apply, l2_clip_norm=0.5,
                                     full_aux=True),
             gram_haiku.clipped_grad(f.apply, 0.5)):
    assert fn.has_aux and fn.sensitivity() == 0.5
    grads, aux = fn(params, state, None, x, y)
    assert isinstance(aux, gram_haiku.ClippedGradAux)
    _assert_same(grads, bare, rtol=0, atol=0)
    assert aux.grad_norms.shape == (x.shape[0],)


# -- Refusals -------------------------------------------------------------

def test_refused_options_name_the_equivalent():
  f, params, state, x = _quadratic()
  make = lambda **kw: gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0,
                                              **kw)
  cases = [
      (dict(pre_clipping_transform=lambda g: g),
       errors.JAXP_PRE_CLIPPING_TRANSFORM, "clipping='per-layer'"),
      (dict(microbatch_size=3), errors.JAXP_MICROBATCH_SIZE.format(size=3),
       "leave microbatch_size out"),
      (dict(prng_argnum=2), errors.JAXP_PRNG_ARGNUM.format(argnum=2),
       "pass the key as rng"),
      (dict(spmd_axis_name="data"),
       errors.JAXP_SPMD_AXIS_NAME.format(name="data"), "mesh_axes='data'"),
      (dict(keep_batch_dim=False), errors.JAXP_KEEP_BATCH_DIM,
       "return the sum of the per-example losses"),
      (dict(argnums=1), errors.JAXP_ARGNUMS.format(argnums=1), "frozen="),
  ]
  for kw, message, fix in cases:
    assert fix in message and "What to do:" in message
    with pytest.raises(ValueError) as e:
      make(**kw)
    assert str(e.value) == message
  for c in (0.0, np.inf):
    with pytest.raises(ValueError, match="normalize_by=C"):
      gram_haiku.clipped_grad(f.apply, l2_clip_norm=c,
                              rescale_to_unit_norm=True)
  with pytest.raises(ValueError, match="clip_fn='automatic'"):
    gram_haiku.clipped_grad(f.apply, l2_clip_norm=0.0,
                            rescale_to_unit_norm=True)
  with pytest.raises(ValueError, match="not both"):
    make(full_aux=True, return_grad_norms=True)
  # The positional clip norm (the earlier form) is full_aux=True too: the
  # error says so, and how to ask for jax-privacy's aux (it said
  # "full_aux=True returns ..." to a call that never passed full_aux).
  with pytest.raises(ValueError, match=r"clipped_grad\(apply, C\).*\n.*"
                     "l2_clip_norm=C"):
    gram_haiku.clipped_grad(f.apply, 1.0, return_grad_norms=True)
  with pytest.raises(TypeError, match="l2_clip_norm"):
    gram_haiku.clipped_grad(f.apply)
  with pytest.raises(ValueError, match="must be a positive"):
    make(normalize_by=0.0)
  with pytest.raises(ValueError, match="positive number or 0"):
    gram_haiku.clipped_grad(f.apply, l2_clip_norm=-1.0)


def test_traced_per_layer_threshold_is_refused():
  f, params, state, x, y = _mlp(8)
  with pytest.raises(ValueError, match="clipping='all-layer'"):
    jax.jit(lambda c: gram_haiku.clipped_grad(
        f.apply, l2_clip_norm=c, clipping="per-layer")(
            params, state, None, x, y))(1.0)


def test_batch_argnums_checks_match_jax_privacy():
  """jax-privacy's argument checks (overlap with argnums, empty, differing
  batch sizes), plus the arguments of ``fun(params, state, rng, *batch)``
  that cannot hold examples."""
  f, params, state, x = _quadratic()
  for batch_argnums, match in ((0, "overlap"), ((), "must not be empty"),
                               (1, "Haiku's state"), ((2, 3), "Haiku's rng"),
                               (-1, ">= 0")):
    with pytest.raises(ValueError, match=match):
      gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0,
                              batch_argnums=batch_argnums)
  with pytest.raises(ValueError, match="give one of them"):
    gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0, batch_argnums=3,
                            example_axes=(0,))
  f2, params2, state2, inputs, targets = _logistic()
  fn = gram_haiku.clipped_grad(f2.apply, l2_clip_norm=1.0,
                               batch_argnums=(3, 4))
  with pytest.raises(ValueError, match="Batch axis"):
    fn(params2, state2, None, inputs, targets[:2])
  with pytest.raises(ValueError, match="names argument 4"):
    fn(params2, state2, None, inputs)


# -- The function: the loss alone, or Haiku's apply -----------------------

def _shared():
  """One hk.Linear applied twice (its per-example gradient sums both
  applications)."""
  def loss(x, y):
    with gram_haiku.track():
      lin = hk.Linear(4, name="shared")
      out = lin(jnp.tanh(lin(x)))
    return jnp.sum((out - y) ** 2)
  f = hk.transform_with_state(loss)
  kx, ky = jax.random.split(jax.random.PRNGKey(3))
  x, y = jax.random.normal(kx, (6, 4)), jax.random.normal(ky, (6, 4))
  params, state = f.init(jax.random.PRNGKey(4), x, y)
  return f, params, state, x, y


@pytest.mark.parametrize("model", [_mlp, _shared])
def test_apply_and_the_loss_alone_give_the_same(model):
  """``f.apply`` (which returns Haiku's state) and the loss without it give
  the same clipped sum and aux; a module applied twice included (without
  the new state it keeps per-example gradients, never a wrong sum)."""
  f, params, state, x, y = model(0) if model is _mlp else model()
  kw = dict(l2_clip_norm=0.7, batch_argnums=(3, 4), return_values=True,
            return_grad_norms=True)
  with_state = jax.jit(gram_haiku.clipped_grad(f.apply, **kw))(
      params, state, None, x, y)
  theirs, ours = _both(f, **kw)
  alone = jax.jit(ours)(params, state, None, x, y)
  _assert_same(alone, with_state, rtol=1e-5, atol=1e-6)
  _assert_same(alone, jax.jit(theirs)(params, state, None, x, y), rtol=1e-4,
               atol=1e-6)


def test_apply_with_has_aux_reads_the_state_as_aux():
  """jax-privacy's reading of ``clipped_grad(f.apply, has_aux=True)`` for a
  scalar ``f``: the aux is each example's new Haiku state, that of the
  untracked model (the Gram probes are this library's own entries: every
  example's copy of them would be ``B^3`` numbers per layer)."""
  f, params, state, x, y = _mlp(9)
  counter = lambda: hk.get_state("seen", (), jnp.int32, init=jnp.zeros)

  def untracked(x, y):
    hk.set_state("seen", counter() + 1)
    out = hk.nets.MLP([5, 3], activation=jnp.tanh)(x)
    return jnp.sum((out - y) ** 2)

  def tracked(x, y):
    hk.set_state("seen", counter() + 1)
    with gram_haiku.track():
      out = hk.nets.MLP([5, 3], activation=jnp.tanh)(x)
    return jnp.sum((out - y) ** 2)
  plain, ours = (hk.transform_with_state(fn) for fn in (untracked, tracked))
  params, plain_state = jax.jit(plain.init)(jax.random.PRNGKey(0), x, y)
  _, state = jax.jit(ours.init)(jax.random.PRNGKey(0), x, y)
  kw = dict(has_aux=True, l2_clip_norm=1.0, batch_argnums=(3, 4))
  got = _jit(gram_haiku.clipped_grad(ours.apply, **kw))(params, state, None,
                                                         x, y)
  want = _jit(jp_clipping.clipped_grad(plain.apply, **kw))(
      params, plain_state, None, x, y)
  _assert_same(got, want)
  assert set(got[1].aux) == set(plain_state) == {"~"}
  b = x.shape[0]
  shapes = jax.eval_shape(
      gram_haiku.clipped_grad(ours.apply, **kw), params, state, None,
      jnp.zeros((4 * b,) + x.shape[1:]), jnp.zeros((4 * b,) + y.shape[1:]))
  assert all(leaf.size <= 4 * b for leaf in jax.tree.leaves(shapes[1].aux))


def test_a_call_without_state_and_rng_says_how_to_call():
  f, params, state, x, y = _mlp(10)
  step = gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0)
  with pytest.raises(ValueError, match=r"(?s)1 positional.*params, "
                     r"state, rng, \*batch.*What to do"):
    step(params)
  with pytest.raises(ValueError, match="2 positional"):
    step(params, (x, y))


def test_a_shared_argument_of_the_batch_size_is_refused():
  """An argument left out of batch_argnums whose axis 0 happens to be B
  (prototypes every example reads): jax-privacy gives it whole to each
  example, the batch pass would pair its rows with the examples'."""
  f, params, state, x, y = _mlp(11, b=4)
  protos = jnp.ones((4, 3))
  step = gram_haiku.clipped_grad(lambda p, s, r, x, y, protos: f.apply(
      p, s, r, x, y), l2_clip_norm=1.0, batch_argnums=(3, 4))
  with pytest.raises(ValueError, match=r"(?s)argument 5 .*size, 4.*"
                     r"add 5 to batch_argnums.*\[None\]"):
    step(params, state, None, x, y, protos)
  _jit(step)(params, state, None, x, y, protos[:3])  # Another size: shared.
