"""Program-level Gram rules: parameters no tracked module covers, read from
the traced program.

A parameter created with a bare ``hk.get_parameter`` (learned positions, a
class token, a logit scale) reaches no Gram op: no module rule covers it.
Its per-example gradient can still be read from the program where its use
has a rule. This is a domain on the program interpreter
(:mod:`gram_haiku._src.analysis.interpreter`) whose state per value says
which such parameters it is an example-independent function of (the
*prefix*: ``q = f(p)``, e.g. ``p``, ``exp(p)``, a reshape or broadcast of
it) and whether it depends on the examples' data.

Where a prefix value meets the data, the equation's *site rule* (the table
:data:`SITE_RULES`, keyed by primitive, in the style of JAX's
``primitive_batchers``) says whether that use is a *site*: the prefix
broadcast along the examples' axis ``e`` into a value ``Z`` that the rest
of the program may treat as an input. Every slice of ``Z`` along ``e`` is
the same function ``F_1(p)`` of the parameters, and slice ``i`` meets
example ``i``'s data alone, so with ``Z`` differentiated as an input,

    ``g_i = J_{F_1}(p)^T (dL/dZ)[i]``                     (exact)

is example ``i``'s gradient with respect to ``p`` (summed over the sites
of ``p``: the cross terms of several uses are in the sum). Rules today:

* ``broadcast``: an elementwise primitive (``add``, ``mul``, ``sub``,
  ``div``, ...) with a prefix operand that it broadcasts (a rank-0 or a
  size-1 operand, or one broadcast by ``broadcast_in_dim`` earlier in the
  prefix) and a data operand: ``Z`` is the prefix operand at the output's
  shape (positions, layer scales, temperatures);
* ``concatenate``: a prefix operand broadcast along the examples,
  concatenated with the data along another axis (class and register
  tokens): ``Z`` is that operand;
* ``dot_general``, ``conv_general_dilated``, ``gather``,
  ``dynamic_slice`` (:data:`PER_EXAMPLE_RULES`): a prefix operand
  contracted, convolved or indexed by the data (a bare weight in ``x @ W``
  or ``jnp.einsum``, either operand; a kernel in ``lax.conv``; a table read
  by ``table[ids]``): ``Z`` is the operand stacked per example,
  ``[B, *operand.shape]`` (its examples' axis 0), and the pass evaluates
  the equation once per example (``jax.vmap`` over ``Z``'s axis 0 and the
  data's examples' axis, :func:`gram_haiku._src.compat.hijax_compat.
  bind_per_example`), so that ``(dL/dZ)[i]`` is example ``i``'s gradient
  of the operand. :func:`resolve` reads the data's and the output's
  examples' axes from the example flow, and checks that the evaluation
  per example gives the output's shape (a batch dimension the parameter
  shares, or data without an examples' axis, such as ``dynamic_slice``'s
  scalar start, is refused). It costs ``B x |operand|`` memory, three
  times over (:func:`gram_haiku._src.compute.cost_model.
  per_example_operand_bytes`): a tracked layer (``hk.Conv*``,
  ``hk.Embed``) takes the ghost methods instead. A ``dot_general`` of the
  shape of ``hk.Linear``'s product (:data:`LINEAR_FORMS`: a 2-D weight
  contracted with the data on one axis, no batch axes;
  :attr:`Site.linear`) is not evaluated per example: the pass binds the
  linear layer's Gram op there
  (:mod:`gram_haiku._src.passes.program_pass`), at ``hk.Linear``'s cost.

The prefix itself runs any example-independent program, and may take
constants (a zero carry: ``zeros @ kernel + bias`` is the first step of a
recurrent cell unrolled in Python), whose constant axes are tracked
alike; :data:`PREFIX_RULES` (elementwise primitives, ``broadcast_in_dim``,
``tile``, ``slice``, ``split``, ``dot_general``) say along which axes
their outputs are constant. A value broadcast along an axis (size above
1) may only go on through these before it meets the data (and not be
contracted by ``dot_general``): a sum over a broadcast over the batch
(``sum(broadcast_to(p, (B, D)), 0)``) would make each example's share
depend on ``B``.

Where a prefix value and the data meet inside a call-like primitive (one
with programs in its parameters), :data:`CALL_RULES` (keyed by primitive)
says how it is followed: a ``jit`` call and a ``checkpoint``
(``hk.remat``) inside, their derivative being their body's
(:func:`_into_call`); a ``cond``/``switch`` whose index does not depend on
the examples into every branch, one of which runs for the whole batch
(:func:`_into_cond`); a ``scan`` into its body, for prefix values that are
its constants, each site's ``Z`` then a constant of the replayed loop whose
gradient sums the steps (:func:`_into_scan`). The sites found inside carry
the calls that hold them (:attr:`Site.calls`), which the pass replays with
``Z`` in place (:func:`gram_haiku._src.compat.hijax_compat.replay`). A
function with a custom derivative that takes a prefix value with the data
is refused (:func:`_custom_derivative`: its rule, not its body, is
differentiated); one of the data alone (``jax.nn.relu(x @ w)``) takes no
prefix value. A prefix value that meets the data by any other primitive
(a ``while_loop``, a ``cond`` chosen from the examples, a loop carry or
scanned input, a primitive without a rule), that leaves a branch or loop
(:func:`_leaving`), or that reaches the loss without meeting the data (a
penalty on the parameter, which belongs to no example), is a
:class:`Refusal`: the parameter stays untracked, and the message names
the primitive and the user's line.

A parameter that a tracked module's op also reads as one of its
parameters (a tied output: ``hk.Embed``'s lookup and ``h @
embed.embeddings.T``; :attr:`gram_haiku._src.analysis.dataflow.Discovery.mixed`)
is followed here too (``tracked`` of :func:`find`): that read is the
module's own (its rule gives that part of the gradient), not a use
without a rule, and the sites' per-example gradients are added to the
module's (:attr:`Program.tracked`; the pass keeps the module's
per-example gradients for that).

Which axis of ``Z`` is the examples' (``e``) is read from the example-flow
analysis (:mod:`gram_haiku._src.analysis.example_flow`): the state of the
site's output. :func:`resolve` checks that ``Z`` is constant along it and
holds ``B`` rows (for a per-example site, that the output holds the
examples along one axis). That each slice of ``Z`` reaches its example's
loss alone is what the example-flow check proves for every value computed
from the parameters (a sum over the batch before a nonlinearity is refused
there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src.analysis import interpreter
from gram_haiku._src.analysis.flow_states import CONST
from gram_haiku._src.analysis.flow_states import ELEMENTWISE
from gram_haiku._src.analysis.flow_states import Ex
from gram_haiku._src.analysis.flow_states import SUM
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.core import errors


@dataclasses.dataclass(frozen=True)
class Val:
  """A value's state.

  Attributes:
    leaves: the untracked parameter leaves it is an example-independent
      function of (a prefix value); empty otherwise.
    data: it depends on the examples (the batch, a probe, a Gram op).
    const: for a prefix value, the axes along which it is constant (its
      size-1 axes and those a broadcast made).
    stepped: for a ``data`` value, it is computed from a loop's carries and
      scanned inputs that do not depend on the examples (a step counter)
      and from constants only: it changes from step to step (so it is no
      prefix value), the same for every example (a ``cond`` may branch on
      it, :func:`_into_cond`).
  """
  leaves: frozenset = frozenset()
  data: bool = False
  const: frozenset = frozenset()
  stepped: bool = False


def _join(a: Val, b: Val) -> Val:
  data = a.data or b.data
  return Val(a.leaves | b.leaves, data, a.const & b.const,
             data and _stepped(a) and _stepped(b))


def _stepped(v: Val) -> bool:
  """Whether ``v`` does not depend on the examples (a prefix value, a
  constant, or a :attr:`Val.stepped` value)."""
  return not v.data or v.stepped


@dataclasses.dataclass(frozen=True)
class Site:
  """A finding: a use of untracked parameters with a rule.

  Attributes:
    eqn: the equation (of the program's own).
    operand: the index of its prefix operand.
    leaves: the parameter leaves the operand is computed from.
    shape: the shape of ``Z``.
    const: the axes of ``Z`` along which it is constant.
    rule: the rule's name (for :attr:`Grams.coverage`).
    line: the user's line, for messages.
    axis: the examples' axis of ``Z`` (set by :func:`resolve`).
    mapped: the equation is evaluated once per example (a
      :data:`PER_EXAMPLE_RULES` site): ``Z`` is the operand stacked per
      example, ``[B, *operand.shape]`` (``shape`` is the operand's until
      :func:`resolve` adds ``B``), and its examples' axis is 0.
    data: for a mapped site, its operands that depend on the examples.
    in_axes: for a mapped site, each operand's examples' axis (None: the
      same for every example; set by :func:`resolve`).
    out_axis: for a mapped site, its output's examples' axis (set by
      :func:`resolve`).
    calls: the call-like equations (outermost first: ``jit``,
      ``checkpoint``, ``cond``, ``scan``; :data:`CALL_RULES`) whose
      programs hold ``eqn``; ``()`` for the program's own.
    linear: for a mapped site of the shape of a linear layer, how it is one
      (:class:`LinearForm`, set by :func:`resolve`; :data:`LINEAR_FORMS`);
      None otherwise.
  """
  eqn: Any
  operand: int
  leaves: tuple
  shape: tuple
  const: frozenset
  rule: str
  line: str
  axis: Optional[int] = None
  mapped: bool = False
  data: tuple = ()
  in_axes: Optional[tuple] = None
  out_axis: Optional[int] = None
  calls: tuple = ()
  linear: Optional["LinearForm"] = None

  @property
  def path(self) -> tuple:
    """The ids of :attr:`calls`: the key of ``eqn``'s run (see
    :meth:`gram_haiku._src.analysis.interpreter.Interpreter.call_path`)."""
    return tuple(id(c) for c in self.calls)


@dataclasses.dataclass(frozen=True)
class Refusal:
  """A finding: a use of untracked parameters ``leaves`` without a rule,
  by primitive ``primitive`` (at ``line``), and why."""
  leaves: tuple
  primitive: str
  line: str
  why: str


def _shape(v) -> tuple:
  return tuple(getattr(getattr(v, "aval", None), "shape", ()))


def _line(ctx, eqn) -> str:
  return ctx.line_of(eqn)


def _ones(shape) -> frozenset:
  return frozenset(k for k, n in enumerate(shape) if n == 1)


def _spread(val: Val, shape) -> bool:
  """Whether prefix value ``val`` of ``shape`` is constant along an axis of
  size above 1 (it was broadcast)."""
  return any(shape[k] > 1 for k in val.const if k < len(shape))


def _const_at(val: Val, v, out_shape) -> frozenset:
  """The axes of an elementwise output along which operand ``v`` (state
  ``val``) is constant: all for a rank-0 operand, else its own (size-1
  axes, which the primitive broadcasts, included)."""
  shape = _shape(v)
  if not shape:
    return frozenset(range(len(out_shape)))
  return val.const | _ones(shape)


# -- prefix rules: example-independent values of the parameters ----------------


def _elementwise_prefix(ctx, eqn, ins) -> list:
  del ctx
  out_shape = _shape(eqn.outvars[0])
  const = frozenset(range(len(out_shape)))
  for v, s in zip(eqn.invars, ins):
    const &= _const_at(s, v, out_shape)
  leaves = frozenset().union(*(s.leaves for s in ins))
  return [Val(leaves, False, const | _ones(out_shape))] * len(eqn.outvars)


def _broadcast_in_dim_prefix(ctx, eqn, ins) -> list:
  del ctx
  dims = tuple(eqn.params["broadcast_dimensions"])
  out_shape = _shape(eqn.outvars[0])
  own = ins[0].const | _ones(_shape(eqn.invars[0]))
  const = (frozenset(range(len(out_shape))) - set(dims)) | {
      dims[k] for k in own}
  return [Val(ins[0].leaves, False, const | _ones(out_shape))]


def _same_axes_prefix(ctx, eqn, ins) -> list:
  """``slice``, ``split``: each output axis is constant where the
  operand's is (a part of a constant axis is constant)."""
  del ctx
  own = ins[0].const | _ones(_shape(eqn.invars[0]))
  return [Val(ins[0].leaves, False, own | _ones(_shape(v)))
          for v in eqn.outvars]


def _dot_general_prefix(ctx, eqn, ins) -> list:
  """``dot_general`` of example-independent operands (a recurrent cell's
  first step, ``zeros @ kernel`` from a zero carry): an output axis is
  constant where its operands' axis is (both of a batch axis). An operand
  broadcast along an axis is refused, as by any primitive without a rule
  (a contraction over it would make each example's share depend on
  ``B``)."""
  if any(s.leaves and _spread(s, _shape(v))
         for v, s in zip(eqn.invars, ins)):
    return _refuse(ctx, eqn, ins, errors.PROGRAM_BROADCAST_REDUCED.format(
        primitive=eqn.primitive.name))
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs, rhs = (s.const | _ones(_shape(v)) for v, s in zip(eqn.invars, ins))
  free = lambda v, c, b: [k for k in range(len(_shape(v)))
                          if k not in c and k not in b]
  axes = ([a in lhs and b in rhs for a, b in zip(lb, rb)] +
          [k in lhs for k in free(eqn.invars[0], lc, lb)] +
          [k in rhs for k in free(eqn.invars[1], rc, rb)])
  leaves = ins[0].leaves | ins[1].leaves
  out_shape = _shape(eqn.outvars[0])
  return [Val(leaves, False, frozenset(k for k, c in enumerate(axes) if c)
              | _ones(out_shape))]


def _tile_prefix(ctx, eqn, ins) -> list:
  """``jnp.tile`` (a class token tiled along the examples, as Flax ViTs
  write it): an axis is constant in the output where it is in the operand
  (a size-1 axis repeated, or one a broadcast made)."""
  del ctx
  own = ins[0].const | _ones(_shape(eqn.invars[0]))
  return [Val(ins[0].leaves, False, own | _ones(_shape(eqn.outvars[0])))]


#: How a prefix value goes on through a primitive: its output's constant
#: axes. Any other primitive keeps only its output's size-1 axes, and may
#: not take a broadcast value (see the module docstring).
PREFIX_RULES = hx.rule_table({
    **{name: _elementwise_prefix for name in ELEMENTWISE},
    "broadcast_in_dim": _broadcast_in_dim_prefix,
    "tile": _tile_prefix,
    "slice": _same_axes_prefix,
    "split": _same_axes_prefix,
    "dot_general": _dot_general_prefix,
})


# -- site rules: where a prefix value meets the examples ------------------------


def _elementwise_site(ctx, eqn, ins) -> list:
  """A prefix operand broadcast by an elementwise primitive to the shape
  of its data operand: ``Z`` is the operand at the output's shape."""
  out_shape = _shape(eqn.outvars[0])
  for k, (v, s) in enumerate(zip(eqn.invars, ins)):
    if s.leaves and hx.may_carry_gradient(v):
      ctx.log.append(Site(eqn, k, tuple(sorted(s.leaves)), out_shape,
                          _const_at(s, v, out_shape), "broadcast",
                          _line(ctx, eqn), calls=tuple(ctx.config.calls)))
  return [Val(data=True)] * len(eqn.outvars)


def _concatenate_site(ctx, eqn, ins) -> list:
  """A prefix operand broadcast along the examples and concatenated with
  the data along another axis: ``Z`` is the operand."""
  dim = eqn.params["dimension"]
  for k, (v, s) in enumerate(zip(eqn.invars, ins)):
    if s.leaves and hx.may_carry_gradient(v):
      ctx.log.append(Site(eqn, k, tuple(sorted(s.leaves)), _shape(v),
                          s.const - {dim}, "concatenate", _line(ctx, eqn),
                          calls=tuple(ctx.config.calls)))
  return [Val(data=True)] * len(eqn.outvars)


def _per_example_site(ctx, eqn, ins) -> list:
  """A prefix operand that the equation contracts, convolves or indexes
  with the data (``x @ W``, ``lax.conv(x, K)``, ``table[ids]``): ``Z`` is
  the operand stacked per example, and the equation is evaluated once per
  example (:func:`resolve` reads the axes and checks that this is the
  equation's own value)."""
  data = tuple(k for k, s in enumerate(ins) if s.data)
  for k, (v, s) in enumerate(zip(eqn.invars, ins)):
    if s.leaves and hx.may_carry_gradient(v):
      ctx.log.append(Site(eqn, k, tuple(sorted(s.leaves)), _shape(v),
                          frozenset(), eqn.primitive.name, _line(ctx, eqn),
                          mapped=True, data=data,
                          calls=tuple(ctx.config.calls)))
  return [Val(data=True)] * len(eqn.outvars)


#: The primitives whose sites are evaluated once per example (a
#: contraction, convolution or indexing of a parameter by the examples'
#: values). Their ``Z`` costs ``B x |operand|`` memory (three times over:
#: ``Z``, ``dL/dZ`` and the per-example gradients; see
#: :func:`gram_haiku._src.compute.cost_model.per_example_operand_bytes`).
PER_EXAMPLE_RULES = ("dot_general", "conv_general_dilated", "gather",
                     "dynamic_slice")

#: The program-level Gram rules, by primitive: ``rule(ctx, eqn, ins)`` for
#: an equation where a prefix value meets the data; it logs a
#: :class:`Site` per prefix operand and returns the outputs' states. A
#: primitive without one refuses (:func:`_no_rule`).
SITE_RULES = hx.rule_table({
    **{name: _elementwise_site for name in ELEMENTWISE
       if name not in ("stop_gradient", "optimization_barrier")},
    "concatenate": _concatenate_site,
    **{name: _per_example_site for name in PER_EXAMPLE_RULES},
})


def _refuse(ctx, eqn, ins, why: str) -> list:
  leaves = frozenset().union(*(s.leaves for s in ins))
  ctx.log.append(Refusal(tuple(sorted(leaves)), eqn.primitive.name,
                         _line(ctx, eqn), why))
  return [Val(data=True)] * len(eqn.outvars)


def _no_rule(ctx, eqn, ins) -> list:
  return _refuse(ctx, eqn, ins, errors.PROGRAM_NO_RULE.format(
      primitive=eqn.primitive.name))


def _into_call(ctx, eqn, ins) -> list:
  """A ``jit`` call (``jnp.take`` is one) or a ``checkpoint`` (``hk.remat``)
  where a prefix value meets the data: followed inside, its sites the
  body's equations under the call (:attr:`Site.calls`; the pass replays
  the body with them, :func:`gram_haiku._src.compat.hijax_compat.replay`).
  Exact: either call's derivative is its body's (a checkpoint only
  recomputes the body's values in the backward pass; the replay keeps it
  a checkpoint, with its policy)."""
  if hx.call_bodies(eqn) is None:
    return _in_call(ctx, eqn, ins)
  ctx.config.calls.append(eqn)
  try:
    outs = ctx.join_all(ctx.run_subs(eqn, lambda sub: list(ins)))
  finally:
    ctx.config.calls.pop()
  return outs if outs is not None else [Val(data=True)] * len(eqn.outvars)


def _leaving(ctx, eqn, ins, outs) -> list:
  """``outs`` of a branch or loop equation, or a refusal where a prefix
  value leaves it (it would be computed with the examples' values: the
  pass computes a site's operand from the parameters alone)."""
  if any(o.leaves and hx.may_carry_gradient(v)
         for v, o in zip(eqn.outvars, outs)):
    return _refuse(ctx, eqn, ins, errors.PROGRAM_OUT_OF_CALL.format(
        primitive=eqn.primitive.name))
  return [Val(data=True) if o.data else Val(const=o.const) for o in outs]


def _into_cond(ctx, eqn, ins) -> list:
  """A ``lax.cond``/``lax.switch`` whose index does not depend on the
  examples, with a prefix value among its operands: each branch followed
  inside (:meth:`~gram_haiku._src.analysis.interpreter.Interpreter.
  branches`), its sites under the call. Exact: one branch runs, the same
  for every example (its index is example-independent: a constant, or a
  value of the parameters alone), and each example's gradient is that
  branch's, which the pass replays by ``lax.switch`` on the same index
  (a site of the branch that does not run takes a zero gradient). In a
  loop body, an index computed from carries and scanned inputs that do not
  depend on the examples (a step counter, :attr:`Val.stepped`) is one
  too: each step's branch is the same for every example, and the
  replayed loop computes it alike. An index computed from the examples'
  values (one branch for the batch, chosen from several examples; under
  ``stop_gradient`` too) is refused; a ``cond`` per example
  (``jax.vmap`` of it) is no ``cond`` in the program but a ``select_n``
  of both branches' values, which the broadcast rule covers."""
  if not _stepped(ins[0]):
    return _refuse(ctx, eqn, ins, errors.PROGRAM_BRANCH_ON_EXAMPLES.format(
        primitive=eqn.primitive.name))
  ctx.config.calls.append(eqn)
  try:
    outs = ctx.join_all(ctx.branches(eqn, hx.cond_branches(eqn),
                                     list(ins[1:])))
  finally:
    ctx.config.calls.pop()
  return _leaving(ctx, eqn, ins, outs)


def _into_scan(ctx, eqn, ins) -> list:
  """A ``lax.scan`` (``hk.scan``, ``hk.dynamic_unroll``, Flax's ``nn.RNN``
  and ``nn.scan``) with a prefix value among its constants (a recurrent
  cell's bare weights, closed over by its body): the body followed
  inside, its sites under the call. In the body the carries and the
  scanned slices count as data (a value that changes from step to step
  is no function of the parameters alone); a prefix value that is a
  carry or a scanned input (a learned initial state, per-step weights) is
  refused (its leaves alone: the constants' uses are still followed), and
  so is one that leaves the loop.

  Exact: the pass passes each site's ``Z`` into the loop as a constant
  (closed over by the replayed body, :func:`gram_haiku._src.compat.
  hijax_compat.replay`), the same at every step, so that ``dL/dZ`` is the
  sum over the steps of each step's cotangent (autodiff of a loop
  constant), and slice ``i`` of it still meets example ``i``'s values
  alone (which the example flow proves inside the body, as outside):
  ``(dL/dZ)[i]`` is example ``i``'s gradient of the operand, summed over
  the steps, as ``jax.vmap(jax.grad)`` gives it."""
  body, n_consts, n_carry, _ = hx.scan_parts(eqn)
  consts, carry, xs = (list(ins[:n_consts]),
                       list(ins[n_consts:n_consts + n_carry]),
                       list(ins[n_consts + n_carry:]))
  if any(s.leaves for s in carry + xs):
    # (Only the carried leaves: the body is still followed for the
    # constants, a carried value in it taken for the examples' values.)
    _refuse(ctx, eqn, carry + xs, errors.PROGRAM_LOOP_CARRIED.format(
        primitive=eqn.primitive.name))
  # (A carry or scanned input that does not depend on the examples, a step
  # counter, stays one: Val.stepped, while the body keeps it one.)
  stepping = [Val(data=True, stepped=_stepped(s)) for s in carry + xs]

  def step(c):
    outs = ctx.run(body, consts + c[:n_carry] + stepping[n_carry:],
                   ctx.key(eqn))
    new = [_join(a, b) for a, b in zip(c, outs[:n_carry])]
    return outs, new

  ctx.config.calls.append(eqn)
  try:
    # (Each round past the first turns at least one stepped carry into
    # the examples' values, or is the last.)
    outs, carry, reached = ctx.fixed_point(step, stepping[:n_carry],
                                           3 + n_carry)
  finally:
    ctx.config.calls.pop()
  if not reached or any(c.leaves for c in carry):
    return _refuse(ctx, eqn, ins, errors.PROGRAM_OUT_OF_CALL.format(
        primitive=eqn.primitive.name))
  # (A stacked output's constant axes are not the body's: only its size-1
  # ones are known.)
  ys = [Val(data=True) if o.data else Val(o.leaves, False, _ones(_shape(v)))
        for v, o in zip(eqn.outvars[n_carry:], outs[n_carry:])]
  return _leaving(ctx, eqn, ins, list(carry) + ys)


def _custom_derivative(ctx, eqn, ins) -> list:
  """A prefix value that is an operand, with the data, of a function with
  a custom derivative (``jax.custom_jvp``, ``jax.custom_vjp``): refused.
  Differentiation runs the function's rule, not its body, so a site in
  the body would be replayed under a derivative that is not the
  function's (``jax.nn.relu``'s at 0, a straight-through estimator's);
  and treating the whole call as a per-example site would need its rule
  to be shown separable by example and its rounding bounded, which this
  version does not do. A custom-derivative function of the data alone
  (``jax.nn.relu(x @ w)``) takes no prefix value: nothing to refuse."""
  return _refuse(ctx, eqn, ins, errors.PROGRAM_IN_CUSTOM_DERIVATIVE.format(
      primitive=eqn.primitive.name))


def _in_call(ctx, eqn, ins) -> list:
  return _refuse(ctx, eqn, ins, errors.PROGRAM_IN_CALL.format(
      primitive=eqn.primitive.name))


#: How a prefix value that meets the data inside a call-like primitive
#: (one with programs in its parameters) is followed, by primitive: a rule
#: as in :data:`SITE_RULES`, which runs the programs in the domain. A
#: primitive without one (``while``, a vmapped call) refuses
#: (:func:`_in_call`).
CALL_RULES = hx.rule_table({
    "pjit": _into_call,
    "jit": _into_call,
    **{name: _into_call for name in hx.REMAT_NAMES},
    "cond": _into_cond,
    "scan": _into_scan,
    "custom_jvp_call": _custom_derivative,
    "custom_vjp_call": _custom_derivative,
    "custom_vjp_call_jaxpr": _custom_derivative,
})


def _tracked_read(ctx, eqn, ins) -> bool:
  """Whether Gram op ``eqn`` reads prefix values only as its parameters,
  and only the leaves that its module tracks too (:attr:`_Run.tracked`):
  the module's own rule gives their part of the gradient."""
  # (A Gram op's operands: its input, its present parameters, its probe.)
  return (not ins[0].leaves and not ins[-1].leaves and
          all(s.leaves <= ctx.config.tracked for s in ins[1:-1]))


def _equation(ctx, eqn, ins: list) -> list:
  """The domain's step: no parameter (data or constants), a prefix value
  going on, or a prefix value meeting the data (a site rule)."""
  n_out = len(eqn.outvars)
  leaves = frozenset().union(*(s.leaves for s in ins))
  data = any(s.data for s in ins)
  is_op = hx.gram_op_of(eqn, ctx.gram_op_type) is not None
  if not leaves:
    if eqn.primitive.name == "stop_gradient" and not data:
      return [Val()] * n_out
    # (The examples' values under stop_gradient are still theirs: a value
    # computed from them is no prefix value, which the pass computes from
    # the parameters alone.)
    if data or is_op:
      # (A step counter's function is one: none of its operands depends
      # on the examples.)
      stepped = not is_op and all(_stepped(s) for s in ins)
      return [Val(data=True, stepped=stepped)] * n_out
    # An example-independent constant (a zero carry): its constant axes,
    # where a prefix rule knows them.
    rule = None if hx.jaxprs_of(eqn) else hx.rule_of(PREFIX_RULES, eqn)
    if rule is not None:
      return rule(ctx, eqn, ins)
    return [Val(const=_ones(_shape(v))) for v in eqn.outvars]
  if eqn.primitive.name == "stop_gradient":
    return [Val()] * n_out  # no gradient: a constant
  if is_op:
    loops = [c for c in ctx.config.calls if c.primitive.name == "scan"]
    if _tracked_read(ctx, eqn, ins) and loops:  # (named by the loop)
      _refuse(ctx, loops[-1], ins, errors.PROGRAM_TRACKED_IN_LOOP.format(
          primitive=loops[-1].primitive.name))
      return [Val(data=True)] * n_out
    if _tracked_read(ctx, eqn, ins):
      return [Val(data=True)] * n_out
    return _refuse(ctx, eqn, ins, errors.PROGRAM_IN_GRAM_OP)
  if hx.jaxprs_of(eqn):
    if data:
      return (hx.rule_of(CALL_RULES, eqn) or _in_call)(ctx, eqn, ins)
    rule = None  # An example-independent call: an opaque prefix step.
  elif data:
    return (hx.rule_of(SITE_RULES, eqn) or _no_rule)(ctx, eqn, ins)
  else:
    rule = hx.rule_of(PREFIX_RULES, eqn)
  if rule is not None:
    return rule(ctx, eqn, ins)
  if any(s.leaves and _spread(s, _shape(v))
         for v, s in zip(eqn.invars, ins)):
    return _refuse(ctx, eqn, ins, errors.PROGRAM_BROADCAST_REDUCED.format(
        primitive=eqn.primitive.name))
  return [Val(leaves, False, _ones(_shape(v))) for v in eqn.outvars]


#: Which untracked parameters each value is an example-independent
#: function of, and whether it depends on the examples.
PROGRAM = interpreter.Domain(
    name="program", rules=SITE_RULES, default=_no_rule, join=_join,
    bottom=Val(), equation=_equation)


@dataclasses.dataclass(frozen=True)
class Findings:
  """What :func:`find` read: the sites and refusals, in program order."""
  sites: tuple = ()
  refusals: tuple = ()

  def candidates(self) -> frozenset:
    """The leaves with a site and no refusal."""
    refused = {k for r in self.refusals for k in r.leaves}
    return frozenset(k for s in self.sites for k in s.leaves
                     if k not in refused)


@dataclasses.dataclass
class _Run:
  """The parameters of one run of :data:`PROGRAM` (its ``ctx.config``).

  Attributes:
    calls: the call-like equations the current equation is inside (see
      :data:`CALL_RULES`).
    tracked: the leaves that a tracked module's op also reads as a
      parameter (:attr:`gram_haiku._src.analysis.dataflow.Discovery.mixed`):
      that read is the module's, not a use without a rule.
  """
  calls: list
  tracked: frozenset


def find(jaxpr, num_param_leaves: int, untracked: Sequence[int],
         gram_op_type, tracked: Sequence[int] = ()) -> Findings:
  """Runs :data:`PROGRAM` over the loss's program ``jaxpr(params, probes,
  batch arrays)`` for the parameter leaves ``untracked`` (and
  ``tracked``: the leaves of ``untracked`` that a tracked module's op also
  reads as a parameter)."""
  if not untracked:
    return Findings()
  wanted = set(untracked)
  ins = []
  for k, v in enumerate(jaxpr.invars):
    if k in wanted:
      ins.append(Val(frozenset({k}), False, _ones(_shape(v))))
    else:
      ins.append(Val(data=k >= num_param_leaves))
  outs, log = interpreter.interpret(PROGRAM, jaxpr, ins, gram_op_type,
                                    _Run([], frozenset(tracked)))
  entries = list(interpreter.flatten(log))
  refusals = [e for e in entries if isinstance(e, Refusal)]
  for v, s in zip(jaxpr.outvars, outs):
    if s.leaves and hx.may_carry_gradient(v):
      refusals.append(Refusal(tuple(sorted(s.leaves)), "the loss", "",
                              errors.PROGRAM_REACHES_LOSS))
  return Findings(tuple(e for e in entries if isinstance(e, Site)),
                  tuple(refusals))


@dataclasses.dataclass(frozen=True)
class Program:
  """The program-level rules of one traced loss (:func:`resolve`).

  Attributes:
    sites: the sites of the covered leaves, each with its examples' axis.
    leaves: leaf index -> name, of the covered leaves.
    refused: leaf name -> why no rule covers it (its message's tail).
    tracked: leaf index -> module, of the covered leaves that the module's
      op also reads (:attr:`gram_haiku._src.analysis.dataflow.Discovery.mixed`):
      their per-example gradients are added to the module's store.
  """
  sites: tuple = ()
  leaves: Mapping[int, str] = dataclasses.field(default_factory=dict)
  refused: Mapping[str, str] = dataclasses.field(default_factory=dict)
  tracked: Mapping[int, str] = dataclasses.field(default_factory=dict)

  def rules_of(self, k: int) -> str:
    """``"program: broadcast, concatenate"``: the rules covering leaf
    ``k``, for :attr:`Grams.coverage`."""
    names = sorted({s.rule for s in self.sites if k in s.leaves})
    return "program: " + ", ".join(names)


def _axis(site: Site, state, batch: int) -> tuple[Optional[int], str]:
  """``(e, "")``: the examples' axis of ``site``'s ``Z``, from the
  example-flow state of its output; ``(None, why)`` where there is none."""
  if state == SUM:
    return None, errors.PROGRAM_REACHES_LOSS
  if not isinstance(state, Ex):
    return None, errors.PROGRAM_NO_EXAMPLES
  if state.tag is not None or state.order is not None or (
      state.inner, state.outer) != (1, 1):
    return None, errors.PROGRAM_EXAMPLES_MERGED
  e = state.dim
  if e >= len(site.shape) or site.shape[e] != batch or (
      e not in site.const and batch != 1):
    return None, errors.PROGRAM_NOT_BROADCAST.format(axis=e)
  return e, ""


def _observed_key(calls: Sequence[Any], v) -> tuple:
  """``(call path, variable)``: where the example flow observes ``v`` of
  the program of the innermost of ``calls`` (see
  :func:`gram_haiku._src.analysis.example_flow.check`'s ``observed``)."""
  return tuple(id(c) for c in calls), v


def observed_keys(found: Findings) -> list:
  """The keys of the example-flow states :func:`resolve` reads (see
  :func:`gram_haiku._src.analysis.example_flow.check`'s ``observed``):
  each site's output, and a per-example site's data operands."""
  return [_observed_key(s.calls, v) for s in found.sites
          for v in (s.eqn.outvars[0], *(s.eqn.invars[k] for k in s.data))]


def _plain(state) -> bool:
  """Whether example-flow ``state`` holds the examples along one axis, one
  per slice, in the batch's order."""
  return isinstance(state, Ex) and state.tag is None and (
      state.order is None and (state.inner, state.outer) == (1, 1))


def _mapped(site: Site, observed: Mapping[Any, Any],
            batch: Optional[int]) -> tuple[Optional[Site], str]:
  """``(site, "")``: mapped ``site`` with ``Z``'s shape and the axes of its
  per-example evaluation, read from the example-flow states ``observed``;
  ``(None, why)`` where it cannot be evaluated one example at a time with
  the equation's own values."""
  eqn = site.eqn
  out = observed.get(_observed_key(site.calls, eqn.outvars[0]))
  if not batch:
    return None, errors.PROGRAM_NO_EXAMPLES
  axes = [None] * len(eqn.invars)
  for k in site.data:
    state = observed.get(_observed_key(site.calls, eqn.invars[k]))
    if _plain(state):
      axes[k] = state.dim
    elif state != CONST:
      return None, (errors.PROGRAM_EXAMPLES_MERGED if isinstance(state, Ex)
                    else errors.PROGRAM_NO_EXAMPLES)
  if all(a is None for a in axes):
    return None, errors.PROGRAM_OPERAND_NO_EXAMPLES.format(
        primitive=eqn.primitive.name)
  if isinstance(out, Ex) and not _plain(out):
    return None, errors.PROGRAM_EXAMPLES_MERGED
  if not isinstance(out, Ex):
    return None, errors.PROGRAM_NOT_PER_EXAMPLE.format(
        primitive=eqn.primitive.name, state=out)
  shape = (batch, *site.shape)
  args = [v.val if isinstance(v, hx.Literal) else jax.ShapeDtypeStruct(
      shape if k == site.operand else v.aval.shape, v.aval.dtype)
          for k, v in enumerate(eqn.invars)]
  try:
    got = jax.eval_shape(lambda *a: hx.bind_per_example(
        eqn, list(a), axes, (site.operand,), out.dim), *args)
  except (TypeError, ValueError):
    got = None
  if got is None or [tuple(g.shape) for g in got] != [
      _shape(v) for v in eqn.outvars]:
    return None, errors.PROGRAM_NOT_SEPARABLE.format(
        primitive=eqn.primitive.name,
        axes=", ".join(f"{a} of operand {k}" for k, a in enumerate(axes)
                       if a is not None))
  site = dataclasses.replace(site, shape=shape, axis=0, in_axes=tuple(axes),
                             out_axis=out.dim)
  form = hx.rule_of(LINEAR_FORMS, eqn)
  return dataclasses.replace(site, linear=form and form(site)), ""


@dataclasses.dataclass(frozen=True)
class LinearForm:
  """How a per-example site is ``hk.Linear``'s product ``x' @ W'``
  (``x': [B, *positions, d_in]``, ``W': [d_in, d_out]``), so that the pass
  can bind the linear layer's Gram op there instead of evaluating the
  equation once per example (:mod:`gram_haiku._src.passes.program_pass`):
  the ghost and factor methods, chosen by the cost model as for a tracked
  ``hk.Linear``.

  Attributes:
    data: the index of the data operand ``x``.
    x_perm: the permutation of ``x``'s axes that gives ``x'`` (its
      examples' axis, its other free axes in order, the contracted one).
    w_transposed: ``W' = W.T`` (the weight is contracted on its axis 1).
    out_perm: the permutation of ``x' @ W'``'s axes that gives the
      equation's output.
  """
  data: int
  x_perm: tuple
  w_transposed: bool
  out_perm: tuple


def _dot_general_linear(site: Site) -> Optional[LinearForm]:
  """``dot_general`` of a 2-D weight and the data, one axis contracted,
  no batch axes, the data's examples' axis among its free axes and both
  operands of one float dtype (``x @ W``, ``x @ W.T``, ``W.T @ x``,
  ``jnp.einsum('btd,de->bte', x, W)``); None otherwise."""
  eqn, k = site.eqn, site.operand
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  j = 1 - k
  if lb or rb or site.data != (j,) or site.in_axes is None:
    return None
  e = site.in_axes[j]
  x, w = eqn.invars[j].aval, eqn.invars[k].aval
  contract = (lc, rc)
  if (len(w.shape) != 2 or len(contract[j]) != 1 or e is None or
      e == contract[j][0] or x.dtype != w.dtype or
      not jnp.issubdtype(x.dtype, jnp.floating) or
      eqn.params.get("preferred_element_type") not in (None, x.dtype)):
    return None
  cx = contract[j][0]
  free = [d for d in range(len(x.shape)) if d != cx]
  mine = [e] + [d for d in free if d != e] + ["w"]
  target = free + ["w"] if j == 0 else ["w"] + free
  return LinearForm(j, tuple(mine[:-1]) + (cx,), contract[k][0] == 1,
                    tuple(mine.index(a) for a in target))


#: Per-example sites that are a linear layer's product, by primitive:
#: ``form(site) -> LinearForm or None`` (:func:`resolve` sets
#: :attr:`Site.linear`).
LINEAR_FORMS = hx.rule_table({"dot_general": _dot_general_linear})


def _message(refusal: Refusal) -> str:
  where = (f"`{refusal.primitive}`{refusal.line}" if refusal.line else
           f"`{refusal.primitive}`")
  return errors.PROGRAM_REFUSED.format(where=where, why=refusal.why)


def resolve(found: Findings, observed: Mapping[Any, Any], batch: int,
            leaf_names: Sequence[str],
            tracked: Mapping[int, str] = None) -> Program:
  """The :class:`Program` of ``found``, each site's axis read from the
  example-flow states ``observed`` (:func:`observed_keys` -> state).
  ``tracked``: leaf -> module, the leaves a tracked module also reads
  (:attr:`Program.tracked`)."""
  refusals = list(found.refusals)
  if batch == 0:
    # No examples (nothing to follow): a site whose output is empty takes
    # no gradient (its examples' stores are empty, exactly); one whose
    # output is not (a penalty on the parameter) is refused.
    refusals += [Refusal(s.leaves, s.eqn.primitive.name, s.line,
                         errors.PROGRAM_REACHES_LOSS) for s in found.sites
                 if math.prod(_shape(s.eqn.outvars[0])) != 0]
    refused = {k for r in refusals for k in r.leaves}
    return Program((), {k: leaf_names[k] for s in found.sites
                        for k in s.leaves if not set(s.leaves) & refused},
                   {leaf_names[k]: _message(r) for r in reversed(refusals)
                    for k in r.leaves})
  sites = []
  for s in found.sites:
    if any(k in {l for r in refusals for l in r.leaves} for k in s.leaves):
      continue
    if s.mapped:
      site, why = _mapped(s, observed, batch)
    else:
      out = observed.get(_observed_key(s.calls, s.eqn.outvars[0]))
      e, why = _axis(s, out, batch)
      site = None if e is None else dataclasses.replace(s, axis=e)
    if site is None:
      refusals.append(Refusal(s.leaves, s.eqn.primitive.name, s.line, why))
    else:
      sites.append(site)
  refused: dict[str, str] = {}
  for r in refusals:
    for k in r.leaves:
      refused.setdefault(leaf_names[k], _message(r))
  bad = {k for r in refusals for k in r.leaves}
  sites = tuple(s for s in sites if not set(s.leaves) & bad)
  leaves = {k: leaf_names[k] for s in sites for k in s.leaves}
  return Program(sites, leaves, refused,
                 {k: m for k, m in (tracked or {}).items() if k in leaves})


def match(found: Findings, program: Program) -> list[Site]:
  """The sites of ``program`` (read from the discovery trace) in another
  trace of the same loss (the pass's, ``found``): the same equations in
  the same order, with their axes.

  Raises:
    ValueError: where the two traces disagree (tracked layers under
      ``jax.jvp`` in the loss read their parameters through a program
      that the pass's trace changes).
  """
  wanted = set(program.leaves)
  mine = [s for s in found.sites if set(s.leaves) <= wanted]
  if len(mine) != len(program.sites) or any(
      (a.operand, a.leaves, a.shape, a.eqn.primitive, a.mapped,
       len(a.calls)) !=
      (b.operand, b.leaves, b.shape[1:] if b.mapped else b.shape,
       b.eqn.primitive, b.mapped, len(b.calls))
      for a, b in zip(mine, program.sites)):
    raise ValueError(errors.PROGRAM_TRACES_DIFFER.format(
        params=", ".join(repr(n) for n in sorted(program.leaves.values()))))
  return [dataclasses.replace(a, axis=b.axis, shape=b.shape,
                              in_axes=b.in_axes, out_axis=b.out_axis,
                              linear=b.linear)
          for a, b in zip(mine, program.sites)]
