"""Operator-norm and rounding bounds of a linear program, read from its jaxpr.

A reparametrising getter's pull-back ``g_i = J^T f_i``
(:mod:`gram_haiku._src.analysis.reparam`) maps each example's stored gradient
``f_i`` (off by at most ``e_i`` in norm, its rounding bound) through the
getter's VJP. For the clip factor's norm to stay a sound upper bound of the
true ``|J^T w_i|`` (``w_i`` the exact ``f_i``),

    ``|J^T w_i| <= |fl(J^T f_i)| + L (e_i + r |f_i|)``,

with ``L >= |J^T|`` (the operator 2-norm) and ``r`` the VJP's own relative
rounding. Both are read here from the VJP's program, which is linear in the
cotangent: every equation that depends on it is linear in it, its other
operands are constants of the program (the residuals at ``theta``). A table
keyed by primitive gives each linear equation's norm factor from its
constants:

* ``mul``/``div`` by a constant ``a``: ``max|a|`` (``max|1/a|``): a diagonal
  map;
* ``dot_general`` with a constant ``a``: ``|a|_F`` (Cauchy-Schwarz per output
  entry, summed);
* ``reduce_sum`` of ``n`` terms into each output: ``sqrt(n)``; a broadcast
  copying each entry ``n`` times: ``sqrt(n)``; ``cumsum`` over ``n``: ``n``;
* ``add``/``sub``/``select_n``: the sum of the operands' factors (the
  triangle inequality); ``concatenate``: their root sum of squares;
* reshapes, transposes, casts, slices, zero padding: 1.

Along the program the factors compose: a variable's ``L`` bounds the norm of
the map from the cotangent to it (sums over paths of products along them).
The rounding count ``N`` of a variable is the largest, over its paths, of
the summed term counts of the equations on the path (``n`` per ``n``-term
dot product or sum, 1 per elementwise operation); with ``r = gamma_N``
(:func:`gram_haiku._src.compute.norm_bounds.dot_error`) each equation's rounding,
``<= u k_j |v_j|``, carried through the rest of the program, sums to at most
``r L |f|`` (first order in ``u``; ``gamma`` covers the rest).

**Underflow.** The rounding model is relative; a result below its dtype's
smallest normal number (``tiny``) may be flushed to zero (XLA's CPU
backend flushes subnormals), an absolute error of at most ``tiny`` per
operation. A getter ``w 1e-2 1e19 1e19 1e-19 1e-19`` has a VJP whose
intermediate ``f 1e-38`` flushes for cotangents near 1, while its
gradient, ``1e-2 f``, is representable. So each variable also carries
``A``, a bound (norm units, independent of the cotangent) of the effect of
every result flushed on its paths: an equation's own flushed results,
``2 k tiny sqrt(size)`` for ``k`` roundings per output entry, plus its
operands' ``A`` mapped by the equation's factor (its rule applied to
them). The factors themselves are float32 numbers whose products and sums
of squares could flush too (``L`` of that getter was 0): they are formed
so that they never fall below the exact factor (:func:`_times`,
:func:`_norm`; no factor below ``tiny``). And XLA does not run the program
as written: it folds ``(u c1) c2`` into ``u (c1 c2)`` where ``c1``, ``c2``
are constants of the compiled program (``w 1e-2 1e19 1e19 1e-19 1e-19``
compiles to ``f 0``). Where a product of consecutive factors flushes
(in float32 here, at run time), the value it scales may be lost whole:
``E``, in units of ``|ct|``, the ``L`` of that value, carried like ``A``.

An equation the table does not know, or one that is not linear in the
cotangent (a product of two dependent operands, a cast to integers, a
constant added to a dependent value: ``g + k`` is affine, and only a
constant known to be zero, a literal 0 and what reshapes, broadcasts and
casts make of it, may join a dependent value), leaves the program
unbounded: :func:`bound` then says why, and the caller refuses.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from gram_haiku._src.analysis import interpreter
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import norm_bounds


class _Lin:
  """A variable that depends on the cotangent: ``|v| <= L |ct|``, rounded
  at most ``n`` times along any path, and off by at most ``a`` (norm
  units) from the results flushed to zero on its paths.

  Where it is a product by a value or a broadcast, its form too, so that
  a sum or product that follows is bounded per output entry
  (Cauchy-Schwarz) rather than by ``sqrt(n) max |c|``:
  ``scaled = (u, c, raw)``: ``|v| = c * |u|`` elementwise (``c`` from
  above, ``raw`` the float32 product of the factors' magnitudes, which may
  have flushed); ``spread = (u, axes, c)``: ``v_j = c_j u_{o(j)}``, ``u``
  copied along ``axes`` (``c`` None: 1).

  ``e``: a bound of the error, in units of ``|ct|``, of values lost where
  XLA folds a product of constant factors that flushes to zero (see the
  module docstring)."""
  __slots__ = ("l", "n", "scaled", "spread", "a", "e")

  def __init__(self, l, n: int, scaled=None, spread=None, a=0.0, e=0.0):
    self.l, self.n, self.scaled, self.spread = l, n, scaled, spread
    self.a, self.e = a, e


_TINY = float(jnp.finfo(jnp.float32).tiny)


def _floor(x) -> jax.Array:
  """``max(|x|, tiny)`` in float32: above the exact value of a factor
  whose float32 computation flushed to zero (or was exact)."""
  return jnp.maximum(jnp.abs(jnp.asarray(x, jnp.float32)), _TINY)


def _times(*factors) -> jax.Array:
  """The product of nonnegative factor bounds, never below the exact
  product of factors at least ``tiny``: each partial product floored at
  ``tiny`` (above the exact one wherever the float32 one flushed), the
  whole rounded up by ``(1 + 2^-22)`` per product."""
  static = [f for f in factors if isinstance(f, (int, float))]
  traced = [f for f in factors if not isinstance(f, (int, float))]
  k = 1.0  # (the static factors in Python: no equations traced for them)
  for f in static:
    k = max(k * max(f, _TINY) * (1 + 2.0 ** -22), _TINY)
  if not traced:
    return jnp.float32(k)
  out = jnp.maximum(traced[0], _TINY)
  for f in traced[1:]:
    out = jnp.maximum(out * f, _TINY)
  up = k * (1 + 2.0 ** -22) ** len(traced)
  return jnp.maximum(out * up, _TINY) if up != 1.0 else out


def _norm(c, axes=None) -> jax.Array:
  """``sqrt(sum c^2)`` over ``axes`` (None: all), from above: scaled by
  the largest ``|c|`` (the squares neither overflow nor flush but the
  ratios below ``sqrt(tiny)``, ``n tiny`` in all) and rounded up."""
  c = jnp.abs(jnp.asarray(c, jnp.float32))
  if not c.size:
    return jnp.float32(0)
  m = jnp.max(c, axis=axes, keepdims=True)
  s = jnp.sum(jnp.square(c / jnp.where(m > 0, m, 1)), axis=axes)
  n = c.size // max(s.size, 1)
  m = jnp.squeeze(m, axis=axes)
  out = _times(m, jnp.sqrt((s + n * _TINY) * (1 + 2.0 ** -23 * (n + 4))))
  return jnp.where(jnp.isinf(m), jnp.inf, out)  # (not inf / inf)


def _grouped(c, axes) -> jax.Array:
  """``max_o sqrt(sum_{j in o} c_j^2)``, ``o`` ranging over the entries
  of ``c`` with ``axes`` summed out."""
  c = jnp.asarray(c, jnp.float32)
  return jnp.max(_norm(c, tuple(axes))) if c.size else jnp.float32(0)


def _size(aval) -> int:
  return math.prod(aval.shape)


def _max_abs(a) -> jax.Array:
  return jnp.max(jnp.abs(jnp.asarray(a, jnp.float32))) if jnp.size(a) else (
      jnp.float32(0))


def _frobenius(a) -> jax.Array:
  return _norm(a)


def _unary(k: float = 1.0, rounds: int = 0):
  """A map of its first operand that keeps norms (times ``k``): casts,
  reshapes, slices (whose other operands, start indices, must be
  constants)."""
  def rule(eqn, ins):
    if not isinstance(ins[0], _Lin) or any(
        isinstance(x, _Lin) for x in ins[1:]):
      if eqn.primitive.name != "optimization_barrier":
        return (f"`{eqn.primitive.name}` whose indices or shape depend on "
                "the cotangent (not linear)")
    lins = [x for x in ins if isinstance(x, _Lin)]
    return _Lin(_times(sum(x.l for x in lins), k),
                max(x.n for x in lins) + rounds)
  return rule


def _resized(eqn, ins):
  """``reduce_sum`` (``n`` terms into each output) and broadcasts (each
  entry copied ``n`` times): a factor ``sqrt(n)``; a sum rounds ``n``
  times. A sum of a product ``c * u`` is bounded by ``max_o |c_o|``."""
  (lin,) = [x for x in ins if isinstance(x, _Lin)]
  n_in, n_out = _size(eqn.invars[0].aval), _size(eqn.outvars[0].aval)
  if eqn.primitive.name == "reduce_sum":  # A sum of n_in / n_out terms.
    n = max(n_in // max(n_out, 1), 1)
    l = _times(lin.l, math.sqrt(n))
    if lin.scaled is not None:
      u, c, _ = lin.scaled
      l = jnp.minimum(l, _times(u.l, _grouped(c, eqn.params["axes"])))
    return _Lin(l, lin.n + n)
  shape_in = eqn.invars[0].aval.shape
  shape_out = eqn.outvars[0].aval.shape
  kept = eqn.params["broadcast_dimensions"]
  axes = tuple(d for d in range(len(shape_out)) if d not in kept) + tuple(
      d for k, d in enumerate(kept) if shape_in[k] != shape_out[d])
  spread = (lin, axes, None)
  if lin.scaled is not None and jnp.shape(lin.scaled[1]) == shape_in:
    u, c, _ = lin.scaled
    spread = (u, axes, lax.broadcast_in_dim(c, shape_out, kept))
  return _Lin(_times(lin.l, math.sqrt(n_out // max(n_in, 1))), lin.n,
              spread=spread)


class _Zero:
  """A constant of the program known to be exactly zero (a literal 0 and
  what reshapes, broadcasts, casts and slices make of it): the only
  constant a linear map may add to what depends on the cotangent."""
  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value


def _value(x):
  return x.value if isinstance(x, _Zero) else x


def _affine(eqn, ins, operands):
  """Why ``eqn`` is not linear, where one of ``operands`` (indices) is a
  constant not known to be zero (``g + k``: an affine map); else None."""
  for k in operands:
    if not isinstance(ins[k], (_Lin, _Zero)):
      return (f"`{eqn.primitive.name}` of a value that depends on the "
              "cotangent and a constant not known to be zero (an affine "
              "map, not a linear one)")
  return None


def _sum_of(eqn, ins):
  """``add``, ``sub``, ``add_any``, ``select_n`` (its predicate constant):
  the sum of the dependent operands' factors; any constant operand must
  be a known zero."""
  cases = range(len(ins))
  if eqn.primitive.name == "select_n":
    if isinstance(ins[0], _Lin):
      return (f"`select_n` whose predicate depends on the cotangent (not "
              "linear)")
    cases = range(1, len(ins))
  why = _affine(eqn, ins, cases)
  if why:
    return why
  lins = [x for x in ins if isinstance(x, _Lin)]
  rounds = 0 if eqn.primitive.name == "select_n" else 1
  return _Lin(sum(x.l for x in lins), max(x.n for x in lins) + rounds)


def _scaled(eqn, ins):
  """``mul`` by a constant (a diagonal map: ``max|a|``), ``div`` of a
  dependent operand by a constant (``max|1/a|``); products compose, and a
  product of a broadcast is bounded by ``max_o |c_o|``."""
  lins = [k for k, x in enumerate(ins) if isinstance(x, _Lin)]
  if len(lins) != 1:
    return (f"`{eqn.primitive.name}` of two values that depend on the "
            "cotangent (quadratic, not linear)")
  k = lins[0]
  lin, const = ins[k], _value(ins[1 - k])
  c = jnp.broadcast_to(jnp.asarray(const, jnp.float32),
                       eqn.outvars[0].aval.shape)
  if eqn.primitive.name == "div":
    if k != 0:
      return "`div` by a value that depends on the cotangent (not linear)"
    c = 1.0 / c
  raw = jnp.abs(c)
  c = _floor(c)  # (|c|, from above: 1 / c may flush)
  l = _times(lin.l, _max_abs(c))
  base, folded = lin, None
  if lin.scaled is not None:  # c * (c0 * u)
    base, c0, raw0 = lin.scaled
    # XLA folds ``(u c0) c`` into ``u (c0 c)`` where both are constants:
    # a product of factors that flushes loses the value it scales.
    product = raw * raw0
    folded = jnp.any((raw > 0) & (raw0 > 0) & (product < _TINY))
    raw = product
    c = _times(c, c0)
    l = jnp.minimum(l, _times(base.l, _max_abs(c)))
  if lin.spread is not None:  # c_j c0_j u_{o(j)}
    u, axes, c0 = lin.spread
    l = jnp.minimum(l, _times(u.l, _grouped(
        c if c0 is None else _times(c, c0), axes)))
  e = 0.0 if folded is None else jnp.where(folded, l, 0.0)
  return _Lin(l, lin.n + 1, scaled=(base, c, raw), e=e)


def _dot(eqn, ins):
  """``dot_general`` with one constant operand ``a``: ``|a|_F``; its
  contraction of ``n`` terms rounds ``n`` times."""
  lins = [k for k, x in enumerate(ins) if isinstance(x, _Lin)]
  if len(lins) != 1:
    return ("`dot_general` of two values that depend on the cotangent "
            "(quadratic, not linear)")
  k = lins[0]
  (contract, _), _ = eqn.params["dimension_numbers"]
  n = math.prod(eqn.invars[0].aval.shape[d] for d in contract)
  return _Lin(_times(ins[k].l, _frobenius(_value(ins[1 - k]))),
              ins[k].n + max(n, 1))


def _concatenate(eqn, ins):
  why = _affine(eqn, ins, range(len(ins)))
  if why:
    return why
  lins = [x for x in ins if isinstance(x, _Lin)]
  return _Lin(_norm(jnp.stack([jnp.asarray(x.l, jnp.float32)
                               for x in lins])), max(x.n for x in lins))


def _cumsum(eqn, ins):
  (lin,) = [x for x in ins if isinstance(x, _Lin)]
  n = eqn.invars[0].aval.shape[eqn.params["axis"]]
  return _Lin(_times(lin.l, n), lin.n + n)


def _pad(eqn, ins):
  """Padding with a known zero keeps norms (any other padding value is an
  affine, not linear, map)."""
  if not isinstance(ins[1], _Zero):
    return ("`pad` with a padding value not known to be zero (an affine "
            "map, not a linear one)")
  if not isinstance(ins[0], _Lin):
    return None
  return _unary()(eqn, ins[:1])


def _update(eqn, ins):
  """``dynamic_update_slice``: the operand and the update, summed (both
  dependent, or a known zero)."""
  why = _affine(eqn, ins, (0, 1))
  if why:
    return why
  lins = [x for x in ins[:2] if isinstance(x, _Lin)]
  return _Lin(sum(x.l for x in lins), max(x.n for x in lins))


def _cast(eqn, ins):
  """A cast keeps norms, rounding once; to an integer or boolean type it
  is not linear."""
  if not jnp.issubdtype(eqn.params["new_dtype"], jnp.inexact):
    return (f"`convert_element_type` to {jnp.dtype(eqn.params['new_dtype'])}"
            " of a value that depends on the cotangent (not linear)")
  return _unary(rounds=1)(eqn, ins)


#: Primitive name -> ``rule(eqn, ins) -> _Lin or str`` for an equation
#: with at least one operand that depends on the cotangent (the others are
#: values, :class:`_Zero` where known to be zero); a string says why it is
#: not linear in it.
RULES: dict[str, Callable[..., Any]] = {
    **{name: _unary() for name in (
        "neg", "reshape", "transpose", "squeeze", "expand_dims", "copy",
        "copy_p", "rev", "slice", "dynamic_slice", "real", "imag",
        "reduce_precision", "optimization_barrier", "split", "pvary",
        "name")},
    "pcast": lambda eqn, ins: (
        _unary()(eqn, ins) if eqn.params.get("to") == "varying" else
        f"`pcast` to {eqn.params.get('to')!r} (not known to keep values)"),
    "convert_element_type": _cast,
    "reduce_sum": _resized,
    "broadcast_in_dim": _resized,
    "add": _sum_of, "sub": _sum_of, "add_any": _sum_of, "select_n": _sum_of,
    "mul": _scaled, "div": _scaled,
    "dot_general": _dot,
    "concatenate": _concatenate,
    "cumsum": _cumsum,
    "pad": _pad,
    "dynamic_update_slice": _update,
}

#: Primitives whose result is zero where their first ``k`` operands are
#: (by name: ``k``); other constants are not known to be zero.
_KEEPS_ZERO = {
    **{name: 1 for name in (
        "broadcast_in_dim", "reshape", "convert_element_type", "squeeze",
        "expand_dims", "transpose", "copy", "copy_p", "slice", "rev", "neg",
        "dynamic_slice", "reduce_sum", "real", "imag", "split", "pvary",
        "pcast", "name")},
    "pad": 2, "concatenate": 1 << 30, "add": 2, "add_any": 2, "sub": 2,
}


def _is_concrete_zero(val) -> bool:
  """Whether ``val`` is a concrete value (not traced), all zeros."""
  if isinstance(val, jax.core.Tracer):
    return False
  try:
    return bool(np.all(np.asarray(val) == 0))
  except Exception:  # pylint: disable=broad-except
    return False


#: Calls whose body is a program of its own: interpreted inline.
_CALLS = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def _body(eqn):
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    inner = eqn.params.get(key)
    if inner is not None:
      return inner
  return None


def _rounds_in(dtype, unit: float) -> int:
  """Roundings of relative size ``unit`` that one rounding in ``dtype``
  counts for (a bfloat16 operation in a float32 program: ``2^16``)."""
  if not jnp.issubdtype(dtype, jnp.inexact):
    return 1
  return max(1, math.ceil(float(jnp.finfo(dtype).eps) / unit))


# -- the domain on the program interpreter ---------------------------------------
#
# A value is a constant (by value; a concrete zero as :class:`_Zero`) or a
# :class:`_Lin`. Constant equations are evaluated; calls are followed
# inside; every other equation that depends on the cotangent goes to
# :data:`RULES`, and one it does not bound ends the run (:class:`_Unbounded`).


class _Unbounded(Exception):
  """An equation that leaves the program unbounded, and why."""

  def __init__(self, why: str):
    super().__init__(why)
    self.why = why


class _Config:
  """A run's constants (by constant variable; a call's are added as it
  runs) and its rounding unit."""

  def __init__(self, consts: dict, unit: float):
    self.consts, self.unit = consts, unit


def _known(c):
  return _Zero(c) if _is_concrete_zero(c) else c


def _constant_eqn(eqn, vals) -> list:
  """An equation of constants alone, evaluated (a concrete zero kept as
  one where the primitive keeps zeros)."""
  name = eqn.primitive.name
  zero = name in _KEEPS_ZERO and all(
      isinstance(x, _Zero) for x in vals[:_KEEPS_ZERO[name]])
  outs = hx.bind_equation(eqn, [_value(x) for x in vals])
  return [_Zero(o) for o in outs] if zero else outs


def _linear_eqn(ctx, eqn, vals) -> list:
  """An equation that depends on the cotangent: its rule's bound, with its
  own roundings counted in its output's dtype."""
  name = eqn.primitive.name
  rule = RULES.get(name)
  out = rule(eqn, vals) if rule is not None else None
  if not isinstance(out, _Lin):
    raise _Unbounded(out or f"`{name}`")
  base = max(x.n for x in vals if isinstance(x, _Lin))
  out_aval = eqn.outvars[0].aval
  own = out.n - base
  factor = _factor(rule, eqn, vals)
  a = _flushed(factor, vals, own, out_aval)
  e = _carried(factor, vals, "e")
  e = out.e if _is_zero(e) else e + out.e
  if own > 0:  # Its own roundings, in its output's dtype.
    out = _Lin(out.l, base + own * _rounds_in(
        out_aval.dtype, ctx.config.unit), out.scaled, out.spread)
  out.a, out.e = a, e
  return [out] * len(eqn.outvars)


def _factor(rule, eqn, vals):
  """The equation's factor for errors that the rest of the program maps
  as it maps the cotangent (``a``, ``e``): its rule applied to unit
  bounds, without the forms that refine ``L`` (None where its operands
  carry none). A rule is monotone and homogeneous in its operands'
  bounds, so the factor times their largest bound is above the rule of
  those bounds."""
  if all(not isinstance(x, _Lin) or (_is_zero(x.a) and _is_zero(x.e))
         for x in vals):
    return None
  return rule(eqn, [_Lin(jnp.float32(1), x.n) if isinstance(x, _Lin)
                    else x for x in vals]).l


def _carried(factor, vals, field: str):
  """The operands' ``field`` (``a`` or ``e``) through the equation's
  ``factor`` (:func:`_factor`)."""
  values = [getattr(x, field) for x in vals if isinstance(x, _Lin)
            and not _is_zero(getattr(x, field))]
  if factor is None or not values:
    return 0.0
  return _times(factor, functools.reduce(jnp.maximum, values))


def _flushed(factor, vals, rounds: int, aval):
  """``A`` of an equation's output (see the module docstring): its
  operands' ``A`` carried (:func:`_carried`), plus its own ``rounds``
  roundings per entry, each flushing at most ``tiny`` of its output's
  dtype (twice, for a product and the sum it joins)."""
  carried = _carried(factor, vals, "a")
  if rounds <= 0 or not jnp.issubdtype(aval.dtype, jnp.inexact):
    return carried
  tiny = float(jnp.finfo(aval.dtype).tiny)
  own = 2 * rounds * tiny * math.sqrt(max(_size(aval), 1)) * (1 + 2.0 ** -20)
  return carried + own  # (carried is at least tiny or 0: no flush)


def _is_zero(a) -> bool:
  return isinstance(a, (int, float)) and a == 0


def _equation(ctx, eqn, vals) -> list:
  """The domain's step (:attr:`interpreter.Domain.equation`)."""
  if not any(isinstance(x, _Lin) for x in vals):
    return _constant_eqn(eqn, vals)
  if eqn.primitive.name in _CALLS and _body(eqn) is not None:
    inner = _body(eqn)
    body = getattr(inner, "jaxpr", inner)
    ctx.config.consts.update(zip(body.constvars,
                                 getattr(inner, "consts", ())))
    return ctx.run(body, vals, ctx.key(eqn))
  return _linear_eqn(ctx, eqn, vals)


#: The linear bound of each value (see the module docstring).
LINEAR = interpreter.Domain(
    name="linear_bound", rules={}, default=None, join=None, bottom=None,
    literal=lambda ctx, v: _known(v.val),
    constant=lambda ctx, v: _known(ctx.config.consts[v]),
    equation=_equation)


def _run(jaxpr, consts, ins, unit: float):
  """Interprets ``jaxpr``: constants by value, dependent variables as
  :class:`_Lin`; ``(outs, why)``, ``why`` a string where a dependent
  equation is not in :data:`RULES` or not linear. Rounding counts are in
  roundings of relative size ``unit`` (an equation computed in a wider
  unit counts as several, :func:`_rounds_in`)."""
  config = _Config(dict(zip(jaxpr.constvars, consts)), unit)
  try:
    outs, _ = interpreter.interpret(LINEAR, jaxpr, ins, config=config)
  except _Unbounded as e:
    return None, e.why
  return outs, None


def bound(fun: Callable[..., Any], *args: Any):
  """``(L, N, precision, None)`` for a function ``fun`` linear in its
  arguments (all of them depend on the cotangent): ``|fun(*args)| <= L
  |args|`` (all outputs together, in the 2-norm), and every output
  rounds at most ``N`` times along any path, in roundings of the
  arguments' dtype (an operation in a narrower dtype counts for as many
  as its unit roundoff is larger; see the module docstring);
  ``precision`` the lowest of its dot products' (``None`` for none, else
  a ``lax.Precision``). ``L`` is a float32 scalar computed in the
  caller's trace. ``(None, None, None, why)`` where the program is not
  linear in its arguments, or uses a primitive without a rule here.
  :func:`bound_and_flushed` adds the absolute allowance for results
  flushed to zero."""
  l, n, precision, _, why = bound_and_flushed(fun, *args)
  return l, n, precision, why


def pulled_back_error(vjp: Callable[..., Any], cts, rows: jax.Array,
                      err: Optional[jax.Array] = None):
  """``([B] bound, None)`` or ``(None, why)``: the error of pulling each
  example's row ``rows[i]`` (``[B, P]``, the stored values ``f_i``) back by
  the linear ``vjp`` in floating point, against the exact pull-back of the
  exact ``w_i`` (``|f_i - w_i| <= err_i``, ``err: [B]``; ``None``: the rows
  are exact): ``(L r + E) |f_i| + A + L (1 + r) err_i``, with :func:`
  bound_and_flushed`'s ``L, A, E`` read from ``vjp(*cts)`` (``cts``: one
  example's cotangents, values unused) and ``r`` its rounding bound
  (:func:`gram_haiku._src.compute.norm_bounds.dot_error`)."""
  l, n, precision, (a, e), why = bound_and_flushed(vjp, cts)
  if why:
    return None, why
  r = norm_bounds.dot_error(n, rows.dtype, precision)
  out = (l * r + e) * norm_bounds.row_norms(rows) + a
  if err is not None:  # |J^T (f - w)| <= L |f - w|, and J^T's own rounding
    out = out + l * (1 + r) * err.astype(out.dtype)
  return out, None


def bound_and_flushed(fun: Callable[..., Any], *args: Any):
  """``(L, N, precision, (A, E), why)``: :func:`bound`'s, and float32
  scalars ``A``, ``E`` with ``|fl(fun(*args)) - fun(*args)| <= (r L + E)
  |args| + A`` where ``r`` is ``N``'s rounding bound
  (:func:`gram_haiku._src.compute.norm_bounds.dot_error`): what the
  results flushed to zero add (``A``), and the values lost where XLA folds
  constant factors whose product flushes (``E``; 0 unless one does; see
  the module docstring)."""
  closed = jax.make_jaxpr(fun)(*args)
  leaves = jax.tree.leaves(args)
  # Counts in roundings of the arguments' (the accumulation) dtype.
  unit = float(jnp.finfo(jnp.result_type(*leaves)).eps)
  outs, why = _run(closed.jaxpr, list(closed.consts),
                   [_Lin(jnp.float32(1), 0)] * len(leaves), unit)
  if why:
    return None, None, None, (None, None), why
  if any(not isinstance(o, (_Lin, _Zero)) for o in outs):
    return None, None, None, (None, None), (
        "an output that does not depend on the cotangent and is not known "
        "to be zero (an affine map, not a linear one)")
  lins = [o for o in outs if isinstance(o, _Lin)]
  if not lins:
    return jnp.float32(0), 0, None, (jnp.float32(0), jnp.float32(0)), None
  # Each output's L bounds it by max_k |ct_k| <= |ct| (every argument
  # started at L = 1); the outputs together by their root sum of squares
  # (A by their sum).
  l = _norm(jnp.stack([jnp.asarray(o.l, jnp.float32) for o in lins]))
  a = _times(sum(jnp.asarray(o.a, jnp.float32) for o in lins), 1)
  e = sum(jnp.asarray(o.e, jnp.float32) for o in lins)
  return (l, max(o.n for o in lins), _lowest_precision(closed.jaxpr),
          (a, e), None)


def _lowest_precision(jaxpr):
  """``lax.Precision.HIGHEST`` where every dot product of the program
  (nested calls included) asks for it, else ``lax.Precision.DEFAULT``."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      p = eqn.params.get("precision")
      p = p[0] if isinstance(p, tuple) else p
      if p != lax.Precision.HIGHEST:
        return lax.Precision.DEFAULT
    for inner in hx.jaxprs_of(eqn):
      if _lowest_precision(inner) != lax.Precision.HIGHEST:
        return lax.Precision.DEFAULT
  return lax.Precision.HIGHEST
