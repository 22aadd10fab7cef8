"""Grams formed from their upper block triangle (``kernels.symmetric_blocks``).

From ``kernels.SYMMETRIC_MIN_ROWS`` examples on, a layer's Gram evaluates
only the pairs of example blocks ``I <= J`` and mirrors the rest. The
helper itself is checked against the full evaluation, every layer of the zoo
with the threshold lowered to its batch, and a model at the real threshold,
where the block-shaped products show in the program lowered for the CPU
(other platforms keep the full products).
"""

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.compute import kernels
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import reference_gram
from tests import layer_zoo
from tests import problems


# The blocks are what a program compiled for the CPU runs; elsewhere the
# full products, whose values the rest of the suite checks (the references
# here are float32-exact only on the CPU).
_CPU_ONLY = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="symmetric blocks are lowered for the CPU only")


def _kernel(xi, di, xj, dj):
  dot = lambda a, b: jnp.matmul(a, b.T, precision="highest")
  return dot(xi, xj) * jnp.tanh(dot(di, dj))


@pytest.mark.parametrize("b,n_blocks", [(1, 4), (3, 4), (5, 4), (17, 4),
                                        (17, 3), (9, 1)])
def test_blocks_match_the_full_evaluation_and_are_symmetric(b, n_blocks):
  x = problems.normal(jax.random.PRNGKey(b), (b, 6))
  d = problems.normal(jax.random.PRNGKey(b + 100), (b, 2))
  out, full = jax.jit(lambda x, d: (  # one program, not op by op
      kernels.symmetric_blocks(_kernel, (x, d), n_blocks),
      _kernel(x, d, x, d)))(x, d)
  assert out.shape == (b, b)
  np.testing.assert_allclose(out, full, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(out, out.T)


def test_only_one_devices_examples_at_the_threshold_use_it():
  big = jnp.zeros((kernels.SYMMETRIC_MIN_ROWS, 2))
  small = big[1:]
  assert kernels.uses_symmetry(kernels.LOCAL, big)
  assert not kernels.uses_symmetry(kernels.LOCAL, small)
  gathered = kernels.LOCAL.replace(column_axes=("batch",))
  assert not kernels.uses_symmetry(gathered, big)


# Every zoo layer, with every batch large enough: its Gram from blocks of
# 1, 2 and 1 examples (B = 4), against the reference, exactly symmetric.
@_CPU_ONLY
@pytest.mark.parametrize("name", [e.name for e in layer_zoo.ENTRIES
                                  if not layer_zoo.is_low_precision(e)])
def test_every_layer_from_blocks_matches_the_reference(name, monkeypatch):
  monkeypatch.setattr(kernels, "SYMMETRIC_MIN_ROWS", 1)
  monkeypatch.setattr(kernels, "SYMMETRIC_BLOCKS", 3)
  entry = layer_zoo.BY_NAME[name]
  grams, ref, *_ = layer_zoo.run(entry, "explicit", layer_zoo.seed_of(name),
                                 strategy="materialize" if "Conv" in name
                                 else "auto")
  assert_gram_close(grams.total, ref)
  for g in jax.tree_util.tree_leaves(grams.by_layer):
    np.testing.assert_array_equal(g, np.asarray(g).T)


@functools.lru_cache(maxsize=None)
def _mlp_at_the_threshold(strategy, bias):
  """The model, its parameters and its jitted ``value_grad_and_gram``,
  made once per process (two tests use it)."""
  b = kernels.SYMMETRIC_MIN_ROWS + 3  # blocks of 257, 257, 256, 257

  def net(x):
    h = jnp.tanh(hk.Linear(6, with_bias=bias)(x))
    return 0.5 * jnp.sum(hk.Linear(3)(h) ** 2)

  def loss(x):
    with gram_haiku.track(strategy=strategy):
      return net(x)
  f = hk.transform_with_state(loss)
  x = problems.normal(jax.random.PRNGKey(0), (b, 5))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(1), x)
  vgg = jax.jit(gram_haiku.value_grad_and_gram(f.apply))
  plain = hk.transform(net)
  return vgg, params, state, x, lambda p, x: plain.apply(p, None, x)


def _product_shapes(vgg, platform, *args):
  """The result shapes of the products in ``vgg`` lowered for ``platform``."""
  text = jax.export.export(vgg, platforms=(platform,))(*args).mlir_module()
  return {line.rsplit("->", 1)[1].split(">")[0].strip() + ">"
          for line in text.splitlines() if "stablehlo.dot_general" in line}


@_CPU_ONLY
@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
@pytest.mark.parametrize("bias", [True, False])
def test_a_batch_at_the_threshold_takes_the_upper_blocks(strategy, bias):
  vgg, params, state, x, plain_loss = _mlp_at_the_threshold(strategy, bias)
  _, _, grams = vgg(params, state, None, x)
  assert_gram_close(grams.total, reference_gram(plain_loss, params, x))
  np.testing.assert_array_equal(grams.total, np.asarray(grams.total).T)
  args = (params, state, None, x)
  # On the CPU ten block products per factor, none over the whole batch;
  # lowered for another platform, the full products (the same program).
  cpu = _product_shapes(vgg, "cpu", *args)
  assert {"tensor<257x257xf32>", "tensor<256x257xf32>"} <= cpu
  assert "tensor<1027x1027xf32>" not in cpu
  tpu = _product_shapes(vgg, "tpu", *args)
  assert "tensor<1027x1027xf32>" in tpu
  assert "tensor<257x257xf32>" not in tpu


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_a_symbolic_batch_size_exports_with_the_full_products(strategy):
  # jax.export with a batch size unknown when tracing: the blocks need a
  # known one, so the full products, exact at every size it is called with.
  vgg, params, state, _, plain_loss = _mlp_at_the_threshold(strategy, True)
  (b,) = jax.export.symbolic_shape("b")
  exported = jax.export.export(vgg)(
      params, state, None, jax.ShapeDtypeStruct((b, 5), jnp.float32))
  for size in (7, kernels.SYMMETRIC_MIN_ROWS + 1):
    x = problems.normal(jax.random.PRNGKey(size), (size, 5))
    _, _, grams = exported.call(params, state, None, x)
    assert grams.total.shape == (size, size)
    assert_gram_close(grams.total, reference_gram(plain_loss, params, x))


# The kernels over pairs of positions (a sequence's ghost Gram, the
# embedding's ghost and segment forms), blocked for memory as well: the
# upper block triangle against every pair, for budgets that take all
# columns at once, rows in blocks, one row's columns in blocks, and (the
# sequence kernel) blocks of positions.
def _pair_kernels(seed):
  from gram_haiku._src.ops import embed as embed_op
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  x = problems.normal(k[0], (7, 5, 3))
  d = problems.normal(k[1], (7, 5, 2))
  # int8 ids, ONE_HOT over 300 rows: iota wraps, so a key's weight is 1 or
  # 2; a few lookups dropped (key -1, weight 0), as out-of-range ids are.
  ids = problems.randint(k[2], (7, 5), -128, 128).astype(jnp.int8)
  rows = problems.normal(k[3], (7, 5, 4))

  @jax.jit  # one program, not op by op
  def embedded(ids, rows, k):
    key, weight, _ = embed_op.lookup_keys(ids, 300, "ONE_HOT")
    dropped = jax.random.bernoulli(k, 0.2, key.shape)
    key = jnp.where(dropped, -1, key)
    weight = jnp.where(dropped, 0, weight)
    return key, weight, jnp.where((weight > 0)[..., None], rows, 0)
  key, weight, rows = embedded(ids, rows, k[4])
  assert int(weight.max()) == 2 and int(weight.min()) == 0
  return {
      "sequence": lambda cfg: kernels.ghost_gram(x, d, cfg),
      "embed_ghost": lambda cfg: embed_op.ghost_gram(key, weight, rows, cfg),
      "embed_segment": lambda cfg: embed_op.segment_gram(key, weight, rows,
                                                         cfg),
  }


@_CPU_ONLY
@pytest.mark.parametrize("budget", [10**9, 700, 150, 20])
def test_pair_kernels_from_blocks_match_every_pair(budget, monkeypatch):
  cfg = kernels.KernelConfig(memory_budget_bytes=budget,
                             precision=jax.lax.Precision.HIGHEST)
  kernels_ = _pair_kernels(budget)
  full = {n: np.asarray(jax.jit(lambda f=f: f(cfg))())
          for n, f in kernels_.items()}
  monkeypatch.setattr(kernels, "SYMMETRIC_MIN_ROWS", 1)
  monkeypatch.setattr(kernels, "SYMMETRIC_BLOCKS", 3)
  for name, f in kernels_.items():
    got = np.asarray(jax.jit(lambda f=f: f(cfg))())
    # Float32 sums in another order: to a few ulps of the largest entry.
    np.testing.assert_allclose(got, full[name], rtol=1e-6,
                               atol=1e-6 * np.abs(full[name]).max(),
                               err_msg=name)
    np.testing.assert_array_equal(got, got.T, err_msg=name)
    assert np.abs(got).max() > 0


def _sequence_and_embedding_net(ids, x):
  h = hk.Embed(11, 4)(ids) + hk.Linear(4)(x)
  return jnp.sum(jnp.tanh(hk.Linear(3, with_bias=False)(h)) ** 2)


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_sequence_models_from_blocks_match_the_reference(strategy,
                                                         monkeypatch):
  # Per-example losses over T = 6 positions: the linear layers' sequence
  # kernels and the embedding's forms (ghost; segment where the dense
  # per-example gradients exceed the budget) from blocks of 3, 3 and 3
  # examples, against the reference.
  monkeypatch.setattr(kernels, "SYMMETRIC_MIN_ROWS", 1)
  monkeypatch.setattr(kernels, "SYMMETRIC_BLOCKS", 3)
  b, t = 9, 6
  ids = problems.randint(jax.random.PRNGKey(0), (b, t), 0, 11)
  x = problems.normal(jax.random.PRNGKey(1), (b, t, 5))

  def loss(ids, x):
    with gram_haiku.track(strategy=strategy, memory_budget_bytes=600):
      return _sequence_and_embedding_net(ids, x)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(2), ids, x)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, ids, x)
  plain = hk.transform(_sequence_and_embedding_net)
  ref = reference_gram(lambda p, ids, x: plain.apply(p, None, ids, x),
                       params, ids, x)
  assert_gram_close(grams.total, ref)
  for g in jax.tree_util.tree_leaves(grams.by_layer):
    np.testing.assert_array_equal(g, np.asarray(g).T)


@_CPU_ONLY
def test_sequence_kernels_at_the_threshold_take_the_upper_blocks():
  # Lowered only (not run): at B = 1027 and T = 2 the sequence ghost kernel
  # and the embedding's ghost form evaluate blocks of about 257 examples on
  # the CPU, every pair of examples at once elsewhere.
  b, t = kernels.SYMMETRIC_MIN_ROWS + 3, 2

  def loss(ids, x):
    with gram_haiku.track(strategy="ghost"):
      return _sequence_and_embedding_net(ids, x)
  f = hk.transform_with_state(loss)
  ids = jnp.zeros((b, t), jnp.int32)
  x = jnp.zeros((b, t, 5))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), ids[:2], x[:2])
  vgg = jax.jit(gram_haiku.value_grad_and_gram(f.apply))
  cpu = _product_shapes(vgg, "cpu", params, state, None, ids, x)
  tpu = _product_shapes(vgg, "tpu", params, state, None, ids, x)
  block, whole = "tensor<257x2x257x2xf32>", f"tensor<{b}x2x{b}x2xf32>"
  assert block in cpu and whole not in cpu
  assert whole in tpu and block not in tpu
