"""The pass with program-level Gram rules
(:mod:`gram_haiku._src.analysis.program_rules`).

Where some parameter is covered by a rule read from the program rather
than by a tracked module, the pass's loss is traced to a jaxpr (with
``track()`` told the pass's decisions, as for the plain pass) and
evaluated again under ``jax.value_and_grad`` with one change: at each
site, the broadcast of the parameter is an input ``Z`` of its own
(initialised to the value the program computes, so the loss, the other
gradients and every Gram op are as before; the Gram ops are hijax
primitives of the program, bound again). At a per-example site (a
``dot_general``, ``conv_general_dilated`` or ``gather`` of a parameter
with the data) ``Z`` is the operand stacked per example, ``[B,
*operand.shape]``, and the equation is bound once per example
(:func:`gram_haiku._src.compat.hijax_compat.bind_per_example`, through
``hx.replay``). A site inside a ``jit`` call, a checkpoint, a ``cond``
branch or a ``scan`` body is replayed there, ``Z`` closed over (in a loop
the same ``Z`` at every step, so that ``dL/dZ`` is the sum of the steps'
parts). Each example's gradient of the
parameter is then the pull-back of its slice of ``dL/dZ`` through the
program's own equations that compute one slice of ``Z`` from the
parameter (``F_1``):

    ``g_i = J_{F_1}(p)^T (dL/dZ)[i]``

summed over the parameter's sites. These ``[B, *p.shape]`` per-example
gradients are a store like a module's ``PER_EXAMPLE`` one (for a
parameter a tracked module reads too, they are added to that module's
``PER_EXAMPLE`` store: :func:`gram_haiku._src.passes.pass_pipeline.run`): its Gram,
norms (with a sound rounding bound: ``L r |dZ_i|``, ``L >= |J^T|`` and
``r`` the pull-back's rounding, read from its program by
:mod:`gram_haiku._src.analysis.linear_bound`, plus the rounding of a
per-example or loop site's own ``dL/dZ``: :func:`_site_error`) and
``sum_i c_i g_i`` are read from it.

A site of the shape of a linear layer (``x @ W``, ``x @ W.T``,
``jnp.einsum('btd,de->bte', x, W)``: :class:`~gram_haiku._src.analysis.
program_rules.LinearForm`) whose weight is the parameter itself (or its
transpose) of the program's own (not inside
a call or loop) is not evaluated once per example: the linear layer's Gram op
(:func:`gram_haiku._src.ops.linear.linear_rule`) is bound there with the
weight as its parameter and a probe of its own, so that it costs what a
tracked ``hk.Linear`` costs. For a parameter with that one site (not also
read by a tracked module) the probe receives its Gram or squared norms
(ghost or materialised, as the cost model says), or for a
re-contracting pass its factors (``x``, ``dL/dy`` per example; or its
per-example gradients where the cost model's book-keeping rule prefers
them): :attr:`Stores.formed`, :attr:`Stores.factors`. Shared with other
sites, it gives its per-example gradients by the linear kernels, added to
the parameter's :attr:`Stores.per_example`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src.analysis import linear_bound
from gram_haiku._src.analysis import program_rules
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute.plan import Plan
from gram_haiku._src.core import errors
from gram_haiku._src.ops import factors as factors_lib
from gram_haiku._src.ops import linear as linear_lib
from gram_haiku._src.ops import op as op_lib


@dataclasses.dataclass
class Stores:
  """The program-level stores of one pass.

  Attributes:
    per_example: leaf index -> ``[B, *leaf.shape]`` per-example gradients
      (in at least float32), summed over the leaf's sites.
    error: leaf index -> ``[B]``: the bound of each row's rounding error
      (norm units), for a clipping pass; empty otherwise.
    formed: leaf index -> its ``[B, B]`` Gram or ``[B]`` squared norms,
      formed by the linear Gram op bound at its one site.
    factors: leaf index -> ``(op, [B, K] factors, flip)``: the linear Gram
      op bound at its one site and its factors (``flip``: the op's weight
      is the leaf transposed).
  """
  per_example: Mapping[int, jax.Array]
  error: Mapping[int, jax.Array]
  formed: Mapping[int, jax.Array] = dataclasses.field(default_factory=dict)
  factors: Mapping[int, tuple] = dataclasses.field(default_factory=dict)


def _slice(body, consts, targets: list, eqns: list):
  """``(ins, fn)``: ``fn(*values of ins) -> values of targets``, the
  equations of ``eqns`` (of ``body``, in order; constants' values
  ``consts`` by variable) that ``targets`` need, ``ins`` the inputs of
  ``body`` they read. A ``jit`` call or a checkpoint among them
  (:data:`~gram_haiku._src.compat.hijax_compat.INLINE_CALLS`) is cut to
  the outputs needed (its body sliced the same way): a call that also
  takes the examples may return a value of the parameters alone (``w2, h
  = f(params, x)``), which is computed without the examples."""
  lit = lambda v: isinstance(v, hx.Literal)
  constvars = set(body.constvars)
  needed = {v for v in targets if not lit(v)}
  steps = []
  for e in reversed(eqns):
    want = [k for k, v in enumerate(e.outvars) if v in needed]
    if not want:
      continue
    call = hx.inline_body(e)
    if call is not None:
      sub, sub_consts = call
      sub_ins, part = _slice(sub, sub_consts, [sub.outvars[k] for k in want],
                             list(sub.eqns))
      operands = [e.invars[list(sub.invars).index(v)] for v in sub_ins]
      steps.append((operands, [e.outvars[k] for k in want], part))
    else:
      operands = [v for v in e.invars if not lit(v) and v not in constvars]
      part, _ = hx.sub_program(body, consts, operands, list(e.outvars), [e])
      steps.append((operands, list(e.outvars), part))
    needed |= {v for v in operands if not lit(v)}
  steps.reverse()
  ins = [v for v in body.invars if v in needed]

  def fn(*values):
    env = {v: consts[v] for v in constvars if v in needed}
    env.update(zip(ins, values))
    read = lambda v: v.val if lit(v) else env[v]
    for operands, outs, part in steps:
      env.update(zip(outs, part(*[read(v) for v in operands])))
    return [read(v) for v in targets]
  return ins, fn


def _prefix(jaxpr, consts, site, num_param_leaves: int):
  """``(inputs, fn)``: ``fn(*values of the program inputs inputs) ->
  [operand]``, the program's own equations that compute ``site``'s
  prefix operand (from parameter leaves and constants alone), through the
  programs of the calls, branches and loops that hold it
  (:attr:`Site.calls`; a loop's from its constants)."""
  ends = [*site.calls, site.eqn]  # where each level's slice ends
  levels = [(jaxpr, consts, None)] + [
      hx.body_holding(call, inner) for call, inner in zip(ends, ends[1:])]
  targets = [site.eqn.invars[site.operand]]
  fn = lambda *values: list(values)
  for depth in reversed(range(len(levels))):
    body, body_consts, operands = levels[depth]
    eqns = list(body.eqns)
    at = next(k for k, e in enumerate(eqns) if e is ends[depth])
    ins, part = _slice(body, body_consts, targets, eqns[:at])
    fn = (lambda part, inner: lambda *values: inner(*part(*values)))(part,
                                                                     fn)
    if depth:  # the body's inputs: its call's operands, one level out
      targets = [operands[list(body.invars).index(v)] for v in ins]
      if any(t is None for t in targets):
        raise AssertionError("gram_haiku internal error: a program-level "
                             "site's operand is computed from a loop's "
                             "carry or scanned input.")
  position = {v: k for k, v in enumerate(jaxpr.invars)}
  inputs = [position[v] for v in ins]
  if any(k >= num_param_leaves for k in inputs):
    raise AssertionError("gram_haiku internal error: a program-level site's "
                         "operand is computed from the data.")
  return inputs, fn


def _slice_fn(site, inputs, fn, leaves, acc) -> Callable:
  """``F_1(*theta)``: one slice (along the examples' axis) of ``Z`` as a
  function of ``site``'s leaves ``theta`` (the other inputs held)."""
  def f1(*theta):
    own = dict(zip(site.leaves, theta))
    vals = [own[k] if k in own else lax.stop_gradient(leaves[k])
            for k in inputs]
    # One slice of the broadcast, taken before broadcasting (a slice of
    # the whole [B, ...] broadcast would cost B times its size in the
    # pull-back, once per example).
    v = jnp.asarray(fn(*vals)[0])
    v = v.reshape((1,) * (len(site.shape) - v.ndim) + v.shape)
    v = lax.index_in_dim(v, 0, site.axis, keepdims=False)
    return jnp.broadcast_to(v, site.shape[:site.axis] +
                            site.shape[site.axis + 1:]).astype(acc)
  return f1


def _steps(site) -> int:
  """How many times ``site``'s equation runs per evaluation of the loss:
  the product of the lengths of the ``scan`` loops that hold it (each
  step's part of ``dL/dZ`` is added up by the loop's transpose)."""
  return math.prod(c.params["length"] for c in site.calls
                   if c.primitive.name == "scan")


def _site_error(site, abs_sums) -> jax.Array:
  """``[B]``: the bound of the rounding of each example's ``dL/dZ`` at a
  per-example site, or at a site inside a loop, in norm units.

  At a per-example site its entries are sums of products of the site's
  other operands and its output cotangent (a contraction, convolution or
  gather's transpose), off by at most ``e sum |x| |d|``
  (:func:`~gram_haiku._src.compute.norm_bounds.dot_error`, ``n`` the
  terms of each entry: the data's free entries per example for a
  ``dot_general``, else the output's entries per example, more than any
  entry's terms) where ``abs_sums`` (``[B, *operand]``, computed by the
  same equation from absolute values) is ``sum |x| |d|`` up to the same
  relative error; so the bound is ``e / (1 - e) |abs_sums_i|``, rounded
  up. Inside a loop of ``T`` steps (:func:`_steps`) each entry is the sum
  of ``T`` such sums (of one term each at a broadcast or concatenate
  site, whose ``abs_sums`` is ``sum_t |d_t|``: ``hx.abs_tap``): ``n + T
  - 1`` terms in all."""
  n = 1
  if site.mapped:
    out = site.eqn.outvars[0].aval.shape
    n = max(1, math.prod(out) // max(1, out[site.out_axis]))
  if site.mapped and site.eqn.primitive.name == "dot_general":
    # n / the operand's free entries: each entry of its cotangent sums the
    # data's free entries.
    contracting, _ = site.eqn.params["dimension_numbers"]
    shape = site.eqn.invars[site.operand].aval.shape
    free = math.prod(shape) // max(1, math.prod(
        shape[d] for d in contracting[site.operand]))
    n = max(1, n // max(1, free))
  n += _steps(site) - 1
  acc = abs_sums.dtype
  e = norm_bounds.dot_error(n, acc, site.eqn.params.get("precision"))
  rows = jnp.moveaxis(abs_sums, site.axis, 0)
  rows = rows.reshape((rows.shape[0], -1))
  u = jnp.finfo(acc).eps
  return (e / jnp.maximum(1 - e, 1e-30) * norm_bounds.row_norms(rows) *
          (1 + 4 * u))


def _per_example(site, inputs, fn, leaves, dz, upper_bound: bool,
                 site_error=None, names=()):
  """``({leaf: [B, *shape]}, [B] error or None)`` of one site from its
  ``dz = dL/dZ``; ``site_error``: ``[B]``, the bound of the rounding of
  ``dz`` itself (a per-example site's), pulled back with it; ``names``:
  the site's leaves' names, for messages."""
  theta = [hx.vary_like(leaves[k], dz) for k in site.leaves]
  acc = jnp.promote_types(jnp.result_type(*theta), jnp.float32)
  _, vjp = jax.vjp(_slice_fn(site, inputs, fn, leaves, acc), *theta)
  ct = jnp.moveaxis(dz, site.axis, 0).astype(acc)
  grads = jax.vmap(vjp)(ct)
  out = {k: g.astype(acc) for k, g in zip(site.leaves, grads)}
  if not upper_bound:
    return out, None
  rows = ct.reshape((ct.shape[0], math.prod(ct.shape[1:])))
  bound, why = linear_bound.pulled_back_error(
      vjp, hx.vary_like(jnp.zeros(ct.shape[1:], acc), ct), rows, site_error)
  if why:
    raise ValueError(errors.PROGRAM_PREFIX_NOT_BOUNDED.format(
        params=", ".join(repr(n) for n in names or site.leaves),
        primitive=site.eqn.primitive.name, line=site.line, why=why))
  return out, bound


def _weight_flip(jaxpr, site) -> Optional[bool]:
  """For a linear site (:attr:`Site.linear`) of the program's own, whether
  its weight ``W'`` (``[d_in, d_out]``) is its one leaf transposed
  (True) or the leaf itself (False); None where the weight is another
  function of the leaf (a cast, a scale: the site is evaluated once per
  example, and the gradient pulled back)."""
  if site.linear is None or site.calls or len(site.leaves) != 1:
    return None
  v = site.eqn.invars[site.operand]
  leaf = jaxpr.invars[site.leaves[0]]
  if v is leaf:
    return site.linear.w_transposed
  producer = next((e for e in jaxpr.eqns
                   if any(o is v for o in e.outvars)), None)
  if (producer is not None and producer.primitive.name == "transpose" and
      tuple(producer.params["permutation"]) == (1, 0) and
      producer.invars[0] is leaf):
    return not site.linear.w_transposed
  return None


def _linear_op(site, mode: str, upper_bound: bool, name: str):
  """The linear layer's Gram op for ``site`` (:attr:`Site.linear`) in
  ``mode`` (its probe's shape for that mode), the examples on axis 0 of
  its input."""
  form = site.linear
  x = site.eqn.invars[form.data].aval
  w = site.eqn.invars[site.operand].aval
  x_aval = x.update(shape=tuple(x.shape[a] for a in form.x_perm))
  w_aval = w.update(shape=tuple(w.shape[::-1] if form.w_transposed
                                else w.shape))
  acc = kernels.accumulation_dtype(x.dtype, w.dtype)
  plan = Plan.make(mode=mode, example_axis=0, column_axes=()).replace(
      upper_bound=upper_bound and mode == "per_example")
  rule = linear_lib.linear_rule(site.eqn.params.get("precision"))
  make = lambda shape: op_lib.RuleOp(
      x_aval, (w_aval, None), x.update(shape=shape, dtype=acc,
                                       weak_type=False),
      name=name, plan=plan, rule=rule)
  b = x_aval.shape[0]
  op = make((b,))
  return make({"gram": (b, b), "norms": (b,),
               "factors": (b, factors_lib.factor_width(op)),
               "per_example": (b, op.num_params() + int(plan.upper_bound))
               }[mode])


def _bind_linear(site, op, stop: bool, ins: list, probe) -> list:
  """``site``'s output with the linear Gram ``op`` bound in its place
  (the weight through ``stop_gradient`` where ``stop``: its gradient is
  then the sum of the per-example gradients the probe receives)."""
  form = site.linear
  x = jnp.transpose(ins[form.data], form.x_perm)
  w = ins[site.operand]
  w = w.T if form.w_transposed else w
  if stop:
    w = lax.stop_gradient(w)
  return [jnp.transpose(op(x, w, None, probe), form.out_perm)]


def _linear_sites(jaxpr, sites, program, ghost: Optional[str],
                  upper_bound: bool) -> list:
  """Per site, None (evaluated once per example) or ``(op, flip, stop)``:
  the linear Gram op bound there (:func:`_linear_op`), whether its weight
  is the leaf transposed, and whether the weight's gradient comes from the
  probe (``"per_example"`` mode) rather than the op's own VJP. ``ghost``:
  the mode of a leaf's one site (``"gram"``, ``"norms"``, ``"factors"``:
  the cost model's book-keeping rule may prefer ``"per_example"``); None:
  no linear site (the examples sharded over a mesh)."""
  count = collections.Counter(k for s in sites for k in s.leaves)
  out = []
  for s in sites:
    flip = None if ghost is None else _weight_flip(jaxpr, s)
    if flip is None:
      out.append(None)
      continue
    (k,) = s.leaves
    mode = (ghost if count[k] == 1 and k not in program.tracked
            else "per_example")
    name = program.leaves[k]
    op = _linear_op(s, mode, upper_bound, name)
    if mode == "factors" and cost_model.bookkeeping_method(
        op.num_params(), cost_model.value_hint(factors_lib.factor_width(op)),
        op.factors_exact(op.accumulation_dtype())) != "factors":
      mode = "per_example"
      op = _linear_op(s, mode, upper_bound, name)
    out.append((op, flip, mode == "per_example"))
  return out


def value_and_grad(traced: Callable, leaves: Sequence[Any],
                   diff_idx: Sequence[int], probes: Mapping[str, Any],
                   arrays: Sequence[Any], program: program_rules.Program,
                   upper_bound: bool, ghost: Optional[str] = None):
  """The pass of ``traced(leaves, probes, arrays) -> (value, aux)`` with
  the sites of ``program`` as inputs (see the module docstring).
  ``ghost``: what a parameter's one linear site keeps (``"gram"``,
  ``"norms"``, ``"factors"``; see :func:`_linear_sites`), None for no
  linear site.

  Returns:
    ``((value, aux), (leaf cotangents of diff_idx, probe cotangents),
    Stores)``, the first two as ``jax.value_and_grad(..., argnums=(0, 1),
    has_aux=True)`` of the loss of the differentiated leaves and probes
    gives them.
  """
  if not program.sites:  # No examples (B = 0): every store is empty.
    def plain(diff_leaves, diff_probes):
      full = list(leaves)
      for k, v in zip(diff_idx, diff_leaves):
        full[k] = v
      return traced(full, diff_probes, list(arrays))
    out, cts = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(
        [leaves[k] for k in diff_idx], probes)
    acc = {k: jnp.promote_types(jnp.result_type(leaves[k]), jnp.float32)
           for k in program.leaves}
    return out, cts, Stores(
        {k: jnp.zeros((0, *jnp.shape(leaves[k])), acc[k])
         for k in program.leaves},
        {k: jnp.zeros((0,), acc[k]) for k in program.leaves}
        if upper_bound else {})
  closed, shape = jax.make_jaxpr(traced, return_shape=True)(
      list(leaves), probes, list(arrays))
  # Without its dead equations, as the discovery read it (a vmapped cond
  # leaves a dead select of each branch's operands: sites of no value).
  jaxpr = hx.live_part(closed.jaxpr)
  consts = dict(zip(closed.jaxpr.constvars, closed.consts))
  n = len(leaves)
  sites = program_rules.match(
      program_rules.find(jaxpr, n, sorted(program.leaves), op_lib.RuleOp,
                         tracked=sorted(program.tracked)),
      program)
  linear = _linear_sites(jaxpr, sites, program, ghost, upper_bound)
  prefixes = [_prefix(jaxpr, consts, s, n) for s in sites]
  zs = [None if lin else
        jnp.broadcast_to(fn(*[leaves[k] for k in inputs])[0], s.shape)
        for s, (inputs, fn), lin in zip(sites, prefixes, linear)]
  out_tree = jax.tree_util.tree_structure(shape)

  # For clipping, each per-example site's abs probe, and each other site's
  # inside a loop: its cotangent bounds the rounding of the site's own
  # dL/dZ (see _site_error).
  abs_zs = [jnp.zeros_like(z) if upper_bound and z is not None and (
      s.mapped or _steps(s) > 1) else None for s, z in zip(sites, zs)]
  # Each linear site's probe (see _linear_sites).
  lin_probes = [None if lin is None else jnp.zeros(
      lin[0].probe_aval.shape, lin[0].probe_aval.dtype) for lin in linear]

  def loss(diff_leaves, diff_probes, z, abs_z, lin_p):
    full = list(leaves)
    for k, v in zip(diff_idx, diff_leaves):
      full[k] = v
    mapped = {(s.path, id(s.eqn)): (s.in_axes, (s.operand,), s.out_axis, a)
              for s, a, lin in zip(sites, abs_z, linear)
              if s.mapped and lin is None}
    mapped.update({(s.path, id(s.eqn)): functools.partial(
        _bind_linear, s, lin[0], lin[2], probe=p)
                   for s, lin, p in zip(sites, linear, lin_p)
                   if lin is not None})
    outs = hx.replay(jaxpr, consts,
                     jax.tree_util.tree_leaves((full, diff_probes,
                                                list(arrays))),
                     {(s.path, id(s.eqn), s.operand): zk
                      for s, zk in zip(sites, z) if zk is not None},
                     mapped,
                     {(s.path, id(s.eqn), s.operand): a
                      for s, a in zip(sites, abs_z)
                      if a is not None and not s.mapped})
    return jax.tree_util.tree_unflatten(out_tree, outs)

  out, (d_leaves, d_probes, dzs, d_abs, d_lin) = jax.value_and_grad(
      loss, argnums=(0, 1, 2, 3, 4), has_aux=True)(
          [leaves[k] for k in diff_idx], probes, zs, abs_zs, lin_probes)
  per, err, formed, kept_factors = {}, {}, {}, {}
  for s, (inputs, fn), dz, da, lin, dl in zip(sites, prefixes, dzs, d_abs,
                                              linear, d_lin):
    if lin is not None:
      op, flip, _ = lin
      (k,) = s.leaves
      if op.mode in ("gram", "norms"):
        formed[k] = dl
        continue
      if op.mode == "factors":
        kept_factors[k] = (op, dl, flip)
        continue
      grads, e = _linear_per_example(op, dl, flip, leaves[k], upper_bound)
      grads = {k: grads}
    else:
      grads, e = _per_example(s, inputs, fn, leaves, dz, upper_bound,
                              None if da is None else _site_error(s, da),
                              [program.leaves[k] for k in s.leaves])
    for k, g in grads.items():
      per[k] = g if k not in per else per[k] + g
      if e is not None:  # (a bound of each part: their sum bounds the sum)
        err[k] = e if k not in err else err[k] + e
  return out, (d_leaves, d_probes), Stores(per, err, formed, kept_factors)


def _linear_per_example(op, value, flip: bool, leaf, upper_bound: bool):
  """``([B, *leaf.shape], [B] error or None)``: the per-example gradients
  of a linear site's leaf from its op's ``"per_example"`` probe (``[B,
  d_in d_out]``, then the rounding bound's column in a clipping pass)."""
  b = value.shape[0]
  d_in, d_out = op.param_avals[0].shape
  g = value[:, :d_in * d_out].reshape((b, d_in, d_out))
  if flip:
    g = jnp.swapaxes(g, 1, 2)
  return g.reshape((b, *jnp.shape(leaf))), (value[:, -1] if upper_bound
                                             else None)
