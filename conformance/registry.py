"""Registry of Gram ops under test (Haiku's module-descriptor pattern)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """How to exercise one Gram op.

  Attributes:
    name: a short id, used in test ids.
    make_params: ``(key, dtype) -> params``, a dict of arrays of ``dtype``.
    make_example: ``(key, lead_shape, dtype) -> x`` with leading axes
      ``lead_shape`` (example axis first, then within-example axes) followed
      by the shape one application of the op consumes. For an op with
      ``integer_input``, ``dtype`` is ignored and ``x`` holds integers.
    apply: ``(params, probe, x, **op_kwargs) -> y`` calling the Gram op.
      ``op_kwargs`` may hold ``example_axis`` (an
      :class:`gram_haiku.ExampleAxis`) and ``mode`` (``"gram"``,
      ``"norms"``); pass them on to the op. ``probe`` is the zero probe:
      ``(B, B)`` for ``"gram"``, ``(B,)`` for ``"norms"``.
    plain: ``(params, x) -> y``, the same computation untracked; must
      accept ``x`` with any number of leading axes.
    integer_input: ``x`` is integer (ids): its cotangent must be ``float0``
      and its dtype is not varied.
  """
  name: str
  make_params: Callable[[jax.Array, Any], Any]
  make_example: Callable[[jax.Array, tuple[int, ...], Any], jax.Array]
  apply: Callable[..., jax.Array]
  plain: Callable[[Any, jax.Array], jax.Array]
  integer_input: bool = False


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
  """Adds ``spec`` to the suite; re-registering a name replaces it."""
  _REGISTRY[spec.name] = spec
  return spec


def registered_ops() -> list[OpSpec]:
  """All registered specs, the built-in gram_haiku ops included."""
  from conformance import ops  # pylint: disable=g-import-not-at-top
  ops.load_all()
  return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)
