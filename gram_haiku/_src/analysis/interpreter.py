"""One forward interpreter of jaxprs for the program analyses.

Every analysis of a traced program (which parameter reaches which Gram op
and through what, :mod:`gram_haiku._src.analysis.dataflow`; where the examples
flow, :mod:`gram_haiku._src.analysis.example_flow`) is a *domain* on this one
interpreter, in the style of JAX's ``primitive_batchers`` and
neural-tangents' ``STRUCTURE_RULES``:

* a lattice of abstract states: its ``join`` and its ``bottom`` (the state
  of a literal or a variable the program never bound);
* a table of rules keyed by primitive (:func:`hijax_compat.rule_table`):
  ``rule(ctx, eqn, ins) -> outs``, a plain function of an explicit context
  (the :class:`Interpreter`) and the states of the equation's operands,
  returning one state per output; a ``default`` for primitives without a
  rule, and the rule under :data:`GRAM_OP` for an equation of a Gram op;
* findings, appended to the run's :class:`Log` (never to attributes of the
  domain), which a reader of the domain's own turns into facts and
  errors after the run.

The interpreter owns what is the same for every domain, once: running a
program's equations in order, the per-call-site keys of sub-programs
(:meth:`Interpreter.key`; a helper called from two places runs under two
keys, the rounds of one loop under one), running a call's sub-programs
(:meth:`Interpreter.run_subs`), the fixed point of a loop's carries
(:meth:`Interpreter.fixed_point`: only the last round's findings are
kept, since earlier rounds saw carries below their fixed point) and the
branches of a ``cond`` (:meth:`Interpreter.branches`: each branch's
findings are kept apart, as a :class:`Branches` entry of the log, so that
a reader can count alternatives as such).

A domain's rules for ``scan``, ``while``, ``cond`` and the call-like
primitives are small transfer functions that say what a loop step or a
call does to its operands' states; the traversal is this module's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.core import warning_site

#: The key of a domain's rule for an equation of a Gram op (a hijax
#: primitive of the tracked op type): ``rule(ctx, eqn, op, ins)``.
GRAM_OP = "gram_op"

Rule = Callable[..., list]


@dataclasses.dataclass(frozen=True)
class Branches:
  """A log entry: the findings of a ``cond``'s branches, one tuple per
  branch (alternatives: one of them runs)."""
  logs: tuple


class Log:
  """The findings of one run, in the order they were made: append-only.

  Entries are the domain's own records, and :class:`Branches` for the
  findings inside a ``cond``.
  """

  def __init__(self):
    self._entries: list = []

  def append(self, entry: Any) -> None:
    self._entries.append(entry)

  def extend(self, entries: Sequence[Any]) -> None:
    self._entries.extend(entries)

  def entries(self) -> tuple:
    return tuple(self._entries)


def flatten(entries: Sequence[Any]) -> Iterator[Any]:
  """A log's entries with every branch's entries in place of its
  :class:`Branches`, in order."""
  for e in entries:
    if isinstance(e, Branches):
      for branch in e.logs:
        yield from flatten(branch)
    else:
      yield e


@dataclasses.dataclass(frozen=True)
class Domain:
  """An analysis on the interpreter (see the module docstring).

  Attributes:
    name: for messages.
    rules: primitive -> rule (:func:`hijax_compat.rule_table`); the rule
      under :data:`GRAM_OP` for a Gram op's equation.
    default: the rule for a primitive without one.
    join: the least state above two.
    bottom: the state of a literal or an unbound variable.
    literal: ``literal(ctx, v)``, a literal's state (``bottom`` if None).
    constant: ``constant(ctx, v)``, the state of a constant variable of a
      program (``bottom`` if None).
    output: ``output(ctx, v, state)``, the state stored for an output
      variable (``state`` if None).
    equation: ``equation(ctx, eqn, ins) -> outs``, for a domain whose
      states are a product (a state and facts about the value) that it
      unpacks around its rule table: every equation goes to it (None: the
      rule table's rule, :meth:`Interpreter.dispatch`).
  """
  name: str
  rules: Mapping[Any, Rule]
  default: Rule
  join: Callable[[Any, Any], Any]
  bottom: Any
  literal: Optional[Callable] = None
  constant: Optional[Callable] = None
  output: Optional[Callable] = None
  equation: Optional[Callable] = None


class Interpreter:
  """Runs a domain over a program; the context every rule gets.

  Attributes:
    domain: the :class:`Domain`.
    config: the domain's parameters for this run (any value; the domain's
      rules read it).
    gram_op_type: the base class of Gram ops (their equations go to the
      :data:`GRAM_OP` rule); None for a domain without such a rule.
    log: the findings so far (the current round's or branch's).
    depth: 1 while running the program's own equations, more inside calls,
      loops and branches.
    site: the key of the current run (:meth:`key`).
  """

  def __init__(self, domain: Domain, gram_op_type: Optional[type],
               config: Any = None):
    self.domain = domain
    self.config = config
    self.gram_op_type = gram_op_type
    self.log = Log()
    self.depth = 0
    self.site: Any = 0
    self._runs = 0
    # The equations being interpreted, outermost first (a call's, then
    # those of its program), for messages (:meth:`line_of`).
    self.enclosing: list = []

  # -- programs and equations ----------------------------------------------

  def run(self, jaxpr, ins: Sequence[Any], site: Any = None) -> list:
    """The states of ``jaxpr``'s outputs for its inputs' ``ins``.

    ``site``: the calling equation's :meth:`key`; None for a program of
    its own (a fresh key).
    """
    if site is None:
      self._runs += 1
      site = ("run", self._runs)
    outer, self.site = self.site, site
    self.depth += 1
    try:
      return self._run(jaxpr, ins)
    finally:
      self.depth -= 1
      self.site = outer

  def _run(self, jaxpr, ins) -> list:
    d = self.domain
    env = dict(zip(jaxpr.invars, ins))
    for v in jaxpr.constvars:
      if v not in env:
        env[v] = d.bottom if d.constant is None else d.constant(self, v)
    for eqn in jaxpr.eqns:
      self.enclosing.append(eqn)
      try:
        outs = self.eqn(eqn, [self.read(env, v) for v in eqn.invars])
      finally:
        self.enclosing.pop()
      for v, s in zip(eqn.outvars, outs):
        env[v] = s if d.output is None else d.output(self, v, s)
    return [self.read(env, v) for v in jaxpr.outvars]

  def read(self, env: Mapping[Any, Any], v) -> Any:
    """The state of operand ``v`` in ``env``."""
    d = self.domain
    if isinstance(v, hx.Literal):
      return d.bottom if d.literal is None else d.literal(self, v)
    return env.get(v, d.bottom)

  def eqn(self, eqn, ins: list) -> list:
    """The states of one equation's outputs: its rule's (or the domain's
    ``equation``)."""
    if self.domain.equation is not None:
      return self.domain.equation(self, eqn, ins)
    return self.dispatch(eqn, ins)

  def dispatch(self, eqn, ins: list) -> list:
    """The outputs of ``eqn``'s rule in the domain's table (its Gram op
    rule, its primitive's, or the default)."""
    op = (None if self.gram_op_type is None else
          hx.gram_op_of(eqn, self.gram_op_type))
    if op is not None:
      return self.domain.rules[GRAM_OP](self, eqn, op, ins)
    rule = hx.rule_of(self.domain.rules, eqn)
    if rule is None:
      rule = self.domain.default
    return rule(self, eqn, ins)

  def line_of(self, eqn) -> str:
    """``" (at file:line)"``: the user's line that traced ``eqn``, else
    that of the innermost equation being interpreted that holds it (``eqn``
    inside a library's jitted function: ``jnp.take``, ``jnp.sort``,
    ``jnp.var``, whose tracebacks end inside JAX); ``""`` where JAX kept
    neither."""
    line = warning_site.user_line(hx.source_frames(eqn))
    for outer in reversed(self.enclosing):
      if line:
        break
      line = warning_site.user_line(hx.source_frames(outer))
    return line

  def key(self, eqn) -> tuple:
    """A key of one equation in the current run: the site of the
    programs it calls."""
    return (self.site, id(eqn))

  def call_path(self, site: Any = None) -> tuple:
    """The ids of the equations (outermost first) whose programs the
    current run (or the run of key ``site``) is inside, by :meth:`key`:
    ``()`` in a program's own."""
    path, site = [], self.site if site is None else site
    while isinstance(site, tuple) and len(site) == 2 and not isinstance(
        site[0], str):  # (a fresh run's key is ("run", n))
      site, eqn_id = site
      path.append(eqn_id)
    return tuple(reversed(path))

  # -- control flow ---------------------------------------------------------

  def join_all(self, outs: Sequence[Optional[list]]) -> Optional[list]:
    """The outputs of several programs (alternatives, or parts of one call),
    joined; None entries (not run) are left out; None if all are."""
    joined = None
    for res in outs:
      if res is None:
        continue
      joined = (list(res) if joined is None else
                [self.domain.join(a, b) for a, b in zip(joined, res)])
    return joined

  def run_subs(self, eqn, ins_of: Callable[[Any], Optional[list]]
               ) -> list[Optional[list]]:
    """Runs each sub-program of a call ``eqn`` (``jit``, ``remat``, a custom
    derivative's programs) on ``ins_of(sub)`` (None: not run) under the
    call's :meth:`key`; their outputs, in order (None where not run)."""
    out = []
    for sub in hx.jaxprs_of(eqn):
      ins = ins_of(sub)
      out.append(None if ins is None else self.run(sub, ins, self.key(eqn)))
    return out

  def branches(self, eqn, jaxprs: Sequence[Any], ins: list) -> list[list]:
    """Runs each branch of a ``cond`` ``eqn`` on ``ins``; their outputs. The
    findings of each go to the log as one :class:`Branches` entry."""
    outer, logs, outs = self.log, [], []
    try:
      for branch in jaxprs:
        self.log = Log()
        outs.append(self.run(branch, ins, self.key(eqn)))
        logs.append(self.log.entries())
    finally:
      self.log = outer
    outer.append(Branches(tuple(logs)))
    return outs

  def fixed_point(self, step: Callable[[list], tuple[Any, list]],
                  carry: list, rounds: int, every_round: bool = False
                  ) -> tuple[Any, list, bool]:
    """A loop's carries at their fixed point.

    ``step(carry) -> (result, new_carry)`` runs one round (the loop's
    programs, under the loop equation's :meth:`key`); rounds repeat until
    ``new_carry == carry``, at most ``rounds`` times. Only the findings
    of the last round are kept (earlier ones saw carries below the fixed
    point), unless ``every_round`` (a domain whose findings only
    accumulate).

    Returns:
      ``(result, carry, reached)``: the last round's result and carry, and
      whether the carries reached their fixed point within ``rounds``.
    """
    outer, result = self.log, None
    try:
      for _ in range(rounds):
        if not every_round:
          self.log = Log()
        result, new = step(list(carry))
        if list(new) == list(carry):
          if not every_round:
            outer.extend(self.log.entries())
          return result, list(carry), True
        carry = new
    finally:
      self.log = outer
    return result, list(carry), False


def interpret(domain: Domain, jaxpr, ins: Sequence[Any],
              gram_op_type: Optional[type] = None,
              config: Any = None) -> tuple[list, tuple]:
  """Runs ``domain`` over ``jaxpr``: ``(output states, log entries)``."""
  ctx = Interpreter(domain, gram_op_type, config)
  outs = ctx.run(jaxpr, ins)
  return outs, ctx.log.entries()
