"""A plain-JAX loss as the pass pipeline's input.

The pipeline (:mod:`gram_haiku._src.passes.pass_pipeline`) runs a Haiku
``apply(params, state, rng, *batch) -> (out, new_state)``. A plain-JAX loss
``loss(params, *batch)`` over any pytree of parameters is one with no state
and no tracked layer: :class:`BareLoss` says so. Every parameter leaf of a
bare loss is covered by the program-level Gram rules read from its traced
program (:mod:`gram_haiku._src.analysis.program_rules`), or refused with
the rule's teaching error; nothing else changes (the semantics page's
example axis, sums, sharing and soundness hold as for a Haiku model).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class BareLoss:
  """``loss(params, *batch, **kwargs)`` as ``apply(params, state, rng,
  *batch, **kwargs) -> (loss(...), state)``: no Haiku state (``state`` is
  ``{}`` and passes through) and no ``rng`` (ignored).

  Attributes:
    loss: the plain-JAX loss: a scalar, the sum of the per-example losses
      (or ``(scalar, aux)`` where the caller says ``has_aux``).
  """
  loss: Callable[..., Any]

  def __call__(self, params, state, rng, *args, **kwargs):
    del rng
    return self.loss(params, *args, **kwargs), state


def is_bare(apply_fn) -> bool:
  """Whether ``apply_fn`` is a plain-JAX loss (:class:`BareLoss`)."""
  return isinstance(apply_fn, BareLoss)
