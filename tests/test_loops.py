"""Modules applied at every step of a loop (``hk.dynamic_unroll``, ``hk.scan``,
Python loops): each application keeps its factors in a slot of a slotted
probe, and the Gram is formed once after the pass. Every case is checked
against the reference ``F @ F.T`` of the untracked model, and the path taken
(slots, or accumulated per-example gradients where the slots cannot
be counted) is asserted, so that a fallback is never silent either. The
programs are rows of the interpreter's corpus too
(``tests/interpreter_corpus.py``)."""

import re
import zlib

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.api import reweight
from gram_haiku._src.api import value_grad_and_gram as vgg
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import weighted_sum
from gram_haiku._src.ops import factors
from gram_haiku._src.passes import bookkeeping
from gram_haiku._src.passes import slots as slots_lib
from gram_haiku.conformance.plugin import thorough
from tests import problems

B, T, F, H = 5, 4, 3, 8


def _data(seed, shape=(B, T, F), out=2):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return problems.normal(k1, shape), problems.normal(k2, (shape[0], out))


def _sq(out, y):
  return 0.5 * jnp.sum((out - y) ** 2)


def _unrolled(core_fn, unroll="dynamic"):
  """``[B, T, F] -> [B, 2]``: a core unrolled over T, then a linear head."""
  def model(x):
    core = core_fn()
    state = core.initial_state(x.shape[0])
    xs = jnp.swapaxes(x, 0, 1)
    if unroll == "static":
      outs, _ = hk.static_unroll(core, xs, state)
    else:
      outs, _ = hk.dynamic_unroll(core, xs, state,
                                  reverse=unroll == "reverse")
    return hk.Linear(2, name="head")(jnp.tanh(outs[-1]))
  return model


def _tracked(model, x, y, mode="gram"):
  """``model``'s squared loss inside ``track()``: transform, params, state."""
  def tracked(x, y):
    with gram_haiku.track(mode=mode):
      return _sq(model(x), y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  return f, params, state


def _run(model, x, y, mode="gram", return_state=False):
  """Tracked pass against the reference ``F`` of the untracked model (its
  Gram, norms and column sum, the plain gradient); returns (grams, the slot
  counts chosen, new state or None, the initial state)."""
  f, params, state = _tracked(model, x, y, mode)
  g = hk.without_apply_rng(hk.transform(lambda x, y: _sq(model(x), y)))
  fn = jax.jit(gram_haiku.value_grad_and_gram(f.apply,
                                              return_state=return_state))
  value, grads, grams = fn(params, state, None, x, y)
  if return_state:
    value, new_state = value
  ref_f = np.asarray(jax.jit(lambda p: per_example_grads(g.apply, p, x, y))(
      params), np.float64)
  ref = ref_f @ ref_f.T
  if mode == "gram":
    assert_gram_close(grams.total, ref)
  np.testing.assert_allclose(grams.norms, np.sqrt(np.diag(ref)), rtol=1e-4)
  chex.assert_trees_all_close(
      grads, weighted_sum(ref_f, np.ones(len(ref)), params), rtol=1e-4,
      atol=1e-5 * np.abs(ref_f).max())
  t = vgg.trace_loss(f.apply, False, params, state, None, (x, y), {}, ())
  slots = slots_lib.slotted_modules(t.found, (), params)
  return grams, slots, (new_state if return_state else None), state


CORES = {
    "lstm": (lambda: hk.LSTM(H), {"lstm/linear": T}),
    "gru": (lambda: hk.GRU(H), {"gru": T}),
    # linear (input to hidden): T K = 4 * 11 > P = 32, the per-example
    # gradients are the smaller store; linear_1 (hidden to hidden): 4 * 16
    # < 72.
    "vanilla": (lambda: hk.VanillaRNN(H), {"vanilla_rnn/linear_1": T}),
}


def _core_cases():
  """Every core under every unroll nightly; by default each core under
  ``hk.dynamic_unroll``, plus a reversed scan (LSTM) and a Python loop of
  separate applications (GRU: a rule rebuilt per call)."""
  out = []
  for core in sorted(CORES):
    for unroll in ("dynamic", "static", "reverse"):
      if thorough() or unroll == "dynamic" or (core, unroll) in (
          ("lstm", "reverse"), ("gru", "static")):
        out.append(pytest.param(core, unroll, id=f"{core}-{unroll}"))
  return out


@pytest.mark.parametrize("core,unroll", _core_cases())
def test_cores_in_loops_match_reference(core, unroll):
  make, want = CORES[core]
  x, y = _data(zlib.crc32(f"{core}/{unroll}".encode()) % 1000)
  _, slots, _, _ = _run(_unrolled(make, unroll), x, y)
  assert slots == want


def test_norms_mode_uses_the_slots():
  x, y = _data(1)
  _, slots, _, _ = _run(_unrolled(CORES["lstm"][0]), x, y, mode="norms")
  assert slots == {"lstm/linear": T}


def test_x64_lstm():
  with jax.enable_x64(True):
    x, y = _data(2)
    x, y = x.astype(jnp.float64), y.astype(jnp.float64)
    grams, slots, _, _ = _run(_unrolled(CORES["lstm"][0]), x, y)
    assert grams.total.dtype == jnp.float64
    assert slots == {"lstm/linear": T}


def test_nested_scans_multiply_the_slots():
  # An outer hk.scan over 2 chunks of an inner dynamic unroll over T.
  x, y = _data(3, (B, 2, T, F))
  def model(x):
    core = hk.LSTM(H)
    def chunk(state, xc):  # xc: [B, T, F]
      outs, state = hk.dynamic_unroll(core, jnp.swapaxes(xc, 0, 1), state)
      return state, outs[-1]
    state, last = hk.scan(chunk, core.initial_state(x.shape[0]),
                          jnp.swapaxes(x, 0, 1))
    return hk.Linear(2, name="head")(last[-1] + state.hidden)
  _, slots, _, _ = _run(model, x, y)
  assert slots == {"lstm/linear": 2 * T}


def test_called_twice_same_and_different_shapes():
  x, y = _data(4, (B, H))
  def same(x):
    lin = hk.Linear(H, name="shared")
    return hk.Linear(2, name="head")(jnp.tanh(lin(jnp.tanh(lin(x)))))
  _, slots, _, _ = _run(same, x, y)
  assert slots == {"shared": 2}

  def different(x):  # [B, F] then [B, 2, F]: slots of two sizes
    lin = hk.Linear(H, name="shared")
    h = jnp.tanh(lin(x))
    h2 = jnp.tanh(lin(jnp.stack([h, x], axis=1))).sum(1)
    return hk.Linear(2, name="head")(h2)
  _, slots, _, _ = _run(different, x, y)
  assert slots == {}  # per-example gradients, still exact


def test_raw_lax_scan_body_falls_back():
  # A raw jax.lax.scan (not hk.scan) cannot carry Haiku state: no slots.
  x, y = _data(5)
  def model(x):
    lin = hk.Linear(H, name="cell")
    h0 = jnp.tanh(lin(jnp.zeros((x.shape[0], F + H))))  # creates w, b
    def step(h, xt):
      return jnp.tanh(lin(jnp.concatenate([xt, h], -1))), None
    h, _ = jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1))
    return hk.Linear(2, name="head")(h)
  _, slots, _, _ = _run(model, x, y)
  assert slots == {}


def test_cond_branch_falls_back():
  # How often a cond branch runs is not known from the program: no slots.
  x, y = _data(6, (B, H))
  def model(x):
    lin = hk.Linear(H, name="cell")
    h = jnp.tanh(lin(x))
    flag = jnp.ones((), jnp.float32) * x.shape[0] > 0  # not the examples
    h = hk.cond(flag, lambda h: jnp.tanh(lin(h)), lambda h: h, h)
    return hk.Linear(2, name="head")(h)
  _, slots, _, _ = _run(model, x, y)
  assert slots == {}


def test_per_example_core_under_hk_vmap():
  # Per-example code: the unroll over T runs under hk.vmap over the batch.
  x, y = _data(7)
  def one(xi):  # [T, F]
    core = hk.LSTM(H)
    outs, _ = hk.dynamic_unroll(core, xi, core.initial_state(None))
    return hk.Linear(2, name="head")(outs[-1])
  _, slots, _, _ = _run(hk.vmap(one, split_rng=False), x, y)
  assert slots == {"lstm/linear": T}


def test_returned_state_is_the_callers_and_can_be_fed_back():
  x, y = _data(8)
  model = _unrolled(CORES["lstm"][0])
  _, _, new_state, state = _run(model, x, y, return_state=True)
  chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)
  assert not any(slots_lib.SLOT_NAME in v for v in new_state.values())


def test_slot_count_mismatch_is_nan_not_a_partial_gram():
  # The guard behind the slots: a counter that did not reach the count read
  # from the program gives NaN, never a Gram missing applications.
  x, y = _data(9)
  model = _unrolled(CORES["lstm"][0])
  f, params, state = _tracked(model, x, y)
  t = vgg.trace_loss(f.apply, False, params, state, None, (x, y), {}, ())
  op = t.found.ops["lstm/linear"].in_mode("factors")
  leaves = jax.tree_util.tree_leaves(params)
  ps = bookkeeping.op_params(op, leaves, t.found.param_leaves["lstm/linear"])
  f_ = problems.normal(jax.random.PRNGKey(1), (T, B, factors.factor_width(op)))
  good = slots_lib.from_slots(op, f_, ps, "gram", jnp.int32(T), T)
  bad = slots_lib.from_slots(op, f_, ps, "gram", jnp.int32(T - 1), T)
  assert np.all(np.isfinite(good)) and np.all(np.isnan(bad))


def _loop_bodies(hlo: str) -> str:
  """The text of every computation a ``while`` body of ``hlo`` runs."""
  comps, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) ", line)
    if m and line.rstrip().endswith("{"):
      name = m.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  todo = re.findall(r"body=%?([\w.\-]+)", hlo)
  seen, out = set(), []
  while todo:
    c = todo.pop()
    if c in seen or c not in comps:
      continue
    seen.add(c)
    text = "\n".join(comps[c])
    out.append(text)
    todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)",
                       text)
  return "\n".join(out)


def test_loop_keeps_no_per_example_gradients():
  """No loop body of the compiled slotted LSTM step holds a per-example
  gradient (``[B, N + 1, M]`` or ``[B, P]``): the slots ``[T, B, K]``
  replace the accumulator, and the Gram is formed after the loops."""
  x, y = _data(10)
  model = _unrolled(CORES["lstm"][0])
  f, params, state = _tracked(model, x, y)
  n, m = F + H, 4 * H
  fn = jax.jit(gram_haiku.value_grad_and_gram(f.apply))
  hlo = fn.lower(params, state, None, x, y).compile().as_text()
  bodies = _loop_bodies(hlo)
  assert bodies  # the unroll's forward and backward loops
  for shape in (f"[{B},{n + 1},{m}]", f"[{B},{(n + 1) * m}]"):
    assert shape not in bodies
  assert f"[{T},{B},{n + m}]" in hlo


@pytest.mark.parametrize("core", ["lstm", "gru"])
def test_clipped_and_reweighted_grads_from_slots(core):
  """DP-SGD's clipped sum and a Gram-weighted gradient of a core unrolled
  over T: the gates keep their factors in slots (no per-example gradient
  accumulator) and re-contract them after the pass."""
  make, want = CORES[core]
  x, y = _data(11)
  model = _unrolled(make)
  f, params, state = _tracked(model, x, y)
  plain = hk.without_apply_rng(hk.transform(lambda x, y: _sq(model(x), y)))
  ref = np.asarray(jax.jit(lambda p: per_example_grads(plain.apply, p, x, y))(
      params), np.float64)
  norms = np.sqrt(np.sum(ref * ref, axis=1))
  c_norm = float(np.median(norms))
  grads, aux = jax.jit(gram_haiku.clipped_grad(f.apply, c_norm))(
      params, state, None, x, y)
  np.testing.assert_allclose(aux.grad_norms, norms, rtol=1e-4)
  chex.assert_trees_all_close(
      grads, weighted_sum(ref, clip_reference(norms, c_norm), params),
      rtol=1e-4, atol=1e-5 * np.abs(ref).max())

  def weight_fn(grams):  # needs the off-diagonal entries
    return (jnp.sum(grams.total, axis=1) > 0).astype(jnp.float32)
  _, grads, grams, c = jax.jit(gram_haiku.reweighted_grad(
      f.apply, weight_fn, needs="gram"))(params, state, None, x, y)
  assert_gram_close(grams.total, ref @ ref.T)
  want_c = (ref @ ref.sum(0) > 0).astype(np.float64)
  np.testing.assert_array_equal(c, want_c)
  chex.assert_trees_all_close(grads, weighted_sum(ref, want_c, params),
                              rtol=1e-4, atol=1e-5 * np.abs(ref).max())
  modes = {}
  def go(params, state):
    r = reweight.run(f.apply, params, state, None, (x, y), {}, fn_name="t",
                     needs="norms", has_aux=False, axes=(), frozen=None,
                     weight_fn=lambda g: jnp.ones_like(g.sq_norms))
    modes.update(r.modes)
    return r.grads
  jax.eval_shape(go, params, state)  # traced, not run: what each kept
  assert {m: modes[m] for m in want} == {m: "slots" for m in want}


def _dead_last_step(x):
  # A Python loop whose last application's output the loss never uses.
  lin = hk.Linear(H, name="cell")
  h, hs = jnp.zeros((x.shape[0], H)), []
  for t in range(T):
    h = jnp.tanh(lin(jnp.concatenate([x[:, t], h], -1)))
    hs.append(h)
  return hk.Linear(2, name="head")(sum(hs[:-1]))


def _dead_warm_up(x):
  # A call whose output is dropped, then the same module in a scan.
  lin = hk.Linear(H, name="cell")
  lin(jnp.zeros((x.shape[0], F + H)))
  def step(h, xt):
    return jnp.tanh(lin(jnp.concatenate([xt, h], -1))), None
  h, _ = hk.scan(step, jnp.zeros((x.shape[0], H)), jnp.swapaxes(x, 0, 1))
  return hk.Linear(2, name="head")(h)


@pytest.mark.parametrize("model,slots", [(_dead_last_step, T),
                                         (_dead_warm_up, T + 1)],
                         ids=["last-step-unused", "warm-up-call"])
def test_applications_the_loss_does_not_use_still_take_a_slot(model, slots):
  """Slots are counted on the program before dead-code elimination: every
  traced application advances the counter, and a dead one's slot stays
  zero (its factors get no cotangent). Counted on the live program, two
  live applications would share a slot."""
  x, y = _data(12)
  _, got, _, _ = _run(model, x, y)
  assert got == {"cell": slots}


def test_dropped_state_updates_fall_back_to_accumulation():
  """A wrapper that returns the state it was given, or ``hk.lift_with_state``
  with ``ignore_update()``: the slot counters do not come back, so the
  pass is traced again with per-example accumulation (exact)."""
  x, y = _data(13)
  model = _unrolled(CORES["lstm"][0])
  f, params, state = _tracked(model, x, y)
  plain = hk.without_apply_rng(hk.transform(lambda x, y: _sq(model(x), y)))
  ref_f = np.asarray(jax.jit(lambda p: per_example_grads(plain.apply, p, x,
                                                         y))(params),
                     np.float64)
  ref = ref_f @ ref_f.T
  def keeps_given(params, state, rng, *args):
    return f.apply(params, state, rng, *args)[0], state
  def keeps_original(params, state_, rng, *args):
    return f.apply(params, state_, rng, *args)[0], state
  for apply in (keeps_given, keeps_original):
    _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(apply))(
        params, state, None, x, y)
    assert_gram_close(grams.total, ref)
    g, _ = jax.jit(gram_haiku.clipped_grad(apply, 1e9))(params, state,
                                                       None, x, y)
    chex.assert_trees_all_close(g, weighted_sum(ref_f, np.ones(B), params),
                                rtol=1e-4, atol=1e-5 * np.abs(ref_f).max())

  def lifted(x):
    inner = hk.transform_with_state(model)
    init, updater = hk.lift_with_state(inner.init, name="inner")
    p, s = init(hk.next_rng_key() if hk.running_init() else None, x)
    out, _ = inner.apply(p, s, None, x)
    updater.ignore_update()  # the only state is the read-only probe
    return out
  grams, slots, _, _ = _run(lifted, x, y)
  assert slots == {"inner/lstm/linear": T}  # found, then not trusted


@pytest.mark.parametrize("x_dtype,state_dtype,param_dtype", [
    (jnp.bfloat16, jnp.float32, jnp.bfloat16),
    (jnp.float32, jnp.bfloat16, jnp.float32),
    (jnp.bfloat16, jnp.bfloat16, jnp.float32),
    (jnp.float32, jnp.float32, jnp.bfloat16),
])
def test_gru_keeps_each_dtype_like_hk_gru(x_dtype, state_dtype, param_dtype):
  # hk.GRU multiplies its state in the state's dtype: the tracked cell's
  # step equals it bit for bit, in value and dtype, so that a loop's carry
  # keeps its type; under hk.dynamic_unroll (where hk.GRU itself runs: the
  # step's dtype is the state's) the Gram is then the reference's within
  # bfloat16's tolerance.
  def step(tracked):
    def f(x, h):
      core = hk.GRU(5)
      if tracked:
        with gram_haiku.track():
          return core(x, h)[0]
      return core(x, h)[0]
    return hk.transform_with_state(f)
  key = jax.random.PRNGKey(zlib.crc32(repr((x_dtype, state_dtype,
                                             param_dtype)).encode()))
  x = problems.normal(key, (3, 4)).astype(x_dtype)
  h = problems.normal(jax.random.fold_in(key, 1), (3, 5)).astype(state_dtype)
  params, _ = step(False).init(key, x, h)
  params = jax.tree.map(lambda a: a.astype(param_dtype), params)
  want = step(False).apply(params, {}, None, x, h)[0]
  _, state = step(True).init(key, x, h)
  got = step(True).apply(params, state, None, x, h)[0]
  assert got.dtype == want.dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want, np.float32))
  if want.dtype != state_dtype:
    return  # hk.dynamic_unroll of hk.GRU itself refuses such a carry.

  def net(xs):
    core = hk.GRU(5)
    h0 = core.initial_state(xs.shape[0]).astype(state_dtype)
    out, _ = hk.dynamic_unroll(core, jnp.swapaxes(xs, 0, 1), h0)
    return 0.5 * jnp.sum(out.astype(jnp.float32) ** 2)

  def loss(xs):
    with gram_haiku.track():
      return net(xs)
  xs = problems.normal(key, (4, 6, 4)).astype(x_dtype)
  tracked = hk.transform_with_state(loss)
  params, state = tracked.init(key, xs)
  params = jax.tree.map(lambda a: a.astype(param_dtype), params)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(tracked.apply))(
      params, state, None, xs)
  plain = hk.transform(net)
  ref = np.asarray(per_example_grads(
      lambda p, x: plain.apply(p, None, x), params, xs), np.float64)
  assert_gram_close(grams.total, ref @ ref.T, "bfloat16")
