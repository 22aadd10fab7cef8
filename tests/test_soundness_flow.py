"""Soundness of the example-flow check behind ``clipped_grad``: what the
analysis cannot prove to be one example's is refused, never taken as safe.

Four classes of values that escaped it (each gave a silently wrong clipped
sum, one example moving it by more than ``C``): a ``while_loop`` whose
number of rounds reads several examples; data the loss closes over rather
than takes as arguments; a legacy PRNG key taken for batch data (its size
2 set the batch size); and false refusals whose messages did not say what
to do. Each accepted case is checked against ``vmap(grad)`` (or the
Jacobian of the per-example losses, where the batch shares a dropout draw)
in float64, each refused one by a stable part of its message. The cases
that are only "this program -> this verdict" (loops whose rounds read
several examples or one, labels, inputs and tables closed over or passed,
views split by a reshape) are rows of the interpreter's corpus
(``tests/interpreter_corpus.py``); the tests here need more (a named vmap
axis, an enclosing ``jit``, the model's state, an rng, the advice a refusal
gives).
"""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import weighted_sum

B, F, O = 6, 3, 2
C = 0.7  # the clip norm: some examples clipped, some not
RTOL = 1e-4

_CLOSED = "closes over"


def _data(seed, b=B):
  rng = np.random.RandomState(seed)
  x = rng.randn(b, F).astype(np.float32)
  x[0] *= 50.0  # example 0 large: a batch-wide loop bound follows it
  return x, rng.randn(b, O).astype(np.float32)


def _f64(tree):
  """Float leaves as float64 (integer ones, labels, as they are)."""
  return jax.tree.map(lambda a: np.asarray(a, np.float64) if np.issubdtype(
      np.asarray(a).dtype, np.floating) else np.asarray(a), tree)


def _rows(per_example_loss, params, *batch):
  """``F``: float64 per-example gradients, each example alone."""
  with jax.enable_x64(True):
    return np.asarray(per_example_grads(per_example_loss, _f64(params),
                                        *_f64(batch)), np.float64)


def _jacobian_rows(losses, params):
  """``F`` from the Jacobian of the batch's ``[B]`` losses: for models
  whose examples share a draw (dropout over the batch). In float32: under
  x64 the same key draws another mask."""
  leaves = jax.tree.leaves(jax.jit(jax.jacrev(losses))(params))
  return np.concatenate([np.asarray(l, np.float64).reshape(
      l.shape[0], -1) for l in leaves], axis=1)


def _assert_clipped(grads, flat, params, c_norm=C):
  norms = np.sqrt(np.sum(flat * flat, 1))
  want = weighted_sum(flat, clip_reference(norms, c_norm), params)
  chex.assert_trees_all_close(_f64(grads), want, rtol=RTOL,
                              atol=RTOL * float(np.abs(flat).max()))


def _model():
  """``sum_i |Linear(x)_i - y_i|^2``, the tracked and plain transforms."""
  def body(x, y):
    return jnp.sum((hk.Linear(O, name="head")(x) - y) ** 2)

  def tracked(x, y):
    with gram_haiku.track():
      return body(x, y)
  return (hk.transform_with_state(tracked),
          hk.without_apply_rng(hk.transform(body)))


def _clipped(f, *batch, rng=None, **kw):
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), *batch)
  return params, gram_haiku.clipped_grad(f.apply, C, **kw)(
      params, state, rng, *batch)


# -- 1. while loops whose number of rounds reads the examples ----------------
# (Each example's own rounds, under a named hk.vmap axis.)


def _halve_until_batch_max(x):
  return jax.lax.while_loop(lambda v: jnp.max(jnp.abs(v)) > 1.0,
                            lambda v: v / 2.0, x)


def test_a_per_example_loop_inside_hk_vmap_is_exact():
  x, y = _data(3)

  def per_example(xi, yi):
    h = hk.Linear(O, name="head")(_halve_until_batch_max(xi))
    return jnp.sum((h - yi) ** 2)

  def tracked(x, y):
    with gram_haiku.track(example_axis="batch"):
      return jnp.sum(hk.vmap(per_example, axis_name="batch",
                             split_rng=False)(x, y))
  f = hk.transform_with_state(tracked)
  plain = hk.without_apply_rng(hk.transform(
      lambda x, y: jnp.sum(hk.vmap(per_example, split_rng=False)(x, y))))
  params, (grads, _) = _clipped(f, x, y)
  flat = _rows(plain.apply, params, x, y)
  _assert_clipped(grads, flat, params)


# -- 2. data the loss closes over ----------------------------------------------


@pytest.mark.parametrize("what", ["labels", "centred", "inputs"])
def test_tracers_of_an_enclosing_jit_are_refused(what):
  """hk.transform_with_state(lambda x: loss(net(x), y)) built inside a
  jitted step: y is a tracer of the step, a constant of the loss."""
  x, y = _data(6)

  @jax.jit
  def step(x, y):
    def loss(a):
      xs, ys = (x, a) if what == "inputs" else (a, y)
      if what == "centred":
        ys = ys - ys.mean(0)
      with gram_haiku.track():
        out = hk.Linear(O, name="head")(xs)
      return jnp.sum((out - ys) ** 2)
    f = hk.transform_with_state(loss)
    arg = y if what == "inputs" else x
    params, state = jax.jit(f.init)(jax.random.PRNGKey(0), arg)
    return gram_haiku.clipped_grad(f.apply, C)(params, state, None, arg)[0]
  with pytest.raises(ValueError, match=_CLOSED):
    step(x, y)


def test_the_models_own_state_is_not_closed_over_data():
  """BatchNorm in evaluation mode with B features: its moving averages
  ((1, B), from the state given to apply) are the model's, not data."""
  x, y = _data(21)

  def body(x, y):
    h = hk.Linear(B, name="first")(x)
    h = hk.BatchNorm(True, True, 0.9)(h, is_training=hk.running_init())
    return jnp.sum((hk.Linear(O, name="head")(h) - y) ** 2)

  def tracked(x, y):
    with gram_haiku.track():
      return body(x, y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  grads, _ = gram_haiku.clipped_grad(f.apply, C)(params, state, None, x, y)
  plain = hk.transform_with_state(body)
  ema = {m: v for m, v in state.items() if "gram_probe" not in v}
  flat = _rows(lambda p, xi, yi: plain.apply(p, ema, None, xi, yi)[0],
               params, x, y)
  _assert_clipped(grads, flat, params)


# -- 3. the rng is never batch data --------------------------------------------


_T = 3


def _batch_apply_dropout(x, y):
  h = hk.BatchApply(hk.Linear(4, name="first"))(x)
  h = hk.dropout(hk.next_rng_key(), 0.5, jnp.tanh(h))
  out = hk.BatchApply(hk.Linear(O, name="head"))(h)
  return jnp.sum((out - y) ** 2)


def _keys():
  return {"legacy": jax.random.PRNGKey(1), "typed": jax.random.key(1),
          "sequence": next(hk.PRNGSequence(3))}


@pytest.mark.parametrize("key", ["legacy", "typed", "sequence"])
@pytest.mark.parametrize("fn", ["clipped", "gram"])
def test_merged_tokens_are_refused_whatever_the_key(key, fn):
  """hk.BatchApply merges (B, T) into B T rows: a token Gram, not the
  examples', refused for every kind of rng (a legacy key's size 2 once
  made the batch size ambiguous and switched the check off)."""
  x = np.random.RandomState(13).randn(4, _T, F).astype(np.float32)
  y = np.random.RandomState(14).randn(4, _T, O).astype(np.float32)

  def tracked(x, y):
    with gram_haiku.track():
      return _batch_apply_dropout(x, y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  transform = (gram_haiku.value_grad_and_gram(f.apply) if fn == "gram" else
               gram_haiku.clipped_grad(f.apply, C))
  with pytest.raises(ValueError, match="merges the examples"):
    transform(params, state, _keys()[key], x, y)


def test_merged_tokens_without_an_rng_are_refused():
  x = np.random.RandomState(15).randn(4, _T, F).astype(np.float32)
  y = np.random.RandomState(16).randn(4, _T, O).astype(np.float32)

  def tracked(x, y):
    with gram_haiku.track():
      out = hk.BatchApply(hk.Linear(O, name="head"))(x)
    return jnp.sum((out - y) ** 2)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="merges the examples"):
    gram_haiku.clipped_grad(f.apply, C)(params, state, None, x, y)


def _dropout_losses(x, y):
  h = hk.dropout(hk.next_rng_key(), 0.5, jnp.tanh(hk.Linear(4)(x)))
  return jnp.sum((hk.Linear(O, name="head")(h) - y) ** 2, -1)


@pytest.mark.parametrize("key", ["legacy", "typed", "sequence"])
@pytest.mark.parametrize("b", [2, 5])
def test_any_key_with_any_batch_is_exact(key, b):
  """B = 2 included: a legacy key (uint32[2]) is not two examples."""
  x, y = _data(17, b)

  def tracked(x, y):
    with gram_haiku.track():
      return jnp.sum(_dropout_losses(x, y))
  f = hk.transform_with_state(tracked)
  rng = _keys()[key]
  params, (grads, _) = _clipped(f, x, y, rng=rng)
  plain = hk.transform(_dropout_losses)
  flat = _jacobian_rows(lambda p: plain.apply(p, rng, x, y), params)
  _assert_clipped(grads, flat, params)
  # The Gram as well.
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, rng,
                                                        x, y)
  np.testing.assert_allclose(grams.total, flat @ flat.T, rtol=RTOL,
                             atol=RTOL * np.abs(flat @ flat.T).max())


@pytest.mark.parametrize("axes", [None, (0, 0)])
def test_without_apply_rng_the_first_argument_is_batch_data(axes):
  x, y = _data(18)
  f, plain = _model()
  f = hk.without_apply_rng(f)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  grads, _ = gram_haiku.clipped_grad(f.apply, C, example_axes=axes)(
      params, state, x, y)
  _assert_clipped(grads, _rows(plain.apply, params, x, y), params)


def test_no_one_batch_size_is_a_privacy_error():
  """Arguments of two leading sizes, and layers that see a third (merged
  tokens): nothing can be followed, which clipping refuses."""
  x = np.random.RandomState(19).randn(4, _T, F).astype(np.float32)
  memory = np.random.RandomState(20).randn(5, F).astype(np.float32)

  def tracked(x, memory):
    with gram_haiku.track():
      out = hk.BatchApply(hk.Linear(F, name="head"))(x)
    return jnp.sum(out * jnp.mean(memory, 0))
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, memory)
  with pytest.raises(ValueError, match="batch size cannot be told"):
    gram_haiku.clipped_grad(f.apply, C)(params, state, None, x, memory)


# -- 4. refusals that say what fits --------------------------------------------


def _time_major_net(xb):  # one example's (T, F)
  return hk.Linear(O)(jnp.tanh(hk.Linear(4)(xb)).mean(0))


@pytest.mark.parametrize("fn", ["clipped", "gram"])
def test_a_time_major_input_under_a_named_vmap(fn):
  """T == B: the default rule takes axis 0 (time) for the examples, which
  the named vmap contradicts; the refusal names the example_axes that
  fit, and with it the result is exact."""
  b = t = 4
  rng = np.random.RandomState(22)
  x = rng.randn(t, b, F).astype(np.float32)
  y = rng.randn(b, O).astype(np.float32)

  def tracked(x, y):
    with gram_haiku.track(example_axis="batch"):
      out = hk.vmap(_time_major_net, in_axes=1, axis_name="batch",
                    split_rng=False)(x)
    return jnp.sum((out - y) ** 2)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)

  def transform(**kw):
    return (gram_haiku.value_grad_and_gram(f.apply, **kw) if fn == "gram"
            else gram_haiku.clipped_grad(f.apply, C, **kw))
  with pytest.raises(ValueError, match=r"example_axes=\(1, 0\)"):
    transform()(params, state, None, x, y)
  out = transform(example_axes=(1, 0))(params, state, None, x, y)
  plain = hk.without_apply_rng(hk.transform(lambda xb, y: jnp.sum((hk.vmap(
      _time_major_net, split_rng=False)(xb) - y) ** 2)))
  flat = _rows(plain.apply, params, np.swapaxes(x, 0, 1), y)
  if fn == "gram":
    np.testing.assert_allclose(out[2].total, flat @ flat.T, rtol=RTOL,
                               atol=RTOL * np.abs(flat @ flat.T).max())
  else:
    _assert_clipped(out[0], flat, params)


def test_a_weight_penalty_in_the_loss_says_what_to_do():
  x, y = _data(24)
  lam = 0.01

  def with_penalty(x, y):
    with gram_haiku.track():
      lin = hk.Linear(O, name="head")
      out = lin(x)
    return jnp.sum((out - y) ** 2) + lam * jnp.sum(lin.params_dict()[
        "head/w"] ** 2)
  f = hk.transform_with_state(with_penalty)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="optimizer's weight decay"):
    gram_haiku.clipped_grad(f.apply, C)(params, state, None, x, y)
  # What it says to do: the penalty's gradient added outside.
  g, plain = _model()
  grads, _ = gram_haiku.clipped_grad(g.apply, C)(params, state, None, x, y)
  grads["head"]["w"] = grads["head"]["w"] + 2 * lam * params["head"]["w"]
  flat = _rows(plain.apply, params, x, y)
  norms = np.sqrt(np.sum(flat * flat, 1))
  want = weighted_sum(flat, clip_reference(norms, C), params)
  want["head"]["w"] = want["head"]["w"] + 2 * lam * np.asarray(
      params["head"]["w"], np.float64)
  chex.assert_trees_all_close(_f64(grads), want, rtol=RTOL,
                              atol=RTOL * float(np.abs(flat).max()))
