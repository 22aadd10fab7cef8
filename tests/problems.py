"""Random problems shared by the model-level tests."""

import jax
import jax.numpy as jnp
import numpy as np

from conformance.registry import normal as _normal


def normal(key, shape, dtype=jnp.float32):
  """``jax.random.normal(key, shape, dtype)``'s distribution, drawn by numpy
  (outside jit, ``jax.random`` compiles a program per shape and dtype)."""
  return _normal(key, shape, dtype)


def uniform(key, shape, minval=0.0, maxval=1.0):
  """Uniform float32 draws in ``[minval, maxval)``, drawn by numpy."""
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel()
                              .tolist())
  return jax.device_put(rng.uniform(minval, maxval, shape).astype(np.float32))


def randint(key, shape, minval, maxval):
  """int32 draws in ``[minval, maxval)``, drawn by numpy."""
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)).ravel()
                              .tolist())
  return jax.device_put(rng.integers(minval, maxval, shape).astype(np.int32))


def data(seed, shape, out_dim):
  """Random inputs ``shape`` and targets ``shape[:-1] + (out_dim,)``."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return normal(k1, shape), normal(k2, shape[:-1] + (out_dim,))


def sq(out, y):
  """The summed squared error (a sum of per-example losses)."""
  return 0.5 * jnp.sum((out - y) ** 2)
