"""Program-level Gram rules inside calls, branches and loops
(``program_rules.CALL_RULES``): a bare parameter used inside
``jax.checkpoint``, a ``lax.cond``/``lax.switch`` chosen without the
examples, or a ``lax.scan`` body (an RNN cell of bare weights; Haiku's
``hk.dynamic_unroll``), through ``gram_haiku.functional``: exact against
``F @ F.T`` of ``vmap(grad)`` in float64 and against the reference clipped
sums; what cannot be proven per example is refused with the primitive and
the user's line."""

import warnings

import haiku as hk
import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

import gram_haiku
from gram_haiku import functional as gf
from gram_haiku import testing
from gram_haiku._src.analysis import program_rules
from gram_haiku._src.compat import hijax_compat as hx
from tests import problems

B, T, D, H = 3, 4, 2, 5


def _params(dtype, keys=("wx", "wh", "b", "g", "out")):
  """The weights named ``keys`` (each model's own: a parameter it does not
  use would be a term of no example)."""
  rng = np.random.default_rng(7)
  return {k: v for k, v in {"wx": jnp.asarray(rng.standard_normal((D, H)), dtype),
          "wh": jnp.asarray(0.5 * rng.standard_normal((H, H)), dtype),
          "b": jnp.asarray(rng.standard_normal(H), dtype),
          "g": jnp.asarray(rng.standard_normal(H), dtype),
          "out": jnp.asarray(rng.standard_normal(H), dtype)}.items()
          if k in keys}


def _batch(dtype, seed=0):
  """``x: [B, T, D]`` with one example 1e3 times the others (huge inputs
  next to small ones) and ``y: [B]``."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((B, T, D))
  x[1] *= 1e3
  return (jnp.asarray(x, dtype),
          jnp.asarray(rng.standard_normal(B), dtype))


@jax.custom_jvp
def _softsign(a):
  return a / (1 + jnp.abs(a))


_softsign.defjvp(lambda primals, tangents: (
    _softsign(primals[0]), tangents[0] / (1 + jnp.abs(primals[0])) ** 2))


def _in_checkpoint(p, x, y):
  """A bare weight and gate inside ``jax.checkpoint``, with custom_jvp
  activations (``jax.nn.relu``, a user's) of the data and exact GELU."""
  def block(a):
    h = a @ p["wx"] + p["b"]
    return (jax.nn.relu(h) + jax.nn.gelu(h * p["g"], approximate=False) +
            _softsign(h))
  h = jax.checkpoint(block)(x[:, 0] / 1e2)
  return jnp.sum((h @ p["out"] - y) ** 2)


def _in_cond(p, x, y):
  """``lax.cond`` on the parameters and ``lax.switch`` on a constant, the
  bare weights used in the branches (in a ``jit`` call in one); then a
  ``lax.cond`` per example (``jax.vmap``: a ``select_n`` of both branches,
  one of which is dead for the loss)."""
  a = x[:, 0] / 1e2
  h = lax.cond(jnp.sum(p["g"]) > 0,
               lambda a: jnp.tanh(a @ p["wx"] + p["b"]),
               lambda a: jax.jit(lambda a: a @ p["wx"] * p["g"])(a), a)
  h = lax.switch(jnp.int32(1), [lambda h: h * p["b"],
                                lambda h: jnp.tanh(h @ p["wh"])], h)
  h = jax.vmap(lambda hi, ai: lax.cond(
      jnp.sum(ai) > 0, lambda h: jnp.tanh(h @ p["wh"]),
      lambda h: h * p["g"], hi))(h, a)
  return jnp.sum((h @ p["out"] - y) ** 2)


def _rnn(p, x, y, remat=False):
  """An RNN cell of bare weights scanned over time (examples on axis 0 of
  the carry), unrolled by 2, the cell checkpointed where ``remat``."""
  def cell(h, xt):
    h = jnp.tanh(xt / 1e2 @ p["wx"] + h @ p["wh"] + p["b"])
    return h, h * p["g"]
  if remat:
    cell = jax.checkpoint(cell)
  h, hs = lax.scan(cell, jnp.zeros((x.shape[0], H), x.dtype),
                   jnp.swapaxes(x, 0, 1), unroll=2)
  return jnp.sum((h @ p["out"] - y) ** 2) + jnp.sum(jnp.tanh(hs) ** 2)


class _BareCell(hk.RNNCore):
  """An Elman cell of bare ``hk.get_parameter`` weights."""

  def __call__(self, xt, h):
    init = hk.initializers.RandomNormal()
    wx = hk.get_parameter("wx", [D, H], xt.dtype, init)
    wh = hk.get_parameter("wh", [H, H], xt.dtype, init)
    b = hk.get_parameter("b", [H], xt.dtype, init)
    h = jnp.tanh(xt @ wx + h @ wh + b)
    return h, h

  def initial_state(self, batch_size):
    return jnp.zeros((batch_size, H))


def _haiku_unroll(x, y):
  hs, _ = hk.dynamic_unroll(_BareCell(name="cell"),
                            jnp.swapaxes(x / 1e2, 0, 1),
                            jnp.zeros((x.shape[0], H), x.dtype))
  w = hk.get_parameter("out", [H], x.dtype, hk.initializers.RandomNormal())
  return jnp.sum((hs[-1] @ w - y) ** 2)


_UNROLL = hk.without_apply_rng(hk.transform(_haiku_unroll))


def _unroll_loss(p, x, y):
  return _UNROLL.apply(p, x, y)


def _cond_on_a_step_counter(p, x, y):
  """A ``lax.cond`` on a step counter carried by the scan (the same branch
  for every example, a different one from step to step) and a
  ``lax.switch`` on a scanned index."""
  def cell(c, a):
    h, t = c
    xt, k = a
    xt = xt / 1e2
    h = lax.cond(t % 2 == 0, lambda h: jnp.tanh(h @ p["wh"] + xt @ p["wx"]),
                 lambda h: h * p["b"] + xt @ p["wx"], h)
    h = lax.switch(k, [lambda h: h, lambda h: jnp.sin(h) * p["g"],
                       lambda h: jnp.tanh(h @ p["wh"])], h)
    return (h, t + 1), None
  (h, _), _ = lax.scan(cell, (jnp.zeros((x.shape[0], H), x.dtype), 0),
                       (jnp.swapaxes(x, 0, 1), jnp.array([2, 0, 1, 2])))
  return jnp.sum((h @ p["out"] - y) ** 2)


def _value_out_of_checkpoint(p, x, y):
  """A checkpointed block that returns, next to its value of the data, a
  value of the parameters alone (``wh * g``), which meets the data after
  the block (the prefix computed without the block's data operand)."""
  def block(a, wx, wh, g):
    return jnp.tanh(a @ wx + p["b"]), wh * g
  h, w2 = jax.checkpoint(block)(x[:, 0] / 1e2, p["wx"], p["wh"], p["g"])
  return jnp.sum((jnp.tanh(h @ w2) @ p["out"] - y) ** 2)


def _setup(name, dtype):
  x, y = _batch(dtype)
  if name == "hk_dynamic_unroll":
    params = _UNROLL.init(jax.random.PRNGKey(0), x, y)
    return _unroll_loss, jax.tree.map(lambda a: a.astype(dtype), params), (
        x, y)
  loss = {"checkpoint": _in_checkpoint, "cond": _in_cond, "scan": _rnn,
          "cond_on_a_step_counter": _cond_on_a_step_counter,
          "value_out_of_checkpoint": _value_out_of_checkpoint,
          "scan_of_checkpoint": lambda p, x, y: _rnn(p, x, y, True)}[name]
  keys = {"checkpoint": ("wx", "b", "g", "out")}.get(
      name, ("wx", "wh", "b", "g", "out"))
  return loss, _params(dtype, keys), (x, y)


# (The default budget runs the first, conftest.py; the thorough env all.)
CASES = ["checkpoint", "scan_of_checkpoint", "cond", "hk_dynamic_unroll",
         "scan"]


def _close(got, want, rtol):
  top = max(float(np.abs(w).max()) for w in jax.tree.leaves(want))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      a, b, rtol=rtol, atol=rtol * top), got, want)


@pytest.mark.parametrize("name", CASES)
def test_sites_inside_calls_are_the_reference(name):
  """The Gram, the gradient and the all-layer clipped sum (some examples
  clipped, some not) against float64 ``vmap(grad)``."""
  with jax.enable_x64(True):
    loss, params, batch = _setup(name, jnp.float64)
    _, grads, grams = jax.jit(gf.value_grad_and_gram(loss))(params, *batch)
    assert grams.complete
    assert all(c.rule.startswith("program:")
               for c in grams.coverage.values())
    f = np.asarray(testing.per_example_grads(loss, params, *batch))
    testing.assert_gram_close(grams.total, f @ f.T, "float64")
    _close(grads, testing.weighted_sum(f, np.ones(B), params), 1e-10)
    norms = np.linalg.norm(f, axis=1)
    c = float(np.median(norms))
    got = jax.jit(gf.clipped_grad(loss, l2_clip_norm=c))(params, *batch)
    _close(got, testing.weighted_sum(f, testing.clip_reference(norms, c),
                                     params), 1e-9)


def test_a_cond_on_a_step_counter_is_the_reference():
  """A ``cond`` in a loop body on a carried step counter (and a ``switch``
  on a scanned index) is chosen without the examples (it was refused, the
  body's carries and scanned inputs all taken for the examples' values)."""
  test_sites_inside_calls_are_the_reference("cond_on_a_step_counter")


def test_a_parameters_value_returned_by_a_checkpoint_is_the_reference():
  """A value of the parameters alone that a ``jax.checkpoint`` returns
  with one of the data is computed from the checkpoint's body without the
  data, as from a ``jit`` call's (it was an internal error: the whole
  checkpoint, data operand included, taken as the prefix)."""
  test_sites_inside_calls_are_the_reference("value_out_of_checkpoint")


def test_a_chain_of_carries_reaches_its_fixed_point():
  """Carries that the examples reach one step of a chain at a time (zero
  initial states, each fed by the previous one): a step counter's state
  turns into the examples' one carry per round of the fixed point."""
  def loss(p, x, y):
    def cell(c, xt):
      h1, h2, h3, h4 = c
      return (jnp.tanh(xt @ p["wx"]), jnp.tanh(h1), jnp.tanh(h2),
              jnp.tanh(h3)), None
    z = jnp.zeros((x.shape[0], H), x.dtype)
    c, _ = lax.scan(cell, (z,) * 4, jnp.swapaxes(x / 1e2, 0, 1))
    return jnp.sum((c[3] @ p["out"] - y) ** 2)
  with jax.enable_x64(True):
    params, batch = _params(jnp.float64, ("wx", "out")), _batch(jnp.float64)
    _, _, grams = jax.jit(gf.value_grad_and_gram(loss))(params, *batch)
    f = np.asarray(testing.per_example_grads(loss, params, *batch))
    testing.assert_gram_close(grams.total, f @ f.T, "float64")


def test_scan_per_layer_clipping_is_the_reference():
  """Per-layer clipping of the RNN (each leaf its own threshold) against
  the float64 reference."""
  with jax.enable_x64(True):
    params, batch = _params(jnp.float64), _batch(jnp.float64, seed=3)
    f = np.asarray(testing.per_example_grads(_rnn, params, *batch))
    names = sorted(params)  # (leaf order)
    sizes = [int(np.size(params[n])) for n in names]
    cols = dict(zip(names, np.split(np.arange(f.shape[1]),
                                    np.cumsum(sizes)[:-1])))
    thresholds = {n: 0.5 * float(np.median(np.linalg.norm(f[:, c], axis=1)))
                  for n, c in cols.items()}
    got = jax.jit(gf.clipped_grad(_rnn, l2_clip_norm=thresholds,
                                  clipping="per-layer"))(params, *batch)
    total = np.zeros(f.shape[1])
    for n, c in cols.items():
      total[c] = testing.clip_reference(np.linalg.norm(f[:, c], axis=1),
                                        thresholds[n]) @ f[:, c]
    _close(got, testing.weighted_sum(np.eye(f.shape[1]), total, params),
           1e-9)


@pytest.mark.parametrize("use", ["matmul", "broadcast"])
def test_clip_norms_of_sites_in_a_loop_bound_the_float64_norm(use):
  """The norm a clip factor comes from is not below the float64 norm where
  each example's gradient of a bare weight used in a ``scan`` body is a
  float32 sum over the steps that cancels (inputs offset by +-1e4 at
  alternate steps): the bound covers the loop's sum of the steps' parts
  (``n + T - 1`` terms of ``sum_t |x_t| |d_t|``; at a broadcast site
  ``sum_t |d_t|``, tapped by ``hx.abs_tap``: without it the broadcast
  case's bound is below the float64 norm)."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((6, 32, 3)).astype(np.float32)
  x[:, ::2] += 1e4
  x[:, 1::2] -= 1e4
  x = jnp.asarray(x)
  shape = (3, 5) if use == "matmul" else (3,)
  params = {"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)}

  def loss(p, x):
    def step(c, xt):
      h = xt @ p["w"] if use == "matmul" else xt * p["w"]
      return c + h.sum(-1) * 1e-3, None
    c, _ = lax.scan(step, jnp.zeros(x.shape[:1], x.dtype),
                    jnp.swapaxes(x, 0, 1))
    return jnp.sum(c)
  problems.assert_clip_norms_bound(loss, params, x)


def test_a_cond_and_a_checkpoint_under_a_mesh_are_the_reference():
  """``mesh=`` (one device: the shard_map's varying types are the same):
  the cond and the checkpoint holding sites are traced again, from Python,
  for values that vary over the mesh (a recorded call would not take
  them)."""
  def loss(p, x, y):
    h = lax.cond(jnp.sum(p["g"]) > 0,
                 lambda a: jnp.tanh(a @ p["wx"] + p["b"]),
                 lambda a: a @ p["wx"] * p["g"], x[:, 0] / 1e2)
    h = jax.checkpoint(lambda h: jnp.tanh(h * p["g"] + p["b"]))(h)
    return jnp.sum((h @ p["out"] - y) ** 2)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  params = _params(jnp.float32, ("wx", "b", "g", "out"))
  batch = _batch(jnp.float32)
  _, _, grams = jax.jit(gf.value_grad_and_gram(loss, mesh=mesh))(params,
                                                                 *batch)
  f = np.asarray(testing.per_example_grads(loss, params, *batch), np.float64)
  testing.assert_gram_close(grams.total, f @ f.T, "float32")
  norms = np.linalg.norm(f, axis=1)
  c = float(np.median(norms))
  got = jax.jit(gf.clipped_grad(loss, mesh=mesh, l2_clip_norm=c))(params,
                                                                  *batch)
  _close(got, testing.weighted_sum(f, testing.clip_reference(norms, c),
                                   params), 1e-4)


def _while_net(p, x, y):
  h = lax.while_loop(lambda c: c[0] < 3,
                     lambda c: (c[0] + 1, jnp.tanh(c[1] @ p["wh"])),
                     (0, x[:, 0] @ p["wx"]))[1]
  return jnp.sum((h @ p["out"] - y) ** 2)


def _cond_on_data_net(p, x, y):
  h = lax.cond(jnp.sum(x) > 0, lambda a: a @ p["wx"],
               lambda a: -(a @ p["wx"]), x[:, 0])
  return jnp.sum((h @ p["out"] - y) ** 2)


@jax.custom_jvp
def _straight_through(a, w):
  return jnp.round(a @ w)


_straight_through.defjvp(lambda primals, tangents: (
    _straight_through(*primals),
    tangents[0] @ primals[1] + primals[0] @ tangents[1]))


def _custom_of_weight_net(p, x, y):
  h = _straight_through(x[:, 0], p["wx"])
  return jnp.sum((h @ p["out"] - y) ** 2)


def _learned_initial_state_net(p, x, y):
  h0 = jnp.broadcast_to(p["b"], (x.shape[0], H))
  h, _ = lax.scan(lambda h, xt: (jnp.tanh(xt @ p["wx"] + h @ p["wh"]), None),
                  h0, jnp.swapaxes(x, 0, 1))
  return jnp.sum((h @ p["out"] - y) ** 2)


def _examples_summed_in_a_carry_net(p, x, y):
  """A scan over the examples (one per step) that sums them in its carry
  before a nonlinearity: no example's gradient of its own."""
  c, _ = lax.scan(lambda c, xi: (c + xi[0] @ p["wx"], None), jnp.zeros(H),
                  x)
  return jnp.sum(jnp.tanh(c)) + 0.0 * jnp.sum(y)


def _cond_on_one_examples_carry_net(p, x, y):
  """A ``lax.cond`` in a scan on a carry that example 1's data feeds (a step
  counter to the rule, but not example-independent)."""
  def cell(c, xt):
    h, t = c
    h = lax.cond(t > 0.5, lambda h: jnp.tanh(h @ p["wh"] + xt @ p["wx"]),
                 lambda h: h + xt @ p["wx"], h)
    return (h, t * 0 + xt[1, 0]), None
  (h, _), _ = lax.scan(cell, (jnp.zeros((x.shape[0], H), x.dtype), 0.0),
                       jnp.swapaxes(x, 0, 1))
  return jnp.sum((h @ p["out"] - y) ** 2)


def _cond_on_stopped_data_net(p, x, y):
  """A ``lax.cond`` on one example's data under ``stop_gradient`` (taken for
  a constant: the Gram of the batch's branch, no refusal)."""
  h = lax.cond(lax.stop_gradient(x)[0, 0, 0] > 0, lambda a: a @ p["wx"],
               lambda a: -(a @ p["wx"]), x[:, 0])
  return jnp.sum((h @ p["out"] - y) ** 2)


def _stopped_batch_mean_net(p, x, y):
  """A bare weight times a batch mean under ``stop_gradient`` (taken for a
  prefix value: an internal AssertionError in the pass)."""
  h = x[:, 0] @ p["wx"] - lax.stop_gradient(x[:, 0].mean(0)) @ p["wx"]
  return jnp.sum((jnp.tanh(h) @ p["out"] - y) ** 2)


@pytest.mark.parametrize("net, keys, primitive, why", [
    (_while_net, ("wx", "wh", "out"), "while", "while_loop"),
    (_cond_on_data_net, ("wx", "out"), "cond",
     "chosen from the examples' values"),
    (_custom_of_weight_net, ("wx", "out"), "custom_jvp_call",
     "custom derivative"),
    (_learned_initial_state_net, ("wx", "wh", "b", "out"), "scan",
     "loop carry or a scanned input"),
    (_examples_summed_in_a_carry_net, ("wx",), "dot_general",
     "hold no examples' axis"),
    (_cond_on_one_examples_carry_net, ("wx", "wh", "out"), "cond",
     "chosen from the examples' values"),
    (_cond_on_stopped_data_net, ("wx", "out"), "cond",
     "chosen from the examples' values"),
    (_stopped_batch_mean_net, ("wx", "out"), "dot_general",
     "hold no examples' axis"),
], ids=["while_loop", "cond_on_the_data", "custom_jvp_of_the_weight",
        "learned_initial_state", "examples_summed_in_a_carry",
        "cond_on_one_examples_carry", "cond_on_stopped_data",
        "stopped_batch_mean"])
def test_what_cannot_be_proven_is_refused_at_the_users_line(net, keys,
                                                            primitive, why):
  params, batch = _params(jnp.float32, keys), _batch(jnp.float32)
  with pytest.raises(ValueError, match="No program-level rule") as e:
    gf.value_grad_and_gram(net)(params, *batch)
  assert f"`{primitive}`" in str(e.value)
  assert why in str(e.value)
  assert "test_program_rules_calls.py:" in str(e.value)
  # (Clipping may refuse first for another reason: a branch chosen from
  # several examples' data is other examples' data for each.)
  with pytest.raises(ValueError, match="test_program_rules_calls.py:"):
    gf.clipped_grad(net, l2_clip_norm=1.0)(params, *batch)


def _eqn_of(name):
  """An equation of the primitive that ``name``'s model uses."""
  loss, params, batch = _setup(name, jnp.float32)
  prim = {"checkpoint": hx.REMAT_NAMES, "cond": ("cond",),
          "scan": ("scan",)}[name]
  jaxpr = jax.make_jaxpr(loss)(params, *batch).jaxpr
  return next(e for e in jaxpr.eqns if e.primitive.name in prim)


@pytest.mark.parametrize("name", ["checkpoint", "cond", "scan"])
def test_without_its_call_rule_the_model_is_refused(monkeypatch, name):
  """Mutation: each rule of ``CALL_RULES`` is what covers its model."""
  eqn = _eqn_of(name)
  for key in list(program_rules.CALL_RULES):
    if getattr(key, "name", key) == eqn.primitive.name:
      monkeypatch.delitem(program_rules.CALL_RULES, key)
  assert hx.rule_of(program_rules.CALL_RULES, eqn) is None
  loss, params, batch = _setup(name, jnp.float32)
  with pytest.raises(ValueError, match="No program-level rule covers its "
                     f"use by `{eqn.primitive.name}`"):
    gf.value_grad_and_gram(loss)(params, *batch)


def _bare_hk_scan(x, y):
  """``hk.scan`` of a cell whose weights are all bare ``hk.get_parameter``
  inside ``track()`` (read in the body), no tracked layer: no probe."""
  init = hk.initializers.RandomNormal()
  with gram_haiku.track():
    def cell(h, xt):
      w = hk.get_parameter("w", [D, H], x.dtype, init)
      b = hk.get_parameter("b", [H], x.dtype, init)
      return jnp.tanh(xt @ w + h * b), None
    h, _ = hk.scan(cell, jnp.zeros((x.shape[0], H), x.dtype),
                   jnp.swapaxes(x / 1e2, 0, 1))
    o = hk.get_parameter("o", [H], x.dtype, init)
    return jnp.sum((h @ o - y) ** 2)


def test_clipped_grad_of_a_haiku_model_with_bare_parameters_only():
  """``clipped_grad(f.apply)`` of a Haiku model with no probe (its state
  ``{}``): ``f.apply``'s ``(loss, {})`` is the loss and its new state (it
  was taken for a loss that is a tuple), against the float64 reference."""
  with jax.enable_x64(True):
    f = hk.transform_with_state(_bare_hk_scan)
    x, y = _batch(jnp.float64)
    params, state = f.init(jax.random.PRNGKey(0), x, y)
    assert state == {}
    loss = lambda p, x, y: f.apply(p, state, None, x, y)[0]
    with warnings.catch_warnings():  # (the raw apply reports bare reads)
      warnings.simplefilter("ignore", gram_haiku.UntrackedParameterWarning)
      fr = np.asarray(testing.per_example_grads(loss, params, x, y))
    norms = np.linalg.norm(fr, axis=1)
    c = float(np.median(norms))
    got, aux = jax.jit(gram_haiku.clipped_grad(f.apply, c))(
        params, state, None, x, y)
    assert np.all(np.asarray(aux.grad_norms) >= norms * (1 - 1e-12))
    _close(got, testing.weighted_sum(fr, testing.clip_reference(norms, c),
                                     params), 1e-9)


def _named_rnn(p, x, y):
  """An RNN cell checkpointed with ``save_only_these_names``, its input
  product tagged by ``checkpoint_name`` (a ``name`` primitive)."""
  from jax.ad_checkpoint import checkpoint_name
  cell = jax.checkpoint(
      lambda h, xt: jnp.tanh(checkpoint_name(xt / 1e2 @ p["wx"], "x") +
                             h @ p["wh"]),
      policy=jax.checkpoint_policies.save_only_these_names("x"))
  h, _ = lax.scan(lambda h, xt: (cell(h, xt), None),
                  jnp.zeros((x.shape[0], H), x.dtype), jnp.swapaxes(x, 0, 1))
  return jnp.sum((h @ p["out"] - y) ** 2)


def test_checkpoint_name_in_a_scanned_checkpoint_is_the_reference():
  """``checkpoint_name`` is the identity to every domain (the example flow
  lost the examples there, and the weight after the loop was refused)."""
  with jax.enable_x64(True):
    params = _params(jnp.float64, ("wx", "wh", "out"))
    batch = _batch(jnp.float64)
    _, _, grams = jax.jit(gf.value_grad_and_gram(_named_rnn))(params, *batch)
    f = np.asarray(testing.per_example_grads(_named_rnn, params, *batch))
    testing.assert_gram_close(grams.total, f @ f.T, "float64")
    norms = np.linalg.norm(f, axis=1)
    c = float(np.median(norms))
    got = jax.jit(gf.clipped_grad(_named_rnn, l2_clip_norm=c))(params,
                                                               *batch)
    _close(got, testing.weighted_sum(f, testing.clip_reference(norms, c),
                                     params), 1e-9)


def test_a_loop_carry_refuses_only_the_carried_parameter():
  """A learned initial state (``z``, carried) with a weight the body closes
  over (``a``, named first): the refusal names ``z``, the carried one (it
  named ``a``, whose use in the body is covered, as "a loop carry or a
  scanned input")."""
  def net(p, x, y):
    h0 = jnp.broadcast_to(p["z"], (x.shape[0], H))
    h, _ = lax.scan(lambda h, xt: (jnp.tanh(xt @ p["a"] + h), None), h0,
                    jnp.swapaxes(x, 0, 1))
    return jnp.sum((h.sum(-1) - y) ** 2)
  rng = np.random.default_rng(0)
  params = {"a": jnp.asarray(rng.standard_normal((D, H)), jnp.float32),
            "z": jnp.asarray(rng.standard_normal(H), jnp.float32)}
  with pytest.raises(ValueError, match="No program-level rule") as e:
    gf.value_grad_and_gram(net)(params, *_batch(jnp.float32))
  assert "parameter 'z'" in str(e.value)
  assert "loop carry or a scanned input" in str(e.value)


def _carried_state_net(x, y):
  """A Haiku RNN of bare weights closed over by the body and a bare
  learned initial state ``z`` carried by the loop."""
  w = lambda n, s: hk.get_parameter(n, s, x.dtype,
                                    hk.initializers.RandomNormal())
  wx, wh, z = w("wx", [D, H]), w("wh", [H, H]), w("z", [H])
  h, _ = lax.scan(lambda h, xt: (jnp.tanh(xt @ wx + 0.5 * h @ wh), None),
                  jnp.broadcast_to(z, (x.shape[0], H)),
                  jnp.swapaxes(x / 1e2, 0, 1))
  return jnp.sum((h.sum(-1) - y) ** 2)


def test_the_constants_of_a_loop_with_a_carried_parameter_are_exact():
  """With ``track(untracked="ignore")`` the carried ``z`` is left out
  (``grams.complete`` False) and the weights the body closes over are
  covered, their Grams the float64 reference's (there was no Gram: the
  whole loop was refused)."""
  def loss(x, y):
    with gram_haiku.track(untracked="ignore"):
      return _carried_state_net(x, y)
  f = hk.transform_with_state(loss)
  with jax.enable_x64(True), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    x, y = _batch(jnp.float64)
    params, state = f.init(jax.random.PRNGKey(0), x, y)
    _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
        params, state, None, x, y)
    assert not grams.complete and sorted(grams.by_layer) == ["~/wh", "~/wx"]
    plain = hk.without_apply_rng(hk.transform(_carried_state_net))
    g = jax.vmap(jax.grad(lambda p, a, b: plain.apply(p, a[None], b[None])),
                 in_axes=(None, 0, 0))(params, x, y)
    for k in ("wh", "wx"):
      f_k = np.asarray(g["~"][k]).reshape(B, -1)
      testing.assert_gram_close(grams.by_layer[f"~/{k}"], f_k @ f_k.T,
                                "float64")
