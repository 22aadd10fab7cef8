"""The raw ``jax.grad`` path: refusals decided from Haiku's state alone,
best-effort.

Under :func:`gram_haiku.value_grad_and_gram` the traced program says which
parameter reaches which tracked use and how often. A user who instead
differentiates the probes themselves (``jax.grad`` of ``f.apply`` with
respect to the state) has no such program: :func:`refusal` decides, per
application, whether the op's Gram would be missing terms, from what
Haiku holds at that moment. It is the raw path's one set of checks (no
other module compares parameter or probe values by identity). A refusal
becomes the op's ``refusal`` (:class:`gram_haiku._src.ops.op.RuleOp`) and is
raised only if its probe is differentiated, so that the forward pass,
inference and plain parameter gradients still work.

**Best-effort.** These checks read names and the identity of Python
values, not the program's data flow, so they catch only what those show:

* a second use of a module is told by its name within the outermost Haiku
  frame (one call of the transformed function): seen across ``track()``
  blocks, ``hk.remat``, ``hk.vmap``, ``hk.cond`` and ``hk.static_unroll``;
  a module in both branches of one ``hk.cond`` counts as two uses;
* a value is the parameter Haiku stores if it *is* that value (``is``), or
  has the dtype of the module's mixed-precision policy cast of it (a
  getter that changes the values as well as casting them is not seen); a
  convolution's ``mask`` (``w * mask``) is refused as such a new value;
* one state handed to two calls of the transformed function (a siamese
  loss) is seen only where both calls get the very same probe value (held
  weakly, compared with ``is``): a state copied or rebuilt between the
  calls (``jax.tree.map(jnp.copy, state)``) is not seen, and the Gram then
  lacks the cross terms between the calls;
* not seen at all: rows of the batch reordered or mixed between layers, a
  coupled loss, a tracked parameter also used outside every ``track()``
  block, and a module none of whose parameters is differentiated.

:func:`gram_haiku.value_grad_and_gram` (and the reweighting functions)
read all of these from the traced program; use them wherever the Gram
must be right.
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


def _probe_seen_before(probe) -> bool:
  """Whether this very probe value (one traced value) was handed to a
  tracked op before, e.g. by another call of the transformed function on
  the same state (a siamese loss ``f.apply(..., x1) - f.apply(..., x2)``);
  records it. Held weakly (:func:`ambient.raw_probes`): a value no longer
  alive cannot be seen again."""
  seen = ambient.raw_probes()
  try:
    before = seen.get(id(probe)) is probe
    seen[id(probe)] = probe
  except TypeError:  # not weakly referenceable: nothing to tell
    return False
  return before


def _held_refusal(module: hk.Module, params) -> Optional[str]:
  """The refusal told by Haiku's names and stored parameters (records this
  use of the module)."""
  name = module.module_name
  if _used_before(name):
    return errors.SHARED_LAYER.format(module=name)
  if hx.inside_loop_trace():
    return errors.LOOP_BODY.format(module=name)
  if _handed_new_values(module, params):
    if getattr(module, "mask", None) is not None and isinstance(
        module, (hk.ConvND, hk.ConvNDTranspose)):
      return errors.RAW_MASKED.format(module=name)
    return errors.RAW_GETTER.format(module=name)
  if not _hands_every_parameter(module, params):
    return errors.RAW_PARAM_OUTSIDE_OP.format(module=name)
  return None


def refusal(module: hk.Module, params: Sequence[jax.Array], probe: jax.Array,
            *, coupled: Optional[str] = None) -> Optional[str]:
  """Why this application's Gram would be wrong on the raw path, or None
  (best-effort: see the module docstring).

  Args:
    module: the Haiku module being applied.
    params: the parameter values handed to the op (absent ones left out).
    probe: the probe value handed to the op.
    coupled: the handler's declaration that the application mixes the
      examples (``LayerCall.apply(coupled=...)``), or None.

  Returns:
    At ``init`` (where nothing is differentiated), the first of: the module
    was applied before in this call (weight sharing), the op runs inside a
    loop body, a getter handed it other values than the stored parameters,
    a stored parameter does not reach the op. Otherwise ``coupled`` where
    given, else the first of those, else that the same probe value reached
    another application before.
  """
  why = _held_refusal(module, params)
  if hkc.running_init():
    return why
  if coupled is not None:
    return coupled
  if why is None and _probe_seen_before(probe):
    return errors.SHARED_LAYER.format(module=module.module_name)
  return why
