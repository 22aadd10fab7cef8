"""hk.Embed: the Gram embedding op and the tracked module, vs the reference.

CASES.md C06: integer ids (float0 cotangent), ids repeated within an example,
out-of-range ids, a padding id, both lookup styles.
"""

import functools

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.api import reweight
from gram_haiku._src.compute import cost_model
from gram_haiku._src.core import reference
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import RTOL_BF16
from gram_haiku._src.ops import embed as embed_op
from gram_haiku._src.ops.embed import gram_embed
from tests import problems

_HIGHEST = jax.lax.Precision.HIGHEST
STYLES = ("ARRAY_INDEX", "ONE_HOT")


def _problem(seed, b=5, t=8, v=6, d=3, lo=0, hi=None, dtype=jnp.float32,
             ids_dtype=jnp.int32):
  """Random embeddings, ids with many repeats (t > v) and targets."""
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  hi = v if hi is None else hi
  ids = problems.randint(k[0], (b, t), lo, hi).astype(ids_dtype)
  e = problems.normal(k[1], (v, d), dtype)
  y = problems.normal(k[2], (b, t, d))
  return e, ids, y


def _head(out, y):
  return 0.5 * jnp.sum((jnp.tanh(out.astype(jnp.float32)) - y) ** 2)


def _plain_loss(style, depth=0):
  """The untracked lookup, with the same ``depth`` of vmaps as the op."""
  def loss(e, ids, y):
    f = lambda i: embed_op.embed_forward(i, e, style, _HIGHEST)
    for _ in range(depth):
      f = jax.vmap(f)
    return _head(f(ids), y)
  return loss


def _op_gram(e, ids, y, style, b, depth=0, jit="outside", **kw):
  """The op's Gram with ``depth`` nested vmaps (0: explicitly batched);
  ``jit``: the gradient under ``jax.jit`` (``"outside"``, one program),
  around the op (``"inside"``), or None: eagerly, op by op."""
  def loss(probe):
    f = lambda i: gram_embed(i, e, probe, lookup_style=style,
                             precision=_HIGHEST, **kw)
    if jit == "inside":
      f = jax.jit(f)
    for _ in range(depth):
      f = jax.vmap(f)
    return _head(f(ids), y)
  g = jax.grad(loss)
  if jit == "outside":
    g = jax.jit(g)
  mode = kw.get("mode", "gram")
  return g(jnp.zeros((b, b) if mode == "gram" else (b,)))


def _closed_form(e, ids, y):
  """C06's formula by explicit loops, for in-range ids (either style)."""
  out = np.asarray(e)[np.asarray(ids)]
  d = np.tanh(out) - np.asarray(y)
  d = d * (1 - np.tanh(out) ** 2)  # cotangent of the output
  b, t = ids.shape
  g = np.zeros((b, b))
  for i in range(b):
    for j in range(b):
      for s in range(t):
        for u in range(t):
          if ids[i, s] == ids[j, u]:
            g[i, j] += d[i, s] @ d[j, u]
  return g


# -- op level ------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_closed_form_with_repeated_ids(style):
  e, ids, y = _problem(0, hi=3)  # many repeats
  assert len(np.unique(np.asarray(ids[0]))) < 8  # repeats within an example
  gram = _op_gram(e, ids, y, style, 5)
  closed = _closed_form(e, ids, y)
  assert_gram_close(gram, closed)
  assert_gram_close(gram, reference_gram(_plain_loss(style), e, ids, y))
  # Per-token norms (no summing of repeats) would be a different number.
  per_token = np.einsum("itd,itd->i", *(2 * [np.asarray(
      jax.grad(lambda o: _head(o, y))(e[ids]))]))
  assert np.abs(np.diag(closed) - per_token).max() > 1e-3


@pytest.mark.parametrize("style,method", [
    ("ARRAY_INDEX", "ghost"), ("ARRAY_INDEX", "dense"),
    ("ARRAY_INDEX", "segment"), ("ARRAY_INDEX", "auto"),
    ("ONE_HOT", "ghost"), ("ONE_HOT", "segment")])
def test_methods_with_out_of_range_ids(style, method):
  # Ids in [-9, 12) with V=6: negative ids wrap (ARRAY_INDEX) or vanish
  # (ONE_HOT); ids still out of range have no gradient.
  e, ids, y = _problem(1, lo=-9, hi=12)
  strategy = {"dense": "materialize", "segment": "materialize"}.get(method,
                                                                    method)
  budget = kernels.KernelConfig().memory_budget_bytes
  if method == "segment":  # The dense per-example gradients do not fit.
    budget = 5 * 6 * 3 * 4 - 1
  b, t = ids.shape
  assert cost_model.embed_method(b, t, 3, 6, 4, strategy=strategy,
                                 budget=budget) == (
      method if method != "auto" else cost_model.embed_method(b, t, 3, 6, 4))
  ref = reference_gram(_plain_loss(style), e, ids, y)
  assert_gram_close(_op_gram(e, ids, y, style, 5, strategy=strategy,
                             memory_budget_bytes=budget), ref)
  norms = _op_gram(e, ids, y, style, 5, strategy=strategy, mode="norms",
                   memory_budget_bytes=budget)
  assert_gram_close(norms, np.diag(ref))


@pytest.mark.parametrize("method", ["ghost", "segment"])
def test_row_blocking_bounds_memory(method):
  e, ids, y = _problem(2, hi=4)
  strategy = "ghost" if method == "ghost" else "materialize"
  fn = functools.partial(_op_gram, e, ids, y, "ARRAY_INDEX", 5,
                         strategy=strategy, memory_budget_bytes=300)
  jaxpr = str(jax.make_jaxpr(lambda: fn())())
  assert "scan" in jaxpr or "while" in jaxpr  # lax.map over row blocks
  assert_gram_close(fn(), reference_gram(_plain_loss("ARRAY_INDEX"), e, ids,
                                         y))


@pytest.mark.parametrize("budget", [10**9, 8000, 2000, 1000])
def test_pair_blocking_same_result(budget):
  # Unblocked, row blocks (padded), and row-by-column blocks.
  _, ids, _ = _problem(10, lo=-3, hi=8)
  d = problems.normal(jax.random.PRNGKey(11), (5, 8, 3))
  cfg = kernels.KernelConfig(memory_budget_bytes=budget)

  @jax.jit  # one program, not op by op
  def grams(ids, d):
    key, weight, _ = embed_op.lookup_keys(ids, 6, "ARRAY_INDEX")
    d = jnp.where((weight > 0)[..., None], d, 0)
    whole = [embed_op.ghost_gram(key, weight, d, kernels.LOCAL),
             embed_op.segment_gram(key, weight, d, kernels.LOCAL)]
    blocked = [embed_op.ghost_gram(key, weight, d, cfg),
               embed_op.segment_gram(key, weight, d, cfg)]
    return whole, blocked
  whole, blocked = grams(ids, d)
  for w, bl in zip(whole, blocked):
    np.testing.assert_allclose(bl, w, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(whole[0], whole[1], rtol=1e-5, atol=1e-5)


def test_dense_never_over_budget():
  # B V D * 4 bytes = 4 * 100 * 8 * 4 > 1000: never the dense form.
  for strategy in ("auto", "materialize"):
    assert cost_model.embed_method(4, 64, 8, 100, 4, strategy=strategy,
                                   budget=1000) != "dense"
  assert cost_model.embed_method(4, 64, 8, 7, 4, strategy="materialize",
                                 budget=1000) == "dense"
  assert cost_model.embed_method(64, 1, 8, 5, 4) == "ghost"
  assert cost_model.embed_method(8, 512, 64, 50000, 4) == "segment"
  with pytest.raises(ValueError, match="Unknown Gram strategy"):
    gram_embed(jnp.zeros((2, 3), jnp.int32), jnp.ones((4, 2)),
               jnp.zeros((2, 2)), strategy="fast")


@pytest.mark.parametrize("style,depth,jit", [
    ("ARRAY_INDEX", 1, None), ("ARRAY_INDEX", 2, "outside"),
    ("ARRAY_INDEX", 2, "inside"), ("ONE_HOT", 1, "inside"),
    ("ONE_HOT", 2, None)])
def test_vmap_depth_and_jit(style, depth, jit):
  # With depth 2 the layer sees scalar ids: out-of-range ids are clamped in
  # the gradient too (jnp's dynamic_slice), where depth 1 drops them.
  e, ids, y = _problem(3, lo=-8, hi=10)
  ref = reference_gram(_plain_loss(style, depth), e, ids, y)
  assert_gram_close(_op_gram(e, ids, y, style, 5, depth=depth, jit=jit), ref)


def test_multi_dim_ids_and_inner_axes():
  # ids (B, T, K) (paxml's EmbeddingMultiDimInputs), vmapped over B only.
  e, ids, y = _problem(4, lo=-2, hi=8)
  ids, y = ids.reshape(5, 4, 2), y.reshape(5, 4, 2, 3)
  for depth in (0, 3):
    ref = reference_gram(_plain_loss("ARRAY_INDEX", depth), e, ids, y)
    assert_gram_close(_op_gram(e, ids, y, "ARRAY_INDEX", 5, depth=depth), ref)


@pytest.mark.parametrize("ids_dtype", [jnp.int32, jnp.uint32, jnp.int8])
def test_scalar_ids_clamp_out_of_range(ids_dtype):
  # A scalar id is read by dynamic_slice: out of range, it is clamped in the
  # gradient as in the forward pass (an array of ids drops it instead). The
  # op, batched by vmap, keeps the scalar behaviour: same parameter
  # gradient and Gram as vmap(vmap(lookup)). uint32: the negative values
  # wrap to 2**32 - k, which jnp converts back to -k.
  e, ids, y = _problem(9, lo=-12, hi=14)
  ids = ids.astype(ids_dtype)
  plain = _plain_loss("ARRAY_INDEX", depth=2)
  def tracked(e, probe):
    f = jax.vmap(jax.vmap(lambda i: gram_embed(i, e, probe)))
    return _head(f(ids), y)
  ge, gram = jax.grad(tracked, argnums=(0, 1))(e, jnp.zeros((5, 5)))
  np.testing.assert_allclose(ge, jax.grad(plain)(e, ids, y), rtol=1e-6)
  ref = reference_gram(plain, e, ids, y)
  assert_gram_close(gram, ref)
  # Not the array semantics: there the out-of-range lookups have no gradient.
  assert np.abs(ref - reference_gram(_plain_loss("ARRAY_INDEX"), e, ids,
                                     y)).max() > 1e-3


@pytest.mark.parametrize("style,ids_dtype,v,lo,hi,strategy", [
    # one_hot's iota(V) in the ids' dtype wraps: an id matches 2 rows.
    ("ONE_HOT", jnp.uint8, 300, 0, 256, "materialize"),
    # Wraps too: negative ids match rows >= 128.
    ("ONE_HOT", jnp.int8, 200, -128, 128, "ghost"),
    # Negative ids normalised in int8 (uint32: test_huge_unsigned_ids...).
    ("ARRAY_INDEX", jnp.int8, 100, -128, 128, "materialize"),
])
def test_id_dtypes(style, ids_dtype, v, lo, hi, strategy):
  k = jax.random.split(jax.random.PRNGKey(5), 3)
  ids = problems.randint(k[0], (4, 40), lo, hi).astype(ids_dtype)
  e = problems.normal(k[1], (v, 2))
  y = problems.normal(k[2], (4, 40, 2))
  ref = reference_gram(_plain_loss(style), e, ids, y)
  assert_gram_close(_op_gram(e, ids, y, style, 4, strategy=strategy), ref)


def test_huge_unsigned_ids_have_no_gradient():
  # uint32 ids >= 2**31 become negative int32 indices: the gather clamps
  # them, the scatter-add of the gradient drops them.
  e, ids, y = _problem(6)
  huge = jnp.array([2**31, 2**31 + 1, 2**32 - 1, 2**32 - 5, 3], jnp.uint32)
  ids = jnp.where(jnp.arange(8) % 3 == 0, huge[:, None],
                  ids.astype(jnp.uint32))
  for style in STYLES:
    ref = reference_gram(_plain_loss(style), e, ids, y)
    assert_gram_close(_op_gram(e, ids, y, style, 5), ref)


@pytest.mark.parametrize("style", STYLES)
def test_cotangents_parity_float0(style):
  e, ids, y = _problem(7, lo=-3, hi=9)
  def loss(e, probe, ids):
    return _head(jax.vmap(lambda i: gram_embed(
        i, e, probe, lookup_style=style, precision=_HIGHEST))(ids), y)
  grad = jax.grad(loss, argnums=(0, 1, 2), allow_int=True)
  for ge, gp, gi in (grad(e, jnp.zeros((5, 5)), ids),
                     jax.eval_shape(grad, e, jnp.zeros((5, 5)), ids)):
    assert gi.dtype == jax.dtypes.float0 and gi.shape == ids.shape
    assert ge.dtype == e.dtype and ge.shape == e.shape
    assert gp.dtype == jnp.float32 and gp.shape == (5, 5)
  ge, _, _ = grad(e, jnp.zeros((5, 5)), ids)
  np.testing.assert_allclose(ge, jax.grad(_plain_loss(style))(e, ids, y),
                             rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("style", STYLES)
def test_forward_bitwise_equal_to_hk_embed(style):
  e, ids, _ = _problem(8, lo=-8, hi=10)
  plain = hk.without_apply_rng(hk.transform(
      lambda i: hk.Embed(embedding_matrix=e, lookup_style=style)(i)))
  out = gram_embed(ids, e, jnp.zeros((5, 5)), lookup_style=style,
                   precision=_HIGHEST)
  np.testing.assert_array_equal(out, plain.apply(plain.init(None, ids), ids))


def test_op_errors():
  with pytest.raises(ValueError, match="integer ids"):
    gram_embed(jnp.ones((2, 3)), jnp.ones((4, 2)), jnp.zeros((2, 2)))
  with pytest.raises(ValueError, match="Unknown Gram strategy"):
    gram_embed(jnp.ones((2, 3), int), jnp.ones((4, 2)), jnp.zeros((2, 2)),
               strategy="fast")


# -- hk.Embed inside track() ---------------------------------------------------


def _model(style, v=7, d=4, **embed_kw):
  def model(ids):
    h = hk.Embed(v, d, lookup_style=style, **embed_kw)(ids)
    return hk.Linear(3)(jnp.tanh(h))
  return model


def _sq(out, y):
  return 0.5 * jnp.sum((out.astype(jnp.float32) - y) ** 2)


def _track_check(model, ids, y, jit=False, loss=_sq, cast=None, **track_kw):
  def tracked(ids, y):
    with gram_haiku.track(**track_kw):
      return loss(model(ids), y)
  f = hk.transform_with_state(tracked)
  g = hk.without_apply_rng(hk.transform(lambda ids, y: loss(model(ids), y)))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), ids, y)
  chex.assert_trees_all_equal(
      params, jax.jit(g.init)(jax.random.PRNGKey(0), ids, y))
  if cast is not None:
    params = jax.tree.map(lambda a: a.astype(cast), params)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  if jit:
    fn = jax.jit(fn)
  value, grads, grams = fn(params, state, None, ids, y)
  np.testing.assert_allclose(value, jax.jit(g.apply)(params, ids, y),
                             rtol=1e-6)
  chex.assert_trees_all_close(grads,
                              jax.jit(jax.grad(g.apply))(params, ids, y),
                              rtol=1e-5, atol=1e-6)
  return grams, params, g


def _embed_ref(g, params, ids, y, name="embed"):
  """Reference Gram of the embedding parameters only."""
  def loss(e, ids, y):
    p = dict(params)
    p[name] = {"embeddings": e}
    return g.apply(p, ids, y)
  return reference_gram(loss, params[name]["embeddings"], ids, y)


def _ids(seed, shape, lo=0, hi=7):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (problems.randint(k1, shape, lo, hi),
          problems.normal(k2, shape + (3,)))


@pytest.mark.parametrize("style,layout", [
    ("ARRAY_INDEX", "explicit"), ("ONE_HOT", "explicit"),
    ("ONE_HOT", "vmap1"), ("ARRAY_INDEX", "vmap2")])
def test_track_layouts(style, layout):
  ids, y = _ids(10, (5, 8), lo=-3, hi=10)  # repeats and out-of-range ids
  model = _model(style)
  if layout == "vmap1":
    model = hk.vmap(model, split_rng=False)
  elif layout == "vmap2":
    model = hk.vmap(hk.vmap(model, split_rng=False), split_rng=False)
  grams, params, g = _track_check(model, ids, y, jit=layout == "vmap1")
  assert set(grams.by_layer) == {"embed", "linear"}
  assert_gram_close(grams.total, reference_gram(g.apply, params, ids, y))
  assert_gram_close(grams.by_layer["embed"], _embed_ref(g, params, ids, y))


@pytest.mark.parametrize("style", STYLES)
def test_track_forward_identical_to_hk_embed(style):
  ids, _ = _ids(11, (5, 8), lo=-9, hi=12)
  def tracked_out(ids):
    with gram_haiku.track():
      return hk.Embed(7, 4, lookup_style=style)(ids)
  f = hk.transform_with_state(tracked_out)
  plain = hk.transform(lambda ids: hk.Embed(7, 4, lookup_style=style)(ids))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), ids)
  chex.assert_trees_all_equal(
      params, jax.jit(plain.init)(jax.random.PRNGKey(0), ids))
  assert set(state) == {"embed"}
  out, _ = f.apply(params, state, None, ids)
  np.testing.assert_array_equal(out, plain.apply(params, None, ids))


def test_track_call_time_lookup_style_override():
  ids, y = _ids(12, (5, 8))
  def model(ids):
    h = hk.Embed(7, 4, lookup_style="ARRAY_INDEX")(ids, lookup_style="one_hot")
    return hk.Linear(3)(h)
  grams, params, g = _track_check(model, ids, y)
  assert_gram_close(grams.total, reference_gram(g.apply, params, ids, y))


def test_track_pad_id_masked_in_loss_adds_nothing():
  # C06 padding variant: positions with id 0 are masked out of the loss, so
  # the pad row has zero per-example gradient, and nothing of the pad
  # positions' cotangents (zero) reaches the Gram.
  ids, y = _ids(13, (5, 8), lo=0, hi=4)
  y = jnp.where((ids != 0)[..., None], y, 0.0)
  def model(ids):
    out = _model("ARRAY_INDEX")(ids)
    return jnp.where((ids != 0)[..., None], out, 0.0)
  grams, params, g = _track_check(model, ids, y)
  ref = reference_gram(g.apply, params, ids, y)
  assert_gram_close(grams.total, ref)
  per_ex = jax.vmap(jax.grad(lambda p, i, yy: g.apply(p, i[None], yy[None])),
                    in_axes=(None, 0, 0))(params, ids, y)
  np.testing.assert_array_equal(per_ex["embed"]["embeddings"][:, 0], 0.0)


def test_track_norms_mode():
  ids, y = _ids(14, (5, 8), lo=-2, hi=9)
  grams, params, g = _track_check(_model("ONE_HOT"), ids, y, mode="norms")
  ref = reference_gram(g.apply, params, ids, y)
  np.testing.assert_allclose(grams.sq_norms, np.diag(ref), rtol=1e-4)
  np.testing.assert_allclose(grams.sq_norms_by_layer["embed"],
                             np.diag(_embed_ref(g, params, ids, y)),
                             rtol=1e-4)


def test_track_embed_called_twice_has_cross_terms():
  ids, y = _ids(15, (5, 8))
  def model(ids):
    embed = hk.Embed(7, 4)
    h = embed(ids) + jnp.roll(embed((ids + 2) % 7), 1, axis=-2)
    return hk.Linear(3)(h)
  grams, params, g = _track_check(model, ids, y)
  assert_gram_close(grams.total, reference_gram(g.apply, params, ids, y))
  assert_gram_close(grams.by_layer["embed"], _embed_ref(g, params, ids, y))


def test_track_bf16_embeddings():
  ids, y = _ids(16, (5, 8))
  def model(ids):
    h = hk.Embed(7, 4, w_init=hk.initializers.RandomNormal())(ids)
    return jnp.tanh(h.astype(jnp.float32)) @ jnp.ones((4, 3))
  grams, params, g = _track_check(model, ids, y, cast=jnp.bfloat16)
  assert params["embed"]["embeddings"].dtype == jnp.bfloat16
  assert grams.total.dtype == jnp.float32
  p32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  assert_gram_close(grams.total, reference_gram(g.apply, p32, ids, y),
                    rtol=RTOL_BF16)


def test_track_tied_output_layer_via_unembed(style="ARRAY_INDEX"):
  # The embedding table also used as the output layer (gram_haiku.unembed):
  # its per-example gradient sums both uses, so the Gram has cross terms
  # between the lookup (this op, in per-example mode) and the output layer.
  ids, _ = _ids(17, (5, 8), lo=-2, hi=9)
  y = problems.normal(jax.random.PRNGKey(18), (5, 8, 7))
  def model(ids):
    embed = hk.Embed(7, 4, lookup_style=style)
    h = jnp.tanh(hk.Linear(4)(embed(ids)))
    return gram_haiku.unembed(embed, h)  # h @ embed.embeddings.T, tracked
  grams, params, g = _track_check(model, ids, y)
  assert set(grams.by_layer) == {"embed", "linear"}
  assert_gram_close(grams.total, reference_gram(g.apply, params, ids, y))
  assert_gram_close(grams.by_layer["embed"], _embed_ref(g, params, ids, y))


# -- a tied table's parts store (clipping without B x V x D) -----------------


def _tied_model(style, v=64, d=16):
  """A lookup, a tracked hidden layer and the tied output layer; the loss
  is linear in both uses (``sum(e * w1) + sum(logits * w2)``), so the
  cotangents are exact and the float64 reference is the truth."""
  def body(ids, hx, w1, w2):
    embed = hk.Embed(v, d, lookup_style=style, name="embed")
    e = embed(ids)
    h = hx + hk.Linear(d, name="hidden")(jnp.tanh(e))
    return jnp.sum(e * w1) + jnp.sum(gram_haiku.unembed(embed, h) * w2)
  return body


def _tied_case(seed, b=5, t=4, v=64, d=16, cancel=False, offset=1e3):
  """Ids (out-of-range and repeated ones included), hidden offsets and the
  loss weights. ``cancel``: example 0's lookup gradient nearly cancels its
  output-layer gradient (``E_0 ~ -O_0``, entries ``offset`` large), and its
  hidden inputs carry ``+a``, ``-a`` offsets."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, v, size=(b, t)).astype(np.int32)
  ids[1, 1] = ids[1, 0]  # a repeat, an out-of-range id (its gradient is
  ids[2, 2], ids[3, 0] = v, -1  # dropped) and a negative one (row v - 1)
  hx = rng.normal(size=(b, t, d)).astype(np.float32)
  w1 = rng.normal(size=(b, t, d)).astype(np.float32)
  w2 = rng.normal(size=(b, t, v)).astype(np.float32)
  if cancel:
    ids[0] = rng.choice(v, size=t, replace=False)
    a = rng.normal(size=d)
    hx[0, 0] += offset * a / np.linalg.norm(a)
    hx[0, 1] -= offset * a / np.linalg.norm(a)
    w2[0] = 0
    w2[0][:, ids[0]] = rng.normal(size=(t, t))
  return ids, hx, w1, w2


def _tied_reference(body, params, batch):
  with jax.enable_x64(True):
    plain = hk.without_apply_rng(hk.transform(body))
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    b64 = [a if a.dtype.kind == "i" else np.asarray(a, np.float64)
           for a in batch]
    return np.asarray(reference.per_example_grads(
        lambda p, *ex: plain.apply(p, *ex), p64, *b64), np.float64)


def _tied_step(body, batch, clipping="all-layer"):
  f = hk.transform_with_state(lambda *a: _tracked_sum(body, *a))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), *batch)
  step = jax.jit(gram_haiku.clipped_grad(f.apply, 1.0, clipping=clipping,
                                         full_aux=True))
  return f, params, state, step(params, state, None, *batch)


def _tracked_sum(body, *args):
  with gram_haiku.track(mode="norms"):
    return body(*args)


@pytest.mark.parametrize("style,clipping,two_level", [
    ("ARRAY_INDEX", "all-layer", True), ("ONE_HOT", "per-layer", False)])
def test_tied_table_clips_from_its_parts(style, clipping, two_level,
                                         monkeypatch):
  # The tied table keeps each use's factors (not B x V x D per-example
  # gradients); its norm bounds hold against float64 and the clipped sum is
  # the reference sum clipped by those bounds. two_level: the output
  # layer's logits-cotangent kernel in 17 chunks of its 301 features, the
  # last one shorter (as a 32000-word vocabulary's, norm_bounds.kernel).
  v = 64
  if two_level:
    v = 301
    monkeypatch.setattr(norm_bounds, "KERNEL_LEVEL_FEATURES", 64)
    monkeypatch.setattr(norm_bounds, "KERNEL_CHUNK", 16)
    assert norm_bounds.kernel_split(v) == (17, 18)
  body = _tied_model(style, v=v)
  batch = _tied_case(21, v=v)
  f, params, state, (grads, aux) = _tied_step(body, batch, clipping)
  r = reweight.run(f.apply, params, state, None, batch, {},
                   fn_name="clipped_grad", needs="norms", has_aux=False,
                   axes=(), frozen=None, weight_fn=lambda g: g.norms,
                   privacy=True)
  assert r.modes["embed"] == "parts", r.modes
  ref = _tied_reference(body, params, batch)
  cols = reference.column_groups(params)
  if clipping == "all-layer":
    reference.assert_sound_norms(aux.grad_norms,
                                 np.linalg.norm(ref, axis=1))
    c = reference.clip_reference(aux.grad_norms, 1.0)
    want = reference.weighted_sum(ref, c, params)
  else:
    flat = np.zeros(ref.shape[1])
    for m, idx in cols.items():
      bound = np.sqrt(np.asarray(aux.grams.sq_norms_by_layer[m], np.float64))
      reference.assert_sound_norms(bound, np.linalg.norm(ref[:, idx], axis=1))
      c = np.asarray(aux.weights[m], np.float64)
      flat[idx] = c @ ref[:, idx]
    want = reference.weighted_sum(flat[None], np.ones(1), params)
  chex.assert_trees_all_close(
      jax.tree.map(lambda a: np.asarray(a, np.float64), grads), want,
      rtol=2e-5, atol=2e-6)


def test_tied_table_bound_holds_where_its_uses_cancel():
  # Example 0's lookup and output-layer gradients nearly cancel (a large
  # cross term) and its hidden inputs carry large opposite offsets: the
  # norm bound stays at or above the float64 norm; the others stay tight.
  body = _tied_model("ARRAY_INDEX")
  batch = list(_tied_case(22, cancel=True))
  params = hk.without_apply_rng(hk.transform(body)).init(
      jax.random.PRNGKey(0), *batch)
  ids, hx, w1, w2 = batch
  # w1_t = -O_0[k_t] + small (O_0 from the output layer's factors, in
  # float64): the lookup's cotangent is w1 plus the hidden layer's share.
  plain = hk.without_apply_rng(hk.transform(
      lambda ids, hx: _hidden(body, ids, hx)))
  h = np.asarray(plain.apply(params, ids, hx), np.float64)[0]
  o = w2[0].astype(np.float64).T @ h  # [V, D]
  w1[0] = (-o[ids[0]] + 1e-3 * np.random.RandomState(0).normal(
      size=w1[0].shape)).astype(np.float32)
  f, params, state, (_, aux) = _tied_step(body, batch)
  ref = _tied_reference(body, params, batch)
  true = np.linalg.norm(ref, axis=1)
  bounds = np.asarray(aux.grad_norms, np.float64)
  assert np.all(bounds >= true * (1 - 1e-9)), (bounds, true)
  reference.assert_sound_norms(bounds[1:], true[1:])
  assert np.all(np.isfinite(bounds))


def test_tied_table_parts_are_not_padded_to_the_shared_width():
  # Each use of the tied table keeps its factors in a probe of its own:
  # the compiled clipping step holds no array as wide as both uses'
  # factors together (B x (T (D + 1) + T (D + V))). Columns of one shared
  # probe were padded back to that width in the backward pass and added,
  # use by use (docs/performance.rst, the GPT's tied embedding).
  b, t, v, d = 5, 4, 64, 16
  body = _tied_model("ARRAY_INDEX", v=v, d=d)
  batch = _tied_case(23, b=b, t=t, v=v, d=d)
  f = hk.transform_with_state(lambda *a: _tracked_sum(body, *a))
  params, state = jax.eval_shape(f.init, jax.random.PRNGKey(0), *batch)
  modes = []  # (the stores the pass keeps, traced abstractly)
  jax.eval_shape(lambda p, s: modes.append(reweight.run(
      f.apply, p, s, None, batch, {}, fn_name="clipped_grad", needs="norms",
      has_aux=False, axes=(), frozen=None, weight_fn=lambda g: g.norms,
      privacy=True).modes), params, state)
  assert modes[0]["embed"] == "parts", modes
  step = jax.jit(gram_haiku.clipped_grad(f.apply, 1.0))
  hlo = step.lower(params, state, None, *batch).compile().as_text()
  lookup, output = t * (d + 1), t * (d + v)  # each use's factors
  assert f"[{b},{lookup + output}]" not in hlo


def _hidden(body, ids, hx):
  """The tied model's output-layer input ``h``."""
  del body
  embed = hk.Embed(64, 16, name="embed")
  return hx + hk.Linear(16, name="hidden")(jnp.tanh(embed(ids)))
