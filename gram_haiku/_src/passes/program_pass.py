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
``hx.replay``). Each example's gradient of the
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
:mod:`gram_haiku._src.analysis.linear_bound`) and ``sum_i c_i g_i`` are
read from it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src.analysis import linear_bound
from gram_haiku._src.analysis import program_rules
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.core import errors
from gram_haiku._src.ops import op as op_lib


@dataclasses.dataclass
class Stores:
  """The program-level stores of one pass.

  Attributes:
    per_example: leaf index -> ``[B, *leaf.shape]`` per-example gradients
      (in at least float32), summed over the leaf's sites.
    error: leaf index -> ``[B]``: the bound of each row's rounding error
      (norm units), for a clipping pass; empty otherwise.
  """
  per_example: Mapping[int, jax.Array]
  error: Mapping[int, jax.Array]


def _slice(body, consts, targets: list, eqns: list):
  """``(ins, fn)``: ``fn(*values of ins) -> values of targets``, the
  equations of ``eqns`` (of ``body``, in order; constants' values
  ``consts`` by variable) that ``targets`` need, ``ins`` the inputs of
  ``body`` they read. A ``jit`` call among them is cut to the outputs
  needed (its body sliced the same way): a call that also takes the
  examples may return a value of the parameters alone (``w2, h =
  f(params, x)``), which is computed without the examples."""
  lit = lambda v: isinstance(v, hx.Literal)
  constvars = set(body.constvars)
  needed = {v for v in targets if not lit(v)}
  steps = []
  for e in reversed(eqns):
    want = [k for k, v in enumerate(e.outvars) if v in needed]
    if not want:
      continue
    call = hx.jit_body(e)
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
  bodies of the ``jit`` calls that hold it (:attr:`Site.calls`)."""
  levels = [(jaxpr, consts)] + [hx.jit_body(c) for c in site.calls]
  ends = [*site.calls, site.eqn]  # where each level's slice ends
  targets = [site.eqn.invars[site.operand]]
  fn = lambda *values: list(values)
  for depth in reversed(range(len(levels))):
    body, body_consts = levels[depth]
    eqns = list(body.eqns)
    at = next(k for k, e in enumerate(eqns) if e is ends[depth])
    ins, part = _slice(body, body_consts, targets, eqns[:at])
    fn = (lambda part, inner: lambda *values: inner(*part(*values)))(part,
                                                                     fn)
    if depth:  # the body's inputs: its call's operands, one level out
      call = ends[depth - 1]
      targets = [call.invars[list(body.invars).index(v)] for v in ins]
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


def _site_error(site, abs_sums) -> jax.Array:
  """``[B]``: the bound of the rounding of each example's ``dL/dZ`` at a
  per-example site, in norm units: its entries are sums of products of
  the site's other operands and its output cotangent (a contraction,
  convolution or gather's transpose), off by at most ``e sum |x| |d|``
  (:func:`~gram_haiku._src.compute.norm_bounds.dot_error`, ``n`` the
  terms of each entry: the data's free entries per example for a
  ``dot_general``, else the output's entries per example, more than any
  entry's terms) where
  ``abs_sums`` (``[B, *operand]``, computed by the same equation from
  absolute values) is ``sum |x| |d|`` up to the same relative error;
  so the bound is ``e / (1 - e) |abs_sums_i|``, rounded up."""
  out = site.eqn.outvars[0].aval.shape
  n = max(1, math.prod(out) // max(1, out[site.out_axis]))
  if site.eqn.primitive.name == "dot_general":  # n / the operand's free
    # entries: each entry of its cotangent sums the data's free entries.
    contracting, _ = site.eqn.params["dimension_numbers"]
    shape = site.eqn.invars[site.operand].aval.shape
    free = math.prod(shape) // max(1, math.prod(
        shape[d] for d in contracting[site.operand]))
    n = max(1, n // max(1, free))
  acc = abs_sums.dtype
  e = norm_bounds.dot_error(n, acc, site.eqn.params.get("precision"))
  rows = abs_sums.reshape((abs_sums.shape[0], -1))
  u = jnp.finfo(acc).eps
  return (e / jnp.maximum(1 - e, 1e-30) * norm_bounds.row_norms(rows) *
          (1 + 4 * u))


def _per_example(site, inputs, fn, leaves, dz, upper_bound: bool,
                 site_error=None):
  """``({leaf: [B, *shape]}, [B] error or None)`` of one site from its
  ``dz = dL/dZ``; ``site_error``: ``[B]``, the bound of the rounding of
  ``dz`` itself (a per-example site's), pulled back with it."""
  theta = [hx.vary_like(leaves[k], dz) for k in site.leaves]
  acc = jnp.promote_types(jnp.result_type(*theta), jnp.float32)
  _, vjp = jax.vjp(_slice_fn(site, inputs, fn, leaves, acc), *theta)
  ct = jnp.moveaxis(dz, site.axis, 0).astype(acc)
  grads = jax.vmap(vjp)(ct)
  out = {k: g.astype(acc) for k, g in zip(site.leaves, grads)}
  if not upper_bound:
    return out, None
  l, n, precision, why = linear_bound.bound(
      vjp, hx.vary_like(jnp.zeros(ct.shape[1:], acc), ct))
  if why:
    raise ValueError(errors.GETTER_NOT_BOUNDED.format(
        module=", ".join(str(k) for k in site.leaves), why=why))
  r = norm_bounds.dot_error(n, acc, precision)
  rows = ct.reshape((ct.shape[0], math.prod(ct.shape[1:])))
  bound = l * r * norm_bounds.row_norms(rows)
  if site_error is not None:  # |J^T e| <= l |e|, and J^T's own rounding
    bound = bound + l * (1 + r) * site_error.astype(bound.dtype)
  return out, bound


def value_and_grad(traced: Callable, leaves: Sequence[Any],
                   diff_idx: Sequence[int], probes: Mapping[str, Any],
                   arrays: Sequence[Any], program: program_rules.Program,
                   upper_bound: bool):
  """The pass of ``traced(leaves, probes, arrays) -> (value, aux)`` with
  the sites of ``program`` as inputs (see the module docstring).

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
  jaxpr = closed.jaxpr
  consts = dict(zip(jaxpr.constvars, closed.consts))
  n = len(leaves)
  sites = program_rules.match(
      program_rules.find(jaxpr, n, sorted(program.leaves), op_lib.RuleOp,
                         tracked=sorted(program.tracked)),
      program)
  prefixes = [_prefix(jaxpr, consts, s, n) for s in sites]
  zs = [jnp.broadcast_to(fn(*[leaves[k] for k in inputs])[0], s.shape)
        for s, (inputs, fn) in zip(sites, prefixes)]
  out_tree = jax.tree_util.tree_structure(shape)

  # For clipping, each per-example site's abs probe: its cotangent bounds
  # the rounding of the site's own dL/dZ (see _site_error).
  abs_zs = [jnp.zeros_like(z) if s.mapped and upper_bound else None
            for s, z in zip(sites, zs)]

  def loss(diff_leaves, diff_probes, z, abs_z):
    full = list(leaves)
    for k, v in zip(diff_idx, diff_leaves):
      full[k] = v
    outs = hx.replay(jaxpr, consts,
                     jax.tree_util.tree_leaves((full, diff_probes,
                                                list(arrays))),
                     {(s.path, id(s.eqn), s.operand): zk
                      for s, zk in zip(sites, z)},
                     {(s.path, id(s.eqn)): (s.in_axes, (s.operand,),
                                            s.out_axis, a)
                      for s, a in zip(sites, abs_z) if s.mapped})
    return jax.tree_util.tree_unflatten(out_tree, outs)

  out, (d_leaves, d_probes, dzs, d_abs) = jax.value_and_grad(
      loss, argnums=(0, 1, 2, 3), has_aux=True)(
          [leaves[k] for k in diff_idx], probes, zs, abs_zs)
  per, err = {}, {}
  for s, (inputs, fn), dz, da in zip(sites, prefixes, dzs, d_abs):
    grads, e = _per_example(s, inputs, fn, leaves, dz, upper_bound,
                            None if da is None else _site_error(s, da))
    for k, g in grads.items():
      per[k] = g if k not in per else per[k] + g
      if e is not None:  # (a bound of each part: their sum bounds the sum)
        err[k] = e if k not in err else err[k] + e
  return out, (d_leaves, d_probes), Stores(per, err)
