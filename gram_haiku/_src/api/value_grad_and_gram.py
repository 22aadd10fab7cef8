"""``value_grad_and_gram``: loss, parameter gradients and Grams in one pass.

A composition of the pass pipeline (:mod:`gram_haiku._src.passes.pass_pipeline`):
trace the loss, let every module keep its Gram (or norms, or per-example
gradients where it is applied more than once), run the pass, read the
stores.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src.api import shard_examples
from gram_haiku._src.compute import plan as plan_lib
from gram_haiku._src.core import errors
from gram_haiku._src.core import one_program
from gram_haiku._src.ops import adapter
from gram_haiku._src.passes import pass_pipeline as pipeline
# (The probes in the Haiku state, and the trace, the pipeline's first step,
# are also read here.)
from gram_haiku._src.passes.pass_trace import merge_probes
from gram_haiku._src.passes.pass_trace import split_probes
from gram_haiku._src.passes.pass_trace import State
from gram_haiku._src.passes.pass_trace import trace_loss


def resize_probes(state: State, batch_size: int, *, mode: str = "gram"
                  ) -> dict:
  """Returns ``state`` with every Gram probe replaced by ``zeros(B, B)``.

  For the raw path: ``jax.grad`` of a tracked loss with respect to the probes
  in ``state`` gives each module's Gram, and the probes must then be sized to
  the example axis (per-example code under ``hk.vmap`` cannot see ``B`` at
  init, so its probes start with a placeholder size).

  Args:
    state: Haiku state from ``init`` of a ``hk.transform_with_state``.
    batch_size: ``B``, the size of the example axis.
    mode: the ``track(mode=...)`` the probes were created under: ``"gram"``
      probes become ``[B, B]``, ``"norms"`` probes ``[B]``.

  Returns:
    A new state dict; other entries are untouched. Probes keep their dtype
    and any leading axes (``hk.layer_stack`` stacks one probe per layer).

  Raises:
    ValueError: if ``batch_size`` is not a positive int.
  """
  if isinstance(batch_size, bool) or not isinstance(batch_size, int) or (
      batch_size < 1):
    raise ValueError(errors.BAD_BATCH_SIZE.format(value=batch_size))
  plan_lib.check_mode(mode)
  own = plan_lib.PROBE_NDIM[mode]
  rest, probes = split_probes(state)
  probes = {m: jnp.zeros(tuple(p.shape[:p.ndim - own]) +
                         adapter.probe_shape(mode, batch_size, 0), p.dtype)
            for m, p in probes.items()}
  return merge_probes(rest, probes)


def value_grad_and_gram(apply_fn: Callable[..., Any], *, has_aux: bool = False,
                        return_state: bool = False,
                        mesh_axes: str | tuple[str, ...] | None = None,
                        example_axes: Optional[Sequence[Optional[int]]] = None,
                        mesh: Optional[jax.sharding.Mesh] = None
                        ) -> Callable[..., Any]:
  """Transforms a tracked ``apply`` into one returning loss, grads and Grams.

  Args:
    apply_fn: ``apply`` of ``hk.transform_with_state(f)``, where ``f`` calls
      its model inside ``gram_haiku.track()`` and returns a scalar loss.
    has_aux: ``f`` returns ``(loss, aux)``; ``value`` is then that pair, as
      with ``jax.value_and_grad(..., has_aux=True)``.
    return_state: also return the updated Haiku state (e.g. BatchNorm
      statistics), as ``(value, new_state)`` in place of ``value``.
    mesh_axes: for use inside ``jax.shard_map`` whose example axis is split
      over these mesh axes (a name or a tuple, in the order of the
      ``PartitionSpec`` entry that splits the examples). Each device then
      gets its rows ``f32[b, B]`` of the global Gram (``b`` local examples,
      ``B`` in all); ``out_specs=P(mesh_axes, None)`` assembles the
      ``(B, B)`` Gram. The other devices' Gram factors are gathered
      (``all_gather``); ``track(mode="norms")`` layers need none.
      ``value`` and ``grads`` are what ``jax.value_and_grad`` gives in the
      same ``shard_map``: with replicated parameters and VMA checking on,
      the gradients are all-reduced exactly as JAX's own AD does. See the
      "Distributed" docs page for layouts and communication cost. Several
      axes need ``mesh`` (inside a ``shard_map`` built elsewhere their
      order cannot be checked).
    example_axes: where the examples lie in the positional batch arguments
      (those after ``rng``): one entry per argument, an int (that axis of
      every array in it, e.g. 1 for a time-major ``(T, B, F)`` input) or
      None (an argument that holds no examples: a memory of ``B`` rows
      that every example reads). Default: axis 0 of every array whose
      leading size is the batch's, which cannot tell a time-major input or
      such a memory from the examples when the sizes agree (``T == B``).
      The tracked layers take their own example axis from ``track()``
      (``hk.vmap(..., in_axes=1)`` over a time-major input); this says
      where the check that follows the examples starts.
    mesh: a ``jax.sharding.Mesh``: the returned function then builds the
      ``jax.shard_map`` itself and is called outside it on the whole
      batch. The examples (``example_axes``, default axis 0 of every array
      of the batch arguments) are split over ``mesh_axes`` (default: every
      axis of ``mesh``), in that order, and the Gram is assembled in the
      same order; parameters, state and ``rng`` are replicated. The
      outputs are global: ``grams`` ``f32[B, B]``, ``grads`` (of the sum of
      the devices' losses) replicated, and ``value`` (each device's loss)
      ``f32[n]``; whatever else differs per device (``aux``, BatchNorm
      statistics in the new state) gains a leading axis of size ``n``, one
      entry per device in the order of ``mesh_axes``.

  Returns:
    ``fn(params, state, rng, *args, **kwargs) -> (value, grads, grams)``:
    ``value`` is the loss, ``grads`` its gradient with respect to ``params``
    (identical to untracked ``jax.grad`` up to float rounding), and ``grams``
    a :class:`Grams` with ``total: f32[B, B]``, ``by_layer`` and
    ``norms: f32[B]``. ``B`` is the size of the example axis at apply time,
    which may differ from init. Before the real pass, one abstract trace of
    the loss (``jax.make_jaxpr``, no FLOPs) is read: it sizes the probes,
    finds the modules whose parameters are used more than once, and follows
    the examples (axis 0 of every array argument of the batch's size)
    through the program.

  Raises:
    ValueError: if ``state`` holds no probe, if the loss is not a scalar, if
      ``mesh_axes`` are not axes of an enclosing ``shard_map`` (or, with
      ``mesh``, of the mesh), if there are several without ``mesh``, if
      ``mesh``'s devices cannot share the batch equally; from the
      traced program: a parameter transformed on its way to its layer
      where the transformation cannot be pulled back (see the "Weight
      sharing" section of the semantics docs) or also used outside every
      tracked layer, a layer input whose example
      axis is not the examples (or merges, reorders or mixes them), a loss
      that couples the examples, a tracked layer differentiated inside the
      loss, an ``example_axes`` that does not fit the batch, a loss
      returned as a tuple without ``has_aux``; or from the tracked layers
      (see :class:`gram_haiku.track`).
      Each message names the module or parameter and what to do.
  """
  axes = shard_examples.example_axes_of(mesh_axes, mesh,
                                       "value_grad_and_gram")

  def fn(params, state, rng, *args, **kwargs):
    t = trace_loss(apply_fn, has_aux, params, state, rng, args, kwargs, axes,
                   example_axes=example_axes)
    t, live = pipeline.participants(t, pipeline.GRAMS, params)
    p = pipeline.run(t, pipeline.GRAMS, params, rng, args, kwargs, live=live)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    grads = jax.tree_util.tree_unflatten(
        treedef, [p.param_grads[k] for k in range(len(leaves))])
    grams = pipeline.read_grams(
        t, p, pipeline.GRAMS, leaves, pipeline.open_stores(t, p, leaves),
        pipeline.coverage_of(params, t.seen, t.found))
    value = (p.value, p.aux) if has_aux else p.value
    return ((value, p.state) if return_state else value), grads, grams

  if mesh is not None:
    fn = shard_examples.shard_examples(
        fn, mesh=mesh, axes=axes, example_axes=example_axes,
        fn_name="value_grad_and_gram",
        rows=lambda out: (shard_examples.mark(out[0], False),
                          shard_examples.mark(out[1], False),
                          shard_examples.mark(out[2], True)))
  return one_program.compiled_when_eager(
      fn, "the function value_grad_and_gram returned")
