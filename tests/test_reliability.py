"""No silently wrong Gram: classes of models that must be exact or refused.

Each test draws random inputs and compares with the reference ``F @ F.T``
(:mod:`gram_haiku._src.core.reference`), or checks the teaching error.
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
from gram_haiku._src.core import errors
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import jacobian_gram
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import weighted_sum
from gram_haiku._src.passes import pass_pipeline
from tests import problems


_data = problems.data
_sq = problems.sq


def _transforms(body):
  def tracked(*a):
    with gram_haiku.track():
      return body(*a)
  return (hk.transform_with_state(tracked),
          hk.without_apply_rng(hk.transform(body)))


@functools.lru_cache(maxsize=None)
def _tracked_init(body):
  """``body``'s tracked transform and its jitted init, made once per
  process (for the tests that run one model in several ways)."""
  f, _ = _transforms(body)
  return f, jax.jit(f.init)


# -- nested track() contexts ---------------------------------------------------


def test_nested_track_inner_options_apply_and_no_false_warnings():
  x, y = _data(0, (5, 6), 3)
  def body(x, y, tracked):
    outer = hk.Linear(4, name="outer")
    inner = hk.Linear(3, name="inner")
    if not tracked:
      return _sq(inner(jnp.tanh(outer(x))), y)
    with gram_haiku.track():
      h = jnp.tanh(outer(x))
      with gram_haiku.track(mode="norms"):
        return _sq(inner(h), y)
  f = hk.transform_with_state(lambda x, y: body(x, y, True))
  g = hk.without_apply_rng(hk.transform(lambda x, y: body(x, y, False)))
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # no UntrackedParameterWarning
    params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
    _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, x, y)
  assert sorted(grams.by_layer) == ["outer"]
  assert sorted(grams.sq_norms_by_layer) == ["inner"]
  assert grams.complete
  ref = reference_gram(g.apply, params, x, y)
  np.testing.assert_allclose(grams.sq_norms, np.diag(ref), rtol=1e-4)
  ref_outer = reference_gram(
      lambda p, x, y: g.apply({**params, "outer": p}, x, y), params["outer"],
      x, y)
  assert_gram_close(grams.by_layer["outer"], ref_outer)


# -- inference and plain gradients of a model with shared modules ------------


def _twice(x, y):
  lin = hk.Linear(4)
  return _sq(jnp.tanh(lin(x)) + lin(x ** 2 / 5), y)


def _rnn(x, y):
  core = hk.VanillaRNN(4)
  out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1),
                             core.initial_state(x.shape[0]))
  return _sq(jnp.swapaxes(out, 0, 1), y)


@pytest.mark.parametrize("body", [_twice, _rnn], ids=["called_twice", "rnn"])
def test_shared_modules_run_forward_and_plain_grad(body):
  x, y = _data(1, (4, 3, 6), 4)
  f, g = _transforms(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  out, _ = jax.jit(f.apply)(params, state, None, x, y)
  np.testing.assert_allclose(out, g.apply(params, x, y), rtol=1e-6)
  grads = jax.jit(jax.grad(lambda p: f.apply(p, state, None, x, y)[0]))(
      params)
  chex.assert_trees_all_close(grads,
                              jax.jit(jax.grad(g.apply))(params, x, y),
                              rtol=1e-5, atol=1e-6)
  # The raw path cannot accumulate per-example gradients: an error, only
  # when the probes are differentiated.
  sized = gram_haiku.resize_probes(state, x.shape[0])
  with pytest.raises(ValueError, match="more than once|loop body"):
    jax.grad(lambda s: f.apply(params, s, None, x, y)[0])(sized)
  # value_grad_and_gram accumulates them: exact.
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))


# -- higher-order differentiation ----------------------------------------------


def _penalty(x, y, with_loss=True):
  mlp = hk.nets.MLP([5, 3], activation=jnp.tanh)
  gx = jax.grad(lambda xx: jnp.sum(mlp(xx)))(x)
  penalty = jnp.sum(gx ** 2)
  return (_sq(mlp(x), y) + penalty) if with_loss else penalty


@pytest.mark.parametrize("jit", [False, True])
# (Before the refusal, the example flow warns that it does not model the
# add_any of the penalty's backward pass.)
@pytest.mark.filterwarnings("ignore::gram_haiku.ExampleFlowWarning")
def test_gradient_penalty_through_tracked_layers_is_refused(jit):
  x, y = _data(2, (4, 6), 3)
  f, _ = _transforms(_penalty)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  fn = jax.jit(fn) if jit else fn
  with pytest.raises(ValueError, match="differentiated inside"):
    fn(params, state, None, x, y)  # found in the traced program
  sized = gram_haiku.resize_probes(state, x.shape[0])
  with pytest.raises(ValueError, match="differentiated inside"):
    jax.grad(lambda s: f.apply(params, s, None, x, y)[0])(sized)


def test_penalty_alone_names_the_layers():
  x, y = _data(3, (4, 6), 3)
  f, _ = _transforms(lambda x, y: _penalty(x, y, with_loss=False))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="none of those layers is applied"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)


def _tangent_prop(x, y, with_loss=True):
  mlp = hk.nets.MLP([5, 3], activation=jnp.tanh)
  out, tangent = jax.jvp(mlp, (x,), (jnp.ones_like(x),))
  penalty = jnp.sum(tangent ** 2)
  return (_sq(mlp(x) if with_loss else out, y) + penalty)


@pytest.mark.parametrize("with_loss", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_forward_mode_through_tracked_layers_is_exact_or_refused(with_loss,
                                                               jit):
  # Tangent propagation: jax.jvp of the tracked model inside the loss. The
  # layers run as their plain computation there (was a silently zero Gram
  # on the raw path). With the model also applied outside the jvp, the
  # tangent path's products of its weights are program-level sites of the
  # tracked leaves (their per-example gradients added to the layers'), so
  # the Gram is the reference's; with the model only inside the jvp no
  # tracked layer is applied, which is refused.
  x, y = _data(12, (4, 6), 3)
  f, _ = _transforms(lambda x, y: _tangent_prop(x, y, with_loss))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  fn = jax.jit(fn) if jit else fn
  plain = hk.without_apply_rng(hk.transform(
      lambda x, y: _tangent_prop(x, y, with_loss)))
  if with_loss:
    _, _, grams = fn(params, state, None, x, y)
    assert grams.complete
    flat = np.asarray(per_example_grads(plain.apply, params, x, y),
                      np.float64)
    assert_gram_close(grams.total, flat @ flat.T)
  else:
    with pytest.raises(ValueError, match="jax.jvp|outside every tracked"):
      fn(params, state, None, x, y)
  sized = gram_haiku.resize_probes(state, x.shape[0])
  raw = jax.grad(lambda s: f.apply(params, s, None, x, y)[0])
  raw = jax.jit(raw) if jit else raw
  with pytest.raises(ValueError, match="differentiated in forward mode"):
    raw(sized)
  # The parameters' own derivatives are JAX's, as untracked.
  g = jax.grad(lambda p: f.apply(p, state, None, x, y)[0])(params)
  chex.assert_trees_all_close(g, jax.jit(jax.grad(plain.apply))(params, x, y),
                              rtol=1e-5, atol=1e-6)


def test_hessian_of_a_tracked_loss_still_works():
  x, y = _data(4, (3, 4), 2)
  f, g = _transforms(lambda x, y: _sq(jnp.tanh(hk.Linear(2)(x)), y))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  h = jax.hessian(lambda p: f.apply(p, state, None, x, y)[0])(params)
  want = jax.jit(jax.hessian(lambda p: g.apply(p, x, y)))(params)
  chex.assert_trees_all_close(h, want, rtol=1e-5, atol=1e-6)


# -- empty batches ----------------------------------------------------------------


def _conv(x, y):
  h = hk.Conv1D(3, 2)(x)
  return _sq(hk.Linear(2)(h.reshape(h.shape[0], 15)), y)  # 5 x 3 per example


def _embed(ids, y):
  h = hk.Embed(7, 3)(ids)
  return _sq(hk.LayerNorm(-1, True, True)(h).sum(1), y)


def _shared_twice(x, y):
  lin = hk.Linear(6)
  return _sq(lin(jnp.tanh(lin(x)))[:, :3], y)


def _lstm_unrolled(x, y):
  core = hk.LSTM(3)
  out, _ = hk.dynamic_unroll(core, jnp.stack([x, -x]),
                             core.initial_state(x.shape[0]))
  return _sq(out[-1], y)


@pytest.mark.parametrize("body", [_shared_twice, _lstm_unrolled],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("clipping", [None, "all-layer", "per-layer"])
def test_empty_batch_of_shared_modules_and_clipping(body, clipping):
  # Poisson sampling draws B = 0 now and then: zero gradients, empty Grams.
  x, y = _data(6, (4, 6), 3)
  f, init = _tracked_init(body)
  params, state = init(jax.random.PRNGKey(0), x, y)
  if clipping is None:
    _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, x[:0], y[:0])
    assert grams.total.shape == (0, 0) and grams.norms.shape == (0,)
  else:
    grads, aux = jax.jit(gram_haiku.clipped_grad(
        f.apply, 1.0, clipping=clipping))(params, state, None, x[:0], y[:0])
    assert aux.grad_norms.shape == (0,)
  for leaf in jax.tree.leaves(grads):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


@pytest.mark.parametrize("name", ["mlp", "conv", "embed"])
@pytest.mark.parametrize("jit", problems.JIT_CASES)
def test_empty_batch_gives_empty_grams_and_zero_grads(name, jit):
  key = jax.random.PRNGKey(5)
  if name == "embed":
    x = problems.randint(key, (4, 5), 0, 7)
    y = problems.normal(key, (4, 3))
    body = _embed
  elif name == "conv":
    x, y = problems.normal(key, (4, 5, 2)), problems.normal(key, (4, 2))
    body = _conv
  else:
    x, y = _data(5, (4, 6), 3)
    body = lambda x, y: _sq(hk.nets.MLP([5, 3])(x), y)
  f, _ = _transforms(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  fn = jax.jit(fn) if jit else fn
  value, grads, grams = fn(params, state, None, x[:0], y[:0])
  assert float(value) == 0.0
  assert grams.total.shape == (0, 0) and grams.norms.shape == (0,)
  for leaf in jax.tree.leaves(grads):
    np.testing.assert_array_equal(leaf, np.zeros_like(leaf))


# -- probe dtype follows the parameters at apply ----------------------------


def test_probe_dtype_follows_float64_parameters():
  with jax.enable_x64(True):
    ids = problems.randint(jax.random.PRNGKey(6), (4, 5), 0, 7)
    y = problems.normal(jax.random.PRNGKey(7), (4, 3), jnp.float64)
    f, g = _transforms(lambda i, y: _sq(hk.Embed(7, 3)(i).sum(1), y))
    params, state = jax.jit(f.init)(jax.random.PRNGKey(0), ids, y)
    assert jax.tree.leaves(params)[0].dtype == jnp.float32  # Haiku's table
    params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                          ids, y)
    assert grams.total.dtype == jnp.float64
    ref = reference_gram(g.apply, params, ids, y)
    np.testing.assert_allclose(grams.total, ref, rtol=1e-10,
                               atol=1e-12 * np.abs(ref).max())


# -- masked rows whose inputs overflow the ghost kernel ---------------------


@pytest.mark.parametrize("shape", [(5, 3), (5, 4, 3)])
@pytest.mark.parametrize("mode", ["gram", "norms"])
def test_masked_rows_with_huge_inputs_have_zero_gradient(mode, shape):
  # (x_i . x_i) overflows float32 for a sentinel-filled padding row, whose
  # cotangent is 0: the ghost product was inf * 0 = NaN (one position, and
  # a sequence's (t, s) kernel blocks).
  x, y = _data(11, shape, 2)
  valid = jnp.array([1., 1., 0., 1., 0.])

  def loss(x, y, v):
    mask = v.reshape(v.shape + (1,) * (len(shape) - 1))
    h = jnp.tanh(hk.Linear(4, name="l1")(jnp.where(mask > 0, x, 1e20)))
    per = 0.5 * jnp.sum((hk.Linear(2, name="l2")(h) - y) ** 2, -1)
    return jnp.sum(jnp.where(mask[..., 0] > 0, per, 0.0))
  def tracked(x, y, v):
    with gram_haiku.track(mode=mode, strategy="ghost"):
      return loss(x, y, v)
  f = hk.transform_with_state(tracked)
  g = hk.without_apply_rng(hk.transform(loss))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y, valid)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                        x, y, valid)
  ref = reference_gram(g.apply, params, x, y, valid)
  assert np.all(np.isfinite(ref))
  if mode == "gram":
    assert_gram_close(grams.total, ref)
  else:
    np.testing.assert_allclose(grams.norms, np.sqrt(np.diag(ref)), rtol=1e-5)
  assert np.all(np.asarray(grams.norms)[[2, 4]] == 0)


# -- complex operands --------------------------------------------------------


def _complex(key, shape):
  k1, k2 = jax.random.split(key)
  return (problems.normal(k1, shape) +
          1j * problems.normal(k2, shape)).astype(jnp.complex64)


_COMPLEX_TABLE = _complex(jax.random.PRNGKey(12), (5, 2))
_COMPLEX_LAYERS = {
    # Haiku creates each layer's parameters in its input's dtype.
    "linear": (lambda x: hk.Linear(2)(x), (4, 3)),
    "conv": (lambda x: hk.Conv1D(2, 3)(x), (4, 5, 3)),
    "layer_norm": (lambda x: hk.LayerNorm(-1, True, True)(x)[..., :2],
                   (4, 3)),
    # A complex table looked up by (integer) ids.
    "embed": (lambda x: hk.Embed(embedding_matrix=np.asarray(
        _COMPLEX_TABLE))(jnp.argmax(jnp.real(x), -1)), (4, 3)),
    # Real parameters, complex input.
    "real_weights": (lambda x: hk.Linear(2, name="real")(x) + hk.get_state(
        "zero", (), init=jnp.zeros), (4, 3)),
}


@pytest.mark.parametrize("name", sorted(_COMPLEX_LAYERS))
@pytest.mark.parametrize("use", ["gram", "norms", "clip"])
def test_complex_operands_are_refused_and_inference_still_works(name, use):
  # Their Gram rules take no conjugates: the Gram and the clipped sum were
  # silently wrong (relative error 0.8 and 0.6 for one hk.Linear).
  layer, shape = _COMPLEX_LAYERS[name]
  x = _complex(jax.random.PRNGKey(8), shape)
  y = problems.normal(jax.random.PRNGKey(9), shape[:-1] + (2,))

  def losses(x, y):
    return jnp.sum(jnp.abs(layer(x) - y) ** 2, axis=-1)
  def tracked(x, y):
    with gram_haiku.track(mode="norms" if use == "norms" else "gram"):
      return jnp.sum(losses(x, y))
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  if name == "real_weights":
    params = jax.tree.map(jnp.real, params)
  plain = hk.transform_with_state(lambda x, y: jnp.sum(losses(x, y)))
  _, plain_state = jax.jit(plain.init)(jax.random.PRNGKey(0), x, y)
  # Inference and plain gradients of the tracked model are unaffected.
  loss = lambda p: f.apply(p, state, None, x, y)[0]
  plain_loss = lambda p: plain.apply(p, plain_state, None, x, y)[0]
  np.testing.assert_allclose(loss(params), plain_loss(params), rtol=1e-6)
  chex.assert_trees_all_close(jax.grad(loss)(params),
                              jax.jit(jax.grad(plain_loss))(params),
                              rtol=1e-5)
  fn = (gram_haiku.clipped_grad(f.apply, 1.0) if use == "clip"
        else gram_haiku.value_grad_and_gram(f.apply))
  with pytest.raises(ValueError, match=r"has complex operands \("
                     r"(input|parameter) complex64\[.*conjugates"):
    fn(params, state, None, x, y)


@pytest.mark.parametrize("clip", [False, True])
def test_complex_values_between_real_layers_are_exact(clip):
  # conj, real, imag and complex act within each example: followed.
  x, y = _data(10, (5, 4), 3)

  def losses(x, y):
    h = hk.Linear(4)(x)
    z = jax.lax.complex(h, jnp.tanh(h)) * jnp.exp(0.3j)
    h = jnp.real(z * jnp.conj(z)) + jnp.imag(z)
    return 0.5 * jnp.sum((hk.Linear(3)(h) - y) ** 2, axis=-1)
  f, g = _transforms(lambda x, y: jnp.sum(losses(x, y)))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  if clip:
    got, _ = gram_haiku.clipped_grad(f.apply, 0.5)(params, state, None, x, y)
    f_ref = per_example_grads(g.apply, params, x, y)
    norms = np.linalg.norm(np.asarray(f_ref, np.float64), axis=1)
    want = weighted_sum(f_ref, clip_reference(norms, 0.5), params)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  else:
    _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state,
                                                          None, x, y)
    assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))


# -- a shared module inside hk.layer_stack ---------------------------------


def test_layer_stack_body_that_shares_a_module():
  x, y = _data(8, (4, 5), 5)
  def body(x, y):
    def layer(h):
      lin = hk.Linear(5)
      return jnp.tanh(lin(jnp.tanh(lin(h))))
    return _sq(hk.layer_stack(2)(layer)(x), y)
  f, g = _transforms(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))
  chex.assert_trees_all_close(grads,
                              jax.jit(jax.grad(g.apply))(params, x, y),
                              rtol=1e-5, atol=1e-6)


def test_stacked_per_example_gradients_are_concatenated():
  f = problems.normal(jax.random.PRNGKey(9), (3, 4, 5))  # [L, B, P]
  cols = pass_pipeline.stacked_to_columns(f)
  np.testing.assert_array_equal(cols[1], np.concatenate(list(f[:, 1])))


# -- verify --------------------------------------------------------------------


def test_verify_passes_a_good_model_and_reports_layers():
  x, y = _data(10, (6, 3, 5), 2)
  f, _ = _transforms(lambda x, y: jnp.mean(
      (hk.nets.MLP([4, 2])(x) - y) ** 2, axis=(1, 2)).sum())
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  report = gram_haiku.verify(f.apply, params, state, None, x, y)
  assert report.ok, str(report)
  assert report.loss_scale == "sum" and report.examples == 6
  assert sorted(report.layer_errors) == ["mlp/~/linear_0", "mlp/~/linear_1"]
  assert max(report.layer_errors.values()) < 1e-4
  assert "OK" in str(report)


def test_verify_detects_a_mean_loss():
  x, y = _data(11, (5, 4), 2)
  f, _ = _transforms(lambda x, y: jnp.mean((hk.Linear(2)(x) - y) ** 2))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.warns(gram_haiku.MeanLossWarning):
    report = gram_haiku.verify(f.apply, params, state, None, x, y)
  assert report.ok and report.loss_scale == "mean", str(report)


def test_verify_reports_untracked_parameters():
  x, y = _data(12, (5, 4), 2)
  def body(x, y):
    gain = hk.get_parameter("gain", [], init=jnp.ones)
    # (a product with a custom derivative, which no program-level rule
    # covers: gain * x and x @ (gain * eye) are covered)
    return _sq(problems.uncovered_matmul(hk.Linear(2)(x), gain * jnp.eye(2)),
               y)
  f = hk.transform_with_state(
      lambda x, y: _track_ignoring(body, x, y))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  report = gram_haiku.verify(f.apply, params, state, None, x, y)
  assert not report.ok and report.untracked == ("~/gain",), str(report)


def test_verify_with_aux_and_without_examples():
  x, y = _data(13, (5, 4), 2)

  def body(x, y):
    out = hk.Linear(2)(x)
    return _sq(out, y), {"out": out}
  f, _ = _transforms(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  report = gram_haiku.verify(f.apply, params, state, None, x, y,
                             has_aux=True)
  assert report.ok, str(report)
  # Without has_aux: the report says to pass it (not an internal error).
  report = gram_haiku.verify(f.apply, params, state, None, x, y)
  assert not report.ok and "has_aux=True" in report.problems[0]
  with pytest.raises(ValueError, match="has_aux=True"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)
  with pytest.raises(ValueError, match="has_aux=True"):
    gram_haiku.clipped_grad(f.apply, 1.0)(params, state, None, x, y)
  with pytest.raises(ValueError, match="no examples"):
    gram_haiku.verify(f.apply, params, state, None, x[:0], y[:0],
                      has_aux=True)


def _track_ignoring(body, *a):
  with gram_haiku.track(untracked="ignore"):
    return body(*a)


def test_verify_detects_coupled_examples():
  x, y = _data(13, (6, 4), 3)
  def body(x, y):
    logits = hk.Linear(3)(x)
    # A softmax over the batch couples every example with every other.
    return -jnp.sum(jax.nn.log_softmax(logits, axis=0) * y)
  f, _ = _transforms(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  report = gram_haiku.verify(f.apply, params, state, None, x, y)
  assert not report.ok and report.loss_scale is None, str(report)
  assert "not a sum" in str(report)


def test_new_error_messages_say_what_to_do():
  for template in (errors.HIGHER_ORDER, errors.NO_FORWARD_USE,
                   errors.FORWARD_MODE_INSIDE, errors.REORDERED_ROWS_MEET_DATA):
    assert "What to do" in template


# -- forward-mode linearisation ------------------------------------------------


@pytest.mark.parametrize("jit", problems.JIT_CASES)
def test_linearize_of_a_tracked_loss(jit):
  x, y = _data(14, (3, 4), 2)
  ids = problems.randint(jax.random.PRNGKey(15), (3, 2), 0, 5)
  def body(x, y, ids):
    h = hk.Linear(2)(x) + hk.Embed(5, 2)(ids).sum(1)
    return _sq(jnp.tanh(h), y)
  f, g = _transforms(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y, ids)
  tangent = jax.tree.map(lambda a: jnp.ones_like(a) * 0.3, params)
  def lin(fn):
    out, jvp = jax.linearize(fn, params)
    return out, jvp(tangent)
  run = jax.jit(lin, static_argnums=0) if jit else lin
  got = run(lambda p: f.apply(p, state, None, x, y, ids)[0])
  want = run(lambda p: g.apply(p, x, y, ids))
  chex.assert_trees_all_close(got, want, rtol=1e-5)
  sized = gram_haiku.resize_probes(state, 3)
  with pytest.raises(ValueError, match="linearized in forward mode"):
    jax.linearize(lambda s: f.apply(params, s, None, x, y, ids)[0], sized)


# -- parameters mapped at init, probes mapped by control flow -----------------


def _init_errors(body, x, y):
  """The init error of ``body`` tracked and untracked: (tracked, plain),
  raised while tracing (traced only: nothing to compile or run)."""
  out = []
  for f in _transforms(body):
    with pytest.raises(Exception) as info:
      jax.eval_shape(f.init, jax.random.PRNGKey(0), x, y)
    out.append(info.value)
  return out


def _split_rng_at_init(x, y):
  return _sq(hk.vmap(lambda xi: hk.Linear(2)(xi), split_rng=True)(x), y)


def _created_in_per_example_cond(x, y):
  def per(xi):
    lin = hk.Linear(2)
    return hk.cond(xi[0] > 0, lin, lambda v: -lin(v), xi)
  return _sq(hk.vmap(per, split_rng=False)(x), y)


@pytest.mark.parametrize("body", [_split_rng_at_init,
                                  _created_in_per_example_cond],
                         ids=lambda f: f.__name__)
def test_parameters_mapped_at_init_get_haikus_own_error(body):
  # Haiku refuses both at init with its own advice; inside track() the same
  # error must come through, not one about vmapped parameters.
  x, y = _data(16, (4, 3), 2)
  tracked, plain = _init_errors(body, x, y)
  assert type(tracked) is type(plain)
  assert str(tracked) == str(plain)
  assert "gram_haiku" not in str(tracked)


def _per_example_branches(select):
  def body(x, y):
    def per(xi):
      lin, head = hk.Linear(3), hk.Linear(2)
      h = jnp.tanh(lin(xi))
      if select:  # both branches, picked per example: exact
        return jnp.where(xi[0] > 0, head(h), -2.0 * head(h))
      if hk.running_init():
        head(h)  # parameters created outside the per-example cond
      return hk.cond(xi[0] > 0, head, lambda v: -2.0 * head(v), h)
    return _sq(hk.vmap(per, split_rng=False)(x), y)
  return body


def test_per_example_cond_under_hk_vmap_says_to_select():
  x, y = _data(17, (5, 3), 2)
  f, _ = _transforms(_per_example_branches(select=False))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match=r"(?s)hk.cond or hk.switch whose "
                     r"predicate.*jnp.where\(pred, a, b\)"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)


@pytest.mark.parametrize("jit", problems.JIT_CASES)
def test_per_example_branches_by_select_are_exact(jit):
  x, y = _data(18, (5, 3), 2)
  assert 0 < int(jnp.sum(x[:, 0] > 0)) < 5, "both branches are taken"
  f, g = _transforms(_per_example_branches(select=True))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  _, grads, grams = (jax.jit(fn) if jit else fn)(params, state, None, x, y)
  assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))
  chex.assert_trees_all_close(grads, jax.jit(jax.grad(g.apply))(params, x, y),
                              rtol=1e-5, atol=1e-6)


def test_a_jax_vmap_over_groups_with_mapped_state_gives_each_its_gram():
  # value_grad_and_gram makes its own probes, so a jax.vmap over groups of
  # examples that maps the state (probes included) gives each group its
  # own Gram, as separate calls do.
  x, y = _data(19, (2, 4, 3), 2)  # two groups of four examples
  f, _ = _transforms(lambda x, y: _sq(hk.Linear(2)(x), y))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x[0], y[0])
  states = jax.tree.map(lambda a: jnp.stack([a, a]), state)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  _, _, grams = jax.vmap(lambda s, x, y: fn(params, s, None, x, y))(
      states, x, y)
  for k in range(2):
    np.testing.assert_allclose(grams.total[k],
                               fn(params, state, None, x[k], y[k])[2].total,
                               rtol=1e-5)


def test_empty_batch_that_leaves_no_layer_says_so():
  # At B = 0 a gather of the (empty) labels leaves nothing of the tied
  # output layer in the traced loss: an error about the empty batch, not
  # one about layers used only inside jax.grad.
  tokens = jnp.array([[0, 1, 2], [3, 1, 0]])
  labels = jnp.array([1, 2])
  def body(tokens, labels):
    embed = hk.Embed(5, 3)
    logits = gram_haiku.unembed(embed, jnp.tanh(embed(tokens).sum(1)))
    picked = jax.nn.log_softmax(logits)[jnp.arange(logits.shape[0]), labels]
    return -jnp.sum(picked)
  f, _ = _transforms(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), tokens, labels)
  with pytest.raises(ValueError,
                     match=r"(?s)batch is empty.*x.shape\[0\] == 0"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                            tokens[:0], labels[:0])


# -- coverage is read from the dataflow, not from names ------------------------


class Encoder(hk.Module):

  def __call__(self, x):
    return jnp.tanh(hk.Linear(x.shape[-1])(x))  # 'encoder/linear'


def _untracked_encoder(x, y):
  h = Encoder()(x)  # outside track()
  with gram_haiku.track():
    return _sq(hk.Linear(3)(h), y)  # 'linear': a suffix of 'encoder/linear'


def _untracked_mlp(x, y):
  h = hk.nets.MLP([6, 6], activate_final=True)(x)  # 'mlp/~/linear_{0,1}'
  with gram_haiku.track():
    h = jnp.tanh(hk.Linear(6)(h))  # 'linear'
    return _sq(hk.Linear(3)(h), y)  # 'linear_1'


def _untracked_in_lift(x, y):
  inner = hk.transform(lambda a: jnp.tanh(hk.Linear(a.shape[-1])(a)))
  p = hk.lift(inner.init, name="enc")(
      hk.next_rng_key() if hk.running_init() else None, x)
  h = inner.apply(p, None, x)  # 'enc/linear', untracked
  with gram_haiku.track():
    return _sq(hk.Linear(3)(h), y)


# (Their biases and weights are covered by the program-level rules for a
# broadcast and a matmul, not by the tracked layer whose names theirs end
# like.)
@pytest.mark.parametrize("body,untracked,frozen", [
    (_untracked_encoder, ["encoder/linear/w"], None),
    (_untracked_mlp, [f"mlp/~/linear_{k}/w" for k in (0, 1)],
     "mlp/~/linear_0"),
    (_untracked_in_lift, ["enc/linear/w"], None),
])
def test_an_untracked_module_named_like_a_tracked_one_is_not_its_layer(
    body, untracked, frozen):
  # An untracked module whose parameter names end like a tracked module's
  # ('encoder/linear/w' and 'linear/w') used to borrow its coverage: the
  # Gram left it out with complete=True, and clipped_grad gave it a zero
  # gradient (also with the other untracked layer frozen, as in
  # fine-tuning). Now the program-level rules cover it, by name of rule.
  x, y = _data(1, (5, 6), 3)
  f = hk.transform_with_state(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(
      params, state, None, x, y)
  assert grams.complete
  assert {k: grams.coverage[k].rule for k in untracked} == {
      k: "program: dot_general" for k in untracked}
  grads, _ = gram_haiku.clipped_grad(f.apply, 1.0, frozen=frozen)(
      params, state, None, x, y)
  for k in untracked:
    module, name = k.rsplit("/", 1)
    assert (grads[module][name] != 0).any() != (module == frozen), k


# -- the differentiated state's probes reach the layers ------------------------


def _mlp_body(x, y):
  with gram_haiku.track():
    return _sq(hk.Linear(3)(jnp.tanh(hk.Linear(5)(x))), y)


def _inner_tracked(x):
  with gram_haiku.track():
    return jnp.tanh(hk.Linear(4, name="inner")(x))


def _nested_transform(x, y):
  # Outer parameters fed to an inner tracked transform with its own state.
  inner = hk.transform_with_state(_inner_tracked)
  _, inner_state = jax.jit(inner.init)(jax.random.PRNGKey(0), x)
  w = hk.get_parameter("w", (x.shape[-1], 4), init=jnp.ones)
  b = hk.get_parameter("b", (4,), init=jnp.zeros)
  h, _ = inner.apply({"inner": {"w": w, "b": b}}, inner_state, None, x)
  with gram_haiku.track():
    return _sq(hk.Linear(3, name="head")(h), y)


@functools.lru_cache(maxsize=None)
def _init_probed(body):
  """``body``'s transform and jitted init, made once per process."""
  f = hk.transform_with_state(body)
  return f, jax.jit(f.init)


def _probed(body, x, y):
  """``(f, params, state)`` of ``body`` (its probes sized for ``x``)."""
  f, init = _init_probed(body)
  params, state = init(jax.random.PRNGKey(0), x, y)
  return f, params, gram_haiku.resize_probes(state, x.shape[0])


@functools.lru_cache(maxsize=None)
def _mlp_exact(seed):
  """``(grams, reference Gram)`` of ``_mlp_body`` given its own state, on
  ``_data(seed, (5, 6), 3)``: computed once per process (the same for every
  case that checks it)."""
  x, y = _data(seed, (5, 6), 3)
  f, params, state = _probed(_mlp_body, x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(
      params, state, None, x, y)
  g = hk.without_apply_rng(hk.transform(
      lambda x, y: _sq(hk.Linear(3)(jnp.tanh(hk.Linear(5)(x))), y)))
  return grams, reference_gram(g.apply, params, x, y)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("how", ["closed_over", "stop_gradient", "other_entry",
                                 "scaled", "nested_transform"])
def test_probes_not_taken_from_the_differentiated_state_are_refused(how, jit):
  # The Gram is the gradient of the probes in `state`: a layer reading any
  # other probe used to give a zero, partial or scaled Gram, complete=True.
  x, y = _data(2, (5, 6), 3)
  f, params, state0 = _probed(
      _nested_transform if how == "nested_transform" else _mlp_body, x, y)
  apply = {
      "closed_over": lambda p, s, r, *a: f.apply(p, state0, r, *a),
      "stop_gradient": lambda p, s, r, *a: f.apply(
          p, jax.lax.stop_gradient(s), r, *a),
      "other_entry": lambda p, s, r, *a: f.apply(
          p, {**s, "linear": state0["linear"]}, r, *a),
      "scaled": lambda p, s, r, *a: f.apply(
          p, jax.tree.map(lambda v: 2 * v, s), r, *a),
      "nested_transform": f.apply,
  }[how]
  for fn in (gram_haiku.value_grad_and_gram(apply),
             gram_haiku.clipped_grad(apply, 1.0)):
    with pytest.raises(ValueError, match="not the probe of the `state`"):
      (jax.jit(fn) if jit else fn)(params, state0, None, x, y)
  if how != "nested_transform":  # Given the state unchanged: exact.
    grams, ref = _mlp_exact(2)
    assert_gram_close(grams.total, ref)




# -- a closed-over input whose rows were taken as the examples -----------------


_XS = jax.random.normal(jax.random.PRNGKey(31), (4, 4, 3))  # T == B == 4


def _closed_over_losses(move, back):
  """Per-example losses: a layer on the closed-over ``_XS`` (its axis 0
  taken as the examples), then one given that value with the axis moved
  by ``move``, moved back by ``back`` before the head and the loss."""
  def losses(y):
    h = jnp.tanh(hk.Linear(3, name="pe")(_XS))
    h = back(jnp.tanh(hk.Linear(3, name="moved")(move(h))))
    out = hk.Linear(2, name="head")(h.sum(1))
    return 0.5 * jnp.sum((out - y) ** 2, axis=-1)
  return losses


_MOVES = {
    "time_major": (lambda h: jnp.swapaxes(h, 0, 1),
                   lambda h: jnp.swapaxes(h, 0, 1),
                   "holds the examples along axis 1"),
    "merged": (lambda h: h.reshape(2, 8, 3), lambda h: h.reshape(4, 4, 3),
               "depends on several examples|merge"),
}
# Rows reordered and put back: refused at 'pe' (whose rows reach the
# examples only through the reordering), for that reason and not another.
_REORDERED = "are reordered, repeated or subset"
_PERM = jnp.array([2, 0, 3, 1])
for _name, _there, _back in [
    ("reversed", lambda h: h[::-1], lambda h: h[::-1]),
    ("rolled", lambda h: jnp.roll(h, 1, 0), lambda h: jnp.roll(h, -1, 0)),
    ("permuted", lambda h: h[_PERM], lambda h: h[jnp.argsort(_PERM)]),
    ("rotated_pieces", lambda h: jnp.concatenate([h[1:], h[:1]]),
     lambda h: jnp.concatenate([h[3:], h[:3]])),
]:
  _MOVES[_name] = (_there, _back, f"tracked layer 'pe'(.|\n)*{_REORDERED}")


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("kind", sorted(_MOVES))
def test_a_closed_over_input_moved_off_the_example_axis_is_refused(kind, jit):
  # A later layer given the value with the axis moved (time-major with
  # T == B) used to take axis 0 as the examples, silently.
  move, back, error = _MOVES[kind]
  losses = _closed_over_losses(move, back)
  y = jax.random.normal(jax.random.PRNGKey(30), (4, 2))
  f = hk.transform_with_state(_track_all(lambda y: jnp.sum(losses(y))))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  with pytest.raises(ValueError, match=error):
    (jax.jit(fn) if jit else fn)(params, state, None, y)


def _track_all(body):
  def tracked(*a):
    with gram_haiku.track():
      return body(*a)
  return tracked


def test_a_closed_over_input_kept_on_the_example_axis_stays_exact():
  losses = _closed_over_losses(lambda h: h, lambda h: h)
  y = jax.random.normal(jax.random.PRNGKey(30), (4, 2))
  f = hk.transform_with_state(_track_all(lambda y: jnp.sum(losses(y))))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(
      params, state, None, y)
  plain = hk.without_apply_rng(hk.transform(losses))
  assert_gram_close(grams.total, jacobian_gram(
      lambda p: plain.apply(p, y), params))


# -- PRNG keys made inside the loss ---------------------------------------------


@pytest.mark.parametrize("noise", [
    lambda x: jax.random.normal(jax.random.PRNGKey(9), x.shape, x.dtype),
    lambda x: jax.random.uniform(jax.random.split(jax.random.key(3))[1],
                                 x.shape, x.dtype),
    lambda x: jax.random.bernoulli(jax.random.PRNGKey(4), 0.7,
                                   x.shape).astype(x.dtype),
])
def test_noise_from_a_fixed_key_inside_the_loss_is_exact(noise):
  # A key built in the loss is a constant of the traced program; reading
  # its (key-typed) value used to crash the example analysis.
  x, y = _data(3, (5, 6), 3)

  def losses(x, y):
    out = hk.Linear(3)(jnp.tanh(hk.Linear(4)(x + noise(x))))
    return 0.5 * jnp.sum((out - y) ** 2, axis=-1)
  f = hk.transform_with_state(_track_all(lambda x, y: jnp.sum(losses(x, y))))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(
      params, state, None, x, y)
  assert grams.complete
  plain = hk.without_apply_rng(hk.transform(losses))
  assert_gram_close(grams.total, jacobian_gram(
      lambda p: plain.apply(p, x, y), params))
