"""``gram_haiku.functional``: a plain-JAX loss ``loss(params, *batch)``
over any pytree, every parameter covered by a program-level rule; exact
against ``F @ F.T`` of ``vmap(grad)`` in float64 and against the reference
clipped and reweighted sums; an uncovered use refused with the line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gram_haiku import functional as gf
from gram_haiku import testing
from tests import problems

B, D = 5, 4


def _scale_shift(params, x, y):
  """Per-feature scale, shift and gates of nested and list leaves, a huge
  shift (cancellation in the gradient of the scale)."""
  h = x * params["a"]["scale"] + params["a"]["shift"]
  h = jnp.tanh(h / 1e3) * params["gates"][0] + jnp.exp(params["gates"][1])
  return jnp.sum((h - y) ** 2)


def _params(dtype):
  rng = np.random.default_rng(1)
  return {"a": {"scale": jnp.asarray(rng.standard_normal(D), dtype),
                "shift": jnp.full((D,), 1e3, dtype)},
          "gates": [jnp.asarray(rng.standard_normal(D), dtype),
                    jnp.asarray(rng.standard_normal(()), dtype)]}


def _batch(dtype, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((B, D)), dtype),
          jnp.asarray(rng.standard_normal((B, D)), dtype))


def _one(loss):
  return lambda p, *ex: loss(p, *ex)


def test_gram_grads_and_coverage_are_the_reference():
  with jax.enable_x64(True):
    params, (x, y) = _params(jnp.float64), _batch(jnp.float64)
    value, grads, grams = jax.jit(gf.value_grad_and_gram(_scale_shift))(
        params, x, y)
    f = testing.per_example_grads(_one(_scale_shift), params, x, y)
    np.testing.assert_allclose(grams.total, f @ f.T, rtol=1e-10, atol=0)
    np.testing.assert_allclose(value, _scale_shift(params, x, y),
                               rtol=1e-12)
    want = jax.grad(_scale_shift)(params, x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10),
                 grads, want)
    assert grams.complete
    assert set(grams.coverage) == {"a/scale", "a/shift", "gates/0",
                                   "gates/1"}
    assert all(c.rule.startswith("program:")
               for c in grams.coverage.values())


@pytest.mark.parametrize("function", ["abadi", "automatic"])
def test_clipped_and_reweighted_sums_are_the_reference(function):
  with jax.enable_x64(True):
    params, (x, y) = _params(jnp.float64), _batch(jnp.float64, seed=3)
    f = np.asarray(testing.per_example_grads(_one(_scale_shift), params, x,
                                             y))
    norms = np.linalg.norm(f, axis=1)
    c_clip = float(np.median(norms))
    grads = jax.jit(gf.clipped_grad(_scale_shift, l2_clip_norm=c_clip,
                                    clip_fn=function))(params, x, y)
    want = testing.weighted_sum(
        f, testing.clip_reference(norms, c_clip, function), params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
                 grads, want)
    c = jnp.arange(1.0, B + 1)
    _, grads, _, got_c = jax.jit(gf.reweighted_grad(
        _scale_shift, lambda grams: c, needs="gram"))(params, x, y)
    np.testing.assert_array_equal(got_c, c)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
                 grads, testing.weighted_sum(f, c, params))


def test_clipped_grad_numbers_the_batch_as_jax_privacy_does():
  jax_privacy = pytest.importorskip("jax_privacy")
  params, (x, y) = _params(jnp.float32), _batch(jnp.float32, seed=5)
  params["a"]["shift"] = jnp.zeros((D,))
  ours = jax.jit(gf.clipped_grad(_scale_shift, l2_clip_norm=0.3,
                                 batch_argnums=(1, 2)))(params, x, y)
  theirs = jax.jit(jax_privacy.clipping.clipped_grad(
      _scale_shift, l2_clip_norm=0.3, batch_argnums=(1, 2)))(params, x, y)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5,
                                                       atol=1e-6),
               ours, theirs)
  with pytest.raises(ValueError, match="numbered from 1"):
    gf.clipped_grad(_scale_shift, l2_clip_norm=1.0, batch_argnums=0)


def test_an_example_independent_argument_is_declared_with_example_axes():
  """A table every example reads (B rows by coincidence) is declared None."""
  def loss(params, x, table):
    return jnp.sum(jnp.tanh(x * params["s"]) @ table)
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    params = {"s": jnp.asarray(rng.standard_normal(D))}
    x = jnp.asarray(rng.standard_normal((B, D)))
    table = jnp.asarray(rng.standard_normal((D, 3)))
    _, _, grams = gf.value_grad_and_gram(loss, example_axes=(0, None))(
        params, x, table)
    f = testing.per_example_grads(lambda p, xi: loss(p, xi, table), params,
                                  x)
    np.testing.assert_allclose(grams.total, f @ f.T, rtol=1e-10)


def test_an_uncovered_use_is_refused_with_its_line():
  def loss(params, x):  # (q is the padding value of the data)
    h = jax.lax.pad(x + params["p"], params["q"], [(0, 0, 0), (1, 1, 0)])
    return jnp.sum(jnp.tanh(h))
  params = {"p": jnp.ones(D), "q": jnp.asarray(0.5)}
  x = jnp.ones((B, D))
  with pytest.raises(ValueError) as e:
    gf.value_grad_and_gram(loss)(params, x)
  message = str(e.value)
  assert "plain-JAX loss" in message and "'q'" in message
  assert "`pad`" in message
  assert "test_functional.py" in message and "What to do" in message


def test_batch_arguments_of_different_sizes_ask_for_example_axes():
  def loss(params, x, z):
    return jnp.sum(x * params["p"]) + jnp.sum(z * params["p"][0])
  with pytest.raises(ValueError, match="example_axes"):
    gf.value_grad_and_gram(loss)({"p": jnp.ones(D)}, jnp.ones((B, D)),
                                 jnp.ones((B + 1, D)))


@pytest.mark.parametrize("function", ["gram", "reweighted", "clipped"])
def test_an_integer_or_boolean_parameter_leaf_is_a_teaching_error(function):
  """No gradient exists for it (jax.grad refuses it): the error names each
  leaf and its dtype, and says where such a value belongs."""
  def loss(params, x):
    return jnp.sum(jnp.tanh(x * params["p"]) * params["n"] * params["on"])
  params = {"p": jnp.ones(D), "n": jnp.asarray(2, jnp.int32),
            "on": jnp.asarray(True)}
  fns = {"gram": lambda: gf.value_grad_and_gram(loss),
         "reweighted": lambda: gf.reweighted_grad(loss, lambda g: 1.0),
         "clipped": lambda: gf.clipped_grad(loss, l2_clip_norm=1.0)}
  with pytest.raises(ValueError) as e:
    fns[function]()(params, jnp.ones((B, D)))
  message = str(e.value)
  assert "'n', 'on'" in message and "int32, bool" in message
  assert "floating-point" in message and "What to do" in message


@jax.jit
def _scaled_and_hidden(params, x):
  """A jitted helper that takes the examples and returns, among its
  outputs, a value of the parameters alone (and one it passes through)."""
  return params["w"] * 2, params["w"], jnp.tanh(x) + params["s"]


def test_a_parameter_value_returned_by_a_jit_call_that_reads_the_examples():
  """The prefix of a site outside the call is computed from the call's
  body cut to that output (it once pulled the examples in: an internal
  error)."""
  def loss(params, x):
    w2, w, h = _scaled_and_hidden(params, x)
    return jnp.sum(jnp.tanh(h @ w2) * (x @ w))
  with jax.enable_x64(True):
    rng = np.random.default_rng(2)
    params = {"w": jnp.asarray(rng.standard_normal((D, 3))),
              "s": jnp.asarray(rng.standard_normal(D))}
    x = jnp.asarray(rng.standard_normal((B, D)))
    _, _, grams = jax.jit(gf.value_grad_and_gram(loss))(params, x)
    f = np.asarray(testing.per_example_grads(loss, params, x))
    np.testing.assert_allclose(grams.total, f @ f.T, rtol=1e-10)
    norms = np.linalg.norm(f, axis=1)
    c_norm = float(np.median(norms))
    got = jax.jit(gf.clipped_grad(loss, l2_clip_norm=c_norm))(params, x)
    want = testing.weighted_sum(f, testing.clip_reference(norms, c_norm),
                                params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
                 got, want)


@pytest.mark.parametrize("use", ["take", "sort"])
def test_a_refusal_inside_a_jax_numpy_function_names_the_users_line(use):
  """``jnp.take`` and ``jnp.sort`` are jitted: their equations' tracebacks
  end inside JAX, so the message names the line of the call."""
  def loss(params, x, ids):
    if use == "take":  # every example reads the first example's row
      rows = jnp.take(params["t"], jnp.broadcast_to(ids[0], ids.shape), 0)
      return jnp.sum(rows * x)
    return jnp.sort(jnp.sum(x * params["t"][0], 1))[-1]  # the largest
  params = {"t": jnp.ones((3, D))}
  with pytest.raises(ValueError) as e:
    gf.value_grad_and_gram(loss)(params, jnp.ones((B, D)),
                                 jnp.zeros((B,), jnp.int32))
  assert "test_functional.py" in str(e.value)


def test_an_empty_batch_gives_empty_grams_and_a_zero_sum():
  """B = 0 (Poisson sampling can draw an empty batch): as for a Haiku
  model, not a refusal; a penalty on a parameter is still refused."""
  def loss(params, x, ids):
    h = jnp.tanh(x @ params["w"] + params["b"]) * params["t"][ids]
    return jnp.sum(h ** 2)
  params = {"w": jnp.ones((D, 3)), "b": jnp.ones(3), "t": jnp.ones((5, 3))}
  x, ids = jnp.ones((0, D)), jnp.zeros((0,), jnp.int32)
  _, grads, grams = gf.value_grad_and_gram(loss)(params, x, ids)
  assert grams.total.shape == (0, 0) and grams.complete
  clipped = gf.clipped_grad(loss, l2_clip_norm=1.0)(params, x, ids)
  for g in (grads, clipped):
    jax.tree.map(lambda a, p: np.testing.assert_array_equal(
        a, np.zeros_like(p)), g, params)
  with pytest.raises(ValueError, match="'w'.*penalty"):
    gf.value_grad_and_gram(lambda p, *a: loss(p, *a) + jnp.sum(p["w"] ** 2))(
        params, x, ids)


def test_mesh_with_program_level_rules():
  """``mesh=`` (a one-device mesh: the shard_map's varying types are the
  same) with a broadcast, a contraction and a table: a parameter's prefix,
  cast to vary over the mesh in the traced program, is evaluated again for
  the examples' cotangents (which already vary): once a pvary error."""
  def loss(params, x, ids):
    h = jnp.tanh(x @ params["w"] + params["b"]) * params["t"][ids]
    return jnp.sum(h ** 2)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.standard_normal((D, 3)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal(3), jnp.float32),
            "t": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)}
  x = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
  ids = jnp.asarray(rng.integers(0, 5, (B,)))
  _, _, grams = jax.jit(gf.value_grad_and_gram(loss, mesh=mesh))(
      params, x, ids)
  f = np.asarray(testing.per_example_grads(loss, params, x, ids),
                 np.float64)
  testing.assert_gram_close(grams.total, f @ f.T, "float32")
  norms = np.linalg.norm(f, axis=1)
  c_norm = float(np.median(norms))
  got = jax.jit(gf.clipped_grad(loss, mesh=mesh, l2_clip_norm=c_norm))(
      params, x, ids)
  want = testing.weighted_sum(f, testing.clip_reference(norms, c_norm),
                              params)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-5),
               got, want)


@pytest.mark.parametrize("use", ["matmul", "conv"])
def test_clip_norms_of_per_example_sites_bound_the_float64_norm(use):
  """The norm a clip factor comes from is not below the float64 norm where
  each example's gradient of a bare weight is a float32 sum over positions
  that cancels (inputs offset by +-1e4 at alternate positions): the bound
  covers the rounding of the site's own contraction, not only of the rows
  that are summed."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((6, 32, 3)).astype(np.float32)
  x[:, ::2] += 1e4
  x[:, 1::2] -= 1e4
  x = jnp.asarray(x)
  if use == "matmul":
    def loss(p, x):
      return jnp.sum((x @ p["w"]).sum(1) * 1e-3)
    params = {"w": jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)}
  else:
    def loss(p, x):
      out = jax.lax.conv_general_dilated(x, p["w"], (1,), "VALID",
                                         dimension_numbers=("NWC", "WIO",
                                                            "NWC"))
      return jnp.sum(out.sum(1) * 1e-3)
    params = {"w": jnp.asarray(rng.standard_normal((2, 3, 4)), jnp.float32)}
  problems.assert_clip_norms_bound(loss, params, x)
