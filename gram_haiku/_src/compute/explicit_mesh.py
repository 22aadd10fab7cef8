"""Helpers for arrays laid out over a mesh with Explicit axes.

Under a mesh whose axes are ``jax.sharding.AxisType.Explicit`` every array
carries its ``PartitionSpec`` in its type, and reshapes and contractions
whose output sharding JAX cannot infer must be given one. The Gram kernels
keep the example axis (axis 0) sharded as the input's and replicate the
rest; these helpers spell that out. Outside such a mesh each is the plain
operation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gram_haiku._src.core import errors


def rows_sharding(a: jax.Array, out_ndim: int):
  """``out_sharding`` for a contraction whose output rows are ``a``'s axis 0.

  Under a mesh with Explicit axes, a contraction between two operands that
  are both sharded along the example axis has no implied output sharding
  and must be given one: the output keeps ``a``'s example-axis sharding on
  its first axis (rows) and is replicated along the others. None otherwise.
  """
  spec = explicit_spec(a)
  if not spec or spec[0] is None:
    return None
  return jax.sharding.PartitionSpec(spec[0], *([None] * (out_ndim - 1)))




def explicit_spec(a: jax.Array):
  """``a``'s PartitionSpec under a mesh with Explicit axes, else None.

  Raises:
    ValueError: if ``a`` is sharded over Explicit mesh axes but no mesh is
      set (``jax.set_mesh``): JAX then cannot resolve the output shardings
      that the Gram contractions need.
  """
  return spec_of_type(jax.typeof(a))


def _has_explicit_axis(mesh) -> bool:
  explicit = jax.sharding.AxisType.Explicit
  return any(t == explicit for t in getattr(mesh, "axis_types", ()))


def under_explicit_mesh() -> bool:
  """Whether the current mesh (``jax.set_mesh``) has an Explicit axis."""
  mesh = jax.sharding.get_abstract_mesh()
  return not mesh.empty and _has_explicit_axis(mesh)


def spec_of_type(aval):
  """:func:`explicit_spec` of an array type (``jax.typeof`` of an array)."""
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not _has_explicit_axis(mesh):
    return None
  if jax.sharding.get_abstract_mesh().empty:
    raise ValueError(errors.EXPLICIT_MESH_NOT_SET.format(
        shape=tuple(aval.shape), dtype=aval.dtype, spec=sharding.spec,
        axes=dict(zip(mesh.axis_names, mesh.axis_sizes))))
  return sharding.spec


def reshard_like(value: jax.Array, spec) -> jax.Array:
  """``value`` resharded to ``spec`` (from :func:`explicit_spec`), if any."""
  if spec is None or explicit_spec(value) == spec:
    return value
  return jax.sharding.reshard(value, spec)




def merge_leading(a: jax.Array, n: int) -> jax.Array:
  """Merges ``a``'s first ``n`` axes into one (a new axis of 1 for ``n=0``).

  Under an Explicit mesh the merged axis keeps the first axis's sharding
  (row-major merging keeps each shard contiguous when only the first axis is
  sharded), given as the reshape's ``out_sharding``.
  """
  shape = (math.prod(a.shape[:n]),) + tuple(a.shape[n:])
  spec = explicit_spec(a)
  if spec is None or n == 0:
    return a.reshape(shape)
  spec = tuple(spec) + (None,) * (a.ndim - len(spec))
  out = jax.sharding.PartitionSpec(spec[0], *spec[n:])
  return jnp.reshape(a, shape, out_sharding=out)




def reshape_rows(a: jax.Array, shape) -> jax.Array:
  """``a.reshape(shape)`` keeping axis 0 (and its sharding) as it is.

  Under an Explicit mesh a reshape needs its output sharding spelt out;
  this one keeps axis 0's and replicates the rest.
  """
  spec = explicit_spec(a)
  if spec is None:
    return a.reshape(shape)
  lead = spec[0] if len(spec) else None
  out = jax.sharding.PartitionSpec(lead, *([None] * (len(shape) - 1)))
  return jnp.reshape(a, shape, out_sharding=out)




def split_leading(a: jax.Array, lead: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`merge_leading`: axis 0 becomes ``lead``."""
  shape = tuple(lead) + tuple(a.shape[1:])
  spec = explicit_spec(a)
  if spec is None or not lead:
    return a.reshape(shape)
  spec = tuple(spec) + (None,) * (a.ndim - len(spec))
  out = jax.sharding.PartitionSpec(spec[0], *([None] * (len(lead) - 1)),
                                   *spec[1:])
  return jnp.reshape(a, shape, out_sharding=out)
