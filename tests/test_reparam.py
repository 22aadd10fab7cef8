"""Reparametrised layers (a custom getter between a parameter and its
tracked layer): exact by pulling each example's gradient back through the
getter, or a ``ValueError`` saying why not.

Each model is checked against ``F @ F.T`` of the same model untracked
(getter included), its clipped sum against the reference, and its
reweighted sum against ``jax.grad``. The getters applied several times,
twice differently, inside a call or loop, or whose parameter is read
elsewhere are rows of the interpreter's corpus
(``tests/interpreter_corpus.py``).
"""

from __future__ import annotations

import sys

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.analysis import reparam
from gram_haiku._src.compute import kernels
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import weighted_sum
from tests import problems
from tests.test_reweight import _assert_tree_close

RTOL = 1e-4


def _only(name, fn):
  """A getter applying ``fn`` to the parameters called ``name``."""
  return lambda nxt, v, c: fn(nxt(v)) if c.name == name else nxt(v)


def _standardise(w):
  return (w - w.mean(axis=tuple(range(w.ndim - 1)))) / (
      w.std(axis=tuple(range(w.ndim - 1))) + 1e-2)


@jax.custom_vjp
def _zero_grad(w):
  return w


_zero_grad.defvjp(lambda w: (w, None), lambda _, g: (jnp.zeros_like(g),))


@jax.custom_vjp
def _double_grad(w):
  return w


_double_grad.defvjp(lambda w: (w, None), lambda _, g: (2.0 * g,))


@jax.custom_vjp
def _stopped_forward_passed_gradient(w):
  # The forward stops the gradient; the rule passes it on, doubled.
  return jax.lax.stop_gradient(w)


_stopped_forward_passed_gradient.defvjp(
    lambda w: (jax.lax.stop_gradient(w), None), lambda _, g: (2.0 * g,))


@jax.custom_jvp
def _no_tangent(w):
  return w


_no_tangent.defjvp(lambda p, t: (p[0], jnp.zeros_like(t[0])))


def _forged(w, eps):
  """Named like standardise_weight's mark and ending in a division like it,
  but a scaling: the name alone must not route it to the closed form."""
  return w * 2.0 / (1.0 + eps), jnp.ones(w.shape[-1:], w.dtype)


_forged.__name__ = _forged.__qualname__ = "gram_haiku_standardise_weight"
_forged = jax.jit(_forged)


def _learned_eps(w):
  """:func:`gram_haiku.standardise_weight` with a trainable ``eps``."""
  eps = hk.get_parameter("eps", (), w.dtype,
                         init=hk.initializers.Constant(0.5))
  return gram_haiku.standardise_weight(w, eps)


CASES_UNSAMPLED = {
    # A learned eps (a parameter): no closed form, the generic pull-back
    # (the closed form had no term for eps: a wrong Gram, a crash when
    # clipping).
    "marked-standardised-learned-eps": (_only("w", _learned_eps), "linear",
                                        (3, 4)),
}


#: name -> (getter, layer, input shape). Custom derivatives count: an
#: identity whose rule scales or zeroes the gradient is a reparametrisation.
CASES = {
    "scaled-linear": (lambda n, v, c: 2.0 * n(v), "linear", (4,)),
    "weight-norm": (_only("w", lambda w: w / jnp.linalg.norm(w, axis=0)),
                    "linear", (3, 4)),
    "lora": (problems.lora, "linear", (4,)),
    "standardised-conv": (_only("w", _standardise), "conv", (5, 5, 2)),
    # Marked (gram_haiku.standardise_weight): read in closed form from the
    # layer's factors (eps = 0 and eps > 0), a linear layer and a grouped
    # conv too.
    "marked-standardised-conv": (
        _only("w", gram_haiku.standardise_weight), "conv", (5, 5, 2)),
    "marked-standardised-conv-eps": (
        _only("w", lambda w: gram_haiku.standardise_weight(w, 0.5)), "conv",
        (5, 5, 2)),
    "marked-standardised-grouped-conv": (
        _only("w", lambda w: gram_haiku.standardise_weight(w, 1e-3)),
        "grouped_conv", (5, 5, 4)),
    "forged-mark": (_only("w", lambda w: _forged(w, 0.5)[0]), "conv",
                    (5, 5, 2)),
    "marked-standardised-linear": (
        _only("w", lambda w: gram_haiku.standardise_weight(w, 1e-2)),
        "linear", (3, 4)),
    "scaled-embedding": (_only("embeddings", lambda e: e * 3.0), "embed",
                         (5,)),
    "layer-norm-scale-plus-one": (_only("scale", lambda s: 1.0 + s),
                                  "layer_norm", (3, 4)),
    "custom-vjp-zero-gradient": (_only("w", _zero_grad), "linear", (4,)),
    "custom-vjp-doubled-gradient": (_only("b", _double_grad), "linear",
                                    (3, 4)),
    "custom-jvp-zero-tangent": (_only("w", _no_tangent), "linear", (4,)),
    # Frozen: an integer value carries no gradient (a cast to int and back
    # is no reparametrisation, though each cast alone keeps the values).
    "int-cast-round-trip": (
        _only("w", lambda w: w.astype(jnp.int32).astype(w.dtype)),
        "linear", (4,)),
    # Not frozen: a forward's stop_gradient says nothing of the rule's.
    "custom-vjp-stopped-forward": (
        _only("w", _stopped_forward_passed_gradient), "linear", (4,)),
    # A module's own weight mask (w * mask before the op), no getter.
    "masked-conv": (lambda n, v, c: n(v), "masked_conv", (5, 5, 2)),
    "masked-conv-transpose": (lambda n, v, c: n(v), "masked_conv_transpose",
                              (4, 4, 2)),
}

# Masks with zeros (pruned taps) and a scale.
_MASK = np.random.default_rng(0).choice([0.0, 1.0, 0.5], (3, 3, 2, 3))
_MASK_T = np.random.default_rng(1).choice([0.0, 1.0, 2.0], (3, 3, 3, 2))


#: The cases whose clipped sum is checked too (one pull-back, per kind of
#: rule: factors of a linear layer and a conv, a custom derivative).
CLIPPED = ("lora", "standardised-conv", "custom-vjp-doubled-gradient",
           "scaled-embedding", "masked-conv", "marked-standardised-conv",
           "marked-standardised-conv-eps", "marked-standardised-grouped-conv",
           "marked-standardised-linear")


def _layer(kind):
  return {"linear": lambda: hk.Linear(3, name="target"),
          "conv": lambda: hk.Conv2D(3, 3, name="target"),
          "grouped_conv": lambda: hk.Conv2D(4, 3, feature_group_count=2,
                                            name="target"),
          "embed": lambda: hk.Embed(7, 3, name="target"),
          "layer_norm": lambda: hk.LayerNorm(-1, True, True, name="target"),
          "masked_conv": lambda: hk.Conv2D(3, 3, mask=_MASK, name="target"),
          "masked_conv_transpose": lambda: hk.Conv2DTranspose(
              3, 3, stride=2, mask=_MASK_T, name="target"),
          }[kind]()


def _problem(name, vmapped=False, budget=None, strategy="auto"):
  getter, kind, shape = CASES[name]
  kx, ky = jax.random.split(jax.random.PRNGKey(_seed(name)))
  b = 6
  if kind == "embed":
    x = problems.randint(kx, (b,) + shape, 0, 7)
  else:
    x = problems.normal(kx, (b,) + shape)

  def model(x, y):
    with hk.custom_getter(getter):
      h = _layer(kind)(x)
    h = jnp.tanh(h.reshape(h.shape[0], -1) if h.ndim > 1 else h)
    return problems.sq(hk.Linear(2, name="head")(h), y)

  def per_example_model(x, y):
    return model(x[None], y[None])
  body = per_example_model if vmapped else model

  def tracked(x, y):
    opts = {} if budget is None else {"memory_budget_bytes": budget}
    with gram_haiku.track(untracked="error", strategy=strategy, **opts):
      if vmapped:
        return hk.vmap(body, split_rng=False)(x, y).sum()
      return body(x, y)
  y = problems.normal(ky, (b, 2))
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(1), x, y)
  params = jax.tree.map(  # Away from the initial values (LayerNorm's 1, 0).
      lambda p: p + 0.3 * problems.normal(jax.random.PRNGKey(2), p.shape),
      params)
  plain = hk.without_apply_rng(hk.transform(model))
  fr = np.asarray(per_example_grads(plain.apply, params, x, y), np.float64)
  return f, params, state, x, y, fr


def _seed(name):
  return sum(map(ord, name)) % 997


@pytest.mark.parametrize("vmapped", [False, True], ids=["explicit", "hk.vmap"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_reparametrised_layer_is_exact(name, vmapped):
  if vmapped and name != "lora":
    pytest.skip("hk.vmap: one getter (of several leaves)")
  f, params, state, x, y, fr = _problem(name, vmapped)
  value, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  assert_gram_close(grams.total, fr @ fr.T)
  plain = jax.grad(lambda p: f.apply(p, state, None, x, y)[0])(params)
  _assert_tree_close(grads, plain, RTOL)
  if name not in CLIPPED and not vmapped:
    return
  _assert_clips_as_reference(f, params, state, x, y, fr)
  del value


def _assert_clips_as_reference(f, params, state, x, y, fr):
  """``clipped_grad`` at the median norm: its norms and clipped sum
  against the reference's per-example gradients ``fr``."""
  norms = np.sqrt(np.sum(fr * fr, 1))
  c_norm = float(np.median(norms))
  clipped, aux = jax.jit(gram_haiku.clipped_grad(f.apply, c_norm))(
      params, state, None, x, y)
  np.testing.assert_allclose(aux.grad_norms, norms, rtol=RTOL)
  _assert_tree_close(clipped, weighted_sum(fr, clip_reference(norms, c_norm),
                                           params), RTOL)


@pytest.mark.parametrize("name,budget", [("standardised-conv", 1000),
                                         ("lora", None)],
                         ids=["blocks", "one-block"])
def test_pull_back_in_blocks_of_examples(name, budget, monkeypatch):
  """The pull-back vectorised over blocks of examples (an accelerator's
  path, forced on the CPU): blocks of 2 of the 6 examples (a small memory
  budget) for a standardised conv, and the whole batch in one (the default
  budget) for a low-rank adapter (two leaves), each exact:
  the Gram, the clip norms and the clipped sum against the reference."""
  monkeypatch.setattr(reparam, "BLOCKED_ON_CPU", True)
  seen = []
  pulled_back = reparam._pulled_back
  monkeypatch.setattr(reparam, "_pulled_back", lambda vjp, cts, r, then: (
      seen.append(r), pulled_back(vjp, cts, r, then))[1])
  f, params, state, x, y, fr = _problem(name, budget=budget)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  assert_gram_close(grams.total, fr @ fr.T)
  _assert_clips_as_reference(f, params, state, x, y, fr)
  assert seen and all(1 < r < 6 if budget else r == 6 for r in seen), seen


@pytest.mark.parametrize("b,rows", [(7, 3), (6, 4), (5, 5), (5, 9)])
def test_row_slices_give_every_example_its_rows(b, rows):
  # The blocked pull-back's loop: blocks of one size read in place, the
  # last overlapping (7 in 3 + 3 + 3), a row per example (several axes,
  # a pytree), each example's row its own.
  a = problems.normal(jax.random.PRNGKey(0), (b, 2, 3))
  seen = []

  def fn(blk):
    seen.append(blk.shape[0])
    return [2.0 * blk, jnp.sum(blk, axis=(1, 2))]
  twice, sums = kernels.map_row_slices(fn, rows, (a,))
  np.testing.assert_array_equal(twice, 2.0 * a)
  np.testing.assert_allclose(sums, jnp.sum(a, axis=(1, 2)), rtol=1e-6)
  assert seen[-1] == (-(-b // -(-b // rows)) if rows < b else b)


def test_reparametrised_layer_with_gram_weights_and_frozen_leaves():
  f, params, state, x, y, fr = _problem("lora")
  c = problems.uniform(jax.random.PRNGKey(4), (x.shape[0],), 0.5, 2.0)
  frozen = ["target/lora_a"]  # given, but not trained
  start = 0
  for m in sorted(params):
    for n in sorted(params[m]):
      size = int(np.prod(params[m][n].shape))
      if f"{m}/{n}" in frozen:
        fr[:, start:start + size] = 0
      start += size
  _, grads, grams, _ = jax.jit(gram_haiku.reweighted_grad(
      f.apply, lambda g: c, needs="gram", frozen=frozen))(
          params, state, None, x, y)
  assert_gram_close(grams.total, fr @ fr.T)
  _assert_tree_close(grads, weighted_sum(fr, np.asarray(c), params), RTOL)
  assert not np.any(grads["target"]["lora_a"])


SCALE = lambda n, v, c: 2.0 * n(v)


def _body_problem(body, x, y, untracked="error"):
  """``(f, params, state, F, grams)`` for a loss ``body`` run inside
  ``track()``: ``F`` of ``body`` untracked, ``grams`` of the tracked one."""
  def tracked(x, y):
    with gram_haiku.track(untracked=untracked):
      return body(x, y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  plain = hk.without_apply_rng(hk.transform(body))
  fr = np.asarray(per_example_grads(plain.apply, params, x, y), np.float64)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  return f, params, state, fr, grams


def test_parameters_transformed_outside_haiku():
  # The apply wrapper (not a getter) transforms the parameters: a custom
  # VJP on one leaf and a scale on another, then the tracked model.
  x, y = problems.data(5, (6, 4), 3)

  model = problems.two_layers

  def tracked(x, y):
    with gram_haiku.track():
      return model(x, y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)

  def reparametrise(p):
    return {"l1": {"w": _zero_grad(p["l1"]["w"]), "b": p["l1"]["b"]},
            "l2": {"w": 3.0 * p["l2"]["w"], "b": p["l2"]["b"]}}
  apply = lambda p, *a: f.apply(reparametrise(p), *a)
  plain = hk.without_apply_rng(hk.transform(model))
  fr = np.asarray(per_example_grads(
      lambda p, a, b: plain.apply(reparametrise(p), a, b), params, x, y),
      np.float64)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(apply))(
      params, state, None, x, y)
  assert_gram_close(grams.total, fr @ fr.T)


def test_a_parameter_read_by_the_getter_alone_is_covered():
  # A gain created outside the layer and applied to its weight by a getter:
  # its per-example gradient is pulled back too (complete, clippable).
  x, y = problems.data(8, (6, 4), 3)

  def body(x, y):
    s = hk.get_parameter("s", (), init=hk.initializers.Constant(1.5))
    with hk.custom_getter(_only("w", lambda w: s * w)):
      h = jnp.tanh(hk.Linear(5, name="l1")(x))
    return problems.sq(hk.Linear(3, name="l2")(h), y)
  f, params, state, fr, grams = _body_problem(body, x, y, "ignore")
  assert grams.complete and grams.coverage["~/s"].rule == "reparametrised"
  assert_gram_close(grams.total, fr @ fr.T)
  norms = np.sqrt(np.sum(fr * fr, 1))
  _, aux = jax.jit(gram_haiku.clipped_grad(f.apply, 1.0))(
      params, state, None, x, y)
  np.testing.assert_allclose(aux.grad_norms, norms, rtol=RTOL)


@pytest.mark.parametrize("where", ["inside", "outside"])
@pytest.mark.parametrize("getter", ["scale", "scale-first", "scale-cast"])
def test_raw_path_refuses_a_getter_that_changes_the_parameters(getter,
                                                               where):
  # Entered inside or outside track(), changing the value before or after
  # the next getter: the layer gets other values than Haiku's parameters.
  x, y = problems.data(6, (5, 4), 3)
  fn = {"scale": SCALE,
        "scale-first": lambda n, v, c: n(2.0 * v),
        # A new dtype but no mixed-precision policy: not a policy's cast.
        "scale-cast": lambda n, v, c: (2.0 * n(v)).astype(jnp.bfloat16)
        }[getter]

  def tracked(x, y, plain_getter=False):
    def loss():
      return problems.sq(hk.Linear(3, name="lin")(x), y)
    if plain_getter:
      with gram_haiku.track():
        return loss()
    if where == "inside":
      with gram_haiku.track(), hk.custom_getter(fn):
        return loss()
    with hk.custom_getter(fn), gram_haiku.track():
      return loss()
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  with pytest.raises(ValueError,
                     match="(?s)getter.*'lin'.*value_grad_and_gram"):
    jax.grad(lambda p, s: f.apply(p, s, None, x, y)[0], argnums=(0, 1))(
        params, state)
  # A mixed-precision policy's cast is not refused.
  hk.mixed_precision.set_policy(hk.Linear, jmp.get_policy(
      "params=float32,compute=bfloat16,output=float32"))
  try:
    jax.grad(lambda p, s: f.apply(p, s, None, x, y, plain_getter=True)[0],
             argnums=(0, 1))(params, state)
  finally:
    hk.mixed_precision.clear_policy(hk.Linear)


@pytest.mark.parametrize("getter,closed,strategy", [
    ("marked-standardised-conv", "factors", "ghost"),
    ("marked-standardised-grouped-conv", "per-example", "auto"),
    ("standardised-conv", None, "ghost"),
    ("forged-mark", None, "ghost"),
    ("marked-unlisted", None, "ghost")])
def test_the_mark_alone_routes_a_standardisation_to_the_closed_form(
    getter, closed, strategy, monkeypatch):
  """Only :func:`gram_haiku.standardise_weight`'s marked call is read in
  closed form: from the layer's factors (kept where they are the smaller
  store, or with ``strategy="ghost"``), or its per-example gradients
  pulled back in closed form (so is the clip bounds' exact fallback),
  never by the getter's VJP; a
  standardisation in plain jax.numpy, a program that only takes the mark's
  name, or the marked one with its mark taken
  out of :data:`reparam.CLOSED_FORMS` (a mutation), takes the generic
  pull-back; each exact (Gram, clip norms and clipped sum; the closed
  forms per layer too)."""
  from gram_haiku._src.passes import standardised  # pylint: disable=g-import-not-at-top
  if getter == "marked-unlisted":
    monkeypatch.setattr(reparam, "CLOSED_FORMS", {})
    getter = "marked-standardised-conv"
  seen = {"factors": 0, "per-example": 0, "pulled": 0}
  read, summed = standardised.read, reparam.summed
  rows = standardised.per_example

  def count(key, fn):
    def counted(*a, **k):
      seen[key] += 1
      return fn(*a, **k)
    return counted
  monkeypatch.setattr(standardised, "read", count("factors", read))
  monkeypatch.setattr(standardised, "per_example", count("per-example", rows))
  # (the generic update: J^T sum_i c_i f_i by the getter's own VJP)
  monkeypatch.setattr(reparam, "summed", count("pulled", summed))
  f, params, state, x, y, fr = _problem(getter, strategy=strategy)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  assert_gram_close(grams.total, fr @ fr.T)
  _assert_clips_as_reference(f, params, state, x, y, fr)
  if closed:
    _assert_clips_per_layer_as_reference(f, params, state, x, y, fr)
  want = {closed or "pulled"}
  if closed == "factors":  # (the clip bounds' run-time fallback: the
    want.add("per-example")  # rows formed and pulled back in closed form)
  assert {k for k, v in seen.items() if v} == want, seen


def _assert_clips_per_layer_as_reference(f, params, state, x, y, fr):
  """``clipped_grad(clipping="per-layer")`` (``C_l = C / sqrt(L)``): each
  module's norms and clipped sum against the reference's columns."""
  sizes = {m: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params[m]))
           for m in sorted(params)}
  c_norm = float(np.median(np.sqrt(np.sum(fr * fr, 1))))
  c_layer = c_norm / np.sqrt(len(sizes))
  clipped, aux = jax.jit(gram_haiku.clipped_grad(
      f.apply, c_norm, clipping="per-layer"))(params, state, None, x, y)
  want, start = np.zeros_like(fr), 0
  for m, size in sizes.items():
    cols = fr[:, start:start + size]
    norms = np.sqrt(np.sum(cols * cols, 1))
    np.testing.assert_allclose(aux.weights[m], clip_reference(norms, c_layer),
                               rtol=RTOL)
    want[:, start:start + size] = cols * clip_reference(norms, c_layer)[:, None]
    start += size
  _assert_tree_close(clipped, weighted_sum(want, np.ones(len(fr)), params),
                     RTOL)


def test_a_marked_standardisation_gives_exact_cross_grams():
  """:func:`gram_haiku.cross_gram` of a marked standardisation (its Gram
  blocks read from per-example gradients pulled back in closed form, never
  from factors): the block, the examples' own norms and the sums over the
  queries against the float64 reference."""
  f, params, state, x, y, fr = _problem("marked-standardised-conv-eps",
                                        strategy="ghost")
  xq = problems.normal(jax.random.PRNGKey(7), (3,) + x.shape[1:])
  yq = problems.normal(jax.random.PRNGKey(8), (3,) + y.shape[1:])
  getter, kind, _ = CASES["marked-standardised-conv-eps"]

  def model(x, y):
    with hk.custom_getter(getter):
      h = _layer(kind)(x)
    return problems.sq(hk.Linear(2, name="head")(jnp.tanh(
        h.reshape(h.shape[0], -1))), y)
  plain = hk.without_apply_rng(hk.transform(model))
  hq = np.asarray(per_example_grads(plain.apply, params, xq, yq), np.float64)
  _, _, cross = jax.jit(gram_haiku.cross_gram(f.apply))(
      params, state, None, x, y, queries=(xq, yq))
  assert_gram_close(cross.total, fr @ hq.T)
  assert_gram_close(cross.sq_norms[:, None], np.sum(fr * fr, 1)[:, None])
  assert_gram_close(cross.query_summed[:, None], (fr @ hq.sum(0))[:, None])


@pytest.mark.parametrize("name", sorted(CASES_UNSAMPLED))
def test_a_standardisation_of_a_learned_eps_is_exact(name, monkeypatch):
  """:func:`gram_haiku.standardise_weight` whose ``eps`` is a parameter:
  its per-example gradient is part of the Gram and of the clip norms (the
  closed form, which has no term for it, is not used)."""
  monkeypatch.setattr(sys.modules[__name__], "CASES",
                      {**CASES, **CASES_UNSAMPLED})
  f, params, state, x, y, fr = _problem(name)
  assert "eps" in params["target"], params
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  assert_gram_close(grams.total, fr @ fr.T)
  _assert_clips_as_reference(f, params, state, x, y, fr)
