"""Check families, each a function ``check_*(spec, ...)`` raising on failure.

Tolerances are written once, in :data:`TOLERANCES`.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np

from conformance.registry import OpSpec

#: dtype name -> (rtol, atol as a fraction of the reference's max |entry|).
TOLERANCES = {
    "float32": (1e-4, 3e-5),
    "float64": (1e-10, 1e-12),
    "bfloat16": (2e-2, 2e-2),
    "float16": (1e-2, 1e-2),
}


def _loss(out):
  return 0.5 * jnp.sum(jnp.tanh(out.astype(jnp.float32)) ** 2)


def reference_gram(spec: OpSpec, params, x) -> np.ndarray:
  """``F @ F.T`` from ``vmap(grad)`` of the plain op, one example at a time."""
  def one(p, xi):
    return _loss(spec.plain(p, xi[None]))
  up = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  g = jax.vmap(jax.grad(one), in_axes=(None, 0))(up(params), up(x))
  f = np.concatenate([np.asarray(l, np.float64).reshape(x.shape[0], -1)
                      for l in jax.tree.leaves(g)], axis=1)
  return f @ f.T


def assert_close(gram, ref, dtype_name):
  rtol, atol = TOLERANCES[dtype_name]
  ref = np.asarray(ref, np.float64)
  np.testing.assert_allclose(np.asarray(gram, np.float64), ref, rtol=rtol,
                             atol=atol * max(np.abs(ref).max(), 1e-30))


def check_backward_parity(spec: OpSpec, dtype, b=4, t=3, seed=0):
  """Every cotangent matches its primal's shape, dtype and weak type."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = spec.make_params(k1, dtype)
  x = spec.make_example(k2, (b, t), dtype)
  probe = jnp.zeros((b, b), jnp.promote_types(jnp.float32, dtype))
  def loss(params, probe, x):
    return _loss(jax.vmap(lambda xi: spec.apply(params, probe, xi))(x))
  grad = jax.grad(loss, argnums=(0, 1, 2))
  for cts in (grad(params, probe, x), jax.eval_shape(grad, params, probe, x)):
    for ct, primal in zip(jax.tree.leaves(cts),
                          jax.tree.leaves((params, probe, x))):
      chex.assert_equal_shape([ct, primal])
      assert ct.dtype == primal.dtype, (ct.dtype, primal.dtype)
      assert getattr(ct, "weak_type", False) == getattr(primal, "weak_type",
                                                         False)


#: vmap layouts checked: depth -> list of in_axes per level, outermost first.
#: Level ``l`` maps the example axis (outermost) or a within-example axis.
VMAP_LAYOUTS = {
    0: [()],
    1: [(0,), (1,), (2,)],
    2: [(0, 0), (2, 0), (0, 1), (1, 1)],
}


def _layout(x, axes):
  """Moves ``x: (B, T, N)`` so that nested vmaps with ``axes`` map B then T."""
  if len(axes) == 2 and axes[1] == 1:
    x = jnp.swapaxes(x, 1, 2)  # per example (N, T): T mapped at axis 1
  if axes:
    x = jnp.moveaxis(x, 0, axes[0])
  return x


def check_vmap_depth_invariance(spec: OpSpec, axes: tuple[int, ...], jit: str,
                                dtype=jnp.float32, b=4, t=3, seed=0):
  """Explicit batching and nested vmaps (``axes``) all equal ``F @ F.T``.

  Args:
    spec: the op.
    axes: ``in_axes`` (and ``out_axes``) of each vmap level, outermost first;
      ``()`` is the explicitly batched ``(B, T, N)`` call.
    jit: ``"none"``, ``"inside"`` (around the op, inside the vmaps) or
      ``"outside"`` (around the gradient).
  """
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = spec.make_params(k1, dtype)
  x = spec.make_example(k2, (b, t), dtype)  # explicit: (B, T, N)
  ref = reference_gram(spec, params, x)
  def loss(params, probe, xs):
    f = lambda xi: spec.apply(params, probe, xi)
    if jit == "inside":
      f = jax.jit(f)
    for ax in reversed(axes):
      f = jax.vmap(f, in_axes=ax, out_axes=min(ax, 1))
    return _loss(f(xs))
  g = jax.grad(loss, argnums=1)
  if jit == "outside":
    g = jax.jit(g)
  gram = g(params, jnp.zeros((b, b), jnp.float32), _layout(x, axes))
  chex.assert_shape(gram, (b, b))
  assert_close(gram, ref, jnp.dtype(dtype).name)
