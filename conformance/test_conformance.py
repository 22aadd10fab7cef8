"""The conformance families over every registered op (pytest conformance)."""

import jax.numpy as jnp
import pytest

from conformance import checks

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_backward_parity(conformance_op, dtype):
  checks.check_backward_parity(conformance_op, dtype)


LAYOUTS = [(d, axes) for d, layouts in checks.VMAP_LAYOUTS.items()
           for axes in layouts]


@pytest.mark.parametrize("jit", ["none", "inside", "outside"])
@pytest.mark.parametrize("depth,axes", LAYOUTS,
                         ids=[f"depth{d}-axes{a}" for d, a in LAYOUTS])
def test_vmap_depth_invariance(conformance_op, depth, axes, jit):
  del depth
  checks.check_vmap_depth_invariance(conformance_op, axes, jit)
