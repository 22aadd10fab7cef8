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
from gram_haiku._src.core import reference

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
      # The clipped sum, and the norm bounds its factors were computed from
      # (checked against the reference by :func:`check`).
      def step(p, s, *batch):
        grads, aux = clipped(p, s, *batch)
        if clipping == "all-layer":
          return grads, {"": aux.grad_norms}
        return grads, {m: jnp.sqrt(sq) for m, sq in
                       aux.grams.sq_norms_by_layer.items()}
      return step, args
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


def _clipped_sum(f, params, norms=None, by_layer=None) -> dict:
  """The reference clipped sums, all-layer and per-layer (``C/sqrt(L)``),
  from the per-example gradients ``f``, with each example's clip factor
  from the exact norms, or from given norms (``norms``: ``[B]``;
  ``by_layer``: module -> ``[B]``)."""
  exact = np.sqrt((f ** 2).sum(1))
  all_layer = reference.weighted_sum(
      f, reference.clip_reference(exact if norms is None else norms, CLIP),
      params)
  groups = reference.column_groups(params)
  each = CLIP / math.sqrt(len(groups))
  flat = np.zeros(f.shape[1])
  for m, cols in groups.items():
    n = (np.sqrt((f[:, cols] ** 2).sum(1)) if by_layer is None
         else by_layer[m])
    flat[cols] = reference.clip_reference(n, each) @ f[:, cols]
  per_layer = reference.weighted_sum(flat[None], [1.0], params)
  return {"all-layer": all_layer, "per-layer": per_layer}


def reference_sums(prep) -> dict:
  """The reference clipped sums (see :func:`_clipped_sum`), and what
  :func:`check` needs to rebuild them from a step's norm bounds."""
  f = np.asarray(reference.per_example_grads(
      prep.plain.apply, prep.params, *prep.bench.batch), np.float64)
  return {**_clipped_sum(f, prep.params), "f": f, "params": prep.params}


def check(method: str, out, refs: dict, rtol: float = 1e-3):
  """None when ``out`` is the reference clipped sum, else why not. The
  noisy step is checked for shape only (its noise is the point).
  gram_haiku's steps clip by sound upper bounds of the norms (see
  ``gram_haiku/_src/compute/norm_bounds.py``): those are checked against the
  reference norms (never below, at most ``reference.CLIP_BOUND_SLACK``
  above), and the sum against the reference clipped by them."""
  want = refs["per-layer" if method == "dp_layer" else "all-layer"]
  if method in ("dp_all", "dp_layer"):
    out, bounds = out
    f, params = refs["f"], refs["params"]
    groups = reference.column_groups(params)
    exact = ({"": np.sqrt((f ** 2).sum(1))} if method == "dp_all" else
             {m: np.sqrt((f[:, c] ** 2).sum(1)) for m, c in groups.items()})
    bounds = {m: np.asarray(b, np.float64) for m, b in bounds.items()}
    for m, b in bounds.items():
      ratio = b / np.maximum(exact[m], 1e-30)
      if not (np.all(ratio >= 1 - rtol) and
              np.all(ratio <= 1 + reference.CLIP_BOUND_SLACK + rtol)):
        return (f"norm bounds of {m or 'the model'} at {ratio.min():.6f} to "
                f"{ratio.max():.6f} times the reference norms")
    sums = _clipped_sum(f, params, norms=bounds.get(""),
                        by_layer=None if method == "dp_all" else bounds)
    want = sums["per-layer" if method == "dp_layer" else "all-layer"]
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
