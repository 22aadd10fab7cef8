"""The linear Gram primitive against the reference, under every transform."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gram_haiku import ExampleAxis
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import kernels
from gram_haiku._src.core import errors
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import assert_probe_value_close
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import RTOL_BF16
from gram_haiku.ops import gram_linear
from tests import problems


def _problem(seed, b=5, t=3, n=4, m=2, with_bias=True, dtype=jnp.float32):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  x = problems.normal(k[0], (b, t, n), dtype)
  params = {"w": problems.normal(k[1], (n, m), dtype)}
  if with_bias:
    params["b"] = problems.normal(k[2], (m,), dtype)
  y = problems.normal(k[3], (b, t, m), dtype)
  return params, x, y


def _head(out, y):
  return 0.5 * jnp.sum((jnp.tanh(out.astype(jnp.float32)) - y) ** 2)


def _plain_loss(p, x, y):
  out = x @ p["w"]
  if "b" in p:
    out = out + p["b"]
  return _head(out, y)


def _tracked(p, probe, x, **kw):
  return gram_linear(x, p["w"], p.get("b"), probe, **kw)


def _ref(p, x, y):
  return reference_gram(_plain_loss, p, x, y)


def _gram(loss, p, x, y, b):
  return jax.jit(jax.grad(loss, argnums=1))(p, jnp.zeros((b, b)), x, y)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("t", [1, 3])
def test_explicit_batch(with_bias, t):
  p, x, y = _problem(0, t=t, with_bias=with_bias)
  def loss(p, probe, x, y):
    return _head(_tracked(p, probe, x), y)
  assert_gram_close(_gram(loss, p, x, y, 5), _ref(p, x, y))


def test_unbiased_has_no_bias_term():
  p, x, y = _problem(1, with_bias=False)
  def loss(p, probe, x, y):
    return _head(_tracked(p, probe, x), y)
  with_b = dict(p, b=jnp.zeros((2,)))
  # With a (zero) bias the Gram gains the bias term, so the two must differ.
  g_nob = _gram(loss, p, x, y, 5)
  g_b = _gram(loss, with_b, x, y, 5)
  assert np.abs(np.asarray(g_b - g_nob)).max() > 1e-3
  assert_gram_close(g_nob, _ref(p, x, y))


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("jit_inside", [False, True])
def test_vmap_depth(depth, jit_inside):
  p, x, y = _problem(2)
  def loss(p, probe, x, y):
    f = lambda xi: _tracked(p, probe, xi)
    if jit_inside:
      f = jax.jit(f)
    for _ in range(depth):
      f = jax.vmap(f)
    return _head(f(x), y)
  ref = _ref(p, x, y)
  assert_gram_close(_gram(loss, p, x, y, 5), ref)
  assert_gram_close(jax.jit(functools.partial(_gram, loss, b=5))(p, x=x, y=y),
                    ref)


def test_vmap_in_axes_out_axes():
  p, x, y = _problem(3)
  xt = jnp.transpose(x, (1, 2, 0))  # (T, N, B)
  def loss(p, probe, xt, y):
    inner = jax.vmap(lambda xi: _tracked(p, probe, xi), in_axes=0, out_axes=1)
    outer = jax.vmap(inner, in_axes=2, out_axes=2)  # examples: outermost
    out = outer(xt)  # (M, T, B)
    return _head(jnp.transpose(out, (2, 1, 0)), y)
  assert_gram_close(_gram(loss, p, xt, y, 5), _ref(p, x, y))


def test_ones_example_every_entry_is_six():
  w = jnp.ones((3, 2))
  x = jnp.ones((2, 3))
  def loss(probe):
    return jax.vmap(lambda xi: gram_linear(xi, w, None, probe))(x).sum()
  gram = jax.grad(loss)(jnp.zeros((2, 2)))
  np.testing.assert_array_equal(np.asarray(gram), np.full((2, 2), 6.0))


def test_parameter_gradients_and_loss_unchanged():
  p, x, y = _problem(4)
  def loss(p, probe, x, y):
    return _head(jax.vmap(lambda xi: _tracked(p, probe, xi))(x), y)
  probe = jnp.zeros((5, 5))
  v1, g1 = jax.value_and_grad(loss)(p, probe, x, y)
  v0, g0 = jax.value_and_grad(_plain_loss)(p, x, y)
  np.testing.assert_allclose(v1, v0, rtol=1e-6)
  chex.assert_trees_all_close(g1, g0, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_strategies_agree(strategy):
  p, x, y = _problem(5, b=7, t=4, n=6, m=3)
  def loss(p, probe, x, y):
    return _head(_tracked(p, probe, x, strategy=strategy), y)
  assert_gram_close(_gram(loss, p, x, y, 7), _ref(p, x, y))


def test_ghost_blocking_bounds_memory():
  # A budget smaller than one (B, T, B, T) block forces row blocks of 2 with
  # padding (B=7 is not a multiple of 2).
  b, t = 7, 4
  budget = 2 * (2 * t * b * t * 4)
  p, x, y = _problem(6, b=b, t=t)
  def loss(p, probe, x, y):
    return _head(_tracked(p, probe, x, strategy="ghost",
                          memory_budget_bytes=budget), y)
  jaxpr = jax.make_jaxpr(functools.partial(_gram, loss, b=b))(p, x=x, y=y)
  assert "scan" in str(jaxpr)  # blocked with lax.map
  assert_gram_close(_gram(loss, p, x, y, b), _ref(p, x, y))


@pytest.mark.parametrize("budget,what", [
    (3 * 2 * 4 * 4 * 4, "columns"),  # one pair fits, one row of 7 does not
    (2 * 2 * 2 * 4, "positions"),  # one pair's (T, T) kernels do not fit
])
def test_ghost_blocking_over_columns_and_positions(budget, what):
  b, t = 7, 4
  p, x, y = _problem(8, b=b, t=t)
  def loss(p, probe, x, y):
    return _head(_tracked(p, probe, x, strategy="ghost",
                          memory_budget_bytes=budget), y)
  jaxpr = str(jax.make_jaxpr(functools.partial(_gram, loss, b=b))(p, x=x,
                                                                   y=y))
  # Nested loops: rows, then columns (and pairs of position blocks).
  assert jaxpr.count("scan") >= (3 if what == "positions" else 2), what
  assert_gram_close(_gram(loss, p, x, y, b), _ref(p, x, y))


@pytest.mark.parametrize("budget", [2 * 4 * 4 * 4 * 3, 2 * 2 * 2 * 4])
def test_ghost_norms_blocking(budget):
  # Rows of 3 examples; then one example's (T, T) kernels over budget.
  b, t = 7, 4
  p, x, y = _problem(9, b=b, t=t)
  def loss(p, probe):
    return _head(_tracked(p, probe, x, strategy="ghost", mode="norms",
                          memory_budget_bytes=budget), y)
  sq = jax.grad(loss, argnums=1)(p, jnp.zeros((b,)))
  np.testing.assert_allclose(sq, np.diag(_ref(p, x, y)), rtol=1e-4)


@pytest.mark.parametrize("mode", ["gram", "norms", "per_example"])
def test_zero_positions(mode):
  # T = 0: no position, so every per-example gradient is zero.
  x = jnp.ones((3, 0, 2))
  w, b = jnp.ones((2, 4)), jnp.ones((4,))
  shape = {"gram": (3, 3), "norms": (3,), "per_example": (3, 12)}[mode]
  def loss(probe):
    return jnp.sum(gram_linear(x, w, b, probe, mode=mode))
  got = jax.grad(loss)(jnp.zeros(shape))
  np.testing.assert_array_equal(got, np.zeros(shape))


def test_cost_model_choice():
  assert cost_model.linear_method(128, 1, 784, 512, 4) == "ghost"
  assert cost_model.linear_method(8, 512, 16, 16, 4) == "materialize"
  # Materialised gradients that do not fit the budget are formed by chunks
  # of output features (fewer multiply-adds than ghost's B^2 T^2 (N + M));
  # where not even one feature's (cols, N) fit: ghost.
  assert cost_model.linear_method(4096, 512, 4096, 4096, 4) == "materialize"
  assert cost_model.linear_method(8, 512, 16, 16, 4, budget=1000) == (
      "materialize")
  assert cost_model.linear_method(8, 512, 16, 16, 4, budget=500) == "ghost"
  # Per-example mode always materialises; a forced strategy is kept.
  assert cost_model.linear_method(128, 1, 784, 512, 4,
                                  mode="per_example") == "materialize"
  assert cost_model.linear_method(8, 512, 16, 16, 4,
                                  strategy="ghost") == "ghost"
  with pytest.raises(ValueError, match="Unknown Gram strategy"):
    gram_linear(jnp.ones((2, 3)), jnp.ones((3, 2)), None, jnp.zeros((2, 2)),
                strategy="fast")


@pytest.mark.parametrize("budget", [None, 3 * 5 * 7 * 4, 5 * 7 * 4])
def test_materialised_gram_by_chunks_of_features(budget):
  """Per-example gradients over the memory budget: the Gram is the sum of
  their chunks' Grams (chunks of 3 and of 1 output features of 11, the
  last chunk padded), equal to the float64 reference."""
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.normal(size=(5, 4, 7)), jnp.float32)
  d = jnp.asarray(rng.normal(size=(5, 4, 11)) * 10.0 ** rng.randint(
      -3, 3, size=(5, 1, 1)), jnp.float32)
  cfg = kernels.KernelConfig(precision=jax.lax.Precision.HIGHEST,
                             **({} if budget is None else
                                {"memory_budget_bytes": budget}))
  f = np.einsum("itn,itm->inm", np.asarray(x, np.float64),
                np.asarray(d, np.float64)).reshape(5, -1)
  got = jax.jit(lambda x, d: kernels.materialized_gram(x, d, cfg))(x, d)
  assert kernels.materialized_chunk(x, d, cfg) == {
      None: 11, 3 * 5 * 7 * 4: 3, 5 * 7 * 4: 1}[budget]
  assert_gram_close(got, f @ f.T)


def test_checkpoint_keeps_the_gram():
  p, x, y = _problem(7)
  def loss(p, probe, x, y):
    return _head(jax.vmap(lambda xi: _tracked(p, probe, xi))(x), y)
  ref = _ref(p, x, y)
  policies = [None, jax.checkpoint_policies.nothing_saveable,
              jax.checkpoint_policies.everything_saveable,
              jax.checkpoint_policies.dots_saveable]
  for policy in policies:
    ck = jax.checkpoint(loss, policy=policy)
    assert_gram_close(_gram(ck, p, x, y, 5), ref)
    assert_gram_close(jax.jit(functools.partial(_gram, ck, b=5))(p, x=x, y=y),
                      ref)


def test_scan_over_layers_different_params():
  # lax.scan over a stack of layers (different weights per step): the probe
  # is scanned too, and each step's Gram is that layer's.
  k = jax.random.split(jax.random.PRNGKey(8), 3)
  ws = problems.normal(k[0], (3, 4, 4)) / 2
  x = problems.normal(k[1], (5, 4))
  y = problems.normal(k[2], (5, 4))
  def tracked(ws, probes, x):
    def body(h, wp):
      w, probe = wp
      return jnp.tanh(gram_linear(h, w, None, probe)), None
    h, _ = jax.lax.scan(body, x, (ws, probes))
    return 0.5 * jnp.sum((h - y) ** 2)
  grams = jax.grad(tracked, argnums=1)(ws, jnp.zeros((3, 5, 5)), x)
  def plain_one(w, xi, yi):
    h, _ = jax.lax.scan(lambda h, w_: (jnp.tanh(h @ w_), None), xi[None], w)
    return 0.5 * jnp.sum((h - yi[None]) ** 2)
  per = jax.vmap(jax.grad(plain_one), in_axes=(None, 0, 0))(ws, x, y)
  for layer in range(3):
    fl = np.asarray(per[:, layer].reshape(5, -1), np.float64)
    assert_gram_close(grams[layer], fl @ fl.T)


def test_vmap_of_grad_gives_per_example_squared_norms():
  p, x, y = _problem(9)
  def per_example(probe, xi, yi):
    return _head(_tracked(p, probe, xi[None]), yi[None])
  grams = jax.vmap(jax.grad(per_example), in_axes=(None, 0, 0))(
      jnp.zeros((1, 1)), x, y)
  chex.assert_shape(grams, (5, 1, 1))
  np.testing.assert_allclose(grams[:, 0, 0], np.diag(_ref(p, x, y)),
                             rtol=1e-4)


def test_forward_mode_of_plain_path():
  p, x, _ = _problem(10)
  probe = jnp.zeros((5, 5))
  f = lambda w: _tracked(dict(p, w=w), probe, x)
  g = lambda w: x @ w + p["b"]
  out1, t1 = jax.jvp(f, (p["w"],), (jnp.ones_like(p["w"]),))
  out0, t0 = jax.jvp(g, (p["w"],), (jnp.ones_like(p["w"]),))
  np.testing.assert_array_equal(out1, out0)
  np.testing.assert_allclose(t1, t0, rtol=1e-6)


def test_inference_is_bit_identical():
  p, x, _ = _problem(11)
  out = jax.jit(lambda x: _tracked(p, jnp.zeros((5, 5)), x))(x)
  np.testing.assert_array_equal(out, jax.jit(lambda x: x @ p["w"] + p["b"])(x))


@pytest.mark.parametrize("x_dtype,w_dtype", [
    (jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16),
    (jnp.float16, jnp.float16), (jnp.bfloat16, jnp.float32)])
def test_dtype_parity_and_f32_gram(x_dtype, w_dtype):
  p, x, y = _problem(12)
  p = {"w": p["w"].astype(w_dtype), "b": p["b"].astype(w_dtype)}
  x = x.astype(x_dtype)
  def loss(p, probe, x):
    return _head(jax.vmap(lambda xi: _tracked(p, probe, xi))(x), y)
  probe = jnp.zeros((5, 5), jnp.float32)
  g_p, g_probe, g_x = jax.grad(loss, argnums=(0, 1, 2))(p, probe, x)
  for ct, primal in [(g_p["w"], p["w"]), (g_p["b"], p["b"]), (g_x, x),
                     (g_probe, probe)]:
    assert ct.shape == primal.shape and ct.dtype == primal.dtype
    assert ct.weak_type == primal.weak_type
  # Abstractly too, with no compute.
  shapes = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), p, probe, x)
  chex.assert_trees_all_equal_dtypes(shapes, (p, probe, x))
  # Reference from an f32 model on the same (rounded) inputs.
  f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  assert_gram_close(g_probe, _ref(f32(p), f32(x), y), rtol=RTOL_BF16)


def test_float64_under_x64():
  with jax.enable_x64(True):
    p, x, y = _problem(13, dtype=jnp.float64)
    def loss(p, probe, x, y):
      out = jax.vmap(lambda xi: _tracked(p, probe, xi))(x)
      return 0.5 * jnp.sum((jnp.tanh(out) - y) ** 2)
    probe = jnp.zeros((5, 5), jnp.float64)
    gram = jax.grad(loss, argnums=1)(p, probe, x, y)
    assert gram.dtype == jnp.float64
    def plain(p, x, y):
      return 0.5 * jnp.sum((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)
    np.testing.assert_allclose(gram, reference_gram(plain, p, x, y),
                               rtol=1e-10)


def test_integer_input_gets_float0():
  # Integer data fed to a linear layer (cast inside): its cotangent is float0.
  k = jax.random.PRNGKey(14)
  ids = problems.randint(k, (4, 3), 0, 5)
  w = problems.normal(k, (3, 2))
  def loss(ids, probe):
    return gram_linear(ids.astype(jnp.float32), w, None, probe).sum()
  g_ids, _ = jax.grad(loss, argnums=(0, 1), allow_int=True)(
      ids, jnp.zeros((4, 4)))
  assert g_ids.dtype == jax.dtypes.float0


def test_wrong_probe_shape_error():
  p, x, y = _problem(15)
  def loss(p, probe, x, y):
    return _head(_tracked(p, probe, x, name="mlp/~/linear_0"), y)
  with pytest.raises(ValueError) as e:
    jax.grad(loss, argnums=1)(p, jnp.zeros((4, 4)), x, y)
  msg = str(e.value)
  assert "mlp/~/linear_0" in msg and "(4, 4)" in msg and "(5, 5)" in msg
  assert "example_axis=0" in msg


def test_batched_probe_error():
  p, x, _ = _problem(16)
  probes = jnp.zeros((5, 5, 5))
  f = jax.vmap(lambda xi, pr: _tracked(p, pr, xi, name="lin"))
  with pytest.raises(ValueError, match="lin.*batched by vmap"):
    f(x, probes)


def test_batched_params_error():
  p, x, _ = _problem(17)
  ws = jnp.stack([p["w"]] * 5)
  f = jax.vmap(lambda xi, w: gram_linear(xi, w, None, jnp.zeros((3, 3)),
                                         name="ens"))
  with pytest.raises(NotImplementedError, match="ens.*mapped by vmap"):
    f(x, ws)


def test_named_example_axis_with_inner_heads_vmap():
  # Explicitly batched? No: examples mapped by a named vmap, and an inner
  # vmap over K "heads" is a within-example axis.
  b, k_, n, m = 6, 5, 4, 3
  key = jax.random.split(jax.random.PRNGKey(18), 3)
  x = problems.normal(key[0], (b, k_, n))
  p = {"w": problems.normal(key[1], (n, m)), "b": jnp.ones((m,))}
  y = problems.normal(key[2], (b, k_, m))
  axis = ExampleAxis.from_spec("batch")
  def loss(p, probe, x, y):
    per_head = lambda xk: _tracked(p, probe, xk, example_axis=axis)
    per_ex = jax.vmap(per_head)  # heads, innermost
    return _head(jax.vmap(per_ex, axis_name="batch")(x), y)
  assert_gram_close(_gram(loss, p, x, y, b), _ref(p, x, y))
  # Leading mode: the explicit batch axis, with an inner vmap over heads.
  lead = ExampleAxis.from_spec(0)
  def loss_lead(p, probe, x, y):
    xt = jnp.swapaxes(x, 0, 1)  # (K, B, N): vmap over K, input (B, N)
    out = jax.vmap(lambda xk: _tracked(p, probe, xk, example_axis=lead))(xt)
    return _head(jnp.swapaxes(out, 0, 1), y)
  assert_gram_close(_gram(loss_lead, p, x, y, b), _ref(p, x, y))
  # The default rule picks the heads vmap here: the probe check catches it.
  def loss_default(p, probe, x, y):
    xt = jnp.swapaxes(x, 0, 1)
    out = jax.vmap(lambda xk: _tracked(p, probe, xk))(xt)
    return _head(jnp.swapaxes(out, 0, 1), y)
  with pytest.raises(ValueError, match="example_axis=0"):
    _gram(loss_default, p, x, y, b)


def test_named_axis_missing_error():
  # Under a vmap with another name, a missing named axis is an error...
  p, x, y = _problem(19)
  axis = ExampleAxis.from_spec("batch")
  def loss(p, probe, x, y):
    out = jax.vmap(lambda xi: _tracked(p, probe, xi, example_axis=axis,
                                       name="l"), axis_name="other")(x)
    return _head(out, y)
  with pytest.raises(ValueError, match="named 'batch'"):
    _gram(loss, p, x, y, 5)


def test_named_axis_outside_every_vmap_uses_axis_0():
  # ...while a layer outside every vmap is explicitly batched: axis 0.
  p, x, y = _problem(20)
  axis = ExampleAxis.from_spec("batch")
  def loss(p, probe, x, y):
    return _head(_tracked(p, probe, x, example_axis=axis, name="l"), y)
  assert_gram_close(_gram(loss, p, x, y, 5), _ref(p, x, y))


def test_example_axis_spec_validation():
  with pytest.raises(ValueError, match="example_axis=1 is not supported"):
    ExampleAxis.from_spec(1)
  with pytest.raises(ValueError):
    ExampleAxis.from_spec(True)


def test_no_example_axis_error():
  w = jnp.ones((3, 2))
  def loss(probe):
    return gram_linear(jnp.ones((3,)), w, None, probe, name="lin").sum()
  with pytest.raises(ValueError, match=r"lin.*no leading axis"):
    jax.grad(loss)(jnp.zeros((1, 1)))


def test_error_messages_are_constants():
  assert "{module}" in errors.PROBE_SHAPE_MISMATCH
  assert "{module}" in errors.SHARED_LAYER


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("t", [1, 3])
def test_per_example_mode_is_the_flattened_reference(with_bias, t):
  """``mode="per_example"``: the probe's cotangent is ``F`` itself (``w``
  then ``b``, each flattened), with the bias folded into the product."""
  p, x, y = _problem(3, t=t, with_bias=with_bias)
  def loss(p, probe, x, y):
    return _head(_tracked(p, probe, x, mode="per_example"), y)
  width = sum(a.size for a in jax.tree.leaves(p))
  f = jax.jit(jax.grad(loss, argnums=1))(p, jnp.zeros((5, width)), x, y)
  # The reference's columns follow jax.tree.leaves(p): "b" before "w".
  want = np.asarray(per_example_grads(_plain_loss, p, x, y), np.float64)
  if with_bias:
    m = p["b"].size
    want = np.concatenate([want[:, m:], want[:, :m]], axis=1)
  np.testing.assert_allclose(f, want, rtol=1e-5, atol=1e-6)


def _concatenates_of(hlo: str, shape: str) -> list[str]:
  return [l for l in hlo.splitlines()
          if " concatenate(" in l and f"f32[{shape}]" in l.split("=")[1]]


def test_per_example_gradients_in_a_loop_make_no_b_by_p_copy():
  """An RNN-style loop accumulating one layer's per-example gradients
  (``[B, P]`` carry): the step writes the outer product ``[x, 1] (x) d`` in
  one pass; no ``[B, P]`` concatenate of the weight and bias gradients."""
  b, n, m, steps = 4, 6, 5, 3
  p, x, y = _problem(4, b=b, t=steps, n=n, m=m)

  def unrolled(layer, x, y):
    def step(h, xy):
      xt, yt = xy
      out = layer(xt + h[:, :1])
      return jnp.tanh(out), _head(out, yt)
    _, losses = jax.lax.scan(step, jnp.zeros((x.shape[0], m)),
                             (jnp.swapaxes(x, 0, 1), jnp.swapaxes(y, 0, 1)))
    return losses.sum()

  def loss(p, probe, x, y):
    return unrolled(lambda h: _tracked(p, probe, h, mode="per_example"), x, y)
  width = n * m + m
  fn = jax.jit(jax.grad(loss, argnums=1))
  hlo = fn.lower(p, jnp.zeros((b, width)), x, y).compile().as_text()
  assert not _concatenates_of(hlo, f"{b},{width}"), _concatenates_of(
      hlo, f"{b},{width}")
  assert not _concatenates_of(hlo, f"{b},{n + 1},{m}")
  # The result: each example's gradient over the whole sequence.
  want = np.asarray(per_example_grads(
      lambda p, x, y: unrolled(lambda h: h @ p["w"] + p["b"], x, y), p, x, y))
  got = np.asarray(fn(p, jnp.zeros((b, width)), x, y))
  assert_gram_close(np.concatenate([got[:, -m:], got[:, :-m]], 1), want,
                    what="per-example gradients accumulated in a loop")


@pytest.mark.parametrize("lead", [(4,), (4, 3)])
@pytest.mark.parametrize("mode", ["gram", "norms", "per_example"])
@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_zero_input_features_leave_the_bias_gram(lead, mode, strategy):
  # N = 0: w has no entries, and the Gram is the bias's alone. The bias
  # folded into the per-example product as a constant input feature had
  # no column of x to copy (an IndexError before).
  x = jnp.zeros(lead + (0,))
  w = jnp.zeros((0, 3))
  b = problems.normal(jax.random.PRNGKey(5), (3,))
  y = problems.normal(jax.random.PRNGKey(6), lead + (3,))

  def plain(p, x, y):
    return 0.5 * jnp.sum((jnp.tanh(x @ p["w"] + p["b"]) - y) ** 2)
  shape = {"gram": (4, 4), "norms": (4,), "per_example": (4, 3)}[mode]

  def loss(probe):
    out = gram_linear(x, w, b, probe, mode=mode, strategy=strategy)
    return 0.5 * jnp.sum((jnp.tanh(out) - y) ** 2)
  got = jax.jit(jax.grad(loss))(jnp.zeros(shape))
  ref = reference_gram(plain, {"w": w, "b": b}, x, y)
  assert np.abs(ref).max() > 0
  assert_probe_value_close(mode, got, ref, norms_rtol=1e-5)
