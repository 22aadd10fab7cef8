"""gram_haiku.track() + value_grad_and_gram on Haiku models, vs the reference."""

import functools

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.api import value_grad_and_gram as gram_haiku_vgg
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import RTOL_BF16
from gram_haiku.conformance.plugin import thorough
from tests import problems


def _data(seed, shape, out_dim):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (problems.normal(k1, shape),
          problems.normal(k2, shape[:-1] + (out_dim,)))


def _mlp(x):
  return hk.nets.MLP([7, 3], activation=jnp.tanh)(x)


def _sq(out, y):
  return 0.5 * jnp.sum((out - y) ** 2)


def _setup(model_apply, x, y, **track_kw):
  """Tracked transform, its params/state, and the untracked twin."""
  def tracked(x, y):
    with gram_haiku.track(**track_kw):
      return _sq(model_apply(x), y)
  def plain(x, y):
    return _sq(model_apply(x), y)
  f = hk.transform_with_state(tracked)
  g = hk.without_apply_rng(hk.transform(plain))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  return f, g, params, state


def _check(model_apply, x, y, jit=True, **track_kw):
  f, g, params, state = _setup(model_apply, x, y, **track_kw)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  if jit:
    fn = jax.jit(fn)
  value, grads, grams = fn(params, state, None, x, y)
  plain_value, plain_grads, flat = problems.untracked(g.apply, params, x, y)
  ref = flat @ flat.T
  assert_gram_close(grams.total, ref)
  np.testing.assert_allclose(value, plain_value, rtol=1e-6)
  chex.assert_trees_all_close(grads, plain_grads, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grams.norms, np.sqrt(np.diag(ref)), rtol=1e-4)
  return grams


@pytest.mark.parametrize("jit", [False, True])
def test_mlp_explicit_batch(jit):
  x, y = _data(0, (8, 5), 3)
  grams = _check(_mlp, x, y, jit=jit)
  assert set(grams.by_layer) == {"mlp/~/linear_0", "mlp/~/linear_1"}
  chex.assert_shape(grams.total, (8, 8))
  chex.assert_shape(grams.norms, (8,))
  assert grams.total.dtype == jnp.float32


def test_sequence_explicit():
  x, y = _data(1, (6, 4, 5), 3)
  _check(_mlp, x, y)


@pytest.mark.parametrize("jit", problems.JIT_CASES)
def test_sequence_hk_vmap_depth_1(jit):
  x, y = _data(2, (6, 4, 5), 3)
  _check(hk.vmap(_mlp, split_rng=False), x, y, jit=jit)


@pytest.mark.parametrize("jit_inside", [False, True])
def test_sequence_hk_vmap_depth_2(jit_inside):
  x, y = _data(3, (6, 4, 5), 3)
  inner = hk.jit(_mlp) if jit_inside and hasattr(hk, "jit") else _mlp
  model = hk.vmap(hk.vmap(inner, split_rng=False), split_rng=False)
  _check(model, x, y)


def test_sequence_vmap_nonzero_axes():
  x, y = _data(4, (6, 4, 5), 3)
  def model(x):
    xt = jnp.transpose(x, (1, 2, 0))  # (T, N, B)
    inner = hk.vmap(_mlp, in_axes=0, out_axes=1, split_rng=False)  # over T
    out = hk.vmap(inner, in_axes=2, out_axes=2, split_rng=False)(xt)
    return jnp.transpose(out, (2, 1, 0))  # (M, T, B) -> (B, T, M)
  _check(model, x, y)


def test_batch_size_at_apply_differs_from_init():
  x, y = _data(5, (6, 4, 5), 3)
  model = hk.vmap(_mlp, split_rng=False)
  f, g, params, state = _setup(model, x[:2], y[:2])
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))


def test_raw_path_grad_of_state_entry():
  x, y = _data(6, (6, 5), 3)
  f, g, params, state = _setup(_mlp, x, y)
  state = gram_haiku.resize_probes(state, 6)
  def loss_of_state(state):
    return f.apply(params, state, None, x, y)[0]
  dstate = jax.grad(loss_of_state)(state)
  total = sum(d[gram_haiku.PROBE_NAME] for d in dstate.values())
  assert_gram_close(total, reference_gram(g.apply, params, x, y))


def test_bf16_params_parity_and_f32_gram():
  x, y = _data(7, (8, 5), 3)
  def model(x):
    return hk.nets.MLP([7, 3], activation=jnp.tanh)(x.astype(jnp.bfloat16))
  def tracked(x, y):
    with gram_haiku.track():
      return _sq(model(x).astype(jnp.float32), y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  assert all(l.dtype == jnp.bfloat16 for l in jax.tree.leaves(params))
  _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
  assert grams.total.dtype == jnp.float32
  def plain32(p, x, y):
    return _sq(hk.without_apply_rng(hk.transform(
        lambda x: hk.nets.MLP([7, 3], activation=jnp.tanh)(x))).apply(p, x), y)
  p32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  x32 = x.astype(jnp.bfloat16).astype(jnp.float32)
  assert_gram_close(grams.total, reference_gram(plain32, p32, x32, y),
                    rtol=RTOL_BF16)


def test_inference_unchanged_bitwise():
  x, y = _data(8, (8, 5), 3)
  def tracked_out(x):
    with gram_haiku.track():
      return _mlp(x)
  f = hk.transform_with_state(tracked_out)
  g = hk.transform(_mlp)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  chex.assert_trees_all_equal(params, jax.jit(g.init)(jax.random.PRNGKey(0), x))
  out, _ = f.apply(params, state, None, x)
  np.testing.assert_array_equal(out, g.apply(params, None, x))
  out_jit, _ = jax.jit(f.apply)(params, state, None, x)
  np.testing.assert_array_equal(out_jit, jax.jit(g.apply)(params, None, x))
  # Parameter gradients without the probes: same as plain Haiku.
  def loss_t(p):
    return _sq(f.apply(p, state, None, x)[0], 0.0)
  def loss_p(p):
    return _sq(g.apply(p, None, x), 0.0)
  chex.assert_trees_all_close(jax.grad(loss_t)(params), jax.grad(loss_p)(params),
                              rtol=1e-6)


def test_outside_track_no_probes():
  x, _ = _data(9, (4, 5), 3)
  f = hk.transform_with_state(_mlp)
  _, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  assert state == {}


def test_wrong_probe_error_names_module():
  x, y = _data(10, (6, 5), 3)
  f, _, params, state = _setup(_mlp, x, y)
  state = gram_haiku.resize_probes(state, 4)
  with pytest.raises(ValueError) as e:
    jax.grad(lambda s: f.apply(params, s, None, x, y)[0])(state)
  assert "mlp/~/linear_0" in str(e.value)
  assert "(4, 4)" in str(e.value) and "(6, 6)" in str(e.value)


def test_resize_probes_validation():
  with pytest.raises(ValueError, match="positive int"):
    gram_haiku.resize_probes({}, 0)


def test_no_probes_error():
  f = hk.transform_with_state(lambda x: _mlp(x).sum())
  x, _ = _data(11, (4, 5), 3)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="no Gram probe"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x)


def test_non_scalar_loss_error():
  def fn(x):
    with gram_haiku.track():
      return _mlp(x)
  f = hk.transform_with_state(fn)
  x, _ = _data(12, (4, 5), 3)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match="scalar loss"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x)


def test_plain_transform_error():
  def fn(x):
    with gram_haiku.track():
      return _mlp(x).sum()
  with pytest.raises(ValueError, match="transform_with_state"):
    hk.transform(fn).init(jax.random.PRNGKey(0), jnp.ones((2, 5)))


def _raw_probe_grad(f, params, state, *args):
  """The raw path: jax.grad with respect to resized probes, no discovery."""
  rest, probes = gram_haiku_vgg.split_probes(state)
  b = args[0].shape[0]
  probes = gram_haiku_vgg.split_probes(
      gram_haiku.resize_probes(state, b))[1]
  def loss(probes):
    return f.apply(params, gram_haiku_vgg.merge_probes(rest, probes), None,
                   *args)[0]
  return jax.grad(loss)(probes)


@pytest.mark.parametrize("jit", problems.JIT_CASES)
def test_module_called_twice_has_cross_terms(jit):
  # C09 (a): one hk.Linear applied to x and to x**2/5. Its per-example
  # gradient is the sum over both calls: the Gram needs the cross terms.
  x, y = _data(13, (8, 6), 4)
  def model(x):
    lin = hk.Linear(4)
    return jnp.tanh(lin(x)) + lin(x ** 2 / 5)
  grams = _check(model, x, y, jit=jit)
  assert list(grams.by_layer) == ["linear"]


def test_module_called_twice_raw_path_is_an_error():
  # Without value_grad_and_gram's discovery pass nothing can accumulate the
  # per-example gradients: an error, never the sum of per-call Grams.
  x, y = _data(13, (8, 6), 4)
  def tracked(x, y):
    with gram_haiku.track():
      lin = hk.Linear(4)
      return _sq(lin(x) + lin(x ** 2 / 5), y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="'linear' was called more than once"):
    _raw_probe_grad(f, params, state, x, y)


def _rnn(unroll):
  def model(x):  # x: (B, T, F) -> (B, T, H)
    core = hk.VanillaRNN(5)
    xs = jnp.swapaxes(x, 0, 1)
    state0 = core.initial_state(x.shape[0])
    run = hk.dynamic_unroll if unroll == "dynamic" else hk.static_unroll
    out, _ = run(core, xs, state0)
    return jnp.swapaxes(out, 0, 1)
  return model


@pytest.mark.parametrize("unroll", ["dynamic", "static"])
def test_rnn_weight_reuse_has_cross_terms(unroll):
  # C04 (Haiku variant): a VanillaRNN whose matrices are reused per step.
  x, y = _data(14, (6, 4, 3), 5)
  grams = _check(_rnn(unroll), x, y)
  assert len(grams.by_layer) == 2  # input_to_hidden, hidden_to_hidden


@pytest.mark.parametrize("unroll", ["dynamic", "static"])
def test_rnn_weight_reuse_raw_path_is_an_error(unroll):
  x, y = _data(14, (6, 4, 3), 5)
  def tracked(x, y):
    with gram_haiku.track():
      return _sq(_rnn(unroll)(x), y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="loop body|more than once"):
    _raw_probe_grad(f, params, state, x, y)


def test_layer_stack_is_not_sharing():
  x, y = _data(15, (6, 5), 5)
  def model(x):
    stack = hk.layer_stack(3)(lambda h: jnp.tanh(hk.Linear(5)(h)))
    return stack(x)
  grams = _check(model, x, y)
  (stacked,) = grams.by_layer.values()
  chex.assert_shape(stacked, (6, 6))


def test_remat_inside_model():
  x, y = _data(16, (6, 4, 5), 3)
  _check(lambda x: hk.remat(hk.vmap(_mlp, split_rng=False))(x), x, y)


def test_named_axis_with_inner_heads_vmap():
  # C16: hk.vmap over an inner K=5 set axis with shared params, examples
  # mapped by a named vmap. Only B is the example axis: G is 6x6.
  b, k, d = 6, 5, 13
  x, y = _data(17, (b, k, d), 11)
  def mlp(x):
    return hk.nets.MLP([10, 11])(x)
  def per_example(xe):
    return hk.vmap(mlp, split_rng=False)(xe)  # over K
  model = hk.vmap(per_example, split_rng=False, axis_name="batch")
  grams = _check(model, x, y, example_axis="batch")
  chex.assert_shape(grams.total, (b, b))


def test_explicit_batch_with_inner_vmap_needs_override():
  # An explicitly batched model that vmaps over heads internally: the default
  # rule would take the heads axis; example_axis=0 gives the right Gram, and
  # the default is an error, never a silent number.
  b, k, d = 6, 5, 4
  x, y = _data(18, (b, k, d), 3)
  def model(x):
    xt = jnp.swapaxes(x, 0, 1)  # (K, B, D)
    out = hk.vmap(_mlp, split_rng=False)(xt)
    return jnp.swapaxes(out, 0, 1)
  _check(model, x, y, example_axis=0)
  f, _, params, state = _setup(model, x, y)
  with pytest.raises(ValueError, match="example_axis=0"):
    state = gram_haiku.resize_probes(state, b)
    jax.grad(lambda s: f.apply(params, s, None, x, y)[0])(state)


def test_explicit_layer_then_inner_heads_vmap_same_size_is_an_error():
  # The dangerous case: heads H == B, so no size check can tell them apart.
  # An explicit first layer (axis 0) and an inner hk.vmap over heads (the
  # default takes it) resolve the default rule two ways: an error naming
  # the override, never a silent number.
  b = h = 4
  x, y = _data(21, (b, h, 5), 3)
  def model(x):
    z = jnp.tanh(hk.Linear(6, name="stem")(x))       # (B, H, 6), explicit
    zt = jnp.swapaxes(z, 0, 1)                        # (H, B, 6)
    out = hk.vmap(lambda zh: hk.Linear(3, name="head")(zh),
                  split_rng=False)(zt)
    return jnp.swapaxes(out, 0, 1)
  f, _, params, state = _setup(model, x, y)
  with pytest.raises(ValueError, match="example_axis=0"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)
  _check(model, x, y, example_axis=0)


@pytest.mark.parametrize("jit", problems.JIT_CASES)
def test_norms_mode(jit):
  x, y = _data(22, (6, 3, 5), 3)
  def model(x):
    return _mlp(x)
  f, g, params, state = _setup(model, x, y, mode="norms")
  fn = gram_haiku.value_grad_and_gram(f.apply)
  if jit:
    fn = jax.jit(fn)
  value, grads, grams = fn(params, state, None, x, y)
  ref = reference_gram(g.apply, params, x, y)
  np.testing.assert_allclose(grams.sq_norms, np.diag(ref), rtol=1e-4)
  np.testing.assert_allclose(grams.norms, np.sqrt(np.diag(ref)), rtol=1e-4)
  chex.assert_trees_all_close(grads,
                              jax.jit(jax.grad(g.apply))(params, x, y),
                              rtol=1e-5, atol=1e-6)
  assert not grams.by_layer and len(grams.sq_norms_by_layer) == 2
  with pytest.raises(ValueError, match="mode='norms'"):
    grams.total  # pylint: disable=pointless-statement
  del value


def test_norms_mode_with_shared_module():
  # Norms of a module called twice: from accumulated per-example gradients.
  x, y = _data(23, (5, 6), 4)
  def model(x):
    lin = hk.Linear(4)
    return jnp.tanh(lin(x)) + lin(x ** 2 / 5)
  f, g, params, state = _setup(model, x, y, mode="norms")
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  ref = reference_gram(g.apply, params, x, y)
  np.testing.assert_allclose(grams.sq_norms, np.diag(ref), rtol=1e-4)


def test_bad_mode():
  with pytest.raises(ValueError, match="mode"):
    gram_haiku.track(mode="full")


@pytest.mark.parametrize("b", [1, 2, 10, 20] if thorough() else [1, 10])
def test_mean_loss_scales_by_one_over_b_squared(b):
  # C10: sum loss gives the reference, mean loss gives reference / B**2.
  x, y = _data(19, (b, 10), 4)
  def model(x):
    return hk.Linear(4)(jnp.tanh(hk.Linear(16)(x)))
  def tracked(x, y, reduce):
    with gram_haiku.track():
      out = model(x)
    per_ex = 0.5 * jnp.sum((out - y) ** 2, axis=-1)
    return reduce(per_ex)
  f_sum = hk.transform_with_state(functools.partial(tracked, reduce=jnp.sum))
  f_mean = hk.transform_with_state(functools.partial(tracked, reduce=jnp.mean))
  params, state = jax.jit(f_sum.init)(jax.random.PRNGKey(0), x, y)
  g = hk.without_apply_rng(hk.transform(lambda x, y: _sq(model(x), y)))
  ref = reference_gram(g.apply, params, x, y)
  _, _, gs = jax.jit(gram_haiku.value_grad_and_gram(f_sum.apply))(
      params, state, None, x, y)
  _, _, gm = jax.jit(gram_haiku.value_grad_and_gram(f_mean.apply))(
      params, state, None, x, y)
  assert_gram_close(gs.total, ref)
  assert_gram_close(gm.total, ref / b ** 2)
  if b == 1:
    flat = np.concatenate([np.ravel(l) for l in jax.tree.leaves(
        jax.jit(jax.grad(g.apply))(params, x, y))])
    np.testing.assert_allclose(gs.total[0, 0], flat @ flat, rtol=1e-5)


def test_grams_pytree_under_jit_and_vmap():
  x, y = _data(20, (3, 6, 5), 3)  # 3 independent batches of 6
  f, g, params, state = _setup(_mlp, x[0], y[0])
  fn = gram_haiku.value_grad_and_gram(f.apply)
  _, _, grams = jax.jit(jax.vmap(fn, in_axes=(None, None, None, 0, 0)))(
      params, state, None, x, y)
  chex.assert_shape(grams.total, (3, 6, 6))
  chex.assert_shape(grams.norms, (3, 6))
  # Each batch's reference F, the three in one program.
  flats = np.asarray(jax.jit(jax.vmap(lambda x, y: per_example_grads(
      g.apply, params, x, y)))(x, y), np.float64)
  for i in range(3):
    assert_gram_close(grams.total[i], flats[i] @ flats[i].T)


def test_attention_projections_tracked():
  x, y = _data(21, (4, 6, 8), 8)
  def model(x):
    mha = hk.MultiHeadAttention(num_heads=2, key_size=4,
                                w_init=hk.initializers.VarianceScaling(1.0))
    return mha(x, x, x)
  grams = _check(model, x, y)
  assert len(grams.by_layer) == 4  # query, key, value, linear


def test_c12_explicit_operands_match_unswapped_linear():
  # C12 variant C: parameters threaded as primitive operands.
  x, y = _data(22, (8, 6), 4)
  grams = _check(lambda x: hk.Linear(4)(x), x, y)
  assert list(grams.by_layer) == ["linear"]


@pytest.mark.parametrize("jit", [False, True])
def test_layer_input_without_example_axis_under_vmap_is_exact(jit):
  # Position "ids" from jnp.arange do not depend on the example, but under
  # hk.vmap over examples each example's copy of the layer has its own
  # output cotangent, so its own gradient: exact (T == B on purpose). More
  # of this class: tests/test_example_flow.py.
  b = t = 4
  x, y = _data(24, (b, t, 3), 5)
  def per_example(xe):  # (T, 3)
    pos = hk.Linear(5, name="pos")(jax.nn.one_hot(jnp.arange(t), t))
    return hk.Linear(5)(xe) + pos
  grams = _check(hk.vmap(per_example, split_rng=False), x, y, jit=jit)
  assert set(grams.by_layer) == {"pos", "linear"}


def test_track_outside_a_transform_says_where_it_belongs():
  with pytest.raises(ValueError, match="inside the function you give to "
                     "hk.transform_with_state"):
    with gram_haiku.track():
      pass


def test_return_state_gives_the_updated_state():
  x, y = _data(21, (4, 5), 3)
  def tracked(x, y):
    count = hk.get_state("count", [], jnp.int32, init=jnp.zeros)
    hk.set_state("count", count + 1)
    with gram_haiku.track():
      return _sq(_mlp(x), y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  (value, new_state), grads, grams = jax.jit(gram_haiku.value_grad_and_gram(
      f.apply, return_state=True))(params, state, None, x, y)
  assert int(new_state["~"]["count"]) == int(state["~"]["count"]) + 1
  want_value, _ = jax.jit(f.apply)(params, state, None, x, y)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  plain_value, plain_grads, plain_grams = jax.jit(
      gram_haiku.value_grad_and_gram(f.apply))(params, state, None, x, y)
  np.testing.assert_allclose(value, plain_value, rtol=1e-6)
  chex.assert_trees_all_close(grads, plain_grads)
  np.testing.assert_allclose(grams.total, plain_grams.total, rtol=1e-6)


def test_plan_is_in_the_jaxpr_and_the_cache_key():
  x, y = _data(22, (4, 5), 3)
  def tracked(x, y, **kw):
    with gram_haiku.track(**kw):
      return _sq(_mlp(x), y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  jaxpr = str(jax.make_jaxpr(f.apply)(params, state, None, x, y))
  assert jaxpr.count("call_hi_primitive") == 2
  assert "plan': Plan(mode='gram', strategy='auto'" in jaxpr
  g = hk.transform_with_state(functools.partial(tracked, strategy="ghost",
                                                memory_budget_bytes=4096))
  jaxpr = str(jax.make_jaxpr(g.apply)(params, state, None, x, y))
  assert "strategy='ghost'" in jaxpr and "memory_budget_bytes=4096" in jaxpr


def test_cost_model_consulted_once_per_application(monkeypatch):
  from gram_haiku._src.compute import cost_model  # pylint: disable=g-import-not-at-top
  calls = []
  original = cost_model.linear_method
  def counting(*args, **kwargs):
    calls.append(kwargs.get("mode"))
    return original(*args, **kwargs)
  monkeypatch.setattr(cost_model, "linear_method", counting)
  x, y = _data(23, (4, 3, 5), 3)
  for mode in ("gram", "norms"):
    calls.clear()
    f, _, params, state = _setup(_mlp, x, y, mode=mode)
    # Traced, not run: the backward rules consult the model while tracing.
    jax.eval_shape(gram_haiku.value_grad_and_gram(f.apply), params, state,
                   None, x, y)
    assert calls == [mode, mode], calls  # two layers, once each


def test_memory_budget_option_is_validated():
  with pytest.raises(ValueError, match="memory_budget_bytes"):
    gram_haiku.track(memory_budget_bytes=0)
  with pytest.raises(ValueError, match="Unknown Gram strategy"):
    gram_haiku.track(strategy="fast")


def test_memory_budget_takes_any_positive_integer():
  """A NumPy integer (from a config file, np.prod of a shape) is a budget
  like a Python int; a bool, a float or a non-positive one is an error.
  At one output feature's worth of per-example gradients (4 x 5 floats)
  the tracked layer forms its Gram feature by feature: the reference."""
  x = jnp.asarray(np.random.RandomState(0).normal(size=(4, 3, 5)),
                  jnp.float32)
  plain = hk.transform(lambda x: jnp.sum(hk.Linear(6)(x) ** 2))

  def grams(budget):
    def loss(x):
      with gram_haiku.track(memory_budget_bytes=budget):
        return jnp.sum(hk.Linear(6)(x) ** 2)
    f = hk.transform_with_state(loss)
    params, state = f.init(jax.random.PRNGKey(0), x)
    total = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                    x)[2].total
    assert_gram_close(total, reference_gram(
        lambda p, xi: plain.apply(p, None, xi), params, x))
    return total
  np.testing.assert_array_equal(grams(np.int64(4 * 5 * 4)), grams(4 * 5 * 4))
  for bad in (True, 1.5, 0, np.int32(-3)):
    with pytest.raises(ValueError, match="positive integer"):
      grams(bad)
