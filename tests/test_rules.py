"""Every built-in rule's pure functions, on plain arrays, against the
reference: ``F @ F.T`` with ``F`` the flattened per-example gradients from
``jax.vmap(jax.grad(...))`` of the rule's own ``forward``, no primitive
involved. Then a third-party rule (``forward`` plus a Gram function), alone
and bound to a primitive, under ``jax.grad``, ``jit`` and ``vmap``."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.compute.kernels import KernelConfig
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.ops import affine
from gram_haiku._src.ops import conv
from gram_haiku._src.ops import embed
from gram_haiku._src.ops import linear
from gram_haiku._src.rules import rule as rule_lib
from tests import problems

HI = jax.lax.Precision.HIGHEST


def _keys(seed, n):
  return jax.random.split(jax.random.PRNGKey(seed), n)


def reference_flat(forward, x, g, params, example_dim):
  """``[B, P]`` per-example gradients of ``sum(forward(x_i) * g_i)`` over
  the present parameters, by ``vmap(grad)``, in float64."""
  present = [i for i, p in enumerate(params) if p is not None]

  def loss(ps, xi, gi):
    full = list(params)
    for i, p in zip(present, ps):
      full[i] = p
    return jnp.sum(forward(xi, *full) * gi)
  grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, example_dim,
                                                     example_dim)))(
      [params[i] for i in present], x, g)
  return np.concatenate([np.asarray(a, np.float64).reshape(a.shape[0], -1)
                         for a in grads], axis=1)


def _cotangent(seed, forward, x, params):
  y = jax.eval_shape(forward, x, *params)
  return problems.normal(jax.random.PRNGKey(seed), y.shape)


def check_rule(rule, x, params, example_dim, gram_methods, norm_methods,
               seed=0):
  """The rule's Gram, norms and per-example gradients (and its fused form,
  in every mode) equal the reference, for each method.

  The rule's functions run in one jitted program (as in a backward pass,
  where they are always traced): one compile instead of one per primitive.
  """
  g = _cotangent(seed, rule.forward, x, params)
  f = reference_flat(rule.forward, x, g, params, example_dim)
  assert np.abs(f).max() > 0  # never a vacuous comparison
  ref = f @ f.T
  present = tuple(i for i, p in enumerate(params) if p is not None)
  fused_modes = (("gram", gram_methods), ("norms", norm_methods),
                 ("per_example", ("materialize",)))

  @jax.jit
  def values(x, g, params):
    out = {}
    for method in gram_methods:
      out[f"gram/{method}"] = rule_lib.gram_of(
          rule, x, g, params, example_dim, KernelConfig(method=method))
    for method in norm_methods:
      out[f"norms/{method}"] = rule_lib.sq_norms_of(
          rule, x, g, params, example_dim, KernelConfig(method=method))
    out["pe"] = rule_lib.flat(
        rule_lib.per_example_grads_of(rule, x, g, params, example_dim))
    if rule.probe_cotangent_and_grads is not None:
      for mode, methods in fused_modes:
        for method in methods:
          out[f"fused/{mode}/{method}"] = rule.probe_cotangent_and_grads(
              x, g, params, example_dim, mode, present,
              KernelConfig(method=method))
    return out
  got = values(x, g, params)
  for method in gram_methods:
    assert_gram_close(got[f"gram/{method}"], ref, what=f"gram ({method})")
  for method in norm_methods:
    assert_gram_close(got[f"norms/{method}"], np.diag(ref),
                      what=f"sq_norms ({method})")
  assert_gram_close(got["pe"], f, what="per_example_grads")
  if rule.probe_cotangent_and_grads is not None:
    want = {"gram": ref, "norms": np.diag(ref), "per_example": f}
    sums = np.split(f.sum(axis=0), np.cumsum(
        [params[i].size for i in present])[:-1])
    for mode, methods in fused_modes:
      for method in methods:
        value, provided = got[f"fused/{mode}/{method}"]
        assert_gram_close(value, want[mode], what=f"{mode} ({method})")
        for i, ct in provided.items():
          k = present.index(i)
          assert ct.shape == params[i].shape and ct.dtype == params[i].dtype
          assert_gram_close(ct.reshape(-1), sums[k], what=f"provided {i}")
  if rule.cost is not None:
    structs = [None if p is None else jax.ShapeDtypeStruct(p.shape, p.dtype)
               for p in params]
    for mode in ("gram", "norms"):
      method = rule.cost(jax.ShapeDtypeStruct(x.shape, x.dtype),
                         jax.ShapeDtypeStruct(g.shape, g.dtype), structs,
                         example_dim, KernelConfig(), mode=mode,
                         strategy="auto", reuse=True)
      assert method in set(gram_methods) | set(norm_methods)


# -- linear --------------------------------------------------------------------


LINEAR_CASES = [
    pytest.param((6, 4), 0, True, id="2d"),
    pytest.param((6, 1, 4), 0, True, id="one_position"),
    pytest.param((6, 3, 4), 0, False, id="sequence-no_bias"),
    pytest.param((3, 6, 4), 1, True, id="sequence-example_dim1"),
    pytest.param((5, 2, 3, 4), 0, True, id="two_within_axes"),
    pytest.param((2, 5, 3, 4), 1, False, id="two_within_axes-example_dim1"),
]


@pytest.mark.parametrize("shape,example_dim,bias", LINEAR_CASES)
def test_linear_rule(shape, example_dim, bias):
  kx, kw, kb = _keys(len(shape) + 10 * example_dim, 3)
  x = problems.normal(kx, shape)
  w = problems.normal(kw, (shape[-1], 3))
  b = problems.normal(kb, (3,)) if bias else None
  methods = ("ghost", "materialize", None)
  check_rule(linear.linear_rule(), x, (w, b), example_dim, methods, methods)


def test_linear_rule_with_a_frozen_weight_is_the_bias_term():
  kx, kb = _keys(7, 2)
  x = problems.normal(kx, (5, 3, 4))
  b = problems.normal(kb, (2,))
  rule = linear.linear_rule(HI)
  g = _cotangent(8, rule.forward, x, (jnp.ones((4, 2)), b))
  f = reference_flat(rule.forward, x, g, (jnp.ones((4, 2)), b), 0)[:, -2:]
  assert_gram_close(rule.gram(x, g, (None, b), 0, KernelConfig()), f @ f.T)
  assert_gram_close(rule.sq_norms(x, g, (None, b), 0, KernelConfig()),
                    np.sum(f * f, axis=1))


def test_linear_cost_follows_the_strategy():
  x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)
  g = jax.ShapeDtypeStruct((8, 16, 4), jnp.float32)
  for strategy in ("ghost", "materialize"):
    assert linear.cost(x, g, (None, None), 0, KernelConfig(), mode="gram",
                       strategy=strategy) == strategy
  assert linear.cost(x, g, (None, None), 0, KernelConfig(),
                     mode="per_example") == "materialize"


# -- affine (norm layers, hk.Bias) ---------------------------------------------


AFFINE_CASES = [
    pytest.param((6, 5), (5,), (5,), None, 0, id="per_channel"),
    pytest.param((6, 3, 5), (5,), (5,), None, 0, id="sequence"),
    pytest.param((3, 6, 5), (5,), None, None, 1, id="scale_only-example_dim1"),
    pytest.param((6, 3, 5), (3, 5), (3, 5), None, 0, id="two_param_axes"),
    pytest.param((6, 3, 5), (1, 5), (3, 1), None, 0, id="broadcast_axes"),
    pytest.param((6, 3, 5), None, (5,), 2.5, 0, id="bias_multiplier"),
]


@pytest.mark.parametrize("shape,scale,offset,mult,example_dim",
                         AFFINE_CASES)
def test_affine_rule(shape, scale, offset, mult, example_dim):
  kx, ks, ko = _keys(len(shape) + (scale is None), 3)
  x = problems.normal(kx, shape)
  params = (None if scale is None else problems.normal(ks, scale),
            None if offset is None else problems.normal(ko, offset))
  ndim = max(len(p) for p in (scale, offset) if p is not None)
  rule = affine.affine_rule(feature_ndim=ndim, offset_multiplier=mult)
  check_rule(rule, x, params, example_dim, (None,), (None,))


# -- embed ---------------------------------------------------------------------


EMBED_CASES = [
    # (ids shape, example_dim, vocab, style, ids dtype)
    pytest.param((6, 5), 0, 7, "ARRAY_INDEX", jnp.int32, id="index"),
    pytest.param((4, 6), 1, 7, "ARRAY_INDEX", jnp.int32,
                 id="index-example_dim1"),
    pytest.param((6, 2, 3), 0, 5, "ONE_HOT", jnp.int32, id="one_hot"),
    pytest.param((6, 5), 0, 300, "ONE_HOT", jnp.int8, id="one_hot-wrapping"),
]


@pytest.mark.parametrize("shape,example_dim,vocab,style,dtype", EMBED_CASES)
def test_embed_rule(shape, example_dim, vocab, style, dtype):
  ki, ke = _keys(vocab + len(shape), 2)
  lo, hi = max(-vocab - 2, int(jnp.iinfo(dtype).min)), min(
      vocab + 2, int(jnp.iinfo(dtype).max) + 1)
  # Repeated ids within an example, negative ids, and ids out of range.
  ids = problems.randint(ki, shape, lo, hi).astype(dtype)
  table = problems.normal(ke, (vocab, 4))
  rule = embed.embed_rule(lookup_style=style, precision=HI)
  check_rule(rule, ids, (table,), example_dim,
             ("ghost", "dense", "segment", None), ("ghost", "segment", None))


def test_embed_rule_scalar_ids_clamp():
  # One scalar id per example (the module under vmap over every axis):
  # out-of-range ids read (and get the gradient of) the clamped row.
  ki, ke = _keys(3, 2)
  ids = problems.randint(ki, (8,), -9, 9)
  table = problems.normal(ke, (5, 3))
  rule = embed.embed_rule(scalar_ids=True)
  check_rule(rule, ids, (table,), 0, ("ghost", "dense", "segment", None),
             ("ghost", "segment"))


def test_embed_factors_exact_bounds_the_vocabulary():
  rule = embed.embed_rule()
  ids = jax.ShapeDtypeStruct((4, 3), jnp.int32)
  small = (jax.ShapeDtypeStruct((2 ** 10, 8), jnp.float32),)
  large = (jax.ShapeDtypeStruct((2 ** 25, 8), jnp.float32),)
  assert rule.factors_exact(ids, small, jnp.float32)
  assert not rule.factors_exact(ids, large, jnp.float32)


# -- conv ----------------------------------------------------------------------


CONV_CASES = [
    # (x shape, w shape, bias shape, spec fields, example_dim)
    pytest.param((5, 9, 3), (3, 3, 4), (4,),
                 dict(num_spatial_dims=1, stride=(2,), rate=(1,)), 0,
                 id="1d-stride2"),
    pytest.param((5, 7, 7, 4), (3, 3, 2, 6), None,
                 dict(num_spatial_dims=2, stride=(1, 1), rate=(2, 2),
                      padding="VALID", feature_group_count=2), 0,
                 id="2d-rate2-groups2"),
    pytest.param((4, 4, 6, 5), (2, 2, 4, 3), (3, 1, 1),
                 dict(num_spatial_dims=2, channels_last=False, stride=(1, 2),
                      rate=(1, 1), padding=((1, 0), (0, 2))), 0,
                 id="2d-channels_first-explicit_padding"),
    pytest.param((4, 5, 5, 3), (3, 3, 4, 3), (4,),
                 dict(num_spatial_dims=2, transpose=True, stride=(2, 2),
                      rate=(1, 1)), 0, id="2d-transpose"),
    pytest.param((4, 2, 8, 3), (3, 3, 2), (2,),
                 dict(num_spatial_dims=1, stride=(1,), rate=(1,)), 0,
                 id="1d-within_axis"),
    pytest.param((2, 4, 8, 3), (3, 3, 2), None,
                 dict(num_spatial_dims=1, stride=(1,), rate=(1,)), 1,
                 id="1d-within_axis-example_dim1"),
]


@pytest.mark.parametrize("x_shape,w_shape,b_shape,fields,example_dim",
                         CONV_CASES)
def test_conv_rule(x_shape, w_shape, b_shape, fields, example_dim):
  kx, kw, kb = _keys(len(x_shape) + sum(w_shape), 3)
  x = problems.normal(kx, x_shape)
  params = (problems.normal(kw, w_shape),
            None if b_shape is None else problems.normal(kb, b_shape))
  rule = conv.conv_rule(**fields)
  methods = ("ghost", "materialize", "materialize_by_group", None)
  check_rule(rule, x, params, example_dim, methods, methods)


# -- a third party's rule: forward plus a Gram function ------------------------


def _gain_forward(x, w, s):
  """``y = s * (x @ w)``: a linear map with a learned scalar gain."""
  return s * jnp.dot(x, w, precision=HI)


def _gain_gram(x, g, params, example_dim, cfg):
  """The Gram of ``(dw_i, ds_i)``: ``dw_i = s sum_t x_it^T g_it`` (ghost
  form) and ``ds_i = sum_t <x_it @ w, g_it>``."""
  del cfg
  w, s = params
  x = jnp.moveaxis(x, example_dim, 0)
  g = jnp.moveaxis(g, example_dim, 0)
  x = x.reshape(x.shape[0], -1, x.shape[-1])
  g = g.reshape(g.shape[0], -1, g.shape[-1])
  kx = jnp.einsum("itn,jsn->ijts", x, x, precision=HI)
  kg = jnp.einsum("itm,jsm->ijts", g, g, precision=HI)
  ds = jnp.einsum("itn,nm,itm->i", x, w, g, precision=HI)
  return s ** 2 * jnp.sum(kx * kg, axis=(2, 3)) + jnp.outer(ds, ds)


GAIN = gram_haiku.Rule(forward=_gain_forward, param_names=("w", "s"),
                       gram=_gain_gram)


def _gain_problem(seed, shape=(6, 3, 4)):
  kx, kw = _keys(seed, 2)
  return (problems.normal(kx, shape), problems.normal(kw, (shape[-1], 2)),
          jnp.asarray(1.7))


@pytest.mark.parametrize("example_dim", [0, 1])
def test_third_party_rule_without_a_primitive(example_dim):
  x, w, s = _gain_problem(1)
  if example_dim:
    x = jnp.moveaxis(x, 0, 1)
  # The pure Gram function, and the defaults (norms, per-example gradients
  # by vmap of the VJP of forward).
  check_rule(GAIN, x, (w, s), example_dim, (None,), (None,))
  # A rule that is only a forward: every function by the defaults.
  bare = gram_haiku.Rule(forward=_gain_forward, param_names=("w", "s"))
  check_rule(bare, x, (w, s), example_dim, (None,), (None,))


def _tanh_reference(x, w, s):
  """``F F^T`` for per-example losses ``sum(tanh(y_i)^2) / 2``."""
  def loss(p, xi):
    return 0.5 * jnp.sum(jnp.tanh(_gain_forward(xi, *p)) ** 2)
  grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))((w, s), x)
  f = np.concatenate([np.asarray(a, np.float64).reshape(a.shape[0], -1)
                      for a in grads], axis=1)
  return f @ f.T


def test_third_party_rule_bound_to_a_primitive():
  x, w, s = _gain_problem(2)
  b = x.shape[0]

  def loss(w, s, probe):
    y = gram_haiku.ops.bind(GAIN, x, (w, s), probe, name="gain")
    return 0.5 * jnp.sum(jnp.tanh(y) ** 2)
  gram = jax.jit(jax.grad(loss, argnums=2))(w, s, jnp.zeros((b, b)))
  assert_gram_close(gram, _tanh_reference(x, w, s))
  jaxpr = str(jax.make_jaxpr(loss)(w, s, jnp.zeros((b, b))))
  assert "_gain_gram" in jaxpr  # the rule's Gram, not the default
  norms = jax.grad(lambda w, s, p: 0.5 * jnp.sum(jnp.tanh(
      gram_haiku.ops.bind(GAIN, x, (w, s), p, name="gain", mode="norms")) ** 2), argnums=2)(
                                        w, s, jnp.zeros((b,)))
  assert_gram_close(norms, np.diag(np.asarray(gram)), what="norms")
  # The ordinary gradients are JAX's own.
  want = jax.grad(lambda w, s: 0.5 * jnp.sum(jnp.tanh(
      _gain_forward(x, w, s)) ** 2), argnums=(0, 1))(w, s)
  got = jax.grad(loss, argnums=(0, 1))(w, s, jnp.zeros((b, b)))
  for a, c in zip(got, want):
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("in_axis", [0, 1])
def test_third_party_rule_under_vmap(in_axis):
  # One example at a time under vmap (the outermost vmap is the example
  # axis by default), mapped along axis 0 or 1 of the batch.
  x, w, s = _gain_problem(3)
  b = x.shape[0]
  xs = jnp.moveaxis(x, 0, in_axis)

  def loss(w, s, probe):
    def one(xi):
      y = gram_haiku.ops.bind(GAIN, xi, (w, s), probe, name="gain")
      return 0.5 * jnp.sum(jnp.tanh(y) ** 2)
    return jnp.sum(jax.vmap(one, in_axes=in_axis)(xs))
  gram = jax.jit(jax.grad(loss, argnums=2))(w, s, jnp.zeros((b, b)))
  assert_gram_close(gram, _tanh_reference(x, w, s))


class _Gain(hk.Module):
  """``s * (x @ w)`` as a Haiku module."""

  def params(self, x):
    w = hk.get_parameter("w", [x.shape[-1], 2], x.dtype,
                         init=hk.initializers.TruncatedNormal())
    s = hk.get_parameter("s", [], x.dtype, init=jnp.ones)
    return w, s

  def __call__(self, x):
    return _gain_forward(x, *self.params(x))


@gram_haiku.register_layer(_Gain)
def _gain_handler(call, module, x):
  """A handler that gives the rule itself to ``call.apply``."""
  return call.apply(GAIN, x, module.params(x))


def test_third_party_rule_in_track():
  x, _, _ = _gain_problem(4)

  def net(x):
    return 0.5 * jnp.sum(jnp.tanh(_Gain(name="gain")(x)) ** 2)

  def tracked(x):
    with gram_haiku.track():
      return net(x)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x)
  p = params["gain"]
  assert_gram_close(grams.total, _tanh_reference(x, p["w"], p["s"]))
  assert grams.complete and grams.coverage["gain/w"].rule == "_gain_handler"


def test_rules_compare_by_value_and_reject_malformed_fields():
  assert linear.linear_rule(HI) == linear.linear_rule(HI)
  assert hash(linear.linear_rule(HI)) == hash(linear.linear_rule(HI))
  assert linear.linear_rule(HI) != linear.linear_rule(None)
  assert "_gain_gram" in repr(GAIN)
  with pytest.raises(TypeError, match="forward must be a function"):
    gram_haiku.Rule(forward=None)
  with pytest.raises(TypeError, match="param_names must be a tuple"):
    gram_haiku.Rule(forward=_gain_forward, param_names=["w", "s"])
  with pytest.raises(TypeError, match="droppable must be a tuple of indices"):
    gram_haiku.Rule(forward=_gain_forward, param_names=("w",), droppable=(1,))
  with pytest.raises(TypeError, match="binds a gram_haiku.Rule, got "
                     "function"):
    gram_haiku.ops.bind(_gain_forward, jnp.ones((2, 3)), (jnp.ones((3, 2)),),
                        jnp.zeros((2, 2)), name="nothing")


def test_a_droppable_parameter_forward_cannot_take_says_what_to_do():
  """``droppable`` lists ``s``, but ``forward`` multiplies by it: the
  per-example gradients of ``w`` with ``s`` dropped (frozen) call
  ``forward`` with None for it, and the error says what the contract is."""
  x, w, s = _gain_problem(3)
  with pytest.raises(TypeError, match=r"(?s)dropped \(frozen\).*\[1\].*"
                     r"forward included.*What to do"):
    rule_lib.per_example_grads_by_vjp(_gain_forward, x, jnp.ones(
        x.shape[:-1] + (2,)), (w, None), 0)


@pytest.mark.parametrize("mode", ["gram", "norms"])
def test_a_rule_result_narrower_than_the_accumulation_dtype_is_an_error(
    mode):
  """A rule's Gram (or norms) in bfloat16 for float32 operands would be
  rounded to bfloat16 silently: the op says so, naming the function."""
  x, w, s = _gain_problem(4)
  b = x.shape[0]
  narrow = gram_haiku.Rule(
      forward=_gain_forward, param_names=("w", "s"),
      gram=lambda *a: _gain_gram(*a).astype(jnp.bfloat16),
      sq_norms=lambda *a: jnp.diag(_gain_gram(*a)).astype(jnp.bfloat16))
  probe = jnp.zeros((b, b) if mode == "gram" else (b,))

  def loss(probe):
    y = gram_haiku.ops.bind(narrow, x, (w, s), probe, name="gain",
                            mode=mode)
    return jnp.sum(y ** 2)
  fn = "gram" if mode == "gram" else "sq_norms"
  with pytest.raises(ValueError, match=rf"(?s)the {fn} of rule 'gain' "
                     r"for layer 'gain' "
                     r"returned bfloat16.*float32.*What to do"):
    jax.grad(loss)(probe)
