"""Program-level Gram rules (``gram_haiku._src.analysis.program_rules``):
parameters created with a bare ``hk.get_parameter`` and broadcast along
the examples, exact against ``F @ F.T`` of ``vmap(grad)`` (float64) and
the reference clipped sums; uses without a rule stay untracked, with a
message naming the primitive and the line."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.analysis import program_rules
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.core import reference

B, F, D = 4, 3, 5


def _offset_net(x, y):
  """A bare offset far from zero, added to a tracked layer's output."""
  p = hk.get_parameter("offset", [D], init=hk.initializers.Constant(1e3),
                         dtype=x.dtype)
  h = hk.Linear(D, name="linear")(x) + p
  return jnp.sum((jnp.tanh(h / 1e3) - y) ** 2, axis=-1)


def _twice_net(x, y):
  """One bare parameter used by two broadcasts (a bias and a gate)."""
  p = hk.get_parameter("p", [D], x.dtype,
                       init=hk.initializers.RandomNormal())
  h = jnp.tanh(hk.Linear(D, name="linear")(x) + p)
  h = hk.Linear(D, name="out")(h) * jnp.exp(p)[None, :]
  return jnp.sum((h - y) ** 2, axis=-1)


def _data(seed, dtype=None):
  """float64 where x64 is on (else float32, without JAX's truncation
  warning)."""
  if dtype is None:
    dtype = jax.dtypes.canonicalize_dtype(jnp.float64)
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((B, F)), dtype),
          jnp.asarray(rng.standard_normal((B, D)), dtype))


def _model(net, untracked="error"):
  def loss(x, y):
    with gram_haiku.track(untracked=untracked):
      out = net(x, y)
      # (a net may add a term of the whole batch to the loss)
      return out[0].sum() + out[1] if isinstance(out, tuple) else out.sum()
  return hk.transform_with_state(loss)


def _setup(net, seed=0, untracked="error"):
  f = _model(net, untracked)
  x, y = _data(seed)
  params, state = f.init(jax.random.PRNGKey(seed), x, y)
  key = jax.random.PRNGKey(seed + 1)
  params = jax.tree.map(
      lambda a: a + 0.3 * jax.random.normal(key, a.shape, a.dtype), params)
  return f, params, state, (x, y)


def _ref_f(net, params, batch):
  plain = hk.transform(lambda *b: net(*b).sum())
  return np.asarray(reference.per_example_grads(
      lambda p, *ex: plain.apply(p, None, *ex), params, *batch), np.float64)


@pytest.mark.parametrize("net", [_offset_net, _twice_net],
                         ids=["huge_offset", "used_twice"])
def test_a_bare_parameter_broadcast_gives_the_reference_gram(net):
  with jax.enable_x64(True):
    f, params, state, batch = _setup(net)
    _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, *batch)
    assert grams.complete
    name = "~/offset" if net is _offset_net else "~/p"
    assert grams.coverage[name].rule == "program: broadcast"
    ff = _ref_f(net, params, batch)
    reference.assert_gram_close(grams.total, ff @ ff.T, "float64")
    plain = hk.transform(lambda *b: net(*b).sum())
    want = jax.grad(lambda p: plain.apply(p, None, *batch))(params)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    # The parameter's own block: its per-example gradients' Gram.
    cols = _columns(params, name)
    np.testing.assert_allclose(grams.by_layer[name],
                               ff[:, cols] @ ff[:, cols].T, rtol=1e-10,
                               atol=1e-12)


def _columns(params, name):
  """F's columns of parameter ``name`` (leaf order)."""
  start = 0
  for n, leaf in zip(_names(params), jax.tree.leaves(params)):
    size = int(np.prod(np.shape(leaf)))
    if n == name:
      return slice(start, start + size)
    start += size
  raise KeyError(name)


def _names(params):
  return [f"{m}/{k}" for m in sorted(params) for k in sorted(params[m])]


@pytest.mark.parametrize("net", [_offset_net, _twice_net],
                         ids=["huge_offset", "used_twice"])
def test_all_layer_and_per_layer_clipping_are_the_reference(net):
  with jax.enable_x64(True):
    f, params, state, batch = _setup(net, seed=2)
    ff = _ref_f(net, params, batch)
    loss = lambda *a: f.apply(*a)[0]
    c = 0.5 * float(np.median(np.linalg.norm(ff, axis=1)))
    got = jax.jit(gram_haiku.clipped_grad(loss, l2_clip_norm=c))(
        params, state, None, *batch)
    w = np.minimum(1.0, c / np.linalg.norm(ff, axis=1))
    want = reference.weighted_sum(ff, w, params)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-9)
    # Per layer: each module, and the bare parameter, clipped on its own.
    names = _names(params)
    layers = sorted({n.rsplit("/", 1)[0] for n in names if "~" not in n} |
                    {n for n in names if n.startswith("~/")})
    thresholds = {l: c / (k + 1) for k, l in enumerate(layers)}
    got = jax.jit(gram_haiku.clipped_grad(loss, l2_clip_norm=thresholds,
                                          clipping="per-layer"))(
                                              params, state, None, *batch)
    total = np.zeros(ff.shape[1])
    for layer in layers:
      cols = np.zeros(ff.shape[1], bool)
      for n in names:
        if n == layer or n.rsplit("/", 1)[0] == layer and "~" not in n:
          cols[_columns(params, n)] = True
      norm = np.linalg.norm(ff[:, cols], axis=1)
      total[cols] = np.minimum(1.0, thresholds[layer] / norm) @ ff[:, cols]
    want = reference.weighted_sum(np.eye(ff.shape[1]), total, params)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-9)


def test_clipping_with_a_bare_parameter_matches_jax_privacy():
  jp = pytest.importorskip("jax_privacy.clipping")
  f = _model(_twice_net, "ignore")
  x, y = _data(3, jnp.float32)
  params, state = f.init(jax.random.PRNGKey(3), x, y)
  loss = lambda *a: f.apply(*a)[0]
  want = jax.jit(jp.clipped_grad(loss, l2_clip_norm=0.5,
                                 batch_argnums=(3, 4)))(
                                     params, state, None, x, y)
  got = jax.jit(gram_haiku.clipped_grad(loss, l2_clip_norm=0.5,
                                        batch_argnums=(3, 4)))(
                                            params, state, None, x, y)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-4)


def _summed_over_batch_net(x, y):
  """The broadcast summed over the batch before a nonlinearity: each
  example's share would depend on B."""
  p = hk.get_parameter("p", [D], x.dtype,
                       init=hk.initializers.RandomNormal())
  q = jnp.tanh(jnp.broadcast_to(p, (x.shape[0], D)).sum(0))
  return jnp.sum((hk.Linear(D, name="linear")(x) + q - y) ** 2, axis=-1)


def _written_into_net(x, y):
  """A bare parameter written into the activations (example 0's row):
  no rule for dynamic_update_slice."""
  p = hk.get_parameter("p", [D], x.dtype,
                       init=hk.initializers.RandomNormal())
  h = jax.lax.dynamic_update_slice(hk.Linear(D, name="linear")(x),
                                   p[None].astype(x.dtype), (0, 0))
  return jnp.sum((h - y) ** 2, axis=-1)


def _batched_weight_net(x, y):
  """A weight broadcast along the batch and contracted as a batch
  dimension: the examples' axis is one the parameter takes part in, so
  the product cannot be evaluated one example at a time."""
  w = hk.get_parameter("w", [F, D], x.dtype,
                       init=hk.initializers.RandomNormal())
  h = jnp.einsum("bf,bfd->bd", x, jnp.broadcast_to(w, (x.shape[0], F, D)))
  return jnp.sum((hk.Linear(D, name="linear")(x) + h - y) ** 2, axis=-1)


def _penalty_net(x, y):
  """A penalty on the bare parameter: a term of no example."""
  p = hk.get_parameter("p", [D], x.dtype,
                       init=hk.initializers.RandomNormal())
  h = hk.Linear(D, name="linear")(x) + p
  return jnp.sum((h - y) ** 2, axis=-1), jnp.sum(p ** 2)


@pytest.mark.parametrize("net, primitive", [
    (_summed_over_batch_net, "reduce_sum"),
    (_written_into_net, "dynamic_update_slice"),
    (_batched_weight_net, "dot_general"),
    (_penalty_net, "add"),
], ids=["summed_over_batch", "written_into", "batched_weight", "penalty"])
def test_a_use_without_a_rule_stays_untracked_and_says_where(net, primitive):
  f, params, state, batch = _setup(net, untracked="ignore")
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                        *batch)
  assert not grams.complete
  assert [k for k, c in grams.coverage.items() if not c.tracked] == [
      n for n in _names(params) if n.startswith("~/")]
  strict, _, _, _ = _setup(net, untracked="error")
  with pytest.raises(ValueError, match="No program-level rule") as e:
    gram_haiku.value_grad_and_gram(strict.apply)(params, state, None, *batch)
  assert f"`{primitive}`" in str(e.value)
  assert "test_program_rules.py:" in str(e.value)
  loss = lambda *a: f.apply(*a)[0]
  with pytest.raises(ValueError, match="no Gram rule"):
    gram_haiku.clipped_grad(loss, l2_clip_norm=1.0)(params, state, None,
                                                    *batch)


def test_a_use_that_couples_the_examples_is_refused():
  """Added to each example's values, then summed over the batch before a
  nonlinearity: the loss is not a sum of per-example terms."""
  def net(x, y):
    p = hk.get_parameter("p", [D], x.dtype,
                       init=hk.initializers.RandomNormal())
    h = hk.Linear(D, name="linear")(x) + p
    return jnp.sum((jnp.tanh(h.sum(0)) - y) ** 2, axis=-1)
  f, params, state, batch = _setup(net, untracked="ignore")
  with pytest.raises(ValueError, match=r"not a sum \(or mean\) of per-example"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, *batch)


def _tied_linear_net(x, y):
  """A tracked ``hk.Linear`` whose weight and bias are also used outside
  it: the weight by a bare matmul, the bias by a broadcast gate (each
  leaf's per-example gradient is the layer's part plus the outside one's),
  on inputs far from zero."""
  lin = hk.Linear(D, name="linear")
  h = jnp.tanh(lin(x + 100.0) / 100.0)
  w, b = lin.params_dict()["linear/w"], lin.params_dict()["linear/b"]
  out = hk.Linear(D, name="out")(jnp.tanh((h[:, :F] @ w) * jnp.exp(0.1 * b)))
  return jnp.sum((out - y) ** 2, axis=-1)


def test_a_tracked_weight_also_used_by_a_bare_matmul_is_exact():
  """Gram (and its layer block), the gradient, all-layer and per-layer
  clipping and the cross block, against the float64 reference: the
  layer keeps per-example gradients, and the outside uses' are added."""
  with jax.enable_x64(True):
    f, params, state, batch = _setup(_tied_linear_net, seed=4)
    ff = _ref_f(_tied_linear_net, params, batch)
    _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, *batch)
    assert grams.complete and sorted(grams.by_layer) == ["linear", "out"]
    assert grams.coverage["linear/w"].rule == "linear + program: dot_general"
    reference.assert_gram_close(grams.total, ff @ ff.T, "float64")
    plain = hk.transform(lambda *b: _tied_linear_net(*b).sum())
    want = jax.grad(lambda p: plain.apply(p, None, *batch))(params)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    loss = lambda *a: f.apply(*a)[0]
    norms = np.linalg.norm(ff, axis=1)
    c = 0.5 * float(np.median(norms))
    got = jax.jit(gram_haiku.clipped_grad(loss, l2_clip_norm=c))(
        params, state, None, *batch)
    want = reference.weighted_sum(ff, reference.clip_reference(norms, c),
                                  params)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-9)
    # Per layer: "linear" (its outside uses included) and "out".
    thresholds = {"linear": c / 2, "out": c / 3}
    got = jax.jit(gram_haiku.clipped_grad(loss, l2_clip_norm=thresholds,
                                          clipping="per-layer"))(
                                              params, state, None, *batch)
    total = np.zeros(ff.shape[1])
    for layer, threshold in thresholds.items():
      cols = np.zeros(ff.shape[1], bool)
      for leaf in ("w", "b"):
        cols[_columns(params, f"{layer}/{leaf}")] = True
      total[cols] = reference.clip_reference(
          np.linalg.norm(ff[:, cols], axis=1), threshold) @ ff[:, cols]
    want = reference.weighted_sum(np.eye(ff.shape[1]), total, params)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-9)
    qx, qy = _data(9)
    _, _, cross = gram_haiku.cross_gram(f.apply)(params, state, None,
                                                 *batch, queries=(qx, qy))
    fq = _ref_f(_tied_linear_net, params, (qx, qy))
    np.testing.assert_allclose(cross.total, ff @ fq.T, rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(cross.query_summed, ff @ fq.sum(0),
                               rtol=1e-9, atol=1e-12)


def _tied_in_and_out_net(tokens, y):
  embed = hk.Embed(7, D, name="embed")
  h = embed(tokens) + embed.embeddings[0]
  return jnp.sum((h - y[:, None]) ** 2, axis=(-2, -1))


def _tied_in_a_loop_net(tokens, y):
  embed = hk.Embed(7, D, name="embed")
  h = embed(tokens)
  def step(c, ids):
    return c + embed(ids), None
  c, _ = hk.scan(step, jnp.zeros((B, D), h.dtype), jnp.swapaxes(tokens, 0,
                                                                 1))
  return jnp.sum((h @ embed.embeddings.T) ** 2, axis=(-2, -1)) + jnp.sum(
      (c - y) ** 2, axis=-1)


def test_a_parameter_used_both_by_a_layer_and_by_a_broadcast_is_exact():
  """The embedding's lookup (tracked) and its first row broadcast over the
  tokens (a program-level site): their parts add up, with the cross
  terms."""
  with jax.enable_x64(True):
    f = _model(_tied_in_and_out_net)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 7, (B, 2)))
    y = _data(0)[1]
    params, state = f.init(jax.random.PRNGKey(0), tokens, y)
    params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, tokens, y)
    assert grams.complete
    ff = _ref_f(_tied_in_and_out_net, params, (tokens, y))
    reference.assert_gram_close(grams.total, ff @ ff.T, "float64")


def test_a_tied_use_the_parts_of_which_cannot_be_added_is_refused():
  """A tracked module applied inside a loop (its per-example gradients
  are not kept per application there) with its table also read outside:
  refused, naming the parameter, the outside use and gram_haiku.unembed."""
  f = _model(_tied_in_a_loop_net, "ignore")
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 7, (B, 2)))
  y = _data(0, jnp.float32)[1]
  params, state = f.init(jax.random.PRNGKey(0), tokens, y)
  with pytest.raises(ValueError, match=r"(?s)'embed/embeddings' is used both "
                     r"inside a tracked layer \(embed\).*`scan`.*"
                     r"gram_haiku.unembed"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, tokens, y)


def test_without_the_broadcast_rule_the_parameter_is_untracked(monkeypatch):
  """Mutation: the rule for ``add`` is what covers the offset."""
  key = next(k for k in program_rules.SITE_RULES
             if getattr(k, "name", k) == "add")
  monkeypatch.delitem(program_rules.SITE_RULES, key)
  f, params, state, batch = _setup(_offset_net, untracked="ignore")
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                        *batch)
  assert not grams.complete
  assert not grams.coverage["~/offset"].tracked
  assert hx.rule_of(program_rules.SITE_RULES, _add_eqn()) is None


def _add_eqn():
  return jax.make_jaxpr(lambda a: a + a)(1.0).jaxpr.eqns[0]


def test_verify_agrees_with_a_bare_parameter():
  f, params, state, batch = _setup(_twice_net, untracked="ignore")
  report = gram_haiku.verify(f.apply, params, state, None, *batch)
  assert report.ok and not report.untracked, str(report)


def test_cross_gram_with_a_bare_parameter():
  with jax.enable_x64(True):
    f, params, state, (x, y) = _setup(_twice_net, untracked="ignore")
    qx, qy = _data(9)
    _, _, cross = gram_haiku.cross_gram(f.apply)(params, state, None, x, y,
                                                  queries=(qx, qy))
    ff = _ref_f(_twice_net, params, (x, y))
    fq = _ref_f(_twice_net, params, (qx, qy))
    np.testing.assert_allclose(cross.total, ff @ fq.T, rtol=1e-9,
                               atol=1e-12)
    np.testing.assert_allclose(cross.query_summed, ff @ fq.sum(0),
                               rtol=1e-9, atol=1e-12)


# -- parameters contracted, convolved or indexed by the examples' values ------
# (dot_general, conv_general_dilated, gather: each example's gradient of the
# operand, the equation evaluated once per example)


def _w(name, shape, dtype, scale=1.0):
  return hk.get_parameter(name, shape, dtype,
                          init=hk.initializers.RandomNormal(scale))


def _matmul_net(x, y):
  """``x @ (W * scale)``: the weight second, through an elementwise
  prefix, on inputs far from zero."""
  w = _w("w", [F, D], x.dtype)
  h = jnp.tanh((x + 1e3) @ (w * 1e-3) - w.sum(0))  # (cancels)
  return jnp.sum((hk.Linear(D, name="linear")(x) * h - y) ** 2, axis=-1)


def _weight_first_net(x, y):
  """``einsum("df,bf->db")``: the weight the first operand, the examples
  the output's second axis."""
  w = _w("w", [D, F], x.dtype)
  h = jnp.einsum("df,bf->db", w, jnp.tanh(hk.Linear(F, name="linear")(x)))
  return jnp.sum((jnp.tanh(h.T) - y) ** 2, axis=-1)


def _shared_net(x, y):
  """One weight at two contractions and an elementwise broadcast: the
  cross terms of its three uses are in each example's gradient."""
  w = _w("w", [D, D], x.dtype, 0.5)
  h = jnp.tanh(hk.Linear(D, name="linear")(x) @ w)
  h = jnp.tanh(h @ w.T) + w[0]
  return jnp.sum((h - y) ** 2, axis=-1)


def _conv_net(x, y):
  """A bare kernel with ``lax.conv`` (one spatial axis)."""
  k = _w("k", [2, 1, D], x.dtype)
  h = jax.lax.conv_general_dilated(
      x[..., None], k, (1,), "VALID",
      dimension_numbers=("NWC", "WIO", "NWC"))  # [B, F - 1, D]
  return jnp.sum((jnp.tanh(h).mean(1) + hk.Linear(D, name="linear")(x)
                  - y) ** 2, axis=-1)


def _embedding_net(x, y):
  """``table[ids]``: rows of a bare table by each example's ids (some
  repeated within an example)."""
  table = _w("table", [7, D], x.dtype)
  ids = (jnp.abs(x) * 4).astype(jnp.int32) % 7  # [B, F]
  h = table[ids].sum(1) * hk.Linear(D, name="linear")(x)
  return jnp.sum((h - y) ** 2, axis=-1)


_jitted_scale = jax.jit(lambda h, p: h * p)


def _in_jit_calls_net(x, y):
  """``jnp.take`` (a jit call) twice on one table, and one jitted helper
  scaling by two bare parameters: each call's sites its own."""
  table = _w("table", [7, D], x.dtype)
  ids = (jnp.abs(x) * 4).astype(jnp.int32) % 7
  h = jnp.take(table, ids[:, 0], axis=0) * jnp.take(table, ids[:, 1],
                                                     axis=0)
  h = _jitted_scale(h, _w("gate", [D], x.dtype)) + _jitted_scale(
      hk.Linear(D, name="linear")(x), _w("scale", [D], x.dtype))
  return jnp.sum((h - y) ** 2, axis=-1)


def _mixer_net(x, y, tokens=3, c=2):
  """An MLP-Mixer block with bare einsum weights (token and channel
  mixing), its stem a tracked layer."""
  h = hk.Linear(tokens * c, name="stem")(x).reshape(-1, tokens, c)
  h = h + jnp.einsum("btc,ts->bsc", jax.nn.gelu(h),
                     _w("token_mix", [tokens, tokens], x.dtype))
  h = h + jnp.einsum("btc,cd->btd", jax.nn.gelu(h),
                     _w("channel_mix", [c, c], x.dtype))
  out = jnp.einsum("bc,cd->bd", h.mean(1), _w("head", [c, D], x.dtype))
  return jnp.sum((out - y) ** 2, axis=-1)


def _kernel_per_example_net(x, y):
  """A bare parameter image under a kernel made from each example
  (``jax.vmap`` of a convolution whose kernel is the example's: JAX folds
  the examples into the kernel's output features)."""
  image = _w("image", [1, D + 1, 2], x.dtype)  # NWC, one image

  def one(xi):  # [F] -> [D]
    a, b = jnp.tanh(xi[:2]), xi[1:]
    k = jnp.stack([a, b * a], -1)[..., None]  # [W 2, I 2, O 1]
    return jax.lax.conv_general_dilated(
        image, k, (1,), "VALID",
        dimension_numbers=("NWC", "WIO", "NWC"))[0, :, 0]
  h = jax.vmap(one)(x)  # [B, D]
  return jnp.sum((jnp.tanh(h) * hk.Linear(D, name="linear")(x) - y) ** 2,
                 axis=-1)


#: The default budget runs the first (conftest.py), the thorough env all;
#: three are also rows of tests/interpreter_corpus.py
#: (bare_weight_first_in_einsum, bare_weight_matmul, bare_table_gather).
_PER_EXAMPLE_NETS = {
    "shared": (_shared_net, {"~/w": "program: broadcast, dot_general"}),
    "weight_first": (_weight_first_net, {"~/w": "program: dot_general"}),
    "mixer": (_mixer_net, {n: "program: dot_general" for n in (
        "~/token_mix", "~/channel_mix", "~/head")}),
    "matmul_scaled": (_matmul_net,
                      {"~/w": "program: broadcast, dot_general"}),
    "in_jit_calls": (_in_jit_calls_net, {
        "~/table": "program: gather", "~/gate": "program: broadcast",
        "~/scale": "program: broadcast"}),
    "embedding": (_embedding_net, {"~/table": "program: gather"}),
    "conv": (_conv_net, {"~/k": "program: conv_general_dilated"}),
}


@pytest.mark.parametrize("name", list(_PER_EXAMPLE_NETS))
def test_a_bare_weight_contracted_or_indexed_is_exact(name):
  """The Gram (F @ F.T), the summed gradient and the all-layer clipped sum
  (the reference's min(1, C / |g_i|)), float64, under jit and
  untracked="error"."""
  _assert_exact(*_PER_EXAMPLE_NETS[name])


def test_examples_as_a_convolutions_kernel_are_followed():
  """Per-example kernels over a bare parameter image: each output feature
  reads its kernel feature alone, so the examples are followed along them
  (they were taken for combined: a loss "not a sum of per-example
  terms", and a privacy refusal), and the Gram and clipped sum are the
  reference's."""
  _assert_exact(_kernel_per_example_net,
                {"~/image": "program: conv_general_dilated"})


def test_examples_as_the_steps_of_a_loop_are_refused_naming_vmap():
  """The same kernels made one example per step of ``lax.map``: the check
  cannot tell that loop from one that mixes the examples, so clipping
  refuses, and the message says that jax.vmap is followed exactly."""
  def net(x, y):
    image = _w("image", [1, D + 1, 2], x.dtype)

    def one(xi):
      k = jnp.stack([jnp.tanh(xi[:2]), xi[1:]], -1)[..., None]
      return jax.lax.conv_general_dilated(
          image, k, (1,), "VALID",
          dimension_numbers=("NWC", "WIO", "NWC"))[0, :, 0]
    return jnp.sum((jax.lax.map(one, x) - y) ** 2, axis=-1)
  f, params, state, batch = _setup(net)
  with pytest.raises(ValueError, match="(?s)reads data of other examples.*"
                     "steps of a loop.*jax.vmap"):
    jax.eval_shape(gram_haiku.clipped_grad(lambda *a: f.apply(*a)[0],
                                           l2_clip_norm=1.0),
                   params, state, None, *batch)


def _assert_exact(net, rules):
  """:func:`test_a_bare_weight_contracted_or_indexed_is_exact`'s checks."""
  with jax.enable_x64(True):
    f, params, state, batch = _setup(net, seed=4)
    ff = _ref_f(net, params, batch)
    _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, *batch)
    assert grams.complete
    assert {k: grams.coverage[k].rule for k in rules} == rules
    reference.assert_gram_close(grams.total, ff @ ff.T, "float64")
    want = reference.weighted_sum(ff, np.ones(B), params)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)
    norms = np.linalg.norm(ff, axis=1)
    c = float(np.median(norms))  # some clipped, some not
    got = jax.jit(gram_haiku.clipped_grad(lambda *a: f.apply(*a)[0],
                                          l2_clip_norm=c))(
                                              params, state, None, *batch)
    want = reference.weighted_sum(
        ff, reference.clip_reference(norms, c), params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-9)


def _orthogonalised_net(x, y):
  """``x @ Q``, ``Q`` the QR factor of a bare weight: a function of the
  parameter alone whose VJP (a triangular solve) has no bound rule."""
  q = jnp.linalg.qr(_w("w", [F, F], x.dtype))[0]
  return jnp.sum((hk.Linear(D, name="linear")(jnp.tanh(x @ q)) - y) ** 2,
                 axis=-1)


def test_a_prefix_without_a_bound_is_refused_naming_the_parameter():
  """The Gram through ``Q = qr(w)`` is the reference's; clipping, which
  needs a bound of the pull-back through ``qr``'s VJP, is refused naming
  the parameter (``'~/w'``) and its use (it named "module '0'" and a
  custom getter, neither of which the model has)."""
  with jax.enable_x64(True):
    f, params, state, batch = _setup(_orthogonalised_net, seed=5)
    ff = _ref_f(_orthogonalised_net, params, batch)
    _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, *batch)
    reference.assert_gram_close(grams.total, ff @ ff.T, "float64")
    with pytest.raises(ValueError, match=r"(?s)parameter '~/w'.*"
                       r"`dot_general`.*triangular_solve.*What to do") as e:
      jax.eval_shape(gram_haiku.clipped_grad(lambda *a: f.apply(*a)[0],
                                             l2_clip_norm=1.0),
                     params, state, None, *batch)
    assert "custom getter" not in str(e.value)
