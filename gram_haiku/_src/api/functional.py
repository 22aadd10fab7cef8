"""The public functions for a plain-JAX loss: ``loss(params, *batch)``.

``gram_haiku.functional.value_grad_and_gram``, ``reweighted_grad`` and
``clipped_grad`` take a loss over any pytree of parameters (a dict of
arrays, a Flax ``params`` collection, an NNX ``State``) and give what the
Haiku functions of the same names give, with the same semantics: the
examples lie along ``example_axes`` of the batch arguments (default axis 0
of every array whose leading size is the batch's), the loss is the *sum*
of the per-example losses, and every number is exact against
``jax.vmap(jax.grad(per_example_loss))``. There is no module to track:
every parameter is covered by a program-level Gram rule read from the
traced loss (:mod:`gram_haiku._src.analysis.program_rules`), or refused
with an error that names its use and line. Each is the Haiku function of
the same name, run on :class:`~gram_haiku._src.frontend.plain_jax.BareLoss`
(one pass pipeline for both front-ends).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence, Union

from gram_haiku._src.api import clipping
from gram_haiku._src.api import reweight
from gram_haiku._src.api import value_grad_and_gram as vgg
from gram_haiku._src.frontend.plain_jax import BareLoss


def _on_batch(inner: Callable[..., Any]) -> Callable[..., Any]:
  """``fn(params, *batch, **kwargs)``: ``inner`` (a Haiku-style
  ``fn(params, state, rng, *batch)``) with no state and no ``rng``."""
  def fn(params, *batch, **kwargs):
    return inner(params, {}, None, *batch, **kwargs)
  return fn


def value_grad_and_gram(loss_fn: Callable[..., Any], *,
                        has_aux: bool = False,
                        example_axes: Optional[Sequence[Optional[int]]] = None,
                        **options) -> Callable[..., Any]:
  """Loss, gradients and per-example Gram of a plain-JAX loss.

  Args:
    loss_fn: ``loss_fn(params, *batch, **kwargs)``: a scalar, the sum over
      the examples of their losses (``(scalar, aux)`` with ``has_aux``);
      ``params`` any pytree of arrays.
    has_aux: as :func:`gram_haiku.value_grad_and_gram`.
    example_axes: one entry per batch argument: the axis of its examples
      (int) or None for an argument that holds none.
    **options: ``mesh_axes``, ``mesh``: as
      :func:`gram_haiku.value_grad_and_gram`.

  Returns:
    ``fn(params, *batch, **kwargs) -> (value, grads, grams)``: ``grads``
    has the structure of ``params``; ``grams`` a :class:`gram_haiku.Grams`
    whose ``total`` is ``f32[B, B]`` (``G[i, j] = <g_i, g_j>``, over every
    parameter leaf) and whose ``by_layer`` and ``coverage`` are keyed by
    each leaf's path (``"dense/kernel"``: the pytree keys joined by
    ``/``).

  Raises:
    ValueError: for a parameter whose use no program-level rule covers (the
      message names the primitive and the line), batch arguments with no
      one example size (pass ``example_axes``), and the errors of
      :func:`gram_haiku.value_grad_and_gram` that follow the examples (a
      loss that couples them).
  """
  return _on_batch(vgg.value_grad_and_gram(
      BareLoss(loss_fn), has_aux=has_aux, example_axes=example_axes,
      **options))


def reweighted_grad(loss_fn: Callable[..., Any], weight_fn, *,
                    needs: str = "norms", has_aux: bool = False,
                    example_axes: Optional[Sequence[Optional[int]]] = None,
                    **options) -> Callable[..., Any]:
  """``sum_i c_i g_i`` of a plain-JAX loss, ``c = weight_fn(grams)`` from
  the Grams of the same backward pass.

  Args:
    loss_fn: as :func:`value_grad_and_gram`.
    weight_fn: as :func:`gram_haiku.reweighted_grad`.
    needs: as :func:`gram_haiku.reweighted_grad`.
    has_aux: as :func:`gram_haiku.reweighted_grad`.
    example_axes: as :func:`value_grad_and_gram`.
    **options: ``frozen`` (leaves named by path), ``mesh_axes``, ``mesh``:
      as :func:`gram_haiku.reweighted_grad`.

  Returns:
    ``fn(params, *batch, **kwargs) -> (value, grads, grams, c)``, ``c``
    ``f32[B]``.

  Raises:
    ValueError: as :func:`value_grad_and_gram` and
      :func:`gram_haiku.reweighted_grad`.
  """
  return _on_batch(reweight.reweighted_grad(
      BareLoss(loss_fn), weight_fn, needs=needs, has_aux=has_aux,
      example_axes=example_axes, **options))


def clipped_grad(loss_fn: Callable[..., Any], argnums: Any = 0,
                 has_aux: bool = False, *,
                 batch_argnums: Optional[Union[int, Sequence[int]]] = None,
                 **options) -> Callable[..., Any]:
  """DP-SGD's sum of clipped per-example gradients of a plain-JAX loss,
  in one backward pass, with ``jax_privacy.clipping.clipped_grad``'s
  arguments and results: ``loss_fn(params, *batch)`` as jax-privacy takes
  it (but returning the *sum* over the batch: it runs once on the whole
  batch).

  Args:
    loss_fn: as :func:`value_grad_and_gram`.
    argnums, has_aux: as jax-privacy's (``argnums`` must be 0).
    batch_argnums: the argument numbers of ``loss_fn`` that hold examples
      (jax-privacy's numbering: the batch starts at 1); default: every
      argument after ``params``.
    **options: ``l2_clip_norm`` (required) and the other options of
      :func:`gram_haiku.clipped_grad` (``prng_argnum`` is refused there).

  Returns:
    ``fn(params, *batch, **kwargs)``: what
    :func:`gram_haiku.clipped_grad` returns.

  Raises:
    ValueError: as :func:`gram_haiku.clipped_grad`, and for a
      ``batch_argnums`` entry below 1 (the parameters hold no examples).
  """
  if batch_argnums is not None:
    numbers = ((batch_argnums,) if isinstance(batch_argnums, int)
               else tuple(batch_argnums))
    if any(not isinstance(k, int) or k < 1 for k in numbers):
      raise ValueError(
          f"gram_haiku.functional.clipped_grad: batch_argnums="
          f"{batch_argnums!r}: the batch arguments are numbered from 1 "
          "(argument 0 is params).\nWhat to do: number them as in "
          "loss_fn(params, *batch), e.g. batch_argnums=(1, 2).")
    # (The Haiku function numbers them after (params, state, rng).)
    batch_argnums = tuple(k + 2 for k in numbers)
  return _on_batch(clipping.clipped_grad(
      BareLoss(loss_fn), argnums, has_aux, batch_argnums=batch_argnums,
      **options))
