"""Reparametrised layers: per-example gradients pulled back to parameters.

A custom getter may hand a tracked layer a function of its parameters
instead of the parameters themselves: ``W' = fn(theta)`` (weight
normalisation ``g v / |v|``, a scale, weight standardisation, low-rank
adapters ``W0 + A B``). The layer's rule knows gradients with respect to
what it receives, ``W'``. Such a layer keeps its per-example gradients
``f_i = dl_i / dW'`` through the pass (``"per_example"`` mode), and each
example's gradient with respect to the parameters is the pull-back

    ``g_i = dl_i / dtheta = J_fn(theta)^T f_i``,

exact because ``g_i`` is linear in ``f_i`` (the chain rule, one example at a
time); for a weighted sum ``sum_i c_i g_i = J^T (sum_i c_i f_i)`` one
pull-back suffices. ``fn`` is the program's own equations that compute the
operands, read from the traced program (:func:`read_pullback`). Cost: ``B``
VJPs of ``fn``, and ``B x P`` memory for the layer. On an accelerator they
run as one VJP vectorised over a block of examples (``jax.vmap``), as many
examples a block as the layer's memory budget holds
(:func:`gram_haiku._src.compute.kernels.rows_per_block`): one VJP per
example in sequence is ``B`` steps too small to keep the chip busy (WRN-16-4
with weight standardisation, ``B = 128``, one TPU v5e: the pull-backs were
most of a 47.6 ms clipping step). On a CPU, one example at a time
(:data:`BLOCKED_ON_CPU`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src.analysis import linear_bound
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.core import errors
from gram_haiku._src.frontend import standardise

#: Whether a CPU too pulls back a block of examples at once. XLA's CPU
#: backend fuses a reduction over a vectorised cotangent into the loop that
#: broadcasts it back, recomputing it per entry (weight normalisation of a
#: 1024 x 1024 kernel, ``B = 8``: 0.71 s vectorised against 0.036 s one
#: example at a time; ``lax.optimization_barrier`` does not keep them
#: apart there), so a CPU takes one example per step. Tests set it to check
#: the blocked path on a CPU.
BLOCKED_ON_CPU = False


@dataclasses.dataclass(frozen=True)
class PullBack:
  """How a reparametrised layer's operands are computed from parameters.

  A layer whose parameter operands are a function ``W' = fn(theta)`` of
  parameter leaves (weight normalisation, a scale, weight
  standardisation, ``W0 + A B``: a custom getter; the same ``fn`` at every
  use) accumulates per-example gradients with respect to ``W'`` in the
  pass (it is listed as shared); the per-example gradients with respect to
  ``theta`` are their pull-back ``J_fn(theta)^T`` (see the module
  docstring).

  Attributes:
    leaves: the indices of the parameter leaves ``theta``, in the order
      ``fn`` takes them.
    fn: ``fn(*theta) -> [W'...]``: the op's present parameter operands, in
      order (the program's own equations that compute them).
    closed: where the reparametrisation is one the pass knows in closed
      form (:data:`CLOSED_FORMS`, recognised by its mark): how to read it
      (:class:`Standardised`); else None (the generic pull-back).
  """
  leaves: tuple[int, ...]
  fn: Any
  closed: Optional["Standardised"] = None


@dataclasses.dataclass(frozen=True)
class Standardised:
  """A weight standardisation (:func:`gram_haiku.standardise_weight`) of
  the op's first parameter operand, recognised by its mark.

  Its Jacobian at the standardised kernel ``w_hat`` (the operand) is, per
  output channel ``c`` of fan-in ``n``, ``J_c = (1/s_c)(I - 1 1^T / n -
  w_hat_c w_hat_c^T / n)`` (symmetric, whatever ``eps``), so the
  per-example gradients of the kernel are ``J^T f_i`` in closed form
  (:mod:`gram_haiku._src.passes.standardised`).

  Attributes:
    fn: ``fn(*theta, dtype=None) -> [w_hat, s]``: the standardised kernel
      and its scales ``[1, ..., 1, C]``, from the parameter leaves
      ``theta`` (the pull-back's, in its order; the marked call's own
      program), or, with ``dtype``, ``[w_hat, s, err]``: the same
      standardisation evaluated in ``dtype`` from the kernel and ``eps``
      cast up (the closed form's Jacobian at the kernel itself, not at a
      low-precision rounding of its ``w_hat`` and ``s``) and ``[C]``
      bounds of that Jacobian's distance to the exact one
      (:func:`gram_haiku._src.frontend.standardise.standardise_in`).
    kernel: the parameter leaf standardised.
    others: the parameter leaf each present operand after the kernel is
      (a bias, read as it is), in order.
  """
  fn: Any
  kernel: int
  others: tuple[int, ...]


def _read_standardised(jaxpr, consts, app, chosen, inputs):
  """:class:`Standardised`, where the slice ``chosen`` computing ``app``'s
  operands is the marked call alone, its first output the op's first
  parameter operand and read by nothing else there; else None."""
  (eqn,) = chosen
  w_hat = eqn.outvars[0]
  operands = app.eqn.invars[1:-1]
  position = {v: k for k, v in enumerate(jaxpr.invars)}
  if (not operands or operands[0] is not w_hat or
      isinstance(eqn.invars[0], hx.Literal) or eqn.invars[0] not in position
      or any(isinstance(v, hx.Literal) or v not in position
             for v in operands[1:])):
    return None
  eps = eqn.invars[1] if len(eqn.invars) > 1 else None
  if eps is not None and not isinstance(eps, hx.Literal) and eps not in consts:
    return None  # A parameter (a learned eps): its gradient has no closed form.
  body, body_consts = hx.jit_body(eqn)
  if body_consts or not standardise.is_marked_program(
      body, [v.aval for v in eqn.invars]):
    return None  # Named like the mark, but another program.
  # The marked program ends ``centred / s`` (its unused second output
  # ``s`` may have been pruned from the call): ``s`` is read there.
  last = body.eqns[-1] if body.eqns else None
  if (last is None or last.primitive.name != "div" or
      last.outvars[0] is not body.outvars[0] or
      isinstance(last.invars[1], hx.Literal)):
    return None
  inner, _ = hx.sub_program(body, body_consts, list(body.invars),
                            [body.outvars[0], last.invars[1]],
                            list(body.eqns))
  order = [jaxpr.invars[k] for k in inputs]

  def fn(*theta, dtype=None, with_error=True):
    env = dict(zip(order, theta))
    args = [v.val if isinstance(v, hx.Literal) else
            env[v] if v in env else consts[v] for v in eqn.invars]
    if dtype is not None:  # (the program is _standardise's own, checked)
      w, eps = args
      return standardise.standardise_in(w, eps, dtype, with_error)
    return inner(*args)
  return Standardised(fn, position[eqn.invars[0]],
                      tuple(position[v] for v in operands[1:]))


#: The reparametrisations read in closed form: the name of the ``jit``
#: call that marks one -> its reader ``(jaxpr, consts, app, chosen, inputs)
#: -> closed form or None``.
CLOSED_FORMS = {standardise.MARKER: _read_standardised}


def _closed_form(jaxpr, consts, slices, apps):
  """The closed form of one application's slice, where it is a marked call
  of :data:`CLOSED_FORMS` alone (by construction, never by its contents);
  else None."""
  if len(slices) != 1 or len(apps) != 1:
    return None
  chosen, inputs, _, _ = slices[0]
  if len(chosen) != 1:
    return None
  body = hx.jit_body(chosen[0])
  name = chosen[0].params.get("name") if body is not None else None
  reader = CLOSED_FORMS.get(name)
  return reader and reader(jaxpr, consts, apps[0], chosen, inputs)


def _slice(jaxpr, eqns: list, app, gram_op_type):
  """The equations (in order) that compute ``app``'s parameter operands, or
  a string saying why there are none to read."""
  if app.eqn is None:
    return ("the layer runs inside a call, loop or branch (jax.jit, "
            "hk.remat, hk.cond, a scan), where its operands cannot be "
            "recomputed")
  at = next(k for k, e in enumerate(eqns) if e is app.eqn)
  needed = {v for v in app.eqn.invars[1:-1] if not isinstance(v, hx.Literal)}
  chosen = []
  for e in reversed(eqns[:at]):
    if any(v in needed for v in e.outvars):
      if hx.gram_op_of(e, gram_op_type) is not None:
        return "an operand is computed by another tracked layer"
      chosen.append(e)
      needed |= {v for v in e.invars if not isinstance(v, hx.Literal)}
  chosen.reverse()
  return chosen, needed


def read_pullback(jaxpr, consts: Mapping[Any, Any], apps: list,
                  num_param_leaves: int, gram_op_type):
  """Reads ``fn`` for the applications ``apps`` of one module
  (:class:`gram_haiku._src.analysis.dataflow.Application`, in the top-level program
  ``jaxpr`` with its constants ``consts``, by constant variable).

  ``(PullBack, None)`` when the program computes every application's
  parameter operands from parameter leaves alone, by the same equations,
  and uses those leaves nowhere else; else ``(None, why)``."""
  eqns = list(jaxpr.eqns)
  slices = _slices(jaxpr, consts, eqns, apps, num_param_leaves, gram_op_type)
  if isinstance(slices, str):
    return None, slices
  if len({(inputs, key) for _, inputs, _, key in slices}) > 1:
    # Its uses sum into one store of per-example gradients, which one
    # pull-back maps to the parameters only if they all compute alike.
    return None, ("it is applied more than once, with its operands "
                  "computed differently")
  why = _other_reads(jaxpr, eqns, slices, apps)
  if why is not None:
    return None, why
  return PullBack(slices[0][1], slices[0][2],
                  _closed_form(jaxpr, consts, slices, apps)), None


def _slices(jaxpr, consts, eqns, apps, num_param_leaves: int, gram_op_type):
  """Per application: ``(equations, parameter inputs, fn, key)`` of the
  program slice computing its parameter operands; or why not (a string)."""
  position = {v: k for k, v in enumerate(jaxpr.invars)}
  slices = []
  for app in apps:
    found = _slice(jaxpr, eqns, app, gram_op_type)
    if isinstance(found, str):
      return found
    chosen, needed = found
    inputs = sorted(position[v] for v in needed if v in position)
    if any(k >= num_param_leaves for k in inputs):
      return "an operand is computed from the data or a probe"
    fn, key = hx.sub_program(jaxpr, consts,
                             [jaxpr.invars[k] for k in inputs],
                             list(app.eqn.invars[1:-1]), chosen)
    slices.append((chosen, tuple(inputs), fn, key))
  return slices


def _other_reads(jaxpr, eqns, slices, apps) -> Optional[str]:
  """Why the slices' parameter leaves (and what they compute) are read
  elsewhere than by the slices and as the layers' parameter operands; None
  where they are not."""
  derived = {jaxpr.invars[k] for k in slices[0][1]}
  in_slice = {id(e) for chosen, *_ in slices for e in chosen}
  layers = {id(app.eqn) for app in apps}
  for e in eqns:
    reads = [k for k, v in enumerate(e.invars)
             if not isinstance(v, hx.Literal) and v in derived]
    if not reads:
      continue
    if id(e) in layers:
      if any(k == 0 or k == len(e.invars) - 1 for k in reads):
        return "it is also the layer's input"
    elif id(e) in in_slice:
      derived |= set(e.outvars)
    else:
      return f"it is also read by `{e.primitive.name}`"
  if any(v in derived for v in jaxpr.outvars
         if not isinstance(v, hx.Literal)):
    return "it is also an output of the loss"
  return None


def _operands(op, pb, leaves, acc, *likes):
  """``(vjp, present operand types)``: the VJP of ``fn`` at the parameter
  leaves, its operands in the accumulation dtype ``acc``; the leaves cast
  to vary over the mesh axes ``likes`` vary over (``shard_map``: taken
  per device, so not summed over devices)."""
  thetas = [hx.vary_like(leaves[k], *likes) for k in pb.leaves]
  avals = [a for a in op.param_avals if a is not None]

  def fn(*theta):
    return [o.astype(acc) for o in pb.fn(*theta)]
  _, vjp = jax.vjp(fn, *thetas)
  return vjp, avals


def per_example(op, pb, f, leaves: Sequence[Any], skip=frozenset()):
  """``[B, P_theta]`` per-example gradients of the leaves ``pb.leaves`` (in
  that order, each flattened), from the op's ``f: [B, P']`` per-example
  gradients of its operands; leaves in ``skip`` (frozen) get zeros."""
  return _pull_back(op, pb, f, leaves, skip, lambda rows: rows)


def sq_sums(op, pb, f, leaves: Sequence[Any], skip=frozenset()):
  """``(s, p)``: ``s: [B]`` the sums of squares of :func:`per_example`'s
  rows (:func:`gram_haiku._src.compute.norm_bounds.sum_of_squares`, each
  row's value as it would be of the whole array) and ``p`` their length,
  formed block by block: the ``[B, P_theta]`` rows are never all held at
  once (a clipping pass needs only their norms)."""
  p = sum(math.prod(jnp.shape(leaves[k])) for k in pb.leaves)
  return _pull_back(op, pb, f, leaves, skip, norm_bounds.sum_of_squares), p


def _pull_back(op, pb, f, leaves, skip, then):
  """``then(rows)`` of each block of :func:`per_example`'s rows, stacked
  (``then`` maps ``[R, P_theta]`` to an array with ``R`` rows)."""
  acc = f.dtype
  vjp, avals = _operands(op, pb, leaves, acc, f)
  cts, start = [], 0
  for a in avals:
    n = math.prod(a.shape)
    cts.append(f[:, start:start + n].reshape((f.shape[0],) + a.shape))
    start += n

  def columns(per):
    cols = []
    for k, g in zip(pb.leaves, per):
      g = kernels.rows(g).astype(acc)
      cols.append(jnp.zeros_like(g) if k in skip else g)
    return then(jnp.concatenate(cols, axis=1))
  return _pulled_back(vjp, cts, block_rows(op, pb, f, leaves), columns)


def block_rows(op, pb, f, leaves: Sequence[Any]) -> int:
  """Examples per vectorised step of :func:`per_example`: as many as the
  op's memory budget holds, each needing its operand cotangents (a row of
  ``f: [B, P']``) and its gradients of the leaves ``pb.leaves``
  (:func:`gram_haiku._src.compute.kernels.rows_per_block`)."""
  p_theta = sum(math.prod(jnp.shape(leaves[k])) for k in pb.leaves)
  per_row = (f.shape[1] + p_theta) * jnp.dtype(f.dtype).itemsize
  return kernels.rows_per_block(f.shape[0], per_row,
                                op.plan.memory_budget_bytes)


def _pulled_back(vjp, cts: list, rows: int, then):
  """``then([vjp(c_i) for each example i in a block])`` of every block,
  stacked: ``cts`` the operand cotangents ``[B, ...]`` each, ``then`` a
  map of a block's gradients (stacked per leaf) to an array of its rows.
  On an accelerator (or a CPU with
  :data:`BLOCKED_ON_CPU`), ``vjp`` vectorised over blocks of at most
  ``rows`` examples, read in place
  (:func:`gram_haiku._src.compute.kernels.map_row_slices`: no padded copy
  of the ``[B, P']`` cotangents); on a
  CPU, one example per step. The same linear map of each example either
  way; only the order of evaluation differs."""
  def blocked():
    return kernels.map_row_slices(
        lambda *c: then(jax.vmap(lambda *ci: vjp(list(ci)))(*c)), rows, cts)

  def one_by_one():
    return jax.lax.map(lambda c: then([g[None] for g in vjp(list(c))])[0],
                       cts)
  if BLOCKED_ON_CPU:
    return blocked()
  return jax.lax.platform_dependent(cpu=one_by_one, default=blocked)


def per_example_error(op, pb, f, leaves: Sequence[Any], err, module: str):
  """``[B]``: a bound of ``|J^T w_i - fl(J^T f_i)|`` (norm units), the error
  of :func:`per_example`'s rows against the pull-back of the exact
  per-example gradients ``w_i``, from the stored gradients ``f: [B, P']``
  and their rounding bound ``err: [B]`` (``|f_i - w_i| <= err_i``):
  ``(L r + E) |f_i| + A + L (1 + r) err_i``, ``L >= |J^T|``, ``r`` the
  VJP's relative rounding and ``A``, ``E`` what its results flushed to zero
  add (:func:`gram_haiku._src.analysis.linear_bound.pulled_back_error`)
  (a VJP through factors ``1e-19 1e-19 1e19 1e19`` flushes ``f 1e-38``,
  or, folded by XLA, ``f 0``), read from its program (:mod:`gram_haiku._src.analysis.linear_bound`).

  Raises:
    ValueError: the getter's VJP has an equation with no norm rule (or is
      not linear in the cotangent): no sound bound, so no clipping.
  """
  acc = f.dtype
  vjp, avals = _operands(op, pb, leaves, acc, f)
  cts = [hx.vary_like(jnp.zeros(a.shape, acc), f) for a in avals]
  out, why = linear_bound.pulled_back_error(vjp, cts, f, err)
  if why:
    raise ValueError(errors.GETTER_NOT_BOUNDED.format(module=module, why=why))
  return out


def summed(op, pb, cts: Mapping[int, Any], leaves: Sequence[Any],
           module: str) -> dict:
  """``{leaf: cotangent}``: the pull-back of the op's operand cotangents
  ``cts`` (``{operand index: sum_i c_i f_i}``) to the leaves ``pb.leaves``:
  ``J^T sum_i c_i f_i = sum_i c_i J^T f_i`` where the getter's VJP is
  linear in its cotangent, as JAX's own are.

  Raises:
    ValueError: a VJP that is not (a custom VJP rule that clips or
      squashes its cotangent): its sum is not the sum of the per-example
      pull-backs.
  """
  present = [k for k, a in enumerate(op.param_avals) if a is not None]
  acc = next(iter(cts.values())).dtype if cts else jnp.float32
  # (shard_map: each device's share; to_leaf sums them)
  vjp, avals = _operands(op, pb, leaves, acc, *cts.values())
  full = [cts[k].astype(acc) if k in cts else jnp.zeros(a.shape, acc)
          for k, a in zip(present, avals)]
  why = linear_bound.bound(vjp, full)[3]
  if why:
    raise ValueError(errors.GETTER_NOT_LINEAR.format(module=module, why=why))
  return dict(zip(pb.leaves, vjp(full)))
