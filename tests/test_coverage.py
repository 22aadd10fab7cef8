"""Coverage: which parameters the Gram covers, and what happens to the rest."""

import contextlib
import functools
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import weighted_sum
from gram_haiku._src.frontend import coverage as coverage_lib
from tests import problems


def _data(seed, b=5, t=3, d=4, out=3):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (problems.normal(k1, (b, t, d)),
          problems.normal(k2, (b, t, out)))


#: A matrix product with a custom derivative: where a parameter meets the
#: data there, no program-level rule covers it.
_uncovered_matmul = problems.uncovered_matmul


class Scale(hk.Module):
  """A module with no Gram rule: y = x * s, written as a product with
  diag(s) by a function with a custom derivative, a use that no
  program-level rule covers either (``x * s`` and ``x @ diag(s)``
  themselves are covered)."""

  def __call__(self, x):
    s = hk.get_parameter("s", [x.shape[-1]], x.dtype, init=jnp.ones)
    return _uncovered_matmul(x, jnp.diag(s))


def _model(x):
  h = jnp.tanh(hk.Linear(6)(x))
  h = Scale()(h)
  t = hk.get_parameter("temperature", [], jnp.float32, init=jnp.ones)
  # (times t, as a product that no program-level rule covers: see Scale)
  return _uncovered_matmul(hk.Linear(3)(h), t * jnp.eye(3))


def _run(untracked, seed=0):
  x, y = _data(seed)
  def loss(x, y):
    with gram_haiku.track(untracked=untracked):
      return 0.5 * jnp.sum((_model(x) - y) ** 2)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  out = gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)
  return out, params, x, y


def test_coverage_lists_every_parameter():
  (_, _, grams), params, x, y = _run("ignore")
  cov = grams.coverage
  assert set(cov) == {"linear/w", "linear/b", "linear_1/w", "linear_1/b",
                      "scale/s", "~/temperature"}
  assert cov["linear/w"].tracked and cov["linear/w"].rule == "linear"
  assert not cov["scale/s"].tracked and cov["scale/s"].module_type == "Scale"
  assert not cov["~/temperature"].tracked
  assert cov["~/temperature"].module_type == "(none)"
  assert not grams.complete
  assert grams.untracked == ["scale/s", "~/temperature"]
  # The Gram covers exactly the tracked parameters.
  def plain(p, x, y):
    return 0.5 * jnp.sum((hk.without_apply_rng(hk.transform(_model)).apply(
        p, x) - y) ** 2)
  tracked_only = {k: v for k, v in params.items() if k.startswith("linear")}
  frozen = {k: v for k, v in params.items() if not k.startswith("linear")}
  ref = reference_gram(lambda p, x, y: plain({**p, **frozen}, x, y),
                       tracked_only, x, y)
  assert_gram_close(grams.total, ref)


def test_complete_model():
  x, y = _data(1)
  def loss(x, y):
    with gram_haiku.track():
      return jnp.sum(hk.nets.MLP([4, 3])(x) * y)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                         x, y)
  assert grams.complete and not grams.untracked


def test_untracked_warns_once_per_parameter():
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _run("warn", seed=2)
    _run("warn", seed=3)
  msgs = [str(w.message) for w in caught
          if issubclass(w.category, gram_haiku.UntrackedParameterWarning)]
  for name in ("scale/s", "~/temperature"):
    # The module-level registry may already hold it from another test in
    # this process: then zero, never more than one.
    assert sum(f"'{name}'" in m for m in msgs) <= 1
  assert all("no Gram rule covers it" in m for m in msgs)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("path", ["value_grad_and_gram", "raw",
                                  "reweighted_grad", "clipped_grad"])
def test_untracked_warning_points_at_the_users_code(path, jit, monkeypatch):
  # Not into JAX, Haiku or jax-privacy (whose BoundedSensitivityCallable
  # wraps clipped_grad), under jit or not: value_grad_and_gram reports
  # after tracing, at the user's call; the raw path at the read itself.
  monkeypatch.setattr(coverage_lib, "_WARNED", set())
  x, y = problems.data(40, (4, 3), 2)

  def loss(x, y):
    with gram_haiku.track():
      s = hk.get_parameter("stray", (), init=jnp.ones)
      # (a use that no program-level rule covers: see Scale)
      return jnp.sum((_uncovered_matmul(hk.Linear(2)(x), s * jnp.eye(2))
                      - y) ** 2)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = {"value_grad_and_gram": gram_haiku.value_grad_and_gram(f.apply),
        "raw": f.apply,
        "reweighted_grad": gram_haiku.reweighted_grad(
            f.apply, lambda g: jnp.ones_like(g.norms)),
        "clipped_grad": gram_haiku.clipped_grad(f.apply, 1.0)}[path]
  fn = jax.jit(fn) if jit else fn
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      fn(params, state, None, x, y)
    except ValueError as e:  # A weighted sum needs every parameter's.
      assert path in ("reweighted_grad", "clipped_grad"), e
      assert "stray" in str(e), e
  (w,) = [w for w in caught
          if issubclass(w.category, gram_haiku.UntrackedParameterWarning)]
  assert w.filename == __file__, (w.filename, w.lineno)


@pytest.mark.parametrize("path", ["value_grad_and_gram", "raw"])
def test_untracked_error(path):
  # `init` computes no Gram: the first apply is where the error is raised.
  x, y = _data(4)
  def loss(x, y):
    with gram_haiku.track(untracked="error"):
      return 0.5 * jnp.sum((_model(x) - y) ** 2)
  f = hk.transform_with_state(loss)
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError, match="'scale/s' .*module type Scale"):
    if path == "raw":
      f.apply(params, state, None, x, y)
    else:
      gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x, y)


def _stopped_model(x, also_direct):
  # `Scale` and the bare temperature have no Gram rule; read only through
  # stop_gradient they have no gradient, so the Gram misses nothing.
  h = jnp.tanh(hk.Linear(6)(x))
  s = Scale()
  h = jax.lax.stop_gradient(s(h)) + (s(h) if also_direct else 0.0)
  t = hk.get_parameter("temperature", [], jnp.float32, init=jnp.ones)
  return hk.Linear(3)(h) * jax.lax.stop_gradient(t)


def _assert_reported(loss, x, y, jit=False,
                     match="'scale/s' .*module type Scale"):
  """``value_grad_and_gram`` of ``loss(x, y)`` raises the untracked error."""
  f = hk.transform_with_state(loss)
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  with pytest.raises(ValueError, match=match):
    (jax.jit(fn) if jit else fn)(params, state, None, x, y)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("untracked", ["error", "warn"])
def test_untracked_read_only_through_stop_gradient_is_not_reported(
    untracked, jit):
  x, y = _data(5)
  def loss(x, y):
    with gram_haiku.track(untracked=untracked):
      return 0.5 * jnp.sum((_stopped_model(x, False) - y) ** 2)
  f = hk.transform_with_state(loss)
  g = hk.without_apply_rng(hk.transform(
      lambda x, y: 0.5 * jnp.sum((_stopped_model(x, False) - y) ** 2)))
  with warnings.catch_warnings():
    warnings.simplefilter("error", gram_haiku.UntrackedParameterWarning)
    params, state = f.init(jax.random.PRNGKey(0), x, y)
    fn = gram_haiku.value_grad_and_gram(f.apply)
    _, grads, grams = (jax.jit(fn) if jit else fn)(params, state, None, x, y)
  assert grams.complete, grams.untracked
  for name in ("scale/s", "~/temperature"):
    assert grams.coverage[name].rule == "frozen"
  np.testing.assert_array_equal(grads["scale"]["s"], 0.0)
  assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))
  # And the clipped sum (its completeness check reads the same coverage).
  f_ref = np.asarray(per_example_grads(g.apply, params, x, y), np.float64)
  norms = np.sqrt(np.sum(f_ref ** 2, axis=1))
  c_norm = float(np.median(norms))
  clip = gram_haiku.clipped_grad(f.apply, c_norm)
  clipped, _ = (jax.jit(clip) if jit else clip)(params, state, None, x, y)
  want = weighted_sum(f_ref, clip_reference(norms, c_norm), params)
  for got, ref in zip(jax.tree.leaves(clipped), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


@jax.custom_vjp
def _stopped_forward_passed_gradient(h):
  return jax.lax.stop_gradient(h)


_stopped_forward_passed_gradient.defvjp(
    lambda h: (jax.lax.stop_gradient(h), None), lambda _, g: (g,))


def test_untracked_read_through_a_custom_vjp_that_passes_the_gradient():
  # The forward stops the gradient, the custom rule passes it on: the
  # untracked parameter has a gradient, so it is reported.
  x, y = _data(7)
  def loss(x, y):
    with gram_haiku.track(untracked="error"):
      h = jnp.tanh(hk.Linear(6)(x))
      h = _stopped_forward_passed_gradient(Scale()(h))
      return 0.5 * jnp.sum((hk.Linear(3)(h) - y) ** 2)
  # (The examples cannot be followed through the custom_vjp: that is said
  # too, before the untracked parameter is reported.)
  with pytest.warns(gram_haiku.ExampleFlowWarning, match="custom_vjp_call"):
    _assert_reported(loss, x, y)


class _Delay(hk.RNNCore):
  """A two-step delay line whose initial state is learned (no Gram rule)."""

  def __call__(self, x, state):
    a, b = state
    return a, (b, x)

  def initial_state(self, batch_size):
    w = hk.get_parameter("init", [3], jnp.float32, init=jnp.ones)
    return (jnp.zeros((batch_size, 3)), jnp.broadcast_to(w, (batch_size, 3)))


def _rotate(c):
  return (c[1], c[2], c[0])


def _delayed(x, loop):
  # The parameter reaches the loss only after two steps of the loop's carry.
  h = hk.Linear(3)(x)
  if loop == "dynamic_unroll":
    delay = _Delay()
    ys, _ = hk.dynamic_unroll(delay, jnp.stack([h, h, h]),
                              delay.initial_state(x.shape[0]))
    return h + jnp.sum(ys, 0)
  w = hk.get_parameter("w", [3], jnp.float32, init=jnp.ones)
  carry = (h, h, jnp.broadcast_to(w, h.shape))
  if loop == "scan":
    carry = jax.lax.scan(lambda c, _: (_rotate(c), None), carry, None,
                         length=2)[0]
  else:
    carry = jax.lax.fori_loop(0, 2, lambda _, c: _rotate(c), carry)
  return carry[0]


@pytest.mark.parametrize("loop", ["dynamic_unroll", "scan", "fori_loop"])
def test_untracked_read_through_a_loop_carry_is_reported(loop):
  # A carry feeds the next step: the leaf is found after any number of steps.
  x, y = _data(8)
  x, y = x[:, 0], y[:, 0]
  def loss(x, y):
    with gram_haiku.track(untracked="error"):
      return 0.5 * jnp.sum((_delayed(x, loop) - y) ** 2)
  _assert_reported(loss, x, y, jit=True,
                   match="is read inside gram_haiku.track")


def test_untracked_reads_in_two_blocks_keep_the_strictest_policy():
  x, y = _data(9)
  def loss(x, y):
    scale = Scale()  # read in both blocks: the later "ignore" wins nothing
    for policy in ("error", "ignore"):
      with gram_haiku.track(untracked=policy):
        x = scale(hk.Linear(4)(x))
    return 0.5 * jnp.sum((hk.Linear(3)(x) - y) ** 2)
  _assert_reported(loss, x, y)


def test_untracked_parameter_only_compared_has_no_gradient():
  # A comparison's boolean carries no gradient: nothing to report.
  x, y = _data(10)
  def body(x, y):
    h = hk.Linear(4)(x)
    h = jnp.where(Scale()(h) > 0, h, -h)
    return 0.5 * jnp.sum((hk.Linear(3)(h) - y) ** 2)
  def loss(x, y):
    with gram_haiku.track(untracked="error"):
      return body(x, y)
  f = hk.transform_with_state(loss)
  g = hk.without_apply_rng(hk.transform(body))
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(
      params, state, None, x, y)
  assert grams.complete and grams.coverage["scale/s"].rule == "frozen"
  assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))


def test_untracked_read_also_with_a_gradient_is_still_reported():
  x, y = _data(6)
  def loss(x, y):
    with gram_haiku.track(untracked="error"):
      return 0.5 * jnp.sum((_stopped_model(x, True) - y) ** 2)
  _assert_reported(loss, x, y)


def test_bad_untracked_policy():
  with pytest.raises(ValueError, match="untracked"):
    gram_haiku.track(untracked="loud")


def _tied_lm(use_unembed):
  def model(ids):
    embed = hk.Embed(11, 6)
    h = jnp.tanh(hk.Linear(6)(embed(ids)))
    if use_unembed:
      return gram_haiku.unembed(embed, h)
    return h @ embed.embeddings.T
  return model


def test_tied_embedding_raw_matmul_adds_up():
  # The embedding read by its tracked lookup and again by a raw matmul
  # (outside its layer): the matmul is a program-level site, whose
  # per-example gradients are added to the lookup's; the Gram is the one
  # gram_haiku.unembed gives.
  ids = problems.randint(jax.random.PRNGKey(5), (4, 3), 0, 11)
  def loss(ids, use_unembed):
    with gram_haiku.track(untracked="error"):
      return jnp.sum(jnp.tanh(_tied_lm(use_unembed)(ids)) ** 2)
  grams = []
  for use_unembed in (False, True):
    f = hk.transform_with_state(functools.partial(loss,
                                                  use_unembed=use_unembed))
    params, state = f.init(jax.random.PRNGKey(0), ids)
    grams.append(jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, ids)[2])
  assert grams[0].complete
  assert grams[0].coverage["embed/embeddings"].rule == (
      "embed + program: dot_general")
  plain = hk.without_apply_rng(hk.transform(
      lambda ids: jnp.sum(jnp.tanh(_tied_lm(False)(ids)) ** 2)))
  assert_gram_close(grams[0].total, reference_gram(plain.apply, params, ids))
  np.testing.assert_allclose(grams[0].by_layer["embed"],
                             grams[1].by_layer["embed"], rtol=1e-4)


@pytest.mark.parametrize("jit", [False, True])
def test_tied_embedding_with_unembed(jit):
  ids = problems.randint(jax.random.PRNGKey(6), (4, 5), 0, 11)
  ids = ids.at[0, 1].set(ids[0, 0])  # a repeated id within an example
  targets = problems.normal(jax.random.PRNGKey(7), (4, 5, 11))
  def loss(ids, y):
    with gram_haiku.track(untracked="error"):
      return 0.5 * jnp.sum((_tied_lm(True)(ids) - y) ** 2)
  def plain(p, ids, y):
    out = hk.without_apply_rng(hk.transform(_tied_lm(True))).apply(p, ids)
    return 0.5 * jnp.sum((out - y) ** 2)
  f = hk.transform_with_state(loss)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), ids, targets)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  if jit:
    fn = jax.jit(fn)
  value, grads, grams = fn(params, state, None, ids, targets)
  assert grams.complete
  assert_gram_close(grams.total, reference_gram(plain, params, ids, targets))
  np.testing.assert_allclose(value, plain(params, ids, targets), rtol=1e-5)
  np.testing.assert_allclose(grads["embed"]["embeddings"],
                             jax.jit(jax.grad(plain))(params, ids, targets)[
                                 "embed"]["embeddings"], rtol=1e-4, atol=1e-5)


def test_gru_dynamic_and_static_unroll():
  x, y = _data(6, b=4, t=5, d=3, out=6)
  for run in (hk.dynamic_unroll, hk.static_unroll):
    def model(x, run=run):
      core = hk.GRU(6)
      out, _ = run(core, jnp.swapaxes(x, 0, 1), core.initial_state(x.shape[0]))
      return jnp.swapaxes(out, 0, 1)
    def tracked(x, y, model=model):
      with gram_haiku.track(untracked="error"):
        return 0.5 * jnp.sum((model(x) - y) ** 2)
    def plain(p, x, y, model=model):
      return 0.5 * jnp.sum((hk.without_apply_rng(hk.transform(model)).apply(
          p, x) - y) ** 2)
    f = hk.transform_with_state(tracked)
    params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
    value, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, x, y)
    assert grams.complete
    assert_gram_close(grams.total, reference_gram(plain, params, x, y))
    np.testing.assert_allclose(value, plain(params, x, y), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                         atol=1e-5),
                 grads, jax.jit(jax.grad(plain))(params, x, y))


# -- parameters used outside every track() block -----------------------------


def _outside_data(seed=30):
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  return problems.normal(kx, (4, 5)), problems.normal(ky, (4, 3))


def test_module_outside_every_track_block_is_read_from_the_program():
  x, y = _outside_data()
  def loss_fn(x, y, remat):
    with gram_haiku.track():
      h = hk.nets.MLP([8])(x)
    head = hk.Linear(3, name="head")
    out = (hk.remat(head) if remat else head)(jnp.tanh(h))  # outside
    return 0.5 * jnp.sum((out - y) ** 2)
  f = hk.transform_with_state(functools.partial(loss_fn, remat=False))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  # Its bias, broadcast along the examples, and its weight, in a matmul,
  # are covered by the program-level rules; the module type stays the
  # reader's.
  assert grams.complete
  assert grams.coverage["head/b"].rule == "program: broadcast"
  assert grams.coverage["head/w"].rule == "program: dot_general"
  assert grams.coverage["head/w"].module_type == "(outside track())"
  # Inside a checkpoint (hk.remat), by the same rules, followed inside:
  # the same Gram.
  g = hk.transform_with_state(functools.partial(loss_fn, remat=True))
  _, _, remat_grams = jax.jit(gram_haiku.value_grad_and_gram(g.apply))(
      params, state, None, x, y)
  assert remat_grams.complete
  assert remat_grams.coverage["head/w"].rule == "program: dot_general"
  assert remat_grams.coverage["head/w"].module_type == "(outside track())"
  np.testing.assert_allclose(remat_grams.total, grams.total, rtol=1e-6,
                             atol=1e-6 * float(np.abs(grams.total).max()))


def _used_again_after_block(x, y, track=gram_haiku.track):
  with track():
    lin = hk.Linear(3)
    h = jnp.tanh(lin(x[:, :3]))
  return 0.5 * jnp.sum((lin(h) - y) ** 2)


def _used_first_outside(x, y, track=gram_haiku.track):
  lin = hk.Linear(3)
  h = jnp.tanh(lin(x[:, :3]))
  with track():
    return 0.5 * jnp.sum((lin(h) - y) ** 2)


def _tied_read_after_block(x, y, track=gram_haiku.track):
  ids = jnp.argmax(x, axis=-1) % 7
  with track():
    embed = hk.Embed(7, 3)
    h = jnp.tanh(embed(ids))
  return 0.5 * jnp.sum(((h @ embed.embeddings.T)[:, :3] - y) ** 2)


def _vmapped_and_outside(x, y, track=gram_haiku.track):
  lin = hk.Linear(3)
  with track():
    a = hk.vmap(lambda xi: lin(xi[:3]), split_rng=False)(x)
  return 0.5 * jnp.sum((a + lin(x[:, 1:4]) - y) ** 2)


def _unused_output_weight_read_directly(x, y):
  # The tracked application's output is discarded: only the direct read
  # reaches the loss.
  with gram_haiku.track():
    lin, other = hk.Linear(3), hk.Linear(3, name="other")
    h = lin(x[:, :3])
    other(x[:, :3])
  w = other.params_dict()["other/w"]
  return 0.5 * jnp.sum((h + x[:, :3] @ w - y) ** 2)


def _tied_read_with_embedding_stopped(x, y, track=gram_haiku.track):
  # The lookup's output under stop_gradient: the tracked lookup gives the
  # table no gradient, the tied read (whose data is the stopped rows, the
  # examples' own values) all of it, as a program-level site.
  ids = jnp.argmax(x, axis=-1) % 7
  with track():
    embed = hk.Embed(7, 3)
    h = jax.lax.stop_gradient(embed(ids))
  return 0.5 * jnp.sum(((h @ embed.embeddings.T)[:, :3] - y) ** 2)


@pytest.mark.parametrize("body", [_used_again_after_block, _used_first_outside,
                                  _tied_read_after_block,
                                  _tied_read_with_embedding_stopped,
                                  _vmapped_and_outside],
                         ids=lambda f: f.__name__)
def test_tracked_parameter_also_used_outside_adds_up(body):
  """Also used outside every track() block (a module called again, a tied
  read of its table): program-level rules cover the outside use, and its
  per-example gradients are added to the layer's."""
  x, y = _outside_data(31)
  f = hk.transform_with_state(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  _, _, grams = jax.jit(fn)(params, state, None, x, y)
  assert grams.complete
  plain = hk.without_apply_rng(hk.transform(
      functools.partial(body, track=contextlib.nullcontext)))
  assert_gram_close(grams.total, reference_gram(plain.apply, params, x, y))


@pytest.mark.parametrize("body", [_unused_output_weight_read_directly],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("jit", [False, True])
def test_tracked_parameter_also_used_outside_is_an_error(body, jit):
  x, y = _outside_data(31)
  f = hk.transform_with_state(body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  fn = jax.jit(fn) if jit else fn
  with pytest.raises(ValueError, match="outside every tracked layer"):
    fn(params, state, None, x, y)


@pytest.mark.parametrize("use", [
    lambda w: jnp.mean((w > 0).astype(jnp.float32)),
    lambda w: jnp.argmax(w.reshape(-1)).astype(jnp.float32) / w.size,
    lambda w: jnp.all(jnp.isfinite(w)).astype(jnp.float32),
], ids=["compared", "argmax", "isfinite"])
@pytest.mark.parametrize("jit", [False, True])
def test_tracked_parameter_read_outside_without_a_gradient_is_exact(use, jit):
  # Outside its layer the weight is only compared or indexed: no gradient
  # flows back through that use, so the Gram misses nothing.
  x, y = _outside_data(33)

  def body(x, y, tracked):
    lin = hk.Linear(3)
    if tracked:
      with gram_haiku.track():
        h = lin(x[:, :3])
    else:
      h = lin(x[:, :3])
    return 0.5 * jnp.sum((h * (1. + use(lin.params_dict()["linear/w"]))
                          - y) ** 2)
  f = hk.transform_with_state(lambda x, y: body(x, y, True))
  g = hk.without_apply_rng(hk.transform(lambda x, y: body(x, y, False)))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  fn = gram_haiku.value_grad_and_gram(f.apply)
  fn = jax.jit(fn) if jit else fn
  _, _, grams = fn(params, state, None, x, y)
  assert grams.complete
  assert_gram_close(grams.total, reference_gram(g.apply, params, x, y))


def test_untracked_use_in_aux_only_is_not_an_error():
  # A weight norm reported as aux does not reach the loss: no error.
  x, y = _outside_data(32)
  def loss_fn(x, y):
    with gram_haiku.track():
      lin = hk.Linear(3)
      out = lin(x)
    w = lin.params_dict()["linear/w"]
    return 0.5 * jnp.sum((out - y) ** 2), jnp.sum(w ** 2)
  f = hk.transform_with_state(loss_fn)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  (_, aux), _, grams = gram_haiku.value_grad_and_gram(
      f.apply, has_aux=True)(params, state, None, x, y)
  assert grams.complete and aux.shape == ()


def test_tracked_layer_and_batch_statistic_in_aux_only():
  # What only the aux output depends on is not part of the differentiated
  # program: a batch statistic fed to a tracked layer there is no error,
  # and the loss's Gram is exact.
  x, y = _outside_data(33)
  def body(x, y, tracked):
    lin = hk.Linear(3)
    h = lin(x)
    metric = hk.Linear(2, name="metric")(h - h.mean(0)).sum()
    return 0.5 * jnp.sum((h - y) ** 2), metric
  def tracked(x, y):
    with gram_haiku.track():
      return body(x, y, True)
  f = hk.transform_with_state(tracked)
  g = hk.without_apply_rng(hk.transform(lambda x, y: body(x, y, False)[0]))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  (_, aux), _, grams = jax.jit(gram_haiku.value_grad_and_gram(
      f.apply, has_aux=True))(params, state, None, x, y)
  assert aux.shape == ()
  assert_gram_close(grams.by_layer["linear"],
                    reference_gram(g.apply, params, x, y))


def test_a_bare_parameter_in_a_layer_stack_says_to_use_a_tracked_layer():
  """A bare ``hk.get_parameter`` in an ``hk.layer_stack`` body is a stacked
  parameter sliced per step, which the program-level rules do not follow:
  the refusal says so and names the fix (a tracked layer), where it
  suggested ``untracked='error'`` to a model already under it."""
  def loss(x):
    with gram_haiku.track(untracked="error"):
      def body(h):
        s = hk.get_parameter("s", [3], init=jnp.ones)
        return jnp.tanh(hk.Linear(3)(h) * s)
      return jnp.sum(hk.layer_stack(2)(body)(x) ** 2)
  f = hk.transform_with_state(loss)
  x = jnp.ones((4, 3))
  params, state = f.init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match=r"(?s)'~/s'.*hk\.layer_stack.*"
                     r"read it through a tracked layer"):
    gram_haiku.value_grad_and_gram(f.apply)(params, state, None, x)
