"""Inference runs as plain Haiku; no call's frame outlives it; clear errors.

* Outside differentiation a tracked model is plain Haiku: a training-mode
  ``hk.BatchNorm`` (batch statistics, moving averages) gives Haiku's outputs
  and state under ``jit``, ``hk.scan``, ``lax.scan``, ``hk.remat`` and
  ``jax.eval_shape``, and ``jax.grad`` of its loss is Haiku's; only asking
  for its Gram or a clipped sum is an error.
* No Haiku frame, tracer or array of a finished call is held by gram_haiku
  (``jax.checking_leaks``; a weak reference to the parameters).
* ``jax.export`` of a convolution with a symbolic sequence length; an empty
  batch; and teaching errors for a pure ``hk.transform`` (lifted or not),
  the arguments of apply, two modules that share a layer name under
  ``frozen=``, and a mean loss given to ``clipped_grad`` (a warning).
"""

import gc
import warnings
import weakref

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.analysis import loss_scale
from gram_haiku._src.api import value_grad_and_gram as vgg_lib
from gram_haiku._src.compute import cost_model
from gram_haiku._src.core import errors
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.frontend import ambient

B, F, H = 4, 3, 5


def _x(seed=0, shape=(B, F)):
  return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda u, v: np.testing.assert_allclose(
      np.asarray(u), np.asarray(v), rtol=rtol, atol=atol), a, b)


def _without_probes(state):
  return vgg_lib.split_probes(state)[0]


def _raw_probe_grad(f, params, state, *args):
  """``jax.grad`` of the loss with respect to the probes (the raw path)."""
  rest, probes = vgg_lib.split_probes(state)
  return jax.grad(lambda q: f.apply(params, vgg_lib.merge_probes(rest, q),
                                    None, *args)[0])(probes)


# -- 1. Training-mode BatchNorm runs as plain Haiku ------------------------

def _bn_body(x, is_training=True, test_local_stats=False, **bn_kw):
  h = hk.Linear(H)(x)
  h = hk.BatchNorm(True, True, 0.9, **bn_kw)(
      h, is_training=is_training, test_local_stats=test_local_stats)
  return hk.Linear(2)(jnp.tanh(h))


def _pair(body):
  """``(tracked, plain)`` transforms of ``body`` (same parameter names)."""
  def tracked(*a):
    with gram_haiku.track():
      return body(*a)
  return hk.transform_with_state(tracked), hk.transform_with_state(body)


def _init_both(tracked, plain, *args):
  params, state = tracked.init(jax.random.PRNGKey(1), *args)
  plain_params, plain_state = plain.init(jax.random.PRNGKey(1), *args)
  _close(params, plain_params, 0, 0)
  _close(_without_probes(state), plain_state, 0, 0)
  return params, state, plain_state


def _bn_scan_body(xs):  # xs: (T, B, F); moving averages updated per step
  core = hk.Linear(H)
  bn = hk.BatchNorm(True, True, 0.9)
  def step(carry, xt):
    return carry, bn(core(xt), is_training=True)
  return hk.scan(step, None, xs)[1]


@pytest.mark.parametrize("how", ["jit", "eager", "hk.scan", "lax.scan",
                                 "hk.remat", "test_local_stats"])
def test_training_batch_norm_forward_and_state_match_haiku(how):
  x = _x()
  body = _bn_body
  if how == "hk.scan":
    x, body = _x(shape=(3, B, F)), _bn_scan_body
  elif how == "hk.remat":
    body = lambda x: hk.remat(_bn_body)(x)
  elif how == "test_local_stats":
    body = lambda x: _bn_body(x, is_training=False, test_local_stats=True)
  tracked, plain = _pair(body)
  params, state, plain_state = _init_both(tracked, plain, x)
  x = x + 1.0  # other statistics than at init
  if how == "lax.scan":  # apply steps of a data loop, state carried
    def steps(f, state):
      return jax.lax.scan(
          lambda s, xb: f.apply(params, s, None, xb)[::-1], state,
          jnp.stack([x, 2 * x]))
    new_state, out = jax.jit(steps, static_argnums=0)(tracked, state)
    plain_new, plain_out = jax.jit(steps, static_argnums=0)(plain,
                                                            plain_state)
  else:
    apply_t = tracked.apply if how == "eager" else jax.jit(tracked.apply)
    apply_p = plain.apply if how == "eager" else jax.jit(plain.apply)
    out, new_state = apply_t(params, state, None, x)
    plain_out, plain_new = apply_p(params, plain_state, None, x)
  _close(out, plain_out)
  _close(_without_probes(new_state), plain_new)
  if how != "test_local_stats":  # the moving averages moved, as Haiku's
    ema = "batch_norm/~/mean_ema"
    assert not np.allclose(new_state[ema]["average"], state[ema]["average"])


def test_training_batch_norm_eval_shape_matches_haiku():
  tracked, plain = _pair(_bn_body)
  x = _x()
  params, state, plain_state = _init_both(tracked, plain, x)
  out, new_state = jax.eval_shape(tracked.apply, params, state, None, x)
  plain_out, plain_new = jax.eval_shape(plain.apply, params, plain_state,
                                        None, x)
  assert (out.shape, out.dtype) == (plain_out.shape, plain_out.dtype)
  assert jax.tree.map(lambda a: (a.shape, a.dtype),
                      _without_probes(new_state)) == jax.tree.map(
                          lambda a: (a.shape, a.dtype), plain_new)


def test_training_batch_norm_loss_gradient_matches_haiku():
  tracked, plain = _pair(lambda x, y: jnp.sum((_bn_body(x) - y) ** 2))
  x, y = _x(), _x(1, (B, 2))
  params, state, plain_state = _init_both(tracked, plain, x, y)
  value_and_grad = lambda f, s: jax.jit(jax.value_and_grad(
      lambda p: f.apply(p, s, None, x, y)[0]))(params)
  _close(value_and_grad(tracked, state), value_and_grad(plain, plain_state),
         rtol=1e-5, atol=1e-5)


_BN_REFUSAL = "hk.BatchNorm.*per-example gradients.*undefined"


@pytest.mark.parametrize("bn_kw", [{}, {"test_local_stats": True,
                                        "is_training": False}])
def test_training_batch_norm_gram_and_clipped_sum_are_refused(bn_kw):
  f = _pair(lambda x, y: jnp.sum((_bn_body(x, **bn_kw) - y) ** 2))[0]
  x, y = _x(), _x(1, (B, 2))
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  with pytest.raises(ValueError, match=_BN_REFUSAL):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)
  with pytest.raises(ValueError, match=_BN_REFUSAL):
    gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0)(params, state, None,
                                                       x, y)
  with pytest.raises(ValueError, match=_BN_REFUSAL):  # the raw path
    _raw_probe_grad(f, params, state, x, y)


def test_batch_norm_without_parameters_is_refused_too():
  body = lambda x: jnp.sum(hk.BatchNorm(False, False, 0.9)(
      hk.Linear(H)(x), is_training=True))
  f = _pair(body)[0]
  x = _x()
  params, state = f.init(jax.random.PRNGKey(1), x)
  with pytest.raises(ValueError, match=_BN_REFUSAL):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x)


# -- 2. Nothing of a finished call is held ---------------------------------

# (A squared error straight on the op's output: in JAX 0.10.2 a
# VJPHiPrimitive's output fed to some ops, e.g. `jnp.tanh(out)` or
# `out.sum()`, is reported as leaked under jit by JAX's own checker, with a
# plain 10-line VJPHiPrimitive as well; nothing of gram_haiku holds it.)
def _mlp_loss(x, y):
  with gram_haiku.track():
    out = hk.nets.MLP([H, 2])(x)
  return jnp.sum((out - y) ** 2)


def _plain_mlp_loss(x, y):
  return jnp.sum((hk.nets.MLP([H, 2])(x) - y) ** 2)


def test_no_tracer_leaks_under_jit():
  f = hk.transform_with_state(_mlp_loss)
  x, y = _x(), _x(1, (B, 2))
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  value, _ = jax.jit(f.apply)(params, state, None, x, y)
  # (Under the leak checker, which traces slowly: the backward passes that
  # see the whole batch, through the API and through the raw probes.)
  with jax.checking_leaks():
    _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, x, y)
    raw = jax.jit(lambda s: _raw_probe_grad(f, params, s, x, y))(
        gram_haiku.resize_probes(state, B))
  plain = hk.transform_with_state(_plain_mlp_loss)
  _, plain_state = plain.init(jax.random.PRNGKey(1), x, y)
  plain_loss = lambda p, x, y: plain.apply(p, plain_state, None, x, y)[0]
  np.testing.assert_allclose(value, plain_loss(params, x, y), rtol=1e-6)
  _close(grads, jax.jit(jax.grad(plain_loss))(params, x, y), rtol=1e-5)
  ref = reference_gram(plain_loss, params, x, y)
  assert_gram_close(grams.total, ref)
  assert_gram_close(sum(raw.values()), ref)


def test_finished_call_parameters_are_not_held():
  f = hk.transform_with_state(_mlp_loss)
  x, y = _x(), _x(1, (B, 2))
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  params = jax.tree.map(lambda a: a + 0, params)  # only this test holds them
  ref = weakref.ref(params["mlp/~/linear_0"]["w"])
  value = f.apply(params, state, None, x, y)[0]  # eager: arrays in the frame
  raw = _raw_probe_grad(f, params, gram_haiku.resize_probes(state, B), x, y)
  assert float(value) > 0 and all(np.all(np.isfinite(g))
                                  for g in raw.values())
  del params
  gc.collect()
  assert ref() is None, gc.get_referrers(ref())
  held = getattr(ambient._LOCAL, "raw_uses", None)  # pylint: disable=protected-access
  assert held is None or isinstance(held[0], int)


# -- 3a. jax.export with a symbolic sequence length through a Conv1D -------

@pytest.mark.parametrize("stride,padding", [(1, "SAME"), (2, "SAME"),
                                            (2, "VALID")])
def test_conv1d_exports_with_a_symbolic_length(stride, padding):
  # (SAME with stride 2 pads by a symbolic floordiv of the length.)
  tail = lambda o: 0.5 * jnp.sum(jnp.tanh(o) ** 2)
  model = lambda x: hk.Conv1D(4, 3, stride=stride, padding=padding)(x)
  tracked, plain = _pair(lambda x: tail(model(x)))
  x = _x(0, (B, 64, F))
  params, state, plain_state = _init_both(tracked, plain, x)
  vgg = jax.jit(gram_haiku.value_grad_and_gram(tracked.apply))
  # VALID needs t >= 3 said (plain Haiku's export needs it too).
  t_sym = jax.export.symbolic_shape(
      "t", constraints=("t >= 3",) if padding == "VALID" else ())
  spec = jax.ShapeDtypeStruct((B,) + t_sym + (F,), x.dtype)
  exported = jax.export.export(vgg)(params, state, None, spec)
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
  for t in (5, 40):
    xt = _x(t, (B, t, F))
    grams = exported.call(params, state, None, xt)[2]
    assert_gram_close(grams.total, reference_gram(plain_loss, params, xt))


def test_value_hint_of_symbolic_byte_counts():
  a, b = jax.export.symbolic_shape("a, b")
  s = cost_model.SYMBOLIC_SIZE
  assert cost_model.value_hint(7) == 7
  assert cost_model.value_hint(3 * a * b * 4 + 2 * a) == 12 * s * s + 2 * s
  assert cost_model.value_hint((2 * a - 2) // 3 + 1) == (2 * s - 2) // 3 + 1
  assert cost_model.patch_block(4, 36 * a, 4 * a) >= 1


# -- 3b. Pure transforms: nested (hk.lift) and outer -----------------------

def _lifted(lift, inner_transform):
  def loss(x):
    inner = inner_transform(lambda x: hk.Linear(2)(x))
    with gram_haiku.track():
      rng = hk.next_rng_key() if hk.running_init() else None
      if lift in ("lift_with_state", "transparent_lift_with_state"):
        lifter = (hk.lift_with_state if lift == "lift_with_state" else
                  hk.experimental.transparent_lift_with_state)
        kw = {"name": "inner"} if lift == "lift_with_state" else {}
        init, updater = lifter(inner.init, **kw)
        p, s = init(rng, x)
        out, s = inner.apply(p, s, None, x)
        updater.update(s)
      else:
        init = (hk.lift(inner.init, name="inner") if lift == "lift" else
                hk.experimental.transparent_lift(inner.init))
        out = inner.apply(init(rng, x), None, x)
    return jnp.sum(jnp.tanh(out) ** 2)
  return hk.transform_with_state(loss)


@pytest.mark.parametrize("lift", ["lift", "transparent_lift"])
def test_lifted_pure_transform_teaches_lift_with_state(lift):
  f = _lifted(lift, hk.transform)
  with pytest.raises(ValueError, match="(?s)inner hk.transform.*lift_with_state"):
    f.init(jax.random.PRNGKey(1), _x())


@pytest.mark.parametrize("lift", ["lift_with_state",
                                  "transparent_lift_with_state"])
def test_lifted_transform_with_state_is_tracked(lift):
  f = _lifted(lift, hk.transform_with_state)
  x = _x()
  params, state = f.init(jax.random.PRNGKey(1), x)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                        x)
  plain = hk.transform_with_state(
      lambda x: jnp.sum(jnp.tanh(hk.Linear(2)(x)) ** 2))
  (module, inner), = params.items()
  ref = reference_gram(lambda p, x: plain.apply(
      {"linear": p[module]}, {}, None, x)[0], {module: inner}, x)
  assert grams.complete
  assert_gram_close(grams.total, ref)


def test_track_in_hk_transform_teaches_transform_with_state():
  def loss(x):
    with gram_haiku.track():
      return jnp.sum(hk.Linear(2)(x))
  with pytest.raises(ValueError, match="(?s)runs inside hk.transform.*"
                     "transform_with_state"):
    hk.transform(loss).init(jax.random.PRNGKey(1), _x())
  with pytest.raises(ValueError, match=r"apply of hk.transform"):
    gram_haiku.value_grad_and_gram(hk.transform(loss).apply)({}, {}, None,
                                                              _x())


# -- 3c. The arguments of apply --------------------------------------------

def test_argument_slips_get_teaching_errors():
  f = hk.transform_with_state(_mlp_loss)
  x, y = _x(), _x(1, (B, 2))
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  vgg = gram_haiku.value_grad_and_gram(f.apply)
  with pytest.raises(ValueError, match="(?s)state argument is None.*f.init"):
    vgg(params, None, x, y)
  with pytest.raises(ValueError, match="(?s)swapped.*params, state, rng"):
    vgg(state, params, None, x, y)
  with pytest.raises(ValueError, match=r"is an array float32\[\d+, \d+\], "
                     "not the Haiku state"):
    vgg(params, x, None, x, y)
  with pytest.raises(ValueError, match="state argument is None"):
    gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0)(params, None, x, y)
  for name in ("STATE_IS_NONE", "PARAMS_STATE_SWAPPED", "PURE_TRANSFORM_APPLY",
               "TRACK_IN_PURE_TRANSFORM", "TRACK_IN_LIFTED_PURE_TRANSFORM",
               "FROZEN_NAME_CLASH", "MEAN_LOSS_CLIPPED"):
    assert "What to do:" in getattr(errors, name)


# -- 3d. frozen= and two modules that run under one layer name -------------

def _stack_model(head_name):
  def loss(x, y):
    with gram_haiku.track():
      h = hk.Linear(H, name=head_name)(x)
      h = hk.layer_stack(2)(lambda h: jnp.tanh(hk.Linear(H)(h)))(h)
    return jnp.sum((h - y) ** 2)
  return hk.transform_with_state(loss)


def test_frozen_name_clash_names_both_modules():
  f = _stack_model("linear")
  x, y = _x(), _x(1, (B, H))
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  stacked = next(m for m in params if m != "linear")
  with pytest.raises(ValueError, match=(
      rf"(?s)'{stacked}' \(frozen: \['w'\]\) and 'linear' \(frozen: \[\]\).*"
      r"distinct names")):
    gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0,
                            frozen=f"{stacked}/w")(params, state, None, x, y)


def test_shared_and_unshared_modules_under_one_layer_name_refused():
  # The layer-stacked module is applied twice per layer (per-example
  # gradients), the outer one once (a Gram); track() sees one layer name
  # "linear" for both, so it could not tell them which to keep.
  def loss(x, y):
    with gram_haiku.track():
      h = hk.Linear(H, name="linear")(x)
      def body(h):
        lin = hk.Linear(H)
        return lin(jnp.tanh(lin(h)))
      h = hk.layer_stack(2)(body)(h)
    return jnp.sum((h - y) ** 2)
  f = hk.transform_with_state(loss)
  x, y = _x(), _x(1, (B, H))
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  stacked = next(m for m in params if m != "linear")
  with pytest.raises(ValueError, match=(
      rf"(?s)layer name 'linear' belongs to .*\['{stacked}'\].*"
      r"\['linear'\].*distinct names")):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)


def test_frozen_with_distinct_names_matches_plain_gradient():
  f = _stack_model("head")
  x, y = _x(), _x(1, (B, H))
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  grads = gram_haiku.clipped_grad(f.apply, l2_clip_norm=1e6,
                                  frozen="head/w")(params, state, None, x, y)
  plain = jax.grad(lambda p: f.apply(p, state, None, x, y)[0])(params)
  np.testing.assert_array_equal(grads["head"]["w"], 0.0)
  plain["head"]["w"] = jnp.zeros_like(plain["head"]["w"])
  _close(grads, plain, rtol=1e-5, atol=1e-5)


# -- 3e. An empty batch ----------------------------------------------------

def _stack_body(x):
  return hk.layer_stack(2)(lambda h: jnp.tanh(hk.Linear(F)(h)))(x)


_EMPTY_MODELS = {
    "Linear": (lambda x: hk.Linear(2)(x), (F,)),
    "MLP": (lambda x: hk.nets.MLP([H, 2])(x), (F,)),
    "layer_stack": (_stack_body, (F,)),
    "Conv1D": (lambda x: hk.Conv1D(2, 3)(x), (6, F)),
}


def _empty_case(name, mode):
  body, example = _EMPTY_MODELS[name]
  tail = lambda o: 0.5 * jnp.sum(jnp.tanh(o) ** 2)
  def tracked(x):
    with gram_haiku.track(mode=mode):
      return tail(body(x))
  f = hk.transform_with_state(tracked)
  x = _x(0, (3,) + example)
  params, state = f.init(jax.random.PRNGKey(1), x)
  return f, params, state, x[:0]


@pytest.mark.parametrize("mode", ["gram", "norms"])
@pytest.mark.parametrize("name", sorted(_EMPTY_MODELS))
def test_empty_batch_after_init(name, mode):
  f, params, state, empty = _empty_case(name, mode)
  value, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, empty)
  assert float(value) == 0.0
  assert grams.norms.shape == (0,)
  if mode == "gram":
    assert grams.total.shape == (0, 0)
  zeros = jax.tree.map(jnp.zeros_like, params)
  _close(grads, zeros, 0, 0)
  _close(jax.grad(lambda p: f.apply(p, state, None, empty)[0])(params),
         zeros, 0, 0)


@pytest.mark.parametrize("name", ["Linear", "MLP", "layer_stack", "Conv1D"])
def test_empty_batch_clipped_sum_is_zero(name):
  f, params, state, empty = _empty_case(name, "norms")
  grads = gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0)(
      params, state, None, empty)
  _close(grads, jax.tree.map(jnp.zeros_like, params), 0, 0)


# -- 3f. A mean loss given to clipped_grad ---------------------------------

_REDUCTIONS = {
    "sum": lambda per: per.sum(),
    "sum scaled by 3": lambda per: per.sum() / 3.0,
    "mean": lambda per: per.sum(1).mean(),
    "sum / B": lambda per: per.sum() / per.shape[0],
    "sum * (1 / B)": lambda per: per.sum() * (1.0 / per.shape[0]),
    "token mean": lambda per: per.mean(),
    "mean in a jit": lambda per: jax.jit(lambda p: p.sum(1).mean())(per),
}


def _reduced(name):
  def loss(x, y):
    with gram_haiku.track():
      out = hk.Linear(2)(x)
    return _REDUCTIONS[name]((out - y) ** 2)
  return hk.transform_with_state(loss)


@pytest.mark.parametrize("name", sorted(_REDUCTIONS))
def test_clipped_grad_warns_on_a_mean_loss_only(name):
  f = _reduced(name)
  x, y = _x(), _x(1, (B, 2))
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    grads = gram_haiku.clipped_grad(f.apply, l2_clip_norm=0.5)(
        params, state, None, x, y)
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)
  mean = [w for w in caught if issubclass(w.category,
                                          loss_scale.MeanLossWarning)]
  is_mean = name not in ("sum", "sum scaled by 3")
  assert len(mean) == int(is_mean), [str(w.message) for w in caught]
  if is_mean:
    assert "looks like a mean over the 4 examples" in str(mean[0].message)
    assert mean[0].filename == __file__  # the user's line
  # The clipped sum is what it is either way: sum_i min(1, C/|g_i|) g_i of
  # the per-example contributions to the loss as written.
  plain = hk.transform_with_state(
      lambda x, y: _REDUCTIONS[name]((hk.Linear(2)(x) - y) ** 2))
  # (the reference evaluates each example as a batch of one, where a mean
  # over the batch divides by 1)
  scale = 1 / B if is_mean else 1.0
  one = lambda p, x, y: plain.apply(p, {}, None, x, y)[0]
  per = per_example_grads(one, params, x, y) * scale
  norms = np.linalg.norm(np.asarray(per, np.float64), axis=1)
  c = np.minimum(1.0, 0.5 / norms)
  flat = np.concatenate([np.ravel(g) for g in jax.tree.leaves(grads)])
  np.testing.assert_allclose(flat, c @ np.asarray(per, np.float64),
                             rtol=1e-4, atol=1e-6)
