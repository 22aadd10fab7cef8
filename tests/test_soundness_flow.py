"""Soundness of the example-flow check behind ``clipped_grad``: what the
analysis cannot prove to be one example's is refused, never taken as safe.

Four classes of values that escaped it (each gave a silently wrong clipped
sum, one example moving it by more than ``C``): a ``while_loop`` whose
number of rounds reads several examples; data the loss closes over rather
than takes as arguments; a legacy PRNG key taken for batch data (its size
2 set the batch size); and false refusals whose messages did not say what
to do. Each accepted case is checked against ``vmap(grad)`` (or the
Jacobian of the per-example losses, where the batch shares a dropout draw)
in float64, each refused one by a stable part of its message.
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

_REFUSED_DATA = "reads data of other examples"
_CLOSED = "closes over"
_LOOP = "number of rounds depends on"


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


def _model(pre=lambda x: x, head=lambda out, y: (out - y) ** 2):
  """``sum_i head(Linear(pre(x))_i, y_i)``, the tracked and plain
  transforms."""
  def body(x, y):
    out = hk.Linear(O, name="head")(pre(x))
    return jnp.sum(head(out, y))

  def tracked(x, y):
    with gram_haiku.track():
      return body(x, y)
  return (hk.transform_with_state(tracked),
          hk.without_apply_rng(hk.transform(body)))


def _clipped(f, *batch, rng=None, **kw):
  params, state = f.init(jax.random.PRNGKey(0), *batch)
  return params, gram_haiku.clipped_grad(f.apply, C, **kw)(
      params, state, rng, *batch)


# -- 1. while loops whose number of rounds reads the examples ----------------


def _halve_until_batch_max(x):
  return jax.lax.while_loop(lambda v: jnp.max(jnp.abs(v)) > 1.0,
                            lambda v: v / 2.0, x)


def _fori_to_a_batch_count(x):
  return jax.lax.fori_loop(0, jnp.sum(x > 1.0), lambda i, v: v * 0.5, x)


def _stop_on_example_0(x):
  return jax.lax.while_loop(lambda v: jnp.abs(v[0, 0]) > 1.0,
                            lambda v: v * 0.5, x)


def _count_to_a_batch_count(x):
  def body(c):
    return c[0] * 0.9, c[1] + 1
  return jax.lax.while_loop(lambda c: c[1] < jnp.sum(x > 0.0), body,
                            (x, 0))[0]


def _scale_chosen_by_example_0(x):
  scale = jax.lax.cond(x[0, 0] > 0.0, lambda: 0.5, lambda: 2.0)
  return x * scale


@pytest.mark.parametrize("pre", [
    _halve_until_batch_max, _fori_to_a_batch_count, _stop_on_example_0,
    _count_to_a_batch_count, _scale_chosen_by_example_0,
], ids=lambda f: f.__name__)
def test_rounds_decided_by_several_examples_are_refused(pre):
  x, y = _data(0)
  f, _ = _model(pre)
  with pytest.raises(ValueError, match=_REFUSED_DATA):
    _clipped(f, x, y)
  # The Gram does not care whose data an input is computed from: exact.
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state,
                                                        None, x, y)
  _, plain = _model()  # the input computed once, for the whole batch
  flat = _rows(plain.apply, params, np.asarray(pre(x)), y)
  np.testing.assert_allclose(grams.total, flat @ flat.T, rtol=RTOL,
                             atol=RTOL * np.abs(flat @ flat.T).max())


def test_a_coupled_loop_is_named_in_the_refusal():
  x, y = _data(1)
  f, _ = _model(_count_to_a_batch_count)
  with pytest.raises(ValueError, match=_LOOP):
    _clipped(f, x, y)


def _halve_each_until_its_max(x):
  return jax.vmap(_halve_until_batch_max)(x)  # per row: its own max


def _count_each_to_its_own(x):
  def one(r):
    def body(c):
      return c[0] * 0.9, c[1] + 1
    return jax.lax.while_loop(lambda c: c[1] < jnp.sum(r > 0.0), body,
                              (r, 0))[0]
  return jax.vmap(one)(x)


@pytest.mark.parametrize("pre", [_halve_each_until_its_max,
                                 _count_each_to_its_own],
                         ids=lambda f: f.__name__)
def test_a_per_example_loop_under_vmap_is_exact(pre):
  """Batched, a while_loop runs until every row stops, but a row that has
  stopped keeps its value: each example's result is its own."""
  x, y = _data(2)
  f, plain = _model(pre)
  params, (grads, _) = _clipped(f, x, y)
  flat = _rows(lambda p, xi, yi: plain.apply(p, xi, yi), params, x, y)
  _assert_clipped(grads, flat, params)


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


def _closed_over(kind, x, y):
  """A transform whose loss reads ``y`` (or ``x``) closed over."""
  if kind.startswith("inputs"):
    xc = jnp.asarray(x) if kind == "inputs-jax" else x

    def loss(y):
      with gram_haiku.track():
        out = hk.Linear(O, name="head")(xc)
      return jnp.sum((out - y) ** 2)
    return hk.transform_with_state(loss), (y,)
  yc = {"labels-numpy": y, "labels-jax": jnp.asarray(y),
        "labels-centred": y - y.mean(0),
        "labels-int": np.argmax(y, -1).astype(np.int32)}[kind]

  def loss(x):
    with gram_haiku.track():
      out = hk.Linear(O, name="head")(x)
    if kind == "labels-int":
      logp = jax.nn.log_softmax(out)
      return -jnp.sum(jnp.take_along_axis(logp, yc[:, None], axis=1))
    return jnp.sum((out - yc) ** 2)
  return hk.transform_with_state(loss), (x,)


_CLOSED_KINDS = ["labels-numpy", "labels-jax", "labels-centred",
                 "labels-int", "inputs-numpy", "inputs-jax"]


@pytest.mark.parametrize("kind", _CLOSED_KINDS)
def test_closed_over_batch_data_is_refused(kind):
  x, y = _data(4)
  f, batch = _closed_over(kind, x, y)
  with pytest.raises(ValueError, match=_CLOSED) as e:
    _clipped(f, *batch)
  assert "example_axes" in str(e.value)


def test_one_hot_of_closed_over_integer_labels_is_refused():
  x, y = _data(5)
  labels = np.argmax(y, -1).astype(np.int32)

  def loss(x):
    with gram_haiku.track():
      out = hk.Linear(O, name="head")(x)
    return jnp.sum((out - jax.nn.one_hot(labels, O)) ** 2)
  with pytest.raises(ValueError, match=_CLOSED):
    _clipped(hk.transform_with_state(loss), x)


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
    params, state = f.init(jax.random.PRNGKey(0), arg)
    return gram_haiku.clipped_grad(f.apply, C)(params, state, None, arg)[0]
  with pytest.raises(ValueError, match=_CLOSED):
    step(x, y)


def test_the_same_data_passed_as_arguments_is_exact():
  x, y = _data(7)
  f, plain = _model()
  params, (grads, _) = _clipped(f, x, y)
  _assert_clipped(grads, _rows(plain.apply, params, x, y), params)
  # And the centred labels, as arguments, keep their own refusal.
  g, _ = _model(head=lambda out, y: (out - (y - y.mean(0))) ** 2)
  with pytest.raises(ValueError, match=_REFUSED_DATA):
    _clipped(g, x, y)


def test_small_closed_over_constants_stay_constants():
  """A scale, a fixed projection and per-class weights (no axis of the
  batch's size), and index arrays (np.arange(B), a fixed permutation)
  that pick rows: exact."""
  x, y = _data(8)
  proj = np.random.RandomState(9).randn(F, F).astype(np.float32)
  class_w = np.array([0.5, 2.0], np.float32)
  perm = np.array([2, 0, 1, 5, 3, 4])

  def body(x, y):
    h = (x @ proj) * np.float32(0.5)
    out = hk.Linear(O, name="head")(h)
    l = jnp.sum(class_w * (out[perm] - y[perm]) ** 2, -1)
    return jnp.sum(l[np.arange(B)])

  def tracked(x, y):
    with gram_haiku.track():
      return body(x, y)
  f = hk.transform_with_state(tracked)
  plain = hk.without_apply_rng(hk.transform(
      lambda x, y: jnp.sum(class_w * (
          hk.Linear(O, name="head")((x @ proj) * 0.5) - y) ** 2)))
  params, (grads, _) = _clipped(f, x, y)
  _assert_clipped(grads, _rows(plain.apply, params, x, y), params)


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
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  grads, _ = gram_haiku.clipped_grad(f.apply, C)(params, state, None, x, y)
  plain = hk.transform_with_state(body)
  ema = {m: v for m, v in state.items() if "gram_probe" not in v}
  flat = _rows(lambda p, xi, yi: plain.apply(p, ema, None, xi, yi)[0],
               params, x, y)
  _assert_clipped(grads, flat, params)


def test_labels_picked_by_a_closed_over_arange_are_exact():
  x, y = _data(10)
  labels = np.argmax(y, -1).astype(np.int32)

  def body(x, labels):
    logp = jax.nn.log_softmax(hk.Linear(O, name="head")(x))
    return -jnp.sum(logp[np.arange(len(labels)), labels])

  def tracked(x, labels):
    with gram_haiku.track():
      return body(x, labels)
  f = hk.transform_with_state(tracked)
  plain = hk.without_apply_rng(hk.transform(body))
  params, (grads, _) = _clipped(f, x, labels)
  flat = _rows(plain.apply, params, x, labels)
  _assert_clipped(grads, flat, params)


def test_a_table_of_batch_rows_passed_with_example_axes_none():
  """The fix the refusal teaches for a constant that merely has B rows."""
  x, y = _data(11)
  table = np.random.RandomState(12).randn(B, F).astype(np.float32)

  def body(x, y, table):
    h = jnp.tanh(x @ table.T)  # (B, B): every example reads the table
    return jnp.sum((hk.Linear(O, name="head")(h) - y) ** 2)

  def tracked(x, y, table):
    with gram_haiku.track():
      return body(x, y, table)
  f = hk.transform_with_state(tracked)
  closed = hk.transform_with_state(lambda x, y: tracked(x, y, table))
  with pytest.raises(ValueError, match=_CLOSED):
    _clipped(closed, x, y)
  params, state = f.init(jax.random.PRNGKey(0), x, y, table)
  grads, _ = gram_haiku.clipped_grad(f.apply, C, example_axes=(0, 0, None))(
      params, state, None, x, y, table)
  plain = hk.without_apply_rng(hk.transform(
      lambda x, y: body(x, y, table)))
  _assert_clipped(grads, _rows(plain.apply, params, x, y), params)


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
  params, state = f.init(jax.random.PRNGKey(0), x, y)
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
  params, state = f.init(jax.random.PRNGKey(0), x, y)
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
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, rng,
                                                        x, y)
  np.testing.assert_allclose(grams.total, flat @ flat.T, rtol=RTOL,
                             atol=RTOL * np.abs(flat @ flat.T).max())


@pytest.mark.parametrize("axes", [None, (0, 0)])
def test_without_apply_rng_the_first_argument_is_batch_data(axes):
  x, y = _data(18)
  f, plain = _model()
  f = hk.without_apply_rng(f)
  params, state = f.init(jax.random.PRNGKey(0), x, y)
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
  params, state = f.init(jax.random.PRNGKey(0), x, memory)
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
  params, state = f.init(jax.random.PRNGKey(0), x, y)

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


def test_views_of_an_example_split_by_a_reshape():
  """Augmentation multiplicity on the flat (B K) batch: taken as B K
  examples each view would be clipped alone (K C per example), so it is
  refused, with the rewrite that is exact: the layers on (B, K, F)."""
  b, k = 4, 3
  rng = np.random.RandomState(23)
  x = rng.randn(b * k, F).astype(np.float32)
  y = rng.randn(b, O).astype(np.float32)

  def head(h):
    return hk.Linear(O, name="head")(jnp.tanh(hk.Linear(4, name="first")(h)))

  def flat_views(x, y):
    with gram_haiku.track():
      out = head(x)
    return jnp.sum((out.reshape(b, k, O) - y[:, None]) ** 2)
  f = hk.transform_with_state(flat_views)
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match=r"split the examples' axis of 12 "
                     r"rows into \(4, 3\)"):
    gram_haiku.clipped_grad(f.apply, C)(params, state, None, x, y)

  def grouped(xv, y):
    with gram_haiku.track():
      out = head(xv)
    return jnp.sum((out - y[:, None]) ** 2)
  g = hk.transform_with_state(grouped)
  xv = x.reshape(b, k, F)
  grads, _ = gram_haiku.clipped_grad(g.apply, C)(params, state, None, xv, y)
  plain = hk.without_apply_rng(hk.transform(
      lambda xv, y: jnp.sum((head(xv) - y[:, None]) ** 2)))
  _assert_clipped(grads, _rows(plain.apply, params, xv, y), params)


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
  params, state = f.init(jax.random.PRNGKey(0), x, y)
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
