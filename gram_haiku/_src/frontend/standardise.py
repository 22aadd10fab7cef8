"""Weight standardisation with a mark the pass recognises.

:func:`standardise_weight` is the weight standardisation of a kernel
(Qiao et al. 2019, "Micro-batch training with batch-channel normalization
and weight standardization"; De et al. 2022 use it for DP-SGD), written as
one ``jax.jit`` call named :data:`MARKER`. A tracked layer that reads its
kernel through it (a custom getter) is recognised by that call in the
traced program (:mod:`gram_haiku._src.analysis.reparam`), and its
per-example norms and Gram come in closed form from the layer's factors
(:mod:`gram_haiku._src.passes.standardised`) instead of ``B x P``
per-example gradients pulled back one example at a time. Any other
standardisation (plain ``jax.numpy``) still gets the exact generic pull-back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gram_haiku._src.compute import norm_bounds

#: The name of the ``jit`` call that marks a weight standardisation.
MARKER = "gram_haiku_standardise_weight"


def _standardise(w, eps):
  """``((w - mean) / s, s)`` over every axis of ``w`` but the last,
  ``s = sqrt(var + eps)`` (``[1, ..., 1, C]``)."""
  axes = tuple(range(w.ndim - 1))
  mean = jnp.mean(w, axis=axes, keepdims=True)
  centred = w - mean
  var = jnp.mean(jnp.square(centred), axis=axes, keepdims=True)
  s = jnp.sqrt(var + jnp.asarray(eps, var.dtype))
  return centred / s, s


_standardise.__name__ = MARKER
_standardise.__qualname__ = MARKER
_marked = jax.jit(_standardise)


def standardise_in(w, eps, dtype, with_error: bool = True):
  """``(w_hat, s, err)``: :func:`standardise_weight`'s ``w_hat`` and ``s``
  evaluated in ``dtype`` (at least ``w``'s) from ``w`` and ``eps`` cast up
  (neither carries ``w``'s own bfloat16 rounding), and ``err``: ``[C]``
  bounds of ``|s_c J_c - s_c J'_c|`` (spectral norm), ``J_c = (1/s_c) M_c``
  the exact standardisation's Jacobian and ``J'_c`` the closed form's at
  the computed ``w_hat``, ``s`` (:func:`jacobian_error`; None without
  ``with_error``: a pull-back that bounds nothing need not trace it).

  Its sums run in :func:`norm_bounds.sum_in_two_levels` (``err`` about
  ``sqrt(n) u`` on ordinary kernels, not ``n u``), and the mean is kept in
  two words (its rounding, measured by the residual, subtracted after the
  mean), so that ``err`` stays small on a kernel whose mean is far above
  its spread too: ``|mean| / std = 4 10^5`` put ``jnp.mean``'s ``w_hat``
  ``10^-2`` off, and the clip norms ``6 10^-4`` below the float64 norms."""
  dtype = jnp.promote_types(dtype, jnp.result_type(w))
  w = jnp.asarray(w).astype(dtype)
  eps = jnp.asarray(eps).astype(dtype)
  n = math.prod(w.shape[:-1])
  rows = jnp.reshape(w, (n, w.shape[-1])).T  # [C, n]
  sums = norm_bounds.sum_in_two_levels
  mean = sums(rows) / n
  low = sums(rows - mean[:, None]) / n  # (the mean's own rounding)
  centred = (rows - mean[:, None]) - low[:, None]
  sq = sums(jnp.square(centred))
  s = jnp.sqrt(sq / n + eps)
  w_hat = (centred / s[:, None]).T.reshape(w.shape)
  err = jacobian_error(centred, low, sq, s) if with_error else None
  return w_hat, s.reshape((1,) * (w.ndim - 1) + (-1,)), err


def jacobian_error(centred, low, sq, s):
  """``[C]``: bounds of ``|s' J_c - M'_c|`` (spectral norm) for
  :func:`standardise_in`'s ``centred: [C, n]`` (``c'_k = fl(fl(w_k - m) -
  low)``, ``mu' = m + low`` the two-word mean, ``low: [C]``), ``sq`` (its
  two-level sum of squares) and ``s`` (``s' = fl(sqrt(fl(sq / n) +
  eps'))``, ``eps' = fl(eps)``), with ``J_c = (1/s_c) M_c`` the exact
  standardisation's Jacobian (``M = I - 1 1^T / n - w w^T / n``, ``w`` the
  exact ``w_hat``, ``|w|^2 <= n``) and ``M'_c`` the same at the computed
  ``w' = fl(c' / s')``: ``(s'/s) M - M' = (s'/s)(M - M') + (s'/s - 1) M'``
  and ``w w^T - w' w'^T = delta w^T + w delta^T - delta delta^T``, so

      ``err = rho max(1, |w'|^2 / n) + (1 + rho) (2 sqrt(n) |delta| +
      |delta|^2) / n``

  with ``rho >= |s'/s - 1|`` and ``delta >= |w - w'|``. With ``g`` the
  relative bound of the two-level sums (:func:`norm_bounds.squares_rel`,
  halved: ``gamma_{terms + 2}``), ``u`` the unit roundoff, ``c = w - mu``
  (``1 . c = 0``):

  * ``c'_k = (w_k - mu') + r_k``, ``|r_k| <= 3 u |c'_k| + 2 u |low|``
    (two roundings);
  * ``|mu - mu'| <= e_mu = (|fl(1 . c')| + (g + 3 u) |c'|_1) / n + 2 u
    |low|`` (the residual ``sum_k (w_k - mu')`` measured, not the mean's
    worst case), so ``c = c' + (mu' - mu) 1 - r``, ``|c - c'| <= E = |r| +
    sqrt(n) e_mu``;
  * ``|c|^2 = |c'|^2 - |r - m 1|^2 - 2 c . r`` (``m = mu' - mu``) is within ``kappa = beta^2 + 2
    (1 + beta) |r| / |c'|`` of ``|c'|^2`` (``beta = E / |c'|``; the
    mean's error enters at second order), and ``|c'|^2`` within ``g`` of
    ``sq``, so ``s^2 = |c|^2 / n + eps`` is within ``tau`` of ``sq / n +
    eps'``, and ``s'^2`` within ``8 u``: ``s^2 / s'^2`` within ``z`` of 1,
    ``rho = z / (2 (1 - z))`` (infinite where ``z >= 1``);
  * ``|delta| <= (E (1 + rho) + |c'| (rho + 8 u)) / s'``.

  Sources: Higham, "Accuracy and Stability of Numerical Algorithms", 2nd
  ed., 2002, sections 2.2 and 3.1 (``gamma_n`` of a sum in any order)."""
  dtype = centred.dtype
  n = centred.shape[-1]
  u = float(jnp.finfo(dtype).eps) / 2
  g = norm_bounds.squares_rel(n, dtype) / 2
  g = g / (1 - g)
  g_o = 8 * u  # (a few elementwise roundings; a TPU's sqrt and division)
  up = 1 + 4 * g + 32 * u  # (each formula's own rounding, generously)
  sums = norm_bounds.sum_in_two_levels
  low = jnp.abs(low)
  root_n = math.sqrt(n)
  l1 = sums(jnp.abs(centred)) * (1 + g) * up
  e_mu = ((jnp.abs(sums(centred)) + (g + 3 * u) * l1) / n + 2 * u * low) * up
  c_hi = jnp.sqrt(sq / (1 - g)) * up
  c_lo = jnp.sqrt(sq / (1 + g)) / up
  r_norm = (3 * u * c_hi + 2 * u * root_n * low) * up
  big_e = (r_norm + root_n * e_mu) * up
  beta = big_e / c_lo * up
  kappa = (jnp.square(beta) + 2 * (1 + beta) * r_norm / c_lo) * up
  tau = ((1 + kappa) / (1 - g) - 1 + 2 * u) * up
  z = (tau + g_o) / (1 - g_o) * up
  rho = z / jnp.maximum(2 * (1 - z), 1e-30) * up
  delta = (big_e * (1 + rho) + c_hi * (rho + g_o)) / s * up
  w_norm = c_hi * (1 + g_o) / s * up
  err = (rho * jnp.maximum(1, jnp.square(w_norm) / n) +
         (1 + rho) * (2 * root_n * delta + jnp.square(delta)) / n) * up
  return jnp.where((z < 1) & (c_lo > 0), err, jnp.inf)


def is_marked_program(body, avals) -> bool:
  """Whether ``body`` (the open jaxpr of a call named :data:`MARKER`, with
  inputs of ``avals``) is :func:`standardise_weight`'s own program, equation
  for equation (with its first output, or both): the closed form then
  holds by construction, not by a name another function could take."""
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype,
                               weak_type=getattr(a, "weak_type", False))
          for a in avals]
  if len(args) != 2:
    return False
  outs = len(body.outvars)
  ours = jax.make_jaxpr(lambda w, eps: _standardise(w, eps)[:outs])(*args)
  return str(ours.jaxpr) == str(body)


def standardise_weight(w: jax.Array, eps: float = 0.0) -> jax.Array:
  """Weight standardisation: ``(w - mean) / sqrt(var + eps)`` per output
  channel.

  Use it in a custom getter (``hk.custom_getter``) of a tracked
  ``hk.Linear`` or ``hk.ConvND`` (channels last) kernel; the pass then
  forms that layer's per-example norms and Gram in closed form (with sound
  bounds for clipping) without keeping its per-example gradients. Other
  layers, and a standardisation written in ``jax.numpy``, get the exact
  generic pull-back. Sources: Qiao et al. 2019 (weight standardisation);
  the closed form of its Jacobian, ``(1/s)(I - 1 1^T/n - w_hat
  w_hat^T/n)`` per output channel, is derived on the Performance page
  (the WRN).

  Args:
    w: ``[..., C_in, C_out]`` kernel (``hk.Linear``'s ``[N, M]``,
      ``hk.ConvND``'s ``[*kernel, C_in, C_out]``), float. The mean and the
      variance are over every axis but the last (the fan-in ``n``).
    eps: ``>= 0``, added to the variance: a number (or a constant). A
      learned ``eps`` (a parameter) is not read in closed form: the layer
      takes the generic pull-back (exact, with ``B x P`` per-example
      gradients).

  Returns:
    The standardised kernel, ``w``'s shape and dtype.

  Raises:
    ValueError: for a scalar ``w`` (no output channel axis).
  """
  if jnp.ndim(w) < 1:
    raise ValueError("standardise_weight: the kernel needs an output "
                     f"channel axis, got shape {jnp.shape(w)}.")
  return _marked(w, eps)[0]
