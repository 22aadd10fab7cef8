"""The DP-SGD steps under test: one clipped gradient sum per step.

Every step returns the clipped sum ``sum_i c_i g_i`` (``c_i = min(1,
C/|g_i|)``, all-layer unless named per-layer) with the structure of the
parameters, so that :func:`check` compares each with the ``vmap(grad)``
reference before it is timed.

* ``dp_all``: :func:`gram_haiku.clipped_grad`, all-layer, one backward pass.
* ``dp_layer``: the same, ``clipping="per-layer"`` (inside each layer's
  backward rule; the reference clips each module to ``C / sqrt(L)``).
* ``dp_noise``: ``dp_all`` plus jax-privacy's Gaussian privatizer (JAX's
  default PRNG), the full DP step's gradient.
* ``dp_two_pass``: the recipe without reweighting: norms from
  ``value_grad_and_gram(track(mode="norms"))``, then ``jax.grad`` of
  ``sum_i c_i l_i`` (a second backward pass).
* ``jaxp_clipped``: ``jax_privacy.clipping.clipped_grad`` (``vmap`` over
  examples); ``jaxp_micro``: the same with ``microbatch_size = B / 4``.
* ``optax_dp``: ``vmap(grad)`` then
  ``optax.contrib.differentially_private_aggregate`` with zero noise
  (it divides by ``B``: the step multiplies back).
"""

from __future__ import annotations

import math
from typing import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku._src import reference

DP_METHODS = ("dp_all", "dp_layer", "dp_noise", "dp_two_pass",
              "jaxp_clipped", "jaxp_micro", "optax_dp")
#: The clipping norm of every DP step (the cost does not depend on it).
CLIP = 1.0


def build(prep, method: str) -> tuple[Callable, tuple]:
  """``(step, args)``: ``step(params, state, *batch) -> clipped sum``."""
  bench = prep.bench
  tracked = prep.tracked["norms"].apply
  state = prep.states["norms"]
  args = (prep.params, state, *bench.batch)
  if method in ("dp_all", "dp_noise", "dp_layer"):
    clipping = "per-layer" if method == "dp_layer" else "all-layer"
    clipped = gram_haiku.clipped_grad(tracked, CLIP, clipping=clipping)
    if method != "dp_noise":
      return (lambda p, s, *batch: clipped(p, s, *batch)[0]), args
    from jax_privacy import noise_addition  # pylint: disable=g-import-not-at-top
    privatizer = noise_addition.gaussian_privatizer(
        stddev=clipped.sensitivity(), prng_key=jax.random.key(0))
    noise_state = privatizer.init(prep.params)

    def step(p, s, *batch):
      grads, _ = clipped(p, s, *batch)
      return privatizer.update(grads, noise_state)[0]
    return step, args
  if method == "dp_two_pass":
    norms = gram_haiku.value_grad_and_gram(tracked)
    per_example = hk.without_apply_rng(hk.transform(bench.net))

    def step(p, s, *batch):
      _, _, grams = norms(p, s, *batch)
      c = jax.lax.stop_gradient(jnp.minimum(1.0, CLIP / grams.norms))
      return jax.grad(lambda q: jnp.sum(c * per_example.apply(q, *batch)))(p)
    return step, args
  loss = lambda p, *batch: prep.plain.apply(p, *batch)
  n_batch = len(bench.batch)
  if method in ("jaxp_clipped", "jaxp_micro"):
    from jax_privacy import clipping as jp_clipping  # pylint: disable=g-import-not-at-top
    micro = (max(1, bench.batch_size // 4) if method == "jaxp_micro"
             else None)
    clipped = jp_clipping.clipped_grad(
        loss, l2_clip_norm=CLIP, batch_argnums=tuple(range(1, n_batch + 1)),
        microbatch_size=micro)
    return (lambda p, s, *batch: clipped(p, *batch)), args
  if method == "optax_dp":
    import optax  # pylint: disable=g-import-not-at-top
    agg = optax.contrib.differentially_private_aggregate(
        CLIP, 0.0, jax.random.key(0))
    agg_state = agg.init(prep.params)

    def loss_one(p, *example):
      return loss(p, *[a[None] for a in example])

    def step(p, s, *batch):
      per = jax.vmap(jax.grad(loss_one),
                     in_axes=(None,) + (0,) * n_batch)(p, *batch)
      mean, _ = agg.update(per, agg_state)
      return jax.tree.map(lambda g: g * batch[0].shape[0], mean)
    return step, args
  raise ValueError(f"Unknown DP method {method!r}; expected one of "
                   f"{DP_METHODS}.")


def reference_sums(prep) -> dict:
  """The reference clipped sums: all-layer and per-layer (``C/sqrt(L)``)."""
  f = np.asarray(reference.per_example_grads(
      prep.plain.apply, prep.params, *prep.bench.batch), np.float64)
  norms = np.sqrt((f ** 2).sum(1))
  all_layer = reference.weighted_sum(f, reference.clip_reference(norms, CLIP),
                                     prep.params)
  groups = reference.column_groups(prep.params)
  each = CLIP / math.sqrt(len(groups))
  flat = np.zeros(f.shape[1])
  for cols in groups.values():
    n = np.sqrt((f[:, cols] ** 2).sum(1))
    flat[cols] = reference.clip_reference(n, each) @ f[:, cols]
  per_layer = reference.weighted_sum(flat[None], [1.0], prep.params)
  return {"all-layer": all_layer, "per-layer": per_layer}


def check(method: str, out, refs: dict, rtol: float = 1e-3):
  """None when ``out`` is the reference clipped sum, else why not. The
  noisy step is checked for shape only (its noise is the point)."""
  want = refs["per-layer" if method == "dp_layer" else "all-layer"]
  got_l = [np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(out)]
  want_l = [np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(want)]
  if [a.shape for a in got_l] != [a.shape for a in want_l]:
    return "wrong structure of the clipped gradient"
  if method == "dp_noise":
    return None
  err = reference.relative_error(np.concatenate(got_l),
                                 np.concatenate(want_l))
  if not np.isfinite(err) or err > rtol:
    return f"wrong result: max relative error {err:.2e} against vmap(grad)"
  return None
