"""One process of the 2-process test (``tests/test_distributed.py``).

``python -m tests.multiprocess_worker --process-id I --num-processes 2
--port P --json OUT`` joins JAX's distributed runtime on loopback
(``jax.distributed.initialize``; CPU backend, 4 devices per process, gloo
collectives), splits a batch of 16 examples over all 8 devices and computes
the Gram and the gradients of a small model (MLP with a shared layer and a
LayerNorm) three ways:

* ``shard_map`` with ``value_grad_and_gram(mesh_axes="data")``;
* ``jit`` with the batch placed by ``NamedSharding`` (Auto axes);
* on this process's first device alone, untracked: the reference
  ``F @ F.T`` and ``jax.grad``.

It writes the largest relative differences to ``OUT``; the test asserts on
them. Every process computes the same thing (JAX's multi-controller model)
and reads the sharded results back with ``process_allgather``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from gram_haiku.conformance import runner

B = 16
DEVICES_PER_PROCESS = 4


def _model(tracked: bool):
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top

  def loss(x, y):
    with (gram_haiku.track() if tracked else contextlib.nullcontext()):
      h = jax.nn.relu(hk.Linear(16)(x))
      shared = hk.Linear(16, name="shared")
      h = jnp.tanh(shared(jnp.tanh(shared(h))))
      h = hk.LayerNorm(-1, True, True)(h)
      out = hk.Linear(5)(h)
    logp = jax.nn.log_softmax(out)
    return -jnp.sum(jnp.take_along_axis(logp, y[:, None], axis=1))
  return hk.transform_with_state(loss)


def run(process_id: int, num_processes: int, port: int) -> dict:
  """Joins the cluster, computes, returns the maximum relative errors."""
  runner.strip_device_count_flag(os.environ)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=num_processes,
                             process_id=process_id,
                             initialization_timeout=120)
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core.reference import reference_gram  # pylint: disable=g-import-not-at-top

  n = len(jax.devices())
  assert n == num_processes * DEVICES_PER_PROCESS, jax.devices()
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (B, 8)))
  y = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (B,), 0, 5))
  tracked, plain = _model(True), _model(False)
  local = jax.local_devices()[0]
  with jax.default_device(local):
    params, state = tracked.init(jax.random.PRNGKey(2), x, y)
    _, plain_state = plain.init(jax.random.PRNGKey(2), x, y)
    plain_loss = lambda p, x, y: plain.apply(p, plain_state, None, x, y)[0]
    ref = reference_gram(plain_loss, params, x, y)
    ref_grads = jax.jit(jax.grad(plain_loss))(params, x, y)
  params = jax.tree.map(np.asarray, params)
  state = jax.tree.map(np.asarray, state)

  mesh = jax.make_mesh((n,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  batch = NamedSharding(mesh, P("data"))
  xs = jax.make_array_from_callback(x.shape, batch, lambda i: x[i])
  ys = jax.make_array_from_callback(y.shape, batch, lambda i: y[i])
  replicated = NamedSharding(mesh, P())
  params_g = jax.tree.map(
      lambda a: jax.make_array_from_callback(a.shape, replicated,
                                             lambda i, a=a: a[i]), params)
  state_g = jax.tree.map(
      lambda a: jax.make_array_from_callback(a.shape, replicated,
                                             lambda i, a=a: a[i]), state)

  def shard_local(params, state, x, y):
    _, grads, grams = gram_haiku.value_grad_and_gram(
        tracked.apply, mesh_axes="data")(params, state, None, x, y)
    return grads, grams.total
  sm = jax.jit(jax.shard_map(
      shard_local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
      out_specs=(P(), P("data", None))))
  with jax.sharding.use_mesh(mesh) if not hasattr(jax, "set_mesh") else (
      jax.set_mesh(mesh)):
    jit_out = jax.jit(gram_haiku.value_grad_and_gram(tracked.apply))(
        params_g, state_g, None, xs, ys)
  results = {"shard_map": sm(params_g, state_g, xs, ys),
             "jit_auto": (jit_out[1], jit_out[2].total)}

  scale_g = max(float(np.abs(np.asarray(g)).max())
                for g in jax.tree.leaves(ref_grads))
  out = {"process_id": process_id, "devices": n,
         "local_devices": len(jax.local_devices())}
  for name, (grads, total) in results.items():
    total = np.asarray(multihost_utils.process_allgather(total, tiled=True),
                       np.float64)
    grads = jax.tree.map(lambda g: np.asarray(g.addressable_data(0)), grads)
    out[name] = {
        "gram_rel_err": float(np.abs(total - ref).max() / np.abs(ref).max()),
        "grad_rel_err": max(
            float(np.abs(g - np.asarray(r)).max()) / scale_g
            for g, r in zip(jax.tree.leaves(grads),
                            jax.tree.leaves(ref_grads))),
        "gram_shape": list(total.shape)}
  jax.distributed.shutdown()
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, default=2)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--json", required=True)
  args = parser.parse_args(argv)
  out = run(args.process_id, args.num_processes, args.port)
  with open(args.json, "w") as f:
    json.dump(out, f)
  return 0


if __name__ == "__main__":
  sys.exit(main())
