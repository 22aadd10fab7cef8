"""Programs exported with a symbolic batch size or sequence length.

``jax.export`` with ``symbolic_shape`` traces once for every size. Every
choice made from sizes (the cost model's method, the blocks that keep a
kernel within the memory budget, a convolution's patches) takes a symbolic
size as ``cost_model.SYMBOLIC_SIZE``, so the program exports; it is then
checked against the reference at sizes other than the traced one.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import kernels
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import assert_sound_norms
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import weighted_sum
from tests import layer_zoo
from tests import problems


def _exported(entry, symbols, constraints=(), **track_kw):
  """``(call, plain_loss, params)``: the zoo entry's value_grad_and_gram
  exported with the leading ``len(symbols)`` axes of its input symbolic."""
  fn, lead = layer_zoo._styled(entry, "explicit")
  x = layer_zoo._draw(entry, lead, 0)
  tracked = hk.transform_with_state(layer_zoo._tracked(fn, entry, **track_kw))
  plain = hk.transform_with_state(lambda x: layer_zoo._tail(fn(x)))
  params, state = tracked.init(jax.random.PRNGKey(1), x)
  _, plain_state = plain.init(jax.random.PRNGKey(1), x)
  vgg = jax.jit(gram_haiku.value_grad_and_gram(tracked.apply))
  dims = jax.export.symbolic_shape(", ".join(symbols),
                                   constraints=constraints)
  spec = jax.ShapeDtypeStruct(dims + x.shape[len(dims):], x.dtype)
  exported = jax.export.export(vgg)(params, state, None, spec)
  call = lambda x: exported.call(params, state, None, x)[2]
  return call, lambda p, x: plain.apply(p, plain_state, None, x)[0], params


def _draw(entry, *lead, seed):
  """A batch of the entry whose leading axes are ``lead`` (the example
  axis first; a second one replaces the first within-example axis)."""
  shape = tuple(lead) + entry.example_shape[len(lead) - 1:]
  key = jax.random.PRNGKey(seed)
  if entry.ids:
    return problems.randint(key, shape, 0, entry.ids)
  return problems.normal(key, shape)


_EXPLICIT = [e.name for e in layer_zoo.ENTRIES
             if e.explicit_ok and not layer_zoo.is_low_precision(e)]


@pytest.mark.parametrize("name", _EXPLICIT)
def test_every_layer_exports_with_a_symbolic_batch(name):
  entry = layer_zoo.BY_NAME[name]
  call, plain_loss, params = _exported(entry, ["b"])
  for size in (3, 6):
    x = _draw(entry, size, seed=size)
    grams = call(x)
    assert grams.total.shape == (size, size)
    assert_gram_close(grams.total, reference_gram(plain_loss, params, x))


# Each forced method and the blocked kernels (a memory budget of 2000 bytes
# blocks rows, columns and, for a symbolic T costed at 1024, positions).
# Every combination with --conformance-thorough; by default each value of
# each axis (problems.spread).
@pytest.mark.parametrize("name,strategy,budget", problems.spread(
    [(n, n) for n in ("MLP", "Conv2D", "Embed", "transformer-block",
                      "GRU-static")],
    [(s, s) for s in ("ghost", "materialize")],
    [("default", None), ("2000", 2000)]))
def test_forced_methods_and_blocks_export_with_a_symbolic_batch(
    name, strategy, budget):
  entry = layer_zoo.BY_NAME[name]
  kw = {"strategy": strategy}
  if budget:
    kw["memory_budget_bytes"] = budget
  call, plain_loss, params = _exported(entry, ["b"], **kw)
  x = _draw(entry, 5, seed=5)
  assert_gram_close(call(x).total, reference_gram(plain_loss, params, x))


# A sequence length (or image height) symbolic too: the ghost kernels'
# positions, the embedding's segment search and a convolution's patches.
@pytest.mark.parametrize("name,budget,mode", problems.spread(
    [(n, n) for n in ("Linear", "Conv2D", "Embed", "transformer-block")],
    [("default", None), ("2000", 2000)],
    [(m, m) for m in ("gram", "norms")]))
def test_a_symbolic_sequence_length_exports(name, budget, mode):
  entry = layer_zoo.BY_NAME[name]
  kw = {"mode": mode}
  if budget:
    kw["memory_budget_bytes"] = budget
  call, plain_loss, params = _exported(entry, ["b", "t"], ("t >= 3",), **kw)
  t = entry.example_shape[0] + 1  # not the traced length
  x = _draw(entry, 4, t, seed=t)
  ref = reference_gram(plain_loss, params, x)
  grams = call(x)
  if mode == "norms":
    assert_gram_close(grams.sq_norms, np.diag(ref), what="squared norms")
  else:
    assert_gram_close(grams.total, ref)


@pytest.mark.parametrize("clipping", ["all-layer", "per-layer"])
@pytest.mark.parametrize("name", ["MLP", "Conv2D"])
def test_the_clipped_gradient_exports_with_a_symbolic_batch(name, clipping):
  entry = layer_zoo.BY_NAME[name]
  fn, lead = layer_zoo._styled(entry, "explicit")
  x = layer_zoo._draw(entry, lead, 0)
  tracked = hk.transform_with_state(layer_zoo._tracked(fn, entry))
  plain = hk.transform_with_state(lambda x: layer_zoo._tail(fn(x)))
  params, state = tracked.init(jax.random.PRNGKey(1), x)
  _, plain_state = plain.init(jax.random.PRNGKey(1), x)
  step = jax.jit(gram_haiku.clipped_grad(tracked.apply, 0.3,
                                         clipping=clipping))
  (b,) = jax.export.symbolic_shape("b")
  exported = jax.export.export(step)(
      params, state, None, jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype))
  x = _draw(entry, 5, seed=7)
  got, aux = exported.call(params, state, None, x)
  # The reference: each example's gradient (each layer's, per-layer)
  # clipped to its threshold by the norm bound the step used (checked
  # to be sound and tight), summed.
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
  f = np.asarray(per_example_grads(plain_loss, params, x), np.float64)
  modules = sorted(params)
  sizes = [sum(np.size(v) for v in params[m].values()) for m in modules]
  if clipping == "all-layer":
    assert_sound_norms(aux.grad_norms, np.linalg.norm(f, axis=1))
    c = clip_reference(aux.grad_norms, 0.3)
    want = weighted_sum(f, c, params)
  else:
    c_l = 0.3 / np.sqrt(len(modules))
    cols = np.split(f, np.cumsum(sizes)[:-1], axis=1)
    bounds = [np.sqrt(np.asarray(aux.grams.sq_norms_by_layer[m],
                                 np.float64)) for m in modules]
    for bound, blk in zip(bounds, cols):
      assert_sound_norms(bound, np.linalg.norm(blk, axis=1))
    scaled = np.concatenate(
        [blk * clip_reference(bound, c_l)[:, None]
         for bound, blk in zip(bounds, cols)], axis=1)
    want = weighted_sum(scaled, np.ones(len(f)), params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_symbolic_size_is_costed_at_the_documented_size():
  (b,) = jax.export.symbolic_shape("b")
  assert cost_model.size_hint(b) == cost_model.SYMBOLIC_SIZE
  assert cost_model.size_hint(7) == 7
  # Blocks of rows of a symbolic batch: padded, mapped, cut back.
  exported = jax.export.export(jax.jit(
      lambda a: kernels.map_row_blocks(lambda r: r @ a.T, 4, (a,))))(
          jax.ShapeDtypeStruct((b, 3), jnp.float32))
  a = problems.normal(jax.random.PRNGKey(0), (7, 3))
  np.testing.assert_allclose(exported.call(a), a @ a.T, rtol=1e-6)


def _module_twice(x):
  layer = hk.Linear(4)
  return layer(jnp.tanh(layer(x)))


def test_a_module_applied_twice_exports_with_a_symbolic_length():
  # Its slots' width grows with the symbolic length, so it cannot be
  # compared with the parameter count: the module accumulates per-example
  # gradients instead (exact), for the Gram and the clipped gradient.
  entry = layer_zoo.Entry("twice", _module_twice, (3, 4))
  call, plain_loss, params = _exported(entry, ["b", "t"])
  x = _draw(entry, 3, 7, seed=1)
  assert_gram_close(call(x).total, reference_gram(plain_loss, params, x))

  fn, lead = layer_zoo._styled(entry, "explicit")
  x0 = layer_zoo._draw(entry, lead, 0)
  tracked = hk.transform_with_state(layer_zoo._tracked(fn, entry))
  params, state = tracked.init(jax.random.PRNGKey(1), x0)
  step = jax.jit(gram_haiku.clipped_grad(tracked.apply, 0.3))
  b, t = jax.export.symbolic_shape("b, t")
  exported = jax.export.export(step)(
      params, state, None, jax.ShapeDtypeStruct((b, t, 4), jnp.float32))
  got, _ = exported.call(params, state, None, x)
  f = np.asarray(per_example_grads(plain_loss, params, x), np.float64)
  want = weighted_sum(f, clip_reference(np.linalg.norm(f, axis=1), 0.3),
                      params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,fn", [
    ("conv-valid", lambda x: hk.Conv2D(3, 3, padding="VALID")(x)),
    ("linear-on-a-crop", lambda x: hk.Linear(3)(x[:, 1:-1, 1:-1, :])),
])
def test_positions_over_two_symbolic_sizes_need_their_product_bounded(
    name, fn):
  # (h - 2)(w - 2) positions: JAX cannot prove the product non-negative
  # from h >= 3 and w >= 3, so the error says which constraint to add;
  # with it, the exported Gram is exact. A convolution's output positions
  # and a linear layer's cropped input alike (kernels.check_mergeable).
  entry = layer_zoo.Entry(name, fn, (5, 5, 2))
  bounds = ("h >= 3", "w >= 3")
  with pytest.raises(ValueError, match=r'"h\*w - 2\*w - 2\*h \+ 4 >= 1"'):
    _exported(entry, ["b", "h", "w"], bounds)
  call, plain_loss, params = _exported(
      entry, ["b", "h", "w"], bounds + ("h*w - 2*w - 2*h + 4 >= 1",))
  x = problems.normal(jax.random.PRNGKey(3), (3, 4, 6, 2))
  assert_gram_close(call(x).total, reference_gram(plain_loss, params, x))


def test_exported_grams_and_clipped_aux_serialize_and_come_back():
  # Exported.serialize() writes the output pytree: Grams and
  # ClippedGradAux are registered, and the deserialized program returns
  # the same values in the same types.
  entry = layer_zoo.BY_NAME["MLP"]
  fn, lead = layer_zoo._styled(entry, "explicit")
  x = layer_zoo._draw(entry, lead, 0)
  tracked = hk.transform_with_state(layer_zoo._tracked(fn, entry))
  params, state = tracked.init(jax.random.PRNGKey(1), x)
  (b,) = jax.export.symbolic_shape("b")
  spec = jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype)
  for step in (gram_haiku.value_grad_and_gram(tracked.apply),
               gram_haiku.clipped_grad(tracked.apply, 0.3)):
    exported = jax.export.export(jax.jit(step))(params, state, None, spec)
    back = jax.export.deserialize(exported.serialize())
    got = back.call(params, state, None, x)
    want = exported.call(params, state, None, x)
    assert (jax.tree.structure(got) == jax.tree.structure(want))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(g, w)
  grams = got[1].grams if hasattr(got[1], "grams") else got[2]
  assert isinstance(grams, gram_haiku.Grams)
  assert grams.complete
