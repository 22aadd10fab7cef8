"""Analytic FLOP counts: the plain step and the minimum extra Gram work.

All counts are FLOPs, 2 per multiply-add (what XLA's ``cost_analysis``
reports). For a linear-type layer ``y_t = x_t W (+ b)``, ``W: [N, M]``,
applied at ``T`` within-example positions (sequence steps, conv output
positions, the steps of an RNN sharing ``W``) to ``B`` examples:

* plain step: forward ``2 B T N M``, backward ``4 B T N M`` (``2 B T N M``
  when the input needs no gradient);
* extra for the full Gram: ``2 min(B^2 T^2 (N+M), B T N M +
  B^2 N M)``, the cheaper of the ghost kernels ``K_x = X X^T``,
  ``K_d = D D^T`` and materialised per-example gradients ``x_i^T d_i``
  followed by ``F F^T`` (``B^2 (N+M)`` for ghost at ``T = 1``); the bias
  adds ``B^2 T^2`` to ghost (nothing at ``T = 1``, where its Gram is ``K_d``)
  and ``B T M + B^2 M`` to materialised;
* extra for the norms only: ``2 min(B T^2 (N+M), B T N M)`` (``2 B (N+M)``
  at ``T = 1``), bias likewise.

From ``kernels.SYMMETRIC_MIN_ROWS`` examples on, the kernels compiled for
the CPU form the
symmetric ``[B, B]`` products from their upper block triangle
(``kernels.symmetric_blocks``, ``n`` blocks a side): the ``B^2`` terms of
``K_x``, ``K_d``, of the ghost kernels over pairs of positions and of
``F F^T`` count ``(n + 1) / 2n`` of the full product's. It is still a floor for the kernels as specified: it does
not assume a ``syrk`` (half of the products exactly), nor that the plain
weight gradient is read off materialised per-example gradients (each would
lower it further; see ``benchmarks/README.md``).

A convolution is a linear layer on im2col patches (``N = k_h k_w C_in``,
``T`` = output positions). Norm layers (GroupNorm, LayerNorm) have
per-example gradients ``sum_t xhat_it * d_it`` of size ``2 C``: ``2 B T C``
to form them, ``2 B^2 C`` for their Gram. The tied embedding is the output
projection (``N = d``, ``M = V``) plus the lookup, whose per-example
gradient adds into the same ``[V, d]`` matrix: counted as a shared linear
layer with materialised per-example gradients (``2 B T V d + 2 B^2 V d``) or
ghost kernels over both uses (``2 B^2 T^2 (2d + V)``). Attention scores
(``Q K^T``, ``A V``) have no parameters: plain FLOPs only.
"""

from __future__ import annotations

import dataclasses

import jax

from gram_haiku._src.compute import kernels


@dataclasses.dataclass(frozen=True)
class Layer:
  """One parameterised layer (or a parameter-free op that costs FLOPs).

  Attributes:
    kind: ``"linear"`` (also conv, RNN gates), ``"norm"``, ``"tied_embed"``
      or ``"attention"`` (``n`` = model width, ``m`` = heads; no params).
    t: within-example positions ``T``.
    n: input features ``N``.
    m: output features ``M``.
    bias: whether it has a bias.
    input_grad: whether the backward pass needs the input's cotangent.
  """
  kind: str
  t: int
  n: int
  m: int
  bias: bool = False
  input_grad: bool = True


def plain_flops(layers, b: int) -> float:
  """Forward + backward FLOPs of the parameterised layers (and attention)."""
  total = 0.0
  for l in layers:
    if l.kind in ("linear", "tied_embed"):
      total += (6 if l.input_grad else 4) * b * l.t * l.n * l.m
    elif l.kind == "attention":
      total += 3 * 2 * 2 * b * l.t * l.t * l.n  # QK^T and AV, fwd + bwd
    elif l.kind == "norm":
      total += 3 * 8 * b * l.t * l.n  # a handful of elementwise ops
  return total


def symmetric_fraction(b: int) -> float:
  """The share of a full ``[B, B]`` product that the kernels form on the
  default backend (the blocks are lowered for the CPU only)."""
  if b < kernels.SYMMETRIC_MIN_ROWS or jax.default_backend() != "cpu":
    return 1.0
  n = min(kernels.SYMMETRIC_BLOCKS, b)
  return (n + 1) / (2 * n)


def _linear_gram_macs(b, t, n, m, bias):
  """Multiply-adds: the cheaper of ghost and materialised, bias included.

  Ghost: ``K_x = X X^T`` and ``K_d = D D^T`` over positions; the bias Gram
  is the sum of ``K_d`` over positions (free when ``T = 1``: it is ``K_d``).
  Materialised: ``x_i^T d_i`` then ``F F^T``; the bias adds ``sum_t d_it``
  and its Gram.
  """
  half = symmetric_fraction(b)
  if t == 1:
    ghost = half * b * b * (n + m)
  else:
    ghost = half * b * b * t * t * (n + m + (1 if bias else 0))
  mat = b * t * n * m + half * b * b * n * m + (
      (b * t * m + half * b * b * m) if bias else 0)
  return min(ghost, mat)


def _linear_norms_macs(b, t, n, m, bias):
  if t == 1:
    ghost = b * (n + m)
  else:
    ghost = b * t * t * (n + m + (1 if bias else 0))
  mat = b * t * n * m + ((b * t * m + b * m) if bias else 0)
  return min(ghost, mat)


def gram_extra_flops(layers, b: int) -> float:
  """Minimum extra FLOPs for the full ``[B, B]`` Gram (the formula above)."""
  total = 0.0
  for l in layers:
    t, n, m = l.t, l.n, l.m
    if l.kind == "linear":
      total += 2 * _linear_gram_macs(b, t, n, m, l.bias)
    elif l.kind == "norm":
      total += 2 * b * t * 2 * n + symmetric_fraction(b) * 2 * b * b * 2 * n
    elif l.kind == "tied_embed":
      ghost = symmetric_fraction(b) * b * b * t * t * (2 * n + m)
      mat = b * t * n * m + symmetric_fraction(b) * b * b * n * m
      total += 2 * min(ghost, mat)
  return total


def norms_extra_flops(layers, b: int) -> float:
  """Minimum extra FLOPs for the squared per-example norms ``[B]``."""
  total = 0.0
  for l in layers:
    t, n, m = l.t, l.n, l.m
    if l.kind == "linear":
      total += 2 * _linear_norms_macs(b, t, n, m, l.bias)
    elif l.kind == "norm":
      total += 2 * b * t * 2 * n + 2 * b * 2 * n
    elif l.kind == "tied_embed":
      ghost = b * t * t * (2 * n + m)
      total += 2 * min(ghost, b * t * n * m)
  return total


def extra_flops(layers, b: int, method: str) -> float | None:
  """Minimum extra FLOPs of ``method`` (``"gram"``/``"norms"``), else None."""
  if method == "gram":
    return gram_extra_flops(layers, b)
  if method == "norms":
    return norms_extra_flops(layers, b)
  return None
