"""A weight-standardised layer's norms, Gram and update in closed form.

A layer whose kernel is :func:`gram_haiku.standardise_weight` of a
parameter ``w`` (recognised by its mark,
:class:`gram_haiku._src.analysis.reparam.Standardised`) keeps its factors
(input ``x_i``, output cotangent ``d_i``) through the pass, not its
``B x P`` per-example gradients. Per output channel ``c`` of fan-in ``n``,
with ``w_hat`` the standardised kernel (the layer's operand) and ``s`` its
scale, the Jacobian of the standardisation is ``J_c = (1/s_c) M_c``,
``M_c = I - 1 1^T / n - w_hat_c w_hat_c^T / n`` (symmetric, for any
``eps``), so with ``f_i`` the per-example gradient of the operand

    ``g_ic = J_c f_ic = (1/s_c)(f_ic - (a_ic / n) 1 - (b_ic / n) w_hat_c)``

    ``<g_ic, g_jc> = F_ij - [a_i a_j + (2 - q) b_i b_j
                             - (sigma / n)(a_i b_j + b_i a_j)] / n``

(each per channel, ``1/s_c`` taken into the cotangent: ``D = d / s``), where
``F`` is the layer's own Gram of the kernel for the cotangent ``D``
(ghost or materialised, by its rule and the cost model), ``a_ic = 1 .
f_ic = sum_t D_itc (x_i * 1)_tc`` and ``b_ic = w_hat_c . f_ic = sum_t
D_itc (x_i * w_hat)_tc`` per-example channel sums of the layer's outputs
for an all-ones kernel and for its own kernel (two helper outputs of the
layer at ``HIGHEST`` precision, :func:`_output`), ``q_c = |w_hat_c|^2 /
n`` and ``sigma_c = 1 . w_hat_c`` (``q = 1 - eps / s^2`` and ``sigma = 0``
in exact arithmetic; kept as computed, so the identities are exact for the
kernel the layer used). The bias, if
any, is not standardised: its term is ``e_i . e_j``, ``e_i = sum_t d_it``.
The reweighted update is ``J^T sum_i c_i f_i`` (:func:`pull_back_sum`).

Clipping bounds (``upper_bound``): ``|g_i|`` is bounded by the layer's own
sound bound of ``|f(D')|^2`` (``D' = fl(d / s)``) less a lower bound of the
corrections (the rounding of ``a``, ``b``, ``q``, ``sigma`` and of their
quadratic form bounded term by term, Higham's ``gamma_n``), plus
``|M| |f(D - D')|``, the division's rounding (``|M| <= max(1, q)``), plus
``max_c err_c |f(d / s)|``, the distance of the Jacobian at the computed
``w_hat`` and ``s`` to the exact one (``err``:
:func:`gram_haiku._src.frontend.standardise.jacobian_error`). Where
that bound is loose (above its estimate by more than
:data:`~gram_haiku._src.compute.norm_bounds.LOOSE`: the corrections cancel
the leading term), the kernel's per-example gradients are formed from the
factors in small blocks and pulled back by the Jacobian in closed form,
with its rounding bound (:func:`per_example_bound`; the getter's own VJP
would round in the kernel's dtype, ``2^-9 |f_i|`` in bfloat16, swamping
``|g_i|``), at run time, for the examples whose bound is loose
(:func:`gram_haiku._src.compute.kernels.loose_fallback`).
``w_hat`` and ``s`` are evaluated in the accumulation dtype from the kernel
itself (``Standardised.fn(..., dtype=)``), not taken from the operand.

Supported layers (:data:`CHANNEL_LAST_RULES`): those whose output channel
``c`` is the output's last axis and reads only ``W[..., c]``: ``hk.Linear``
and ``hk.ConvND`` channels last (feature groups included), not transposed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src.analysis import reparam
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute.kernels import KernelConfig
from gram_haiku._src.ops import conv
from gram_haiku._src.ops import modes


def _spec(rule):
  """A conv rule's spec (its forward's ``spec`` keyword); None for others."""
  return getattr(rule.forward, "keywords", {}).get("spec")


def _conv_channels_last(rule) -> bool:
  spec = _spec(rule)
  return (spec is not None and spec.channels_last and not spec.transpose)


def _linear_map(x, w):
  """``x @ w`` at ``HIGHEST`` (the linear rule's map, no bias)."""
  return jnp.dot(x, w, precision=lax.Precision.HIGHEST)


def _conv_map(rule):
  """The conv rule's map (no bias) at ``HIGHEST``."""
  spec = dataclasses.replace(_spec(rule), precision=lax.Precision.HIGHEST)
  return lambda x, w: conv.conv_forward(x, w, None, spec=spec)


class _Layer(NamedTuple):
  """What the closed form needs of a rule (:data:`CHANNEL_LAST_RULES`)."""
  #: ``rule -> bool``: whether an op of the rule has its output channels
  #: last, each reading only its own column ``W[..., c]`` of the first
  #: parameter (the kernel).
  channels_last: Callable[[Any], bool]
  #: ``rule -> ((x, w) -> y)``: the rule's map without bias at ``HIGHEST``
  #: precision. The closed form's helper outputs (:func:`_output`) run at
  #: ``HIGHEST``: below it a TPU rounds each factor to bfloat16, and that
  #: ``2^-7`` of every per-example channel sum made the clipping bound
  #: loose on every layer of a WRN (the exact fallback ran on each step:
  #: 17x a plain step, 2026-12-06).
  exact_map: Callable[[Any], Callable[[jax.Array, jax.Array], jax.Array]]


#: Rule name (:func:`gram_haiku._src.rules.rule.rule_name`) -> its
#: :class:`_Layer`: the rules the closed form supports.
CHANNEL_LAST_RULES = {
    "linear": _Layer(lambda rule: True, lambda rule: _linear_map),
    "conv": _Layer(_conv_channels_last, _conv_map)}


def _output(op, x, w) -> jax.Array:
  """The layer's output (no bias) at ``x`` for the kernel ``w``, at
  ``HIGHEST`` (:data:`CHANNEL_LAST_RULES`)."""
  return CHANNEL_LAST_RULES[op.kind].exact_map(op.rule)(x, w)


def applies(op, pb) -> bool:
  """Whether module's op ``op`` with pull-back ``pb`` is read in closed
  form: a marked standardisation of its kernel, on a supported layer."""
  if pb is None or not isinstance(pb.closed, reparam.Standardised):
    return False
  check = CHANNEL_LAST_RULES.get(op.kind)
  return (bool(check and check.channels_last(op.rule)) and
          op.param_avals[0] is not None)


def operands(op, pb, leaves: Sequence[Any]) -> list:
  """The op's parameter operands (None for absent ones) from the leaves,
  by the getter's own program."""
  present = iter(pb.fn(*[leaves[k] for k in pb.leaves]))
  return [None if a is None else next(present).astype(a.dtype)
          for a in op.param_avals]


def _scales(op, pb, leaves, with_error: bool = True):
  """``(w_hat, s, err)``: the standardised kernel, its ``[C]`` scales,
  evaluated in the accumulation dtype from the kernel itself (not the
  operand's rounding to a low-precision kernel dtype: a bfloat16 ``s``
  is off by ``2^-9``, more than the bounds' slack), and ``[C]`` bounds of
  ``s_c`` times the distance of the closed form's Jacobian at them to the
  exact one (:func:`gram_haiku._src.frontend.standardise.standardise_in`;
  None without ``with_error``)."""
  acc = op.accumulation_dtype()
  w_hat, s, err = pb.closed.fn(*[leaves[k] for k in pb.leaves], dtype=acc,
                               with_error=with_error)
  return (w_hat.astype(acc), jnp.reshape(s, (-1,)).astype(acc),
          None if err is None else jnp.reshape(err, (-1,)).astype(acc))


def _q_sigma(w_hat):
  """``([C] q, [C] sigma)``: ``|w_hat_c|^2 / n`` and ``1 . w_hat_c``."""
  wh = w_hat.reshape(-1, w_hat.shape[-1])
  return jnp.sum(jnp.square(wh), axis=0) / wh.shape[0], jnp.sum(wh, axis=0)


def _pulled_back(rows, w_hat, s):
  """``J^T f`` for rows ``[..., n, C]`` of kernel gradients: per channel
  ``(f - (1.f / n) 1 - (w_hat.f / n) w_hat) / s``."""
  n = rows.shape[-2]
  wh = w_hat.reshape(n, -1)
  a = jnp.sum(rows, axis=-2, keepdims=True) / n
  b = jnp.sum(rows * wh, axis=-2, keepdims=True) / n
  return (rows - a - b * wh) / s


def _channel_sums(op, x, d, y) -> jax.Array:
  """``[B, C]``: ``sum_t d_itc y_itc`` (``y`` a layer output at ``x``)."""
  e = op.example_axis.resolved_position()
  y = y.astype(d.dtype)
  prod = jnp.moveaxis(d * y, e, 0)
  return jnp.sum(prod.reshape(prod.shape[0], -1, prod.shape[-1]), axis=1)


def _groups(op) -> int:
  """Feature groups of the op (1 for a linear layer)."""
  spec = _spec(op.rule)
  return 1 if spec is None else spec.feature_group_count


def _all_ones_output(op, x, w_hat) -> jax.Array:
  """The layer's output (no bias) at ``x`` for an all-ones kernel, at
  ``HIGHEST``: each output channel's patch sums, the same for every channel
  of a feature group. So the input channels of each group are summed first
  and the layer's map runs on one input and one output channel per group,
  then is repeated over the group's output channels."""
  g = _groups(op)
  c = w_hat.shape[-1]
  summed = jnp.sum(x.reshape(x.shape[:-1] + (g, -1)), axis=-1)
  ones = jnp.ones(w_hat.shape[:-2] + (1, g), w_hat.dtype)
  return jnp.repeat(_output(op, summed, ones), c // g, axis=-1)


def _by_position(op, d) -> jax.Array:
  """``[B, T, C]``: ``d`` with its examples first and every other axis but
  the channels merged into positions."""
  e = op.example_axis.resolved_position()
  m = jnp.moveaxis(d, e, 0)
  return m.reshape(m.shape[0], -1, m.shape[-1])


def _bias_rows(op, d) -> jax.Array:
  """``[B, C]``: the bias's per-example gradients ``e_i = sum_t d_it``."""
  return jnp.sum(_by_position(op, d), axis=1)


def _bias_present(op, skip_bias: bool) -> bool:
  return (len(op.param_avals) > 1 and op.param_avals[1] is not None and
          1 not in (op.plan.frozen or ()) and not skip_bias)


def _kernel_only(op):
  """The op with its bias frozen (the kernel's terms alone)."""
  frozen = set(op.plan.frozen or ())
  if len(op.param_avals) > 1 and op.param_avals[1] is not None:
    frozen.add(1)
  return op.with_plan(frozen=tuple(sorted(frozen)))


def _cfg(op, upper_bound: bool, row_split=None) -> KernelConfig:
  return KernelConfig(memory_budget_bytes=op.plan.memory_budget_bytes,
                      precision=op.plan.precision, upper_bound=upper_bound,
                      row_split=row_split)


def read(op, pb, x, d, params, leaves: Sequence[Any], want: str,
         upper_bound: bool = False, skip=frozenset(),
         row_split: Optional[int] = None) -> jax.Array:
  """``[B, B]`` Gram (``want == "gram"``; its block ``G[:s, s:]`` with
  ``row_split``) or ``[B]`` squared norms (sound upper bounds with
  ``upper_bound``) of the per-example gradients of the leaves the getter
  reads (those in ``skip`` frozen), from the factors ``(x, d)`` of one
  application (``d`` in the accumulation dtype) and the op's operands
  ``params`` (:func:`operands`)."""
  acc = op.accumulation_dtype()
  bias_leaf = pb.closed.others
  skip_bias = bool(bias_leaf) and all(k in skip for k in bias_leaf)
  if pb.closed.kernel in skip:  # (frozen kernel: the generic path)
    return _exact(op, pb, x, d, params, leaves, want, upper_bound, skip,
                  row_split)
  w_hat, s, j_err = _scales(op, pb, leaves, with_error=upper_bound)
  n = math.prod(w_hat.shape[:-1])
  dd = d.astype(acc)
  big_d = dd / s
  x_acc = x.astype(acc) if kernels.is_float(x.dtype) else x
  ones_out = _all_ones_output(op, x_acc, w_hat)
  y_out = _output(op, x_acc, w_hat)
  a = _channel_sums(op, x_acc, big_d, ones_out)
  b = _channel_sums(op, x_acc, big_d, y_out)
  q, sigma = _q_sigma(w_hat)
  with_bias = _bias_present(op, skip_bias)
  kernel_op = _kernel_only(op)
  if want == "gram":
    cfg = _cfg(op, False, row_split)
    value = modes.products(kernel_op.in_mode("gram"), x, big_d, params, (),
                           cfg, reuse=False)[0]
    rows = slice(None) if row_split is None else slice(0, row_split)
    cols = slice(None) if row_split is None else slice(row_split, None)
    r = sigma / n
    corr = (jnp.einsum("ic,jc->ij", a[rows], a[cols] / n) +
            jnp.einsum("ic,jc->ij", b[rows], b[cols] * ((2 - q) / n)) -
            jnp.einsum("ic,jc->ij", a[rows], b[cols] * (r / n)) -
            jnp.einsum("ic,jc->ij", b[rows], a[cols] * (r / n)))
    value = value - corr.astype(value.dtype)
    if with_bias:
      e = _bias_rows(op, dd)
      value = value + (e[rows] @ e[cols].T).astype(value.dtype)
    return value
  quad = (jnp.square(a) + (2 - q) * jnp.square(b) -
          2 * a * b * (sigma / n)) / n
  if not upper_bound:
    value = modes.products(kernel_op.in_mode("norms"), x, big_d, params, (),
                           _cfg(op, False), reuse=False)[0]
    value = value - jnp.sum(quad, axis=1).astype(value.dtype)
    if with_bias:
      value = value + jnp.sum(jnp.square(_bias_rows(op, dd)),
                              axis=1).astype(value.dtype)
    return value
  lead = modes.products(kernel_op.in_mode("norms"), x, big_d, params, (),
                        _cfg(op, True), reuse=False)[0].astype(acc)
  bound, loose = _bound(op, x_acc, dd, big_d, w_hat, a, b, q, sigma, lead,
                        with_bias, ones_out, y_out, j_err)
  operands_ = (x, d, *[leaves[k] for k in pb.leaves])

  def exact(x_, d_, *theta):
    mine = list(leaves)
    for k, t in zip(pb.leaves, theta):
      mine[k] = t
    return _exact(op, pb, x_, d_, params, mine, "norms", True, skip,
                  None, closed=True).astype(bound.dtype)
  return kernels.loose_fallback(loose, exact, bound, operands_)


def _bound(op, x, dd, big_d, w_hat, a, b, q, sigma, lead, with_bias,
           ones_out, y_out, j_err):
  """``([B] bound of |g_i|^2, [B] whether it is loose)``: see the module
  docstring. ``lead``: the layer's bound of ``|f(D')|^2``; ``ones_out``,
  ``y_out``: the layer's outputs (no bias) for an all-ones kernel and for
  ``w_hat``; ``j_err``: ``[C]`` bounds of ``|s J - s' J'|`` (the computed
  ``w_hat`` and ``s``' Jacobian against the exact one, :func:`_scales`),
  which adds ``max_c j_err_c |f(d / s')|`` (``|f(d / s')| <= sqrt(lead) +
  e_div``)."""
  acc = dd.dtype
  n = math.prod(w_hat.shape[:-1])
  positions = _by_position(op, dd).shape[1]
  c_count = w_hat.shape[-1]
  g_n = norm_bounds.dot_error(n, acc, lax.Precision.HIGHEST)  # (_output's)
  g_t = norm_bounds.dot_error(positions, acc, lax.Precision.HIGHEST)
  g_c = norm_bounds.dot_error(2 * c_count + 8, acc, lax.Precision.HIGHEST)
  up = 1 + 4 * g_c  # A generous rounding-up factor for short formulas.
  # Patch norms |p_tc| (per output channel), rounded up.
  patch = jnp.sqrt(jnp.maximum(_all_ones_output(
      op, jnp.square(x), w_hat).astype(acc), 0) * (1 + 2 * g_n)) * up
  big_abs = jnp.abs(big_d)
  sums = lambda v: jnp.sum(_by_position(op, v), axis=1) * (1 + g_t)
  q_sum = sums(patch * big_abs)  # [B, C]: sum_t |p_tc| |D'_tc|
  ones_out, y_out = ones_out.astype(acc), y_out.astype(acc)
  a_abs = sums(jnp.abs(ones_out) * big_abs)
  b_abs = sums(jnp.abs(y_out) * big_abs)
  q_up = q * (1 + g_n) * up
  sig_up = (jnp.abs(sigma) + g_n * n * jnp.sqrt(q_up)) * up
  e_a = (g_t * a_abs + g_n * math.sqrt(n) * q_sum) * up
  e_b = (g_t * b_abs + g_n * jnp.sqrt(n * q_up) * q_sum) * up
  # A lower bound of the corrections' quadratic form at the computed a, b.
  # The form is positive definite where q < 3/2 and |sigma| / n < 1/4 (a
  # standardised kernel has q <= 1 and sigma = 0 up to rounding); else the
  # bound is not used (loose, and infinite).
  valid = (jnp.max(q_up) < 1.5) & (jnp.max(sig_up) / n < 0.25)
  pos = jnp.sum(jnp.square(a) + (2 - q_up) * jnp.square(b), axis=1) / n
  cross = jnp.sum(2 * jnp.abs(a * b) * sig_up, axis=1) / (n * n)
  c_hat = jnp.maximum(pos * (1 - g_c) - cross * up, 0)
  lam = (2 + jnp.max(sig_up) / n) / n
  e_q = jnp.sqrt(lam * jnp.sum(jnp.square(e_a) + jnp.square(e_b), axis=1)
                 ) * up
  root_c = jnp.maximum(jnp.sqrt(c_hat) * (1 - g_c) - e_q, 0)
  kernel_sq = jnp.maximum(lead - jnp.square(root_c) * (1 - g_c), 0) * up
  m_norm = jnp.maximum(1, jnp.max(q_up))
  u_div = norm_bounds.division_error(acc)  # (D' = fl(d / s))
  e_div = (u_div / (1 - u_div)) * norm_bounds.row_norms(q_sum) * up
  kernel_norm = (jnp.sqrt(kernel_sq) * up + m_norm * e_div +
                 jnp.max(j_err) * (jnp.sqrt(lead) + e_div) * up)
  value = jnp.square(kernel_norm) * up
  # The bound's own slack, against the layer's bound less the corrections
  # (the layer's slack is its kernel's, below LOOSE of |f(D')|^2 there).
  estimate = jnp.maximum(lead - c_hat, 0)
  if with_bias:
    e = _bias_rows(op, dd)
    e_err = g_t * norm_bounds.row_norms(sums(jnp.abs(dd)))
    bias = jnp.square(norm_bounds.row_norms(e) * up + e_err) * up
    value = value + bias * up
    estimate = estimate + jnp.sum(jnp.square(e), axis=1)
  value = jnp.where(valid, value, jnp.inf)
  return value, (value > (1 + norm_bounds.LOOSE) * estimate) | ~valid


def _exact(op, pb, x, d, params, leaves, want, upper_bound, skip,
           row_split, closed=False):
  """The generic path from the factors: the per-example gradients of the
  operands formed (in blocks of examples where only norms are wanted) and
  pulled back exactly (:mod:`gram_haiku._src.analysis.reparam`), or, with
  ``closed`` (norm bounds of a kernel that is not frozen), pulled back in
  closed form (:func:`per_example_bound`: the Jacobian in the accumulation
  dtype; the getter's own VJP runs in the kernel's dtype, and a bfloat16
  kernel's rounding of ``|f_i|`` swamps ``|g_i|`` where they cancel)."""
  e = op.example_axis.resolved_position()
  pe = op.in_mode("per_example").with_plan(upper_bound=upper_bound)
  cfg = _cfg(op, upper_bound)

  def rows_of(xb, db):
    f = modes.products(pe, xb, db, params, (), cfg)[0]
    if upper_bound:
      f, err = f[:, :-1], f[:, -1]
      if closed:
        return norm_bounds.of_rows(*per_example_bound(op, pb, f, leaves, err,
                                                      skip))
      slack = reparam.per_example_error(op, pb, f, leaves, err, op.name)
      sq, p = reparam.sq_sums(op, pb, f, leaves, skip)
      return norm_bounds.of_sq_sums(sq, p, f.dtype, slack)
    g = reparam.per_example(op, pb, f, leaves, skip)
    return jnp.sum(g * g, axis=-1) if want != "gram" else g
  if want == "gram":
    g = rows_of(x, d)
    return kernels.gram_matmul(g, g, KernelConfig(
        precision=op.plan.precision, row_split=row_split))
  per_row = max(1, op.num_params() * 3 * jnp.dtype(d.dtype).itemsize)
  block = max(1, kernels.FALLBACK_BYTES // per_row)
  xm, dm = jnp.moveaxis(x, e, 0), jnp.moveaxis(d, e, 0)
  return kernels.map_row_blocks(
      lambda xb, db: rows_of(jnp.moveaxis(xb, 0, e), jnp.moveaxis(db, 0, e)),
      block, (xm, dm))


def pull_back_sum(op, pb, cts: dict, leaves: Sequence[Any]) -> dict:
  """``{leaf: J^T sum_i c_i f_i}`` from the op's operand cotangents
  ``cts`` (``{operand: sum_i c_i f_i}``), by the closed form (the same
  ``J`` the norms are bounded for); the bias (not standardised) as it
  is."""
  w_hat, s, _ = _scales(op, pb, leaves, with_error=False)
  out = {}
  if 0 in cts:
    f = cts[0].astype(w_hat.dtype)
    out[pb.closed.kernel] = _pulled_back(
        f.reshape(-1, f.shape[-1]), w_hat, s).reshape(f.shape)
  present = [k for k, a in enumerate(op.param_avals) if a is not None]
  for k, leaf in zip(present[1:], pb.closed.others):
    if k in cts:
      out[leaf] = cts[k]
  return out


def _kernel_rows(op, f):
  """``(kernel rows [B, n, C], other columns [B, P - n C])`` of the
  per-example gradients ``f: [B, P]`` of the op's operands (kernel first)."""
  shape = op.param_avals[0].shape
  size = math.prod(shape)
  n = math.prod(shape[:-1])
  return f[:, :size].reshape(f.shape[0], n, shape[-1]), f[:, size:]


def per_example(op, pb, f, leaves: Sequence[Any], skip=frozenset(),
                scales=None):
  """``[B, P_theta]``: the per-example gradients of the leaves
  ``pb.leaves`` (in that order, flattened; those in ``skip`` zero) from
  the op's ``f: [B, P']``, pulled back in closed form (the kernel's
  ``J^T f_i``, vectorised; the bias as it is), the layout of
  :func:`gram_haiku._src.analysis.reparam.per_example`. ``scales``:
  :func:`_scales`' ``(w_hat, s)`` where the caller has them."""
  w_hat, s = scales or _scales(op, pb, leaves, with_error=False)[:2]
  rows, rest = _kernel_rows(op, f.astype(w_hat.dtype))
  g = _pulled_back(rows, w_hat, s).reshape(f.shape[0], -1)
  cols = {pb.closed.kernel: g}
  start = 0
  for leaf in pb.closed.others:
    size = math.prod(jnp.shape(leaves[leaf]))
    cols[leaf] = rest[:, start:start + size]
    start += size
  out = [jnp.zeros_like(cols[k]) if k in skip else cols[k]
         for k in pb.leaves]
  return jnp.concatenate(out, axis=1)


def per_example_bound(op, pb, f, leaves: Sequence[Any], err,
                      skip=frozenset()):
  """``(g, e)``: :func:`per_example`'s rows and ``[B]`` bounds of their
  distance to ``J^T w_i``, the pull-back of the exact per-example
  gradients ``w_i`` (``|f_i - w_i| <= err_i``, the stored rows' bound):
  per channel ``|J_c| <= max(1, q_c) / s_c`` maps ``err``, and the closed
  form's own rounding is at most ``(gamma_4 (2 + q_c) + gamma_n (1 +
  q_c)) |f_ic| / s_c`` (its sums ``a``, ``b`` are ``n``-term dot products,
  ``|a_c| <= sqrt(n) |f_c|``, ``|b_c| <= |w_hat_c| |f_c|``, ``|w_hat_c|^2
  = n q_c``), so ``e_i = L err_i + kappa |f_i|``; the computed ``w_hat``
  and ``s``' Jacobian is within ``j = max_c j_err_c / s_c`` of the exact
  one (:func:`_scales`), which adds ``j (|f_i| + err_i)``."""
  w_hat, s, j_err = _scales(op, pb, leaves)
  g = per_example(op, pb, f, leaves, skip, scales=(w_hat, s))
  acc = w_hat.dtype
  n = math.prod(w_hat.shape[:-1])
  g_n = norm_bounds.dot_error(n, acc, lax.Precision.HIGHEST)
  g_4 = norm_bounds.dot_error(4, acc, lax.Precision.HIGHEST)
  q, _ = _q_sigma(w_hat)
  up = 1 + 4 * norm_bounds.dot_error(n + 8, acc, lax.Precision.HIGHEST)
  q_up = q * (1 + g_n) * up
  lip = jnp.max(jnp.maximum(1, q_up) / s) * up
  j = jnp.max(j_err / s) * up
  kappa = jnp.max((g_4 * (2 + q_up) + g_n * (1 + q_up)) / s) * up + j
  lip = jnp.maximum(lip, 1.0) + j  # (the bias: the identity)
  e = kappa * norm_bounds.row_norms(f.astype(acc))
  if err is not None:
    e = e + lip * err.astype(acc)
  return g, e * up
