"""Frozen parameters: no gradient, so no term in the Gram, the norms or the
clipped sum.

A parameter is frozen three ways: left out of the parameters that are
differentiated (``hk.data_structures.partition``, the rest closed over),
read through ``jax.lax.stop_gradient`` (a custom getter), or declared
``frozen=`` to :func:`gram_haiku.reweighted_grad` and
:func:`gram_haiku.clipped_grad`. Each is checked on layers of every kind
(linear, conv, norm, embedding, a shared RNN cell, a tied LM,
``hk.layer_stack``) against ``F @ F.T`` of the untracked model's
per-example gradients of the trainable parameters only, with frozen
weights (BitFit: biases train), frozen biases, or a whole frozen module.
A layer frozen in one use only, and programs frozen by ``stop_gradient``,
are rows of the interpreter's corpus (``tests/interpreter_corpus.py``).
"""

from __future__ import annotations

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.core import reference
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import assert_sound_norms
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import RTOL_BF16
from gram_haiku._src.core.reference import weighted_sum
from gram_haiku.conformance.examples import scaled_linear
from gram_haiku.conformance.plugin import thorough
from tests import layer_zoo
from tests import problems
from tests.test_reweight import _assert_tree_close

RTOL = 2e-5

#: Which parameters are frozen: ``(module, name) -> bool``, given the
#: sorted module names.
KINDS = {
    "weights": lambda modules: lambda m, n: n in ("w", "embeddings",
                                                   "scale"),
    "biases": lambda modules: lambda m, n: n in ("b", "offset"),
    "first-module": lambda modules: lambda m, n: m == modules[0],
}
WAYS = ("partition", "stop_gradient", "declared")

#: The default run: each way on each class of rule and store (a linear
#: layer's ghost kernels, conv, a norm's affine op, an embedding and its
#: tied unembedding, a shared RNN cell's per-example store, stacked
#: layers). Every entry, kind and way with ``--conformance-thorough``.
DEFAULT = (
    ("MLP", "weights", "partition"),
    ("MLP", "biases", "stop_gradient"),
    ("MLP", "first-module", "declared"),
    ("Conv2D", "weights", "stop_gradient"),
    ("LayerNorm", "weights", "declared"),
    ("tied-LM", "weights", "stop_gradient"),
    ("LSTM-dynamic", "weights", "partition"),
    ("GRU-static", "biases", "declared"),
    ("layer_stack", "weights", "stop_gradient"),
)


def _cases():
  if not thorough():
    return [pytest.param(*c, id="-".join(c)) for c in DEFAULT]
  return [pytest.param(e.name, k, w, id=f"{e.name}-{k}-{w}")
          for e in layer_zoo.ENTRIES for k in KINDS for w in WAYS]


def _getter(is_frozen):
  def getter(next_getter, value, context):
    value = next_getter(value)
    if is_frozen(context.module_name, context.name):
      return jax.lax.stop_gradient(value)
    return value
  return getter


def _problem(name: str, kind: str, way: str):
  """``(apply, params, state, x, F, frozen names)``: the tracked apply and
  the parameters it differentiates, and the untracked model's per-example
  gradients of those parameters (zero columns for frozen ones)."""
  entry = layer_zoo.BY_NAME[name]
  fn, lead = layer_zoo._styled(entry, "explicit")  # pylint: disable=protected-access
  x = layer_zoo._draw(entry, lead, layer_zoo.seed_of(name))  # pylint: disable=protected-access
  init_params, _ = jax.jit(hk.transform_with_state(
      layer_zoo._tracked(fn, entry)).init)(jax.random.PRNGKey(1), x)  # pylint: disable=protected-access
  is_frozen = KINDS[kind](sorted(init_params))
  names = [f"{m}/{n}" for m in init_params for n in init_params[m]
           if is_frozen(m, n)]
  if not names or len(names) == sum(len(v) for v in init_params.values()):
    pytest.skip(f"{kind} freezes none or all of {name}'s parameters")
  def body(x):
    if way != "stop_gradient":
      return fn(x)
    with hk.custom_getter(_getter(is_frozen)):
      return fn(x)
  tracked = hk.transform_with_state(layer_zoo._tracked(body, entry))  # pylint: disable=protected-access
  plain = hk.transform_with_state(lambda x: layer_zoo._tail(body(x)))  # pylint: disable=protected-access
  params, state = jax.jit(tracked.init)(jax.random.PRNGKey(1), x)
  _, plain_state = jax.jit(plain.init)(jax.random.PRNGKey(1), x)
  apply, plain_apply = tracked.apply, plain.apply
  if way == "partition":
    cold, params = hk.data_structures.partition(is_frozen_leaf(is_frozen),
                                                params)
    merged = lambda f: lambda p, *a: f(hk.data_structures.merge(p, cold), *a)
    apply, plain_apply = merged(apply), merged(plain_apply)
  plain_loss = lambda p, x: plain_apply(p, plain_state, None, x)[0]
  f = np.asarray(per_example_grads(plain_loss, params, x), np.float64)
  if way == "declared":  # Trainable in the model: its columns are dropped.
    start, cols = 0, []
    for m in sorted(params):
      for n in sorted(params[m]):
        size = int(np.prod(params[m][n].shape))
        if not is_frozen(m, n):
          cols.extend(range(start, start + size))
        start += size
    mask = np.zeros(f.shape[1], bool)
    mask[cols] = True
    f = np.where(mask, f, 0.0)
  return apply, params, state, x, f, names


def is_frozen_leaf(is_frozen):
  return lambda m, n, v: is_frozen(m, n)


def _rtol(name):
  return RTOL_BF16 if layer_zoo.is_low_precision(layer_zoo.BY_NAME[name]) \
      else RTOL


@pytest.mark.parametrize("name,kind,way", _cases())
def test_gram_leaves_frozen_parameters_out(name, kind, way):
  if way == "declared":
    pytest.skip("frozen= is an argument of the reweighted gradients")
  apply, params, state, x, f, _ = _problem(name, kind, way)
  value, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(apply))(
      params, state, None, x)
  assert_gram_close(grams.total, f @ f.T, rtol=_rtol(name))
  if layer_zoo.is_low_precision(layer_zoo.BY_NAME[name]):
    return  # (bf16 gradients: rounding differs from the plain model's)
  plain_value, plain = jax.jit(jax.value_and_grad(
      lambda p: apply(p, state, None, x)[0]))(params)
  np.testing.assert_allclose(value, plain_value, rtol=1e-5)
  chex.assert_trees_all_close(grads, plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,kind,way", _cases())
def test_clipped_sum_leaves_frozen_parameters_out(name, kind, way):
  apply, params, state, x, f, names = _problem(name, kind, way)
  norms = np.sqrt(np.sum(f * f, axis=1))
  c_norm = float(np.median(norms))  # Some examples clipped, some not.
  frozen = names if way == "declared" else None
  grads, aux = jax.jit(gram_haiku.clipped_grad(apply, c_norm,
                                               frozen=frozen))(
      params, state, None, x)
  rtol = _rtol(name)
  # The clip factors come from sound upper bounds of the norms (checked
  # against the reference); the sum is re-contracted with them.
  assert_sound_norms(aux.grad_norms, norms * (1 - rtol),
                     slack=reference.CLIP_BOUND_SLACK + 2 * rtol)
  _assert_tree_close(grads, weighted_sum(
      f, clip_reference(aux.grad_norms, c_norm), params), 5 * rtol)
  if way != "partition":  # Frozen leaves are given: their gradient is 0.
    for full in names:
      m, n = full.rsplit("/", 1)
      assert not np.any(grads[m][n]), full


@pytest.mark.parametrize("needs", ["norms", "gram"])
def test_reweighted_gram_and_per_layer_clipping_with_frozen_weights(needs):
  apply, params, state, x, f, names = _problem("MLP", "weights", "declared")
  c = problems.uniform(jax.random.PRNGKey(3), (x.shape[0],), 0.5, 2.0)
  _, grads, grams, got_c = jax.jit(gram_haiku.reweighted_grad(
      apply, lambda g: c, needs=needs, frozen=names))(params, state, None, x)
  np.testing.assert_allclose(got_c, c)
  if needs == "gram":
    assert_gram_close(grams.total, f @ f.T)
  np.testing.assert_allclose(grams.sq_norms, np.sum(f * f, 1), rtol=RTOL)
  _assert_tree_close(grads, weighted_sum(f, np.asarray(c), params),
                     5 * RTOL)
  # Per-layer clipping (inside the backward rule): each layer's own norm.
  c_norm = float(np.median(np.sqrt(np.sum(f * f, 1))))
  grads, aux = jax.jit(gram_haiku.clipped_grad(
      apply, c_norm, clipping="per-layer", frozen=names))(
          params, state, None, x)
  want = {}
  for m in params:  # Each module's columns, clipped by its own norm.
    cols = reference.column_groups(params)[m]
    fm = np.zeros_like(f)
    fm[:, cols] = f[:, cols]
    c_m = clip_reference(np.sqrt(np.sum(fm * fm, 1)),
                         c_norm / np.sqrt(len(params)))
    want[m] = weighted_sum(fm, c_m, params)[m]
  _assert_tree_close(grads, want, 5 * RTOL)
  for full in names:
    m, n = full.rsplit("/", 1)
    assert not np.any(grads[m][n]), full
  del aux


def test_norms_mode_and_hk_vmap_with_a_partitioned_frozen_module():
  x, y = problems.data(5, (6, 4), 3)

  def model(x, y):
    return problems.two_layers(x, y, ("backbone", "head"))

  def tracked(x, y):
    with gram_haiku.track(mode="norms"):
      return hk.vmap(lambda a, b: model(a[None], b[None]),
                     split_rng=False)(x, y).sum()
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  cold, train = hk.data_structures.partition(
      lambda m, n, v: m == "backbone", params)
  apply = lambda p, *a: f.apply(hk.data_structures.merge(p, cold), *a)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(apply))(
      train, state, None, x, y)
  plain = hk.without_apply_rng(hk.transform(model))
  ref = per_example_grads(
      lambda p, a, b: plain.apply(hk.data_structures.merge(p, cold), a, b),
      train, x, y)
  np.testing.assert_allclose(grams.sq_norms, np.sum(np.square(ref), 1),
                             rtol=RTOL)


@pytest.mark.parametrize("param", ["w", "s"])
def test_a_rule_that_reads_the_frozen_parameter(param):
  # y = s (x @ w): each parameter's gradient reads the other's value, so a
  # frozen one is held at its value and the trainable one's per-example
  # gradients are formed (in the pass, also for a clipped sum).
  x, y = problems.data(8, (6, 3, 4), 3)

  def model(x, y):
    h = jnp.tanh(scaled_linear.ScaledLinear(5)(x))
    return problems.sq(hk.Linear(3)(h), y)

  def tracked(x, y):
    with gram_haiku.track(untracked="error"):
      return model(x, y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  params = jax.tree.map(lambda a: a * 1.5, params)  # s != 1
  cold, train = hk.data_structures.partition(
      lambda m, n, v: m == "scaled_linear" and n == param, params)
  apply = lambda p, *a: f.apply(hk.data_structures.merge(p, cold), *a)
  plain = hk.without_apply_rng(hk.transform(model))
  fr = np.asarray(per_example_grads(
      lambda p, a, b: plain.apply(hk.data_structures.merge(p, cold), a, b),
      train, x, y), np.float64)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(apply))(
      train, state, None, x, y)
  assert_gram_close(grams.total, fr @ fr.T)
  norms = np.sqrt(np.sum(fr * fr, 1))
  c_norm = float(np.median(norms))
  grads, aux = jax.jit(gram_haiku.clipped_grad(apply, c_norm))(
      train, state, None, x, y)
  np.testing.assert_allclose(aux.grad_norms, norms, rtol=RTOL)
  _assert_tree_close(grads, weighted_sum(fr, clip_reference(norms, c_norm),
                                         train), 5 * RTOL)


@pytest.mark.parametrize("how", ["partition", "stop_gradient"])
def test_raw_path_refuses_a_partly_differentiated_layer(how):
  # Without the traced program nothing says which parameters are frozen:
  # the raw path's Gram covers every parameter, so a layer whose
  # parameters are differentiated only in part is refused; differentiating
  # the probes alone gives the Gram of all of them.
  x, y = problems.data(9, (6, 4), 3)
  freeze = lambda m, n: m == "l1" and n == "w"

  model = problems.two_layers

  def tracked(x, y):
    with gram_haiku.track():
      if how == "partition":
        return model(x, y)
      with hk.custom_getter(_getter(freeze)):
        return model(x, y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  cold, train = hk.data_structures.partition(
      lambda m, n, v: how == "partition" and freeze(m, n), params)
  loss = lambda p, s: f.apply(hk.data_structures.merge(p, cold), s, None,
                              x, y)[0]
  with pytest.raises(ValueError, match="'l1'.*only its parameter.*'b'"
                     if how == "partition" else "getter.*'l1'"):
    jax.grad(loss, argnums=(0, 1))(train, state)
  probes = jax.grad(loss, argnums=1)(train, state)
  plain = hk.without_apply_rng(hk.transform(model))
  fr = np.asarray(per_example_grads(plain.apply, params, x, y), np.float64)
  assert_gram_close(probes["l1"]["gram_probe"] + probes["l2"]["gram_probe"],
                    fr @ fr.T)


def test_an_untracked_parameter_read_through_stop_gradient_needs_no_rule():
  x, y = problems.data(10, (5, 4), 4)

  def tracked(x, y):
    with gram_haiku.track(untracked="ignore"):
      h = hk.Linear(4, name="l1")(x)
      alpha = jax.lax.stop_gradient(hk.get_parameter(
          "alpha", (4,), init=hk.initializers.Constant(0.2)))
      h = jnp.where(h > 0, h, alpha * h)  # a PReLU with a frozen slope
      return problems.sq(hk.Linear(4, name="l2")(h), y)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(
      params, state, None, x, y)
  assert grams.complete and grams.coverage["~/alpha"].rule == "frozen"
  grads, aux = jax.jit(gram_haiku.clipped_grad(f.apply, 1.0))(
      params, state, None, x, y)
  assert not np.any(grads["~"]["alpha"])
  np.testing.assert_allclose(aux.grad_norms ** 2, grams.sq_norms, rtol=RTOL)


def test_a_boolean_mask_freezes_what_its_names_freeze():
  """``frozen=`` as a mask shaped like the parameters (optax's ``masked``
  convention): True leaves are frozen, False and left-out ones are not."""
  apply, params, state, x, f, names = _problem("MLP", "weights", "declared")
  mask = {m: {n: f"{m}/{n}" in names for n in leaves}
          for m, leaves in params.items()}
  # A module wholly frozen may be given as one boolean; one left out is not.
  whole = {m: True for m, leaves in params.items()
           if all(f"{m}/{n}" in names for n in leaves)}
  partial = {m: {n: True for n in leaves if f"{m}/{n}" in names}
             for m, leaves in params.items()
             if any(f"{m}/{n}" in names for n in leaves) and m not in whole}
  c_norm = float(np.median(np.sqrt(np.sum(f * f, 1))))
  want, _ = jax.jit(gram_haiku.clipped_grad(apply, c_norm, frozen=names))(
      params, state, None, x)
  for frozen in (mask, {**whole, **partial}):
    got, aux = jax.jit(gram_haiku.clipped_grad(apply, c_norm,
                                               frozen=frozen))(
        params, state, None, x)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(aux.grad_norms, np.sqrt(np.sum(f * f, 1)),
                               rtol=RTOL)
  module = next(iter(params))
  leaf = next(iter(params[module]))
  bad = [({"no_such_module": True}, "no_such_module"),
         ({module: {"no_such_leaf": True}}, "no_such_leaf"),
         ({module: {leaf: 1.0}}, "Python booleans"),
         ({module: jnp.ones(())}, "Python booleans")]
  for frozen, says in bad:
    with pytest.raises(ValueError, match=says):
      gram_haiku.clipped_grad(apply, c_norm, frozen=frozen)(
          params, state, None, x)


def test_frozen_names_and_masks_hold_for_haiku_flatmap_params():
  """Haiku's immutable FlatMap params: the same frozen leaves as the plain
  dict of the same values."""
  apply, params, state, x, f, names = _problem("MLP", "weights", "declared")
  flat_map = hk.data_structures.to_immutable_dict(params)
  mask = {m: {n: f"{m}/{n}" in names for n in leaves}
          for m, leaves in params.items()}
  c_norm = float(np.median(np.sqrt(np.sum(f * f, 1))))
  for frozen in (names, mask):
    want, want_aux = gram_haiku.clipped_grad(apply, c_norm, frozen=frozen)(
        params, state, None, x)
    got, aux = gram_haiku.clipped_grad(apply, c_norm, frozen=frozen)(
        flat_map, state, None, x)
    np.testing.assert_allclose(aux.grad_norms, want_aux.grad_norms,
                               rtol=1e-6)
    for full in names:
      m, n = full.rsplit("/", 1)
      assert not np.any(got[m][n]), full
    chex.assert_trees_all_close(
        hk.data_structures.to_mutable_dict(got), want, rtol=1e-6, atol=1e-7)


def test_freezing_everything_or_passing_one_boolean_is_a_teaching_error():
  apply, params, state, x, _, _ = _problem("MLP", "weights", "declared")
  for frozen, says in [({m: True for m in params}, "freezes every"),
                       (list(params), "freezes every"),
                       (True, "not one boolean")]:
    with pytest.raises(ValueError, match=says):
      gram_haiku.clipped_grad(apply, 1.0, frozen=frozen)(
          params, state, None, x)
