"""Parts: a module applied once by each of several rules keeps each one's
factors.

A tied embedding is read twice, by its ``hk.Embed`` lookup and by
:func:`gram_haiku.unembed`, so its per-example gradient is ``g_i = E_i +
O_i`` and its squared norm ``|E_i|^2 + |O_i|^2 + 2 <E_i, O_i>``. Instead
of accumulating ``B x V x D`` per-example gradients (the ``per_example``
store of a shared module), each application writes its factors (input and
output cotangent, :func:`~gram_haiku._src.ops.factors.factor_matrix`) into
its own ``[B, K_u]`` probe, one of a tuple of probes in the module's state
(the application of rule ``kind`` finds its own by
:attr:`~gram_haiku._src.frontend.ambient.ModulePass.parts`). A probe per
application, not columns of one ``[B, K_1 + K_2]`` probe: the backward
pass of a slice pads the slice's cotangent back to the full width, so
each application's cotangent would be padded to ``B (K_1 + K_2)`` and the
two added (twice the store, and more, in temporary buffers). After the pass
each part's squared norm comes from its own rule, the cross term from a
rule for the pair (:func:`gram_haiku._src.layers.tied.cross_rule`), and
``sum_i c_i g_i`` is the sum of the parts' re-contractions. Chosen for
squared norms (clipping, reweighting), on one device, where the factors are
smaller than the per-example gradients and every pair of applications has
a cross rule; the Gram (``[B, B]`` cross terms) keeps per-example
gradients.
"""

from __future__ import annotations

import itertools
from typing import Mapping

import jax
import jax.numpy as jnp

from gram_haiku._src.analysis import dataflow
from gram_haiku._src.layers import tied
from gram_haiku._src.ops import factors
from gram_haiku._src.passes import bookkeeping as bk


def _crosses(ops) -> list:
  """``[(u, v, rule)]`` for every pair ``u < v`` of applications, or None
  where a pair has no cross rule."""
  out = []
  for u, v in itertools.combinations(range(len(ops)), 2):
    rule = tied.cross_rule(ops[u], ops[v])
    if rule is None:
      return None
    out.append((u, v, rule))
  return out


def parted_modules(found: dataflow.Discovery, axes: tuple[str, ...],
                   probe_dtypes: Mapping[str, object]) -> dict:
  """Module -> its applications' ops, for the shared modules that keep
  each application's factors in a probe of its own (see the module
  docstring): :attr:`Discovery.parts` where every pair has a cross rule,
  every input survives the probe's float dtype and the factors are
  smaller than the per-example gradients; on one device (no mesh axes)."""
  if axes:
    return {}
  out = {}
  for m, ops in found.parts.items():
    if _crosses(ops) is None:
      continue
    dtype = probe_dtypes.get(m, jnp.float32)
    if not all(op.in_mode("factors").factors_exact(dtype) for op in ops):
      continue
    widths = [factors.factor_width(op) for op in ops]
    if not all(isinstance(w, int) for w in widths):
      continue  # (a symbolic width: the per-example gradients)
    if sum(widths) < ops[0].num_params():
      out[m] = ops
  return out


def layout(ops) -> tuple[tuple[str, int], ...]:
  """``((kind, width), ...)``: each application's rule and probe width."""
  return tuple((op.kind, factors.factor_width(op)) for op in ops)


def probe_shapes(ops, size: int) -> tuple[tuple[int, int], ...]:
  """``((B, K_u), ...)``: the shapes of the module's probes, one per
  application (see :func:`layout`)."""
  return tuple((size, w) for _, w in layout(ops))


def open_parts(ops, fs, leaves, leaf_index) -> tuple:
  """``((op, x, g, params), ...)`` per application, from the probes'
  cotangents ``fs``: one ``[B, K_u]`` per application (see
  :func:`layout`)."""
  return tuple((op, *factors.split_factors(op, f),
                bk.op_params(op, leaves, leaf_index))
               for op, f in zip(ops, fs))


def sq_norms(opened, upper_bound: bool) -> jax.Array:
  """``[B]``: ``|sum_u g_i^(u)|^2`` per example, each part's own squared
  norm by its rule plus twice every pair's cross term; with
  ``upper_bound`` a sound upper bound: with ``a_u`` the parts' bounds and
  ``x``, ``r`` the cross terms and their rounding bounds,
  ``sum a_u + 2 sum (x + r)``, rounded up, and never above
  ``(sum sqrt(a_u))^2`` (the triangle inequality)."""
  ops = [o[0] for o in opened]
  own = [bk.from_factors(*o, "norms", upper_bound) for o in opened]
  crosses = [rule(opened[u], opened[v], upper_bound)
             for u, v, rule in _crosses(ops)]
  acc = own[0].dtype
  total = sum(own[1:], own[0])
  if not upper_bound:
    return total + 2 * sum(x.astype(acc) for x, _ in crosses)
  u = float(jnp.finfo(acc).eps) / 2
  n = len(own) + 2 * len(crosses)
  signed = total + 2 * sum((x + r).astype(acc) for x, r in crosses)
  size = total + 2 * sum((jnp.abs(x) + r).astype(acc) for x, r in crosses)
  bound = jnp.maximum(signed + 2 * (n + 2) * u * size, 0)
  roots = sum((jnp.sqrt(a) for a in own[1:]), jnp.sqrt(own[0]))
  return jnp.minimum(bound, jnp.square(roots) * (1 + 4 * (n + 2) * u))


def recontract(opened, c, padded: bool, dtype=None) -> dict:
  """``{k: sum_i c_i g_i}`` per parameter operand ``k``: the sum of the
  parts' re-contractions (:func:`~gram_haiku._src.passes.bookkeeping
  .recontract_factors`, in ``dtype`` where wider than the layer's)."""
  out = {}
  for o in opened:
    for k, ct in bk.recontract_factors(*o, c, padded,
                                       dtype=dtype).items():
      out[k] = out[k] + ct if k in out else ct
  return out
