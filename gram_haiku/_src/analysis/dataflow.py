"""What the traced program says about a tracked model: its Gram ops and
which parameter reaches which of them, how, and how often.

:func:`gram_haiku.value_grad_and_gram` traces the tracked loss once with
``jax.make_jaxpr`` (no FLOPs) before the real pass, and :func:`discover`
reads the jaxpr. Every Gram op application is an equation of the program
(inside ``jit``, ``hk.remat``, ``hk.vmap``, ``hk.cond``, ``lax.scan`` or
``while_loop`` bodies as well), and carries its :class:`Plan`, its input
type (after every ``vmap`` has been batched: the example-axis size is
known) and its layer's name. Following each parameter from the program's
inputs to the ops' parameter operands tells, from the program alone rather
than from Python object identity or the call stack:

* which tracked modules use a parameter more than once: several calls, two
  ``track()`` blocks, a lifted transform, or a loop body that closes over
  it (a ``scan`` over stacked parameters, as ``hk.layer_stack`` does, gives
  each step its own slice and is not a reuse). Such a module accumulates
  per-example gradients (probe ``[B, P]``) in the real pass;
* how a parameter reaches a tracked op: unchanged, cast (a jmp policy),
  reshaped or sliced, which keep the Gram exact, or through any other
  computation (``stop_gradient``, a reparametrisation), where the op's Gram
  would be taken with respect to the wrong quantity: a teaching error;
* whether one parameter reaches the ops of two different modules.

Branches of ``cond`` count as alternatives (the most uses of any branch),
a ``while_loop`` body as repeated.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Mapping, Optional

from gram_haiku._src.analysis import interpreter
from gram_haiku._src.analysis import reparam
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import explicit_mesh
from gram_haiku._src.core import errors

#: Primitives that keep every value of a parameter (so its Gram): casts,
#: copies and reshapes.
_VALUE_PRESERVING = frozenset({
    "convert_element_type", "copy", "copy_p", "reshape", "squeeze",
    "expand_dims", "device_put", "reduce_precision", "pvary", "pcast",
    "sharding_constraint", "reshard", "mesh_cast", "name",
})

#: Primitives by which a loss reads a parameter in a penalty on the weights
#: (``lam * sum(w ** 2)``, ``sum(abs(w))``): their errors say what to do
#: with one.
_PENALTY_PRIMITIVES = frozenset({
    "integer_pow", "square", "pow", "abs", "mul", "dot_general", "sqrt",
    "reduce_sum",
})

#: Primitives that call their one sub-program once, with their own inputs.
_CALLS = frozenset({
    "pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint",
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "shard_map", "named_call",
})
#: ... of which these differentiate by their own rule, not their program's:
#: even an identity changes the gradient (a gradient scale, a frozen
#: weight by a zero VJP), so what they give is never exact.
_CUSTOM_DERIVATIVES = frozenset({
    "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
})


@dataclasses.dataclass(frozen=True)
class Source:
  """One parameter leaf that a value was computed from.

  Attributes:
    leaf: index of the parameter leaf (``jax.tree.leaves(params)``).
    exact: whether every step from the leaf kept its values (casts,
      reshapes, slices of a scanned stack).
    via: the first other primitive on the way (e.g. ``"stop_gradient"``),
      or None when ``exact``.
    sliced: the value is one step's slice of a scanned stack.
    repeated: the value is read again by every step of a loop.
    trips: how many times per pass the code reading the value runs (the
      product of the enclosing ``scan`` lengths), None where that is not
      known (a ``while_loop`` body, a ``cond`` branch).
  """
  leaf: int
  exact: bool = True
  via: Optional[str] = None
  sliced: bool = False
  repeated: bool = False
  trips: Optional[int] = 1


Sources = frozenset  # of Source


@dataclasses.dataclass(frozen=True)
class Application:
  """One Gram op application found in the program.

  Attributes:
    op: the bound op (its ``name``, ``plan`` and input types).
    param_sources: per parameter of the op (``param_names`` order; empty
      for an absent one), the parameter leaves it comes from (a set of
      :class:`Source`).
    probe_sources: the probe leaves its probe operand comes from.
    eqn: its equation, if it is one of the program's own (not inside a
      call, loop or branch); None otherwise.
  """
  op: Any
  param_sources: tuple[Sources, ...]
  probe_sources: Sources
  eqn: Any = None


@dataclasses.dataclass(frozen=True)
class Discovery:
  """Facts about a tracked model, read from its traced program.

  Attributes:
    sizes: module name -> size of its example axis.
    param_counts: module name -> number of parameter entries it tracks.
    shared: modules whose parameters are used more than once (each needs a
      per-example probe ``(B, P)`` instead of a Gram probe).
    vmapped: module name -> whether its example axis came from a vmap (True)
      or from the layer input's own axis 0 (False), under the default rule.
    modes: module name -> the ``track(mode=...)`` it ran under.
    example_specs: module name -> the mesh axes its example axis is sharded
      over, under a mesh with Explicit axes (absent otherwise).
    probe_dtypes: module name -> the accumulation dtype of the parameters
      and input it is applied to (float32, float64 for float64 ones).
    untracked_uses: parameter name -> the primitive that reads it outside
      every Gram op (for parameters that reach no Gram op at all: their
      gradient is outside the Gram).
    mixed: parameter name -> ``(module, primitive)``: a parameter that one
      tracked module's op reads and that ``primitive`` also reads outside
      every Gram op (a tied output's ``h @ embed.embeddings.T``). Exact
      only where program-level rules cover the outside uses: their
      per-example gradients are then added to the module's
      (:mod:`gram_haiku._src.passes.pass_pipeline`); otherwise refused by
      :func:`gram_haiku._src.passes.pass_trace.trace_loss`.
    ops: module name -> its (first) bound op in the program, after every
      ``vmap`` was batched: the rule that re-contracts its book-keeping
      factors after the pass. Its ``Plan.frozen``: the indices of its
      present parameter operands that no parameter leaf reaches (closed
      over, e.g. the frozen part of ``hk.data_structures.partition``, read
      through ``stop_gradient``, or computed from the data), the same for
      every module under its layer name: their gradient is zero and their
      terms are left out of the Gram.
    param_leaves: module name -> for each of its op's parameter operands,
      the index of the parameter leaf it is (a cast or reshape of), or None
      (absent, or not computed from a parameter).
    applications: module name -> number of op equations that read its
      probe (a loop body counts once).
    pullbacks: module name -> its :class:`~gram_haiku._src.analysis.reparam.PullBack`,
      for the modules whose
      operands are computed from parameters (a reparametrising getter).
    no_gradient: names of the parameter leaves that the loss's value is not
      computed from except through ``stop_gradient`` (or not at all): their
      gradient is zero.
    slot_counts: shared module name -> how many times per pass its op
      runs (every step of every enclosing ``scan`` counted), for the shared
      modules whose every application is the same op (same input type and
      configuration) reading its probe unchanged, where the trip counts
      are known (no ``while_loop`` or ``cond`` on the way), and whose
      layer name is its own.
      Such a module can keep each application's factors in its own slot of
      a slotted probe (see ``value_grad_and_gram``).
    parts: shared module name -> its applications' ops, in program order,
      for the shared modules whose applications are of different rules
      (:attr:`RuleOp.kind`), each run once per pass (outside every loop
      and branch) and reading its probe unchanged, where each reads the
      same one parameter leaf, and whose layer name is its own (a tied
      embedding's lookup and :func:`gram_haiku.unembed`). Such a module
      can keep each application's factors in a probe of its own
      (:mod:`gram_haiku._src.passes.parts`).
  """
  sizes: Mapping[str, int]
  param_counts: Mapping[str, int]
  shared: frozenset
  vmapped: Mapping[str, bool]
  modes: Mapping[str, str]
  example_specs: Mapping[str, Any]
  probe_dtypes: Mapping[str, Any]
  untracked_uses: Mapping[str, str] = dataclasses.field(default_factory=dict)
  mixed: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  ops: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  param_leaves: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  applications: Mapping[str, int] = dataclasses.field(default_factory=dict)
  slot_counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
  parts: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  pullbacks: Mapping[str, reparam.PullBack] = dataclasses.field(
      default_factory=dict)
  no_gradient: frozenset = frozenset()

  def by_layer(self, modules=None) -> dict[str, set]:
    """Layer name -> those of ``modules`` (default: every applied one)
    applied under it (:func:`by_layer`)."""
    return by_layer(self.ops, self.ops if modules is None else modules)


def by_layer(ops: Mapping[str, Any], modules) -> dict[str, set]:
  """Layer name -> those of ``modules`` applied under it.

  Everything here is keyed by module (the state name of its probe); its
  layer name, the name ``track()`` sees (inside ``hk.layer_stack`` it lacks
  the stack's prefix), is carried once, by its op (``ops[module].name``).
  This is the one place modules are grouped by it: where two modules run
  under one layer name, the pass cannot tell them apart.

  Args:
    ops: module -> its op (:attr:`Discovery.ops`).
    modules: the modules to group; those without an op are left out.
  """
  groups: dict[str, set] = {}
  for m in modules:
    if m in ops:
      groups.setdefault(ops[m].name, set()).add(m)
  return groups



def also_untracked_message(leaf: str, modules, use: str, why: str) -> str:
  """The error for a tracked parameter also used outside every tracked
  layer (by the primitive ``use``) where the two parts of its gradient
  cannot be added up (``why``), with the advice for a penalty on the
  parameters where ``use`` is one."""
  return errors.MIXED_USE.format(
      param=leaf, modules=", ".join(map(str, modules)), use=use,
      why=why.strip()[:1].lower() + why.strip()[1:].rstrip(".")) + (
          errors.PENALTY_ON_PARAMETERS if use in _PENALTY_PRIMITIVES else "")


def _signature(op) -> tuple:
  """What must agree between two applications for their factors to stack:
  the op's rule and configuration and its input and parameter types."""
  avals = tuple(None if a is None else (a.shape, a.dtype)
                for a in op.in_avals[:-1])
  config = tuple(sorted((k, _comparable(v)) for k, v in op.params.items()
                        if k != "name"))
  return type(op), avals, config


def _comparable(v):
  """``functools.partial`` objects compare by identity; two partials of the
  same function and arguments (a rule built afresh per call) are the same
  configuration."""
  if isinstance(v, functools.partial):
    return (v.func, tuple(_comparable(a) for a in v.args),
            tuple(sorted((k, _comparable(a)) for k, a in v.keywords.items())))
  return v


def _slot_count(apps, probe_leaf: int) -> Optional[int]:
  """Runs per pass of these applications of one module, if they can keep
  their factors in slots of one slotted probe (see :class:`Discovery`)."""
  total, first = 0, None
  for app in apps:
    sources = list(app.probe_sources)
    if len(sources) != 1:
      return None
    s = sources[0]
    if s.leaf != probe_leaf or not s.exact or s.sliced or s.trips is None:
      return None
    sig = _signature(app.op)
    if first is None:
      first = sig
    elif sig != first:
      return None
    total += s.trips
  return total or None


def _parts(apps, probe_leaf: int, num_param_leaves: int) -> Optional[tuple]:
  """The ops of these applications of one module, if each can keep its
  factors in a probe of its own (see :class:`Discovery`)."""
  kinds, leaves = set(), set()
  for app in apps:
    sources = list(app.probe_sources)
    if len(sources) != 1:
      return None
    s = sources[0]
    if (s.leaf != probe_leaf or not s.exact or s.sliced or s.repeated or
        s.trips != 1):
      return None
    own = _own_leaves(app, num_param_leaves)
    if len(own) != 1 or own[0] is None:
      return None
    kinds.add(app.op.kind)
    leaves.add(own[0])
  if len(apps) < 2 or len(kinds) != len(apps) or len(leaves) != 1:
    return None
  return tuple(app.op for app in apps)


def _sub(source: Source, **changes) -> Source:
  return dataclasses.replace(source, **changes)


def _not_exact(sources: Sources, via: str) -> Sources:
  return frozenset(s if not s.exact else _sub(s, exact=False, via=via)
                   for s in sources)


# -- the domain: sources of values, on the program interpreter ----------------
#
# The state of a value is the set of :class:`Source`\ s it is computed from
# (the lattice of sets, joined by union, bottom empty). Findings go to the
# run's log as :class:`Application`, :class:`_Use` and :class:`_OtherUse`
# records, which :func:`read_log` reads.


@dataclasses.dataclass(frozen=True)
class _Use:
  """A finding: a Gram op reads parameter ``leaf`` (a loop's slice of it:
  ``sliced``) ``count`` times per pass."""
  leaf: int
  sliced: bool
  count: int


@dataclasses.dataclass(frozen=True)
class _OtherUse:
  """A finding: primitive ``name``, outside every Gram op's parameters,
  reads parameter ``leaf`` unchanged (its gradient then has a part no
  Gram holds)."""
  leaf: int
  name: str


@dataclasses.dataclass(frozen=True)
class Findings:
  """What one run of the domain found (:func:`read_log`).

  Attributes:
    applications: the Gram op applications, in program order.
    uses: ``(leaf, sliced)`` -> number of uses per pass (the branches of a
      ``cond`` count as alternatives: the most of any branch).
    other_uses: leaf -> the first primitive outside every Gram op's
      parameters that reads it unchanged.
  """
  applications: tuple
  uses: Mapping[tuple, int]
  other_uses: Mapping[int, str]


def _count_uses(entries) -> collections.Counter:
  uses: collections.Counter = collections.Counter()
  for e in entries:
    if isinstance(e, interpreter.Branches):
      most: collections.Counter = collections.Counter()
      for branch in e.logs:
        for k, n in _count_uses(branch).items():
          most[k] = max(most[k], n)
      uses = uses + most
    elif isinstance(e, _Use):
      uses[(e.leaf, e.sliced)] += e.count
  return uses


def read_log(entries) -> Findings:
  """The :class:`Findings` of a run's log."""
  flat = list(interpreter.flatten(entries))
  other: dict[int, str] = {}
  for e in flat:
    if isinstance(e, _OtherUse):
      other.setdefault(e.leaf, e.name)
  return Findings(
      applications=tuple(e for e in flat if isinstance(e, Application)),
      uses=_count_uses(entries), other_uses=other)


def _union(states) -> Sources:
  return frozenset().union(*states) if states else frozenset()


def _other_use(ctx, sources, name: str) -> None:
  for s in sources:
    if s.exact:
      ctx.log.append(_OtherUse(s.leaf, name))


def _gram_op(ctx, eqn, op, ins) -> list:
  """A Gram op application: recorded with the sources of its parameter
  operands and its probe; its outputs are computed from every operand."""
  # Absent parameters (None, e.g. no scale) are not operands of the
  # equation: align the operands' sources with the op's parameters.
  present = iter(ins[1:-1])
  sources = tuple(frozenset() if aval is None else next(present)
                  for aval in op.param_avals)
  ctx.log.append(Application(op, sources, ins[-1],
                             eqn if ctx.depth == 1 else None))
  _other_use(ctx, ins[0], f"the input of {op.name}")
  for s in _union(sources):
    ctx.log.append(_Use(s.leaf, s.sliced, 2 if s.repeated else 1))
  return [_not_exact(_union(ins), op.name)] * len(eqn.outvars)


def _value_preserving(ctx, eqn, ins) -> list:
  del ctx
  return [_union(ins)] * len(eqn.outvars)


def _stop_gradient(ctx, eqn, ins) -> list:
  # No gradient flows through it: what it gives is a constant for the
  # differentiated parameters (a frozen weight; see Plan.frozen of
  # Discovery.ops).
  del ctx, ins
  return [frozenset()] * len(eqn.outvars)


def _other(ctx, eqn, ins) -> list:
  """Any other primitive: its outputs are computed from every operand, not
  exactly; a use outside the Gram ops where a gradient passes."""
  name = eqn.primitive.name
  union = _union(ins)
  if any(hx.may_carry_gradient(v) for v in eqn.outvars):
    # (A comparison or an integer result passes no gradient back: not a
    # use that the Gram would miss.)
    _other_use(ctx, union, name)
  return [_not_exact(union, name)] * len(eqn.outvars)


def _through_subs(ctx, eqn, ins, known: bool) -> list:
  """A primitive with sub-programs: a call (``known``: its body runs once,
  on its own operands) or another one (how often unknown)."""
  name = eqn.primitive.name
  if not hx.jaxprs_of(eqn):
    return _other(ctx, eqn, ins)
  if not known:  # How often its body runs is not known.
    ins = [frozenset(_sub(x, trips=None) for x in s) for s in ins]
  union = _union(ins)
  n_out = len(eqn.outvars)
  # (An unknown calling convention: every input may reach every input.)
  res = ctx.run_subs(eqn, lambda sub: ins if len(sub.invars) == len(ins)
                     else [union] * len(sub.invars))
  outs = ctx.join_all([r if len(r) == n_out else None for r in res])
  if outs is None:
    return _other(ctx, eqn, ins)
  if name in _CUSTOM_DERIVATIVES:
    # Its own derivative rule may send any output's cotangent to any
    # input, whatever the forward reads (a forward that stops the
    # gradient and a backward that passes it on): every output
    # depends on every input.
    _other_use(ctx, union, name)
    return [_not_exact(union, name)] * n_out
  if known:
    return outs
  return [_not_exact(o, name) for o in outs]


def _call(ctx, eqn, ins) -> list:
  return _through_subs(ctx, eqn, ins, known=True)


def _default(ctx, eqn, ins) -> list:
  if hx.jaxprs_of(eqn):
    return _through_subs(ctx, eqn, ins, known=False)
  return _other(ctx, eqn, ins)


def _scan(ctx, eqn, ins) -> list:
  body, n_consts, n_carry, length = hx.scan_parts(eqn)
  loops = length > 1
  times = lambda x: None if x.trips is None else x.trips * length
  inner = []
  for k, s in enumerate(ins):
    if k < n_consts + n_carry:
      inner.append(frozenset(
          _sub(x, repeated=x.repeated or loops, trips=times(x)) for x in s))
    else:  # A scanned input: each step reads its own slice.
      inner.append(frozenset(_sub(x, sliced=True, trips=times(x))
                             for x in s))
  outs = _loop_body(ctx, eqn, body, inner, n_consts, n_carry)
  return [_not_exact(o, "scan") for o in outs]


def _while(ctx, eqn, ins) -> list:
  _, cond_n, body, body_n = hx.while_parts(eqn)
  inner = [frozenset(_sub(x, repeated=True, trips=None) for x in s)
           for s in ins[cond_n:]]
  outs = _loop_body(ctx, eqn, body, inner, body_n, len(inner) - body_n)
  return [_not_exact(o, "while") for o in outs]


def _fed_back(inner: Sources, out: Sources) -> Sources:
  """A carry's sources grown by what the body feeds into it: a leaf fed
  back is marked read by every step, how often unknown; one already in
  the carry in the same form (an unchanged carry) is left as it is, so
  the rounds end (at most one per carry and form of a leaf)."""
  forms = {(x.leaf, x.exact, x.via, x.sliced) for x in inner}
  new = frozenset(_sub(x, repeated=True, trips=None) for x in out
                  if (x.leaf, x.exact, x.via, x.sliced) not in forms)
  return inner | new if new else inner


def _loop_body(ctx, eqn, body, inner: list, n_consts: int,
               n_carry: int) -> list:
  """Runs a loop body with each carry's sources grown by what the body's
  later steps feed into it (:func:`_fed_back`), to the fixed point (a
  leaf may reach a carry only after several steps: a delay line, a
  rotation of the carries). Returns the body's output sources."""
  carries = range(n_consts, n_consts + n_carry)

  def step(ins):
    outs = ctx.run(body, ins, ctx.key(eqn))
    new = list(ins)
    for k, out in zip(carries, outs[:n_carry]):
      new[k] = _fed_back(ins[k], out)
    return outs, new

  # (A bound the lattice never reaches.)
  outs, _, reached = ctx.fixed_point(step, list(inner), 4 * n_carry + 4)
  if not reached:
    raise AssertionError("gram_haiku internal error: the sources of a loop "
                         "carry did not reach a fixed point.")
  return outs


def _cond(ctx, eqn, ins) -> list:
  uncounted = [frozenset(_sub(x, trips=None) for x in s) for s in ins[1:]]
  outs = ctx.join_all(ctx.branches(eqn, hx.cond_branches(eqn), uncounted))
  return [_not_exact(o, "cond") for o in (outs or [])]


def _output(ctx, v, sources: Sources) -> Sources:
  # An integer or boolean value carries no gradient (a comparison, a cast
  # to int and back): nothing reaches through it.
  del ctx
  return sources if hx.may_carry_gradient(v) else frozenset()


#: The domain's rules, by primitive.
RULES = hx.rule_table({
    interpreter.GRAM_OP: _gram_op,
    **{name: _value_preserving for name in _VALUE_PRESERVING},
    **{name: _call for name in _CALLS},
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "stop_gradient": _stop_gradient,
})

#: Which parameter leaves (and probe leaves) each value is computed from.
SOURCES = interpreter.Domain(
    name="sources", rules=RULES, default=_default,
    join=lambda a, b: a | b, bottom=frozenset(), output=_output)


def follow(jaxpr, ins: list, gram_op_type) -> tuple[list, Findings]:
  """Runs :data:`SOURCES` over ``jaxpr`` from the inputs' sources ``ins``:
  the outputs' sources and the :class:`Findings`."""
  outs, log = interpreter.interpret(SOURCES, jaxpr, ins, gram_op_type)
  return outs, read_log(log)


@dataclasses.dataclass
class _Reading:
  """What :func:`discover` reads off the op applications, by module (its
  state name); internal, filled in by :func:`_read_applications`."""
  ops: dict = dataclasses.field(default_factory=dict)
  leaves_of: dict = dataclasses.field(default_factory=dict)
  n_apps: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  sizes: dict = dataclasses.field(default_factory=dict)
  counts: dict = dataclasses.field(default_factory=dict)
  dtypes: dict = dataclasses.field(default_factory=dict)
  vmapped: dict = dataclasses.field(default_factory=dict)
  modes: dict = dataclasses.field(default_factory=dict)
  specs: dict = dataclasses.field(default_factory=dict)
  # parameter leaf -> the modules whose ops it reaches
  modules_of_leaf: dict = dataclasses.field(
      default_factory=lambda: collections.defaultdict(set))
  shared: set = dataclasses.field(default_factory=set)
  # module -> (application, param name, Source) of its first operand
  # computed from a parameter by something other than a cast or reshape
  transformed: dict = dataclasses.field(default_factory=dict)
  # module -> the sets of operand indices no parameter leaf reaches
  frozen_of: dict = dataclasses.field(
      default_factory=lambda: collections.defaultdict(set))


def _param_set(op) -> tuple:
  """The parameters (names and shapes) one application of a Gram op
  reads: two applications under one module name share its probe, so they
  must read the same ones (a tied embedding's lookup and ``unembed`` do)."""
  return tuple((n, tuple(a.shape)) for n, a in zip(op.param_names,
                                                   op.param_avals)
               if a is not None)


def _layer_kind(op) -> str:
  """``linear(w[6, 6], b[6])``: an op's rule and parameters, for
  messages."""
  params = ", ".join(f"{n}{list(shape)}" for n, shape in _param_set(op))
  return f"{op.kind}({params})"


def _own_leaves(app: Application, num_param_leaves: int) -> tuple:
  """Per parameter operand of ``app``'s op: the one parameter leaf it is
  computed from, or None (absent, none, or several)."""
  leaves = []
  for sources, aval in zip(app.param_sources, app.op.param_avals):
    own = {s.leaf for s in sources if s.leaf < num_param_leaves}
    leaves.append(own.pop() if aval is not None and len(own) == 1 else None)
  return tuple(leaves)


def _frozen_operands(app: Application, num_param_leaves: int) -> tuple:
  """The indices of ``app``'s present parameter operands that no parameter
  leaf reaches."""
  return tuple(
      k for k, (sources, aval) in enumerate(zip(app.param_sources,
                                                app.op.param_avals))
      if aval is not None and
      not any(s.leaf < num_param_leaves for s in sources))


def _read_op(r: _Reading, module: str, app: Application,
             num_param_leaves: int) -> None:
  """Records ``app``'s op for ``module``: its sizes, mode and sharding.

  Raises:
    ValueError: for a module applied under two modes, or a module name
      used by two different tracked layers.
  """
  op = app.op
  r.n_apps[module] += 1
  r.frozen_of[module].add(_frozen_operands(app, num_param_leaves))
  if module in r.ops and _param_set(r.ops[module]) != _param_set(op):
    raise ValueError(errors.MODULE_NAME_TWO_LAYERS.format(
        module=module, first=_layer_kind(r.ops[module]),
        second=_layer_kind(op)))
  if module not in r.ops:
    r.ops[module] = op
    r.leaves_of[module] = _own_leaves(app, num_param_leaves)
  r.sizes[module] = op.example_size()
  r.counts[module] = op.num_params()
  r.dtypes[module] = op.accumulation_dtype()
  if op.example_axis.kind == "default":
    r.vmapped.setdefault(module, op.example_axis.vmapped)
  if r.modes.setdefault(module, op.mode) != op.mode:
    raise ValueError(errors.MIXED_MODES.format(
        module=module, modes=sorted({r.modes[module], op.mode})))
  spec = explicit_mesh.spec_of_type(op.x_aval)
  position = op.example_axis.resolved_position()
  if spec is not None and position < len(spec) and spec[position]:
    r.specs[module] = spec[position]


def _read_sources(r: _Reading, module: str, app: Application,
                  found: Findings, num_param_leaves: int) -> None:
  """Records how each parameter leaf reaches ``app``'s op: exactly (and
  whether shared) or transformed."""
  op = app.op
  for pname, sources, aval in zip(op.param_names, app.param_sources,
                                  op.param_avals):
    if aval is None:
      continue
    for s in sources:
      if s.leaf >= num_param_leaves:
        continue  # Computed from a probe (a generated weight): no use.
      r.modules_of_leaf[s.leaf].add(module)
      if not s.exact:
        r.transformed.setdefault(module, (app, pname, s))
      elif found.uses[(s.leaf, s.sliced)] > 1:
        r.shared.add(module)


def _read_applications(found: Findings, module_of, num_param_leaves: int
                       ) -> _Reading:
  """Per module: its op, sizes, mode and sharding, and how each parameter
  leaf reaches it (exactly, shared, transformed or not at all).

  Raises:
    ValueError: for a module applied under two modes, or a module name
      used by two different tracked layers.
  """
  r = _Reading()
  for app in found.applications:
    module = module_of(app)
    _read_op(r, module, app, num_param_leaves)
    _read_sources(r, module, app, found, num_param_leaves)
  return r


def _read_pullbacks(jaxpr, consts, found: Findings, module_of, r: _Reading,
                    num_param_leaves: int, leaf_names: list[str],
                    gram_op_type) -> dict:
  """Module -> its :class:`~gram_haiku._src.analysis.reparam.PullBack`, for each
  module with an operand computed from parameters (``r.transformed``).

  Raises:
    ValueError: where that computation cannot be pulled back.
  """
  pullbacks = {}
  for module, (_, pname, s) in r.transformed.items():
    pb, why = reparam.read_pullback(
        jaxpr, consts, [a for a in found.applications
                        if module_of(a) == module],
        num_param_leaves, gram_op_type)
    if pb is None:
      raise ValueError(errors.PARAM_TRANSFORMED.format(
          module=module, param=pname, leaf=leaf_names[s.leaf], via=s.via,
          why=why))
    pullbacks[module] = pb
  return pullbacks


def _check_shared_names(layers: Mapping[str, set], shared: set) -> None:
  """Raises where one layer name (``layers``: :func:`by_layer`) is both a
  shared module's and one that is not (the real pass tells modules apart
  by layer name)."""
  for name, keys in layers.items():
    if keys & shared and keys - shared:
      raise ValueError(errors.SHARED_NAME_CLASH.format(
          name=name, shared=sorted(keys & shared),
          unshared=sorted(keys - shared)))


def _frozen_operands_of(frozen_of: Mapping[str, set], ops: Mapping[str, Any],
                        layers: Mapping[str, set]) -> dict:
  """Module -> its op's frozen operand indices (the same for every module
  under its layer name, ``layers``: :func:`by_layer`).

  Raises:
    ValueError: for a layer whose uses freeze different operands.
  """
  frozen = {}
  for name, modules in layers.items():
    kinds = set().union(*(frozen_of[m] for m in modules))
    if len(kinds) > 1:
      names = ops[min(modules)].param_names
      raise ValueError(errors.FROZEN_IN_SOME_USES.format(
          name=name, params=[[names[k] for k in ks] for ks in sorted(kinds)]))
    frozen.update(dict.fromkeys(modules, next(iter(kinds))))
  return frozen


def _untracked_uses(found: Findings, modules_of_leaf: Mapping[int, set],
                    pulled: set, leaf_names: list[str],
                    num_param_leaves: int) -> tuple[dict, dict]:
  """``(untracked, mixed)``: parameter name -> the primitive that reads it
  outside every Gram op, for the parameters that reach no Gram op; and
  parameter name -> ``(module, primitive)`` for those that one module's
  op reads too (:attr:`Discovery.mixed`).

  Raises:
    ValueError: for a parameter that reaches the ops of two modules.
  """
  untracked, mixed = {}, {}
  for leaf, modules in modules_of_leaf.items():
    if len(modules) > 1:
      raise ValueError(errors.PARAM_IN_TWO_MODULES.format(
          leaf=leaf_names[leaf], modules=sorted(modules)))
  for leaf, use in found.other_uses.items():
    if leaf >= num_param_leaves or leaf in pulled:
      continue  # (a pulled-back leaf's every use is its getter's)
    if leaf in modules_of_leaf:
      mixed[leaf_names[leaf]] = (next(iter(modules_of_leaf[leaf])), use)
    else:
      untracked[leaf_names[leaf]] = use
  return untracked, mixed


def _check_probe(app: Application, num_param_leaves: int,
                 probe_names: list[str]) -> None:
  """Raises unless the op's probe operand is one probe leaf of the
  differentiated state, unchanged (a cast, a reshape, a loop's slice of a
  stacked probe): only then is the probe's gradient this layer's Gram.

  Raises:
    ValueError: for a probe that is a constant to the differentiated
      function (closed over, read through ``stop_gradient``, taken from
      another state), computed from the state's probe by other values
      (scaled), or from several probes.
  """
  probes = [s for s in app.probe_sources if s.leaf >= num_param_leaves]
  # (One leaf may arrive along several paths: a loop's slice and a
  # branch's copy of the same probe.)
  if len({s.leaf for s in probes}) == 1 and all(s.exact for s in probes) and (
      len(probes) == len(app.probe_sources)):
    return
  if not probes:
    found = ("its probe does not depend on the state's probes (a state "
             "closed over or stored, read through stop_gradient, or taken "
             "from another state)")
  elif len({s.leaf for s in probes}) > 1:
    found = "its probe is computed from the probes of {} modules ({})".format(
        len({s.leaf for s in probes}), ", ".join(sorted(
            repr(probe_names[s.leaf - num_param_leaves]) for s in probes)))
  else:
    s = probes[0]
    found = (f"its probe is computed from the state's probe of "
             f"{probe_names[s.leaf - num_param_leaves]!r} through "
             f"`{s.via or 'a parameter'}`, which changes its values")
  raise ValueError(errors.PROBE_NOT_FROM_STATE.format(module=app.op.name,
                                                      found=found))


def _own_probe_modules(shared: set, r: _Reading, layers: Mapping[str, set],
                       pullbacks: Mapping[str, Any], apps, module_of,
                       num_param_leaves: int, probe_names: list[str]):
  """``(module, its applications, its probe's leaf index)`` for the
  ``shared`` modules with their own probe and layer name (``layers``:
  :func:`by_layer`), not sharded by an Explicit mesh (``r.specs``) nor
  pulled back: the candidates for slots (:func:`_slotted`) and parts
  (:func:`_parted`). None where an application (outside the loss's live
  program, which :func:`_check_probe` did not check) reads no one
  module's probe: which module's slot or part it would take is not known
  (every shared module then keeps per-example gradients, which are
  exact)."""
  if any(module_of(a) is None for a in apps):
    return None
  namesakes = {m for ms in layers.values() if len(ms) > 1 for m in ms}
  return [(module, [a for a in apps if module_of(a) == module],
           num_param_leaves + probe_names.index(module))
          for module in sorted(shared - set(r.specs) - set(pullbacks) -
                               namesakes)
          if module in probe_names]


def _parted(candidates, num_param_leaves: int) -> dict:
  """Module -> its applications' ops (:attr:`Discovery.parts`), for the
  ``candidates`` (:func:`_own_probe_modules`) whose applications are each
  of its own rule and run once (:func:`_parts`)."""
  out = {}
  for module, apps, probe_leaf in candidates or ():
    got = _parts(apps, probe_leaf, num_param_leaves)
    if got is not None:
      out[module] = got
  return out


def _slotted(candidates) -> dict:
  """Module -> its slot count (:attr:`Discovery.slot_counts`), for the
  ``candidates`` (:func:`_own_probe_modules`) whose applications can keep
  their factors in slots (:func:`_slot_count`)."""
  slotted = {}
  for module, apps, probe_leaf in candidates or ():
    uses = _slot_count(apps, probe_leaf)
    if uses is not None:
      slotted[module] = uses
  return slotted


def _probe_owner(num_param_leaves: int, probe_names: list[str],
                 app: Application) -> Optional[str]:
  """The module whose probe ``app`` reads (its state name), or None where
  that is not one module's (outside the live program)."""
  leaves = {s.leaf - num_param_leaves for s in app.probe_sources
            if s.leaf >= num_param_leaves}
  return probe_names[leaves.pop()] if len(leaves) == 1 else None


def discover(jaxpr, num_param_leaves: int, leaf_names: list[str],
             probe_names: list[str], gram_op_type,
             full_jaxpr=None, consts: Mapping[Any, Any] = None
             ) -> Discovery:
  """Reads a tracked loss's program: ``jaxpr(params, probes) -> loss``.

  Args:
    jaxpr: the live part (:func:`hijax_compat.live_part`) of
      ``jax.make_jaxpr`` of the loss, with the parameter leaves as its first
      ``num_param_leaves`` inputs and the probes (one leaf per module) next.
    num_param_leaves: number of parameter leaves.
    leaf_names: their names (``module/param``), for messages.
    probe_names: the modules of the probe leaves, in order: each op's facts
      are keyed by the module whose probe it reads (under ``hk.layer_stack``
      a module's own name lacks the stack's prefix).
    gram_op_type: the base class of Gram ops.
    full_jaxpr: the same program before dead-code elimination, where the
      slots are counted (:attr:`Discovery.slot_counts`): an application
      whose output the loss does not use still takes its module's next
      slot when the model runs (its slot then stays zero).
    consts: the program's constants, by constant variable (for
      :attr:`Discovery.pullbacks`).

  Returns:
    A :class:`Discovery`, keyed by module (state) name.

  Raises:
    ValueError: for a parameter that reaches a tracked op through a
      computation that changes its values (a reparametrisation) where that
      computation cannot be pulled back (see
      :class:`~gram_haiku._src.analysis.reparam.PullBack`), one that
      reaches the ops of two modules, a module applied under two modes, or
      an example axis that cannot be found.
  """
  n_probes = len(probe_names)
  ins = [frozenset({Source(k)}) if k < num_param_leaves + n_probes
         else frozenset() for k in range(len(jaxpr.invars))]
  # The leaves the loss's value is computed from, not only through
  # stop_gradient: the others have no gradient.
  outs, found = follow(jaxpr, ins, gram_op_type)
  reaching = {s.leaf for out in outs for s in out}
  for app in found.applications:
    _check_probe(app, num_param_leaves, probe_names)

  module_of = functools.partial(_probe_owner, num_param_leaves, probe_names)
  r = _read_applications(found, module_of, num_param_leaves)
  pullbacks = _read_pullbacks(jaxpr, consts or {}, found, module_of, r,
                              num_param_leaves, leaf_names, gram_op_type)
  # A pulled-back module keeps per-example gradients of its operands.
  shared = r.shared | set(pullbacks)
  layers = by_layer(r.ops, r.ops)
  _check_shared_names(layers, shared)
  frozen = _frozen_operands_of(r.frozen_of, r.ops, layers)
  ops = {m: op.with_plan(frozen=frozen[m]) for m, op in r.ops.items()}
  pulled = {k for pb in pullbacks.values() for k in pb.leaves}
  untracked, mixed = _untracked_uses(found, r.modules_of_leaf, pulled,
                                     leaf_names, num_param_leaves)
  slot_apps = found.applications
  if full_jaxpr is not None and shared:  # (only shared modules get slots)
    slot_apps = follow(full_jaxpr, ins, gram_op_type)[1].applications
  candidates = _own_probe_modules(shared, r, layers, pullbacks, slot_apps,
                                  module_of, num_param_leaves, probe_names)
  slotted = _slotted(candidates)
  parts = _parted(candidates, num_param_leaves)
  return Discovery(sizes=r.sizes, param_counts=r.counts,
                   shared=frozenset(shared), vmapped=r.vmapped, modes=r.modes,
                   example_specs=r.specs, probe_dtypes=r.dtypes,
                   untracked_uses=untracked, mixed=mixed, ops=ops,
                   param_leaves=r.leaves_of, applications=dict(r.n_apps),
                   slot_counts=slotted, parts=parts,
                   pullbacks=pullbacks,
                   no_gradient=frozenset(
                       leaf_names[k] for k in range(num_param_leaves)
                       if k not in reaching))

