"""LayerNorm, InstanceNorm, RMSNorm, GroupNorm and Bias: the affine Gram op
and the tracked modules, vs the reference F @ F.T of the untracked model."""

import functools

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import RTOL_BF16
from gram_haiku._src.core.reference import RTOL_F32
from gram_haiku._src.ops import affine as affine_op
from gram_haiku._src.ops.affine import gram_affine
from tests import problems


def _head(out, y):
  return 0.5 * jnp.sum((jnp.tanh(out.astype(jnp.float32)) - y) ** 2)


# -- op level ------------------------------------------------------------------

#: name -> (x shape per example, scale shape or None, offset shape or None,
#: offset multiplier).
OP_CONFIGS = {
    "scale_offset": ((4, 3), (3,), (3,), None),
    "scale": ((4, 3), (3,), None, None),
    "offset": ((4, 3), None, (3,), None),
    "full_rank_params": ((4, 3), (1, 4, 1), (1, 4, 3), None),
    "scalar_offset_times": ((4, 3), None, (), -1),
    "offset_times_np": ((4, 3), None, (4, 3), np.float32(0.5)),
}


def _op_problem(config, seed=0, b=5, dtype=jnp.float32):
  shape, s_shape, o_shape, mult = OP_CONFIGS[config]
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  x = problems.normal(k[0], (b,) + shape, dtype)
  p = {}
  if s_shape is not None:
    p["scale"] = problems.normal(k[1], s_shape, dtype)
  if o_shape is not None:
    p["offset"] = problems.normal(k[2], o_shape, dtype)
  y = problems.normal(k[3], (b,) + shape)
  return p, x, y, mult


def _plain_affine(mult):
  def loss(p, x, y):
    out = x
    if "scale" in p:
      out = out * p["scale"]
    if "offset" in p:
      out = out + (p["offset"] if mult is None else p["offset"] * mult)
    return _head(out, y)
  return loss


def _affine_gram(p, x, y, mult, depth=0, jit=None, mode="gram"):
  def loss(p, probe):
    f = lambda xi: gram_affine(xi, p.get("scale"), p.get("offset"), probe,
                               offset_multiplier=mult, mode=mode)
    if jit == "inside":
      f = jax.jit(f)
    for _ in range(depth):
      f = jax.vmap(f)
    return _head(f(x), y)
  g = jax.grad(loss, argnums=(0, 1))
  if jit == "outside":
    g = jax.jit(g)
  b = x.shape[0]
  return g(p, jnp.zeros((b, b) if mode == "gram" else (b,)))


OP_LAYOUTS = [
    ("scale_offset", 0, None), ("scale_offset", 1, "inside"),
    ("scale_offset", 2, "outside"), ("scale", 0, None), ("offset", 1, None),
    ("full_rank_params", 0, None), ("full_rank_params", 1, "inside"),
    ("scalar_offset_times", 2, "outside"), ("offset_times_np", 1, "outside")]


@pytest.mark.parametrize("config,depth,jit", OP_LAYOUTS)
def test_affine_op(config, depth, jit):
  p, x, y, mult = _op_problem(config)
  plain = _plain_affine(mult)
  grads, gram = _affine_gram(p, x, y, mult, depth, jit)
  chex.assert_trees_all_close(grads, jax.grad(plain)(p, x, y), rtol=1e-5,
                              atol=1e-6)
  ref = reference_gram(plain, p, x, y)
  assert_gram_close(gram, ref)
  _, norms = _affine_gram(p, x, y, mult, depth, jit, mode="norms")
  assert_gram_close(norms, np.diag(ref))


def test_affine_op_parity_bf16():
  p, x, y, mult = _op_problem("scale_offset", dtype=jnp.bfloat16)
  def loss(p, probe, x):
    return _head(jax.vmap(lambda xi: gram_affine(
        xi, p["scale"], p["offset"], probe, offset_multiplier=mult))(x), y)
  grad = jax.grad(loss, argnums=(0, 1, 2))
  probe = jnp.zeros((5, 5), jnp.float32)
  for cts in (grad(p, probe, x), jax.eval_shape(grad, p, probe, x)):
    chex.assert_trees_all_equal_shapes_and_dtypes(cts, (p, probe, x))
  _, gram, _ = grad(p, probe, x)
  up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  ref = reference_gram(_plain_affine(mult), up(p), up(x), y)
  assert_gram_close(gram, ref, rtol=RTOL_BF16)


def test_affine_op_errors():
  x = jnp.ones((2, 3))
  with pytest.raises(ValueError, match="scale or an offset"):
    gram_affine(x, None, None, jnp.zeros((2, 2)))
  with pytest.raises(NotImplementedError, match="multiplier"):
    gram_affine(x, None, jnp.ones(3), jnp.zeros((2, 2)),
                offset_multiplier=jnp.ones(3))
  with pytest.raises(ValueError, match="do not broadcast"):
    gram_affine(x, jnp.ones((2, 2, 3)), None, jnp.zeros((2, 2)))


def test_reduce_to_sums_broadcast_and_inner_axes():
  a = problems.normal(jax.random.PRNGKey(1), (3, 2, 4, 5))  # (B, T, H, C)
  a64 = np.asarray(a, np.float64)

  def check(got, axes, keep=False):
    # float32 sums of n terms, against float64: rounding up to ~n eps of the
    # terms' magnitude (a sum that cancels has no relative accuracy).
    want = a64.sum(axis=axes, keepdims=keep)
    n = a.size // want.size
    np.testing.assert_allclose(np.reshape(got, want.shape), want, rtol=0,
                               atol=n * 1.2e-7 * np.abs(a64).max())
  check(affine_op._reduce_to(a, (5,), 2), (1, 2))
  check(affine_op._reduce_to(a, (4, 1), 2), (1, 3), keep=True)
  check(affine_op._reduce_to(a, (), 0), (1, 2, 3))


# -- the tracked modules -------------------------------------------------------


def _sq(out, y):
  return 0.5 * jnp.sum((out.astype(jnp.float32) - y) ** 2)


def _chain(norms):
  """``Linear(C) -> (layer -> 1.5 tanh) for each layer -> Linear(3)``.

  ``norms`` are thunks making callables (modules or wrapped modules). The
  ``tanh`` between two norms keeps a norm from cancelling the previous one's
  parameters (a per-row scale followed by a per-row normalisation has zero
  gradient, which would make the comparison meaningless).
  """
  def model(x):
    h = hk.Linear(x.shape[-1])(x)
    for make in norms:
      h = 1.5 * jnp.tanh(make()(h))
    return hk.Linear(3)(h)
  return model


def _channels_first(module):
  """Runs ``module`` on the channels-first transpose of its input."""
  return lambda h: jnp.moveaxis(module(jnp.moveaxis(h, -1, 1)), 1, -1)


def _data(seed, shape, dtype=jnp.float32):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (problems.normal(k1, shape, dtype),
          problems.normal(k2, shape[:-1] + (3,)))


def _references(g, params, x, y):
  """``F``, ``F F^T`` of the whole model and of each module, from one ``F``.

  ``F`` is :func:`gram_haiku._src.core.reference.per_example_grads` (jitted) of the
  untracked model, with the parameters' own dtype (a bf16 model's gradients
  are bf16, promoted to f32 for the product); its columns follow
  ``jax.tree.leaves(params)``, where each module's leaves are contiguous,
  so each module's Gram is its column block's.
  """
  f = np.asarray(jax.jit(functools.partial(per_example_grads, g.apply))(
      params, x, y), np.float64)
  refs, start = {}, 0
  for name in sorted(params):  # the order of jax.tree.leaves
    size = sum(a.size for a in jax.tree.leaves(params[name]))
    block = f[:, start:start + size]
    refs[name] = block @ block.T
    start += size
  assert start == f.shape[1]
  return f, f @ f.T, refs


def _check_model(model, x, y, expected, modes=("gram",), cast=None):
  """The tracked model vs the untracked one, for each ``track(mode=...)``.

  Checks: the same parameters at init; the loss; the parameter gradients
  (against the sum of the reference's per-example gradients, which is the
  gradient of the summed loss); the set of tracked modules; the total and
  each module's Gram (or squared norms) against the reference.
  """
  g = hk.without_apply_rng(hk.transform(lambda x, y: _sq(model(x), y)))
  plain_params = jax.jit(g.init)(jax.random.PRNGKey(0), x, y)
  params = plain_params
  if cast is not None:
    params = jax.tree.map(lambda a: a.astype(cast), params)
  f_ref, ref, refs = _references(g, params, x, y)
  plain_value = jax.jit(g.apply)(params, x, y)
  dtype = jnp.dtype(x.dtype)
  # LayerNorm and RMSNorm apply the scale in another order: float rounding,
  # compounded through the chains of norms used here (CASES.md's rtol for
  # reordered float32 computations).
  rtol = {"bfloat16": RTOL_BF16, "float64": 1e-10}.get(dtype.name, RTOL_F32)
  for mode in modes:
    def tracked(x, y, mode=mode):
      with gram_haiku.track(mode=mode):
        return _sq(model(x), y)
    f = hk.transform_with_state(tracked)
    init_params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
    chex.assert_trees_all_equal(init_params, plain_params)
    value, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, x, y)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
    np.testing.assert_allclose(value, plain_value, rtol=rtol)
    flat = np.concatenate([np.ravel(np.asarray(l, np.float64))
                           for l in jax.tree.leaves(grads)])
    full = f_ref.sum(axis=0)
    np.testing.assert_allclose(flat, full, rtol=rtol,
                               atol=rtol * np.abs(full).max())
    names = set(grams.by_layer) | set(grams.sq_norms_by_layer)
    assert names == {"linear", "linear_1"} | set(expected), names
    def close(got, want):
      if dtype == jnp.float64:
        assert_gram_close(got, want, rtol=1e-10,
                          atol=1e-10 * np.abs(want).max())
      elif dtype == jnp.bfloat16:
        assert_gram_close(got, want, rtol=RTOL_BF16)
      else:
        assert_gram_close(got, want)
    if mode == "norms":
      close(grams.sq_norms, np.diag(ref))
      for name in expected:
        close(grams.sq_norms_by_layer[name], np.diag(refs[name]))
      continue
    assert grams.total.dtype == (jnp.float64 if dtype == jnp.float64
                                 else jnp.float32)
    close(grams.total, ref)
    for name in expected:
      close(grams.by_layer[name], refs[name])


LN = hk.LayerNorm


def _cond(module, **kw):
  """Calls ``module`` with a call-time scale/offset computed from the input."""
  def call(h):
    c = jnp.tanh(h[..., :1])  # per example and position
    return module(h, **{k: v(c) for k, v in kw.items()})
  return call


#: Every module kind and flag, on inputs (B, H, W, C), in two chains:
#: (thunk, module name, or None for a module without parameters).
CHAINS = {
    "layer_instance_rms": [
        (lambda: LN(-1, True, False), "layer_norm"),
        (lambda: LN(-1, False, True), "layer_norm_1"),
        (lambda: LN((1, 2), True, True, param_axis=-1), "layer_norm_2"),
        (lambda: LN(-1, False, False), None),
        (lambda: LN(-1, True, True, use_fast_variance=True), "layer_norm_4"),
        (lambda: LN(-1, True, True, param_axis=1), "layer_norm_5"),
        (lambda: _cond(LN(-1, False, True, name="cond_scale"),
                       scale=lambda c: 1 + c), "cond_scale"),
        (lambda: _cond(LN(-1, True, False, name="cond_offset"),
                       offset=lambda c: c), "cond_offset"),
        # InstanceNorm's __call__ is LayerNorm's: the same handler tracks it.
        (lambda: hk.InstanceNorm(True, True), "instance_norm"),
        (lambda: _channels_first(hk.InstanceNorm(
            True, False, data_format="channels_first")), "instance_norm_1"),
        (lambda: hk.RMSNorm(slice(1, None), param_axis=1), "rms_norm"),
    ],
    "group_bias": [
        (lambda: _channels_first(hk.GroupNorm(
            2, data_format="channels_first")), "group_norm"),
        (lambda: hk.GroupNorm(3, axis=slice(2, None)), "group_norm_1"),
        (lambda: _cond(hk.GroupNorm(2, create_scale=False),
                       scale=lambda c: 1 + c), "group_norm_2"),
        (lambda: _cond(hk.GroupNorm(3, create_offset=False),
                       offset=lambda c: c), "group_norm_3"),
        (lambda: hk.GroupNorm(2, create_scale=False, create_offset=False),
         None),
        (lambda: hk.Bias(bias_dims=[]), "bias"),
        (lambda: hk.Bias(bias_dims=[-1]), "bias_1"),
        (lambda: hk.Bias(bias_dims=[1]), "bias_2"),  # (H, 1, 1)
        (lambda: functools.partial(hk.Bias(name="times"), multiplier=-1),
         "times"),
        (lambda: functools.partial(hk.Bias(name="times_np"),
                                   multiplier=np.float32(0.5)), "times_np"),
    ],
}


def _with_shared_norm(layers):
  """The chain, plus one LayerNorm instance applied to two activations.

  C09 (b): the shared parameters need cross terms between the two uses.
  """
  def model(x):
    h = _chain([make for make, _ in layers])(x)
    ln = LN(-1, True, True, scale_init=hk.initializers.RandomNormal(),
            offset_init=hk.initializers.RandomNormal(), name="shared")
    return h + hk.Linear(3, name="linear_2")(jnp.tanh(ln(h)) + ln(h ** 2))
  names = [n for _, n in layers if n] + ["shared", "linear_2"]
  return model, names


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_every_module_and_flag_x64(chain):
  # Checked in float64, where tracked and untracked agree to 1e-10: in
  # float32 a chain of norms amplifies the rounding difference of LayerNorm
  # and RMSNorm (they apply the scale in another order). float32 is checked
  # on the shorter chains below, which also have the plain flags.
  if chain == "group_bias":
    model, names = _with_shared_norm(CHAINS[chain])
  else:
    model = _chain([make for make, _ in CHAINS[chain]])
    names = [n for _, n in CHAINS[chain] if n]
  with jax.enable_x64(True):
    x, y = _data(0, (4, 3, 2, 6), jnp.float64)
    _check_model(model, x, y.astype(jnp.float64), names)


@pytest.mark.parametrize("layout", ["vmap1", "vmap2"])
def test_layouts_hk_vmap(layout):
  # Explicitly batched is covered above; here the modules see one example
  # (vmap1: (H, W, C)) or one row (vmap2: (W, C)).
  x, y = _data(2, (4, 3, 2, 6))
  layers = [(lambda: LN(-1, True, True), "layer_norm"),
            (lambda: hk.RMSNorm(-1), "rms_norm")]
  if layout == "vmap1":  # GroupNorm and Bias need a leading axis
    layers += [(lambda: hk.GroupNorm(2, axis=-1), "group_norm"),
               (lambda: hk.Bias(bias_dims=[-1]), "bias")]
    wrap = lambda m: hk.vmap(m, split_rng=False)
  else:
    wrap = lambda m: hk.vmap(hk.vmap(m, split_rng=False), split_rng=False)
  model = wrap(_chain([make for make, _ in layers]))
  # float32 (the x64 chains above cover every flag), and track(mode="norms").
  _check_model(model, x, y, [n for _, n in layers],
               modes=("gram", "norms") if layout == "vmap1" else ("gram",))


def test_bias_array_multiplier_is_a_clear_error():
  x = jnp.ones((3, 4))
  def fn(x):
    with gram_haiku.track():
      return hk.Bias()(x, multiplier=jnp.ones(4)).sum()
  with pytest.raises(NotImplementedError, match="multiplier"):
    hk.transform_with_state(fn).init(None, x)


def test_bf16_parity_and_f32_gram():
  # The reference is vmap(grad) of the untracked bf16 model: a chain of bf16
  # norms drifts from an f32 model by more than the Gram's own rounding.
  x, y = _data(3, (4, 3, 2, 6))
  layers = [(lambda: LN(-1, True, True), "layer_norm"),
            (lambda: hk.GroupNorm(2), "group_norm"),
            (lambda: hk.RMSNorm(-1), "rms_norm"), (hk.Bias, "bias")]
  _check_model(_chain([m for m, _ in layers]), x.astype(jnp.bfloat16), y,
               [n for _, n in layers], cast=jnp.bfloat16)


# -- forward values: the tracked module vs plain Haiku ---------------------------

#: (module factory, input shape, bit-identical).
FORWARD_CASES = {
    "ln": (lambda: LN(-1, True, True), (3, 4, 5), False),
    "ln_no_scale": (lambda: LN(-1, False, True), (3, 4, 5), True),
    "ln_param_axis": (lambda: LN((1, 2), True, True, param_axis=1),
                      (3, 4, 5), False),
    "instance_cf": (lambda: hk.InstanceNorm(
        True, True, data_format="channels_first"), (2, 3, 4, 2), False),
    "rms": (lambda: hk.RMSNorm(-1), (3, 4, 5), False),
    "rms_no_scale": (lambda: hk.RMSNorm(-1, create_scale=False), (3, 5),
                     True),
    "group": (lambda: hk.GroupNorm(2), (3, 2, 4), True),
    "group_no_params": (lambda: hk.GroupNorm(2, create_scale=False,
                                             create_offset=False),
                        (3, 2, 4), True),
    "group_cf": (lambda: hk.GroupNorm(2, data_format="channels_first"),
                 (3, 4, 2, 2), True),
    "bias": (hk.Bias, (3, 4, 5), True),
    "bias_dims": (lambda: hk.Bias(bias_dims=[1]), (3, 4, 5), True),
}


# The x64 chains compare every module's loss and gradients at 1e-10; these
# check the claimed bit-identity, and Haiku's rank-promotion branch.
FORWARD_TESTS = [(name, "allow") for name in sorted(FORWARD_CASES)
                 if FORWARD_CASES[name][2] or name == "ln"] + [
                     (name, "raise") for name in ("ln", "bias_dims")]


@pytest.mark.parametrize("name,rank_promotion", FORWARD_TESTS)
def test_forward_matches_plain_module(name, rank_promotion):
  make, shape, bitwise = FORWARD_CASES[name]
  x = problems.normal(jax.random.PRNGKey(12), shape)
  def tracked(x):
    with gram_haiku.track():
      return make()(x)
  f = hk.transform_with_state(tracked)
  plain = hk.transform(lambda x: make()(x))
  with jax.numpy_rank_promotion(rank_promotion):
    params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
    chex.assert_trees_all_equal(
        params, jax.jit(plain.init)(jax.random.PRNGKey(0), x))
    # Random (not 1/0) parameters, so that the scale and offset matter.
    params = jax.tree.map(lambda a: a + problems.normal(
        jax.random.PRNGKey(a.size), a.shape), params)
    out, _ = f.apply(params, state, None, x)
    ref = plain.apply(params, None, x)
  assert out.dtype == ref.dtype and out.shape == ref.shape
  if bitwise:
    np.testing.assert_array_equal(out, ref)
  else:
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
  assert set(state) == {m for m in params}  # one probe per module with params



_PER_EXAMPLE_PARAMS = {
    "layer_norm": lambda: LN(-1, True, True, param_axis=0),
    "rms_norm": lambda: hk.RMSNorm(-1, param_axis=0),
}


@pytest.mark.parametrize("shape", [(4, 3, 6), (4, 6)])
@pytest.mark.parametrize("name", sorted(_PER_EXAMPLE_PARAMS))
def test_parameters_along_the_example_axis_say_so(name, shape):
  # param_axis=0 on a batch: a scale per example, which no rule covers.
  x, y = _data(5, shape)
  norm = _PER_EXAMPLE_PARAMS[name]
  def loss(x, y):
    with gram_haiku.track():
      return jnp.sum((norm()(x)[..., :3] - y) ** 2)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match=rf"'{name}' has parameters "
                     r"\(scale\[4, 1.*span the last \d axes.*param_axis"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)


@pytest.mark.parametrize("name", sorted(_PER_EXAMPLE_PARAMS))
def test_parameters_along_axis_0_of_one_example_are_exact(name):
  # The advice: under hk.vmap axis 0 is within the example.
  x, y = _data(6, (4, 3, 6))
  model = _chain([lambda: hk.vmap(_PER_EXAMPLE_PARAMS[name](),
                                  split_rng=False)])
  _check_model(model, x, y, [name])


_FULL_RANK_PARAMS = {
    "layer_norm": lambda: LN((1, 2), True, True, param_axis=1),
    "rms_norm": lambda: hk.RMSNorm((1, 2), param_axis=1),
}


@pytest.mark.parametrize("name", sorted(_FULL_RANK_PARAMS))
def test_full_rank_parameters_on_the_raw_path(name):
  """A scale Haiku stores at the input's rank, ``(1, T, 1)``
  (``param_axis=1``), on the raw ``jax.grad`` path: the op takes the value
  Haiku holds (it used to take a reshape of it, which the raw path read as
  a custom getter's new value and refused)."""
  x, y = _data(7, (4, 3, 6))
  norm = _FULL_RANK_PARAMS[name]

  def loss(x, y):
    with gram_haiku.track():
      return jnp.sum((norm()(x)[..., :3] - y) ** 2)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  assert params[name]["scale"].shape == (1, 3, 1)
  state = gram_haiku.resize_probes(state, x.shape[0])
  grad = jax.jit(jax.grad(lambda s: f.apply(params, s, None, x, y)[0]))
  gram = grad(state)[name][gram_haiku.PROBE_NAME]
  plain = hk.without_apply_rng(hk.transform(
      lambda x, y: jnp.sum((norm()(x)[..., :3] - y) ** 2)))
  assert_gram_close(gram, reference_gram(plain.apply, params, x, y))
