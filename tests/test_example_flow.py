"""The examples followed through the traced program, by class.

A layer input that does not carry the examples along the op's example axis,
one that merges them with other positions, a batch statistic between
tracked layers and a loss that couples the examples are each a teaching
error at any size; models where the examples flow as a Gram needs (shared
inputs broadcast over the batch, statistics of the input data, attention,
recurrences, stacks) are exact against the reference.

Each program that is only "this program -> this verdict" is a row of the
interpreter's corpus (``tests/interpreter_corpus.py``, run under ``jit`` by
``tests/test_interpreter_corpus.py``); the tests here make finer
assertions (the refusals without ``jit``, named and norms-only ``hk.vmap``
axes, ``reweighted_grad``, ``verify``, warnings and messages that name the
user's line, a batch of one).
"""

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
# (A refused model may read a parameter no rule covers: its warning is
# expected here, the refusal is what is tested.)
@pytest.mark.filterwarnings("ignore::gram_haiku.UntrackedParameterWarning")
def test_refused_at_any_size(body, match):
  # Without jit (the corpus's rows of the same programs run under it).
  x, y = _data(0)
  with pytest.raises(ValueError, match=match):
    _run(body, x, y, jit=False)


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
    # The memory rows (a bare parameter, "~/memory") are left out of the
    # reference too: untracked="ignore" says so.
    with gram_haiku.track(mode=mode, untracked="ignore", **kw):
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
    # The memory rows are frozen below: no gradient, so neither an
    # untracked error nor a warning, even under untracked="error".
    with gram_haiku.track(untracked="error"):
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


def test_a_layer_on_a_memory_argument_of_another_size_is_refused():
  # Keys computed by a tracked layer from a (6, F) memory given as an
  # argument next to a batch of 4 (closed over: the corpus's
  # layer_on_a_memory_of_another_size): the sizes differ, and the error
  # names them and says to broadcast the memory.
  x, y = _data(23)
  memory = problems.normal(jax.random.PRNGKey(24), (6, F))

  def as_argument(x, m, y):
    q = hk.Linear(3, name="q")(x)
    k = hk.Linear(3, name="k")(m)
    return _sq(jax.nn.softmax(q @ k.T) @ k, y)
  f = _tracked_transform(as_argument)
  params, state = f.init(jax.random.PRNGKey(0), x, memory, y)
  with pytest.raises(ValueError, match=r"(?s)'k': 6.*broadcast"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, memory,
                                            y)


def _after(reorder_out, reorder_y=lambda y: y):
  """A model whose loss reorders the last layer's rows and/or the labels'."""
  def body(x, y):
    out = hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))
    return 0.5 * jnp.sum((reorder_out(out) - reorder_y(y)) ** 2)
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
def test_outputs_reordered_against_the_data_are_refused_for_reweighting(name):
  # Each loss term reads the outputs of one example and the labels of
  # another: the Gram by the inputs' rows and the Gram by the terms' rows
  # differ, and neither is the batch's (was silent: the first, rel. err.
  # 0.9 against rows of jacrev of the terms). The Gram's and clipped_grad's
  # refusals are the corpus's outputs_paired_* rows; reweighted_grad's too.
  x, y = _data(27)
  body = _after(*_OUTPUTS_PAIRED_WITH_OTHERS_DATA[name])
  f = _tracked_transform(body)
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  reweighted = gram_haiku.reweighted_grad(f.apply, lambda g: g.norms)
  with pytest.raises(ValueError, match="another example's data"):
    reweighted(params, state, None, x, y)


def _through(fn):
  def body(x, y):
    h = jnp.tanh(hk.Linear(F, name="first")(x))
    return _sq(hk.Linear(3, name="second")(fn(h)), y)
  return body


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


# -- a primitive without a rule --------------------------------------------------


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


# A helper called twice holds the same program (and variables) in both
# calls: what it reads in each call must be told apart.
_TAKE = jax.jit(lambda a, p: a[p])


def _taken_by_data_indices(x, y, p, q):
  out = hk.Linear(3, name="head")(jnp.tanh(hk.Linear(F, name="first")(x)))
  return 0.5 * jnp.sum((_TAKE(out, p) - _TAKE(y, q)) ** 2)


def _clipped_run(body, *batch, c_norm=1.0):
  f = _tracked_transform(body)
  params, state = f.init(jax.random.PRNGKey(0), *batch)
  return params, jax.jit(gram_haiku.clipped_grad(f.apply, c_norm))(
      params, state, None, *batch)


def test_data_index_arrays_through_a_helper_are_refused():
  x, y = _data(43)
  p = jnp.arange(B)
  for q in (jnp.roll(p, 1), p):  # (p with itself: indices are data)
    with pytest.raises(ValueError, match="reads data of other examples"):
      _clipped_run(_taken_by_data_indices, x, y, p, q)


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
