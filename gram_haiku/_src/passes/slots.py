"""Slots: a module applied several times keeps each application's factors.

A tracked module whose parameters are used more than once in a pass (at
every step of ``hk.dynamic_unroll``/``hk.scan``, or called several times)
has per-example gradient ``g_i = sum_u g_i^(u)`` over its applications
``u``, and its Gram needs the cross terms between them. Accumulating the
per-example gradients adds a ``[B, P]`` buffer per application (at every
step of a loop). Instead, where the program says how many applications
there are, each writes its factors (input and output cotangent,
:func:`~gram_haiku._src.ops.factors.factor_matrix`) into its own slot of a
``[U, B, K]`` probe, picked by a counter ``gram_slot`` in the module's Haiku
state (which ``hk.scan`` carries like any state), and after the pass the
``U`` applications are one application of the same rule with a
within-example axis of size ``U``: the rule sums over within-example axes,
so the cross terms are exact, and its own ghost or materialised kernel
applies.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src.analysis import dataflow
from gram_haiku._src.compute.example_axis import ExampleAxis
from gram_haiku._src.frontend.probes import SLOT_NAME
from gram_haiku._src.ops import factors
from gram_haiku._src.passes import bookkeeping as bk


def slotted_modules(found: dataflow.Discovery, axes: tuple[str, ...],
                    params) -> dict:
  """The shared modules that keep each application's factors in a slot of
  a slotted probe: ``{module: number of slots}`` (see the module
  docstring). Chosen where the trip counts are known
  (:attr:`Discovery.slot_counts`), the slots are smaller than the
  per-example gradients (``U K < P``, as
  :func:`gram_haiku._src.compute.cost_model.bookkeeping_method` chooses stores;
  ``K`` known, not symbolic),
  the input survives the probe's float dtype, and on one device (no mesh
  axes, no Explicit sharding of the examples).
  """
  if axes:
    return {}
  leaves = jax.tree_util.tree_leaves(params)
  out = {}
  for m, uses in found.slot_counts.items():
    op = found.ops[m].in_mode("factors")
    idx = found.param_leaves.get(m, ())
    if any(a is not None and (k is None or k >= len(leaves))
           for a, k in zip(op.param_avals, idx)):
      continue
    if not op.factors_exact(found.probe_dtypes.get(m, jnp.float32)):
      continue
    width = factors.factor_width(op)
    # A symbolic width (a sequence length unknown when jax.export traces)
    # cannot be compared: the module accumulates per-example gradients.
    if isinstance(width, int) and uses * width < op.num_params():
      out[m] = uses
  return out


def open_slots(op, f):
  """The ``U`` applications kept in a slotted probe, as one application.

  Args:
    op: the module's op (its per-application input type).
    f: ``[U, B, K]``, the slotted probe's cotangent: each application's
      factors (:func:`~gram_haiku._src.ops.factors.factor_matrix`).

  Returns:
    ``(whole, x, g)``: the same rule for inputs ``x: [B, U, ...]`` (in the
    op's input dtype) with output cotangents ``g: [B, U, ...]`` (in the
    accumulation dtype), example axis first, then the applications as a
    within-example axis (the rule sums over those, so the cross terms
    between applications are exact).
  """
  # Keeps the loop's [U, B, K] buffer in its own (application-major)
  # layout: without the barrier, XLA's layout assignment on a TPU gave the
  # loop's buffer the layout of the swap below, and every step of the
  # backward loop then wrote its slot with a relayout copy and a strided
  # update (the LSTM benchmark's norms on a TPU v5e, device time with the
  # dispatch amortised: 415 -> 126 us a step, against 57 us plain).
  f = lax.optimization_barrier(f)
  e = op.example_axis.resolved_position()
  rest = lambda shape: list(shape[:e]) + list(shape[e + 1:])
  u, b = f.shape[:2]
  n = math.prod(op.x_aval.shape) // max(b, 1)
  x = f[..., :n].reshape([u, b] + rest(op.x_aval.shape))
  g = f[..., n:].reshape([u, b] + rest(op.out_aval.shape))
  x = jnp.swapaxes(x, 0, 1).astype(op.x_aval.dtype)
  g = jnp.swapaxes(g, 0, 1)
  whole = op.rebuild(op.x_aval.update(shape=x.shape, dtype=x.dtype),
                     ExampleAxis.from_spec(0))
  return whole, x, g


def guard_slots(value, slots_used, slots: int):
  """``value`` if the module's slot counter after the pass reached the
  count read from the program, else NaN: never a Gram (or gradient) that
  misses applications."""
  return jnp.where(slots_used == slots, value,
                   jnp.asarray(jnp.nan, value.dtype))


def slot_state(slotted: Mapping[str, int]) -> dict:
  """The slot counters a pass adds to the state (``loss_of``'s ``extra``)."""
  return {m: {SLOT_NAME: jnp.zeros((), jnp.int32)} for m in slotted}


def unthreaded(new_state, slots: Mapping[str, Any]) -> set:
  """The modules whose slot counter did not come back advanced in the
  model's new state (a wrapper that returns the state it was given,
  ``hk.lift_with_state`` with ``ignore_update()``): their slots cannot be
  trusted, and the pass is traced again with those modules accumulating
  per-example gradients instead."""
  out = set()
  for m, entry in slots.items():
    mine = new_state.get(m) if isinstance(new_state, Mapping) else None
    got = mine.get(SLOT_NAME) if isinstance(mine, Mapping) else None
    if got is None or got is entry[SLOT_NAME]:
      out.add(m)
  return out


def untrusted(new_state, slots: Mapping[str, Any],
              slot_reads: Mapping[str, list]) -> set:
  """The slotted modules whose slots a traced pass cannot trust: their
  counter did not come back advanced (:func:`unthreaded`), or two of their
  applications read one counter value (one traced value, e.g. a lifted
  transform's apply given the same Haiku state twice: they would write one
  slot). ``slot_reads``: module -> the counter values read (see
  ``PassLog.slot_reads``)."""
  twice = {m for m, reads in slot_reads.items()
           if any(a is b for i, a in enumerate(reads) for b in reads[:i])}
  return unthreaded(new_state, slots) | (twice & set(slots))


def pass_with_slots(run_pass, slotted: Mapping[str, int]):
  """``(slotted, result)`` of a pass that trusts only counters that came
  back.

  ``run_pass(slotted) -> (result, modules)``: traces the pass with those
  modules slotted and names the ones whose slots it cannot trust
  (:func:`untrusted`). The pass is then traced once more with those
  modules accumulating per-example gradients instead.
  """
  result, lost = run_pass(slotted)
  if lost:
    slotted = {m: u for m, u in slotted.items() if m not in lost}
    result, _ = run_pass(slotted)
  return slotted, result


def from_slots(op, f, params, mode: str, slots_used, slots: int):
  """The Gram (or squared norms) of a module from its slotted probe's
  cotangent ``f: [U, B, K]`` (see :func:`slotted_modules`,
  :func:`open_slots`); NaN unless ``slots_used == slots``
  (:func:`guard_slots`)."""
  whole, x, g = open_slots(op, f)
  return guard_slots(bk.from_factors(whole, x, g, params, mode), slots_used,
                     slots)
