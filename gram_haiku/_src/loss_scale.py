"""Whether a traced loss is plainly a mean over the examples.

:func:`gram_haiku.clipped_grad` clips the gradient of each example's
contribution to the loss: with ``sum_i l_i`` that is ``g_i``; with a mean,
``g_i / B``, so the clip norm ``C`` acts as ``B C`` on the real gradients and
the privacy accounting is off by that factor. :func:`gram_haiku.verify`
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

import warnings
from typing import Any, Mapping, Optional

import numpy as np

from gram_haiku._src import errors
from gram_haiku._src import hijax_compat as hx
from gram_haiku._src import warning_site


class MeanLossWarning(UserWarning):
  """The loss given to :func:`gram_haiku.clipped_grad` looks like a mean
  over the examples (it must be their sum)."""


#: Primitives a loss value passes through unchanged in what it sums.
_TRANSPARENT = frozenset({"convert_element_type", "reshape", "squeeze",
                          "copy", "copy_p", "expand_dims",
                          "broadcast_in_dim", "reduce_precision"})
#: Primitives that call a sub-jaxpr with the same inputs and outputs.
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call",
                    "custom_jvp_call", "custom_vjp_call", "remat",
                    "checkpoint"})


def _sub_jaxpr(eqn):
  """``(jaxpr, consts)`` that a call primitive runs, or ``(None, {})``."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    sub = eqn.params.get(key)
    if sub is None:
      continue
    if hasattr(sub, "consts"):  # A ClosedJaxpr.
      return sub.jaxpr, dict(zip(sub.jaxpr.constvars, sub.consts))
    return sub, {}
  return None, {}


def _producers(jaxpr) -> dict:
  return {v: e for e in jaxpr.eqns for v in e.outvars}


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


def _source(jaxpr, var, consts, depth: int = 0):
  """``(jaxpr, eqn, consts)`` that produces ``var``, looking through
  transparent primitives and into calls; None at an input."""
  while depth < 64:
    depth += 1
    eqn = _producers(jaxpr).get(var)
    if eqn is None:
      return None
    name = eqn.primitive.name
    if name in _TRANSPARENT and eqn.invars:
      var = eqn.invars[0]
      continue
    if name in _CALLS:
      sub, sub_consts = _sub_jaxpr(eqn)
      if sub is None:
        return None
      var = sub.outvars[eqn.outvars.index(var)]
      jaxpr, consts = sub, sub_consts
      continue
    return jaxpr, eqn, consts
  return None


def _sums_over_examples(jaxpr, var, consts, batch: int) -> bool:
  """Whether ``var`` is a ``reduce_sum`` over an axis of size ``batch``."""
  found = _source(jaxpr, var, consts)
  if found is None:
    return False
  _, eqn, _ = found
  if eqn.primitive.name != "reduce_sum":
    return False
  shape = getattr(eqn.invars[0].aval, "shape", ())
  return any(shape[a] == batch for a in eqn.params.get("axes", ()))


def _multiple_of(c: Optional[float], batch: int) -> bool:
  if c is None or not np.isfinite(c) or c < batch:
    return False
  k = c / batch
  return abs(k - round(k)) <= 1e-6 * k


def looks_like_mean(jaxpr, consts: Mapping[Any, Any], batch: int) -> bool:
  """Whether the first output of ``jaxpr`` (the loss) is a sum over an axis
  of size ``batch`` divided by a multiple of ``batch`` (see the module
  docstring). ``consts``: the values of its constant variables."""
  if batch is None or not isinstance(batch, int) or batch < 2 or (
      not jaxpr.outvars):
    return False
  found = _source(jaxpr, jaxpr.outvars[0], dict(consts))
  if found is None:
    return False
  inner, eqn, inner_consts = found
  name = eqn.primitive.name
  if name == "div":
    num, den = eqn.invars
    return (_multiple_of(_scalar(den, inner_consts), batch) and
            _sums_over_examples(inner, num, inner_consts, batch))
  if name == "mul":
    for value, other in (eqn.invars, eqn.invars[::-1]):
      c = _scalar(value, inner_consts)
      if c and c > 0 and _multiple_of(1.0 / c, batch) and (
          _sums_over_examples(inner, other, inner_consts, batch)):
        return True
  return False


def warn_if_mean(fn_name: str, jaxpr, consts, batch: int) -> None:
  """Warns (:class:`MeanLossWarning`) where :func:`looks_like_mean`."""
  try:
    mean = looks_like_mean(jaxpr, consts, batch)
  except Exception:  # pylint: disable=broad-except
    return  # A program this reading does not know: say nothing.
  if mean:
    warnings.warn(errors.MEAN_LOSS_CLIPPED.format(fn=fn_name, batch=batch),
                  MeanLossWarning, stacklevel=warning_site.user_stacklevel())
