"""The reference every Gram is tested against: ``F @ F.T``.

``F[i]`` is the flattened gradient of example ``i``'s loss, evaluated alone
as a batch of one (a length-1 example axis is added inside the mapped
function so that layers keep their rank), from
``jax.vmap(jax.grad(per_example_loss))`` of the *untracked* model.
"""

import jax
import jax.numpy as jnp
import numpy as np

# Tolerances (CASES.md conventions): same computation order, reordered
# reductions, bf16 compute.
RTOL_F32, ATOL_F32 = 1e-4, 3e-5
RTOL_BF16 = 2e-2


def per_example_grads(per_example_loss, params, *batch, in_axes=0):
  """``F``: ``[B, P]`` flattened per-example gradients, in float32 or wider."""
  def loss_one(p, *example):
    example = jax.tree.map(lambda a: a[None], example)
    return per_example_loss(p, *example)
  # Under jit: one compilation, not one per primitive (op-by-op dispatch).
  grads = jax.jit(jax.vmap(jax.grad(loss_one),
                           in_axes=(None,) + (in_axes,) * len(batch)))(
                               params, *batch)
  leaves = jax.tree.leaves(grads)
  b = leaves[0].shape[0]
  return jnp.concatenate(
      [jnp.asarray(l, jnp.promote_types(l.dtype, jnp.float32)).reshape(b, -1)
       for l in leaves], axis=1)


def reference_gram(per_example_loss, params, *batch, in_axes=0):
  """``F @ F.T`` in float64 numpy."""
  f = np.asarray(per_example_grads(per_example_loss, params, *batch,
                                   in_axes=in_axes), np.float64)
  return f @ f.T


def assert_gram_close(gram, ref, rtol=RTOL_F32, atol=None):
  """Compares with a tolerance relative to the Gram's scale."""
  gram = np.asarray(gram, np.float64)
  ref = np.asarray(ref, np.float64)
  assert gram.shape == ref.shape, (gram.shape, ref.shape)
  scale = max(np.abs(ref).max(), 1e-30)
  if atol is None:
    atol = ATOL_F32 * scale if rtol <= RTOL_F32 else rtol * scale
  np.testing.assert_allclose(gram, ref, rtol=rtol, atol=atol)


def rel_err(gram, ref):
  gram = np.asarray(gram, np.float64)
  ref = np.asarray(ref, np.float64)
  return float(np.abs(gram - ref).max() / max(np.abs(ref).max(), 1e-30))
