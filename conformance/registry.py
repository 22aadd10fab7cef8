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
    make_params: ``(key, dtype) -> params`` pytree.
    make_example: ``(key, lead_shape, dtype) -> x`` with leading axes
      ``lead_shape`` (example axis first, then within-example axes).
    apply: ``(params, probe, x) -> y`` calling the Gram op; ``probe`` is the
      ``(B, B)`` zero probe.
    plain: ``(params, x) -> y``, the same computation untracked.
  """
  name: str
  make_params: Callable[[jax.Array, Any], Any]
  make_example: Callable[[jax.Array, tuple[int, ...], Any], jax.Array]
  apply: Callable[[Any, jax.Array, jax.Array], jax.Array]
  plain: Callable[[Any, jax.Array], jax.Array]


_REGISTRY: dict[str, OpSpec] = {}


def register(spec: OpSpec) -> OpSpec:
  """Adds ``spec`` to the suite; re-registering a name replaces it."""
  _REGISTRY[spec.name] = spec
  return spec


def registered_ops() -> list[OpSpec]:
  """All registered specs, the built-in gram_haiku ops included."""
  from conformance import builtin_ops  # pylint: disable=g-import-not-at-top,unused-import
  return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)
