"""Examples split over mesh axes under ``shard_map``: local rows of the Gram.

Inside ``jax.shard_map`` with the example axis split over mesh axes ``A``,
each device holds ``b = B / n`` examples (``n`` = product of the sizes of
``A``). A Gram op there computes this device's rows of the global Gram,
``G[rows, :] : f32[b, B]``, so that ``out_specs=P(A, None)`` assembles the
``(B, B)`` Gram. Row ``i`` needs every example ``j``'s factors, so the
*column* factors are gathered over ``A`` (``lax.all_gather(tiled=True)``):
the example-major inputs and cotangents of the ghost method
(``B x T x (N + M)`` numbers per linear layer) or the per-example gradients
of the materialised one (``B x N x M``), whichever the cost model picks
(:func:`gram_haiku._src.gram_math.choose_strategy`). The row factors stay
local. Norms (the diagonal) need no other device's data and gather nothing.

The probe of such an op is ``[b, B]`` and varies over ``A`` (a row block per
device). Which axes to gather over comes from :func:`gathering_over`
(``value_grad_and_gram(mesh_axes=...)`` sets it), or else from the probe
itself: a ``[b, k b]`` probe that varies over mesh axes whose sizes
multiply to ``k``, taken in the mesh's axis order.

Gram kernels call :func:`columns` on every column factor; outside
:func:`gathering` it returns its argument, so the same code computes the
single-device Gram.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Optional

import jax
from jax import lax

from gram_haiku._src import errors
from gram_haiku._src import hijax_compat as hx

_LOCAL = threading.local()

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


@contextlib.contextmanager
def _scoped(name: str, value) -> Iterator[None]:
  """Sets thread-local ``name`` to ``value`` while active (for tracing)."""
  previous = getattr(_LOCAL, name, None)
  setattr(_LOCAL, name, value)
  try:
    yield
  finally:
    setattr(_LOCAL, name, previous)


def gathering_over(axes: AxisNames):
  """Declares, for tracing, that examples are split over mesh ``axes``.

  Set by ``value_grad_and_gram(mesh_axes=...)`` around the model; Gram ops
  then expect ``[b, B]`` probes and return local rows.
  """
  return _scoped("declared", tuple(axes))


def declared_axes() -> Optional[AxisNames]:
  """Axes set by :func:`gathering_over`, or None outside it."""
  return getattr(_LOCAL, "declared", None)


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


def row_axes(probe, local_size: int, mode: str, module: str) -> AxisNames:
  """The mesh axes whose other devices' examples are this op's columns.

  Declared axes win; else a ``"gram"`` probe wider than it is tall, varying
  over one mesh axis, is taken as rows of a Gram split over it. ``()``
  means the op computes the whole (single-device) Gram; so it does in the
  ``"norms"`` and ``"per_example"`` modes, whose rows are their own.
  """
  if mode != "gram":
    return ()  # Norms are local; per-example rows are gathered afterwards.
  declared = declared_axes()
  if declared is not None:
    return declared
  if probe.ndim != 2 or probe.shape[1] <= local_size:
    return ()
  return probe_axes(probe, module)


def gathering(axes: AxisNames):
  """While active, :func:`columns` gathers over ``axes`` (backward rules)."""
  return _scoped("gather", tuple(axes))


def active_gather() -> AxisNames:
  return getattr(_LOCAL, "gather", None) or ()


def columns(a: jax.Array) -> jax.Array:
  """The column factor of a Gram: ``a`` (example axis 0) from every device.

  ``f[b, ...] -> f[B, ...]`` by a tiled ``all_gather`` over the active axes;
  ``a`` itself outside :func:`gathering`.
  """
  axes = active_gather()
  if not axes:
    return a
  return lax.all_gather(a, axes if len(axes) > 1 else axes[0], axis=0,
                        tiled=True)


def gathered_rows(b: int) -> int:
  """Column count of a Gram block whose rows are ``b`` local examples."""
  return b * axes_size(active_gather())
