"""Random problems shared by the model-level tests."""

import jax
import jax.numpy as jnp


def data(seed, shape, out_dim):
  """Random inputs ``shape`` and targets ``shape[:-1] + (out_dim,)``."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (jax.random.normal(k1, shape),
          jax.random.normal(k2, shape[:-1] + (out_dim,)))


def sq(out, y):
  """The summed squared error (a sum of per-example losses)."""
  return 0.5 * jnp.sum((out - y) ** 2)
