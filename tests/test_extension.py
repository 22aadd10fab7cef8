"""The documented extension path: a third party's rule, module and handler
(``conformance/examples/scaled_linear.py``) inside ``track()``, against the
reference (the rule's own families, every dtype included, run in
tests/test_conformance_example.py); the deprecated ways to write an op
(``GramOp``, ``GramFunction``, top-level ``gram_*``, a binder function given
to ``LayerCall.apply``) still work for one release, and warn."""

import dataclasses
import re

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import gram_haiku
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import reference_gram
from gram_haiku.conformance.examples import scaled_linear
from tests import problems


def _model(x):
  h = jnp.tanh(scaled_linear.ScaledLinear(6)(x))
  return hk.Linear(3)(h)


def _problem(seed=0, b=7):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return problems.normal(kx, (b, 4, 5)), problems.normal(ky, (b, 4, 3))


def _losses():
  def tracked(x, y):
    with gram_haiku.track():
      out = _model(x)
    return 0.5 * jnp.sum((out - y) ** 2)

  def plain(x, y):
    return 0.5 * jnp.sum((_model(x) - y) ** 2)
  return hk.transform_with_state(tracked), hk.transform(plain)


@pytest.mark.parametrize("jit", problems.JIT_CASES)
def test_registered_module_gram_matches_reference(jit):
  x, y = _problem()
  tracked, plain = _losses()
  params, state = jax.jit(tracked.init)(jax.random.PRNGKey(1), x, y)
  vgg = gram_haiku.value_grad_and_gram(tracked.apply)
  if jit:
    vgg = jax.jit(vgg)
  _, grads, grams = vgg(params, state, None, x, y)
  ref = reference_gram(lambda p, x, y: plain.apply(p, None, x, y), params, x,
                       y)
  assert_gram_close(grams.total, ref)
  assert set(grams.by_layer) == {"scaled_linear", "linear"}
  cov = grams.coverage
  assert cov["scaled_linear/w"].rule == "scaled_linear_handler"
  assert cov["scaled_linear/s"].tracked and grams.complete
  want = jax.grad(lambda p: plain.apply(p, None, x, y))(params)
  for k in ("w", "s"):
    assert jnp.allclose(grads["scaled_linear"][k], want["scaled_linear"][k],
                        rtol=1e-5, atol=1e-6)


def test_registered_module_under_hk_vmap():
  x, y = _problem(seed=2)
  def tracked(x, y):
    with gram_haiku.track():
      out = hk.vmap(_model, split_rng=False)(x)
    return 0.5 * jnp.sum((out - y) ** 2)
  f = hk.transform_with_state(tracked)
  _, plain = _losses()
  params, state = jax.jit(f.init)(jax.random.PRNGKey(1), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                        x, y)
  ref = reference_gram(lambda p, x, y: plain.apply(p, None, x, y), params, x,
                       y)
  assert_gram_close(grams.total, ref)


def test_untracked_forward_is_the_plain_module():
  x, _ = _problem(seed=3)
  f = hk.transform(lambda x: scaled_linear.ScaledLinear(6)(x))
  params = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  assert set(params["scaled_linear"]) == {"w", "s"}
  want = params["scaled_linear"]["s"] * x @ params["scaled_linear"]["w"]
  assert jnp.allclose(f.apply(params, None, x), want, rtol=1e-6, atol=1e-6)


def _bilinear(x, w):
  """``y = (x @ w) * x[..., :1]``: not a linear layer, one parameter."""
  return jnp.dot(x, w) * x[..., :1]


def _bilinear_gram(x, g, params, example_dim, cfg=None):
  """Closed form: ``dL_i/dw = sum_t (x_it * x_it0)^T g_it`` (ghost form)."""
  del params, cfg
  x = jnp.moveaxis(x, example_dim, 0).astype(jnp.float32)
  g = jnp.moveaxis(g, example_dim, 0).astype(jnp.float32)
  u = (x * x[..., :1]).reshape(x.shape[0], -1, x.shape[-1])
  g = g.reshape(g.shape[0], -1, g.shape[-1])
  hi = jax.lax.Precision.HIGHEST
  ku = jnp.einsum("itn,jsn->ijts", u, u, precision=hi)
  kg = jnp.einsum("itm,jsm->ijts", g, g, precision=hi)
  return jnp.sum(ku * kg, axis=(2, 3))


@pytest.mark.parametrize("closed_form", [False, True])
def test_a_rule_is_two_functions(closed_form):
  """A third-party rule as ``forward`` plus an optional Gram function; the
  Gram function alone is checked against the reference without a
  primitive, then the op is."""
  kx, kw, kg = jax.random.split(jax.random.PRNGKey(3), 3)
  x = problems.normal(kx, (6, 4, 5))
  w = problems.normal(kw, (5, 3))
  ref = reference_gram(lambda w, xi: 0.5 * jnp.sum(jnp.tanh(_bilinear(xi, w))
                                                   ** 2), w, x)
  # The pure Gram function, on the cotangent of that loss.
  out, vjp = jax.vjp(lambda y: 0.5 * jnp.sum(jnp.tanh(y) ** 2),
                     _bilinear(x, w))
  del out
  (g,) = vjp(jnp.ones(()))
  assert_gram_close(_bilinear_gram(x, g, (w,), 0), ref)
  rule = gram_haiku.Rule(forward=_bilinear, param_names=("w",),
                         feature_ndim=1,
                         gram=_bilinear_gram if closed_form else None)

  def loss(w, probe):
    y = gram_haiku.ops.bind(rule, x, (w,), probe, name="bilinear")
    return 0.5 * jnp.sum(jnp.tanh(y) ** 2)
  gram = jax.jit(jax.grad(loss, argnums=1))(w, jnp.zeros((6, 6)))
  assert_gram_close(gram, ref)
  jaxpr = str(jax.make_jaxpr(loss)(w, jnp.zeros((6, 6))))
  assert ("_bilinear_gram" in jaxpr) == closed_form


# -- handlers and rules that go wrong: teaching errors -------------------------


class _Gained(hk.Module):
  """``g * (x @ w)``: two parameters, for handlers that misuse one."""

  def __call__(self, x):
    w = hk.get_parameter("w", [x.shape[-1], 3], init=jnp.ones)
    g = hk.get_parameter("g", [], init=jnp.ones)
    return g * jnp.dot(x, w)


def _linear_op(x, w, probe, **kwargs):
  """The deprecated form of ``LayerCall.apply``'s first argument: a function
  that binds a Gram op itself."""
  return gram_haiku.ops.gram_linear(x, w, None, probe, **kwargs)


_LINEAR = gram_haiku.ops.linear_rule()


@pytest.mark.parametrize("misuse", ["gain_outside", "in_the_input"])
def test_a_handler_that_applies_a_parameter_outside_its_op(misuse):
  # The raw path refuses the probe's gradient (its Gram would miss g's);
  # value_grad_and_gram reads the use from the traced program and refuses.
  @gram_haiku.register_layer(_Gained)
  def handler(call, module, x):
    w = hk.get_parameter("w", [x.shape[-1], 3], init=jnp.ones)
    g = hk.get_parameter("g", [], init=jnp.ones)
    if misuse == "gain_outside":
      return g * call.apply(_LINEAR, x, (w, None))
    return call.apply(_LINEAR, x + g, (w, None))
  del handler
  x = problems.normal(jax.random.PRNGKey(1), (5, 4))

  def tracked(x):
    with gram_haiku.track():
      return jnp.sum(jnp.tanh(_Gained()(x)))
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  state = gram_haiku.resize_probes(state, 5)
  with pytest.raises(ValueError, match="does not give to its Gram op"):
    jax.grad(lambda s: f.apply(params, s, None, x)[0])(state)
  with pytest.raises(ValueError, match="outside every tracked layer"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x)


def _tuple_out(x, w, s):
  return s * jnp.dot(x, w), w


def _first_row_gram(x, g, params, example_dim, cfg):
  return scaled_linear.scaled_linear_gram(x, g, params, example_dim, cfg)[0]


_TUPLE_OUT = gram_haiku.Rule(forward=_tuple_out, param_names=("w", "s"))
_WRONG_SHAPE = dataclasses.replace(scaled_linear.RULE, gram=_first_row_gram)


def test_sloppy_rules_get_errors_that_name_the_layer():
  x = problems.normal(jax.random.PRNGKey(2), (4, 5))
  w, s = jnp.ones((5, 3)), jnp.asarray(2.0)
  with pytest.raises(TypeError,
                     match=r"\(layer 'layer_a'\) must return one array"):
    gram_haiku.ops.bind(_TUPLE_OUT, x, (w, s), jnp.zeros((4, 4)),
                        name="layer_a")
  with pytest.raises(TypeError, match="A rule needs at least forward"):
    gram_haiku.Rule(forward=None, param_names=("w",))
  with pytest.raises(TypeError, match=r"takes parameters \('w', 's'\), got "
                     r"1"):
    gram_haiku.ops.bind(scaled_linear.RULE, x, (w,), jnp.zeros((4, 4)),
                        name="layer_b")
  with pytest.raises(ValueError, match=r"'layer_c' returned shape \(4,\), "
                     r"expected \(4, 4\)"):
    jax.grad(lambda p: jnp.sum(gram_haiku.ops.bind(
        _WRONG_SHAPE, x, (w, s), p, name="layer_c")))(jnp.zeros((4, 4)))


def test_layer_call_takes_a_tuple_of_parameters():
  @gram_haiku.register_layer(_Gained)
  def handler(call, module, x):
    del module
    w = hk.get_parameter("w", [x.shape[-1], 3], init=jnp.ones)
    return call.apply(_LINEAR, x, {"w": w})
  del handler
  f = hk.transform_with_state(lambda x: _tracked_gained(x))
  with pytest.raises(TypeError, match="params must be a tuple"):
    f.init(jax.random.PRNGKey(0), jnp.ones((4, 5)))


def _tracked_gained(x):
  with gram_haiku.track():
    return jnp.sum(_Gained()(x))


class _Subclass(scaled_linear.ScaledLinear):
  """Inherits ``__call__``: its own registered handler must run."""


def test_a_registered_subclass_that_inherits_call_gets_its_handler():
  seen = []

  @gram_haiku.register_layer(_Subclass)
  def handler(call, module, x):
    seen.append(type(module))
    return scaled_linear.scaled_linear_handler(call, module, x)
  del handler
  x, y = _problem(3, b=5)

  def body(x, y):
    return 0.5 * jnp.sum((_Subclass(3)(x) - y) ** 2)

  def tracked(x, y):
    with gram_haiku.track():
      return body(x, y)
  f = hk.transform_with_state(tracked)
  g = hk.without_apply_rng(hk.transform(body))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                         x, y)
  assert seen and all(t is _Subclass for t in seen)
  (w_name,) = [k for k in grams.coverage if k.endswith("/w")]
  assert grams.coverage[w_name].rule == "handler"
  assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))


# -- the deprecated ways to write an op: they work, and warn -------------------

_DEPRECATED = {
    "GramOp": "gram_haiku.ops.bind", "GramFunction": "gram_haiku.ops.bind",
    "gram_linear": "gram_haiku.ops.gram_linear",
    "gram_conv": "gram_haiku.ops.gram_conv",
    "gram_conv_transpose": "gram_haiku.ops.gram_conv_transpose",
    "gram_embed": "gram_haiku.ops.gram_embed",
    "gram_affine": "gram_haiku.ops.gram_affine",
}


@pytest.mark.parametrize("name", sorted(_DEPRECATED))
def test_a_deprecated_name_warns_naming_its_replacement(name):
  assert name not in gram_haiku.__all__
  with pytest.warns(DeprecationWarning,
                    match=rf"gram_haiku\.{name} is deprecated.*use .*"
                    rf"{re.escape(_DEPRECATED[name])}"):
    obj = getattr(gram_haiku, name)
  if name.startswith("gram_"):
    assert obj is getattr(gram_haiku.ops, name)
  with pytest.warns(DeprecationWarning):  # Every access, not the first only.
    getattr(gram_haiku, name)


def _shifted_reference(x, w, c):
  return reference_gram(
      lambda p, xi: 0.5 * jnp.sum(jnp.tanh(jnp.dot(xi, p[0]) * 2.0 + p[1])
                                  ** 2), (w, c), x)


def _legacy_op_class():
  with pytest.warns(DeprecationWarning):
    base = gram_haiku.GramOp

  class ShiftedLinearOp(base):
    """The old lower-level way: an op class whose methods are the rule's,
    reading a layer parameter (``gain``) as an attribute."""
    param_names = ("w", "c")

    def forward(self, x, w, c):
      return jnp.dot(x, w) * self.gain + c

    def gram(self, x, g, params, example_dim, cfg):
      # The default Gram (from exact per-example gradients), by the base.
      return super().gram(x, g, params, example_dim, cfg)
  return ShiftedLinearOp


def test_a_deprecated_gram_op_subclass_still_gives_its_gram():
  op_cls = _legacy_op_class()
  x = problems.normal(jax.random.PRNGKey(5), (6, 3, 4))
  w = problems.normal(jax.random.PRNGKey(6), (4, 2))
  c = jnp.asarray(0.5)

  def loss(probe):
    y = op_cls.apply(x, (w, c), probe, name="shifted", gain=2.0)
    return 0.5 * jnp.sum(jnp.tanh(y) ** 2)
  gram = jax.jit(jax.grad(loss))(jnp.zeros((6, 6)))
  assert_gram_close(gram, _shifted_reference(x, w, c))

  class NoForward(op_cls.__mro__[1]):
    param_names = ("w",)
  with pytest.raises(NotImplementedError, match="must define forward"):
    NoForward.apply(x, (w,), jnp.zeros((6, 6)), name="layer_b")


def test_a_deprecated_gram_function_still_binds_a_rule():
  with pytest.warns(DeprecationWarning):
    gram_function = gram_haiku.GramFunction
  kx, kw = jax.random.split(jax.random.PRNGKey(3))
  x, w = problems.normal(kx, (5, 2, 4)), problems.normal(kw, (4, 3))
  ref = reference_gram(lambda w, xi: 0.5 * jnp.sum(jnp.tanh(_bilinear(xi, w))
                                                   ** 2), w, x)
  rule = gram_haiku.Rule(forward=_bilinear, param_names=("w",),
                         gram=_bilinear_gram)

  class WithRule(gram_function):
    rule = gram_haiku.Rule(forward=_bilinear, param_names=("w",))

  binders = {
      "rule": lambda p: gram_function.apply(x, (w,), p, rule=rule,
                                            name="bilinear"),
      "keywords": lambda p: gram_function.apply(
          x, (w,), p, name="bilinear", fn=_bilinear, param_names=("w",),
          gram_fn=lambda *a: _bilinear_gram(*a)),
      "subclass": lambda p: WithRule.apply(x, (w,), p, name="bilinear"),
  }
  for how, bind in binders.items():
    gram = jax.grad(lambda p: 0.5 * jnp.sum(jnp.tanh(bind(p)) ** 2))(
        jnp.zeros((5, 5)))
    assert_gram_close(gram, ref, what=how)
  with pytest.raises(TypeError, match="needs rule="):
    gram_function.apply(x, (w,), jnp.zeros((5, 5)), name="nothing")


def test_a_binder_function_given_to_layer_call_warns_and_works():
  @gram_haiku.register_layer(_Gained)
  def handler(call, module, x):
    del module
    w = hk.get_parameter("w", [x.shape[-1], 3], init=jnp.ones)
    return call.apply(_linear_op, x, (w,))
  del handler
  x = problems.normal(jax.random.PRNGKey(4), (5, 4))

  def tracked(x):
    with gram_haiku.track():
      return 0.5 * jnp.sum(jnp.tanh(_Gained()(x)) ** 2)
  f = hk.transform_with_state(tracked)
  with pytest.warns(DeprecationWarning, match="pass the layer's "
                    "gram_haiku.Rule"):
    params, state = f.init(jax.random.PRNGKey(0), x)
  with pytest.warns(DeprecationWarning):
    _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state,
                                                          None, x)
  (w,) = jax.tree.leaves(params)
  assert_gram_close(grams.total, reference_gram(
      lambda w, xi: 0.5 * jnp.sum(jnp.tanh(jnp.dot(xi, w)) ** 2), w, x))


class _Twice(hk.Module):
  """``x @ w``, for a handler in the deprecated form applied twice."""

  def __call__(self, x):
    return jnp.dot(x, hk.get_parameter("w", [x.shape[-1], 3], init=jnp.ones))


def test_a_binder_function_is_refused_like_a_rule_on_the_raw_path():
  # The op the deprecated form binds gets track()'s refusal too (here: a
  # module applied twice on the raw jax.grad path), not a Gram without
  # cross terms.
  @gram_haiku.register_layer(_Twice)
  def handler(call, module, x):
    del module
    w = hk.get_parameter("w", [x.shape[-1], 3], init=jnp.ones)
    return call.apply(_linear_op, x, (w,))
  del handler
  x = problems.normal(jax.random.PRNGKey(5), (5, 4))

  def tracked(x):
    with gram_haiku.track():
      layer = _Twice()
      return jnp.sum(jnp.tanh(layer(x)) ** 2 + layer(x / 2))
  f = hk.transform_with_state(tracked)
  with pytest.warns(DeprecationWarning):
    params, state = f.init(jax.random.PRNGKey(0), x)
    with pytest.raises(ValueError, match="was called more than once"):
      jax.grad(lambda s: f.apply(params, s, None, x)[0])(state)
