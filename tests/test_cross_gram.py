"""``gram_haiku.cross_gram`` against ``F_train @ F_query.T`` from
``vmap(grad)`` of the untracked model, and its update against the plain
gradient of the training examples alone."""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku import testing
from gram_haiku._src.core.reference import column_groups
from gram_haiku.conformance.plugin import thorough
from tests import layer_zoo

V = 3  # queries; the zoo's batches hold layer_zoo.B = 4 examples

#: The default run: linear factors over positions, a conv, a looped RNN
#: cell's slots (the embedding, a shared table's per-example gradients and
#: a shared layer run in float64 below); every entry with
#: --conformance-thorough.
DEFAULT_ENTRIES = ("MLP", "Conv2D", "GRU-dynamic")


def _zoo_names():
  return [e.name for e in layer_zoo.ENTRIES
          if thorough() or e.name in DEFAULT_ENTRIES]


@pytest.mark.parametrize("name", _zoo_names())
def test_zoo_blocks_match_the_reference_and_the_update_ignores_queries(name):
  entry = layer_zoo.BY_NAME[name]
  seed = layer_zoo.seed_of(name)
  x = layer_zoo._draw(entry, (layer_zoo.B,), seed)  # pylint: disable=protected-access
  xq = layer_zoo._draw(entry, (V,), seed + 1)  # pylint: disable=protected-access
  tracked = hk.transform_with_state(layer_zoo._tracked(entry.fn, entry))  # pylint: disable=protected-access
  plain = hk.transform_with_state(lambda x: layer_zoo._tail(entry.fn(x)))  # pylint: disable=protected-access
  params, state = jax.jit(tracked.init)(jax.random.PRNGKey(1), x)
  _, plain_state = jax.jit(plain.init)(jax.random.PRNGKey(1), x)
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
  value, grads, cross = jax.jit(gram_haiku.cross_gram(tracked.apply))(
      params, state, None, x, queries=(xq,))
  f = np.asarray(testing.per_example_grads(plain_loss, params, x), np.float64)
  h = np.asarray(testing.per_example_grads(plain_loss, params, xq),
                 np.float64)
  assert cross.total.shape == (layer_zoo.B, V)
  low = layer_zoo.is_low_precision(entry)
  case = "mixed" if low else "float32"
  testing.assert_gram_close(cross.total, f @ h.T, case, what=name)
  testing.assert_gram_close(cross.sq_norms[:, None],
                            np.sum(f * f, axis=1)[:, None], case,
                            what=f"{name}: the examples' own squared norms")
  testing.assert_gram_close(cross.query_summed[:, None],
                            (f @ h.sum(0))[:, None], case,
                            what=f"{name}: summed over the queries")
  # Each module's block is the product of its own parameters' columns.
  for m, cols in column_groups(params).items():
    if m in cross.by_layer:
      testing.assert_gram_close(cross.by_layer[m], f[:, cols] @ h[:, cols].T,
                                case, what=f"{name}: {m}")
  assert set(cross.by_layer) & set(params), sorted(cross.by_layer)
  want_value, want_grads = jax.value_and_grad(plain_loss)(params, x)
  rtol = 2e-2 if low else 1e-5
  np.testing.assert_allclose(value, want_value, rtol=rtol)
  scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want_grads))
  chex.assert_trees_all_close(grads, want_grads, rtol=rtol,
                              atol=rtol * scale)


def _x64_models():
  """(name, per-example loss body, example shape, ids): a shared layer, an
  LSTM, a tied-embedding LM; float64."""
  def shared(x):
    layer = hk.Linear(4)
    return jnp.sum(jnp.tanh(layer(jnp.tanh(layer(x)))) ** 2, axis=(-2, -1))

  def lstm(x):
    core = hk.LSTM(4)
    out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1),
                               core.initial_state(x.shape[0]))
    return jnp.sum(hk.Linear(2)(jnp.swapaxes(out, 0, 1)) ** 2, axis=(1, 2))

  def tied_lm(ids):
    embed = hk.Embed(7, 4)
    h = jnp.tanh(hk.Linear(4)(embed(ids)))
    logits = gram_haiku.unembed(embed, h)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0], axis=-1)
  return [("shared", shared, (3, 4), 0), ("lstm", lstm, (4, 3), 0),
          ("tied-LM", tied_lm, (5,), 7)]


@pytest.mark.parametrize("name,body,shape,ids", _x64_models(),
                         ids=[m[0] for m in _x64_models()])
def test_blocks_are_exact_in_float64(name, body, shape, ids):
  del name
  with jax.enable_x64(True):
    k = jax.random.split(jax.random.PRNGKey(3), 3)
    if ids:
      x = jax.random.randint(k[0], (4,) + shape, 0, ids)
      xq = jax.random.randint(k[1], (V,) + shape, 0, ids)
    else:
      x = jax.random.normal(k[0], (4,) + shape, jnp.float64)
      xq = 1e3 + jax.random.normal(k[1], (V,) + shape, jnp.float64)

    def loss(x):
      with gram_haiku.track():
        return body(x).sum()
    tracked = hk.transform_with_state(loss)
    plain = hk.transform(lambda x: body(x).sum())
    params, state = tracked.init(k[2], x)
    params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    plain_loss = lambda p, x: plain.apply(p, None, x)
    value, grads, cross = jax.jit(gram_haiku.cross_gram(tracked.apply))(
        params, state, None, x, queries=(xq,))
    f = np.asarray(testing.per_example_grads(plain_loss, params, x))
    h = np.asarray(testing.per_example_grads(plain_loss, params, xq))
    want = f @ h.T
    np.testing.assert_allclose(cross.total, want, rtol=1e-10,
                               atol=1e-12 * np.abs(want).max())
    np.testing.assert_allclose(cross.query_summed, want.sum(1), rtol=1e-10,
                               atol=1e-12 * np.abs(want).max())
    np.testing.assert_allclose(cross.sq_norms, np.sum(f * f, axis=1),
                               rtol=1e-10)
    want_value, want_grads = jax.value_and_grad(plain_loss)(params, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-11, atol=1e-13)


def test_query_rows_never_reach_the_update():
  """Queries whose values overflow (inf, NaN) leave the update as it is."""
  def loss(x):
    with gram_haiku.track():
      return jnp.sum(hk.Linear(2)(x) ** 2)
  t = hk.transform_with_state(loss)
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 3))
  params, state = t.init(jax.random.PRNGKey(1), x)
  xq = jnp.array([[jnp.inf, 0.0, 1.0], [jnp.nan, 1.0, 0.0]])
  _, grads, _ = gram_haiku.cross_gram(t.apply)(params, state, None, x,
                                               queries=(xq,))
  want = jax.grad(lambda p: t.apply(p, state, None, x)[0])(params)
  chex.assert_trees_all_close(grads, want, rtol=1e-6)


def test_mismatched_queries_and_untracked_parameters_are_refused():
  def loss(x, y):
    with gram_haiku.track():
      out = hk.Linear(2)(x)
    # (written into example 0's row: a use no program-level rule covers;
    # out * s is)
    s = hk.get_parameter("s", [2], init=jnp.ones)
    return jnp.sum((jax.lax.dynamic_update_slice(out, s[None], (0, 0))
                    - y) ** 2)
  t = hk.transform_with_state(loss)
  x, y = jnp.ones((4, 3)), jnp.ones((4, 2))
  params, state = t.init(jax.random.PRNGKey(0), x, y)
  step = gram_haiku.cross_gram(t.apply)
  with pytest.raises(ValueError, match="one query argument per positional"):
    step(params, state, None, x, y, queries=(x,))
  with pytest.raises(ValueError, match="differ in structure or in shape"):
    step(params, state, None, x, y, queries=(jnp.ones((2, 5)),
                                             jnp.ones((2, 2))))
  with pytest.raises(ValueError, match="one B and one V"):
    step(params, state, None, x, y, queries=(jnp.ones((2, 3)),
                                             jnp.ones((3, 2))))
  # Queries in another dtype would promote the training rows (bfloat16
  # rows run in float32: another model's Gram); a NumPy float64 query is
  # float32 to JAX and passes.
  with pytest.raises(ValueError, match=r"differ in dtype.*\['bfloat16'\]"):
    step(params, state, None, x.astype(jnp.bfloat16), y,
         queries=(jnp.ones((2, 3)), jnp.ones((2, 2))))
  with pytest.raises(ValueError, match=r"\['~/s'\]"):
    step(params, state, None, x, y, queries=(np.ones((2, 3)),
                                             np.ones((2, 2))))
  with pytest.raises(ValueError, match=r"\['~/s'\]"):
    step(params, state, None, x, y, queries=(jnp.ones((2, 3)),
                                             jnp.ones((2, 2))))


def test_a_mean_loss_is_warned():
  def loss(x):
    with gram_haiku.track():
      return jnp.mean(jnp.sum(hk.Linear(2)(x) ** 2, axis=-1))
  t = hk.transform_with_state(loss)
  x = jnp.ones((4, 3))
  params, state = t.init(jax.random.PRNGKey(0), x)
  with pytest.warns(gram_haiku.MeanLossWarning,
                    match="cross_gram evaluates the training examples"):
    gram_haiku.cross_gram(t.apply)(params, state, None, x,
                                   queries=(jnp.ones((2, 3)),))


def test_a_bare_parameter_under_untracked_error_is_covered_by_its_program_rule():
  """A learned offset (a bare parameter broadcast over the examples) in a
  model tracked with ``untracked="error"``: covered by a program rule in
  the pass, and the value's own forward pass reports nothing."""
  def body(x):
    h = jnp.tanh(hk.Linear(3)(x))
    return jnp.sum((h + hk.get_parameter("offset", [3], x.dtype,
                                         init=jnp.ones)) ** 2, axis=-1)

  def loss(x):
    with gram_haiku.track(untracked="error"):
      return body(x).sum()
  with jax.enable_x64(True):
    t = hk.transform_with_state(loss)
    plain = hk.transform(lambda x: body(x).sum())
    k = jax.random.split(jax.random.PRNGKey(4), 3)
    x = jax.random.normal(k[0], (4, 2), jnp.float64)
    xq = jax.random.normal(k[1], (3, 2), jnp.float64)
    params, state = t.init(k[2], x)
    value, grads, cross = gram_haiku.cross_gram(t.apply)(
        params, state, None, x, queries=(xq,))
    assert cross.complete
    plain_loss = lambda p, x: plain.apply(p, None, x)
    f = np.asarray(testing.per_example_grads(plain_loss, params, x))
    h = np.asarray(testing.per_example_grads(plain_loss, params, xq))
    np.testing.assert_allclose(cross.total, f @ h.T, rtol=1e-10)
    want_value, want_grads = jax.value_and_grad(plain_loss)(params, x)
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-11)


def _two_losses():
  """A network, a training loss (squared error) and a query loss (cross
  entropy) per example, and the tracked loss that picks one per row from
  ``is_query``."""
  def body(x):
    return hk.Linear(3)(jnp.tanh(hk.Linear(5)(x)))

  def train_loss(out, y):
    return jnp.sum((out - y) ** 2, axis=-1)

  def query_loss(out, y):
    return -jnp.sum(jax.nn.log_softmax(out) * jax.nn.softmax(y), axis=-1)

  def loss(x, y, is_query=None):
    with gram_haiku.track():
      out = body(x)
    return jnp.where(is_query, query_loss(out, y), train_loss(out, y)).sum()
  train = hk.transform(lambda x, y: train_loss(body(x), y).sum())
  query = hk.transform(lambda x, y: query_loss(body(x), y).sum())
  return (hk.transform_with_state(loss),
          lambda p, x, y: train.apply(p, None, x, y),
          lambda p, x, y: query.apply(p, None, x, y))


def _query_problem(seed):
  """Float64 training rows and queries far off them (``1e2``), the two
  losses' model (:func:`_two_losses`) and its parameters, and the
  reference per-example gradients: ``f`` of the training loss
  (``train_loss``, returned too), ``h`` of the query loss. Call under ``jax.enable_x64``."""
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  x, y = (jax.random.normal(k[0], (6, 4), jnp.float64),
          jax.random.normal(k[1], (6, 3), jnp.float64))
  xq = 1e2 + jax.random.normal(k[2], (V, 4), jnp.float64)
  yq = jax.random.normal(k[3], (V, 3), jnp.float64)
  t, train_loss, query_loss = _two_losses()
  params, state = t.init(k[4], x, y, is_query=jnp.zeros((6,), bool))
  f = np.asarray(testing.per_example_grads(train_loss, params, x, y))
  h = np.asarray(testing.per_example_grads(query_loss, params, xq, yq))
  return x, y, xq, yq, t, train_loss, params, state, f, h


@pytest.mark.parametrize("clipped", [False, True], ids=["plain", "clipped"])
def test_a_separate_query_loss_and_clipping_are_exact_in_float64(clipped):
  """``query_flag``: the block against the query loss's gradients (queries
  far off the training inputs); ``l2_clip_norm``: the clipped update of
  the training examples alone, the block still of the unclipped ones."""
  with jax.enable_x64(True):
    x, y, xq, yq, t, train_loss, params, state, f, h = _query_problem(5)
    want, norms = f @ h.T, np.sqrt(np.sum(f * f, axis=1))
    c_norm = float(np.median(norms)) if clipped else None
    value, grads, cross = jax.jit(gram_haiku.cross_gram(
        t.apply, query_flag="is_query", l2_clip_norm=c_norm))(
            params, state, None, x, y, queries=(xq, yq))
    atol = 1e-12 * np.abs(want).max()
    np.testing.assert_allclose(cross.total, want, rtol=1e-10, atol=atol)
    np.testing.assert_allclose(cross.query_summed, want.sum(1), rtol=1e-10,
                               atol=atol)
    np.testing.assert_allclose(cross.sq_norms, norms ** 2, rtol=1e-10)
    c = (testing.clip_reference(norms, c_norm) if clipped
         else np.ones_like(norms))
    assert not clipped or 0 < np.mean(c < 1) < 1
    chex.assert_trees_all_close(grads, testing.weighted_sum(f, c, params),
                                rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(value, train_loss(params, x, y), rtol=1e-12)


def test_a_clipped_update_from_per_example_stores_is_exact_in_float64():
  """A layer applied twice keeps per-example gradients (in a clipping pass
  with their rounding bound's column, which the block leaves out): its
  block and the clipped update of the training examples, exact."""
  name, body, shape, _ = _x64_models()[0]
  assert name == "shared"
  with jax.enable_x64(True):
    k = jax.random.split(jax.random.PRNGKey(6), 3)
    x = jax.random.normal(k[0], (4,) + shape, jnp.float64)
    xq = jax.random.normal(k[1], (V,) + shape, jnp.float64)

    def loss(x):
      with gram_haiku.track():
        return body(x).sum()
    t = hk.transform_with_state(loss)
    plain = hk.transform(lambda x: body(x).sum())
    plain_loss = lambda p, x: plain.apply(p, None, x)
    params, state = t.init(k[2], x)
    f = np.asarray(testing.per_example_grads(plain_loss, params, x))
    h = np.asarray(testing.per_example_grads(plain_loss, params, xq))
    norms = np.sqrt(np.sum(f * f, axis=1))
    c_norm = float(np.median(norms))
    _, grads, cross = jax.jit(gram_haiku.cross_gram(
        t.apply, l2_clip_norm=c_norm))(params, state, None, x, queries=(xq,))
    want = f @ h.T
    np.testing.assert_allclose(cross.total, want, rtol=1e-10,
                               atol=1e-12 * np.abs(want).max())
    np.testing.assert_allclose(cross.query_summed, want.sum(1), rtol=1e-10,
                               atol=1e-12 * np.abs(want).max())
    c = testing.clip_reference(norms, c_norm)
    assert 0 < np.mean(c < 1) < 1
    chex.assert_trees_all_close(grads, testing.weighted_sum(f, c, params),
                                rtol=1e-10, atol=1e-13)


def _flagged_setup():
  """``(t, params, state, x, y)``: :func:`_two_losses`' transform, inited
  on ones with a query flag."""
  t, _, _ = _two_losses()
  x, y = jnp.ones((4, 4)), jnp.ones((4, 3))
  params, state = t.init(jax.random.PRNGKey(0), x, y,
                         is_query=jnp.zeros((4,), bool))
  return t, params, state, x, y


def test_query_flag_errors():
  t, params, state, x, y = _flagged_setup()
  with pytest.raises(ValueError, match="must be a Python identifier"):
    gram_haiku.cross_gram(t.apply, query_flag="is query")
  with pytest.raises(ValueError, match="would overwrite it"):
    gram_haiku.cross_gram(t.apply, query_flag="is_query")(
        params, state, None, x, y, queries=(x, y),
        is_query=jnp.zeros((8,), bool))


@pytest.mark.parametrize("strategy", ["auto", "ghost"])
def test_materialised_blocks_give_the_update_exactly_in_float64(
    strategy, monkeypatch):
  """Layers over positions whose block is formed from materialised
  per-example gradients take the training rows' update from their sum
  (bookkeeping.block_and_row_sums, no re-contraction); ghost blocks keep
  the re-contraction. Both exact, a frozen bias (zero columns, no sum)
  and queries far off the training inputs included."""
  from gram_haiku._src.passes import bookkeeping  # pylint: disable=g-import-not-at-top
  calls = []
  real = bookkeeping.block_and_row_sums
  monkeypatch.setattr(bookkeeping, "block_and_row_sums",
                      lambda op, *a: calls.append(op.name) or real(op, *a))

  def body(x):  # x: [B, 4, 16]: factors kept (smaller than the
    # gradients), and the cost model materialises the linear blocks.
    h = jnp.tanh(hk.Linear(16, name="first")(x))
    h = hk.Conv1D(16, 2, name="conv")(h)
    return jnp.sum(hk.Linear(6, name="last")(h) ** 2, axis=(1, 2))

  def loss(x):
    with gram_haiku.track(strategy=strategy):
      return body(x).sum()
  with jax.enable_x64(True):
    k = jax.random.split(jax.random.PRNGKey(7), 3)
    x = jax.random.normal(k[0], (4, 4, 16), jnp.float64)
    xq = 1e3 + jax.random.normal(k[1], (V, 4, 16), jnp.float64)
    t = hk.transform_with_state(loss)
    plain = hk.transform(lambda x: body(x).sum())
    plain_loss = lambda p, x: plain.apply(p, None, x)
    params, state = t.init(k[2], x)
    value, grads, cross = jax.jit(gram_haiku.cross_gram(
        t.apply, frozen=["first/b"]))(params, state, None, x, queries=(xq,))
    assert set(calls) >= ({"first", "last"} if strategy == "auto" else set()
                          ) and (strategy == "auto" or not calls), calls
    frozen = {"first": {"b"}}
    f = np.asarray(testing.per_example_grads(plain_loss, params, x))
    h = np.asarray(testing.per_example_grads(plain_loss, params, xq))
    names = [f"{m}/{n}" for m, n, _ in hk.data_structures.traverse(params)]
    sizes = [v.size for _, _, v in hk.data_structures.traverse(params)]
    keep = np.concatenate([np.full(s, n != "first/b")
                           for n, s in zip(names, sizes)])
    want = f[:, keep] @ h[:, keep].T
    np.testing.assert_allclose(cross.total, want, rtol=1e-10,
                               atol=1e-12 * np.abs(want).max())
    want_value, want_grads = jax.value_and_grad(plain_loss)(params, x)
    want_grads = {m: {n: (jnp.zeros_like(v) if n in frozen.get(m, ()) else v)
                      for n, v in d.items()} for m, d in want_grads.items()}
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize("form", ["split", "dict"])
def test_a_per_layer_clipped_update_is_exact_in_float64(form):
  """``clipping="per-layer"``: each module's part of ``g_i`` clipped to its
  own threshold (one number split by layer_split, or a dict), the update
  against the per-layer clipped sum of ``vmap(grad)``'s gradients; the
  block stays of the unclipped ones."""
  with jax.enable_x64(True):
    x, y, xq, yq, t, train_loss, params, state, f, h = _query_problem(8)
    groups = column_groups(params)
    norms = {m: np.sqrt(np.sum(f[:, c] ** 2, axis=1))
             for m, c in groups.items()}
    limits = {m: float(np.median(n)) for m, n in norms.items()}
    # One C split by weights w_l (C_l = C w_l / |w|), or a dict of C_l.
    c_norm = (limits if form == "dict" else
              float(np.sqrt(sum(v * v for v in limits.values()))))
    value, grads, cross = jax.jit(gram_haiku.cross_gram(
        t.apply, query_flag="is_query", l2_clip_norm=c_norm,
        clipping="per-layer",
        layer_split="equal" if form == "dict" else lambda sizes: limits))(
            params, state, None, x, y, queries=(xq, yq))
    want = f @ h.T
    np.testing.assert_allclose(cross.total, want, rtol=1e-10,
                               atol=1e-12 * np.abs(want).max())
    weighted = np.zeros_like(f)
    for m, cols in groups.items():
      c = testing.clip_reference(norms[m], limits[m])
      assert 0 < np.mean(c < 1) < 1, (m, c)
      weighted[:, cols] = c[:, None] * f[:, cols]
      np.testing.assert_allclose(cross.sq_norms_by_layer[m], norms[m] ** 2,
                                 rtol=1e-10)
    chex.assert_trees_all_close(
        grads, testing.weighted_sum(weighted, np.ones(len(f)), params),
        rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(value, train_loss(params, x, y), rtol=1e-12)


def test_clipping_errors():
  t, params, state, x, y = _flagged_setup()
  with pytest.raises(ValueError, match="expected one of"):
    gram_haiku.cross_gram(t.apply, l2_clip_norm=1.0, clipping="by-layer")
  with pytest.raises(ValueError, match="'all-layer' with a dict"):
    gram_haiku.cross_gram(t.apply, l2_clip_norm={"linear": 1.0})
  with pytest.raises(ValueError, match=r"cross_gram\(clipping='per-layer'\)"
                     r": no threshold for \['linear_1'\]"):
    gram_haiku.cross_gram(t.apply, query_flag="is_query",
                          l2_clip_norm={"linear": 1.0}, clipping="per-layer")(
                              params, state, None, x, y, queries=(x, y))


def test_query_summed_keeps_float32_accuracy_with_bfloat16_parameters():
  """bfloat16 parameters and float32 inputs: the layers compute in float32,
  so ``query_summed`` (from the queries' summed gradient, not the block)
  is as accurate as ``total``: that sum is not rounded to the parameters'
  bfloat16 first (which left it off by ~1e-3 of its largest entry)."""
  def body(x):
    return jnp.sum(hk.Linear(3)(jnp.tanh(hk.Linear(5)(x))) ** 2, axis=-1)

  def loss(x):
    with gram_haiku.track():
      return body(x).sum()
  k = jax.random.split(jax.random.PRNGKey(9), 3)
  x = jax.random.normal(k[0], (4, 6))
  xq = jax.random.normal(k[1], (V, 6))
  t = hk.transform_with_state(loss)
  params, state = t.init(k[2], x)
  params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
  _, _, cross = jax.jit(gram_haiku.cross_gram(t.apply))(
      params, state, None, x, queries=(xq,))
  with jax.enable_x64(True):
    plain = hk.transform(lambda x: body(x).sum())
    p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    plain_loss = lambda p, x: plain.apply(p, None, x)
    f = np.asarray(testing.per_example_grads(
        plain_loss, p64, jnp.asarray(x, jnp.float64)))
    h = np.asarray(testing.per_example_grads(
        plain_loss, p64, jnp.asarray(xq, jnp.float64)))
  want = f @ h.T
  for got, ref in [(cross.total, want), (cross.query_summed, want.sum(1))]:
    np.testing.assert_allclose(got, ref, rtol=0,
                               atol=1e-5 * np.abs(ref).max())
