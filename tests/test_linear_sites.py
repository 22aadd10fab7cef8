"""Bare weights in a linear layer's product (``x @ W``, ``x @ W.T``,
``jnp.einsum('btd,de->bte')``, the weight first): the pass binds the
linear layer's Gram op there (``program_pass._linear_sites``), so that
they cost what ``hk.Linear`` costs. Exact against ``F @ F.T`` of
``vmap(grad)`` in float64, and against the reference clipped and
reweighted sums, through ``gram_haiku.functional`` and a Haiku model
under ``track()``; the op's mode (Gram, factors, per-example) is the one
a tracked ``hk.Linear`` would keep."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku import functional as gf
from gram_haiku import testing
from gram_haiku._src.passes import program_pass
from tests import problems

B, T, F, H, D = 4, 3, 5, 6, 2


@pytest.fixture
def modes(monkeypatch):
  """The modes of the linear Gram ops the pass binds at bare weights."""
  seen = []
  sites = program_pass._linear_sites

  def spy(*args):
    out = sites(*args)
    seen.extend((lin[0].name, lin[0].mode) for lin in out if lin)
    return out
  monkeypatch.setattr(program_pass, "_linear_sites", spy)
  return seen


def _matmul(p, x, y):
  """``x @ W`` twice (an MLP without biases), inputs far from zero."""
  h = jnp.tanh((x + 1e3) @ p["w1"] / 1e3)
  return jnp.sum((h @ p["w2"] - y[:, 0]) ** 2)


def _transposed(p, x, y):
  """``x @ W.T`` (the weight stored ``[d_out, d_in]``, as in a tied
  output)."""
  h = jnp.tanh(x @ p["w1"])
  return jnp.sum((h @ p["w2t"].T - y[:, 0]) ** 2)


def _positions(p, x, y):
  """``einsum('btd,de->bte')`` over positions, then the weight first
  (``einsum('ed,btd->bte')``: its output's examples on axis 1)."""
  h = jnp.tanh(jnp.einsum("btf,fh->bth", x[:, None] + x[:, :T, None], p["w1"]))
  out = jnp.einsum("dh,bth->btd", p["w2t"], h)
  return jnp.sum((out - y) ** 2)


def _shared(p, x, y):
  """One weight at two products and a broadcast: per-example gradients
  with the cross terms (as ``hk.Linear`` applied twice)."""
  h = jnp.tanh(x @ p["w"])
  h = jnp.tanh(h @ p["w"] + p["w"][0])
  return jnp.sum((h[:, :D] - y[:, 0]) ** 2)


def _not_linear(p, x, y):
  """Contractions that are not ``hk.Linear``'s: a scaled weight (its
  gradient pulled back through the scale) and a 3-D weight: evaluated
  once per example."""
  h = jnp.tanh(x @ (p["w1"] * 0.5))
  out = jnp.einsum("bh,hd->bd", h, p["w2"]) + jnp.einsum(
      "bh,hdk->bd", h, p["w3"])
  return jnp.sum((out - y[:, 0]) ** 2)


def _params(names, seed=0):
  rng = np.random.default_rng(seed)
  shapes = {"w1": (F, H), "w2": (H, D), "w2t": (D, H), "w": (F, F), "w3": (H, D, 2)}
  return {n: jnp.asarray(rng.standard_normal(shapes[n]), jnp.float64)
          for n in names}


def _batch(seed=1):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((B, F)), jnp.float64),
          jnp.asarray(rng.standard_normal((B, T, D)), jnp.float64))


#: loss -> (its parameters, the modes of the Gram pass's and of the
#: clipping pass's linear ops). A weight's one site forms its Gram, or
#: keeps factors (or per-example gradients, where fewer: T (F + H) > F H)
#: to re-contract; a weight at several sites keeps per-example gradients.
_LOSSES = {
    "matmul": (_matmul, ("w1", "w2"), ("gram", "factors")),
    "transposed": (_transposed, ("w1", "w2t"), ("gram", "factors")),
    "positions": (_positions, ("w1", "w2t"), ("gram", "per_example")),
    "shared": (_shared, ("w",), ("per_example", "per_example")),
    # (w2 alone is hk.Linear's product)
    "not_linear": (_not_linear, ("w1", "w2", "w3"), ("gram", "factors")),
}


@pytest.mark.parametrize("name", list(_LOSSES))
def test_a_bare_linear_weight_is_exact_through_the_linear_op(name, modes):
  loss, names, (gram_mode, clip_mode) = _LOSSES[name]
  with jax.enable_x64(True):
    params, (x, y) = _params(names), _batch()
    f = np.asarray(testing.per_example_grads(loss, params, x, y))
    _, grads, grams = jax.jit(gf.value_grad_and_gram(loss))(params, x, y)
    assert {m for _, m in modes} == {gram_mode}
    if name == "not_linear":
      assert [n for n, _ in modes] == ["w2"]
    assert grams.complete
    testing.assert_gram_close(grams.total, f @ f.T, "float64")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10),
                 grads, jax.grad(loss)(params, x, y))
    norms = np.linalg.norm(f, axis=1)
    c = float(np.median(norms))  # some clipped, some not
    del modes[:]
    got = jax.jit(gf.clipped_grad(loss, l2_clip_norm=c))(params, x, y)
    assert {m for _, m in modes} == {clip_mode}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
                 got, testing.weighted_sum(
                     f, testing.clip_reference(norms, c), params))


def test_reweighting_and_per_layer_clipping_from_a_linear_sites_factors(
    modes):
  with jax.enable_x64(True):
    params, (x, y) = _params(("w1", "w2t")), _batch(2)
    f = np.asarray(testing.per_example_grads(_transposed, params, x, y))
    w = np.arange(1.0, B + 1)
    _, grads, _, _ = jax.jit(gf.reweighted_grad(
        _transposed, lambda grams: jnp.asarray(w), needs="gram"))(
            params, x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
                 grads, testing.weighted_sum(f, w, params))
    cols = {"w1": slice(0, F * H), "w2t": slice(F * H, None)}
    c = {n: 0.5 * float(np.median(np.linalg.norm(f[:, s], axis=1)))
         for n, s in cols.items()}
    got = jax.jit(gf.clipped_grad(_transposed, l2_clip_norm=c,
                                  clipping="per-layer"))(params, x, y)
    total = np.concatenate([testing.clip_reference(
        np.linalg.norm(f[:, s], axis=1), c[n]) @ f[:, s]
                            for n, s in cols.items()])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
                 got, testing.weighted_sum(np.eye(f.shape[1]), total,
                                           params))
    assert {m for _, m in modes} == {"factors"}


def _haiku_net(x, y):
  """Bare weights next to a tracked layer, inside ``track()``: ``x @ W``
  and ``h @ W.T``, and the tracked layer's own weight read again by a
  bare product (tied: its per-example gradients)."""
  w_in = hk.get_parameter("w_in", [F, H], x.dtype,
                          init=hk.initializers.RandomNormal())
  w_out = hk.get_parameter("w_out", [D, H], x.dtype,
                           init=hk.initializers.RandomNormal())
  lin = hk.Linear(H, name="linear")
  h = jnp.tanh((x + 1e2) @ w_in / 1e2) * lin(x)
  h = h + jnp.tanh(x @ lin.params_dict()["linear/w"])
  return jnp.sum((h @ w_out.T - y[:, 0]) ** 2, axis=-1)


def test_bare_linear_weights_in_a_tracked_haiku_model(modes):
  def loss(x, y):
    with gram_haiku.track():
      return _haiku_net(x, y).sum()
  f = hk.transform_with_state(loss)
  with jax.enable_x64(True):
    x, y = _batch(3)
    params, state = f.init(jax.random.PRNGKey(0), x, y)
    plain = hk.transform(lambda *b: _haiku_net(*b).sum())
    ff = np.asarray(testing.per_example_grads(
        lambda p, *ex: plain.apply(p, None, *ex), params, x, y))
    _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, x, y)
    assert grams.complete
    assert sorted(modes) == [("linear/w", "per_example"), ("~/w_in", "gram"),
                             ("~/w_out", "gram")]
    testing.assert_gram_close(grams.total, ff @ ff.T, "float64")
    want = jax.grad(lambda p: plain.apply(p, None, x, y))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10),
                 grads, want)
    norms = np.linalg.norm(ff, axis=1)
    c = float(np.median(norms))
    got = jax.jit(gram_haiku.clipped_grad(lambda *a: f.apply(*a)[0],
                                          l2_clip_norm=c))(
                                              params, state, None, x, y)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
                 got, testing.weighted_sum(
                     ff, testing.clip_reference(norms, c), params))


def test_clip_norms_from_a_linear_sites_factors_bound_the_float64_norm(
    modes):
  """float32, each example's gradient a sum over two positions that
  cancels (inputs offset by +-1e4): the norm a clip factor comes from (the
  linear rule's bound from the kept factors) is not below the float64
  norm, and not vacuous."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((6, 2, 3)).astype(np.float32)
  x[:, 0] += 1e4
  x[:, 1] -= 1e4
  x = jnp.asarray(x)

  def loss(p, x):
    return jnp.sum((x @ p["w"]).sum(1) * 1e-3)
  params = {"w": jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)}
  problems.assert_clip_norms_bound(loss, params, x)
  assert modes == [("w", "factors")]


def test_a_linear_site_exports_with_a_symbolic_batch_and_length():
  """``jax.export`` with ``B`` and ``T`` symbolic: the cost model's
  choices take size hints, and the exported clipped sum is the jitted
  one's at concrete sizes."""
  from jax import export  # pylint: disable=g-import-not-at-top

  def loss(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"]) ** 2)
  rng = np.random.default_rng(0)
  p = {"w": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)}
  x = jnp.asarray(rng.standard_normal((B, T, 3)), jnp.float32)
  fn = jax.jit(gf.clipped_grad(loss, l2_clip_norm=0.5))
  spec = jax.ShapeDtypeStruct(export.symbolic_shape("b, t, 3"), x.dtype)
  exported = export.export(fn)(p, spec)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5,
                                                       atol=1e-6),
               exported.call(p, x), fn(p, x))


def _bare_only_net(x):
  """A Haiku model whose only parameter is a bare weight, used
  untransposed and transposed, under ``jax.vmap`` over the examples: no
  tracked layer, so no probe in the state."""
  w = hk.get_parameter("w", [F, F], x.dtype,
                       init=hk.initializers.RandomNormal())
  return jax.vmap(lambda xi: jnp.sum(jnp.tanh(jnp.tanh(xi @ w) @ w.T) ** 2))(
      x)


def test_a_haiku_model_of_bare_weights_alone_is_covered_by_the_program():
  """Inside ``track()`` with no tracked layer (the state holds no probe):
  the bare weight's sites are read from the program, ``B`` from the
  batch. Before, ``NO_PROBES`` refused it ("call the model inside
  track()", which it was)."""
  def loss(x):
    with gram_haiku.track():
      return _bare_only_net(x).sum()
  f = hk.transform_with_state(loss)
  with jax.enable_x64(True):
    x, _ = _batch(4)
    x = jnp.stack([x, x[::-1]], axis=1)  # [B, 2, F]: two positions
    params, state = f.init(jax.random.PRNGKey(0), x)
    plain = hk.transform(lambda x: _bare_only_net(x).sum())
    ff = np.asarray(testing.per_example_grads(
        lambda p, x: plain.apply(p, None, x), params, x))
    _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, x)
    assert grams.complete
    testing.assert_gram_close(grams.total, ff @ ff.T, "float64")
    np.testing.assert_allclose(
        grads["~"]["w"], jax.grad(lambda p: plain.apply(p, None, x))(
            params)["~"]["w"], rtol=1e-10)
    norms = np.linalg.norm(ff, axis=1)
    c = float(np.median(norms))
    got = jax.jit(gram_haiku.clipped_grad(lambda *a: f.apply(*a)[0],
                                          l2_clip_norm=c))(
                                              params, state, None, x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-9),
                 got, testing.weighted_sum(
                     ff, testing.clip_reference(norms, c), params))


@jax.custom_vjp
def _opaque_product(x, w):
  return x @ w


_opaque_product.defvjp(lambda x, w: (x @ w, (x, w)),
                       lambda r, g: (g @ r[1].T, r[0].T @ g))


def test_no_probe_and_no_program_rule_is_refused():
  """No tracked layer and no use a program rule covers (a weight inside a
  custom_vjp): there is no Gram to form; the refusal says so, not an
  index error from an empty sum."""
  def loss(x):
    with gram_haiku.track(untracked="ignore"):
      w = hk.get_parameter("w", [F, F], x.dtype, init=jnp.ones)
      return jnp.sum(jnp.tanh(_opaque_product(x, w)) ** 2)
  f = hk.transform_with_state(loss)
  x = jnp.ones((B, F))
  params, state = f.init(jax.random.PRNGKey(0), x)
  # (The custom_vjp is also where the example flow stops following.)
  with pytest.warns(gram_haiku.ExampleFlowWarning), pytest.raises(
      ValueError, match="no Gram to form"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x)


def test_the_reference_takes_an_empty_batch():
  """``testing.per_example_grads`` at ``B = 0``: ``[0, P]`` (it reshaped
  with ``-1``, which a size-0 array cannot infer)."""
  with jax.enable_x64(True):
    params, (x, y) = _params(("w1", "w2")), _batch()
    f = testing.per_example_grads(_matmul, params, x[:0], y[:0])
  assert f.shape == (0, F * H + H * D)


def test_the_reference_keeps_a_time_major_layout():
  """``testing.per_example_grads(in_axes=1)`` passes each example as a
  batch of one along axis 1 (``(T, 1, F)``). It used to add the axis in
  front (``(1, T, F)``: one time step of ``T`` examples), which a loss that
  sums independent positions cannot tell apart but a recurrence can: the
  reference was silently another model's."""
  def loss(p, x):  # x: (T, B, F); a recurrence over T.
    def step(h, xt):
      h = jnp.tanh(xt @ p["w"] + h @ p["u"])
      return h, h
    h0 = jnp.zeros((x.shape[1], H), x.dtype)
    return jnp.sum(jax.lax.scan(step, h0, x)[1][-1] ** 2)
  with jax.enable_x64(True):
    rng = np.random.default_rng(6)
    p = {"w": jnp.asarray(rng.standard_normal((F, H))),
         "u": jnp.asarray(rng.standard_normal((H, H)))}
    x = jnp.asarray(rng.standard_normal((T, B, F)))
    f = np.asarray(testing.per_example_grads(loss, p, x, in_axes=1))
    rows = jax.vmap(jax.grad(lambda p, xe: loss(p, xe[:, None])),
                    in_axes=(None, 1))(p, x)
  want = np.concatenate([np.asarray(l).reshape(B, -1)
                         for l in jax.tree.leaves(rows)], axis=1)
  np.testing.assert_allclose(f, want, rtol=1e-10, atol=1e-12)


def test_time_major_examples_and_a_stopped_second_use():
  """Time-major data (``[T, B, F]``, ``example_axes=(1,)``) into
  ``einsum('tbd,de->bte')`` (the output's examples moved to axis 0), the
  same weight read again through ``stop_gradient`` (no gradient from that
  use): the Gram and the clipped sum against the reference taken along
  axis 1."""
  def loss(p, x):
    z = jnp.einsum("tbd,de->bte", x, p["w"])
    zs = jnp.einsum("tbd,de->bte", x, jax.lax.stop_gradient(p["w"]))
    return jnp.sum(jnp.tanh(z) * jnp.tanh(zs) * (1 + jnp.arange(H) / H))
  with jax.enable_x64(True):
    rng = np.random.default_rng(5)
    p = {"w": jnp.asarray(rng.standard_normal((F, H)))}
    x = jnp.asarray(rng.standard_normal((T, B, F)))
    f = np.asarray(testing.per_example_grads(loss, p, x, in_axes=1))
    _, _, grams = jax.jit(gf.value_grad_and_gram(loss, example_axes=(1,)))(
        p, x)
    testing.assert_gram_close(grams.total, f @ f.T, "float64")
    norms = np.linalg.norm(f, axis=1)
    c = float(np.median(norms))
    got = jax.jit(gf.clipped_grad(loss, l2_clip_norm=c, example_axes=(1,)))(
        p, x)
    np.testing.assert_allclose(got["w"], testing.weighted_sum(
        f, testing.clip_reference(norms, c), p)["w"], rtol=1e-9)
