"""Sharded models against the single-device reference, in their own process.

``python -m tests.distributed_cases --json OUT [--all]`` sets 8 CPU devices
(which must happen before JAX starts a backend, hence the own process),
runs every case below and writes one record per case to ``OUT``;
``tests/test_distributed.py`` starts it once and turns each record into a
test. Every Gram is compared with ``F @ F.T`` of the untracked model on one
device (:mod:`gram_haiku._src.core.reference`), every gradient with ``jax.grad`` of it.

Cases:

* ``shard_map/<zoo entry>/<style>``: each model of :mod:`tests.layer_zoo`
  under ``shard_map`` with the examples split over ``"data"``, through
  ``value_grad_and_gram(mesh_axes="data")``; rows assembled by
  ``out_specs=P("data", None)``. The default run takes the explicit style
  of most entries and the ``vmap1`` style of a few; ``--all`` every entry
  in both styles, and more layouts.
* ``shard_map_2d/<entry>``: a ``(4, 2)`` mesh, examples split over both
  axes, ``value_grad_and_gram(mesh=mesh, mesh_axes=("a", "b"))`` (and
  ``("b", "a")``), which builds the ``shard_map``.
* ``mesh_argument/...``: ``mesh=`` on ``reweighted_grad`` and
  ``clipped_grad`` (with padding), an ``aux``, a new state and an
  unbatched argument; its teaching errors (several axes without a mesh,
  axes the mesh lacks, a batch the devices cannot share, a call inside
  ``shard_map``).
* ``shard_map_norms``: ``track(mode="norms")``: the squared norms, and no
  all-gather in the compiled HLO.
* ``collectives``: the compiled step of the Gram has the plain step's
  all-reduces (count and bytes) and all-gathers of the size the docs'
  formula gives.
* ``no_check_vma``: ``shard_map(check_vma=False)``: the Gram rows as
  above, the gradients local (summed by the user, as with plain JAX).
* ``jit/<Auto|Explicit>/<entry>``: ``jit`` with the batch placed by
  ``NamedSharding``; under Explicit the Gram comes out sharded by rows.
* ``errors/...``: the teaching errors of a missing or unbound ``mesh_axes``.
* ``clipped/<clipping>/<entry>``: ``gram_haiku.clipped_grad(mesh_axes=
  "data")`` under ``shard_map``: the clipped sum over all devices equals
  ``sum_i min(1, C/|g_i|) g_i`` of the single-device reference (per-layer:
  each module clipped to ``C / sqrt(L)``).
* ``cross_gram/MLP``: :func:`gram_haiku.cross_gram` with the examples and
  the queries split, under ``shard_map`` and ``mesh=`` (5 queries on 8
  devices: padded): the block equals
  ``F_train @ F_query.T`` of the single-device reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gram_haiku.conformance import runner
from gram_haiku.conformance import sharded

N_DEVICES = 8
B = 16
VMAP_ENTRIES = ("MLP",)
# Left to --all (the nightly budget), to keep the default run short: each is
# covered by a kindred case (tied-LM holds a transformer block; the
# shard_map_rnn cases run dynamic_unroll with the carry cast to varying,
# which the zoo's RNNs, untracked too, cannot run under shard_map).
# ResNet-GroupNorm is GroupNorm and Conv2D; the shard_map_rnn cases share a
# module over steps as GRU-static does; the single layers below are each a
# registered op of the conformance suite, whose sharded family runs them
# under shard_map and jit (Auto and Explicit) in every default run. The
# tied LM (4.3 s of the runner's 31 here): its embedding and unembedding
# are the conformance suite's embed and unembed ops, which its sharded
# family runs under shard_map by default, and shard_map/MLP/explicit runs
# the same value_grad_and_gram(mesh_axes=) path.
ALL_ONLY = ("tied-LM",
            "DepthwiseConv2D", "SeparableDepthwiseConv2D",
            "transformer-block", "GRU-dynamic", "LSTM-dynamic", "Conv1D",
            "Conv3D", "RMSNorm", "InstanceNorm", "LSTM-static",
            "mixed-precision-track-first", "ResNet-GroupNorm", "GRU-static",
            "Linear", "Conv2D", "Conv2D-grouped-dilated", "Conv2DTranspose",
            "LayerNorm", "Bias", "Embed-one-hot", "BatchNorm-eval",
            # Single layers also run in the conformance sharded family.
            "Embed", "GroupNorm", "layer_stack",
            "mixed-precision-policy-first")
TWO_D_ENTRIES = ("MLP",)
JIT_ENTRIES = ("MLP", "tied-LM")


def _setup():
  runner.strip_device_count_flag(os.environ)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", N_DEVICES)
  # Compilation dominates these small cases; XLA's optimisations only
  # reorder float work (the collectives case turns them back on: it counts
  # the collectives of the program users would run).
  jax.config.update("jax_disable_most_optimizations", True)
  return jax


def _problem(entry, style, seed=0):
  """Tracked and plain transforms, batch, params, state, reference."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from tests import layer_zoo  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import reference_gram  # pylint: disable=g-import-not-at-top

  fn = entry.fn if style == "explicit" else hk.vmap(entry.fn,
                                                     split_rng=False)
  x = layer_zoo._draw(entry, (B,), seed)  # pylint: disable=protected-access
  tracked = hk.transform_with_state(
      layer_zoo._tracked(fn, entry))  # pylint: disable=protected-access
  plain = hk.transform_with_state(
      lambda x: layer_zoo._tail(fn(x)))  # pylint: disable=protected-access
  params, state = tracked.init(jax.random.PRNGKey(1), x)
  _, plain_state = plain.init(jax.random.PRNGKey(1), x)
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
  ref = reference_gram(plain_loss, params, x)
  grads = jax.jit(jax.grad(plain_loss))(params, x)
  return tracked, x, params, state, ref, grads, plain_loss


def _tolerance(entry):
  from tests import layer_zoo  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core import reference  # pylint: disable=g-import-not-at-top
  return (reference.RTOL_BF16 if layer_zoo.is_low_precision(entry)
          else reference.RTOL_F32)


def _assert_grads(got, want, rtol):
  """Gradients close, relative to the largest entry of any of them.

  (Some are zero up to rounding, e.g. an attention key bias, to which
  softmax is invariant: their own scale is noise.)
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  scale = max(float(np.abs(np.asarray(w)).max())
              for w in jax.tree.leaves(want))
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol,
                               atol=rtol * scale,
                               err_msg=f"gradient {jax.tree_util.keystr(path)}")


class Skip(Exception):
  """The untracked model cannot run under this layout either."""


def _plain_fails(run_plain, like: Exception) -> str:
  """JAX's error for the untracked model under the layout, or ``""``.

  Only an error of the same type as ``like`` (the tracked run's) counts:
  anything else is the tracked run's own failure.
  """
  import jax  # pylint: disable=g-import-not-at-top
  try:
    run_plain()
  except Exception as e:  # pylint: disable=broad-except
    if type(e) is type(like):
      return (f"the untracked model fails under this layout in jax "
              f"{jax.__version__}: {type(e).__name__}: {e}")[:600]
  return ""


def _tracked_or_skip(run_tracked, run_plain):
  """``run_tracked()``; where it fails, a :class:`Skip` if plain JAX fails
  the same way."""
  try:
    return run_tracked()
  except Exception as e:  # pylint: disable=broad-except
    reason = _plain_fails(run_plain, e)
    if reason:
      raise Skip(reason) from None
    raise


def _shard_map_step(tracked, mesh, axes, check_vma=True):
  """Several axes: ``value_grad_and_gram(mesh=...)`` builds the shard_map
  (their order cannot be checked inside one built here)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top

  if isinstance(axes, tuple) and len(axes) > 1:
    assert check_vma
    built = jax.jit(gram_haiku.value_grad_and_gram(
        tracked.apply, mesh=mesh, mesh_axes=axes))

    def step(params, state, x):
      value, grads, grams = built(params, state, None, x)
      return value, grads, grams.total, grams.sq_norms
    return step

  def local(params, state, x):
    value, grads, grams = gram_haiku.value_grad_and_gram(
        tracked.apply, mesh_axes=axes)(params, state, None, x)
    if not check_vma:  # Then JAX sums nothing for us; the user does.
      grads = jax.lax.psum(grads, axes)
    return value[None], grads, grams.total, grams.sq_norms
  spec = P(axes)
  return jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P(), spec),
      out_specs=(spec, P(), P(axes, None), spec), check_vma=check_vma))


def case_shard_map(entry_name, style, mesh_shape=(N_DEVICES,),
                   axes=("data",), check_vma=True, spec_axes=None):
  """``spec_axes``: the order in which the batch is split over the mesh
  axes (default: the mesh's own order)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from tests import layer_zoo  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import assert_gram_close  # pylint: disable=g-import-not-at-top

  entry = layer_zoo.BY_NAME[entry_name]
  tracked, x, params, state, ref, grads, plain_loss = _problem(entry, style)
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(
      jax.sharding.AxisType.Auto,) * len(axes))
  spec_axes = spec_axes or axes
  names = spec_axes if len(spec_axes) > 1 else spec_axes[0]
  step = _shard_map_step(tracked, mesh, names, check_vma)

  def plain():
    from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
    jax.jit(jax.shard_map(jax.grad(plain_loss), mesh=mesh,
                          in_specs=(P(), P(names)), out_specs=P(),
                          check_vma=check_vma))(params, x)
  value, got_grads, total, sq_norms = _tracked_or_skip(
      lambda: step(params, state, x), plain)
  rtol = _tolerance(entry)
  assert total.shape == (B, B), total.shape
  assert_gram_close(total, ref, rtol=rtol)
  assert_gram_close(sq_norms, np.diag(ref), rtol=rtol)
  _assert_grads(got_grads, grads, rtol)
  np.testing.assert_allclose(float(np.sum(value)),
                             float(plain_loss(params, x)), rtol=rtol)
  return {}


def case_rnn_shard_map(core_name):
  """An RNN under ``hk.dynamic_unroll`` (per-example accumulation).

  Inside ``shard_map`` the zero initial state must vary over the examples'
  axis as its carry does (JAX's own rule for ``scan``): the model casts it
  with ``lax.pcast``, as a user of the untracked model must too.
  """
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import assert_gram_close  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import reference_gram  # pylint: disable=g-import-not-at-top

  def make(tracked, sharded):
    def loss(x):  # x: (B, T, F)
      core = getattr(hk, core_name)(4)
      state = core.initial_state(x.shape[0])
      if sharded:
        state = jax.tree.map(
            lambda s: jax.lax.pcast(s, ("data",), to="varying"), state)
      with (gram_haiku.track() if tracked else _nullcontext()):
        out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1), state)
        out = hk.Linear(3)(jnp.swapaxes(out, 0, 1))
      return 0.5 * jnp.sum(jnp.tanh(out) ** 2)
    return hk.transform_with_state(loss)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 5, 3))
  plain = make(False, False)
  params, plain_state = plain.init(jax.random.PRNGKey(1), x)
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
  ref = reference_gram(plain_loss, params, x)
  tracked = make(True, True)
  _, state = make(True, False).init(jax.random.PRNGKey(1), x)
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  _, grads, total, sq_norms = _shard_map_step(tracked, mesh, "data")(
      params, state, x)
  assert_gram_close(total, ref)
  assert_gram_close(sq_norms, np.diag(ref))
  _assert_grads(grads, jax.jit(jax.grad(plain_loss))(params, x), 1e-4)
  return {}


def case_clipped(clipping, entry_name):
  import math  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from tests import layer_zoo  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core import reference  # pylint: disable=g-import-not-at-top

  entry = layer_zoo.BY_NAME[entry_name]
  tracked, x, params, state, _, _, plain_loss = _problem(entry, "explicit")
  f = np.asarray(reference.per_example_grads(plain_loss, params, x),
                 np.float64)
  norms = np.sqrt((f ** 2).sum(1))
  c_norm = float(np.median(norms))
  if clipping == "all-layer":
    want = reference.weighted_sum(f, reference.clip_reference(norms, c_norm),
                                  params)
    want_fraction = np.mean(norms > c_norm)
  else:
    groups = reference.column_groups(params)
    # C_l = C / sqrt(L): the median over the examples of their largest
    # layer norm, so that about half are clipped in some layer (the
    # all-layer median clipped every example of the tied LM in some layer).
    largest = np.max([np.sqrt((f[:, cols] ** 2).sum(1))
                      for cols in groups.values()], axis=0)
    c_norm = float(np.median(largest)) * math.sqrt(len(groups))
    flat = np.zeros(f.shape[1])
    clipped_any = np.zeros(f.shape[0], bool)
    for cols in groups.values():
      n = np.sqrt((f[:, cols] ** 2).sum(1))
      c_l = c_norm / math.sqrt(len(groups))
      flat[cols] = reference.clip_reference(n, c_l) @ f[:, cols]
      clipped_any |= n > c_l
    want = reference.weighted_sum(flat[None], [1.0], params)
    want_fraction = np.mean(clipped_any)
  clipped = gram_haiku.clipped_grad(tracked.apply, c_norm, clipping=clipping,
                                    mesh_axes="data")

  def local(params, state, x):
    grads, aux = clipped(params, state, None, x)
    return grads, aux.grad_norms, aux.fraction_clipped
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(),
                                                           P("data")),
                               out_specs=(P(), P("data"), P())))
  grads, got_norms, fraction = step(params, state, x)
  np.testing.assert_allclose(got_norms, norms, rtol=1e-4)
  # Over every device's examples (and invariant over the mesh: P()).
  np.testing.assert_allclose(fraction, want_fraction, rtol=1e-6)
  assert 0 < want_fraction < 1
  _assert_grads(grads, want, _tolerance(entry))
  return {}


def case_loose_gram():
  """The full Gram with ``mesh=`` (8 devices, 2 examples each) where one
  example's ghost norm cancels (a linear layer's inputs on a large offset,
  its cotangents summing to 0 over the positions): its row and column are
  the materialised Gram's, whichever device holds the others, so every
  other entry is bit for bit the Gram without it (the flags gathered over
  the devices; a batch-wide switch moved them), and the whole Gram is the
  float64 one's."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top

  rng = np.random.RandomState(3)
  t, n, m = 4, 8, 4
  a, e = rng.normal(size=n), rng.normal(size=(B, t, n))
  v = rng.normal(size=(B, t, m))
  v = (v - v.mean(1, keepdims=True)).astype(np.float32)

  def body(x):
    return hk.Linear(m, name="layer")(x)

  def loss_fn(x, v):
    with gram_haiku.track(strategy="ghost"):
      out = body(x)
    return jnp.sum(out * v)
  tracked = hk.transform_with_state(loss_fn)
  x = (a + e).astype(np.float32)  # (no cancellation)
  params, state = tracked.init(jax.random.PRNGKey(0), x, v)
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  step = jax.jit(gram_haiku.value_grad_and_gram(tracked.apply, mesh=mesh))
  loose = 5  # On the third device.
  both = x.copy()
  both[loose] = (3e3 * a + e[loose]).astype(np.float32)
  with_it = np.asarray(step(params, state, None, both, v)[-1].total)
  without = np.asarray(step(params, state, None, x, v)[-1].total)
  keep = np.arange(B) != loose
  np.testing.assert_array_equal(with_it[keep][:, keep],
                                without[keep][:, keep])
  # F in float64: each example's bias and kernel gradients.
  x64, v64 = both.astype(np.float64), v.astype(np.float64)
  f = np.concatenate([v64.sum(1), np.einsum("btn,btm->bnm", x64,
                                            v64).reshape(B, -1)], 1)
  norms = np.sqrt((f * f).sum(1))
  np.testing.assert_array_less(np.abs(with_it - f @ f.T),
                               1e-4 * np.outer(norms, norms))


def case_cross_gram():
  """``cross_gram`` with the examples and the queries split over the mesh:
  under ``shard_map`` (``mesh_axes="data"``: this device's rows of the
  block against every device's queries) and with ``mesh=`` over two axes
  in the order that is not the mesh's and 5 queries for 8 devices
  (padded); blocks, query sums and squared
  norms equal ``F_train @ F_query.T`` of the single-device reference, the
  update the training examples' gradient. Inside ``shard_map`` without
  ``mesh_axes``: an error that names ``cross_gram``'s ``mesh_axes``."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from tests import layer_zoo  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core import reference  # pylint: disable=g-import-not-at-top

  entry = layer_zoo.BY_NAME["MLP"]
  tracked, x, params, state, _, grads, plain_loss = _problem(entry,
                                                            "explicit")
  xq = layer_zoo._draw(entry, (N_DEVICES,), 1)  # pylint: disable=protected-access
  f = np.asarray(reference.per_example_grads(plain_loss, params, x),
                 np.float64)
  h = np.asarray(reference.per_example_grads(plain_loss, params, xq),
                 np.float64)
  want = f @ h.T

  def check(total, summed, sq, got_grads, want_grads=grads, v=N_DEVICES):
    assert total.shape == (B, v), total.shape
    reference.assert_gram_close(total, want[:, :v])
    reference.assert_gram_close(summed[:, None], want[:, :v].sum(1)[:, None])
    reference.assert_gram_close(sq[:, None], (f * f).sum(1)[:, None])
    _assert_grads(got_grads, want_grads, 1e-5)

  def local(axes):
    def step(params, state, x, xq):
      _, g, cross = gram_haiku.cross_gram(tracked.apply, mesh_axes=axes)(
          params, state, None, x, queries=(xq,))
      return g, cross.total, cross.query_summed, cross.sq_norms
    return step
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  rows = P("data")
  g, total, summed, sq = jax.jit(jax.shard_map(
      local("data"), mesh=mesh, in_specs=(P(), P(), rows, rows),
      out_specs=(P(), P("data", None), rows, rows)))(params, state, x, xq)
  check(total, summed, sq, g)
  mesh2 = jax.make_mesh((4, 2), ("a", "b"),
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  # With the update clipped (the block is of the unclipped gradients),
  # and 5 queries for 8 devices: padded, their columns dropped.
  norms = np.sqrt((f * f).sum(1))
  c_norm = float(np.median(norms))
  value, g, cross = jax.jit(gram_haiku.cross_gram(
      tracked.apply, mesh=mesh2, mesh_axes=("b", "a"),
      l2_clip_norm=c_norm))(params, state, None, x, queries=(xq[:5],))
  assert value.shape == (N_DEVICES,), value.shape
  check(cross.total, cross.query_summed, cross.sq_norms, g,
        reference.weighted_sum(f, reference.clip_reference(norms, c_norm),
                               params), v=5)
  np.testing.assert_allclose(float(value.sum()), float(plain_loss(params, x)),
                             rtol=1e-5)
  try:
    jax.jit(jax.shard_map(local(None), mesh=mesh,
                          in_specs=(P(), P(), rows, rows),
                          out_specs=(P(), P("data", None), rows, rows)))(
                              params, state, x, xq)
  except ValueError as e:
    text = str(e)
    assert "cross_gram" in text and "mesh_axes='data'" in text, text
  else:
    raise AssertionError("no error without mesh_axes inside shard_map")
  return {}


def _nullcontext():
  import contextlib  # pylint: disable=g-import-not-at-top
  return contextlib.nullcontext()


def _mlp_norms_problem():
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top

  def make(mode):
    def loss(x):
      mlp = hk.nets.MLP([12, 12, 3])
      if mode is None:
        return 0.5 * jnp.sum(jnp.tanh(mlp(x)) ** 2)
      with gram_haiku.track(mode=mode):
        return 0.5 * jnp.sum(jnp.tanh(mlp(x)) ** 2)
    return hk.transform_with_state(loss)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 6))
  return make, x


def _compiled_stats(fn, *args):
  from benchmarks import collectives  # pylint: disable=g-import-not-at-top
  return collectives.stats(fn.lower(*args).compile().as_text())


def case_norms_and_collectives():
  """Norms gather nothing; the Gram adds only the formula's all-gathers."""
  import jax  # pylint: disable=g-import-not-at-top
  previous = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    return _norms_and_collectives()
  finally:
    jax.config.update("jax_disable_most_optimizations", previous)


def _norms_and_collectives():
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from benchmarks import collectives  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import assert_gram_close  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import reference_gram  # pylint: disable=g-import-not-at-top

  make, x = _mlp_norms_problem()
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  plain = make(None)
  params, plain_state = plain.init(jax.random.PRNGKey(1), x)
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
  ref = reference_gram(plain_loss, params, x)

  def plain_local(params, x):
    return jax.value_and_grad(plain_loss)(params, x)[1]
  plain_step = jax.jit(jax.shard_map(plain_local, mesh=mesh,
                                     in_specs=(P(), P("data")),
                                     out_specs=P()))
  baseline = _compiled_stats(plain_step, params, x)
  out = {}
  for mode in ("norms", "gram"):
    tracked = make(mode)
    _, state = tracked.init(jax.random.PRNGKey(1), x)

    def local(params, state, x, tracked=tracked):
      _, grads, grams = gram_haiku.value_grad_and_gram(
          tracked.apply, mesh_axes="data")(params, state, None, x)
      return grads, grams.sq_norms
    step = jax.jit(jax.shard_map(local, mesh=mesh,
                                 in_specs=(P(), P(), P("data")),
                                 out_specs=(P(), P("data"))))
    grads, sq_norms = step(params, state, x)
    assert_gram_close(sq_norms, np.diag(ref))
    _assert_grads(grads, jax.grad(plain_loss)(params, x), 1e-4)
    got = _compiled_stats(step, params, state, x)
    assert got["all-reduce"] == baseline["all-reduce"], (
        f"{mode}: all-reduces {got['all-reduce']} differ from the plain "
        f"step's {baseline['all-reduce']}")
    for kind in ("reduce-scatter", "all-to-all", "collective-permute"):
      assert got[kind]["count"] == 0, (mode, kind, got[kind])
    gathered = got["all-gather"]["bytes"]
    if mode == "norms":
      assert gathered == 0, f"norms mode gathers {gathered} bytes"
    else:
      expected = collectives.mlp_formula(B, [6, 12, 12, 3], N_DEVICES)
      received = gathered * (N_DEVICES - 1) // N_DEVICES
      assert received == expected, (received, expected)
    out[mode] = got
  return {"collectives": out, "plain": baseline}


def case_jit(axis_type_name, entry_name):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from tests import layer_zoo  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import assert_gram_close  # pylint: disable=g-import-not-at-top

  entry = layer_zoo.BY_NAME[entry_name]
  tracked, x, params, state, ref, grads, plain_loss = _problem(entry,
                                                               "explicit")
  axis_type = getattr(jax.sharding.AxisType, axis_type_name)
  mesh = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(axis_type,))
  set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
  with set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    _, got_grads, grams = _tracked_or_skip(
        lambda: jax.jit(gram_haiku.value_grad_and_gram(tracked.apply))(
            params, state, None, xs),
        lambda: jax.jit(jax.grad(plain_loss))(params, xs))
  assert_gram_close(grams.total, ref, rtol=_tolerance(entry))
  _assert_grads(got_grads, grads, _tolerance(entry))
  spec = getattr(grams.total.sharding, "spec", None)
  if axis_type_name == "Explicit":
    assert tuple(spec) == ("data", None), f"Gram sharded as {spec}"
  return {"spec": str(spec)}


def case_gru_step_explicit():
  """One tracked ``hk.GRU`` step under a mesh with an Explicit axis: the
  inputs' rows sharded over the examples, the state replicated (its
  initial state). The layer joins the two in one array; that
  concatenation failed (ShardingTypeError) where ``hk.GRU``'s sum of two
  products runs. The Gram is the float64 one's, laid out by rows."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import assert_gram_close  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import per_example_grads  # pylint: disable=g-import-not-at-top

  def make(tracked):
    def loss(x):
      core = hk.GRU(4, name="gru")
      state = core.initial_state(x.shape[0])
      if tracked:
        with gram_haiku.track():
          out, _ = core(x, state)
      else:
        out, _ = core(x, state)
      return jnp.sum(jnp.tanh(out) ** 2)
    return hk.transform_with_state(loss)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 3))
  plain, tracked = make(False), make(True)
  params, plain_state = plain.init(jax.random.PRNGKey(1), x)
  _, state = tracked.init(jax.random.PRNGKey(1), x)
  f = np.asarray(per_example_grads(
      lambda p, x: plain.apply(p, plain_state, None, x)[0], params, x),
                 np.float64)
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
  with set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(tracked.apply))(
        params, state, None, xs)
  assert_gram_close(grams.total, f @ f.T)
  spec = getattr(grams.total.sharding, "spec", None)
  assert tuple(spec) == ("data", None), f"Gram sharded as {spec}"
  return {}


def case_jit_mixed_modes():
  """Explicit mesh, a full-Gram layer and a norms-only one: each result is
  laid out by rows like the examples (``P("data", None)``, ``P("data")``)."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import assert_gram_close  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import per_example_grads  # pylint: disable=g-import-not-at-top

  def make(tracked):
    def loss(x):
      ctx = gram_haiku.track if tracked else (lambda **_: _nullcontext())
      with ctx(mode="gram"):
        h = jnp.tanh(hk.Linear(8, name="full")(x))
      with ctx(mode="norms"):
        out = hk.Linear(3, name="diag")(h)
      return 0.5 * jnp.sum(jnp.tanh(out) ** 2)
    return hk.transform_with_state(loss)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 5))
  plain = make(False)
  params, plain_state = plain.init(jax.random.PRNGKey(1), x)
  _, state = make(True).init(jax.random.PRNGKey(1), x)
  f = per_example_grads(lambda p, x: plain.apply(p, plain_state, None, x)[0],
                        params, x)
  sizes = {k: sum(np.size(v) for v in params[k].values()) for k in params}
  full = np.asarray(f[:, :sizes["diag"]])  # params sorted: diag, full
  cut = sizes["diag"]
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
  with set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    _, _, grams = _tracked_or_skip(
        lambda: jax.jit(gram_haiku.value_grad_and_gram(make(True).apply))(
            params, state, None, xs),
        lambda: jax.jit(jax.grad(plain_loss))(params, xs))
  f_full = np.asarray(f[:, cut:], np.float64)
  assert_gram_close(grams.by_layer["full"], f_full @ f_full.T)
  assert_gram_close(grams.sq_norms_by_layer["diag"],
                    np.sum(np.asarray(full, np.float64) ** 2, axis=1))
  specs = {"full": tuple(grams.by_layer["full"].sharding.spec),
           "diag": tuple(grams.sq_norms_by_layer["diag"].sharding.spec)}
  assert specs["full"] == ("data", None), specs
  assert specs["diag"] == ("data",), specs
  return {"specs": str(specs)}


def case_errors():
  """A missing or unbound ``mesh_axes``, or a raw probe whose rows are split
  over several axes, is a teaching error."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top

  make, x = _mlp_norms_problem()
  tracked = make("gram")
  params, state = tracked.init(jax.random.PRNGKey(1), x)
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))

  def local(params, state, x):
    return gram_haiku.value_grad_and_gram(tracked.apply)(
        params, state, None, x)[2].total
  try:
    jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                          out_specs=P("data", None)))(params, state, x)
  except ValueError as e:
    text = str(e)
    assert "mesh_axes='data'" in text and "mlp/~/linear_0" in text, text
  else:
    raise AssertionError("no error without mesh_axes inside shard_map")
  # Raw path, rows split over two axes: their order is unknown, so an error.
  mesh2 = jax.make_mesh((4, 2), ("a", "b"),
                        axis_types=(jax.sharding.AxisType.Auto,) * 2)
  w = jax.random.normal(jax.random.PRNGKey(2), (6, 3))

  def raw(probe, x):
    return jax.grad(lambda q: jnp.sum(gram_haiku.ops.gram_linear(
        x, w, None, q, name="raw") ** 2))(probe)
  try:
    jax.jit(jax.shard_map(
        raw, mesh=mesh2, in_specs=(P(("a", "b"), None), P(("a", "b"))),
        out_specs=P(("a", "b"), None)))(jnp.zeros((B, B)), x)
  except ValueError as e:
    assert "several mesh axes" in str(e) and "'raw'" in str(e), str(e)
  else:
    raise AssertionError("no error for a raw probe over two mesh axes")
  try:
    gram_haiku.value_grad_and_gram(tracked.apply, mesh_axes="data")(
        params, state, None, x)
  except ValueError as e:
    assert "not bound" in str(e) and "shard_map" in str(e), str(e)
  else:
    raise AssertionError("no error for mesh_axes outside shard_map")
  # mesh_axes with a replicated batch: every device would count the same
  # examples again.
  def claimed(params, state, x):
    return gram_haiku.value_grad_and_gram(tracked.apply, mesh_axes="data")(
        params, state, None, x)[2].total
  try:
    jax.jit(jax.shard_map(claimed, mesh=mesh, in_specs=(P(), P(), P()),
                          out_specs=P("data", None)))(params, state, x)
  except ValueError as e:
    assert "no batch input varies" in str(e) and str(tuple(x.shape)) in str(
        e), str(e)
  else:
    raise AssertionError("no error for mesh_axes with a replicated batch")
  # An Explicit mesh without jax.set_mesh: ours, not JAX's reshard error.
  # Under an Auto mesh nothing needs to be set.
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  for mode in ("gram", "norms"):
    f = make(mode)
    p, st = f.init(jax.random.PRNGKey(1), x)
    explicit = jax.make_mesh((N_DEVICES,), ("data",),
                             axis_types=(jax.sharding.AxisType.Explicit,))
    xs = jax.device_put(x, NamedSharding(explicit, P("data")))
    try:
      jax.jit(gram_haiku.value_grad_and_gram(f.apply))(p, st, None, xs)
    except ValueError as e:
      assert "jax.set_mesh" in str(e) and str(tuple(x.shape)) in str(e), (
          mode, str(e))
    else:
      raise AssertionError(f"no error for an Explicit mesh without "
                           f"jax.set_mesh ({mode})")
  xa = jax.device_put(x, NamedSharding(mesh, P("data")))
  got = jax.jit(gram_haiku.value_grad_and_gram(tracked.apply))(
      params, state, None, xa)[2].total
  want = jax.jit(gram_haiku.value_grad_and_gram(tracked.apply))(
      params, state, None, x)[2].total
  err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
  assert err < 1e-5, f"Auto mesh without set_mesh: rel. err. {err}"
  return {}


def _mesh_problem():
  """A two-layer model with an aux output, a state entry that differs per
  device, and an unbatched memory argument; its untracked twin."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top

  def make(tracked):
    def f(x, memory):  # x: (B, 4); memory: (3, 4), read by every example.
      hk.set_state("seen", jnp.sum(jax.lax.stop_gradient(x)))
      with (gram_haiku.track() if tracked else _nullcontext()):
        h = jnp.tanh(hk.Linear(5)(x + memory.mean(0)))
        out = hk.Linear(3)(h)
      return 0.5 * jnp.sum(out ** 2), out
    return hk.transform_with_state(f)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 4))
  memory = jax.random.normal(jax.random.PRNGKey(3), (3, 4))
  plain = make(False)
  params, plain_state = plain.init(jax.random.PRNGKey(1), x, memory)
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x, memory)[0][0]
  tracked = make(True)
  _, state = tracked.init(jax.random.PRNGKey(1), x, memory)
  return tracked, params, state, x, memory, plain_loss


def case_mesh_argument():
  """``mesh=`` on every transform, a 2-D split in the order that is not the
  mesh's: global Grams, weights and norms equal to the single-device
  reference; ``aux`` and the per-device state with a leading device axis in
  ``mesh_axes`` order; replicated state entries as given."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core import reference  # pylint: disable=g-import-not-at-top

  tracked, params, state, x, memory, plain_loss = _mesh_problem()
  f = np.asarray(reference.per_example_grads(plain_loss, params, x),
                 np.float64)
  ref = f @ f.T
  norms = np.sqrt(np.diag(ref))
  mesh = jax.make_mesh((4, 2), ("a", "b"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  grads_ref = jax.jit(jax.grad(plain_loss))(params, x)
  # Not the mesh's order ("a", "b", the shard_map_2d cases').
  axes = ("b", "a")
  # Entry k of a per-device output is the device that holds examples
  # [2k, 2k + 2) (its index over `axes`, in this order).
  (value, new_state), grads, grams = jax.jit(gram_haiku.value_grad_and_gram(
      tracked.apply, has_aux=True, return_state=True, mesh=mesh,
      mesh_axes=axes, example_axes=(0, None)))(
          params, state, None, x, memory)
  loss, aux = value
  assert loss.shape == (8,) and aux.shape == (8, 2, 3), (loss.shape,
                                                          aux.shape)
  reference.assert_gram_close(grams.total, ref)
  assert grams.mesh_axes == ()
  np.testing.assert_allclose(grams.norms, norms, rtol=1e-5)
  _assert_grads(grads, grads_ref, 1e-5)
  np.testing.assert_allclose(float(loss.sum()), float(plain_loss(params, x)),
                             rtol=1e-5)
  want_seen = np.asarray(x).reshape(8, 2, 4).sum((1, 2))
  np.testing.assert_allclose(new_state["~"]["seen"], want_seen, rtol=1e-5)
  np.testing.assert_array_equal(
      jax.tree.leaves(new_state["linear"]), jax.tree.leaves(state["linear"]))

  _, grads, grams, c = jax.jit(gram_haiku.reweighted_grad(
      tracked.apply, lambda g: 1.0 / (1.0 + g.norms), has_aux=True,
      mesh=mesh, mesh_axes=axes, example_axes=(0, None)))(
          params, state, None, x, memory)
  want_c = 1.0 / (1.0 + norms)
  np.testing.assert_allclose(c, want_c, rtol=1e-5)
  _assert_grads(grads, reference.weighted_sum(f, want_c, params), 1e-5)

  c_norm = float(np.median(norms))
  pad = np.arange(B) >= B - 3
  clipped = gram_haiku.clipped_grad(
      tracked.apply, c_norm, has_aux=True, mesh=mesh, mesh_axes=axes,
      example_axes=(0, None))
  grads, caux = jax.jit(clipped)(params, state, None, x, memory,
                                 is_padding_example=jnp.asarray(pad))
  weights = reference.clip_reference(norms, c_norm) * ~pad
  _assert_grads(grads, reference.weighted_sum(f, weights, params), 1e-5)
  np.testing.assert_allclose(caux.grad_norms, norms, rtol=1e-5)
  for w in caux.weights.values():
    np.testing.assert_allclose(w, weights, rtol=1e-5)
  want_fraction = np.sum((norms > c_norm) & ~pad) / np.sum(~pad)
  np.testing.assert_allclose(caux.fraction_clipped, want_fraction,
                             rtol=1e-6)
  return {}


def case_reparam_mesh(blocked: bool = False):
  """Reparametrised layers (a weight-norm getter, LoRA, a conv's weight
  mask) under ``mesh=``: the getter's equations replayed for each device's
  examples equal the single-device reference (Gram and clipped sum); a
  getter with a custom derivative is a clear error. ``blocked``: the
  weight norm alone, pulled back as on an accelerator (vectorised over
  blocks of examples, forced on the CPU), one of each device's 2 examples
  a block (a small memory budget)."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core import reference  # pylint: disable=g-import-not-at-top
  from tests import problems  # pylint: disable=g-import-not-at-top

  @jax.custom_vjp
  def doubled(w):
    return w
  doubled.defvjp(lambda w: (w, None), lambda _, g: (2.0 * g,))
  # (Four input channels: a closed-over array with an axis of the local
  # batch's size, 2 here, is refused under clipped_grad as data of unknown
  # examples; see example_flow.)
  mask = np.random.default_rng(0).choice([0.0, 1.0, 0.5], (3, 3, 4, 3))
  getters = {
      "weight_norm": lambda n, v, c: (n(v) / jnp.linalg.norm(n(v), axis=0)
                                      if c.name == "w" else n(v)),
      "lora": problems.lora,
      "conv_mask": None,
      "custom_vjp": lambda n, v, c: doubled(n(v)) if c.name == "w" else n(v),
  }
  opts = {}
  if blocked:
    getters = {"weight_norm": getters["weight_norm"]}
    opts = {"memory_budget_bytes": 1000}  # (876 bytes an example)
  mesh = jax.make_mesh((N_DEVICES,), ("d",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 5, 5, 4))
  y = jax.random.normal(jax.random.PRNGKey(1), (B, 2))
  for name, getter in getters.items():
    def model(x, y, name=name, getter=getter):
      if name == "conv_mask":
        h = hk.Conv2D(3, 3, mask=mask)(x)
      elif name == "lora":
        h = hk.Conv2D(3, 3)(x)
      else:
        with hk.custom_getter(getter):
          h = hk.Conv2D(3, 3)(x)
      h = jnp.tanh(h).reshape(h.shape[0], -1)
      if name == "lora":  # On the head's [N, M] weight.
        with hk.custom_getter(getter):
          return 0.5 * jnp.sum((hk.Linear(2)(h) - y) ** 2)
      out = hk.Linear(2)(h)
      return 0.5 * jnp.sum((out - y) ** 2)

    def tracked(x, y, model=model):
      with gram_haiku.track(**opts):
        return model(x, y)
    f = hk.transform_with_state(tracked)
    params, state = f.init(jax.random.PRNGKey(2), x, y)
    plain = hk.without_apply_rng(hk.transform(model)).apply
    step = jax.jit(gram_haiku.value_grad_and_gram(f.apply, mesh=mesh,
                                                  mesh_axes=("d",)))
    if name == "custom_vjp":
      try:
        step(params, state, None, x, y)
      except NotImplementedError as e:
        assert "custom derivative" in str(e), str(e)
        continue
      raise AssertionError("custom_vjp getter under mesh=: no error")
    fr = np.asarray(reference.per_example_grads(plain, params, x, y),
                    np.float64)
    _, _, grams = step(params, state, None, x, y)
    reference.assert_gram_close(grams.total, fr @ fr.T)
    norms = np.sqrt(np.sum(fr * fr, 1))
    c_norm = float(np.median(norms))
    grads, aux = jax.jit(gram_haiku.clipped_grad(
        f.apply, c_norm, mesh=mesh, mesh_axes=("d",)))(params, state, None,
                                                       x, y)
    reference.assert_sound_norms(aux.grad_norms, norms)
    _assert_grads(grads, reference.weighted_sum(
        fr, reference.clip_reference(aux.grad_norms, c_norm), params), 1e-4)
  return {}


def case_reparam_mesh_blocked():
  """:func:`case_reparam_mesh` pulled back in blocks on the CPU."""
  from gram_haiku._src.analysis import reparam  # pylint: disable=g-import-not-at-top
  reparam.BLOCKED_ON_CPU = True
  try:
    return case_reparam_mesh(blocked=True)
  finally:
    reparam.BLOCKED_ON_CPU = False


def case_fused_rule_sharded():
  """A third party's rule with only the fused form
  (``probe_cotangent_and_grads``) and ``sharding_aware=False`` (a FiLM-like
  gain per feature): under ``shard_map`` its Gram comes from exact
  per-example gradients with gathered columns, equal to the reference
  (the fused function used to be called and return this device's (b, b)
  block only)."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core import reference  # pylint: disable=g-import-not-at-top

  def forward(x, gamma):
    return x * gamma

  def fused(x, g, params, example_dim, mode, wanted, cfg):
    del params, wanted, cfg
    f = jnp.moveaxis(x * g, example_dim, 0)
    f = f.reshape(f.shape[0], -1, f.shape[-1]).sum(1)  # [B, F]
    value = {"gram": lambda: f @ f.T, "norms": lambda: (f * f).sum(1)}.get(
        mode, lambda: f)()
    return value, {}
  rule = gram_haiku.Rule(forward=forward, param_names=("gamma",),
                         probe_cotangent_and_grads=fused)

  class Film(hk.Module):
    def __call__(self, x):
      gamma = hk.get_parameter("gamma", x.shape[-1:], init=jnp.ones)
      return forward(x, gamma)

  @gram_haiku.register_layer(Film)
  def _handler(call, module, x):  # pylint: disable=unused-variable
    gamma = hk.get_parameter("gamma", x.shape[-1:], init=jnp.ones)
    del module
    return call.apply(rule, x, (gamma,))

  def model(x):
    h = Film()(hk.Linear(4)(x))
    return 0.5 * jnp.sum(jnp.tanh(h) ** 2)

  def tracked(x):
    with gram_haiku.track():
      return model(x)
  f = hk.transform_with_state(tracked)
  x = jax.random.normal(jax.random.PRNGKey(0), (B, 3, 5))
  params, state = f.init(jax.random.PRNGKey(1), x)
  plain = hk.without_apply_rng(hk.transform(model)).apply
  fr = np.asarray(reference.per_example_grads(plain, params, x), np.float64)
  mesh = jax.make_mesh((N_DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))

  def local(params, state, x):
    _, _, grams = gram_haiku.value_grad_and_gram(f.apply, mesh_axes="data")(
        params, state, None, x)
    return grams.total
  gram = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(),
                                                           P("data")),
                               out_specs=P("data", None)))(params, state, x)
  reference.assert_gram_close(gram, fr @ fr.T)
  return {}


def case_mesh_argument_errors():
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top

  tracked, params, state, x, memory, _ = _mesh_problem()
  mesh = jax.make_mesh((4, 2), ("a", "b"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def expect(run, *fragments):
    try:
      run()
    except ValueError as e:
      assert all(f in str(e) for f in fragments), (fragments, str(e))
    else:
      raise AssertionError(f"no error; expected {fragments}")
  for transform in (gram_haiku.value_grad_and_gram,
                    lambda f, **kw: gram_haiku.reweighted_grad(
                        f, lambda g: g.norms, **kw),
                    lambda f, **kw: gram_haiku.clipped_grad(f, 1.0, **kw)):
    expect(lambda t=transform: t(tracked.apply, mesh_axes=("a", "b")),
           "several mesh axes", "mesh=mesh")
    expect(lambda t=transform: t(tracked.apply, mesh=mesh,
                                 mesh_axes=("a", "c")), "['c']")
  step = gram_haiku.value_grad_and_gram(tracked.apply, has_aux=True,
                                        mesh=mesh, example_axes=(0, None))
  expect(lambda: step(params, state, None, x[:12], memory),
         "(12, 4)", "8 devices", "is_padding_example")

  def inside(params, state, x):
    return step(params, state, None, x, memory)[2].total
  inside_map = jax.shard_map(inside, mesh=mesh,
                             in_specs=(P(), P(), P(("a", "b"))),
                             out_specs=P(("a", "b")))
  expect(lambda: inside_map(params, state, x), "called inside shard_map")

  # An RNN whose zero initial state is not cast to varying: JAX refuses the
  # scan carry inside the shard_map that mesh= builds; the error says so.
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def rnn_loss(x):
    core = hk.GRU(3)
    with gram_haiku.track():
      out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1),
                                 core.initial_state(x.shape[0]))
    return jnp.sum(out ** 2)
  rnn = hk.transform_with_state(rnn_loss)
  xr = jax.random.normal(jax.random.PRNGKey(0), (8, 4, 3))
  rnn_params, rnn_state = rnn.init(jax.random.PRNGKey(1), xr)
  try:
    gram_haiku.value_grad_and_gram(rnn.apply, mesh=mesh)(
        rnn_params, rnn_state, None, xr)
  except TypeError as e:
    for fragment in ("gram_haiku.value_grad_and_gram(mesh=...",
                     "jax.lax.pcast(s, ('a', 'b'), to='varying')",
                     "JAX's error: scan body function carry"):
      assert fragment in str(e), (fragment, str(e))
  else:
    raise AssertionError("no error for an unvarying scan carry")
  return {}


def cases(everything: bool):
  from tests import layer_zoo  # pylint: disable=g-import-not-at-top
  out = []
  for entry in layer_zoo.ENTRIES:
    if entry.name in ALL_ONLY and not everything:
      continue
    styles = ["explicit"]
    if "vmap1" in entry.styles and (everything or
                                    entry.name in VMAP_ENTRIES):
      styles.append("vmap1")
    for style in styles:
      if style == "explicit" and not entry.explicit_ok:
        continue
      out.append((f"shard_map/{entry.name}/{style}",
                  lambda e=entry.name, s=style: case_shard_map(e, s)))
  # By default the 2-D mesh runs once, with the batch spec in the other
  # order than mesh_axes (the case that permuted columns); both orders and
  # the tied LM with --all.
  for name in (TWO_D_ENTRIES + ("tied-LM",)) if everything else ():
    out.append((f"shard_map_2d/{name}", lambda n=name: case_shard_map(
        n, "explicit", (4, 2), ("a", "b"))))
  out.append(("shard_map_2d/MLP/spec-order-b-a", lambda: case_shard_map(
      "MLP", "explicit", (4, 2), ("a", "b"), spec_axes=("b", "a"))))
  out.append(("jit/Explicit/mixed-modes", case_jit_mixed_modes))
  for core in ("GRU", "LSTM") if everything else ("GRU",):
    out.append((f"shard_map_rnn/{core}",
                lambda c=core: case_rnn_shard_map(c)))
  if everything:
    out.append(("no_check_vma/MLP", lambda: case_shard_map(
        "MLP", "explicit", check_vma=False)))
  out.append(("collectives", case_norms_and_collectives))
  # By default the MLP under an Auto mesh (the Explicit mesh's jit path:
  # jit/Explicit/mixed-modes and jit/Explicit/GRU-step).
  for axis_type in ("Auto", "Explicit") if everything else ("Auto",):
    for name in (JIT_ENTRIES + ("GRU-dynamic", "GRU-static",
                                "ResNet-GroupNorm")
                 if everything else JIT_ENTRIES[:1]):
      out.append((f"jit/{axis_type}/{name}",
                  lambda a=axis_type, n=name: case_jit(a, n)))
  out.append(("jit/Explicit/GRU-step", case_gru_step_explicit))
  out.append(("errors", case_errors))
  out.append(("mesh_argument/transforms", case_mesh_argument))
  out.append(("mesh_argument/errors", case_mesh_argument_errors))
  if everything:
    # (4.5 s by default before: mesh_argument/transforms runs the same
    # mesh= path, and tests/test_reparam.py the reparametrisation on one
    # device.)
    out.append(("mesh_argument/reparametrised", case_reparam_mesh))
    out.append(("mesh_argument/reparametrised/blocked",
                case_reparam_mesh_blocked))
  if everything:
    # (The fused rule under shard_map: shard_map/MLP/explicit runs the same
    # rows-and-columns path with the built-in rules, tests/test_rules.py
    # the fused rule on one device.)
    out.append(("fused_rule/shard_map", case_fused_rule_sharded))
  out.append(("cross_gram/MLP", case_cross_gram))
  out.append(("loose_gram/linear", case_loose_gram))
  # The tied LM clipped, and per-layer clipping, with --all
  # (clipped/all-layer/MLP runs the same clipped_grad(mesh_axes=) path;
  # per-layer clipping's split of the threshold is the single-device one
  # of tests/test_reweight.py).
  for clipping in ("all-layer", "per-layer") if everything else (
      "all-layer",):
    for name in ("MLP", "tied-LM") if everything else ("MLP",):
      out.append((f"clipped/{clipping}/{name}",
                   lambda c=clipping, n=name: case_clipped(c, n)))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", required=True)
  parser.add_argument("--all", action="store_true",
                      help="every batching style of every zoo entry")
  parser.add_argument("--only", default="", help="substring of case names")
  args = parser.parse_args(argv)
  _setup()
  records = []
  for name, run in cases(args.all):
    if args.only and args.only not in name:
      continue
    rec = {"case": name}
    start = time.perf_counter()
    try:
      rec.update(run() or {})
      rec["status"] = "pass"
    except Skip as e:
      rec["status"] = "skip"
      rec["reason"] = str(e)
    except Exception as e:  # pylint: disable=broad-except
      rec.update(sharded.failure_record(e))
    rec["seconds"] = round(time.perf_counter() - start, 2)
    records.append(rec)
  with open(args.json, "w") as f:
    json.dump(records, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
