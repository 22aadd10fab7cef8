"""The program interpreter's own mechanics, on a toy domain: which inputs
each value is computed from (sets, joined by union)."""

import jax
import jax.numpy as jnp
from jax.extend.core import primitives

from gram_haiku._src.analysis import interpreter
from gram_haiku._src.compat import hijax_compat as hx


def _union(ctx, eqn, ins):
  del ctx
  out = frozenset().union(*ins) if ins else frozenset()
  return [out] * len(eqn.outvars)


def _call(ctx, eqn, ins):
  outs = ctx.join_all(ctx.run_subs(eqn, lambda sub: list(ins)))
  return outs if outs is not None else _union(ctx, eqn, ins)


def _scan(ctx, eqn, ins):
  body, n_consts, n_carry, _ = hx.scan_parts(eqn)
  carries = range(n_consts, n_consts + n_carry)

  def step(inner):
    outs = ctx.run(body, inner, ctx.key(eqn))
    new = list(inner)
    for k, out in zip(carries, outs[:n_carry]):
      new[k] = inner[k] | out
    ctx.log.append(("round", tuple(new)))
    return outs, new

  outs, _, reached = ctx.fixed_point(step, list(ins), 4 * n_carry + 4)
  assert reached
  return outs


def _cond(ctx, eqn, ins):
  return ctx.join_all(ctx.branches(eqn, hx.cond_branches(eqn), ins[1:]))


def _sin(ctx, eqn, ins):
  ctx.log.append(("sin", ctx.site))
  return _union(ctx, eqn, ins)


REACH = interpreter.Domain(
    name="reach",
    rules=hx.rule_table({"jit": _call, "scan": _scan, "cond": _cond,
                         "sin": _sin}),
    default=_union, join=lambda a, b: a | b, bottom=frozenset())


def _reach(f, *args):
  closed = jax.make_jaxpr(f)(*args)
  ins = [frozenset({k}) for k in range(len(closed.jaxpr.invars))]
  return interpreter.interpret(REACH, closed.jaxpr, ins)


def test_rule_tables_are_keyed_by_primitive_objects():
  table = hx.rule_table({"add": 1, "pvary": 2})
  assert primitives.add_p in table  # exported: the primitive itself
  assert "pvary" in table or hx.primitive_named("pvary") in table
  eqn = jax.make_jaxpr(lambda x: x + 1.0)(1.0).jaxpr.eqns[0]
  assert hx.rule_of(table, eqn) == 1


def test_calls_are_followed_inside():
  outs, _ = _reach(lambda x, y: jax.jit(lambda a, b: a * 2.0)(x, y), 1.0, 2.0)
  assert outs == [frozenset({0})]


def test_loop_carries_reach_their_fixed_point_and_keep_the_last_round():
  def rotate(x, y, z):
    def body(c, _):
      a, b, d = c
      return (b, d, a), None
    return jax.lax.scan(body, (x, y, z), None, length=3)[0]
  outs, log = _reach(rotate, 1.0, 2.0, 3.0)
  # Each carry meets every input after two rounds of the rotation.
  assert outs == [frozenset({0, 1, 2})] * 3
  rounds = [e for e in log if e[0] == "round"]
  assert len(rounds) == 1  # only the round at the fixed point is kept


def test_cond_branches_are_one_log_entry_of_alternatives():
  def f(p, x, y):
    return jax.lax.cond(p > 0, lambda a, b: jnp.sin(a), lambda a, b: b, x, y)
  outs, log = _reach(f, 1.0, 2.0, 3.0)
  assert outs == [frozenset({1, 2})]
  (branches,) = [e for e in log if isinstance(e, interpreter.Branches)]
  assert len(branches.logs) == 2
  assert [e[0] for e in interpreter.flatten(log)] == ["sin"]


def test_a_helper_called_from_two_places_runs_under_two_keys():
  helper = jax.jit(jnp.sin)
  _, log = _reach(lambda x: helper(x) + helper(x), 1.0)
  sites = [e[1] for e in interpreter.flatten(log) if e[0] == "sin"]
  assert len(sites) == 2 and sites[0] != sites[1]
