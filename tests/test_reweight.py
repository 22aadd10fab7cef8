"""Reweighted and clipped gradients in one backward pass, against the
``vmap(grad)`` reference: every layer-zoo model, per-layer and automatic
clipping, a cross-example ``weight_fn``, padding masks, optax's DP
aggregate, and the completeness errors that protect a privacy guarantee."""

import functools

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gram_haiku
from gram_haiku._src.api import reweight
from gram_haiku._src.compute.plan import Clip
from gram_haiku._src.core.reference import ATOL_F32
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import column_groups
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import RTOL_BF16
from gram_haiku._src.core.reference import RTOL_F32
from gram_haiku._src.core.reference import weighted_sum
from gram_haiku.conformance.plugin import thorough
from tests import layer_zoo
from tests import problems

RTOL, ATOL = 1e-4, 1e-6


def _assert_tree_close(got, want, rtol):
  """Each leaf within ``rtol`` of the largest entry of the whole tree."""
  scale = max(float(np.max(np.abs(l))) for l in jax.tree.leaves(want)) or 1.0
  chex.assert_trees_all_close(
      jax.tree.map(lambda a: np.asarray(a, np.float64), got), want,
      rtol=rtol, atol=rtol * scale)


def _zoo_problem(entry, style, seed):
  fn, lead = layer_zoo._styled(entry, style)  # pylint: disable=protected-access
  x = layer_zoo._draw(entry, lead, seed)  # pylint: disable=protected-access
  tracked = hk.transform_with_state(layer_zoo._tracked(fn, entry))  # pylint: disable=protected-access
  plain = hk.transform_with_state(lambda x: layer_zoo._tail(fn(x)))  # pylint: disable=protected-access

  def setup(key, x):  # One program: both inits and the reference.
    params, state = tracked.init(key, x)
    _, plain_state = plain.init(key, x)
    plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
    return params, state, per_example_grads(plain_loss, params, x)
  params, state, f = jax.jit(setup)(jax.random.PRNGKey(1), x)
  return tracked, params, state, x, np.asarray(f, np.float64)


#: The default run: one entry per class of what a layer keeps and how it
#: is re-contracted (factors of a linear, conv, transposed conv, embedding,
#: norm and bias op; per-example gradients of a shared RNN cell, a tied LM
#: and hk.layer_stack; a bf16 policy; a composite). The LSTM under
#: dynamic_unroll runs in the per-layer and store tests below. Every entry
#: in every style with ``--conformance-thorough``.
DEFAULT_ENTRIES = ("MLP", "Conv2D", "Conv2DTranspose", "Embed", "LayerNorm",
                   "Bias", "GRU-static", "layer_stack", "tied-LM",
                   "ResNet-GroupNorm", "mixed-precision-policy-first")
#: ... and these also under hk.vmap (style -> entries).
VMAP_DEFAULT = {"vmap1": ("tied-LM",), "vmap2": ("MLP",)}


def _zoo_cases():
  out = []
  for e in layer_zoo.ENTRIES:
    styles = [s for s in e.styles if s != "eager"]
    if not thorough():
      if e.name not in DEFAULT_ENTRIES:
        continue
      styles = styles[:1] + [s for s in styles[1:]
                             if e.name in VMAP_DEFAULT.get(s, ())]
    for s in styles:
      out.append(pytest.param(e.name, s, id=f"{e.name}-{s}"))
  return out


@pytest.mark.parametrize("name,style", _zoo_cases())
def test_all_layer_clipping_matches_reference(name, style):
  entry = layer_zoo.BY_NAME[name]
  tracked, params, state, x, f = _zoo_problem(entry, style,
                                              layer_zoo.seed_of(name))
  norms = np.sqrt(np.sum(f * f, axis=1))
  c_norm = float(np.median(norms))  # Some examples clipped, some not.
  clipped = gram_haiku.clipped_grad(tracked.apply, c_norm)
  grads, aux = jax.jit(clipped)(params, state, None, x)
  want_c = clip_reference(norms, c_norm)
  rtol = RTOL_BF16 if layer_zoo.is_low_precision(entry) else RTOL
  np.testing.assert_allclose(aux.grad_norms, norms, rtol=rtol)
  _assert_tree_close(grads, weighted_sum(f, want_c, params), rtol)
  np.testing.assert_allclose(aux.fraction_clipped, np.mean(norms > c_norm))
  assert clipped.sensitivity() == c_norm


def _setup(f, plain_loss, seed, batch):
  """``(params, state, F)``: ``f.init`` and the reference ``F`` (float64)
  of ``plain_loss(params, *batch)``, in one program."""
  def setup(key, *batch):
    params, state = f.init(key, *batch)
    return params, state, per_example_grads(plain_loss, params, *batch)
  params, state, ref = jax.jit(setup)(jax.random.PRNGKey(seed), *batch)
  return params, state, np.asarray(ref, np.float64)


def _kept(make):
  """``make(seed, ...)`` made once per process for each argument list (the
  model, its parameters and its reference are the same each time); each
  call gets its own copy of the reference ``F`` (a test may write to it)."""
  made = functools.lru_cache(maxsize=None)(make)

  @functools.wraps(make)
  def get(*args, **kwargs):
    f, params, state, batch, ref = made(*args, **kwargs)
    return f, params, state, batch, ref.copy()
  return get


@_kept
def _mlp(seed=0, b=6):
  x, y = problems.data(seed, (b, 5), 3)

  def loss(x, y):
    with gram_haiku.track():
      return problems.sq(hk.nets.MLP([7, 4, 3])(x), y)
  f = hk.transform_with_state(loss)
  plain = hk.transform(lambda x, y: problems.sq(hk.nets.MLP([7, 4, 3])(x), y))
  params, state, ref = _setup(f, lambda p, x, y: plain.apply(p, None, x, y),
                              seed, (x, y))
  return f, params, state, (x, y), ref


@_kept
def _lstm(seed=0, b=5, t=4):
  x, y = problems.data(seed, (b, t, 3), 2)

  def model(x, y):
    core = hk.LSTM(4)
    out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1),
                               core.initial_state(x.shape[0]))
    return problems.sq(hk.Linear(2)(jnp.swapaxes(out, 0, 1)), y)

  def loss(x, y):
    with gram_haiku.track():
      return model(x, y)
  f = hk.transform_with_state(loss)
  plain = hk.transform(model)
  params, state, ref = _setup(f, lambda p, x, y: plain.apply(p, None, x, y),
                              seed, (x, y))
  return f, params, state, (x, y), ref


PROBLEMS = {"mlp": _mlp, "lstm": _lstm}


@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("clip_fn", ["abadi", "automatic"])
def test_per_layer_clipping_matches_reference(problem, clip_fn):
  f, params, state, batch, ref = PROBLEMS[problem]()
  groups = column_groups(params)
  thresholds = {}
  for i, (m, cols) in enumerate(sorted(groups.items())):
    n = np.sqrt(np.sum(ref[:, cols] ** 2, axis=1))
    thresholds[m] = float(np.median(n)) * (0.5 + 0.5 * i)
  clipped = gram_haiku.clipped_grad(f.apply, thresholds, clipping="per-layer",
                                    clip_fn=clip_fn, gamma=0.05)
  grads, aux = jax.jit(clipped)(params, state, None, *batch)
  want = np.zeros(ref.shape[1])
  for m, cols in groups.items():
    n = np.sqrt(np.sum(ref[:, cols] ** 2, axis=1))
    c = clip_reference(n, thresholds[m], clip_fn, 0.05)
    want[cols] = c @ ref[:, cols]
  _assert_tree_close(grads, weighted_sum(want[None], [1.0], params), RTOL)
  np.testing.assert_allclose(aux.grad_norms,
                             np.sqrt(np.sum(ref ** 2, axis=1)), rtol=RTOL)
  bound = np.sqrt(sum(v * v for v in thresholds.values()))
  np.testing.assert_allclose(clipped.sensitivity(), bound)


def _run(f, params, state, batch, **kw):
  """``reweight.run`` under jit: ``(its modes, its gradients)``."""
  seen = {}

  def go(params, state, batch):
    r = reweight.run(f.apply, params, state, None, batch, {}, fn_name="t",
                     needs="norms", has_aux=False, axes=(), frozen=None, **kw)
    seen["modes"] = r.modes
    return r.grads
  grads = jax.jit(go)(params, state, batch)
  return seen["modes"], grads


def test_per_layer_runs_inside_the_backward_rule():
  f, params, state, batch, _ = _mlp()
  modes, _ = _run(f, params, state, batch,
                  clips=lambda sizes: {m: Clip(0.1) for m in sizes})
  assert set(modes.values()) == {"clip"}


@pytest.mark.parametrize("split", ["equal", "by_size", "custom"])
def test_one_number_per_layer_is_split(split):
  f, params, state, batch, ref = _mlp()
  groups = column_groups(params)
  sizes = {m: cols.stop - cols.start for m, cols in groups.items()}
  c_total = 0.3
  if split == "custom":  # the last layer gets twice the others' share
    last = max(sizes)
    layer_split = lambda s: {m: 2.0 if m == last else 1.0 for m in s}
    w = {m: 2.0 if m == last else 1.0 for m in sizes}
  else:
    layer_split = split
    w = {m: 1.0 if split == "equal" else np.sqrt(n) for m, n in sizes.items()}
  norm = np.sqrt(sum(v * v for v in w.values()))
  clipped = gram_haiku.clipped_grad(f.apply, c_total, clipping="per-layer",
                                    layer_split=layer_split)
  grads, aux = jax.jit(clipped)(params, state, None, *batch)
  want = np.zeros(ref.shape[1])
  clipped_any = np.zeros(ref.shape[0], bool)
  for m, cols in groups.items():
    n = np.sqrt(np.sum(ref[:, cols] ** 2, axis=1))
    c_l = c_total * w[m] / norm
    want[cols] = clip_reference(n, c_l) @ ref[:, cols]
    clipped_any |= n > c_l
  _assert_tree_close(grads, weighted_sum(want[None], [1.0], params), RTOL)
  assert clipped.sensitivity() == pytest.approx(c_total)
  np.testing.assert_allclose(aux.fraction_clipped, clipped_any.mean())


def _stacked(x):
  h = hk.layer_stack(3)(lambda h: h + jnp.tanh(hk.Linear(5)(h)))(x)
  return hk.Linear(3, name="head")(h)


def _called_twice(x):
  shared = hk.Linear(5)
  return hk.Linear(3, name="head")(jnp.tanh(shared(jnp.tanh(shared(x)))))


def _getter(x):
  def scaled(next_getter, value, context):
    out = next_getter(value)
    return out * 1.5 if context.name == "w" else out
  with hk.custom_getter(scaled):
    h = jnp.tanh(hk.Linear(5)(x))
  return hk.Linear(3, name="head")(h)


def _stacked_scan(x):
  h = hk.layer_stack(2, unroll=2)(
      lambda h: jnp.tanh(hk.LayerNorm(-1, True, True)(hk.Linear(5)(h))))(x)
  return hk.Linear(3, name="head")(h)


@pytest.mark.parametrize("model", [_stacked, _called_twice, _getter,
                                   _stacked_scan])
@pytest.mark.parametrize("frozen", [False, True])
def test_by_size_counts_the_parameters_a_module_owns(model, frozen):
  # The sizes "by_size" and a split function see are each module's
  # parameter count in params (frozen ones left out), not what one call of
  # its op sees: one layer's slice inside hk.layer_stack, one read of a
  # module called twice, the getter's output. Checked on the thresholds
  # through the clipped sum, against vmap(grad).
  x, y = problems.data(4, (6, 5), 3)

  def loss(x, y):
    with gram_haiku.track():
      return problems.sq(model(x), y)
  f = hk.transform_with_state(loss)
  plain = hk.transform(lambda x, y: problems.sq(model(x), y))
  params, state, ref = _setup(f, lambda p, x, y: plain.apply(p, None, x, y),
                              2, (x, y))
  groups = column_groups(params)
  # Freeze the bias of a module other than the head: a stacked one's is
  # [L, 5].
  cold = min(m for m in groups if m != "head" and "b" in params[m])
  sizes = {m: cols.stop - cols.start for m, cols in groups.items()}
  if frozen:  # its gradient is zero
    sizes[cold] -= params[cold]["b"].size
    start = groups[cold].start  # a module's leaves in name order: b, w
    ref[:, start:start + params[cold]["b"].size] = 0.0
  seen = {}

  def spy(s):
    seen.update(s)
    return {m: np.sqrt(n) for m, n in s.items()}
  kwargs = dict(clipping="per-layer")
  if frozen:
    kwargs["frozen"] = cold + "/b"
  c_total = 0.05
  got = {}
  for split in ("by_size", spy):
    clipped = gram_haiku.clipped_grad(f.apply, c_total, layer_split=split,
                                      **kwargs)
    got[split if isinstance(split, str) else "spy"] = jax.jit(clipped)(
        params, state, None, x, y)[0]
  assert seen == sizes
  norm = np.sqrt(sum(sizes.values()))
  want = np.zeros(ref.shape[1])
  for m, cols in groups.items():
    n = np.sqrt(np.sum(ref[:, cols] ** 2, axis=1))
    c_l = c_total * np.sqrt(sizes[m]) / norm
    assert np.all(n > c_l), "a case where every example is clipped"
    want[cols] = clip_reference(n, c_l) @ ref[:, cols]
  for name, grads in got.items():
    _assert_tree_close(grads, weighted_sum(want[None], [1.0], params),
                       RTOL)


def test_bad_layer_splits_are_errors():
  f, params, state, batch, _ = _mlp()
  with pytest.raises(ValueError, match="layer_split='thirds'"):
    gram_haiku.clipped_grad(f.apply, 1.0, clipping="per-layer",
                            layer_split="thirds")
  with pytest.raises(ValueError, match="with a dict of thresholds"):
    gram_haiku.clipped_grad(f.apply, {"mlp/~/linear_0": 1.0},
                            clipping="per-layer", layer_split="by_size")
  for bad, match in [(lambda s: {}, "no weight for"),
                     (lambda s: {m: -1.0 for m in s}, "finite number >= 0"),
                     (lambda s: {m: 0.0 for m in s}, "only zero weights")]:
    clipped = gram_haiku.clipped_grad(f.apply, 1.0, clipping="per-layer",
                                      layer_split=bad)
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(clipped, params, state, None, *batch)


def test_cross_example_weight_fn():
  """Drop the examples whose gradient has a negative cosine with the batch's
  mean gradient: needs the Gram's off-diagonal entries."""
  f, params, state, batch, ref = _mlp(seed=3, b=8)

  def weight_fn(grams):
    return (jnp.sum(grams.total, axis=1) > 0).astype(jnp.float32)
  fn = jax.jit(gram_haiku.reweighted_grad(f.apply, weight_fn, needs="gram"))
  value, grads, grams, c = fn(params, state, None, *batch)
  want_c = (ref @ ref.sum(0) > 0).astype(np.float64)
  assert 0 < want_c.sum() < len(want_c), "a case that drops some examples"
  np.testing.assert_array_equal(c, want_c)
  _assert_tree_close(grads, weighted_sum(ref, want_c, params), RTOL)
  np.testing.assert_allclose(grams.total, ref @ ref.T, rtol=RTOL,
                             atol=RTOL * np.abs(ref @ ref.T).max())
  np.testing.assert_allclose(value, f.apply(params, state, None, *batch)[0],
                             rtol=1e-6)


@pytest.mark.parametrize("clipping", ["all-layer", "per-layer"])
def test_an_example_with_a_non_finite_loss_gets_weight_zero(clipping):
  # Without padding, an example whose label is NaN has a NaN output
  # cotangent (its inputs are finite): it gets weight 0 and adds nothing,
  # and the others are clipped as without it.
  f, params, state, (x, y), _ = _mlp(seed=5, b=6)
  bad = y.at[2].set(jnp.nan)
  clipped = jax.jit(gram_haiku.clipped_grad(f.apply, 0.5, clipping=clipping))
  grads, aux = clipped(params, state, None, x, bad)
  keep = np.arange(6) != 2
  want, _ = clipped(params, state, None, x[keep], y[keep])
  assert np.asarray(aux.weights[next(iter(aux.weights))])[2] == 0
  chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("pad,match", [
    (np.zeros(8, bool), r"shape \(8,\).*7 examples"),
    (np.zeros((7, 1), bool), r"shape \(7, 1\)"),
    (np.ones((), bool), r"shape \(\)"),
    (np.full(7, 0.5, np.float32), "boolean array"),
    (np.zeros(7, np.int32), "boolean array"),
])
def test_a_bad_padding_mask_is_a_teaching_error(pad, match):
  # Not broadcast, not a weight: a mask of one bool per example.
  f, params, state, (x, y), _ = _mlp(seed=4, b=7)
  with pytest.raises(ValueError, match=match):
    gram_haiku.clipped_grad(f.apply, 0.5)(params, state, None, x, y,
                                          is_padding_example=pad)


@pytest.mark.parametrize("clipping", ["all-layer", "per-layer"])
def test_padding_rows_contribute_nothing(clipping):
  f, params, state, (x, y), ref = _mlp(seed=4, b=7)
  pad = np.array([0, 1, 0, 0, 1, 1, 0], bool)
  # Padded rows hold anything, even non-finite values.
  x = jnp.where(pad[:, None], jnp.nan, x)
  clipped = jax.jit(gram_haiku.clipped_grad(f.apply, 0.5, clipping=clipping))
  grads, aux = clipped(params, state, None, x, y, is_padding_example=pad)
  real = ~pad
  sub = jax.jit(gram_haiku.clipped_grad(f.apply, 0.5, clipping=clipping))
  want, want_aux = sub(params, state, None, x[real], y[real])
  chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-7)
  assert all(np.isfinite(l).all() for l in jax.tree.leaves(grads))
  np.testing.assert_allclose(aux.fraction_clipped,
                             want_aux.fraction_clipped, rtol=1e-6)


def test_equals_optax_dp_aggregate_without_noise():
  f, params, state, batch, ref = _mlp(seed=5, b=8)
  c_norm = float(np.median(np.sqrt(np.sum(ref ** 2, 1))))
  b = batch[0].shape[0]
  ours, _ = jax.jit(gram_haiku.clipped_grad(f.apply, c_norm, normalize_by=b))(
      params, state, None, *batch)
  plain = hk.transform(lambda x, y: problems.sq(hk.nets.MLP([7, 4, 3])(x), y))
  per = jax.jit(jax.vmap(lambda xi, yi: jax.grad(lambda p: plain.apply(
      p, None, xi[None], yi[None]))(params)))(*batch)
  agg = optax.contrib.differentially_private_aggregate(
      c_norm, 0.0, jax.random.key(0))
  theirs, _ = jax.jit(agg.update)(per, agg.init(params))
  chex.assert_trees_all_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_modes_follow_the_cost_model():
  """Unshared layers keep factors where they are smaller than the
  per-example gradients (the MLP's), else the per-example gradients (the
  LSTM's head over T=4 steps: 24 factor entries per example against 10
  parameters); the LSTM's gates, applied at every step, keep each step's
  factors in a slot (4 steps x 23 entries against 128 parameters). With
  c = 1 every store gives back the plain gradient."""
  for problem, want in [("mlp", {f"mlp/~/linear_{i}": "factors"
                                 for i in range(3)}),
                        ("lstm", {"linear": "per_example",
                                  "lstm/linear": "slots"})]:
    f, params, state, batch, _ = PROBLEMS[problem]()
    modes, got = _run(f, params, state, batch,
                      weight_fn=lambda g: jnp.ones_like(g.sq_norms))
    assert modes == want
    grads = jax.jit(jax.grad(lambda p: f.apply(p, state, None, *batch)[0]))(
        params)
    chex.assert_trees_all_close(got, grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clipping", ["all-layer", "per-layer"])
def test_clipped_grad_ignores_the_track_mode(clipping):
  """clipped_grad computes only the norms: the lowered step is the same
  under track() and track(mode="norms") (docs/performance.rst, "How to
  choose the options", tells users there is nothing to set)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 5))
  y = jnp.arange(8) % 3

  def lowered(mode):
    def loss_fn(x, y):
      with gram_haiku.track(mode=mode):
        logits = hk.nets.MLP([16, 3])(x)
      logp = jax.nn.log_softmax(logits)
      return -jnp.take_along_axis(logp, y[:, None], -1).sum()
    f = hk.transform_with_state(loss_fn)
    params, state = f.init(jax.random.PRNGKey(1), x, y)
    step = gram_haiku.clipped_grad(f.apply, l2_clip_norm=1.0,
                                   clipping=clipping)
    return jax.jit(step).lower(params, state, None, x, y).as_text()

  assert lowered("gram") == lowered("norms")


def test_per_layer_clip_norms_are_costed_without_reuse(monkeypatch):
  """Per-layer clipping re-contracts its clipped sum from the factors, so
  nothing reuses materialised per-example gradients: the norms' method is
  costed as after the pass (``B T N M`` against ghost ``B T^2 (N + M)``),
  not as the norms mode's diagonal, which counts the weight gradient as
  given. At N = M = 16 and T = 4 the two disagree (ghost, materialise);
  the clipped sum is the reference's."""
  from gram_haiku._src.ops import linear  # pylint: disable=g-import-not-at-top
  chosen = []
  cost = linear.cost

  def spy(*args, **kwargs):
    chosen.append((kwargs.get("mode"), kwargs.get("reuse", True),
                   cost(*args, **kwargs)))
    return chosen[-1][-1]
  monkeypatch.setattr(linear, "cost", spy)
  x, y = problems.data(3, (5, 4, 16), 16)

  def model(x, y):
    return problems.sq(hk.Linear(16)(x), y)

  def loss(x, y):
    with gram_haiku.track():
      return model(x, y)
  f = hk.transform_with_state(loss)
  plain = hk.transform(model)
  params, state, ref = _setup(f, lambda p, x, y: plain.apply(p, None, x, y),
                              0, (x, y))
  grads, _ = jax.jit(gram_haiku.clipped_grad(f.apply, 0.5,
                                             clipping="per-layer"))(
                                                 params, state, None, x, y)
  assert chosen and all(c == ("norms", False, "ghost") for c in chosen)
  want = clip_reference(np.sqrt(np.sum(ref ** 2, axis=1)), 0.5) @ ref
  _assert_tree_close(grads, weighted_sum(want[None], [1.0], params), RTOL)


def test_frozen_parameters_get_zero_gradient_and_need_no_rule():
  x, y = problems.data(6, (5, 4), 2)

  def loss(x, y):
    # Outside track(), its weight in a product with a custom derivative: no
    # rule (a program-level rule covers a plain product, and one inside a
    # checkpoint).
    with hk.name_scope("frozen_features"):
      w = hk.get_parameter("w", [4, 3], init=hk.initializers.RandomNormal())
      b = hk.get_parameter("b", [3], init=jnp.ones)
    h = problems.uncovered_matmul(x, w) + b
    with gram_haiku.track():
      return problems.sq(hk.Linear(2, name="head")(jnp.tanh(h)), y)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="frozen_features/w.*no Gram rule"):
    gram_haiku.clipped_grad(f.apply, 1.0)(params, state, None, x, y)
  grads, aux = jax.jit(gram_haiku.clipped_grad(
      f.apply, 1.0, frozen="frozen_features"))(params, state, None, x, y)
  assert all((l == 0).all() for l in jax.tree.leaves(grads["frozen_features"]))
  head = lambda p, x, y: problems.sq(hk.transform(lambda x: hk.Linear(
      2, name="head")(x)).apply(p, None, jnp.tanh(
          x @ params["frozen_features"]["w"] + params["frozen_features"]["b"])),
                                     y)
  hp = {"head": params["head"]}
  fr = np.asarray(per_example_grads(head, hp, x, y), np.float64)
  want = weighted_sum(fr, clip_reference(np.sqrt((fr ** 2).sum(1)), 1.0), hp)
  _assert_tree_close({"head": grads["head"]}, want, RTOL)
  assert aux.grams.complete


def test_coupled_examples_are_an_error():
  x, y = problems.data(7, (6, 4), 2)

  def loss(x, y):
    with gram_haiku.track():
      h = hk.Linear(3)(x)
      h = h - jnp.mean(h, axis=0)  # couples the examples
      return problems.sq(hk.Linear(2)(h), y)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="couple|other examples|mix"):
    gram_haiku.clipped_grad(f.apply, 1.0)(params, state, None, x, y)


def test_batch_norm_training_is_an_error():
  x, y = problems.data(8, (6, 4), 4)

  def loss(x, y):
    with gram_haiku.track():
      h = hk.BatchNorm(True, True, 0.9)(hk.Linear(4)(x), is_training=True)
      return problems.sq(h, y)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="BatchNorm"):
    gram_haiku.clipped_grad(f.apply, 1.0)(params, state, None, x, y)


def test_bad_options_are_errors():
  f, *_ = _mlp()
  with pytest.raises(ValueError, match="clipping="):
    gram_haiku.clipped_grad(f.apply, 1.0, clipping="flat")
  with pytest.raises(ValueError, match="clip function"):
    gram_haiku.clipped_grad(f.apply, 1.0, clip_fn="hard")
  with pytest.raises(ValueError, match="l2_clip_norm"):
    gram_haiku.clipped_grad(f.apply, -1.0)
  with pytest.raises(ValueError, match="per-layer"):
    gram_haiku.clipped_grad(f.apply, {"mlp/~/linear_0": 1.0})
  with pytest.raises(ValueError, match="needs="):
    gram_haiku.reweighted_grad(f.apply, lambda g: g.norms, needs="full")


def test_missing_per_layer_threshold_and_bad_weights_are_errors():
  f, params, state, batch, _ = _mlp()
  with pytest.raises(ValueError, match=r"no threshold for \['mlp/~/linear_2'"):
    gram_haiku.clipped_grad(f.apply, {"mlp/~/linear_0": 1.0,
                                      "mlp/~/linear_1": 1.0},
                            clipping="per-layer")(params, state, None, *batch)
  with pytest.raises(ValueError, match=r"expected one weight per example"):
    gram_haiku.reweighted_grad(f.apply, lambda g: g.sq_norms[:2])(
        params, state, None, *batch)


def test_a_threshold_for_an_untracked_module_is_an_error():
  """A misspelt (or wholly frozen) module's threshold would count in the
  sensitivity, so in the noise, while bounding no gradient."""
  f, params, state, batch, _ = _mlp()
  names = ("mlp/~/linear_0", "mlp/~/linear_1", "mlp/~/linear_2")
  thresholds = {**{m: 1.0 for m in names}, "mlp/~/linear_9": 1.0}
  with pytest.raises(ValueError, match=r"thresholds for \['mlp/~/linear_9'\]"):
    gram_haiku.clipped_grad(f.apply, thresholds, clipping="per-layer")(
        params, state, None, *batch)
  frozen = {m: 1.0 for m in names}
  with pytest.raises(ValueError, match=r"thresholds for \['mlp/~/linear_0'\]"):
    gram_haiku.clipped_grad(f.apply, frozen, clipping="per-layer",
                            frozen=("mlp/~/linear_0",))(
                                params, state, None, *batch)


@pytest.mark.parametrize("clipping", ["all-layer", "per-layer"])
def test_thresholds_as_numpy_or_jax_scalars_and_no_clipping(clipping):
  """A NumPy or concrete JAX scalar is a threshold like a float; ``inf``
  (``"abadi"``) clips nothing: the plain sum of the per-example
  gradients, with an infinite sensitivity."""
  f, params, state, batch, ref = _mlp()
  # Each kind of scalar once, the two clippings taking them in turn.
  kinds = {"all-layer": (np.float32(0.7), jnp.bfloat16(0.7)),
           "per-layer": (jnp.asarray(0.7, jnp.float32), np.array(0.7))}
  for c in kinds[clipping]:
    value = float(np.asarray(c, np.float64))
    want = gram_haiku.clipped_grad(f.apply, value, clipping=clipping)(
        params, state, None, *batch)[0]
    fn = gram_haiku.clipped_grad(f.apply, c, clipping=clipping)
    got = fn(params, state, None, *batch)[0]
    chex.assert_trees_all_close(got, want, rtol=1e-6)
    assert fn.sensitivity() == value
  unclipped = gram_haiku.clipped_grad(f.apply, np.inf, clipping=clipping)
  assert unclipped.sensitivity() == np.inf
  got, aux = unclipped(params, state, None, *batch)
  assert float(aux.fraction_clipped) == 0.0
  chex.assert_trees_all_close(
      got, weighted_sum(ref, np.ones(len(ref)), params), rtol=RTOL_F32,
      atol=ATOL_F32 * float(np.abs(ref).max()))
  if clipping == "per-layer":  # A zero weight is a zero threshold.
    split = lambda sizes: {m: float(not m.endswith("_0")) for m in sizes}
    got, _ = gram_haiku.clipped_grad(f.apply, np.inf, clipping=clipping,
                                     layer_split=split)(params, state, None,
                                                        *batch)
    assert not np.any(got["mlp/~/linear_0"]["w"])
    assert np.all(np.isfinite(got["mlp/~/linear_1"]["w"]))
  with pytest.raises(ValueError, match="positive, finite"):
    gram_haiku.clipped_grad(f.apply, np.inf, clip_fn="automatic")
  traced = lambda c: gram_haiku.clipped_grad(f.apply, c, clipping=clipping)(
      params, state, None, *batch)[0]
  if clipping == "per-layer":  # Its thresholds are fixed in the backward.
    with pytest.raises(ValueError, match="traced"):
      jax.jit(traced)(0.7)
  else:  # As jax-privacy's: a traced threshold under jit.
    chex.assert_trees_all_close(jax.jit(traced)(0.7), traced(0.7),
                                rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("target", ["batch_mean", "reversed", "summed"])
def test_other_examples_data_in_a_loss_is_a_privacy_error(target):
  """A Gram is defined when example i's loss reads other examples' *data*
  (only parameter-dependent coupling breaks it), but a clipped gradient
  then bounds nothing: clipped_grad refuses, value_grad_and_gram does not."""
  x, y = problems.data(9, (6, 4), 2)
  targets = {"batch_mean": lambda y: jnp.mean(y, axis=0),
             "reversed": lambda y: y[::-1],
             "summed": lambda y: y * jnp.sum(y)}

  def loss(x, y):
    with gram_haiku.track():
      out = hk.Linear(2)(x)
    return problems.sq(out, targets[target](y))
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  # The Gram itself is fine (traced, not run); only privacy refuses it.
  jax.eval_shape(gram_haiku.value_grad_and_gram(f.apply), params, state,
                 None, x, y)
  with pytest.raises(ValueError, match="reads data of other examples"):
    gram_haiku.clipped_grad(f.apply, 1.0)(params, state, None, x, y)


def test_own_labels_and_fixed_statistics_are_private():
  x, y = problems.data(10, (6, 4), 3)
  labels = jnp.argmax(y, -1)

  def loss(x, labels):
    x = (x - 0.5) / 2.0  # fixed, data-independent statistics
    with gram_haiku.track():
      logits = hk.Linear(3)(x)
    logp = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.take_along_axis(logp, labels[:, None], axis=1))
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, labels)
  grads, _ = jax.jit(gram_haiku.clipped_grad(f.apply, 0.1))(params, state,
                                                            None, x, labels)
  assert all(np.isfinite(l).all() for l in jax.tree.leaves(grads))


def test_example_axis_behind_another_vmap():
  """The examples' vmap inside an outer vmap (over heads): the layer's
  example axis is not its input's first axis. Weights drawn at random,
  against grad of sum_i c_i l_i of the same model untracked."""
  b, d, heads = 5, 6, 3  # K = 3 (6 + 8) factor entries < P = 56
  x = problems.normal(jax.random.PRNGKey(0), (b, d))
  scales = jnp.arange(1.0, heads + 1.0)
  c = problems.uniform(jax.random.PRNGKey(1), (b,), minval=0.1)

  def per_example_losses(x):
    def per_head(scale):
      def one(xi):
        return jnp.sum(jnp.tanh(hk.Linear(8)(xi * scale)) ** 2)
      return hk.vmap(one, axis_name="batch", split_rng=False)(x)
    return hk.vmap(per_head, split_rng=False)(scales).sum(0)  # (B,)

  def tracked(x):
    with gram_haiku.track(example_axis="batch"):
      return jnp.sum(per_example_losses(x))
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(2), x)
  plain = hk.transform(per_example_losses)
  want = jax.jit(jax.grad(lambda p: jnp.sum(c * plain.apply(p, None, x))))(
      params)
  r = reweight.run(f.apply, params, state, None, (x,), {}, fn_name="t",
                   needs="gram", has_aux=False, axes=(), frozen=None,
                   weight_fn=lambda g: c)
  assert r.modes == {"linear": "factors"}
  chex.assert_trees_all_close(r.grads, want, rtol=1e-5, atol=1e-6)
  ref = np.asarray(per_example_grads(lambda p, xi: plain.apply(
      p, None, xi).sum(), params, x), np.float64)
  np.testing.assert_allclose(r.grams.total, ref @ ref.T, rtol=1e-4,
                             atol=1e-5 * np.abs(ref @ ref.T).max())


@pytest.mark.parametrize("take_first", [True, False])
def test_module_in_both_branches_of_a_cond(take_first):
  """Two alternative applications (hk.cond branches, inputs of other
  shapes): the module keeps per-example gradients, whichever branch runs."""
  x, y = problems.data(12, (5, 4, 6), 16)  # K = 4 (6 + 16) < P = 112

  def model(x, y, pred):
    lin = hk.Linear(16)
    out = hk.cond(pred, lambda v: lin(v),
                  lambda v: lin(v[:, ::-1].reshape(-1, 2, 2, 6)).reshape(
                      -1, 4, 16), x)
    return problems.sq(jnp.tanh(out), y)

  def tracked(x, y, pred):
    with gram_haiku.track():
      return model(x, y, pred)
  pred = jnp.asarray(take_first)
  f = hk.transform_with_state(tracked)
  plain = hk.transform(model)

  def setup(key, x, y, pred):
    params, state = f.init(key, x, y, pred)
    return params, state, per_example_grads(lambda p, x, y: plain.apply(
        p, None, x, y, pred), params, x, y)
  params, state, ref = jax.jit(setup)(jax.random.PRNGKey(0), x, y, pred)
  ref = np.asarray(ref, np.float64)
  c = np.linspace(0.2, 1.0, 5)
  r = reweight.run(f.apply, params, state, None, (x, y, pred), {},
                   fn_name="t", needs="norms", has_aux=False, axes=(),
                   frozen=None, weight_fn=lambda g: jnp.asarray(c, jnp.float32))
  assert r.modes == {"linear": "per_example"}
  _assert_tree_close(r.grads, weighted_sum(ref, c, params), RTOL)
  np.testing.assert_allclose(r.grams.sq_norms, (ref ** 2).sum(1), rtol=RTOL)
