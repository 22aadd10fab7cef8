"""Where the examples flow in a tracked loss's program.

A tracked layer's Gram is over the leading axis its op takes as the example
axis. That is only the Gram of per-example gradients if that axis of the
layer's input really holds the examples, one per row in the batch's order,
and if the loss is a sum of per-example terms. Sizes cannot tell (a sequence
of length ``T == B``, positions from ``jnp.arange``, an unbatched memory of
length ``B``); the program can. :func:`check` follows the example axis of the
batch through the traced loss (``jax.make_jaxpr``, after every ``vmap`` has
been batched) with a small abstract interpretation:

* :class:`Ex` ``(dim, inner)``: the value holds the examples along ``dim``,
  each row depending on its own example only, in order; ``inner > 1`` when
  that axis merges the examples with ``inner`` positions each (``(B, T) ->
  (B T)``, as ``hk.BatchApply`` does), ``outer > 1`` when it merges them
  after other positions;
* ``CONST``: does not depend on the examples (parameters, ``iota``);
* ``SUM``: a linear combination over the examples (after a sum over them);
  the loss must be ``SUM`` (or ``CONST``);
* ``MIXED``: depends on several examples in another way (batch statistics,
  a softmax over the batch, rows reordered or subset): the examples are
  coupled;
* ``UNKNOWN``: a primitive this analysis does not model; nothing is
  concluded from it (no error).

Each Gram op's input must be ``Ex`` at the op's example-axis position with
nothing merged into it; otherwise :func:`check` raises a teaching error.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Optional, Sequence, Union

from gram_haiku._src import errors
from gram_haiku._src import hijax_compat as hx


class ExampleFlowWarning(UserWarning):
  """The examples could not be followed to a tracked layer or the loss
  through a primitive this analysis does not model: the Gram is not
  verified there (see :func:`gram_haiku.verify`)."""


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
SUM = "sum"
MIXED = "mixed"
UNKNOWN = "unknown"
State = Union[Ex, str]

_ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp
convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp
exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p
logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem
round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan
tanh xor
pvary device_put optimization_barrier
""".split())
#: Elementwise primitives that are linear in each argument (a SUM stays one).
_LINEAR = frozenset("add sub neg convert_element_type copy copy_p "
                    "reduce_precision stop_gradient pvary device_put".split())


def _untagged(s: State) -> State:
  return dataclasses.replace(s, tag=None) if isinstance(s, Ex) else s


def _value_ordered(order) -> bool:
  """Whether a reordering key (:func:`_reordered`) includes a sort: an
  order that depends on the values."""
  if not isinstance(order, tuple):
    return False
  return order[:1] == ("sort",) or any(_value_ordered(o) for o in order)


def _reordered(s: Ex, key) -> Ex:
  """``s`` with its rows reordered (or a subset) by the operation ``key``."""
  return dataclasses.replace(s, order=(s.order, key) if s.order else key)


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
      right = _untagged(cand) == real
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


def _shape(v):
  return tuple(getattr(v.aval, "shape", ()))


class _Flow:
  """The abstract interpreter (one instance per check)."""

  def __init__(self, batch: int, gram_op_type, strict: bool = False):
    self.batch = batch
    self.gram_op_type = gram_op_type
    self.strict = strict
    self.findings: list[tuple[Any, State]] = []
    self.verdicts: dict[int, bool] = {}  # candidate tag -> right so far
    self.combined: set[int] = set()  # candidates whose rows were combined
    self.unknown: set[str] = set()  # primitives not modelled, met by examples
    self._deps: list[bool] = []  # the current equation's input dependences

  def join(self, a: State, b: State) -> State:
    return join(a, b, self.verdicts)

  def run(self, jaxpr, ins: Sequence[State],
          deps: Optional[Sequence[bool]] = None) -> list[State]:
    """Abstract states of ``jaxpr``'s outputs.

    ``deps``: per input, whether it depends on the parameters. A sum over,
    or a mix of, the examples that does not (a statistic of the input data:
    centring by the batch mean) is input data for every example's gradient
    and is treated as a constant; one that does couples the examples.
    """
    deps = list(deps) if deps is not None else [True] * len(ins)
    env = dict(zip(jaxpr.invars, ins))
    dep = dict(zip(jaxpr.invars, deps))
    for v in jaxpr.constvars:
      env.setdefault(v, CONST)
      dep.setdefault(v, False)
    literal = lambda v: isinstance(v, hx.Literal)
    read = lambda v: CONST if literal(v) else env.get(v, CONST)
    for eqn in jaxpr.eqns:
      in_deps = [False if literal(v) else dep.get(v, False)
                 for v in eqn.invars]
      ins_now = []
      for s, d in zip(map(read, eqn.invars), in_deps):
        if s in (SUM, MIXED) and not d:
          if not self.strict:
            s = CONST  # Data of several examples: input data (see above).
          elif any(in_deps) or hx.gram_op_of(eqn, self.gram_op_type):
            raise ValueError(errors.DATA_COUPLED.format(
                state="a value computed from several examples' data"))
        ins_now.append(s)
      outs = self.eqn(eqn, ins_now, in_deps)
      if (UNKNOWN in outs and UNKNOWN not in ins_now and
          not hx.jaxprs_of(eqn)):
        self.unknown.add(eqn.primitive.name)
      out_dep = any(in_deps) or hx.gram_op_of(eqn, self.gram_op_type) is not None
      for v, s in zip(eqn.outvars, outs):
        env[v] = s
        dep[v] = out_dep
    self.last_deps = [False if literal(v) else dep.get(v, False)
                      for v in jaxpr.outvars]
    return [read(v) for v in jaxpr.outvars]

  # -- one equation -------------------------------------------------------------

  def eqn(self, eqn, ins: list[State], deps: list[bool]) -> list[State]:
    n_out = len(eqn.outvars)
    op = hx.gram_op_of(eqn, self.gram_op_type)
    if op is not None:
      x = ins[0]
      self.findings.append((op, x))
      if x == CONST:  # A candidate: settled where it meets the examples.
        x = Ex(op.example_axis.resolved_position() or 0,
               tag=len(self.findings) - 1)
        self.findings[-1] = (op, x)
      lead = len(op.lead_shape(op.x_aval.shape))
      out = x if not isinstance(x, Ex) or x.dim < lead else UNKNOWN
      return [out] * n_out
    if all(s == CONST for s in ins) and not hx.jaxprs_of(eqn):
      return [CONST] * n_out
    name = eqn.primitive.name
    rule = getattr(self, "_" + name.replace("-", "_"), None)
    self._deps = deps
    if name in _ELEMENTWISE:
      ins = self._implicit_broadcasts(eqn, ins)
    if name in _ELEMENTWISE or name in ("dot_general", "concatenate"):
      ins = self._data_as_constant(ins, deps)
    if rule is not None:
      return rule(eqn, ins)
    if name in _ELEMENTWISE:
      return [self._elementwise(name, ins)] * n_out
    subs = hx.jaxprs_of(eqn)
    if subs and name not in ("scan", "while", "cond"):
      outs = None
      for sub in subs:
        if len(sub.invars) != len(ins):
          return [UNKNOWN] * n_out
        res = self.run(sub, ins, deps)
        if len(res) != n_out:
          return [UNKNOWN] * n_out
        outs = (res if outs is None else
                [self.join(a, b) for a, b in zip(outs, res)])
      return outs
    if MIXED in ins:
      return [MIXED] * n_out
    return [UNKNOWN] * n_out

  def _implicit_broadcasts(self, eqn, ins):
    """Elementwise operands whose length-1 axes are broadcast to the
    output's (``lax.mul`` of ``[B, F]`` and ``[1, F]``): along the examples'
    axis that is :meth:`_broadcast_in_dim`'s repeat of one row."""
    out_shape = _shape(eqn.outvars[0])
    fixed = []
    for v, s in zip(eqn.invars, ins):
      shape = _shape(v)
      if (isinstance(s, Ex) and len(shape) == len(out_shape) and
          shape[s.dim] != out_shape[s.dim]):
        s = (self._combined(s, CONST) if s.tag is not None else
             _reordered(s, ("broadcast", id(eqn))))
      fixed.append(s)
    return fixed

  def _data_as_constant(self, ins, deps):
    """Input data met by values of the parameters: constant for them.

    In ``(out - y) ** 2`` the labels ``y`` do not couple the examples'
    gradients, whatever their rows: only values that depend on the
    parameters do. (A candidate, ``Ex.tag``, still needs to meet the data
    to be settled.) Under ``strict`` (a privacy guarantee: each example's
    gradient may depend on its own data only) data that mixes or reorders
    the examples is an error here.
    """
    param_rows = [s for s, d in zip(ins, deps)
                  if isinstance(s, Ex) and s.tag is None and d]
    if not param_rows:
      return ins
    if self.strict:
      for s, d in zip(ins, deps):
        if d:
          continue
        if s in (MIXED, SUM) or (isinstance(s, Ex) and s.tag is None and (
            s.order is not None or any(
                (p.dim, p.inner, p.outer, p.order) !=
                (s.dim, s.inner, s.outer, s.order) for p in param_rows))):
          raise ValueError(errors.DATA_COUPLED.format(
              state="rows of other examples, or in another order"))
    return [CONST if isinstance(s, Ex) and not d else s
            for s, d in zip(ins, deps)]

  def _elementwise(self, name, ins):
    states = [s for s in ins if s != CONST]
    if not states:
      return CONST
    if SUM not in states:
      out = states[0]
      for s in states[1:]:
        out = self.join(out, s)
      return out
    others = [s for s in states if s != SUM]
    if MIXED in others:
      return MIXED
    if UNKNOWN in others:
      return UNKNOWN
    if others:  # A sum over the examples meets one example's values.
      return MIXED
    if name in _LINEAR:  # sums and constants, added: still a sum
      return SUM
    if len(states) == 1 and (name == "mul" or (name == "div" and
                                               ins[0] == SUM)):
      return SUM  # a sum scaled by a constant
    return MIXED  # a nonlinear function of a sum over the examples

  # -- shape and layout -------------------------------------------------------

  def _broadcast_in_dim(self, eqn, ins):
    s = ins[0]
    if isinstance(s, Ex):
      dim = eqn.params["broadcast_dimensions"][s.dim]
      before = _shape(eqn.invars[0])[s.dim]
      after = _shape(eqn.outvars[0])[dim]
      if before != after:
        # A length-1 example axis repeated (``q[None]`` of one row met with
        # a batch): every row is that one row's.
        if s.tag is not None:
          return [self._combined(s, CONST)]
        return [_reordered(dataclasses.replace(s, dim=dim),
                           ("broadcast", id(eqn)))]
      return [dataclasses.replace(s, dim=dim)]
    return [s]

  def _transpose(self, eqn, ins):
    s = ins[0]
    if isinstance(s, Ex):
      return [dataclasses.replace(
          s, dim=list(eqn.params["permutation"]).index(s.dim))]
    return [s]

  def _squeeze(self, eqn, ins):
    s = ins[0]
    if isinstance(s, Ex):
      dims = [d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"]]
      if s.dim in dims:
        # One example's values (``h[0]``) with no example axis left: a
        # linear combination of the examples, like a sum over them.
        return [self._combined(s, SUM)]
      return [dataclasses.replace(s, dim=s.dim - sum(d < s.dim for d in dims))]
    return [s]

  def _expand_dims(self, eqn, ins):
    s = ins[0]
    if isinstance(s, Ex):
      dim = s.dim
      for d in sorted(eqn.params["dimensions"]):
        if d <= dim:
          dim += 1
      return [dataclasses.replace(s, dim=dim)]
    return [s]

  def _reshape(self, eqn, ins):
    s = ins[0]
    if not isinstance(s, Ex):
      return [s]
    old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    # Row-major: the example factor (B, or a candidate's own size) has
    # stride `stride`.
    size = old[s.dim] // (s.inner * s.outer)
    stride = s.inner * math.prod(old[s.dim + 1:])
    if size == 0 or stride == 0:
      return [UNKNOWN]  # Empty: nothing to follow.
    for k in range(len(new)):
      suffix = math.prod(new[k + 1:])
      if stride % suffix == 0 and (suffix * new[k]) % (stride * size) == 0:
        inner = stride // suffix
        return [dataclasses.replace(s, dim=k, inner=inner,
                                    outer=new[k] // (inner * size))]
    return [MIXED]

  def _combined(self, s: Ex, state: State) -> State:
    """``state``, for rows of ``s`` combined with each other (a sum, a
    maximum, a contraction over the axis). For a candidate (``s.tag``) that
    settles it as wrong: the rows its layer took for examples were merged
    before meeting any, so its parameters' per-example gradients flow
    through a value every example shares, which no row of that layer
    holds. What is left does not depend on the examples."""
    if s.tag is None:
      return state
    self.verdicts[s.tag] = False
    self.combined.add(s.tag)
    return CONST

  def _reduce(self, eqn, ins, linear: bool):
    s = ins[0]
    axes = tuple(eqn.params["axes"])
    if isinstance(s, Ex):
      if s.dim in axes:
        return [self._combined(s, SUM if linear else MIXED)]
      return [dataclasses.replace(s, dim=s.dim - sum(a < s.dim for a in axes))]
    if s == SUM and not linear:
      return [MIXED]
    return [s]

  def _reduce_sum(self, eqn, ins):
    return self._reduce(eqn, ins, linear=True)

  def _reduce_max(self, eqn, ins):
    return self._reduce(eqn, ins, linear=False)

  _reduce_min = _reduce_max
  _reduce_prod = _reduce_max
  _reduce_and = _reduce_max
  _reduce_or = _reduce_max
  _argmax = _reduce_max
  _argmin = _reduce_max

  def _along(self, eqn, ins, axis_param, on_examples):
    """Ops acting along one axis: ``on_examples(s)`` when it is the
    examples' axis."""
    s = ins[0]
    if not isinstance(s, Ex):
      return [s if s != SUM else MIXED] * len(eqn.outvars)
    axes = eqn.params[axis_param]
    axes = axes if isinstance(axes, (tuple, list)) else (axes,)
    ndim = len(_shape(eqn.invars[0]))
    out = (self._combined(s, on_examples(s))
           if s.dim in [a % ndim for a in axes] else s)
    return [out] * len(eqn.outvars)

  def _cumsum(self, eqn, ins):
    # Prefix sums over the examples: linear combinations of them.
    return self._along(eqn, ins, "axis", lambda s: SUM)

  def _cumprod(self, eqn, ins):
    return self._along(eqn, ins, "axis", lambda s: MIXED)

  _cummax = _cummin = _cumlogsumexp = _cumprod

  def _rev(self, eqn, ins):
    return self._along(eqn, ins, "dimensions",
                       lambda s: _reordered(s, ("rev",)))

  def _sort(self, eqn, ins):
    states = [s for s in ins if s != CONST]
    out = states[0]
    for s in states[1:]:
      out = self.join(out, s)
    if isinstance(out, Ex) and out.dim == eqn.params["dimension"]:
      out = _reordered(out, ("sort", id(eqn)))
    return [out] * len(eqn.outvars)

  def _split(self, eqn, ins):
    s = ins[0]
    if isinstance(s, Ex) and s.dim == eqn.params["axis"]:
      return [self._subset(s, ("split", id(eqn), k))
              for k in range(len(eqn.outvars))]
    return [s] * len(eqn.outvars)

  def _stack(self, eqn, ins):
    axis = eqn.params["axis"]
    out = CONST
    for x in ins:
      out = self.join(out, x)
    if isinstance(out, Ex) and out.dim >= axis:
      out = dataclasses.replace(out, dim=out.dim + 1)
    return [out]

  def _unstack(self, eqn, ins):
    s = ins[0]
    axis = eqn.params["axis"] % len(_shape(eqn.invars[0]))
    n = len(eqn.outvars)
    if isinstance(s, Ex):
      if s.dim == axis:  # One example per output.
        return [self._combined(s, SUM)] * n
      return [dataclasses.replace(s, dim=s.dim - (s.dim > axis))] * n
    return [s] * n

  def _fft(self, eqn, ins):
    s = ins[0]
    ndim = len(_shape(eqn.invars[0]))
    transformed = range(ndim - len(eqn.params["fft_lengths"]), ndim)
    if isinstance(s, Ex) and s.dim in transformed:
      return [self._combined(s, MIXED)]
    return [s if s != SUM else MIXED]

  def _dynamic_update_slice(self, eqn, ins):
    operand, update, *index = ins
    if any(i != CONST for i in index):
      return [MIXED if MIXED in ins else UNKNOWN]
    return [self._write(eqn, operand, update, [
        _shape(eqn.invars[1])[d] == _shape(eqn.invars[0])[d]
        for d in range(len(_shape(eqn.invars[0])))], list(range(
            len(_shape(eqn.invars[0])))))]

  def _scatter(self, eqn, ins, add: bool = False):
    operand, indices, updates = ins[:3]
    if indices != CONST or len(ins) != 3:
      return [MIXED if MIXED in ins else UNKNOWN]
    dn = eqn.params["dimension_numbers"]
    if getattr(dn, "operand_batching_dims", ()):
      return [UNKNOWN]
    ndim = len(_shape(eqn.invars[0]))
    indexed = set(dn.scatter_dims_to_operand_dims) | set(
        dn.inserted_window_dims)
    window = [k for k in range(ndim) if k not in dn.inserted_window_dims]
    # Operand axis -> update axis, for the axes written whole (window axes
    # that no index selects).
    full = [k not in indexed for k in range(ndim)]
    to_update = [dn.update_window_dims[window.index(k)] if k in window
                 else None for k in range(ndim)]
    del add  # A set and an add of rows aligned with the operand's: alike.
    return [self._write(eqn, operand, updates, full, to_update)]

  def _scatter_add(self, eqn, ins):
    return self._scatter(eqn, ins, add=True)

  _scatter_mul = _scatter_min = _scatter_max = _scatter_add

  def _write(self, eqn, operand, update, full, to_update):
    """``operand`` with ``update`` written into part of it (a scatter, a
    dynamic_update_slice). ``full[k]``: operand axis ``k`` is written whole
    (no index selects along it); ``to_update[k]``: the update's axis that
    fills operand axis ``k`` (None if none)."""
    del eqn
    if update == CONST:
      # Constants written into some rows: each row is still its own
      # example's (or constant); into all rows of an axis the same.
      return operand
    if not isinstance(update, Ex):
      return MIXED if update in (MIXED, SUM) else UNKNOWN
    dims = [k for k, u in enumerate(to_update) if u == update.dim]
    if len(dims) != 1 or not full[dims[0]]:
      # The examples written at selected rows (a permutation, a subset).
      return MIXED
    written = dataclasses.replace(update, dim=dims[0])
    if operand == CONST:
      return written
    return self.join(operand, written)

  def _concatenate(self, eqn, ins):
    dim = eqn.params["dimension"]
    if any(isinstance(s, Ex) and s.dim == dim for s in ins):
      if any(s in (MIXED, SUM) for s in ins):
        return [MIXED]
      if any(s == UNKNOWN for s in ins):
        return [UNKNOWN]
      ex = next(s for s in ins if isinstance(s, Ex))
      return [_reordered(ex, ("concat", id(eqn)))]
    out = CONST
    for s in ins:
      out = self.join(out, s)
    return [out]

  def _pad(self, eqn, ins):
    s = ins[0]
    if isinstance(s, Ex) and tuple(eqn.params["padding_config"][s.dim]) != (
        0, 0, 0):
      return [MIXED]
    return [self.join(s, ins[1]) if ins[1] != CONST else s]

  def _subset(self, s: Ex, key) -> State:
    """Rows ``s`` reduced to a subset (``key``). Of rows sorted by their
    values (``jnp.sort(l)[-1]``, the largest), a subset depending on the
    parameters is a choice among the examples, like a maximum."""
    if _value_ordered(s.order) and any(self._deps):
      return MIXED
    return _reordered(s, key)

  def _slice(self, eqn, ins):
    s = ins[0]
    if isinstance(s, Ex):
      start = eqn.params["start_indices"][s.dim]
      limit = eqn.params["limit_indices"][s.dim]
      strides = eqn.params["strides"]
      step = strides[s.dim] if strides else 1
      size = _shape(eqn.invars[0])[s.dim]
      if (start, limit, step) != (0, size, 1):
        # A subset of the examples, or reordered.
        return [self._subset(s, ("slice", start, limit, step))]
    return [s]

  def _dynamic_slice(self, eqn, ins):
    s = ins[0]
    if any(i != CONST for i in ins[1:]):
      return [MIXED if MIXED in ins else UNKNOWN]  # data-dependent start
    if isinstance(s, Ex):
      full = _shape(eqn.invars[0])[s.dim] == eqn.params["slice_sizes"][s.dim]
      return [s if full else self._subset(s, ("dynamic_slice", id(eqn)))]
    return [s]

  def _dot_general(self, eqn, ins):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    lnd, rnd = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lfree = [d for d in range(lnd) if d not in lc and d not in lb]
    rfree = [d for d in range(rnd) if d not in rc and d not in rb]

    def out_dim(side, d):
      if side == 0:
        if d in lb:
          return list(lb).index(d)
        return len(lb) + lfree.index(d)
      if d in rb:
        return list(rb).index(d)
      return len(lb) + len(lfree) + rfree.index(d)

    states = []
    for side, s, contract, batch in ((0, lhs, lc, lb), (1, rhs, rc, rb)):
      if not isinstance(s, Ex):
        states.append(("plain", s))
      elif s.dim in contract:
        states.append(("contracted", list(contract).index(s.dim), s))
      elif s.dim in batch:
        states.append(("batch", list(batch).index(s.dim), s))
      else:
        states.append(("free", out_dim(side, s.dim), s))
    plain = [st[1] for st in states if st[0] == "plain"]
    if MIXED in plain:
      return [MIXED]
    if UNKNOWN in plain:
      return [UNKNOWN]
    if SUM in plain:
      # A sum over the examples times constants is still one; times one
      # example's values (or another sum) it is not.
      return [SUM if plain.count(CONST) == 1 else MIXED]
    ex = [st for st in states if st[0] != "plain"]
    if not ex:
      return [CONST]
    if len(ex) == 1:
      kind, pos, s = ex[0]
      if kind == "contracted":
        return [self._combined(s, SUM)]
      if kind == "batch":
        return [dataclasses.replace(s, dim=pos)]
      return [dataclasses.replace(s, dim=pos)]
    (k1, p1, s1), (k2, p2, s2) = ex
    if (s1.tag is None) != (s2.tag is None):
      # A candidate meets the examples: right only along a shared batch dim.
      cand, real = (ex[0], ex[1]) if s1.tag is not None else (ex[1], ex[0])
      right = cand[0] == real[0] == "batch" and cand[1] == real[1]
      self.verdicts[cand[2].tag] = self.verdicts.get(cand[2].tag,
                                                     True) and right
      kind, pos, s = real
      return [SUM if kind == "contracted" else
              dataclasses.replace(s, dim=pos)]
    if k1 == k2 == "batch" and p1 == p2 and s1 == s2:
      return [dataclasses.replace(s1, dim=p1)]
    if k1 == k2 == "contracted" and p1 == p2 and s1 == s2:
      return [SUM]  # sum_i f(x_i) g(x_i)
    return [MIXED]  # e.g. x x^T over the batch: pairs of examples

  def _conv_general_dilated(self, eqn, ins):
    lhs, rhs = ins[0], ins[1]
    if rhs not in (CONST,):
      return [MIXED if rhs == MIXED or isinstance(rhs, Ex) else UNKNOWN]
    if not isinstance(lhs, Ex):
      return [lhs]
    dn = eqn.params["dimension_numbers"]
    if lhs.dim != dn.lhs_spec[0] or eqn.params.get("batch_group_count", 1) != 1:
      return [MIXED]
    return [dataclasses.replace(lhs, dim=dn.out_spec[0])]

  def _gather(self, eqn, ins):
    operand, indices = ins[0], ins[1]
    if MIXED in (operand, indices):
      return [MIXED]
    if UNKNOWN in (operand, indices) or SUM in (operand, indices):
      return [UNKNOWN if SUM not in (operand, indices) else MIXED]
    dn = eqn.params["dimension_numbers"]
    out_ndim = len(_shape(eqn.outvars[0]))
    idx_ndim = len(_shape(eqn.invars[1]))
    # Output dims not in offset_dims follow the indices' dims (but the last,
    # the index vector), in order.
    batch_dims = [d for d in range(out_ndim) if d not in dn.offset_dims]
    collapsed = tuple(getattr(dn, "collapsed_slice_dims", ()))
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))

    def idx_out(d):  # output position of an indices dim
      return batch_dims[d] if d < idx_ndim - 1 and d < len(batch_dims) else None

    if isinstance(indices, Ex):
      out = idx_out(indices.dim)
      if out is None:
        return [MIXED]
      if operand == CONST:  # a table looked up by per-example ids
        return [dataclasses.replace(indices, dim=out)]
      e = operand.dim
      aligned = (e in op_batching and
                 idx_batching[op_batching.index(e)] == indices.dim and
                 operand.order == indices.order)
      if operand.tag is not None and indices.tag is None:
        # A candidate meets the examples (indices): settled here.
        self.verdicts[operand.tag] = self.verdicts.get(operand.tag,
                                                       True) and aligned
        return [dataclasses.replace(indices, dim=out)]
      if aligned:  # take_along_axis: each example indexes its own row.
        return [dataclasses.replace(operand, dim=out)]
      if e in dn.start_index_map:
        # Rows picked by per-example indices (x[perm], o[arange(B), t]):
        # one example each, in an order the program does not show.
        return [_reordered(dataclasses.replace(operand, dim=out),
                           ("gather", id(eqn.invars[1])))]
      return [MIXED]
    # Constant indices.
    if operand.dim in op_batching:
      # Batched along the examples (take_along_axis with constant indices):
      # each example indexes its own row.
      out = idx_out(idx_batching[op_batching.index(operand.dim)])
      return [UNKNOWN if out is None else
              dataclasses.replace(operand, dim=out)]
    if operand.dim in dn.start_index_map or operand.dim in collapsed:
      if tuple(dn.start_index_map) == (operand.dim,) and batch_dims and (
          operand.dim in collapsed):
        return [_reordered(dataclasses.replace(operand, dim=batch_dims[0]),
                           ("gather", id(eqn.invars[1])))]
      return [MIXED]
    full = eqn.params["slice_sizes"][operand.dim] == _shape(
        eqn.invars[0])[operand.dim]
    if not full:
      return [MIXED]
    kept = [d for d in range(len(_shape(eqn.invars[0])))
            if d not in collapsed and d not in op_batching]
    return [dataclasses.replace(operand,
                                dim=dn.offset_dims[kept.index(operand.dim)])]

  def _reduce_window(self, eqn, ins):
    s = ins[0]
    if not isinstance(s, Ex):
      return [s if s != SUM else MIXED] * len(eqn.outvars)
    d = s.dim
    window = eqn.params["window_dimensions"][d]
    stride = eqn.params["window_strides"][d]
    pad = tuple(eqn.params["padding"][d])
    if (window, stride, pad) != (1, 1, (0, 0)):
      return [MIXED] * len(eqn.outvars)  # pooling across examples
    return [s] * len(eqn.outvars)

  _reduce_window_sum = _reduce_window_max = _reduce_window_min = _reduce_window

  def _top_k(self, eqn, ins):
    s = ins[0]
    if isinstance(s, Ex) and s.dim == len(_shape(eqn.invars[0])) - 1:
      return [MIXED] * len(eqn.outvars)  # the top examples of the batch
    return [s if s != SUM else MIXED] * len(eqn.outvars)

  # -- control flow ---------------------------------------------------------------

  def _cond(self, eqn, ins):
    index, ops = ins[0], ins[1:]
    outs = None
    for branch in eqn.params["branches"]:
      res = self.run(branch.jaxpr, ops, self._deps[1:])
      outs = (res if outs is None else
              [self.join(a, b) for a, b in zip(outs, res)])
    if index in (SUM, MIXED):
      # One branch for the whole batch, chosen from values that depend on
      # the parameters and on several examples: each example alone could
      # take another one.
      outs = [MIXED if o != CONST else o for o in outs]
    return outs

  def _scan(self, eqn, ins):
    body = eqn.params["jaxpr"].jaxpr
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, xs = (ins[:n_consts], ins[n_consts:n_consts + n_carry],
                         ins[n_consts + n_carry:])
    sliced = []
    for s in xs:
      if isinstance(s, Ex):
        # Scanning over the examples, one per step: each step sees one
        # example's values, a linear combination of the examples (so a
        # carry that accumulates them, or a layer applied to them, mixes
        # the examples).
        sliced.append(self._combined(s, SUM) if s.dim == 0 else
                      dataclasses.replace(s, dim=s.dim - 1))
      else:
        sliced.append(s)
    for _ in range(4):  # Fixed point of the carry (a short lattice).
      deps = self._deps
      outs = self.run(body, list(consts) + list(carry) + sliced,
                      list(deps[:n_consts]) + [True] * n_carry +
                      list(deps[n_consts + n_carry:]))
      new = [self.join(a, b) for a, b in zip(carry, outs[:n_carry])]
      if new == list(carry):
        break
      carry = new
    ys = [dataclasses.replace(s, dim=s.dim + 1) if isinstance(s, Ex) else s
          for s in outs[n_carry:]]
    return list(carry) + ys

  def _while(self, eqn, ins):
    cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    body = eqn.params["body_jaxpr"].jaxpr
    consts, carry = ins[cond_n:cond_n + body_n], ins[cond_n + body_n:]
    for _ in range(4):
      deps = self._deps
      outs = self.run(body, list(consts) + list(carry),
                      list(deps[cond_n:cond_n + body_n]) + [True] * len(carry))
      new = [self.join(a, b) for a, b in zip(carry, outs)]
      if new == list(carry):
        break
      carry = new
    if any(s != CONST for s in ins[:cond_n]):
      carry = [UNKNOWN if s == CONST else s for s in carry]
    return list(carry)


def check(jaxpr, in_states: Sequence[State], batch: int,
          gram_op_type, names: Optional[dict] = None,
          strict: bool = False) -> bool:
  """Raises a teaching error where the examples do not flow as a Gram needs.

  Args:
    jaxpr: the traced loss (its live part).
    in_states: one state per input of the jaxpr (``Ex(0)`` for the batch's
      arrays, ``CONST`` for parameters, probes and state).
    batch: ``B``.
    gram_op_type: the base class of Gram ops.
    names: op name -> module (state) name, for messages.
    strict: also refuse data of other examples meeting an example's
      parameter-dependent values (a privacy guarantee needs each example's
      gradient to depend on its own data only; a Gram does not).

  Returns:
    True when the examples were followed to every Gram op's example axis
    (nothing unknown on the way), False when some could not be.

  Raises:
    ValueError: a tracked layer whose input does not carry the examples
      along its example axis (``EXAMPLE_AXIS_NOT_EXAMPLES``), merges them
      with other positions (``EXAMPLES_MERGED``) or mixes them
      (``EXAMPLES_COUPLED``); or a loss that is not a sum of per-example
      terms (``LOSS_COUPLED``).
  """
  if batch == 0:
    return False  # No examples: every Gram is empty.
  flow = _Flow(batch, gram_op_type, strict)
  deps = [s == CONST for s in in_states]  # parameters, probes: not data
  outs = flow.run(jaxpr, list(in_states), deps)
  names = names or {}
  verified = True
  unfollowed = []  # modules the examples could not be followed to
  for op, state in flow.findings:
    module = names.get(op.name, op.name)
    position = op.example_axis.resolved_position()
    shape = tuple(op.x_aval.shape)
    if state == UNKNOWN:
      verified = False
      unfollowed.append(module)
      continue
    if isinstance(state, Ex) and state.tag is not None:
      if flow.verdicts.get(state.tag, True):
        if state.tag not in flow.verdicts and flow.unknown:
          unfollowed.append(module)  # Met the examples only past the unknown.
        verified = verified and state.tag in flow.verdicts
        continue  # A shared input broadcast along the examples (or unmet).
      found = ("does not depend on the examples, and its output is "
               "summed, reduced or contracted over that axis before it "
               "meets them" if state.tag in flow.combined else
               "does not depend on the examples, and its output meets "
               "them along another axis")
      raise ValueError(errors.EXAMPLE_AXIS_NOT_EXAMPLES.format(
          module=module, shape=shape, position=position, found=found))
    if state in (MIXED, SUM):
      raise ValueError(errors.EXAMPLES_COUPLED.format(module=module,
                                                      shape=shape))
    if state.order is not None:
      raise ValueError(errors.EXAMPLES_REORDERED.format(module=module,
                                                        shape=shape))
    if state.dim != position:
      raise ValueError(errors.EXAMPLE_AXIS_NOT_EXAMPLES.format(
          module=module, shape=shape, position=position,
          found=f"holds the examples along axis {state.dim}"))
    if state.inner != 1 or state.outer != 1:
      raise ValueError(errors.EXAMPLES_MERGED.format(
          module=module, shape=shape, position=position, inner=state.inner,
          outer=state.outer))
    if op.example_size() != batch:
      raise ValueError(errors.EXAMPLES_SUBSET.format(
          module=module, shape=shape, size=op.example_size(), batch=batch))
  if outs and outs[0] == MIXED and flow.last_deps[0]:
    raise ValueError(errors.LOSS_COUPLED)
  if outs and outs[0] == UNKNOWN and flow.last_deps[0]:
    unfollowed.append("the loss")
  if unfollowed:
    message = errors.EXAMPLES_NOT_FOLLOWED.format(
        primitives=", ".join(sorted(flow.unknown)) or "(none recorded)",
        where=", ".join(dict.fromkeys(unfollowed)))
    if strict:
      raise ValueError(message + errors.EXAMPLES_NOT_FOLLOWED_PRIVACY)
    warnings.warn(message, ExampleFlowWarning, stacklevel=3)
  return verified and bool(flow.findings)
