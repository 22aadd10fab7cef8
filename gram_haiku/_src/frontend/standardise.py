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

import jax
import jax.numpy as jnp

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


def standardise_in(w, eps, dtype):
  """``(w_hat, s)`` of :func:`standardise_weight` evaluated in ``dtype``
  (at least ``w``'s): ``w`` and ``eps`` cast up first, so that neither
  ``w_hat`` nor ``s`` carries ``w``'s own (bfloat16) rounding."""
  dtype = jnp.promote_types(dtype, jnp.result_type(w))
  return _standardise(jnp.asarray(w).astype(dtype),
                      jnp.asarray(eps).astype(dtype))


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
