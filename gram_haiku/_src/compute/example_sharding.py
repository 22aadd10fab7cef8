"""Examples split over mesh axes under ``shard_map``: local rows of the Gram.

Inside ``jax.shard_map`` with the example axis split over mesh axes ``A``,
each device holds ``b = B / n`` examples (``n`` = product of the sizes of
``A``). A Gram op there computes this device's rows of the global Gram,
``G[rows, :] : f32[b, B]``, so that ``out_specs=P(A, None)`` assembles the
``(B, B)`` Gram. Row ``i`` needs every example ``j``'s factors, so the
*column* factors are gathered over ``A`` (``lax.all_gather(tiled=True)``,
:meth:`gram_haiku._src.compute.kernels.KernelConfig.columns`): the example-major
inputs and cotangents of the ghost method (``B x T x (N + M)`` numbers per
linear layer) or the per-example gradients of the materialised one
(``B x N x M``), whichever :mod:`gram_haiku._src.compute.cost_model` picks. The row
factors stay local. Norms (the diagonal) need no other device's data and gather nothing.

The probe of such an op is ``[b, B]`` and varies over ``A`` (a row block per
device). Which axes to gather over is the op's plan (``column_axes``, from
``value_grad_and_gram(mesh_axes=...)``), or else is read from the probe
itself: a ``[b, k b]`` probe that varies over one mesh axis of size ``k``
(:func:`column_axes`).
"""

from __future__ import annotations

import math

import jax
from jax import lax

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.core import errors

AxisNames = tuple[str, ...]


def normalize_axes(mesh_axes) -> AxisNames:
  """``"data"`` or ``("data", "fsdp")`` -> a tuple of axis names."""
  if mesh_axes is None:
    return ()
  if isinstance(mesh_axes, str):
    return (mesh_axes,)
  axes = tuple(mesh_axes)
  if not all(isinstance(a, str) for a in axes):
    raise TypeError(f"mesh_axes must be a mesh axis name or a tuple of them, "
                    f"got {mesh_axes!r}.")
  return axes


def axes_size(axes: AxisNames) -> int:
  """Number of devices the example axis is split over (1 for no axes)."""
  return math.prod(lax.axis_size(a) for a in axes) if axes else 1


def in_mesh_order(axes) -> AxisNames:
  """``axes`` (a set of mesh axis names) in the current mesh's order."""
  mesh = jax.sharding.get_abstract_mesh()
  order = list(getattr(mesh, "axis_names", ()) or ())
  return tuple(sorted(axes, key=lambda a: (order.index(a) if a in order
                                           else len(order), a)))


def probe_axes(probe, module: str) -> AxisNames:
  """The one mesh axis a ``shard_map`` probe's rows are split over.

  Raises:
    ValueError: when the probe varies over several axes: it cannot say in
      which order they split its rows, and a guessed order would permute
      the Gram's columns silently.
  """
  axes = in_mesh_order(hx.varying_axes(probe))
  if len(axes) > 1:
    raise ValueError(errors.PROBE_AXES_ORDER.format(
        module=module, axes=axes, shape=tuple(probe.shape)))
  return axes


def column_axes(probe, local_size: int, mode: str, planned, module: str
                ) -> AxisNames:
  """The mesh axes whose other devices' examples are this op's columns.

  ``planned`` (the plan's ``column_axes``) wins when it is not None; else a
  ``"gram"`` probe wider than it is tall, varying over one mesh axis, is
  taken as rows of a Gram split over it. ``()`` means the op computes the
  whole (single-device) Gram; so it does in the ``"norms"`` and
  ``"per_example"`` modes, whose rows are their own.
  """
  if mode != "gram":
    return ()  # Norms are local; per-example rows are gathered afterwards.
  if planned is not None:
    return tuple(planned)
  if probe.ndim != 2 or probe.shape[1] <= local_size:
    return ()
  return probe_axes(probe, module)
