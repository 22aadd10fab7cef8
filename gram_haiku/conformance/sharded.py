"""Sharded vs single device: the Gram with the example axis split over a mesh.

Runs in its own process, because the CPU device count must be set before any
JAX backend starts: ``python -m gram_haiku.conformance.sharded --json OUT`` sets
``jax_num_cpu_devices=8``, then for every registered op, every layout and
every platform present computes the Gram sharded and on one device, and
writes one record per case to ``OUT`` (``--cases op:layout,...`` runs
only those pairs). ``conformance/test_sharded.py`` starts it once per pytest
session, for the (op, layout) pairs the session's budget kept, and turns
each record into a test.

Layouts (see the Distributed page of the documentation):

* ``jit_auto``: ``jit`` with the input ``NamedSharding(mesh, P("data"))``,
  mesh axis type Auto.
* ``jit_explicit``: the same with mesh axis type Explicit.
* ``shard_map``: ``shard_map`` with the example axis split over ``"data"``;
  each device returns its rows of the global Gram, ``f32[B_local, B]``,
  assembled with ``out_specs=P("data", None)``.

Each case also checks the parameter gradients against the single-device
ones. A case that fails where the untracked layer (``spec.plain``) fails
too under the layout, with the same exception type, in the installed JAX,
is recorded as skipped with JAX's error: no Gram op could do better than the
layer it tracks.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

LAYOUTS = ("jit_auto", "jit_explicit", "shard_map")
NUM_CPU_DEVICES = 8


def _configure():
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", NUM_CPU_DEVICES)
  # Compilation dominates these small cases, and XLA's optimisation passes
  # only reorder float work: without them the runner is about 1.7x faster.
  jax.config.update("jax_disable_most_optimizations", True)
  return jax


def _mesh_context(jax, mesh):
  """``jax.set_mesh`` (newer JAX) or ``jax.sharding.use_mesh`` (older)."""
  set_mesh = getattr(jax, "set_mesh", None)
  if set_mesh is not None:
    return set_mesh(mesh)
  return jax.sharding.use_mesh(mesh)


def run_case(spec, layout: str, devices) -> dict:
  """Sharded and single-device Grams and gradients of ``spec``.

  Raises on a mismatch. Returns ``{"status": "skip", "reason": ...}`` when
  the untracked layer (``spec.plain``) itself cannot run under the layout
  in this JAX release: then no Gram op could, and the case says so.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from gram_haiku.conformance import checks  # pylint: disable=g-import-not-at-top

  n = len(devices)
  b = 2 * n
  params, x = checks.make_problem(spec, (b, 3))

  def loss(params, probe, x):
    return checks._loss(spec.apply(params, probe, x))  # pylint: disable=protected-access

  def plain_loss(params, x):
    return checks._loss(spec.plain(params, x))  # pylint: disable=protected-access
  grad = jax.grad(loss, argnums=(0, 1))
  with jax.default_device(devices[0]):
    single = jax.jit(grad)(params, jnp.zeros((b, b)), x)
  axis_type = (jax.sharding.AxisType.Explicit if layout == "jit_explicit"
               else jax.sharding.AxisType.Auto)
  mesh = jax.make_mesh((n,), ("data",), axis_types=(axis_type,),
                       devices=devices)
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  probe = jnp.zeros((b, b))
  if layout in ("jit_auto", "jit_explicit"):
    with _mesh_context(jax, mesh):
      try:
        sharded = jax.jit(grad)(params, probe, xs)
      except Exception as tracked_error:  # pylint: disable=broad-except
        try:
          jax.jit(jax.grad(plain_loss))(params, xs)
        except Exception as e:  # pylint: disable=broad-except
          if type(e) is type(tracked_error):  # The same failure as JAX's.
            return {"status": "skip", "reason": (
                f"the untracked layer itself fails under {layout} in jax "
                f"{jax.__version__}: {type(e).__name__}: {e}")[:600]}
        raise
  else:
    def local(params, probe_rows, x_local):
      return grad(params, probe_rows, x_local)
    sharded = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P("data", None), P("data")),
        out_specs=(P(), P("data", None))))(
            params, jax.device_put(probe, NamedSharding(mesh, P("data", None))),
            xs)
  checks.assert_close(sharded[1], single[1], what=f"sharded Gram ({layout}) "
                      "vs single device")
  for k in single[0]:
    checks.assert_close(sharded[0][k], single[0][k],
                        what=f"gradient of {k!r} ({layout}) vs single device")
  return {"status": "pass",
          "sharding": str(getattr(sharded[1], "sharding", ""))}


def failure_record(error: Exception) -> dict:
  """``status``, ``error`` and ``traceback`` of a failed case (call it in
  the ``except`` block)."""
  return {"status": "fail",
          "error": f"{type(error).__name__}: {error}"[:3000],
          "traceback": traceback.format_exc()[-4000:]}


def parse_cases(text: str) -> set[tuple[str, str]]:
  """``"op:layout,..."`` -> ``{(op, layout), ...}``. Layouts hold no
  ``":"``; op names may (split at the last one)."""
  return {tuple(c.rsplit(":", 1)) for c in text.split(",") if c}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", required=True, help="output file")
  parser.add_argument("--ops", default="", help="comma-separated op names")
  parser.add_argument("--modules", default="", help="comma-separated "
                      "modules to import first: they register ops")
  parser.add_argument("--platforms", default="", help="comma-separated "
                      "platforms to run on (default: every one present); "
                      "one this process cannot open gets skip records")
  parser.add_argument("--cases", default="", help="comma-separated "
                      "op:layout pairs to run (default: every layout of "
                      "every selected op)")
  args = parser.parse_args(argv)
  jax = _configure()
  import importlib  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  sys.path.insert(0, os.getcwd())
  for module in filter(None, args.modules.split(",")):
    importlib.import_module(module)
  from gram_haiku.conformance import checks  # pylint: disable=g-import-not-at-top
  from gram_haiku.conformance.registry import registered_ops  # pylint: disable=g-import-not-at-top
  names = [n for n in args.ops.split(",") if n]
  pairs = parse_cases(args.cases)
  records = []
  wanted = [p for p in args.platforms.split(",") if p]
  for platform in wanted or checks.platforms_present():
    try:
      devices, why = jax.devices(platform), None
    except RuntimeError as e:
      # The test process may hold the platform's only device: a TPU chip
      # is open in one process at a time.
      devices, why = [], (
          f"this runner's own process cannot open platform {platform!r} "
          f"({str(e).splitlines()[0][:300]}); a TPU chip is held by one "
          "process at a time, so on a one-chip TPU run `python -m "
          "gram_haiku.conformance.sharded --json OUT` in a process of its own")
    for spec in registered_ops():
      if names and spec.name not in names:
        continue
      for layout in LAYOUTS:
        if pairs and (spec.name, layout) not in pairs:
          continue
        rec = {"op": spec.name, "layout": layout, "platform": platform,
               "devices": len(devices)}
        if why is not None:
          rec.update(status="skip", reason=why)
          records.append(rec)
          continue
        try:
          rec.update(run_case(spec, layout, devices))
        except Exception as e:  # pylint: disable=broad-except
          rec.update(failure_record(e))
        records.append(rec)
  with open(args.json, "w") as f:
    json.dump(records, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
