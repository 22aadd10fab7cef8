"""The JAX methods under test, as jittable steps over one model.

* ``plain``: ``jax.value_and_grad`` of the untracked model: loss and grads.
* ``gram``: the model inside ``gram_haiku.track()``, through
  ``gram_haiku.value_grad_and_gram``: loss, grads and the full ``[B, B]``
  Gram (total and per layer).
* ``norms``: the same under ``track(mode="norms")``: loss, grads and the
  per-example gradient norms.
* ``naive``: ``jax.vmap(jax.grad(...))`` over examples of the untracked model
  (each example alone, as a batch of one), ``F`` flattened to ``[B, P]``,
  then ``F @ F.T``; grads as ``F.sum(0)``.
* ``cross``: ``gram_haiku.cross_gram`` with ``V = B`` queries (the batch
  rolled by one example): loss, the training examples' grads and the
  ``[B, V]`` block ``<g_i, h_q>``.
* ``cross_concat``: the same block the way one had to before: the queries
  appended to the batch with weight 0 (``reweighted_grad(needs="gram")``),
  forming the whole ``(B + V)^2`` Gram and reading its block.

Every step is ``step(params, state, *batch)`` (``state`` holds the probes;
``plain`` and ``naive`` ignore it) so that the runner times them alike.
Before timing, :func:`check` verifies that a tracked method covers every
parameter and agrees with the naive reference (a silently partial or wrong
Gram is reported, never timed as if it were right).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku._src.core import reference
from benchmarks.models import Bench

from benchmarks import dp_methods

CROSS = ("cross", "cross_concat")
JAX_METHODS = (("plain", "gram", "norms", "naive") + dp_methods.DP_METHODS +
               CROSS)
TRACKED = ("gram", "norms")
#: The methods checked against ``naive``'s Gram before they are timed.
CHECKED = TRACKED + CROSS


@dataclasses.dataclass
class Prepared:
  """Transforms and initial values shared by all methods of one model."""
  bench: Bench
  plain: hk.Transformed
  tracked: dict  # mode -> hk.TransformedWithState
  params: dict
  states: dict  # mode -> state (probes)


def _summed(net):
  def loss(*batch):
    return net(*batch).sum()
  return loss


def _tracked(net, mode: str, strategy: str, gram_precision: str):
  def loss(*batch):
    with gram_haiku.track(mode=mode, strategy=strategy,
                          gram_precision=gram_precision):
      out = net(*batch)
    return out.sum()
  return loss


def prepare(bench: Bench, strategy: str = "auto", seed: int = 0,
            gram_precision: str = "highest", params=None,
            abstract: bool = False) -> Prepared:
  """Transforms the model plain and tracked; initialises the parameters.

  The parameters come from the plain model: ``track()`` creates the same
  ones (same names, shapes, initialisers). Tracked inits that raise (a layer
  kind not supported yet) are left out of ``states`` and reported by
  :func:`build`. ``params``: given parameters (they do not depend on the
  batch size) instead of new ones. ``abstract``: parameters and states as
  ``jax.ShapeDtypeStruct`` (enough to compile a step, not to run it).
  """
  plain = hk.without_apply_rng(hk.transform(_summed(bench.net)))
  rng = jax.random.PRNGKey(seed)
  if params is None:
    init = (functools.partial(jax.eval_shape, plain.init) if abstract
            else jax.jit(plain.init))
    params = init(rng, *bench.batch)
  tracked, states = {}, {}
  for mode in TRACKED:
    tracked[mode] = hk.without_apply_rng(hk.transform_with_state(
        _tracked(bench.net, mode, strategy, gram_precision)))
    try:
      _, shapes = jax.eval_shape(tracked[mode].init, rng, *bench.batch)
      if abstract:
        states[mode] = shapes
      elif all(set(v) == {gram_haiku.PROBE_NAME} for v in shapes.values()):
        # Nothing but probes, which are zeros: no init to compile.
        states[mode] = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
                                    shapes)
      else:
        _, states[mode] = jax.jit(tracked[mode].init)(rng, *bench.batch)
    except Exception as e:  # pylint: disable=broad-except
      states[mode] = e
  return Prepared(bench, plain, tracked, params, states)


def first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  line = text[0] if text else ""
  return f"{type(e).__name__}: {line}"[:160]


class Unsupported(Exception):
  """A method that cannot run (correctly) on this model today."""


def build(prep: Prepared, method: str) -> tuple[Callable, tuple]:
  """Returns ``(step, args)`` for ``method``; ``step(*args)`` is jittable.

  Raises:
    Unsupported: when the tracked model cannot be initialised.
  """
  bench = prep.bench
  if method == "plain":
    vg = jax.value_and_grad(prep.plain.apply)

    def step(params, state, *batch):
      del state
      return vg(params, *batch)
    return step, (prep.params, {}, *bench.batch)

  if method in TRACKED:
    state = prep.states[method]
    if isinstance(state, BaseException):
      raise Unsupported(first_line(state)) from state
    vgg = gram_haiku.value_grad_and_gram(prep.tracked[method].apply)

    def step(params, state, *batch):
      loss, grads, grams = vgg(params, state, *batch)
      out = grams.total if method == "gram" else grams.norms
      return loss, grads, out
    return step, (prep.params, state, *bench.batch)

  if method == "naive":
    def loss_one(params, *example):
      example = [a[None] for a in example]
      return prep.plain.apply(params, *example)

    def step(params, state, *batch):
      del state
      per_example = jax.vmap(jax.grad(loss_one), in_axes=(None,) + (0,) * len(
          batch))(params, *batch)
      leaves = jax.tree.leaves(per_example)
      f = jnp.concatenate([l.reshape(l.shape[0], -1) for l in leaves], axis=1)
      grads = jax.tree.map(lambda l: l.sum(0), per_example)
      loss = prep.plain.apply(params, *batch)
      return loss, grads, f @ f.T
    return step, (prep.params, {}, *bench.batch)

  if method in CROSS:
    state = prep.states["gram"]
    if isinstance(state, BaseException):
      raise Unsupported(first_line(state)) from state
    return _cross_step(prep, method), (prep.params, state, *bench.batch)

  if method in dp_methods.DP_METHODS:
    state = prep.states["norms"]
    if isinstance(state, BaseException):
      raise Unsupported(first_line(state)) from state
    return dp_methods.build(prep, method)

  raise ValueError(f"Unknown method {method!r}; expected one of "
                   f"{JAX_METHODS}.")


def _cross_step(prep: Prepared, method: str) -> Callable:
  """``cross`` or ``cross_concat``: the queries are the batch rolled by one
  example, so the block is ``naive``'s Gram with its columns rolled. Both
  give the update and the block, not the loss (``cross_gram``'s value
  costs one more forward pass of the training examples where it is used;
  the joint batch's loss, which ``cross_concat`` has, is not it)."""
  apply = prep.tracked["gram"].apply

  def with_rng(params, state, rng, *batch):
    del rng
    return apply(params, state, *batch)

  if method == "cross":
    cg = gram_haiku.cross_gram(with_rng)

    def step(params, state, *batch):
      queries = tuple(jnp.roll(a, 1, axis=0) for a in batch)
      _, grads, cross = cg(params, state, None, *batch, queries=queries)
      return jnp.zeros(()), grads, cross.total
    return step

  def step(params, state, *batch):  # cross_concat
    b = batch[0].shape[0]
    mask = jnp.concatenate([jnp.ones((b,)), jnp.zeros((b,))])
    rw = gram_haiku.reweighted_grad(with_rng, lambda grams: mask,
                                    needs="gram")
    both = tuple(jnp.concatenate([a, jnp.roll(a, 1, axis=0)]) for a in batch)
    _, grads, grams, _ = rw(params, state, None, *both)
    return jnp.zeros(()), grads, grams.total[:b, b:]
  return step


def untracked_modules(prep: Prepared, method: str) -> list[str]:
  """Parameterised modules that have no Gram probe under ``method``."""
  state = prep.states["gram" if method in CROSS else method]
  probed = {m for m, entries in state.items()
            if gram_haiku.PROBE_NAME in entries}
  return sorted(m for m in prep.params if m not in probed)


def check(prep: Prepared, method: str, tracked_out, naive_out,
          rtol: float = 1e-3) -> Optional[str]:
  """None when ``method``'s outputs are complete and right, else why not.

  Args:
    prep: the prepared model.
    method: one of :data:`CHECKED`.
    tracked_out: ``step`` output of ``method``.
    naive_out: ``step`` output of ``naive`` (the reference).
    rtol: tolerance relative to the largest reference entry.
  """
  missing = untracked_modules(prep, method)
  if missing:
    shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
    return (f"untracked parameters in {len(missing)} module(s): {shown} "
            "(Gram would be partial)")
  ref = np.asarray(naive_out[2], np.float64)
  got = np.asarray(tracked_out[2], np.float64)
  if method == "norms":
    ref = np.sqrt(np.maximum(np.diagonal(ref), 0))
  elif method in CROSS:  # Query q is example q - 1.
    ref = np.roll(ref, 1, axis=1)
  err = reference.relative_error(got, ref)
  if not np.isfinite(err) or err > rtol:
    return f"wrong result: max relative error {err:.2e} against vmap(grad)"
  return None
