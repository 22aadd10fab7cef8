"""The states of the example-flow analysis
(:mod:`gram_haiku._src.analysis.example_flow`): a small lattice, and how two states
meet.

* :class:`Ex` ``(dim, inner)``: the value holds the examples along ``dim``,
  each row depending on its own example only, in order; ``inner > 1`` when
  that axis merges the examples with ``inner`` positions each (``(B, T) ->
  (B T)``, as ``hk.BatchApply`` does), ``outer > 1`` when it merges them
  after other positions;
* ``CONST``: does not depend on the examples (parameters, ``iota``);
* ``SUM``: a linear combination over the examples (after a sum over them,
  or one example's values alone); the loss must be ``SUM`` (or ``CONST``);
* ``MIXED``: depends on several examples in another way (batch statistics,
  a softmax over the batch, rows reordered or subset): the examples are
  coupled;
* ``UNKNOWN``: met a primitive the analysis does not model; nothing is
  concluded from it (:mod:`gram_haiku._src.analysis.example_flow` warns).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union


@dataclasses.dataclass(frozen=True)
class Ex:
  """The examples lie along axis ``dim`` (``size = outer * B * inner``).

  ``tag``: not the examples yet, but the output of tracked layers whose
  input does not depend on them (positions, a learned query): a
  *candidate*, right if it meets the examples along the same axis (a
  broadcast shared input), wrong if along another one (``arange(T)``
  embedded and broadcast over the batch).
  """
  dim: int
  inner: int = 1
  outer: int = 1
  tag: Optional[int] = None
  #: None: the rows are the examples in the batch's order. Otherwise a key
  #: of the reordering (a slice, a reversal, rows picked by index): each row
  #: is still one example's, so sums over them are sums of per-example
  #: terms, but a layer taking them as its example axis would not be.
  order: Any = None


CONST = "const"
#: A note (not a state): the value is computed from a closed-over array
#: with an axis of the batch's size (see :mod:`gram_haiku._src.analysis.example_flow`).
CLOSED = "closed"
SUM = "sum"
MIXED = "mixed"
UNKNOWN = "unknown"
State = Union[Ex, str]

ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp complex
conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv
erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p
logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem
round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan
tanh xor
pvary device_put optimization_barrier name
""".split())
#: Elementwise primitives that are linear in each argument (a SUM stays one).
LINEAR = frozenset("add sub neg convert_element_type copy copy_p "
                    "reduce_precision stop_gradient pvary device_put name "
                    "conj real imag complex".split())


def untagged(s: State) -> State:
  return dataclasses.replace(s, tag=None) if isinstance(s, Ex) else s


def reordered(s: Ex, key) -> Ex:
  """``s`` with its rows reordered (or a subset) by the operation ``key``."""
  return dataclasses.replace(s, order=(s.order, key) if s.order else key)


class Rows(tuple):
  """An :attr:`Ex.order` known row by row: the batch row each row holds."""


def rows_of(s: Ex, size: int):
  """The batch rows ``s`` holds along its ``size``-row examples' axis,
  where each is known (the axis holds the examples alone, in the batch's
  order or a :class:`Rows` order), else None."""
  if s.tag is not None or s.inner != 1 or s.outer != 1:
    return None
  if s.order is None:
    return tuple(range(size))
  return tuple(s.order) if isinstance(s.order, Rows) else None


def with_rows(s: Ex, rows, batch: int) -> Ex:
  """``s`` holding the batch rows ``rows`` in that order: the batch's own
  order again (``order=None``) when they are ``0 .. batch - 1``."""
  rows = Rows(rows)
  return dataclasses.replace(
      s, order=None if rows == tuple(range(batch)) else rows)


def pick_rows(s: Ex, positions, size: int, batch: int) -> Ex:
  """``s`` with the rows at ``positions`` (of its ``size`` rows along the
  examples' axis) kept, in that order: a slice, a reversal, a split.

  Where every row's example is known (:func:`rows_of`), the order is
  followed row by row, so that putting the rows back
  (``concatenate([h[:2], h[2:]])``, ``flip(flip(h))``) is the batch's
  order again; else the key is opaque.
  """
  positions = tuple(positions)
  current = rows_of(s, size)
  if current is None:
    return reordered(s, ("rows", positions))
  return with_rows(s, (current[p] for p in positions), batch)


def join(a: State, b: State, verdicts: Optional[dict] = None) -> State:
  """The least state covering both; settles candidates (``Ex.tag``) met by
  the examples, recording ``verdicts[tag] = right`` when given."""
  if isinstance(a, Ex) and isinstance(b, Ex) and a.order != b.order:
    return MIXED  # rows of different examples meet
  if isinstance(a, Ex) and isinstance(b, Ex) and a.tag != b.tag:
    if a.tag is not None and b.tag is not None:
      return a if a.dim == b.dim else MIXED
    cand, real = (a, b) if a.tag is not None else (b, a)
    if verdicts is not None:
      right = untagged(cand) == real
      verdicts[cand.tag] = verdicts.get(cand.tag, True) and right
    return real
  if a == b:
    return a
  if MIXED in (a, b):
    return MIXED
  if UNKNOWN in (a, b):
    return UNKNOWN
  if a == CONST:
    return b
  if b == CONST:
    return a
  return MIXED  # Ex vs another Ex, or Ex vs SUM


def shape(v):
  return tuple(getattr(v.aval, "shape", ()))
