"""Weight sharing read from the traced program, by class of reuse.

Every model here applies some tracked module's parameters more than once
in a way that Python object identity cannot see (a new array per read, a
new Haiku frame per lifted transform, two ``track()`` blocks); each Gram is
checked against the reference ``F @ F.T`` of the untracked model. Models
whose parameters reach a tracked layer through a computation that changes
their values must raise instead. The same programs (and two layer kinds
under one module name, refused) are rows of the interpreter's corpus
(``tests/interpreter_corpus.py``); the tests here check more (the raw
``jax.grad`` path, coverage, the layers' names).
"""

import dataclasses
from typing import Any

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.api import value_grad_and_gram as gram_haiku_vgg
from gram_haiku._src.core import errors
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import reference_gram
from tests import interpreter_corpus as corpus
from tests import problems


_data = problems.data
_sq = problems.sq


def _check(tracked_loss, plain_loss, x, y, jit=True, dtype="float32",
           raw="refused"):
  """``tracked_loss`` (with ``track()`` inside) against the reference.

  Also the raw ``jax.grad`` path (``f.apply`` alone, no traced program):
  the forward pass and the parameters' gradients equal the untracked
  model's, and differentiating the probes is refused (``raw="refused"``,
  a shared module) or gives the reference Gram (``raw="exact"``).
  """
  f = hk.transform_with_state(tracked_loss)
  g = hk.without_apply_rng(hk.transform(plain_loss))
  # Both inits in one program.
  (params, state), plain_params = jax.jit(lambda k, x, y: (
      f.init(k, x, y), g.init(k, x, y)))(jax.random.PRNGKey(0), x, y)
  chex.assert_trees_all_equal_shapes(params, plain_params)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  if jit:
    fn = jax.jit(fn)
  value, grads, grams = fn(params, state, None, x, y)
  plain = _plain(g.apply, params, x, y)
  ref = plain.ref
  assert_gram_close(grams.total, ref, dtype)
  np.testing.assert_allclose(value, plain.value, rtol=1e-5)
  chex.assert_trees_all_close(grads, plain.grads, rtol=1e-5, atol=1e-6)
  assert grams.complete
  _check_raw_path(f, plain, params, state, x, y, raw, dtype)
  return grams


@dataclasses.dataclass
class _Plain:
  """The untracked model at the parameters: its loss, its gradient and the
  reference Gram ``F @ F.T`` (float64)."""
  value: Any
  grads: Any
  ref: np.ndarray


def _plain(plain_loss, params, x, y) -> _Plain:
  """The untracked ``plain_loss(params, x, y)``'s value, gradient and
  reference Gram, from one program (:func:`problems.untracked`)."""
  value, grads, flat = problems.untracked(plain_loss, params, x, y)
  return _Plain(value, grads, flat @ flat.T)


def _check_raw_path(f, plain, params, state, x, y, raw, dtype):
  state = gram_haiku.resize_probes(state, x.shape[0])
  rest, probes = gram_haiku_vgg.split_probes(state)
  def loss(params, probes):
    return f.apply(params, gram_haiku_vgg.merge_probes(rest, probes), None,
                   x, y)[0]
  # The forward pass (not differentiated) and the gradient in one program;
  # where the raw path is exact, the probes' gradient too.
  argnums = 0 if raw == "refused" else (0, 1)
  value, grads = jax.jit(lambda p, pr: (loss(p, pr), jax.grad(
      loss, argnums=argnums)(p, pr)))(params, probes)
  if raw != "refused":
    grads, dprobes = grads
  np.testing.assert_allclose(value, plain.value, rtol=1e-5)
  chex.assert_trees_all_close(grads, plain.grads, rtol=1e-5, atol=1e-6)
  if raw == "refused":
    # A shared module, or (for the getters) a new value of its parameters.
    with pytest.raises(ValueError,
                       match="more than once|loop body|a new value"):
      jax.jit(jax.grad(loss, argnums=1))(params, probes)
  else:
    b = x.shape[0]  # hk.layer_stack's probes are stacked: [L, B, B].
    assert_gram_close(sum(d.reshape(-1, b, b).sum(0)
                          for d in jax.tree.leaves(dprobes)), plain.ref,
                      dtype)


def _tracked(body):
  def loss(x, y):
    with gram_haiku.track():
      return body(x, y)
  return loss


def test_two_track_blocks():
  x, y = _data(0, (6, 5), 4)
  def body(x, y, tracked):
    lin = hk.Linear(4, name="shared")
    if tracked:
      with gram_haiku.track():
        h = jnp.tanh(lin(x))
      with gram_haiku.track():
        return _sq(lin(h[:, :4] if h.shape[1] > 4 else
                       jnp.pad(h, ((0, 0), (0, 1)))), y)
    h = jnp.tanh(lin(x))
    return _sq(lin(jnp.pad(h, ((0, 0), (0, 1)))), y)
  grams = _check(lambda x, y: body(x, y, True), lambda x, y: body(x, y, False),
                 x, y)
  assert list(grams.by_layer) == ["shared"]


def test_track_decorator_on_a_function_called_twice():
  x, y = _data(1, (6, 4), 4)

  def block(h):
    return jnp.tanh(hk.Linear(4, name="block")(h))
  tracked_block = gram_haiku.track()(block)
  # Each call creates its own module ("block", then "block_1"): two
  # modules, no sharing, and the raw path is exact too.
  grams = _check(lambda x, y: _sq(tracked_block(tracked_block(x)), y),
                 lambda x, y: _sq(block(block(x)), y), x, y, raw="exact")
  assert sorted(grams.by_layer) == ["block", "block_1"]


def test_track_decorator_on_a_function_of_one_module_called_twice():
  x, y = _data(1, (6, 4), 4)

  def body(x, y, tracked):
    lin = hk.Linear(4, name="lin")
    def block(h):
      return jnp.tanh(lin(h))
    if tracked:
      block = gram_haiku.track()(block)
    return _sq(block(block(x)), y)
  grams = _check(lambda x, y: body(x, y, True), lambda x, y: body(x, y, False),
                 x, y)
  assert list(grams.by_layer) == ["lin"]


def test_shared_block_under_remat_and_outside():
  # ALBERT-style: one block applied under hk.remat and again without it.
  x, y = _data(2, (5, 6), 6)
  def body(x, y):
    block = hk.Linear(6, name="albert_block")
    h = hk.remat(lambda a: jnp.tanh(block(a)))(x)
    return _sq(jnp.tanh(block(h)), y)
  _check(_tracked(body), body, x, y)


def test_siamese_encoder_in_two_hk_vmaps():
  x, y = _data(3, (4, 2, 5), 3)
  def body(x, y):
    enc = hk.Linear(3, name="encoder")
    a = hk.vmap(lambda xi: jnp.tanh(enc(xi)), split_rng=False)(x[:, 0])
    b = hk.vmap(lambda xi: jnp.tanh(enc(xi)), split_rng=False)(x[:, 1])
    return _sq(a * b, y[:, 0])
  _check(_tracked(body), body, x, y)


def test_module_in_a_cond_branch_and_outside():
  x, y = _data(4, (5, 4), 4)
  def body(x, y):
    lin = hk.Linear(4, name="lin")
    h = jnp.tanh(lin(x))
    h = hk.cond(jnp.sum(x) > -1e9, lambda a: lin(a), lambda a: a * 2., h)
    return _sq(h, y)
  _check(_tracked(body), body, x, y)


def test_same_module_in_both_cond_branches_is_used_once():
  x, y = _data(5, (5, 4), 4)
  def body(x, y):
    lin = hk.Linear(4, name="lin")
    # A predicate that every example (and the batch) agrees on.
    h = hk.cond(jnp.sum(x) < 1e9, lambda a: lin(2. * a), lambda a: lin(a), x)
    return _sq(h, y)
  # The raw path cannot tell alternatives from two uses: it refuses.
  grams = _check(_tracked(body), body, x, y)
  assert grams.by_layer["lin"].shape == (5, 5)


def _copying_getter(next_getter, value, context):
  del context
  return jnp.array(next_getter(value), copy=True)  # a new array per read


def _cast_policy_getter(next_getter, value, context):
  del context  # As a mixed-precision policy: a cast (here, and back).
  return next_getter(value).astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("getter", [_copying_getter, _cast_policy_getter])
def test_module_called_twice_under_a_custom_getter(getter):
  x, y = _data(6, (6, 4), 4)
  def body(x, y):
    with hk.custom_getter(getter):
      lin = hk.Linear(4, name="lin")
      return _sq(jnp.tanh(lin(x)) + lin(x ** 2 / 5), y)
  # The cast's transpose rounds each per-example gradient of the reference
  # to bfloat16; the Gram is of the unrounded ones: bfloat16 tolerance.
  dtype = "bfloat16" if getter is _cast_policy_getter else "float32"
  grams = _check(_tracked(body), body, x, y, dtype=dtype)
  assert list(grams.by_layer) == ["lin"]


@pytest.mark.parametrize("unroll,getter", problems.spread(
    [("static", "static"), ("dynamic", "dynamic")],
    [("plain", None), ("copying_getter", _copying_getter)]))
def test_unrolled_lstm(unroll, getter):
  x, y = _data(8, (3, 4, 2), 5)  # (B, T, F)
  run = hk.static_unroll if unroll == "static" else hk.dynamic_unroll
  def body(x, y):
    core = hk.LSTM(5)
    out, _ = run(core, jnp.swapaxes(x, 0, 1), core.initial_state(x.shape[0]))
    return _sq(jnp.swapaxes(out, 0, 1), y)
  def with_getter(x, y):
    if getter is None:
      return body(x, y)
    with hk.custom_getter(getter):
      return body(x, y)
  _check(_tracked(with_getter), with_getter, x, y)


def test_unembed_inside_remat():
  ids = problems.randint(jax.random.PRNGKey(9), (4, 3), 0, 7)
  y = problems.normal(jax.random.PRNGKey(10), (4, 3, 7))

  def body(ids, y, tracked):
    embed = hk.Embed(7, 5, name="embed")
    h = jnp.tanh(embed(ids))
    if tracked:
      logits = hk.remat(lambda a: gram_haiku.unembed(embed, a))(h)
    else:
      logits = hk.remat(lambda a: a @ embed.embeddings.T)(h)
    return _sq(logits, y)
  f = hk.transform_with_state(lambda a, b: _tracked(
      lambda a, b: body(a, b, True))(a, b))
  g = hk.without_apply_rng(hk.transform(lambda a, b: body(a, b, False)))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), ids, y)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, ids, y)
  plain = _plain(g.apply, params, ids, y)
  assert_gram_close(grams.total, plain.ref)
  _check_raw_path(f, plain, params, state, ids, y, "refused", "float32")


@pytest.mark.parametrize("threaded", [True, False],
                         ids=["state-threaded", "same-state-twice"])
def test_lifted_transform_applied_twice(threaded):
  # hk.experimental.lift_with_state: an inner transform's module applied
  # twice, its state threaded from the first apply to the second or the
  # same state given to both (both applications then read one slot
  # counter value: per-example accumulation, not one shared slot).
  x, y = _data(12, (4, 5), 4)
  inner = hk.transform_with_state(lambda z: hk.Linear(4, name="il")(z))

  def body(x, y):
    init, updater = hk.experimental.lift_with_state(
        inner.init, allow_reuse=True, name="lifted")
    p, st = init(hk.next_rng_key() if hk.running_init() else None, x)
    h1, st1 = inner.apply(p, st, None, x)
    h2, st2 = inner.apply(p, st1 if threaded else st, None, -x)
    updater.update(st2)
    return _sq(h1 + jnp.tanh(h2), y)

  f = hk.transform_with_state(_tracked(body))
  g = hk.transform_with_state(body)
  (params, state), (_, plain_state) = jax.jit(lambda k, x, y: (
      f.init(k, x, y), g.init(k, x, y)))(jax.random.PRNGKey(0), x, y)
  per_example = lambda p, x, y: g.apply(p, plain_state, None, x, y)[0]
  _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  plain = _plain(per_example, params, x, y)
  assert_gram_close(grams.total, plain.ref)
  chex.assert_trees_all_close(grads, plain.grads, rtol=1e-5, atol=1e-6)
  assert grams.complete
  # The lift's outer names are covered by the inner module's rule.
  assert {k: c.rule for k, c in grams.coverage.items()} == {
      "lifted/il/w": "linear", "lifted/il/b": "linear"}


@pytest.mark.parametrize("jit", [False, True])
def test_raw_path_two_calls_on_one_state_are_refused(jit):
  # A siamese loss of two f.apply calls given the same probes: each call
  # sees the module once, but the probe's gradient would miss the cross
  # terms. value_grad_and_gram of the same loss as one apply is exact.
  x, y = _data(13, (5, 4), 3)

  def model(x):
    return hk.nets.MLP([6, 3])(x)

  def tracked(x):
    with gram_haiku.track():
      return model(x)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  state = gram_haiku.resize_probes(state, 5)

  def loss(state):
    return jnp.sum((f.apply(params, state, None, x)[0] -
                    f.apply(params, state, None, jnp.tanh(x))[0]) ** 2)
  grad = jax.jit(jax.grad(loss)) if jit else jax.grad(loss)
  with pytest.raises(ValueError, match="two calls given the same state"):
    grad(state)
  # One call per state is the raw path's normal use: exact.
  g = hk.without_apply_rng(hk.transform(lambda x, y: _sq(model(x), y)))
  probe_grad = jax.grad(lambda s: _sq(f.apply(params, s, None, x)[0], y))
  probes = (jax.jit(probe_grad) if jit else probe_grad)(state)
  assert_gram_close(sum(p[gram_haiku.PROBE_NAME] for p in probes.values()),
                    reference_gram(g.apply, params, x, y))


def test_layer_stack_is_not_sharing():
  x, y = _data(11, (4, 5), 5)
  def body(x, y):
    stack = hk.layer_stack(3)(lambda h: jnp.tanh(hk.Linear(5)(h)))
    return _sq(stack(x), y)
  grams = _check(_tracked(body), body, x, y, raw="exact")
  # One stacked probe per layer, each a Gram, summed: no per-example probe.
  assert all(g.shape == (4, 4) for g in grams.by_layer.values())


# A parameter transformed on its way to its layer: tests/test_reparam.py
# (exact) and tests/test_frozen.py (stop_gradient).


def test_error_messages_are_formatted():
  for template in (errors.PARAM_TRANSFORMED, errors.PARAM_IN_TWO_MODULES,
                   errors.MIXED_MODES):
    assert "What to do" in template


# Layers whose first parameter is absent (no scale): the equation's operands
# then skip it, and the traced program must still be read per parameter.
_ABSENT_FIRST = {
    "Bias": lambda: hk.Bias(),
    "LayerNorm-offset-only": lambda: hk.LayerNorm(-1, False, True),
    "GroupNorm-offset-only": lambda: hk.GroupNorm(2, create_scale=False),
}


@pytest.mark.parametrize("name", sorted(_ABSENT_FIRST))
def test_shared_module_without_its_first_parameter(name):
  def model(x, y):
    m = _ABSENT_FIRST[name]()
    return _sq(m(jnp.tanh(m(x))), y)

  def tracked(x, y):
    with gram_haiku.track(untracked="error"):
      return model(x, y)
  x, y = _data(11, (5, 3, 4), 4)
  _check(tracked, model, x, y)


def test_one_layer_kind_recreated_under_its_name_is_shared():
  x, y = _data(15, (5, 6), 3)
  body = corpus.linear_then(lambda name: hk.Linear(6, name=name))
  _check(_tracked(body), body, x, y)
