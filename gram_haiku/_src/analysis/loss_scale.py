"""Whether a traced loss is plainly a mean over the examples.

:func:`gram_haiku.clipped_grad` clips the gradient of each example's
contribution to the loss: with ``sum_i l_i`` that is ``g_i``; with a mean,
``g_i / B``, so the clip norm ``C`` acts as ``B C`` on the real gradients
(fewer examples clipped, the sum ``B`` times smaller: not jax-privacy's
result). Each example still moves the clipped sum by at most ``C`` while
``B`` is a constant (the sensitivity and the accounting hold); a divisor
computed from the batch (its count of real examples) couples the examples
and is refused by the pass. :func:`gram_haiku.verify`
tells the two apart numerically; here the program that
:func:`gram_haiku.value_grad_and_gram`'s discovery pass has traced anyway
is read, at no extra cost, for the common spelling of a mean: the loss is a
``reduce_sum`` over an axis of the batch's size divided by a constant that
is a multiple of ``B`` (``jnp.mean``, ``.sum() / B``, ``.sum() * (1 / B)``,
a mean over ``B T`` tokens), possibly through casts, reshapes and nested
``jit``. Anything else (a sum, a sum scaled by a constant that is not a
multiple of ``B``, a loss computed otherwise) is not reported: a warning,
never a guess that could refuse a sum.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, Optional

import numpy as np

from gram_haiku._src.analysis import interpreter
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.core import errors
from gram_haiku._src.core import warning_site


class MeanLossWarning(UserWarning):
  """The loss given to :func:`gram_haiku.clipped_grad` (or
  :func:`gram_haiku.cross_gram`) looks like a mean over the examples (it
  must be their sum)."""


#: Primitives a loss value passes through unchanged in what it sums.
_TRANSPARENT = frozenset({"convert_element_type", "reshape", "squeeze",
                          "copy", "copy_p", "expand_dims",
                          "broadcast_in_dim", "reduce_precision", "name"})
#: Primitives that call a sub-jaxpr with the same inputs and outputs.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call",
                    "custom_jvp_call", "custom_vjp_call", "remat",
                    "checkpoint"})

# -- the domain: what a value is, for the loss's scale --------------------------
#
# ``SUM``: a ``reduce_sum`` over an axis of the batch's size (through
# transparent primitives and calls); ``MEAN``: such a sum divided by (or
# multiplied by the inverse of) a multiple of the batch's size; a
# :class:`_Scalar`: a scalar literal or constant of the program, read as
# such only where it is an operand itself; ``OTHER``: anything else.

OTHER = "other"
SUM = "sum"
MEAN = "mean"


@dataclasses.dataclass(frozen=True)
class _Scalar:
  value: float


def _scalar(v, consts: Mapping) -> Optional[float]:
  """The value of a scalar literal or constant, or None."""
  if isinstance(v, hx.Literal):
    value = v.val
  elif v in consts:
    value = consts[v]
  else:
    return None
  try:
    a = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return None
  if a.size != 1 or not np.issubdtype(a.dtype, np.number):
    return None
  return float(a.reshape(()))


def _as_scalar(ctx, v):
  c = _scalar(v, ctx.config.consts)
  return OTHER if c is None else _Scalar(c)


def _summed(s):
  """What a transparent primitive or a call hands on: a sum or a mean (a
  scalar only where it is the operand itself)."""
  return s if s in (SUM, MEAN) else OTHER


def _transparent(ctx, eqn, ins):
  del ctx
  return [_summed(ins[0]) if ins else OTHER] * len(eqn.outvars)


def _reduce_sum(ctx, eqn, ins):
  del ins
  shape = getattr(eqn.invars[0].aval, "shape", ())
  over = any(shape[a] == ctx.config.batch for a in eqn.params.get("axes", ()))
  return [SUM if over else OTHER]


def _multiple_of(c: Optional[float], batch: int) -> bool:
  if c is None or not np.isfinite(c) or c < batch:
    return False
  k = c / batch
  return abs(k - round(k)) <= 1e-6 * k


def _div(ctx, eqn, ins):
  del eqn
  num, den = ins
  mean = (num == SUM and isinstance(den, _Scalar) and
          _multiple_of(den.value, ctx.config.batch))
  return [MEAN if mean else OTHER]


def _mul(ctx, eqn, ins):
  del eqn
  for value, other in (ins, ins[::-1]):
    c = value.value if isinstance(value, _Scalar) else None
    if c and c > 0 and _multiple_of(1.0 / c, ctx.config.batch) and (
        other == SUM):
      return [MEAN]
  return [OTHER]


def _call(ctx, eqn, ins):
  """A call: its (first) program's outputs, read inside it only (its
  operands are not followed out of it)."""
  del ins
  subs = hx.jaxprs_of(eqn)
  if not subs:
    return [OTHER] * len(eqn.outvars)
  ctx.config.consts.update(hx.closed_consts_of(eqn))
  outs = ctx.run(subs[0], [OTHER] * len(subs[0].invars), ctx.key(eqn))
  if len(outs) != len(eqn.outvars):
    return [OTHER] * len(eqn.outvars)
  return [_summed(s) for s in outs]


def _other(ctx, eqn, ins):
  del ctx, ins
  return [OTHER] * len(eqn.outvars)


#: The loss-scale rules, by primitive.
RULES = hx.rule_table({
    **{name: _transparent for name in _TRANSPARENT},
    **{name: _call for name in _CALLS},
    "reduce_sum": _reduce_sum, "div": _div, "mul": _mul,
})

#: What each value is for the loss's scale (see above).
SCALE = interpreter.Domain(
    name="loss_scale", rules=RULES, default=_other,
    join=lambda a, b: a if a == b else OTHER, bottom=OTHER,
    literal=_as_scalar, constant=_as_scalar)


@dataclasses.dataclass(frozen=True)
class _Config:
  batch: int
  consts: dict  # constant variable -> value (a call's added as it runs)


def looks_like_mean(jaxpr, consts: Mapping[Any, Any], batch: int) -> bool:
  """Whether the first output of ``jaxpr`` (the loss) is a sum over an axis
  of size ``batch`` divided by a multiple of ``batch`` (see the module
  docstring). ``consts``: the values of its constant variables."""
  if batch is None or not isinstance(batch, int) or batch < 2 or (
      not jaxpr.outvars):
    return False
  outs, _ = interpreter.interpret(
      SCALE, jaxpr, [OTHER] * len(jaxpr.invars),
      config=_Config(batch, dict(consts)))
  return outs[0] == MEAN


def warn_if_mean(fn_name: str, jaxpr, consts, batch: int) -> None:
  """Warns (:class:`MeanLossWarning`) where :func:`looks_like_mean`."""
  try:
    mean = looks_like_mean(jaxpr, consts, batch)
  except Exception:  # pylint: disable=broad-except
    return  # A program this reading does not know: say nothing.
  if mean:
    warnings.warn(_MESSAGES[fn_name].format(fn=fn_name, batch=batch),
                  MeanLossWarning, stacklevel=warning_site.user_stacklevel())


#: The public function that needs a sum -> what a mean does to its result.
_MESSAGES = {"clipped_grad": errors.MEAN_LOSS_CLIPPED,
             "cross_gram": errors.MEAN_LOSS_CROSS}
