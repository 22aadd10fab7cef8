"""Random problems shared by the model-level tests."""

import itertools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku import functional
from gram_haiku import testing
from gram_haiku.conformance.plugin import thorough
from gram_haiku.conformance.registry import normal as _normal
from gram_haiku.conformance.registry import numpy_rng

#: ``jit`` values of a test that runs eagerly and under jit: the eager
#: variant in the nightly budget (``--conformance-thorough``). The default
#: run keeps eager coverage where eagerness is the point: the explicitly
#: batched MLP, tied embeddings, the refusal tests, the conformance
#: ``jit_none`` layouts and the zoo's ``eager`` style.
JIT_CASES = [False, True] if thorough() else [True]


def spread(*axes):
  """Combinations of parameter values for ``pytest.mark.parametrize``.

  Each axis is a list of ``(id, value)`` pairs. With
  ``--conformance-thorough``: the whole product. By default: the
  combinations whose value indices sum to a multiple of the smallest
  axis's length, so that every value of every axis still runs, at about
  ``1 / min(len)`` of the product's cost (for two axes of the same length
  ``n``: ``n`` pairs, each value once). One axis runs whole.
  """
  m = min(len(a) for a in axes) if len(axes) > 1 else 1
  out = []
  for idx in itertools.product(*(range(len(a)) for a in axes)):
    if thorough() or sum(idx) % m == 0:
      picked = [a[i] for a, i in zip(axes, idx)]
      out.append(pytest.param(*(v for _, v in picked),
                              id="-".join(str(k) for k, _ in picked)))
  return out


def normal(key, shape, dtype=jnp.float32):
  """``jax.random.normal(key, shape, dtype)``'s distribution, drawn by numpy
  (outside jit, ``jax.random`` compiles a program per shape and dtype)."""
  return _normal(key, shape, dtype)


def uniform(key, shape, minval=0.0, maxval=1.0):
  """Uniform float32 draws in ``[minval, maxval)``, drawn by numpy."""
  return jax.device_put(numpy_rng(key).uniform(minval, maxval, shape)
                        .astype(np.float32))


def randint(key, shape, minval, maxval):
  """int32 draws in ``[minval, maxval)``, drawn by numpy."""
  return jax.device_put(numpy_rng(key).integers(minval, maxval, shape)
                        .astype(np.int32))


def data(seed, shape, out_dim):
  """Random inputs ``shape`` and targets ``shape[:-1] + (out_dim,)``."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return normal(k1, shape), normal(k2, shape[:-1] + (out_dim,))


def untracked(loss, params, *batch):
  """``(value, grads, F)`` of the untracked ``loss(params, *batch)``: its
  value, its gradient and its per-example gradients ``F`` (float64 numpy,
  :func:`gram_haiku.testing.per_example_grads`), from one jitted program
  (three otherwise). The reference Gram is ``F @ F.T``."""
  value, grads, flat = jax.jit(lambda p, *b: (
      *jax.value_and_grad(loss)(p, *b),
      testing.per_example_grads(loss, p, *b)))(params, *batch)
  return value, grads, np.asarray(flat, np.float64)


@jax.custom_jvp
def uncovered_matmul(a, b):
  """``a @ b`` as a function with a custom derivative (its own, exact): a
  parameter that is its operand with the data has no program-level rule
  (differentiation runs the rule, not the body), where ``a @ b`` itself is
  covered by the rule for ``dot_general``."""
  return a @ b


uncovered_matmul.defjvp(lambda primals, tangents: (
    primals[0] @ primals[1],
    tangents[0] @ primals[1] + primals[0] @ tangents[1]))


def sq(out, y):
  """The summed squared error (a sum of per-example losses)."""
  return 0.5 * jnp.sum((out - y) ** 2)


def two_layers(x, y, names=("l1", "l2"), width=5):
  """``sq(Linear(tanh(Linear(x))), y)``: a small MLP loss (inside a Haiku
  transform), its two layers named ``names``."""
  h = jnp.tanh(hk.Linear(width, name=names[0])(x))
  return sq(hk.Linear(y.shape[-1], name=names[1])(h), y)


def lora(nxt, v, c):
  """A custom getter: ``w`` as ``W0 + A B`` (W0 frozen by stop_gradient;
  A and B rank-2 parameters of their own), other parameters unchanged."""
  if c.name != "w":
    return nxt(v)
  a = hk.get_parameter("lora_a", (v.shape[0], 2), v.dtype,
                       init=hk.initializers.RandomNormal())
  b = hk.get_parameter("lora_b", (2, v.shape[1]), v.dtype,
                       init=hk.initializers.RandomNormal())
  return jax.lax.stop_gradient(nxt(v)) + a @ b


def assert_clip_norms_bound(loss, params, *batch, within: float = 3.0):
  """The float32 clip norms of :func:`gram_haiku.functional.clipped_grad`
  (``return_grad_norms``, under ``jit``) are at least the float64
  per-example norms of ``loss`` (``vmap(grad)`` in float64), and at most
  ``within`` times them (so the check is not vacuous)."""
  with jax.enable_x64(True):
    f = testing.per_example_grads(
        loss, jax.tree.map(lambda a: a.astype(jnp.float64), params),
        *(b.astype(jnp.float64) for b in batch))
  true = np.linalg.norm(np.asarray(f), axis=1)
  _, aux = jax.jit(functional.clipped_grad(loss, l2_clip_norm=1e9,
                                           return_grad_norms=True))(
                                               params, *batch)
  bound = np.asarray(aux.grad_norms, np.float64)
  assert np.all(bound >= true), (bound, true)
  assert np.all(bound <= within * true), (bound, true)


def tracked_gram(net, tracked, x):
  """``(params, state, plain, grads, grams, ref)`` for the loss
  ``net(x).sum()``: the jitted ``value_grad_and_gram`` of ``tracked`` (the
  same network inside ``gram_haiku.track``) at the parameters of the
  untracked ``plain`` transform of ``net`` (``state``: the probes), and the
  float64 reference Gram ``F F^T`` of ``x``'s per-example losses."""
  plain = hk.without_apply_rng(hk.transform(net))
  params = plain.init(jax.random.key(0), x)
  f = hk.without_apply_rng(hk.transform_with_state(tracked))
  _, state = f.init(jax.random.key(0), x)
  _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, x)
  ref = testing.reference_gram(lambda p, xi: plain.apply(p, xi).sum(),
                               params, x, upcast=True)
  return params, state, plain, grads, grams, ref
