"""The raw ``jax.grad`` path: refusals decided from Haiku's state alone.

Under :func:`gram_haiku.value_grad_and_gram` the traced program says which
parameter reaches which tracked use and how often. A user who instead
differentiates the probes themselves (``jax.grad`` of ``f.apply`` with
respect to the state) has no such program; this module decides, per
application, whether the op's Gram would be missing terms, from what
Haiku holds: the module's name within the outermost frame, its stored
parameters and the probe value it was handed. A refusal is written into
the op (its ``refusal``, :class:`gram_haiku._src.ops.op.RuleOp`) and raised only if
its probe is differentiated, so that the forward pass, inference and plain
parameter gradients still work.
"""

from __future__ import annotations

from typing import Optional, Sequence

import haiku as hk
import jax

from gram_haiku._src.compat import haiku_compat as hkc
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.core import errors
from gram_haiku._src.frontend import ambient
from gram_haiku._src.frontend import coverage as coverage_lib


def _is_stored(module: hk.Module, p, stored) -> bool:
  """Whether ``p`` is the parameter value Haiku holds, ``stored``, or its
  cast by the module's mixed-precision policy."""
  return p is stored or (p.shape == stored.shape and
                         coverage_lib.policy_cast(module, stored, p))


def _handed_new_values(module: hk.Module, params) -> bool:
  """Whether the layer gets other values than the parameters Haiku holds
  for its module (or their policy cast), from a custom getter entered
  inside ``track()`` or outside it, before or after the next getter."""
  stored = hkc.stored_parameters(module.module_name)
  return not all(any(_is_stored(module, p, s) for s in stored)
                 for p in params)


def _hands_every_parameter(module: hk.Module, params) -> bool:
  """Whether every parameter Haiku holds for the module reaches the op (a
  handler that applies one outside the op, ``s * op(x, w)`` or
  ``op(x + b, w)``, leaves its gradient out of every Gram)."""
  return all(any(_is_stored(module, p, s) for p in params)
             for s in hkc.stored_parameters(module.module_name))


def _used_before(name: str) -> bool:
  """Whether module ``name`` was applied before in this call.

  Keyed by the module's name within the outermost Haiku frame, so that a
  second use is seen across ``track()`` contexts, Haiku's lifted
  transforms (``hk.remat``, ``hk.vmap``, ``hk.cond`` push frames of their
  own, and pass the parameters as new values) and getters that hand out a
  new array per read. ``hk.static_unroll`` re-creates its modules under the
  same names, so it is seen too; ``hk.layer_stack`` traces its body once.
  """
  uses = ambient.raw_uses(hkc.outermost_frame_id())
  shared = name in uses
  uses.add(name)
  return shared


def refusal_before_probe(module: hk.Module, params: Sequence[jax.Array]
                         ) -> Optional[str]:
  """Why this application's Gram would be wrong, or None.

  Args:
    module: the Haiku module being applied.
    params: the parameter values handed to the op (absent ones left out).

  Returns:
    The teaching error of the first case that applies: the module was
    applied before (weight sharing), the op runs inside a loop body, a
    getter handed it other values than the stored parameters, or a stored
    parameter does not reach the op; None where none does.
  """
  name = module.module_name
  if _used_before(name):
    return errors.SHARED_LAYER.format(module=name)
  if hx.inside_loop_trace():
    return errors.LOOP_BODY.format(module=name)
  if _handed_new_values(module, params):
    return errors.RAW_GETTER.format(module=name)
  if not _hands_every_parameter(module, params):
    return errors.RAW_PARAM_OUTSIDE_OP.format(module=name)
  return None


def seen_probe_refusal(name: str, probe: jax.Array) -> Optional[str]:
  """The refusal where the same probe value reaches a second application
  (two calls of the transformed function on one state): their Grams'
  cross terms would be missing; else None. Not checked at ``init``."""
  if not hkc.running_init() and ambient.probe_seen_before(probe):
    return errors.SHARED_LAYER.format(module=name)
  return None
