"""The examples followed through the traced program, by class.

A layer input that does not carry the examples along the op's example axis,
one that merges them with other positions, a batch statistic between
tracked layers and a loss that couples the examples are each a teaching
error at any size; models where the examples flow as a Gram needs (shared
inputs broadcast over the batch, statistics of the input data, attention,
recurrences, stacks) are exact against the reference.
"""

import functools
import warnings

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.analysis import example_flow
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import ATOL_F32
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import jacobian_gram
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import RTOL_F32
from gram_haiku._src.core.reference import weighted_sum
from tests import problems

B, T, F = 4, 4, 6  # T == B on purpose: sizes cannot tell the axes apart.


def _data(seed, out=3):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (problems.normal(k1, (B, T, F)),
          problems.normal(k2, (B, T, out)))


def _sq(out, y):
  return 0.5 * jnp.sum((out - y) ** 2)


def _tracked_transform(body):
  """``hk.transform_with_state`` of ``body`` run inside ``track()``."""
  def tracked(*args):
    with gram_haiku.track():
      return body(*args)
  return hk.transform_with_state(tracked)


def _run(body, x, y, jit=True):
  f = _tracked_transform(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  fn = jax.jit(fn) if jit else fn
  return params, fn(params, state, None, x, y)


def _positions_late(x, y):  # arange(T) embedded, then broadcast over B
  pos = hk.Embed(T, F)(jnp.arange(T))
  return _sq(hk.Linear(3)(x + pos[None]), y)


def _time_major(x, y):
  h = hk.Linear(3)(jnp.swapaxes(x, 0, 1))  # (T, B, F): axis 0 is time
  return _sq(jnp.swapaxes(h, 0, 1), y)


def _memory(x, y):  # cross-attention to an unbatched memory of length B
  memory = hk.get_parameter("memory", [B, F], init=jnp.ones)
  attn = hk.MultiHeadAttention(
      2, 3, w_init=hk.initializers.VarianceScaling(1.0), model_size=3)
  return _sq(attn(x, memory, memory), y)


def _learned_query(x, y):
  q = hk.Linear(F)(hk.get_parameter("q", [T, 5], init=jnp.ones))
  return _sq(jnp.einsum("qf,btf->btq", q, x)[..., :3], y)


def _batch_apply(x, y):
  return _sq(hk.BatchApply(hk.Linear(3))(x), y)


def _flattened(x, y):  # (B, T, F) -> (B*T, F) by hand
  h = hk.Linear(3)(x.reshape(B * T, F))
  return _sq(h.reshape(B, T, 3), y)


def _hidden_centred(x, y):  # a batch statistic between two tracked layers
  h = jnp.tanh(hk.Linear(F)(x))
  return _sq(hk.Linear(3)(h - h.mean(axis=0)), y)


def _hidden_permuted(x, y):
  h = jnp.tanh(hk.Linear(F)(x))
  return _sq(hk.Linear(3)(h[::-1]), y)


def _hidden_subset(x, y):
  h = jnp.tanh(hk.Linear(F)(x))
  return _sq(hk.Linear(3)(jnp.concatenate([h[:2], h[:2]])), y)


def _batch_softmax_loss(x, y):
  logits = hk.Linear(3)(x)
  return -jnp.sum(jax.nn.log_softmax(logits, axis=0) * y)


def _contrastive_loss(x, y):
  del y
  z = hk.Linear(3)(x.mean(1))
  sim = z @ z.T
  return -jnp.sum(jnp.diag(jax.nn.log_softmax(sim, axis=1)))


# A layer applied to a value that does not depend on the examples (a
# learned memory, positions) whose rows are then combined before they meet
# the examples: its parameters' per-example gradients flow through a value
# every example shares, which no row of the layer holds.
M = 5  # memory rows; B == T == 4 beside it


def _memory_rows(size=M):
  return hk.get_parameter("memory", [size, F], init=jnp.ones) + jnp.arange(
      size * F, dtype=jnp.float32).reshape(size, F) / 10


def _shared_sum_scales(x, y):
  scale = jnp.sum(hk.Linear(3)(_memory_rows(B)))
  return _sq(hk.Linear(3)(x) * scale, y)


def _shared_mean_added(x, y):
  return _sq(hk.Linear(3)(x) + jnp.mean(hk.Linear(3)(_memory_rows()), 0), y)


def _shared_max_added(x, y):
  return _sq(hk.Linear(3)(x) + jnp.max(hk.Linear(3)(_memory_rows()), 0), y)


def _shared_contracted(x, y):
  pooled = jnp.ones((M,)) @ hk.Linear(3)(_memory_rows())
  return _sq(hk.Linear(3)(x) + pooled, y)


def _shared_cumsum(x, y):  # rows of a length-B memory, prefix-summed
  mem = jnp.cumsum(hk.Linear(3)(_memory_rows(B)), axis=0)
  return _sq(hk.Linear(3)(x) + mem[:, None, :], y)


def _shared_regulariser(x, y):  # never meets the examples
  penalty = jnp.sum(hk.Linear(3)(_memory_rows()) ** 2)
  return _sq(hk.Linear(3)(x), y) + 1e-2 * penalty


_COMBINED = "summed, reduced or contracted over that axis"
_REORDERED = "along that axis are reordered, repeated or subset"


@pytest.mark.parametrize("body,match", [
    (_shared_sum_scales, _COMBINED),
    (_shared_mean_added, _COMBINED),
    (_shared_max_added, _COMBINED),
    (_shared_contracted, _COMBINED),
    (_shared_cumsum, _COMBINED),
    (_shared_regulariser, _COMBINED),
    (_positions_late, "meets them along another axis"),
    (_time_major, "along axis 1"),
    (_memory, "meets them along another axis"),
    (_learned_query, "meets them along another axis"),
    (_batch_apply, "merges the examples with other positions"),
    (_flattened, "merges the examples with other positions"),
    (_hidden_centred, "depends on several examples"),
    (_hidden_permuted, "reordered, repeated or a subset"),
    (_hidden_subset, "reordered, repeated or a subset"),
    (_batch_softmax_loss, "not a sum"),
    (_contrastive_loss, "not a sum"),
], ids=lambda v: getattr(v, "__name__", "")[:24])
@pytest.mark.parametrize("jit", [False, True])
# (A refused model may read a parameter no rule covers: its warning is
# expected here, the refusal is what is tested.)
@pytest.mark.filterwarnings("ignore::gram_haiku.UntrackedParameterWarning")
def test_refused_at_any_size(body, match, jit):
  x, y = _data(0)
  with pytest.raises(ValueError, match=match):
    _run(body, x, y, jit=jit)


def _positions_broadcast(x, y):
  ids = jnp.broadcast_to(jnp.arange(T), (x.shape[0], T))
  return _sq(hk.Linear(3)(x + hk.Embed(T, F)(ids)), y)


def _data_centred(x, y):  # coupling confined to the input data
  x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1.0)
  return _sq(hk.Linear(3)(jnp.tanh(hk.Linear(F)(x))), y)


def _attention(x, y):
  attn = hk.MultiHeadAttention(
      2, 3, w_init=hk.initializers.VarianceScaling(1.0), model_size=3)
  return _sq(attn(x, x, x), y)


def _stack_and_scan(x, y):
  h = hk.layer_stack(2)(lambda h: jnp.tanh(hk.Linear(F)(h)))(x)
  core = hk.GRU(3)
  out, _ = hk.dynamic_unroll(core, jnp.swapaxes(h, 0, 1),
                             core.initial_state(x.shape[0]))
  return _sq(jnp.swapaxes(out, 0, 1), y)


def _per_example_vmap(x, y):
  h = hk.vmap(lambda xi: jnp.tanh(hk.Linear(F)(xi)), split_rng=False)(x)
  return _sq(hk.Conv1D(3, 2)(h), y)


# Per-example code under hk.vmap whose tracked layers take inputs that do
# not depend on the example (positions, a learned memory): every example
# applies its own copy, so each has its own gradient through its own output
# cotangent, and the Gram is exact (the op broadcasts the input along the
# examples' vmap). Explicitly batched, the same layers are refused above.
def _vmapped_positions(xi, yi):  # xi: (T, F)
  return _sq(hk.Linear(3)(xi + hk.Embed(T, F)(jnp.arange(T))), yi)


def _vmapped_memory_mean(xi, yi):
  pooled = jnp.mean(jnp.tanh(hk.Linear(F)(_memory_rows())), axis=0)
  return _sq(hk.Linear(3)(xi * pooled), yi)


def _vmapped_cross_attention(xi, yi):
  memory = _memory_rows()
  # No bias: the key bias's gradient is zero (softmax is shift invariant),
  # so only rounding would be compared.
  attn = hk.MultiHeadAttention(2, 3, w_init=hk.initializers.VarianceScaling(
      1.0), model_size=3, with_bias=False)
  return _sq(attn(xi, memory, memory), yi)


def _vmapped_penalty(xi, yi):  # every example's loss carries the penalty
  penalty = jnp.sum(hk.Linear(3)(_memory_rows()) ** 2)
  return _sq(hk.Linear(3)(xi), yi) + 1e-2 * penalty


@pytest.mark.parametrize("body,named,mode", problems.spread(
    [(f.__name__, f) for f in (_vmapped_positions, _vmapped_memory_mean,
                               _vmapped_cross_attention, _vmapped_penalty)],
    [("default", False), ("named", True)],
    [("gram", "gram"), ("norms", "norms")]))
def test_example_independent_inputs_under_hk_vmap_are_exact(body, named,
                                                            mode):
  x, y = _data(5)
  kw = dict(example_axis="batch") if named else {}
  def tracked(x, y):
    with gram_haiku.track(mode=mode, **kw):
      per_example = hk.vmap(body, split_rng=False,
                            axis_name="batch" if named else None)
      return jnp.sum(per_example(x, y))
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  plain = hk.without_apply_rng(hk.transform(
      lambda x, y: jnp.sum(hk.vmap(body, split_rng=False)(x, y))))
  tracked_params = {m: p for m, p in params.items() if m != "~"}
  ref = reference_gram(lambda p, x, y: plain.apply({**params, **p}, x, y),
                       tracked_params, x, y)
  if mode == "gram":
    assert_gram_close(grams.total, ref)
  np.testing.assert_allclose(grams.sq_norms, np.diag(ref), rtol=1e-4,
                             atol=1e-6 * np.abs(ref).max())
  # The tracked layers sum B broadcast copies: float32 sums in another
  # order, so the table's float32 row (atol a fraction of the largest).
  want = jax.jit(jax.grad(plain.apply))(params, x, y)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want))
  chex.assert_trees_all_close(grads, want, rtol=RTOL_F32,
                              atol=ATOL_F32 * scale)


@pytest.mark.parametrize("body", [_vmapped_positions, _vmapped_memory_mean],
                         ids=lambda f: f.__name__)
def test_clipping_example_independent_inputs_under_hk_vmap(body):
  x, y = _data(6)
  def tracked(x, y):
    with gram_haiku.track():
      return jnp.sum(hk.vmap(body, split_rng=False)(x, y))
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  plain = hk.without_apply_rng(hk.transform(
      lambda x, y: jnp.sum(hk.vmap(body, split_rng=False)(x, y))))
  ref = per_example_grads(plain.apply, params, x, y)
  norms = np.linalg.norm(np.asarray(ref, np.float64), axis=1)
  clip = float(np.median(norms))
  frozen = ["~/memory"] if "~" in params else None
  if frozen:  # frozen: zero gradient, so not in the clipped norm either
    keep = jax.tree.map(lambda _: True, params)
    keep["~"] = {"memory": False}
    mask = np.concatenate([np.full(np.size(l), k) for k, l in zip(
        jax.tree.leaves(keep), jax.tree.leaves(params))])
    ref = np.where(mask[None], np.asarray(ref), 0.0)
    norms = np.linalg.norm(ref, axis=1)
  grads, aux = jax.jit(gram_haiku.clipped_grad(f.apply, clip,
                                               frozen=frozen))(
      params, state, None, x, y)
  want = weighted_sum(ref, clip_reference(norms, clip), params)
  assert 0 < float(aux.fraction_clipped) < 1
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
  chex.assert_trees_all_close(grads, want, rtol=RTOL_F32,
                              atol=ATOL_F32 * scale)


# A batched product whose operands hold the examples on axes of their own
# (each example's row paired with its own by one batch or contracting
# dimension): jax.nn.dot_product_attention's XLA path puts them on axis 0
# of one operand and axis 1 of the other.
def _dot_product_attention(x, y, **kw):
  q, k, v = (hk.Linear(4)(x).reshape(x.shape[:2] + (2, 2)) for _ in range(3))
  out = jax.nn.dot_product_attention(q, k, v, **kw)
  return _sq(hk.Linear(3)(out.reshape(x.shape[:2] + (4,))), y)


def _dot_product_attention_causal(x, y):
  return _dot_product_attention(x, y, is_causal=True)


def _attention_over_time_major(x, y):  # (B, H) queries, (T, B, H) keys
  enc = jnp.swapaxes(jnp.tanh(hk.Linear(5)(x)), 0, 1)
  q = hk.Linear(5)(x[:, 0])
  weights = jax.nn.softmax(jnp.einsum("bh,tbh->bt", q, enc), axis=-1)
  ctx = jnp.einsum("bt,tbh->bh", weights, enc)
  return _sq(hk.Linear(3)(ctx)[:, None, :], y[:, :1])


def _contracted_with_transposed_targets(x, y):  # sum_i <out_i, y_i>
  out = hk.Linear(3)(x).reshape(x.shape[0], -1)
  return jnp.einsum("bf,fb->", jnp.tanh(out), y.reshape(y.shape[0], -1).T)


@pytest.mark.parametrize("body", [
    _positions_broadcast, _data_centred, _attention, _stack_and_scan,
    _per_example_vmap, _dot_product_attention, _dot_product_attention_causal,
    _attention_over_time_major, _contracted_with_transposed_targets],
                         ids=lambda f: f.__name__)
def test_flowing_examples_are_exact(body):
  x, y = _data(1)
  params, (_, grads, grams) = _run(body, x, y)
  plain = hk.without_apply_rng(hk.transform(body))
  if body is _data_centred:
    # The statistic is of the input data: each example's gradient is that
    # of its own row of the centred batch.
    xc = (x - x.mean(axis=0)) / (x.std(axis=0) + 1.0)
    inner = hk.without_apply_rng(hk.transform(
        lambda x, y: _sq(hk.Linear(3)(jnp.tanh(hk.Linear(F)(x))), y)))
    ref = reference_gram(inner.apply, params, xc, y)
  else:
    ref = reference_gram(plain.apply, params, x, y)
  assert_gram_close(grams.total, ref)
  want = jax.jit(jax.grad(plain.apply))(params, x, y)
  scale = max(float(jnp.abs(l).max()) for l in jax.tree.leaves(want))
  chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-6 * scale)


def test_join_is_a_least_upper_bound():
  ex0, ex1 = example_flow.Ex(0), example_flow.Ex(1)
  c, s, m, u = (example_flow.CONST, example_flow.SUM, example_flow.MIXED,
                example_flow.UNKNOWN)
  assert example_flow.join(c, ex0) == ex0
  assert example_flow.join(ex0, ex1) == m
  assert example_flow.join(ex0, s) == m
  assert example_flow.join(u, ex0) == u
  assert example_flow.join(m, u) == m
  verdicts = {}
  cand = example_flow.Ex(1, tag=3)
  assert example_flow.join(cand, ex0, verdicts) == ex0
  assert verdicts == {3: False}
  assert example_flow.join(example_flow.Ex(0, tag=4), ex0, verdicts) == ex0
  assert verdicts[4] is True


# -- reorderings and subsets -----------------------------------------------------


def _weighted_halves(x, y):
  l = 0.5 * jnp.sum((hk.Linear(3)(x) - y) ** 2, axis=(1, 2))
  return l[:2].sum() + 0.5 * l[2:].sum()


def _reversed_loss(x, y):
  return 0.5 * jnp.sum((hk.Linear(3)(x) - y)[::-1] ** 2)


def _permuted_pairs(x, y):
  perm = jnp.array([1, 0, 3, 2])
  return _sq(hk.Linear(3)(x)[perm], y[perm])


def _cumsum_loss(x, y):
  l = 0.5 * jnp.sum((hk.Linear(3)(x) - y) ** 2, axis=(1, 2))
  return jnp.cumsum(l)[-1]


_WEIGHTS = {_weighted_halves: np.array([1.0, 1.0, 0.5, 0.5])}


@pytest.mark.parametrize("body", [_weighted_halves, _reversed_loss,
                                  _permuted_pairs, _cumsum_loss],
                         ids=lambda f: f.__name__)
def test_losses_that_reorder_or_weight_examples_are_exact(body):
  x, y = _data(2)
  params, (_, _, grams) = _run(body, x, y)
  w = _WEIGHTS.get(body, np.ones(B))
  per_example = hk.without_apply_rng(hk.transform(
      lambda x, y, w: w[0] * _sq(hk.Linear(3)(x), y)))
  ref = reference_gram(per_example.apply, params, x, y, w)
  assert_gram_close(grams.total, ref)


def _two_layer_losses(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  return 0.5 * jnp.sum((hk.Linear(3, name="second")(h) - y) ** 2, (1, 2))


def _stopped_batch_softmax_weights(l):
  return jnp.sum(l * jax.lax.stop_gradient(jax.nn.softmax(l)))


def _stopped_normaliser(l):
  return jnp.sum(l) / jax.lax.stop_gradient(jnp.sum(l))


def _stopped_count(l):
  return jnp.sum(l) / jax.lax.stop_gradient(jnp.sum(l > jnp.median(l)) + 1.)


def _stopped_centring_between_layers(x, y, per_example=False):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  h = h - jax.lax.stop_gradient(h.mean(0))
  l = 0.5 * jnp.sum((hk.Linear(3, name="second")(h) - y) ** 2, (1, 2))
  return l if per_example else jnp.sum(l)


_STOPPED = {
    "softmax_weights": lambda x, y: _stopped_batch_softmax_weights(
        _two_layer_losses(x, y)),
    "normaliser": lambda x, y: _stopped_normaliser(_two_layer_losses(x, y)),
    "count": lambda x, y: _stopped_count(_two_layer_losses(x, y)),
    "centring": _stopped_centring_between_layers,
}



@pytest.mark.parametrize("name", sorted(_STOPPED))
@pytest.mark.parametrize("jit", [False, True])
def test_batch_values_under_stop_gradient_are_constants(name, jit):
  # What the model stops the gradient of is data for differentiation: the
  # Gram is of the loss's per-example terms with those values held fixed
  # (rows of jacrev of the terms), and clipping (one example's gradient
  # reads others' data) refuses.
  x, y = _data(21)
  body = _STOPPED[name]
  params, (_, grads, grams) = _run(body, x, y, jit=jit)
  plain = hk.without_apply_rng(hk.transform(body))
  if name == "centring":
    terms = hk.without_apply_rng(hk.transform(functools.partial(
        _stopped_centring_between_layers, per_example=True))).apply
  else:
    l_of = hk.without_apply_rng(hk.transform(_two_layer_losses)).apply
    total = {"softmax_weights": lambda l: jax.nn.softmax(l),
             "normaliser": lambda l: 1. / jnp.sum(l),
             "count": lambda l: 1. / (jnp.sum(l > jnp.median(l)) + 1.)}[name]

    def terms(p, x, y):
      l = l_of(p, x, y)
      return l * jax.lax.stop_gradient(total(l))
  assert_gram_close(grams.total, jacobian_gram(terms, params, x, y))
  chex.assert_trees_all_close(grads,
                              jax.jit(jax.grad(plain.apply))(params, x, y),
                              rtol=1e-5, atol=1e-6)
  f = _tracked_transform(body)
  _, state = f.init(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="reads data of other examples"):
    gram_haiku.clipped_grad(f.apply, 1.0)(params, state, None, x, y)


@pytest.mark.parametrize("coupling", [
    lambda l: jnp.sum(l * jax.nn.softmax(l)),
    lambda l: jnp.sum(l) / jnp.sum(l),
    lambda l: jnp.sum(l * (l > jnp.median(l))),
], ids=["softmax_weights", "normaliser", "comparison"])
def test_the_same_values_without_stop_gradient_are_refused(coupling):
  x, y = _data(22)
  with pytest.raises(ValueError, match="not a sum"):
    _run(lambda x, y: coupling(_two_layer_losses(x, y)), x, y)


def test_a_layer_on_an_unbatched_memory_of_another_size_is_refused():
  # Keys computed by a tracked layer from a (6, F) memory next to a batch
  # of 4: the error names the sizes and says to broadcast the memory.
  x, y = _data(23)
  memory = problems.normal(jax.random.PRNGKey(24), (6, F))

  def body(x, y):
    q = hk.Linear(3, name="q")(x)  # (B, T, 3)
    k = hk.Linear(3, name="k")(memory)  # (6, 3)
    return _sq(jax.nn.softmax(q @ k.T) @ k, y)
  with pytest.raises(ValueError, match=r"(?s)'k'.*broadcast"):
    _run(body, x, y)
  # Given as an argument of the batch (a memory of another leading size),
  # the sizes differ: that error says the same.
  def as_argument(x, m, y):
    q = hk.Linear(3, name="q")(x)
    k = hk.Linear(3, name="k")(m)
    return _sq(jax.nn.softmax(q @ k.T) @ k, y)
  f = _tracked_transform(as_argument)
  params, state = f.init(jax.random.PRNGKey(0), x, memory, y)
  with pytest.raises(ValueError, match=r"(?s)'k': 6.*broadcast"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, memory,
                                            y)


def _hidden_reversed_then_layer(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))[::-1]
  return _sq(hk.Linear(3, name="second")(h), y)


def _paired_outputs(x, y):
  lin = hk.Linear(3)
  out = lin(x)
  return _sq(out + out[::-1], y)


def _one_example_per_call(x, y):
  lin = hk.Linear(3, name="per_example")
  out = jnp.concatenate([lin(x[i:i + 1]) for i in range(x.shape[0])])
  return _sq(out, y)


@pytest.mark.parametrize("body,match", [
    (_hidden_reversed_then_layer, "reordered, repeated or a subset"),
    (_paired_outputs, "not a sum"),
    (_one_example_per_call, "reordered, repeated or a subset"),
], ids=lambda v: getattr(v, "__name__", "")[:24])
def test_reordered_layer_inputs_are_refused(body, match):
  x, y = _data(3)
  with pytest.raises(ValueError, match=match):
    _run(body, x, y)


def _between(reorder, terms=False):
  def body(x, y):
    h = jnp.tanh(hk.Linear(F, name="first")(x))
    out = hk.Linear(3, name="second")(reorder(h))
    l = 0.5 * jnp.sum((out - y) ** 2, (1, 2))
    return l if terms else jnp.sum(l)
  return body


#: Rows taken apart and put back in the batch's order: exact.
_ROWS_PUT_BACK = {
    "halves": lambda h: jnp.concatenate([h[:2], h[2:]]),
    "flip_flip": lambda h: jnp.flip(jnp.flip(h, 0), 0),
    "reversed_twice": lambda h: h[::-1][::-1],
    "split": lambda h: jnp.concatenate(jnp.split(h, [1, 3])),
    "first_copy": lambda h: jnp.concatenate([h, h])[:h.shape[0]],
    "halves_of_two_values": lambda h: jnp.concatenate([h[:2], 2. * h[2:]]),
    "odd_even": lambda h: jnp.stack([h[0::2], h[1::2]], 1).reshape(h.shape),
}


@pytest.mark.parametrize("name", sorted(_ROWS_PUT_BACK))
def test_rows_put_back_in_order_are_exact(name):
  x, y = _data(25)
  if name == "odd_even":  # interleaving merges two axes: still refused
    with pytest.raises(ValueError, match="reordered|merges|several"):
      _run(_between(_ROWS_PUT_BACK[name]), x, y)
    return
  params, (_, _, grams) = _run(_between(_ROWS_PUT_BACK[name]), x, y)
  # The model depends on row positions: rows of jacrev, not a batch of one.
  terms = hk.without_apply_rng(hk.transform(
      _between(_ROWS_PUT_BACK[name], terms=True))).apply
  assert_gram_close(grams.total, jacobian_gram(terms, params, x, y))


@pytest.mark.parametrize("reorder", [
    lambda h: jnp.concatenate([h[2:], h[:2]]),
    lambda h: jnp.flip(h, 0),
    lambda h: jnp.concatenate([h[:2], h[:2]]),
    lambda h: jnp.concatenate([h, h])[1:h.shape[0] + 1],
], ids=["rotated", "flipped", "repeated", "shifted_copy"])
def test_rows_put_back_in_another_order_are_refused(reorder):
  x, y = _data(26)
  with pytest.raises(ValueError, match="reordered, repeated or a subset"):
    _run(_between(reorder), x, y)


def test_reordered_input_data_are_refused():
  # Rows of the input data reordered before the first layer: the Gram would
  # come back in the model's row order, not the batch's.
  x, y = _data(4)
  perm = jnp.argsort(x[:, 0, 0])  # a data-dependent order (bucketing)
  body = lambda x, y: _sq(hk.Linear(3)(jnp.tanh(hk.Linear(F)(x[perm]))), y)
  with pytest.raises(ValueError, match="reordered, repeated or a subset"):
    _run(body, x, y)


def _after(reorder_out, reorder_y=lambda y: y, terms=False):
  """A model whose loss reorders the last layer's rows and/or the labels'."""
  def body(x, y):
    out = hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))
    l = 0.5 * jnp.sum((reorder_out(out) - reorder_y(y)) ** 2, (1, 2))
    return l if terms else jnp.sum(l)
  return body


_SHUFFLE = lambda a: a[jnp.array([2, 0, 3, 1])]

#: The loss pairs one example's outputs with another example's labels.
_OUTPUTS_PAIRED_WITH_OTHERS_DATA = {
    "reversed": (lambda o: o[::-1], lambda y: y),
    "rolled": (lambda o: jnp.roll(o, 1, axis=0), lambda y: y),
    "shuffled": (_SHUFFLE, lambda y: y),
    "shifted": (lambda o: o[1:], lambda y: y[:-1]),
    "reversed_and_rolled": (lambda o: o[::-1], lambda y: jnp.roll(y, 1, 0)),
}


@pytest.mark.parametrize("name", sorted(_OUTPUTS_PAIRED_WITH_OTHERS_DATA))
def test_outputs_reordered_against_the_data_are_refused(name):
  # Each loss term reads the outputs of one example and the labels of
  # another: the Gram by the inputs' rows and the Gram by the terms' rows
  # differ, and neither is the batch's (was silent: the first, rel. err.
  # 0.9 against rows of jacrev of the terms).
  x, y = _data(27)
  body = _after(*_OUTPUTS_PAIRED_WITH_OTHERS_DATA[name])
  with pytest.raises(ValueError, match="another example's data"):
    _run(body, x, y)
  f = _tracked_transform(body)
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  reweighted = gram_haiku.reweighted_grad(f.apply, lambda g: g.norms)
  with pytest.raises(ValueError, match="another example's data"):
    reweighted(params, state, None, x, y)
  clipped = gram_haiku.clipped_grad(f.apply, 1.0)
  with pytest.raises(ValueError, match="another example's data|other examples"):
    clipped(params, state, None, x, y)


_PERM = jnp.array([2, 0, 3, 1])


def test_outputs_and_data_picked_by_other_index_arrays_are_refused():
  # Two index arrays, told apart by their contents (or their computation).
  x, y = _data(29)
  with pytest.raises(ValueError, match="another example's data"):
    _run(_after(lambda o: o[_PERM], lambda y: y[_PERM[::-1]]), x, y)
  with pytest.raises(ValueError, match="another example's data"):
    _run(_after(lambda o: o[_PERM], lambda y: y[(_PERM + 1) % B]), x, y)
  # A rolled copy of the same array.
  with pytest.raises(ValueError, match="another example's data"):
    _run(_after(lambda o: o[_PERM], lambda y: y[jnp.roll(_PERM, 1)]), x, y)


_REORDERED_WITH_OWN_DATA = [
    "both_reversed", "both_halves_swapped", "both_by_one_index_array",
    "both_by_equal_index_arrays", "both_by_one_index_array_one_jitted",
    "outputs_reversed_no_data", "labels_rolled"]


def _reordered_with_own_data(name, y):
  """``(body, labels)``: a loss whose terms come in another order, and the
  labels each input row is paired with."""
  swap = lambda a: jnp.concatenate([a[2:], a[:2]])
  if name == "both_reversed":
    return _after(lambda o: o[::-1], lambda y: y[::-1]), y
  if name == "both_halves_swapped":
    return _after(swap, swap), y
  if name == "both_by_one_index_array":
    return _after(lambda o: o[_PERM], lambda y: y[_PERM]), y
  if name == "both_by_equal_index_arrays":  # two arrays, equal contents
    return _after(_SHUFFLE, _SHUFFLE), y
  if name == "both_by_one_index_array_one_jitted":
    return _after(jax.jit(lambda o: o[_PERM]), lambda y: y[_PERM]), y
  if name == "outputs_reversed_no_data":
    return _after(lambda o: o[::-1], jnp.zeros_like), jnp.zeros_like(y)
  # Labels rolled: the terms' rows are the inputs' rows.
  return (_after(lambda o: o, lambda y: jnp.roll(y, 1, axis=0)),
          jnp.roll(y, 1, axis=0))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("name", _REORDERED_WITH_OWN_DATA)
def test_outputs_reordered_with_their_own_data_are_exact(name, jit):
  # Each term still reads one example's outputs and labels: the Gram is over
  # the examples (rows of the model's inputs), whatever order the terms of
  # the sum come in.
  x, y = _data(28)
  body, per_y = _reordered_with_own_data(name, y)
  params, (_, grads, grams) = _run(body, x, y, jit=jit)
  # One example alone: its input row and the label it is paired with.
  plain = hk.without_apply_rng(hk.transform(_after(lambda o: o)))
  ref = reference_gram(plain.apply, params, x, per_y)
  assert_gram_close(grams.total, ref)
  want = jax.jit(jax.grad(lambda p: hk.without_apply_rng(
      hk.transform(body)).apply(p, x, y)))(params)
  chex.assert_trees_all_close(grads, want, rtol=RTOL_F32, atol=ATOL_F32)


@pytest.mark.parametrize("name", _REORDERED_WITH_OWN_DATA)
def test_clipping_outputs_reordered_with_their_own_data(name):
  """The clipped sum too: each term reads one example's outputs and its
  own labels, so clipping per input row bounds each example. Labels paired
  with another example's outputs (rolled) stay refused: an example's data
  would move another one's gradient."""
  x, y = _data(29)
  body, per_y = _reordered_with_own_data(name, y)
  if name == "labels_rolled":
    with pytest.raises(ValueError, match="reads data of other examples"):
      _clipped_run(body, x, y)
    return
  params, _ = _tracked_transform(body).init(jax.random.PRNGKey(0), x, y)
  plain = hk.without_apply_rng(hk.transform(_after(lambda o: o)))
  flat = np.asarray(per_example_grads(plain.apply, params, x, per_y),
                    np.float64)
  c_norm = float(np.median(np.sqrt(np.sum(flat * flat, 1))))
  _, (grads, aux) = _clipped_run(body, x, y, c_norm=c_norm)
  _assert_clipped_like_reference(grads, aux, flat, c_norm, params)


@jax.custom_jvp
def _mixes_tangents(h):
  return h


@_mixes_tangents.defjvp
def _mixes_tangents_jvp(primals, tangents):
  (h,), (t,) = primals, tangents
  return h, t + 0.3 * jnp.roll(t, 1, axis=0)  # a neighbour's row


@jax.custom_jvp
def _own_rule_per_row(h):
  return jnp.tanh(h)


@_own_rule_per_row.defjvp
def _own_rule_per_row_jvp(primals, tangents):
  (h,), (t,) = primals, tangents
  return jnp.tanh(h), 2.0 * t / jnp.cosh(h) ** 2  # a gradient scale per row


def _through(fn):
  def body(x, y):
    h = jnp.tanh(hk.Linear(F, name="first")(x))
    return _sq(hk.Linear(3, name="second")(fn(h)), y)
  return body


def test_a_custom_jvp_rule_that_mixes_examples_is_refused():
  # The forward program is the identity; the rule adds a neighbour's
  # tangent: the examples' gradients are mixed (was silent, rel. err. 0.26).
  x, y = _data(30)
  with pytest.raises(ValueError, match="mixes|coupl"):
    _run(_through(_mixes_tangents), x, y)


@jax.custom_vjp
def _mixes_cotangents(h):
  return h


_mixes_cotangents.defvjp(
    lambda h: (h, None),
    lambda _, g: (g + 0.3 * jnp.roll(g, -1, axis=0),))


@jax.custom_vjp
def _scales_cotangents(h):
  return h


_scales_cotangents.defvjp(lambda h: (h, None), lambda _, g: (2.0 * g,))


@pytest.mark.parametrize("fn", [_mixes_cotangents, _scales_cotangents],
                         ids=["mixing", "per_row"])
def test_a_custom_vjp_on_the_examples_path_is_not_taken_on_trust(fn):
  # Its backward is Python code, not a program to read: a warning (run
  # verify), and clipped_grad refuses. The mixing rule was silent before
  # (rel. err. 0.26 in the Gram, 0.23 in the clipped sum).
  x, y = _data(32)
  with pytest.warns(example_flow.ExampleFlowWarning, match="custom_vjp"):
    params, (_, _, grams) = _run(_through(fn), x, y)
  f = _tracked_transform(_through(fn))
  _, state = f.init(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="custom_vjp"):
    gram_haiku.clipped_grad(f.apply, 1.0)(params, state, None, x, y)
  with pytest.warns(example_flow.ExampleFlowWarning, match="custom_vjp"):
    report = gram_haiku.verify(f.apply, params, state, None, x, y)
  assert report.ok == (fn is _scales_cotangents), str(report)


@pytest.mark.parametrize("fn", [_own_rule_per_row, jax.nn.relu,
                                jax.nn.softplus, jax.nn.silu],
                         ids=["own_rule", "relu", "softplus", "silu"])
def test_custom_jvp_rules_per_example_are_exact(fn):
  x, y = _data(31)
  with warnings.catch_warnings():
    warnings.simplefilter("error", example_flow.ExampleFlowWarning)
    params, (_, _, grams) = _run(_through(fn), x, y)
  terms = hk.without_apply_rng(hk.transform(
      lambda x, y: 0.5 * jnp.sum(
          (hk.Linear(3, name="second")(fn(jnp.tanh(
              hk.Linear(F, name="first")(x)))) - y) ** 2, (1, 2))))
  assert_gram_close(grams.total, jacobian_gram(terms.apply, params, x, y))


def _last_step_take_along_axis(x, y):
  h = jnp.tanh(hk.Linear(F)(x))
  lengths = jnp.array([4, 2, 3, 1])
  last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return _sq(hk.Linear(3)(last), y[:, 0])


def _integer_label_cross_entropy(x, y):
  logits = hk.Linear(3)(x.mean(1))
  labels = jnp.argmax(y[:, 0], axis=-1)
  picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  return jnp.sum(jax.nn.logsumexp(logits, -1) - picked)


@pytest.mark.parametrize("body", [_last_step_take_along_axis,
                                  _integer_label_cross_entropy],
                         ids=lambda f: f.__name__)
def test_per_example_gathers_are_exact(body):
  x, y = _data(5)
  params, (_, _, grams) = _run(body, x, y)
  plain = hk.without_apply_rng(hk.transform(body))
  # The lengths are per example: give each example its own in the reference.
  if body is _last_step_take_along_axis:
    lengths = np.array([4, 2, 3, 1])
    def last_step(x, y, n):
      h = jnp.tanh(hk.Linear(F)(x))
      last = jnp.take_along_axis(h, (n - 1)[:, None, None], axis=1)[:, 0]
      return _sq(hk.Linear(3)(last), y[:, 0])
    one = hk.without_apply_rng(hk.transform(last_step))
    ref = reference_gram(one.apply, params, x, y, jnp.asarray(lengths))
  else:
    ref = reference_gram(plain.apply, params, x, y)
  assert_gram_close(grams.total, ref)


def _coupled_after_integer_labels(x, y):
  logits = hk.Linear(3)(x.mean(1))
  labels = jnp.argmax(y[:, 0], axis=-1)
  picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  return jax.nn.logsumexp(jax.nn.logsumexp(logits, -1) - picked)


def _hardest_examples(x, y):
  per_example = jnp.sum((hk.Linear(3)(x) - y) ** 2, axis=(1, 2))
  return jax.lax.top_k(per_example, 2)[0].sum()


def _pooled_over_batch(x, y):
  h = jnp.tanh(hk.Linear(F)(x))
  h = hk.avg_pool(h, (2, 1, 1), (1, 1, 1), "SAME")
  return _sq(hk.Linear(3)(h), y)


@pytest.mark.parametrize("body,match", [
    (_coupled_after_integer_labels, "not a sum"),
    (_hardest_examples, "not a sum"),
    (_pooled_over_batch, "depends on several examples"),
], ids=lambda v: getattr(v, "__name__", "")[:24])
def test_coupling_after_gathers_and_pools_is_refused(body, match):
  x, y = _data(6)
  with pytest.raises(ValueError, match=match):
    _run(body, x, y)


# -- writes, transforms and loops over the batch ------------------------------
# Found by an outside check: each of these once returned a wrong Gram with
# no error (the operation was not modelled, so nothing was concluded).

_PERM = np.array([2, 0, 3, 1])


def _two_layers(between):
  def body(x, y):
    h = jnp.tanh(hk.Linear(F, name="first")(x))
    return _sq(hk.Linear(3, name="second")(between(h)), y)
  body.__name__ = between.__name__
  return body


def _scatter_permuted(h):
  return jnp.zeros_like(h).at[_PERM].set(h)


def _scatter_added(h):
  return jnp.zeros_like(h).at[_PERM].add(h)


def _rows_overwritten(h):
  return jax.lax.dynamic_update_slice(h, h[:1], (2, 0, 0))


def _fft_over_batch(h):
  return jnp.fft.fft(h, axis=0).real


def _ema_over_batch(h):
  step = lambda c, hi: (0.5 * c + hi, 0.5 * c + hi)
  return jax.lax.scan(step, jnp.zeros(h.shape[1:]), h)[1]


def _branch_on_one_example(h):
  return jax.lax.cond(h[0, 0, 0] > 0, lambda a: 2 * a, lambda a: -a, h)


def _constant_query(x, y):  # its (1, F) rows broadcast over the batch
  q = hk.Linear(3, name="q")(jnp.ones((1, 1, F)))
  return _sq(x[..., :3] * q, y)


def _one_example_per_scan_step(x, y):
  lin = hk.Linear(3)
  def step(c, xi):
    return c, lin(xi[None])[0]
  return _sq(hk.scan(step, 0.0, x)[1], y)


def _positions_scanned_with_time(x, y):  # T == B: rows of a (T, F) input
  pos = hk.Linear(F, name="pos")(jnp.eye(T, F))
  h = hk.Linear(F, name="inp")(x)
  def step(c, inp):
    ht, pt = inp
    return jnp.tanh(c + ht + pt), c
  _, hs = jax.lax.scan(step, jnp.zeros((x.shape[0], F)),
                       (jnp.swapaxes(h, 0, 1), pos))
  return _sq(hk.Linear(3, name="out")(jnp.swapaxes(hs, 0, 1)), y)


def _per_example_losses(x, y):
  return 0.5 * jnp.sum((hk.Linear(3)(x) - y) ** 2, axis=(1, 2))


def _sorted_max_loss(x, y):
  return jnp.sort(_per_example_losses(x, y))[-1]


def _sorted_top2_loss(x, y):
  return jnp.sort(_per_example_losses(x, y))[-2:].sum()


def _scanned_product_loss(x, y):
  step = lambda c, li: (c * li, None)
  return jax.lax.scan(step, 1.0, _per_example_losses(x, y))[0]


def _looped_product_loss(x, y):
  l = _per_example_losses(x, y)
  return jax.lax.fori_loop(0, l.shape[0], lambda i, c: c * l[i], 1.0)


@pytest.mark.parametrize("body,match", [
    (_two_layers(_scatter_permuted), "depends on several examples"),
    (_two_layers(_scatter_added), "reordered, repeated or a subset"),
    (_two_layers(_rows_overwritten), "depends on several examples"),
    (_two_layers(_fft_over_batch), "depends on several examples"),
    (_two_layers(_ema_over_batch), "depends on several examples"),
    (_two_layers(_branch_on_one_example), "depends on several examples"),
    (_constant_query, _REORDERED),
    (_one_example_per_scan_step, r"row\(s\) of a loop over the examples"),
    (_positions_scanned_with_time, _COMBINED),
    (_sorted_max_loss, "not a sum"),
    (_sorted_top2_loss, "not a sum"),
    (_scanned_product_loss, "not a sum"),
    (_looped_product_loss, "not a sum"),
], ids=lambda v: getattr(v, "__name__", "")[:24])
def test_writes_transforms_and_loops_over_the_batch_are_refused(body, match):
  x, y = _data(7)
  with pytest.raises(ValueError, match=match):
    _run(body, x, y)


def _feature_column_zeroed(h):
  return h.at[:, :, 1].set(0.0)


def _features_padded(h):
  return jnp.zeros(h.shape[:-1] + (F + 2,)).at[..., :F].set(h)[..., 1:F + 1]


def _first_step_shifted(h):  # a constant added at every example's step 0
  return h.at[:, 0].add(1.0)


def _feature_fft(h):  # an FFT within each example
  return jnp.fft.fft(h, axis=-1).real


def _steps_unstacked_and_stacked(h):
  return jnp.stack([jnp.tanh(s) for s in jnp.unstack(h, axis=1)], axis=1)


@pytest.mark.parametrize("between", [
    _feature_column_zeroed, _features_padded, _first_step_shifted, _feature_fft,
    _steps_unstacked_and_stacked], ids=lambda f: f.__name__)
def test_writes_and_transforms_within_examples_are_exact(between):
  body = _two_layers(between)
  x, y = _data(8)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gram_haiku.ExampleFlowWarning)
    params, (_, _, grams) = _run(body, x, y)
  plain = hk.without_apply_rng(hk.transform(body))
  assert_gram_close(grams.total, reference_gram(plain.apply, params, x, y))


def _solve_over_batch(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  m = jnp.eye(B) + 0.1 * jnp.arange(B * B, dtype=jnp.float32).reshape(B, B)
  h = jnp.linalg.solve(m, h.reshape(B, -1)).reshape(h.shape)
  return _sq(hk.Linear(3, name="second")(h), y)


def test_unmodelled_primitives_warn_and_clipping_refuses():
  x, y = _data(9)
  with pytest.warns(gram_haiku.ExampleFlowWarning,
                    match=r"(?s)could not be followed.*to second.*verify"
                    ) as caught:
    _run(_solve_over_batch, x, y, jit=False)
  # It points at the user's code (here, the test's helper), not into JAX.
  assert {w.filename for w in caught
          if w.category is gram_haiku.ExampleFlowWarning} == {__file__}
  f = _tracked_transform(_solve_over_batch)
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="privacy guarantee cannot rest"):
    gram_haiku.clipped_grad(f.apply, 1.0)(params, state, None, x, y)


# -- a second outside check: loops, sorts and candidates -----------------------


def _h_and_mean(x):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  return h, h.mean(0)


def _centred_in_second_branch(x, y):  # the mean is met in branch 2 of 2
  h, m = _h_and_mean(x)
  z = jax.lax.cond(jnp.sum(x) > -1e9, lambda h, m: h - m,
                   lambda h, m: h * 1.0, h, m)
  return _sq(hk.Linear(3, name="second")(z), y)


def _centred_in_a_later_scan_round(x, y):
  h, m = _h_and_mean(x)
  def step(c, t):
    return h * t, (h - m, x * 2.0)
  c, (ys, _) = jax.lax.scan(step, jnp.zeros_like(h), jnp.arange(3.0))
  return _sq(hk.Linear(3, name="second")(ys[1] + c), y)


def _centred_through_a_delay_line(x, y):  # reached after five rounds
  h, _ = _h_and_mean(x)
  def step(c, _):
    return c[1:] + (h,), None
  c, _ = jax.lax.scan(step, (jnp.zeros_like(h),) * 5, None, length=6)
  return _sq(hk.Linear(3, name="second")(h - c[0].mean(0)), y)


def _max_by_sort_and_mask(x, y):
  return jnp.sort(_per_example_losses(x, y)) @ (jnp.arange(B) == B - 1)


def _max_by_sort_and_index(x, y):
  return jnp.sort(_per_example_losses(x, y))[jnp.array([B - 1])].sum()


def _max_by_sort_and_cumsum(x, y):
  return jnp.cumsum(jnp.sort(_per_example_losses(x, y)))[1:2].sum()


def _candidate_rows_permuted(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  q = jnp.tanh(hk.Linear(F, name="q")(jnp.ones((B, T, 2))))
  q = q[jnp.array([1, 2, 3, 0])]
  return _sq(hk.Linear(3)(q * 0.0 + jnp.einsum("btf,btf->bt", q, h)[
      ..., None]), y)


def _candidate_concatenated_first(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  c = hk.Linear(F, name="c")(jnp.ones((B, T, 2)))
  z = jnp.concatenate([c, h[::-1]], 0)[B:]  # == h[::-1]
  return _sq(hk.Linear(3, name="second")(z), y)


@pytest.mark.parametrize("body,match", [
    (_centred_in_second_branch, "depends on several examples"),
    (_centred_in_a_later_scan_round, "depends on several examples"),
    (_centred_through_a_delay_line, "depends on several examples"),
    (_max_by_sort_and_mask, "not a sum"),
    (_max_by_sort_and_index, "not a sum"),
    (_max_by_sort_and_cumsum, "not a sum"),
    (_candidate_rows_permuted, _REORDERED),
    (_candidate_concatenated_first, _REORDERED),
], ids=lambda v: getattr(v, "__name__", "")[:24])
def test_loops_sorts_and_candidates_are_refused(body, match):
  x, y = _data(10)
  with pytest.raises(ValueError, match=match):
    _run(body, x, y)


def test_one_hot_labels_written_by_scatter_are_data():
  x, y = _data(11)
  labels = jnp.argmax(y[:, 0], axis=-1)

  def xent(x, onehot):
    return -jnp.sum(jax.nn.log_softmax(hk.Linear(3)(x.mean(1))) * onehot)

  def body(x, y):
    del y
    rows = jnp.arange(x.shape[0])
    return xent(x, jnp.zeros((x.shape[0], 3)).at[rows, labels].set(1.0))
  with warnings.catch_warnings():
    warnings.simplefilter("error", gram_haiku.ExampleFlowWarning)
    params, (_, _, grams) = _run(body, x, y)
  # Each example's one-hot row is its own label's.
  plain = hk.without_apply_rng(hk.transform(xent))
  ref = reference_gram(plain.apply, params, x, jax.nn.one_hot(labels, 3))
  assert_gram_close(grams.total, ref)


# -- example_axes: where the examples start --------------------------------------


def _time_major_lstm(x, y):  # x: (T, B, F), y: (B, 3)
  core = hk.LSTM(5)
  out, _ = hk.dynamic_unroll(core, x, core.initial_state(x.shape[1]))
  return _sq(hk.Linear(3, name="head")(out[-1]), y)


def _time_major_vmapped(x, y):  # x: (T, B, F), mapped over its axis 1
  def per_example(xe):  # (T, F)
    return jnp.tanh(hk.Linear(3, name="step")(xe)).sum(0)
  return _sq(hk.vmap(per_example, in_axes=1, split_rng=False)(x), y)


def _attends_to_a_memory(x, memory, y):  # memory: (B, F), read by all
  attn = hk.MultiHeadAttention(
      2, 3, w_init=hk.initializers.VarianceScaling(1.0), model_size=3)
  return _sq(attn(x, memory[None].repeat(x.shape[0], 0),
                  memory[None].repeat(x.shape[0], 0)), y)


def _axes_reference(plain, params, batch, axes):
  """``F F^T``, ``F`` from ``vmap(grad)`` over each argument's example axis
  (``axes``: int or None per argument), one example at a time."""
  def one(p, *example):
    return plain(p, *(e if ax is None else jnp.expand_dims(e, ax)
                      for e, ax in zip(example, axes)))
  grads = jax.jit(jax.vmap(jax.grad(one), in_axes=(None, *axes)))(params,
                                                                   *batch)
  f = np.concatenate([np.asarray(l, np.float64).reshape(B, -1)
                      for l in jax.tree.leaves(grads)], axis=1)
  return f @ f.T


def _with_axes_problem(name):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(31), 3)
  if name in ("time_major_lstm", "time_major_vmapped"):
    # T == B: by size alone axis 0 (time) would be taken for the examples.
    batch = (problems.normal(k1, (T, B, F)), problems.normal(k2, (B, 3)))
    body = (_time_major_lstm if name == "time_major_lstm" else
            _time_major_vmapped)
    return body, batch, (1, 0)
  batch = (problems.normal(k1, (B, T, F)), problems.normal(k2, (B, F)),
           problems.normal(k3, (B, T, 3)))
  return _attends_to_a_memory, batch, (0, None, 0)


@pytest.mark.parametrize("name", ["time_major_lstm", "time_major_vmapped",
                                  "memory_of_b_rows"])
def test_example_axes_say_where_the_examples_are(name):
  body, batch, axes = _with_axes_problem(name)

  f = _tracked_transform(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), *batch)
  plain = hk.without_apply_rng(hk.transform(body)).apply
  if name != "time_major_lstm":  # (there axis 0 is never a layer's rows)
    # Sizes alone cannot tell (T == B, a memory of B rows): refused.
    with pytest.raises(ValueError, match="example"):
      gram_haiku.value_grad_and_gram(f.apply)(params, state, None, *batch)
  fn = jax.jit(gram_haiku.value_grad_and_gram(f.apply, example_axes=axes))
  _, grads, grams = fn(params, state, None, *batch)
  ref = _axes_reference(plain, params, batch, axes)
  assert_gram_close(grams.total, ref)
  chex.assert_trees_all_close(grads, jax.jit(jax.grad(plain))(params, *batch),
                              rtol=1e-5, atol=1e-6)
  if name == "time_major_lstm":
    return  # (the others check the clipped gradient and verify too)
  # The clipped gradient and verify take the same axes.
  clipped, aux = jax.jit(gram_haiku.clipped_grad(
      f.apply, 1.0, example_axes=axes))(params, state, None, *batch)
  np.testing.assert_allclose(aux.grad_norms, np.sqrt(np.diag(ref)),
                             rtol=1e-4)
  report = gram_haiku.verify(f.apply, params, state, None, *batch,
                             example_axes=axes)
  assert report.ok, str(report)


@pytest.mark.parametrize("axes,match", [
    ((1,), "one entry per positional batch argument"),
    ((1, "0"), "one entry per positional batch argument"),
    ((3, 0), "axis 3 for batch argument 0"),
    ((2, 0), "axis 2 of a batch array of shape"),
])
def test_bad_example_axes_are_teaching_errors(axes, match):
  body, batch, _ = _with_axes_problem("time_major_lstm")

  f = _tracked_transform(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), *batch)
  with pytest.raises(ValueError, match=match):
    gram_haiku.value_grad_and_gram(f.apply, example_axes=axes)(
        params, state, None, *batch)


def test_example_axes_still_refuse_a_layer_over_the_wrong_axis():
  # Told that axis 1 holds the examples, a layer applied to the time-major
  # input directly (its example axis 0 is time) is refused, not trusted.
  _, batch, axes = _with_axes_problem("time_major_lstm")

  f = _tracked_transform(
      lambda x, y: _sq(jnp.tanh(hk.Linear(3)(x)).sum(0), y))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), *batch)
  with pytest.raises(ValueError, match="along axis 1"):
    gram_haiku.value_grad_and_gram(f.apply, example_axes=axes)(
        params, state, None, *batch)


def _token_losses(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  out = hk.Linear(3, name="second")(h)
  return 0.5 * jnp.sum((out - y) ** 2, -1).reshape(-1)  # [B T]


_TOKEN_IDS = np.repeat(np.arange(B), T)  # position -> its example


def _segment_sum_loss(x, y):
  per = jax.ops.segment_sum(_token_losses(x, y), jnp.asarray(_TOKEN_IDS),
                            num_segments=B)
  return jnp.sum(per)


def _segment_ids_computed_mean(x, y):  # ids from iota; a mean over examples
  ids = jnp.repeat(jnp.arange(B), T)
  return jnp.mean(jax.ops.segment_sum(_token_losses(x, y), ids,
                                      num_segments=B)) * B


def _at_add_loss(x, y):
  return jnp.sum(jnp.zeros(B).at[jnp.asarray(_TOKEN_IDS)].add(
      _token_losses(x, y)))


def _segments_of_other_examples(x, y):  # a segment may mix examples: a sum
  ids = jnp.asarray((np.arange(B * T) * 3) % B)
  return jnp.sum(jax.ops.segment_sum(_token_losses(x, y), ids,
                                     num_segments=B))


@pytest.mark.parametrize("body", [
    _segment_sum_loss, _segment_ids_computed_mean, _at_add_loss,
    _segments_of_other_examples], ids=lambda f: f.__name__)
@pytest.mark.parametrize("jit", [False, True])
def test_per_token_losses_summed_by_segments_are_exact(body, jit):
  """``segment_sum`` (a scatter-add at constant indices) of per-token
  losses, then a sum: a sum of per-example terms, whatever the segments."""
  x, y = _data(21)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gram_haiku.ExampleFlowWarning)
    params, (value, _, grams) = _run(body, x, y, jit=jit)
  per_example = hk.without_apply_rng(hk.transform(
      lambda x, y: jnp.sum(_token_losses(x, y))))
  np.testing.assert_allclose(value, per_example.apply(params, x, y),
                             rtol=1e-5)
  assert_gram_close(grams.total,
                    reference_gram(per_example.apply, params, x, y))


def _per_example(fn):
  """The reference's per-example loss: ``fn`` of one example's token
  losses ``[T]``, summed over the examples."""
  return hk.without_apply_rng(hk.transform(lambda x, y: jnp.sum(jax.vmap(fn)(
      _token_losses(x, y).reshape(x.shape[0], -1)))))


def _data_weight(x):  # a per-example weight read from the input data
  return jnp.abs(x[:, 0, 0]) + 0.5


def _sqrt_of_segment_sums(x, y):
  per = jax.ops.segment_sum(_token_losses(x, y), jnp.asarray(_TOKEN_IDS),
                            num_segments=B)
  return jnp.sum(jnp.sqrt(per))


def _data_weighted_segment_sums(x, y):
  per = jax.ops.segment_sum(_token_losses(x, y), jnp.asarray(_TOKEN_IDS),
                            num_segments=B)
  return jnp.sum(_data_weight(x) * per)


_SEGMENT_OF = np.array([1, 3, 0, 2])  # example e's tokens -> segment


def _segments_in_another_order(x, y):
  ids = jnp.asarray(_SEGMENT_OF[_TOKEN_IDS])
  per = jax.ops.segment_sum(_token_losses(x, y), ids, num_segments=B)
  return jnp.sum(per ** 1.5)


def _time_major_segments(x, y):  # tokens flattened (T, B): outer positions
  tokens = jnp.swapaxes(_token_losses(x, y).reshape(B, T), 0, 1).reshape(-1)
  ids = jnp.tile(jnp.arange(B), T)
  return jnp.sum(jnp.log1p(jax.ops.segment_sum(tokens, ids, num_segments=B)))


def _fortran_order_segments(x, y):  # the time-major flattening, order="F"
  tokens = _token_losses(x, y).reshape(B, T).ravel(order="F")
  ids = jnp.broadcast_to(jnp.arange(B)[None], (T, B)).ravel()
  return jnp.sum(jnp.sqrt(jax.ops.segment_sum(tokens, ids, num_segments=B)))


_SEGMENT_BODIES = {
    # body: (the per-example function of the token losses, data weight)
    _sqrt_of_segment_sums: (lambda l: jnp.sqrt(jnp.sum(l)), False),
    _data_weighted_segment_sums: (jnp.sum, True),
    _segments_in_another_order: (lambda l: jnp.sum(l) ** 1.5, False),
    _time_major_segments: (lambda l: jnp.log1p(jnp.sum(l)), False),
    _fortran_order_segments: (lambda l: jnp.sqrt(jnp.sum(l)), False),
}


@pytest.mark.parametrize("body", list(_SEGMENT_BODIES),
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("jit", [False, True])
def test_functions_of_one_example_segment_sums_are_exact(body, jit):
  """Segments that each gather one example's tokens (ids known on the
  host), one segment per example: the segment sums are the examples' rows,
  so any function of a row, or a per-example weight from the data, keeps
  the loss a sum of per-example terms."""
  x, y = _data(22)
  with warnings.catch_warnings():
    warnings.simplefilter("error", gram_haiku.ExampleFlowWarning)
    params, (_, _, grams) = _run(body, x, y, jit=jit)
  fn, weighted = _SEGMENT_BODIES[body]
  if weighted:
    ref = hk.without_apply_rng(hk.transform(lambda x, y: jnp.sum(
        _data_weight(x) * jax.vmap(fn)(
            _token_losses(x, y).reshape(x.shape[0], -1)))))
  else:
    ref = _per_example(fn)
  assert_gram_close(grams.total, reference_gram(ref.apply, params, x, y))


def _segment_pooling(x, y):
  """Per-token features pooled by a segment sum into per-example ones,
  then a tracked head (graph pooling, packed sequences)."""
  h = jnp.tanh(hk.Linear(F, name="token")(x))
  b, t = h.shape[:2]
  pooled = jax.ops.segment_sum(h.reshape(b * t, -1), jnp.repeat(
      jnp.arange(b), t), num_segments=b)
  return 0.5 * jnp.sum((hk.Linear(3, name="head")(pooled) - y[:, 0]) ** 2)


@pytest.mark.parametrize("jit", [False, True])
def test_segment_pooling_into_a_tracked_layer_is_exact(jit):
  x, y = _data(24)
  params, (_, _, grams) = _run(_segment_pooling, x, y, jit=jit)
  ref = hk.without_apply_rng(hk.transform(_segment_pooling))
  assert_gram_close(grams.total, reference_gram(ref.apply, params, x, y))
  assert sorted(grams.by_layer) == ["head", "token"]


def _segment_sums_squared_across_examples(x, y):
  ids = jnp.asarray((np.arange(B * T) * 3) % B)
  return jnp.sum(jax.ops.segment_sum(_token_losses(x, y), ids,
                                     num_segments=B) ** 2)


def _two_segments_per_example(x, y):  # halves of each example apart
  ids = jnp.asarray(np.arange(B * T) // (T // 2))
  return jnp.sum(jnp.sqrt(jax.ops.segment_sum(
      _token_losses(x, y), ids, num_segments=2 * B)))


def _segment_pooling_across_examples(x, y):
  h = jnp.tanh(hk.Linear(F, name="token")(x)).reshape(B * T, -1)
  pooled = jax.ops.segment_sum(h, jnp.asarray((np.arange(B * T) * 3) % B),
                               num_segments=B)
  return 0.5 * jnp.sum((hk.Linear(3, name="head")(pooled) - y[:, 0]) ** 2)


def _fortran_order_ids(x, y):  # ids tile(arange(B), T): segments mix
  ids = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T)).ravel(order="F")
  return jnp.sum(jnp.sqrt(jax.ops.segment_sum(_token_losses(x, y), ids,
                                              num_segments=B)))


def _fortran_order_tokens(x, y):  # tokens time-major, ids batch-major: mix
  tokens = _token_losses(x, y).reshape(B, T).ravel(order="F")
  return jnp.sum(jnp.sqrt(jax.ops.segment_sum(
      tokens, jnp.asarray(_TOKEN_IDS), num_segments=B)))


@pytest.mark.parametrize("body", [_segment_sums_squared_across_examples,
                                  _fortran_order_ids, _fortran_order_tokens,
                                  _two_segments_per_example,
                                  _segment_pooling_across_examples],
                         ids=lambda f: f.__name__)
def test_segments_that_are_not_one_example_each_are_refused(body):
  """A segment mixing examples couples them; two segments of one example
  are not known to be a per-example term once a nonlinear function is
  taken of each: a teaching error, never a number."""
  x, y = _data(22)
  with pytest.raises(ValueError, match="not a sum|several examples at once"):
    _run(body, x, y)


@pytest.mark.parametrize("body", [_segment_sum_loss,
                                  _data_weighted_segment_sums],
                         ids=lambda f: f.__name__)
def test_clipping_per_token_losses_summed_by_segments(body):
  x, y = _data(23)
  params, _ = _tracked_transform(body).init(jax.random.PRNGKey(0), x, y)
  ref = (hk.without_apply_rng(hk.transform(lambda x, y: jnp.sum(
      _data_weight(x) * jnp.sum(_token_losses(x, y).reshape(
          x.shape[0], -1), 1)))) if body is _data_weighted_segment_sums
         else _per_example(jnp.sum))
  flat = np.asarray(per_example_grads(ref.apply, params, x, y), np.float64)
  c_norm = float(np.median(np.sqrt(np.sum(flat * flat, 1))))
  _, (grads, aux) = _clipped_run(body, x, y, c_norm=c_norm)
  _assert_clipped_like_reference(grads, aux, flat, c_norm, params)


# A helper called twice holds the same program (and variables) in both
# calls: what it reads in each call must be told apart.
_ROW = jax.jit(lambda a, i: jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0))
_ROW_REMAT = jax.checkpoint(
    lambda a, i: jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0))
_TAKE = jax.jit(lambda a, p: a[p])


def _rows_by_helper(row, shift):
  """Term ``i`` pairs output row ``i`` with label row ``i + shift``."""
  def body(x, y):
    out = hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))
    return sum(0.5 * jnp.sum((row(out, i) - row(y, (i + shift) % B)) ** 2)
               for i in range(B))
  return body


def _taken_by_data_indices(x, y, p, q):
  out = hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))
  return 0.5 * jnp.sum((_TAKE(out, p) - _TAKE(y, q)) ** 2)


def _outer_product_with_labels(x, y):
  out = hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))
  return 0.5 * jnp.sum(jnp.einsum("btf,ctf->bc", out, y) ** 2)


def _per_example_product_with_labels(x, y):
  out = hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))
  return 0.5 * jnp.sum(jnp.einsum("btf,btf->b", out, y) ** 2)


def _largest_segment_sum(x, y):
  return jnp.sort(jax.ops.segment_sum(
      _token_losses(x, y), jnp.asarray(_TOKEN_IDS), num_segments=B))[-1]


def _clipped_run(body, *batch, c_norm=1.0):
  f = _tracked_transform(body)
  params, state = f.init(jax.random.PRNGKey(0), *batch)
  return params, jax.jit(gram_haiku.clipped_grad(f.apply, c_norm))(
      params, state, None, *batch)


def _assert_clipped_like_reference(grads, aux, flat, c_norm, params):
  """``clipped_grad``'s norms and clipped sum against the reference rows
  ``flat`` (``per_example_grads``, float64)."""
  norms = np.sqrt(np.sum(flat * flat, 1))
  np.testing.assert_allclose(aux.grad_norms, norms, rtol=RTOL_F32)
  chex.assert_trees_all_close(
      grads, weighted_sum(flat, clip_reference(norms, c_norm), params),
      rtol=RTOL_F32, atol=ATOL_F32 * float(np.abs(flat).max()))


@pytest.mark.parametrize("row", [_ROW, _ROW_REMAT], ids=["jit", "remat"])
@pytest.mark.parametrize("shift", [1, B - 1])
def test_a_helper_called_twice_is_told_apart(row, shift):
  """``row(out, i)`` with ``row(y, i + 1)`` through one jitted helper: the
  two calls read other rows, so outputs meet another example's labels."""
  x, y = _data(41)
  with pytest.raises(ValueError, match="reads data of other examples"):
    _clipped_run(_rows_by_helper(row, shift), x, y)
  with pytest.raises(ValueError, match="another example's|another order"):
    _run(_rows_by_helper(row, shift), x, y)


@pytest.mark.parametrize("row", [_ROW, _ROW_REMAT], ids=["jit", "remat"])
def test_a_helper_reading_equal_rows_is_exact(row):
  x, y = _data(42)
  params, (grads, aux) = _clipped_run(_rows_by_helper(row, 0), x, y)
  plain = hk.without_apply_rng(hk.transform(_after(lambda o: o)))
  flat = np.asarray(per_example_grads(plain.apply, params, x, y), np.float64)
  _assert_clipped_like_reference(grads, aux, flat, 1.0, params)


def test_data_index_arrays_through_a_helper_are_refused():
  x, y = _data(43)
  p = jnp.arange(B)
  for q in (jnp.roll(p, 1), p):  # (p with itself: indices are data)
    with pytest.raises(ValueError, match="reads data of other examples"):
      _clipped_run(_taken_by_data_indices, x, y, p, q)


def test_outer_products_of_outputs_with_every_label_are_refused():
  """Each term of ``sum_bc (o_b . y_c)^2`` reads every example's labels:
  a Gram over the outputs' rows, but no per-example privacy bound."""
  x, y = _data(44)
  params, (_, _, grams) = _run(_outer_product_with_labels, x, y)
  terms = lambda p, x, y: 0.5 * jnp.sum(jnp.einsum(
      "btf,ctf->bc", hk.without_apply_rng(hk.transform(
          lambda x: hk.Linear(3, name="head")(jnp.tanh(
              hk.Linear(F, name="first")(x))))).apply(p, x), y) ** 2, 1)
  assert_gram_close(grams.total, jacobian_gram(terms, params, x, y))
  with pytest.raises(ValueError, match="a product of every example"):
    _clipped_run(_outer_product_with_labels, x, y)
  # Paired rows (a batch axis of the product): each example's own labels.
  params, (grads, aux) = _clipped_run(_per_example_product_with_labels, x, y)
  one = hk.without_apply_rng(hk.transform(_per_example_product_with_labels))
  flat = np.asarray(per_example_grads(one.apply, params, x, y), np.float64)
  _assert_clipped_like_reference(grads, aux, flat, 1.0, params)


def _head(x):
  return hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))


def _minus_label_mean(x, y):
  return _sq(_head(x) - y.mean(0), 0.0)  # couples: mean


def _minus_reversed_labels(x, y):
  return 0.5 * jnp.sum((_head(x) - y[::-1]) ** 2)  # couples: reversed


def _times_every_label(x, y):
  return jnp.sum(jnp.einsum("btf,ctf->bc", _head(x), y) ** 2)  # couples: outer


def _branch_on_example_0(x, y):
  h = _head(x)
  h = hk.cond(x[0, 0, 0] > -100.0, jnp.tanh, lambda h: h, h)  # couples: cond
  return _sq(h, y)


def _line_of(marker: str) -> int:
  with open(__file__, encoding="utf-8") as f:
    (line,) = [n for n, text in enumerate(f, 1)
               if text.rstrip().endswith("# couples: " + marker)]
  return line


@pytest.mark.parametrize("body,marker,primitive", [
    (_minus_label_mean, "mean", "sub"),
    (_minus_reversed_labels, "reversed", "sub"),
    (_times_every_label, "outer", "dot_general"),
    (_branch_on_example_0, "cond", "cond"),
])
def test_data_coupling_errors_name_the_users_line(body, marker, primitive):
  # Each way an example's loss can read other examples' data is refused
  # with the primitive where the data meets the parameters' values and the
  # line of the user's code that traced it (not JAX's or Haiku's).
  x, y = _data(47)
  with pytest.raises(ValueError, match="reads data of other examples") as e:
    _clipped_run(body, x, y)
  msg = str(e.value)
  assert f"parameters' values in {primitive} (operands of shapes" in msg, msg
  assert f"(at {__file__}:{_line_of(marker)})" in msg, msg


def _logsumexp_over_batch(x, y):
  del y
  return jax.nn.logsumexp(_head(x).sum((1, 2)))  # couples: logsumexp


def _reversed_outputs_shuffled_labels(x, y):
  return 0.5 * jnp.sum((_head(x)[::-1] - _SHUFFLE(y)) ** 2)  # couples: paired


@pytest.mark.parametrize("body,marker,match", [
    (_logsumexp_over_batch, "logsumexp", "is not a sum"),
    (_reversed_outputs_shuffled_labels, "paired", "another order"),
])
def test_gram_coupling_errors_name_the_users_line(body, marker, match):
  # value_grad_and_gram's refusals of a coupled loss say where too.
  x, y = _data(48)
  with pytest.raises(ValueError, match=match) as e:
    _run(body, x, y)
  msg = str(e.value)
  assert f"(at {__file__}:{_line_of(marker)})" in msg, msg


def test_the_largest_segment_sum_is_refused():
  x, y = _data(45)
  with pytest.raises(ValueError, match="not a sum"):
    _run(_largest_segment_sum, x, y)
  with pytest.raises(ValueError, match="not a sum"):
    _clipped_run(_largest_segment_sum, x, y)


_PERM_NP = np.array([2, 0, 3, 1])  # int64 on the host
_OTHER_NP = np.array([1, 0, 3, 2])


@pytest.mark.parametrize("name", ["numpy_and_jnp", "jnp_and_numpy",
                                  "negative_and_positive", "iota_built"])
def test_equal_index_arrays_written_differently_are_one_order(name):
  """Index arrays of equal contents, however written (a NumPy array, a jnp
  one, negative indices, built from iota), pick the same rows."""
  perm_j = jnp.asarray(_PERM_NP, jnp.int32)
  if name == "numpy_and_jnp":
    body = _after(lambda o: o[_PERM_NP], lambda y: y[perm_j])
  elif name == "jnp_and_numpy":
    body = _after(lambda o: o[perm_j], lambda y: y[_PERM_NP])
  elif name == "negative_and_positive":
    body = _after(lambda o: o[_PERM_NP - B], lambda y: y[perm_j])
  else:
    built = lambda: (jnp.arange(B) * 3 + 2) % B  # [2, 1, 0, 3]
    body = _after(lambda o: o[built()], lambda y: y[np.array([2, 1, 0, 3])])
  x, y = _data(46)
  params, (_, _, grams) = _run(body, x, y)
  plain = hk.without_apply_rng(hk.transform(_after(lambda o: o)))
  assert_gram_close(grams.total, reference_gram(plain.apply, params, x, y))
  _, (grads, aux) = _clipped_run(body, x, y)
  flat = np.asarray(per_example_grads(plain.apply, params, x, y), np.float64)
  _assert_clipped_like_reference(grads, aux, flat, 1.0, params)


def test_index_arrays_of_other_contents_stay_apart():
  body = _after(lambda o: o[_PERM_NP], lambda y: y[jnp.asarray(_OTHER_NP)])
  x, y = _data(47)
  with pytest.raises(ValueError, match="another example's|another order"):
    _run(body, x, y)
  with pytest.raises(ValueError, match="reads data of other examples"):
    _clipped_run(body, x, y)


def _bits_identity():  # [0, 1, 2, 3] on the device, by integer bit ops
  i = jnp.arange(B)
  return ((i | 3) + i + 1) % B


def test_index_arrays_built_with_bit_operations_are_read_bit_by_bit():
  """``|``, ``&``, ``~`` of integers are bitwise: ``arange(4) | 3`` is
  ``[3, 3, 3, 3]``. Read logically, this identity would look like
  ``[2, 3, 0, 1]`` and pair outputs with other examples' labels."""
  x, y = _data(48)
  paired_with_others = _after(lambda o: o[_bits_identity()],
                              lambda y: y[np.array([2, 3, 0, 1])])
  with pytest.raises(ValueError, match="reads data of other examples"):
    _clipped_run(paired_with_others, x, y)
  own = _after(lambda o: o[_bits_identity()], lambda y: y[np.arange(B)])
  params, (grads, aux) = _clipped_run(own, x, y)
  plain = hk.without_apply_rng(hk.transform(_after(lambda o: o)))
  flat = np.asarray(per_example_grads(plain.apply, params, x, y), np.float64)
  _assert_clipped_like_reference(grads, aux, flat, 1.0, params)


def _lagged_rows(x, y):
  """Round ``t`` pairs the output row of round ``t - 1`` with ``y[t]``."""
  out = hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))

  def step(i, carry):
    loss, prev = carry
    loss = loss + 0.5 * jnp.sum(
        (prev - jax.lax.dynamic_slice_in_dim(y, i, 1, 0)) ** 2)
    return loss, jax.lax.dynamic_slice_in_dim(out, i, 1, 0)
  init = (0.0, jnp.zeros((1,) + out.shape[1:]))
  return jax.lax.fori_loop(0, B, step, init)[0]


def test_a_row_carried_over_a_loop_round_is_another_order():
  """Keyed alike within a round, the carried row and the next round's
  labels are other examples' rows: refused (the loop's carries count as
  parameter-dependent, so as values of several examples met)."""
  x, y = _data(49)
  with pytest.raises(ValueError,
                     match="reads data of other examples|not a sum"):
    _clipped_run(_lagged_rows, x, y)


# Gathers whose index array holds data (the labels): x[rows, labels].
_CLASSES = 5


def _logits_picked(pick):
  """``-sum(pick(log_softmax(out), labels))`` on ``x: [B, F]``."""
  def body(x, labels, *extra):
    out = hk.Linear(_CLASSES, name="head")(
        jnp.tanh(hk.Linear(F, name="first")(x)))
    return -jnp.sum(pick(jax.nn.log_softmax(out), labels, *extra))
  return body


def _label_data(seed):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(kx, (B, F)),
          jax.random.randint(ky, (B,), 0, _CLASSES))


_OWN_ROWS = {
    "arange": lambda lp, l: lp[jnp.arange(lp.shape[0]), l],
    "numpy_arange": lambda lp, l: lp[np.arange(B), l],
    "column_indices": lambda lp, l: lp[jnp.arange(lp.shape[0])[:, None],
                                       l[:, None]],
    "take_along_axis": lambda lp, l: jnp.take_along_axis(
        lp, l[:, None], axis=1),
    "each_row_twice": lambda lp, l: lp[jnp.arange(lp.shape[0])[:, None],
                                       jnp.stack([l, (l + 1) % _CLASSES], 1)],
}


@pytest.mark.parametrize("name", sorted(_OWN_ROWS))
def test_rows_picked_with_their_own_labels_are_exact(name):
  """``logp[arange(B), labels]`` reads each example's own row with its own
  label: exact for the Gram and for clipped_grad."""
  x, labels = _label_data(50)
  body = _logits_picked(_OWN_ROWS[name])
  params, (_, _, grams) = _run(body, x, labels)
  plain = hk.without_apply_rng(hk.transform(body))
  assert_gram_close(grams.total, reference_gram(plain.apply, params, x,
                                                labels))
  flat = np.asarray(per_example_grads(plain.apply, params, x, labels),
                    np.float64)
  _, (grads, aux) = _clipped_run(body, x, labels)
  _assert_clipped_like_reference(grads, aux, flat, 1.0, params)


_PAIRED_WITH_OTHERS = {
    "rows_reversed": lambda lp, l: lp[jnp.arange(lp.shape[0])[::-1], l],
    "rows_rolled": lambda lp, l: lp[(jnp.arange(lp.shape[0]) + 1) % B, l],
    "outputs_reversed_first": lambda lp, l: lp[::-1][jnp.arange(B), l],
    "flat_index": lambda lp, l: lp.ravel()[
        jnp.arange(B)[::-1] * _CLASSES + l],
    "rows_by_data": lambda lp, l, idx: lp[idx, l],
    "rows_in_fortran_order": lambda lp, l: lp[
        jnp.arange(B).reshape(2, B // 2).ravel(order="F"), l],
    "every_row_sliced": lambda lp, l: jax.lax.gather(
        lp, jnp.stack([jnp.zeros_like(l), l], 1),
        jax.lax.GatherDimensionNumbers(offset_dims=(0,),
                                       collapsed_slice_dims=(1,),
                                       start_index_map=(0, 1)),
        (B, 1), mode="clip").sum(0),
    "windows_of_two_rows": lambda lp, l: jax.lax.gather(
        lp, jnp.stack([jnp.arange(B), l], 1),
        jax.lax.GatherDimensionNumbers(offset_dims=(1,),
                                       collapsed_slice_dims=(1,),
                                       start_index_map=(0, 1)),
        (2, 1), mode="clip"),
}


@pytest.mark.parametrize("name", sorted(_PAIRED_WITH_OTHERS))
def test_rows_picked_with_other_examples_labels_are_refused(name):
  """Output rows picked in another order than the labels' (in the index
  array itself) pair an example's outputs with another example's label: a
  teaching error from both transforms, never a number."""
  x, labels = _label_data(51)
  batch = (x, labels)
  if name == "rows_by_data":
    batch += (jnp.asarray(np.arange(B)[::-1]),)
  f = _tracked_transform(_logits_picked(_PAIRED_WITH_OTHERS[name]))
  params, state = f.init(jax.random.PRNGKey(0), *batch)
  with pytest.raises(ValueError, match="another example's data|not a sum"):
    jax.jit(gram_haiku.value_grad_and_gram(f.apply))(params, state, None,
                                                     *batch)
  with pytest.raises(ValueError, match="another example's data|reads data "
                     "of other examples|not a sum"):
    jax.jit(gram_haiku.clipped_grad(f.apply, 1.0))(params, state, None,
                                                   *batch)


def test_labels_reordered_inside_the_index_array():
  """``logp[arange(B), labels[::-1]]``: each example's outputs with another
  example's label. The Gram is over the model's input rows (labels are
  data), so it is exact; clipped_grad refuses it (another example's data)."""
  x, labels = _label_data(52)
  body = _logits_picked(lambda lp, l: lp[jnp.arange(lp.shape[0]), l[::-1]])
  params, (_, _, grams) = _run(body, x, labels)
  plain = hk.without_apply_rng(hk.transform(body))
  assert_gram_close(grams.total, reference_gram(
      lambda p, x, l: plain.apply(p, x, l[::-1]), params, x, labels[::-1]))
  with pytest.raises(ValueError, match="reads data of other examples"):
    _clipped_run(body, x, labels)


# Sums of per-example terms written through a cross-example operation that
# the check cannot prove separable, and truly coupled losses: refused, with
# the operation that first combined the examples named so that the user can
# rewrite it (each example's own term).
@pytest.mark.parametrize("loss,primitive", [
    (lambda out, y: jnp.trace(out[:, 0] @ out[:, 0].T), "dot_general"),
    (lambda out, y: jnp.sum((out.reshape(3, B * T) -
                             y.reshape(3, B * T)) ** 2), "reshape"),
    (lambda out, y: jnp.sum(jnp.convolve(out.sum((1, 2)),
                                         jnp.array([1., 2.]))),
     "conv_general_dilated"),
    (lambda out, y: jnp.sum(out) ** 2, "integer_pow"),
    # A batch softmax under stop_gradient is a weight (its reduce_max is not
    # where the loss couples the examples); the square of the mean is.
    (lambda out, y: jnp.sum(out.sum((1, 2)) * jax.lax.stop_gradient(
        jax.nn.softmax(out.sum((1, 2))))) + jnp.mean(out) ** 2,
     "integer_pow"),
], ids=["trace-of-output-gram", "reshape-alike", "convolve-losses",
        "square-of-sum", "weighted-then-square-of-mean"])
def test_a_loss_the_check_cannot_separate_names_where(loss, primitive):
  x, y = _data(5)
  with pytest.raises(ValueError, match=rf"not a sum(.|\n)*first combined by "
                     rf"{primitive} \(operands \("):
    _run(lambda x, y: loss(hk.Linear(3)(x), y), x, y)


@pytest.mark.parametrize("body", [
    # What the refusal above tells the user to write instead.
    lambda x, y: jnp.sum(hk.Linear(3)(x)[:, 0] ** 2),
    # complex() of a sum is linear in it: still a sum of per-example terms.
    lambda x, y: jnp.real(jax.lax.complex(
        *(2 * [jnp.sum(hk.Linear(3)(x) ** 2)]))),
], ids=["rewritten", "complex-of-sum"])
def test_the_rewritten_per_example_sum_is_exact(body):
  x, y = _data(6)
  params, (_, _, grams) = _run(body, x, y)
  plain = hk.without_apply_rng(hk.transform(body))
  assert_gram_close(grams.total, reference_gram(plain.apply, params, x, y))


def _loop_step(x_one, y_one):
  out = hk.Linear(2, name="o")(jnp.tanh(hk.Linear(3, name="l")(x_one)))
  return jnp.sum((out - y_one) ** 2)


def _looped(loop):
  """``loop(step, xs, ys)`` over the examples, with the layers made (and
  initialised) before the loop as hk.scan and hk.map need."""
  def body(x, y):
    lin, out = hk.Linear(3, name="l"), hk.Linear(2, name="o")
    out(lin(x[:1, 0]))
    step = lambda xe, ye: jnp.sum((out(jnp.tanh(lin(xe[None]))) - ye) ** 2)
    return jnp.sum(loop(step, x[:, 0], y[:, 0, :2]))
  return body


_scanned_examples = _looped(lambda step, xs, ys: hk.scan(
    lambda c, xy: (c, step(*xy)), 0.0, (xs, ys))[1])
_mapped_examples = _looped(
    lambda step, xs, ys: hk.map(lambda xy: step(*xy), (xs, ys)))
_scanned_examples.__name__ = "_scanned_examples"
_mapped_examples.__name__ = "_mapped_examples"


def _python_loop_over_examples(x, y):
  return sum(_loop_step(x[i:i + 1, 0], y[i, 0, :2]) for i in range(B))


_SCANNED = r"row\(s\) of a loop over the examples \(hk.scan or hk.map"


@pytest.mark.parametrize("body,diagnosis", [
    (_scanned_examples, _SCANNED), (_mapped_examples, _SCANNED),
    (_python_loop_over_examples, "reordered, repeated or a subset")],
                         ids=["scan", "map", "python"])
def test_a_loop_over_the_examples_is_refused_with_the_vmap_advice(
    body, diagnosis):
  x, y = _data(7, out=2)
  with pytest.raises(ValueError, match=f"{diagnosis}(.|\n)*map the "
                     "per-example code with hk.vmap instead"):
    _run(body, x, y)


def test_the_same_per_example_code_under_hk_vmap_is_exact():
  x, y = _data(8, out=2)
  body = lambda x, y: jnp.sum(hk.vmap(_loop_step, split_rng=False)(
      x[:, 0], y[:, 0]))
  params, (_, _, grams) = _run(body, x, y)
  plain = hk.without_apply_rng(hk.transform(body))
  assert_gram_close(grams.total, reference_gram(plain.apply, params, x, y))


# -- a batch of one --------------------------------------------------------
# At B = 1 JAX takes size-1 special cases (take_along_axis gathers without
# batching dimensions), which read as the examples mixed; with one example
# nothing can couple, so the losses are exact, while a layer whose input
# holds the example along another axis is still refused.


def _xent_take_along_axis(logits, y):
  logp = jax.nn.log_softmax(logits)
  return -jnp.sum(jnp.take_along_axis(logp, y[..., None], axis=-1))


def _xent_optax(logits, y):
  import optax
  return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _squared_total(logits, y):  # (sum_i l_i)^2: a sum of one term at B = 1
  return _xent_take_along_axis(logits, y) ** 2


_ONE_EXAMPLE_LOSSES = {"take_along_axis": _xent_take_along_axis,
                       "optax_integer_labels": _xent_optax,
                       "square_of_the_sum": _squared_total}


def _one_example_net(loss_of_logits):
  def net(x, y):
    h = jnp.tanh(hk.Linear(8)(x))
    return loss_of_logits(hk.Linear(5)(h), y)
  return net


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("loss", sorted(_ONE_EXAMPLE_LOSSES))
def test_a_batch_of_one_is_exact_whatever_the_loss(loss, per_token):
  net = _one_example_net(_ONE_EXAMPLE_LOSSES[loss])
  k1, k2 = jax.random.split(jax.random.PRNGKey(3))
  shape = (1, T) if per_token else (1,)
  x = problems.normal(k1, shape + (F,))
  y = problems.randint(k2, shape, 0, 5)
  f = _tracked_transform(net)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  plain = hk.without_apply_rng(hk.transform(net))
  ref = reference_gram(plain.apply, params, x, y)
  assert grams.total.shape == (1, 1) and float(ref[0, 0]) > 0
  assert_gram_close(grams.total, ref)
  # Clipped at half its norm: the gradient scaled by one half.
  norm = float(np.sqrt(ref[0, 0]))
  grads, aux = jax.jit(gram_haiku.clipped_grad(f.apply, norm / 2))(
      params, state, None, x, y)
  want = jax.tree.map(lambda g: g / 2,
                      jax.jit(jax.grad(plain.apply))(params, x, y))
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
  chex.assert_trees_all_close(grads, want, rtol=RTOL_F32,
                              atol=ATOL_F32 * scale)
  assert float(aux.fraction_clipped) == 1


def test_vmap_over_single_examples_gives_the_gram_diagonal():
  # jax.vmap of value_grad_and_gram over examples, one at a time (each a
  # batch of one inside): the 1x1 Grams are the full Gram's diagonal.
  net = _one_example_net(_xent_take_along_axis)
  k1, k2 = jax.random.split(jax.random.PRNGKey(4))
  x = problems.normal(k1, (B, F))
  y = problems.randint(k2, (B,), 0, 5)
  f = _tracked_transform(net)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  vgg = gram_haiku.value_grad_and_gram(f.apply)
  _, _, one = jax.jit(jax.vmap(
      lambda xi, yi: vgg(params, state, None, xi[None], yi[None])))(x, y)
  plain = hk.without_apply_rng(hk.transform(net))
  ref = reference_gram(plain.apply, params, x, y)
  np.testing.assert_allclose(np.asarray(one.total)[:, 0, 0], np.diag(ref),
                             rtol=1e-5)


def test_a_batch_of_one_still_checks_the_example_axis():
  # Time-major: the layer's axis 0 holds the T positions, not the example.
  x = problems.normal(jax.random.PRNGKey(5), (1, T, F))
  y = problems.normal(jax.random.PRNGKey(6), (1, T, 3))
  with pytest.raises(ValueError, match="example axis"):
    _run(_time_major, x, y)


def _batch_term_in_every_loss(x, y):  # (l_i + c).sum(), c a batch mean
  out = hk.Linear(3)(x)
  per = jnp.sum((out - y) ** 2, axis=(1, 2))
  return jnp.sum(per + 0.1 * jnp.mean(out ** 2))


def _batch_term_once(x, y):  # the same total, the batch term added once
  out = hk.Linear(3)(x)
  per = jnp.sum((out - y) ** 2, axis=(1, 2))
  return jnp.sum(per) + 0.1 * x.shape[0] * jnp.mean(out ** 2)


def test_a_batch_term_in_every_loss_is_refused_with_the_rewrite():
  x, y = _data(8)
  with pytest.raises(ValueError, match=r"batch-wide term added to every "
                     r"example's\s+loss"):
    _run(_batch_term_in_every_loss, x, y)
  params, (_, _, grams) = _run(_batch_term_once, x, y)
  plain = hk.without_apply_rng(hk.transform(_batch_term_in_every_loss))
  # Per example (a batch of one), both forms are l_i + 0.1 mean(out_i^2).
  assert_gram_close(grams.total, reference_gram(plain.apply, params, x, y))
