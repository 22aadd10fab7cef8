"""Where a step's device time goes: XLA's profiler, op by op.

``python -m benchmarks.profile --model gpt --scale full --batch 16
--method plain,dp_all,gram --out DIR``

For each method of one model of the ``real`` suite
(:mod:`benchmarks.realistic`), the step is compiled once, run a few times
to warm up, then ``--steps`` times under :func:`jax.profiler.trace`. The
trace's device planes (``/device:...``; a CPU has none, and its host
threads' XLA events are used instead) are read with
:class:`jax.profiler.ProfileData`, and each op's time is summed over the
steps and divided by their number: the device time per step of every HLO
op (a fusion, a copy, a loop...). Written to ``DIR/profile.json`` with
the compiled HLO of each method (``DIR/<model>_<method>.hlo.txt``, to read
what a fusion holds), and the ``--top`` most costly ops printed per
method, with the share of the step each takes.

``--loose_inf``: diagnostics only, the ghost norms' run-time fallback
never taken (:data:`gram_haiku._src.compute.norm_bounds.LOOSE` set to infinity);
its clip factors are then NOT sound, and the numbers only say what the
fallback costs.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile
import time

import jax

from benchmarks import jax_methods
from benchmarks import realistic


def _events(path: str):
  """``(name, duration_ns)`` of every XLA op event in the trace at
  ``path``: the device planes' where there are any, else the host's."""
  data = jax.profiler.ProfileData.from_file(path)
  device = [p for p in data.planes if p.name.startswith("/device:")]
  out = []
  for plane in device:
    for line in plane.lines:
      if line.name in ("XLA Ops",):
        out.extend((e.name, e.duration_ns) for e in line.events)
  if out or device:
    return out
  for plane in data.planes:
    for line in plane.lines:
      if line.name.startswith("tf_XLA") or "XLA" in line.name:
        out.extend((e.name, e.duration_ns) for e in line.events)
  return out


def profile_step(step, args, steps: int, log=print) -> dict:
  """Per-op device time (ns per step) of ``jax.jit(step)(*args)``."""
  t0 = time.perf_counter()
  compiled = jax.jit(step).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  for _ in range(3):
    jax.block_until_ready(compiled(*args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(steps):
        jax.block_until_ready(compiled(*args))
    paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    events = _events(paths[0]) if paths else []
  per_op = collections.Counter()
  counts = collections.Counter()
  for name, ns in events:
    per_op[name] += ns / steps
    counts[name] += 1
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem else None
  return {"compile_s": compile_s, "total_ns": float(sum(per_op.values())),
          "temp_bytes": temp,
          "ops": [{"name": n, "ns": float(t), "calls": counts[n] / steps}
                  for n, t in per_op.most_common()],
          "hlo": compiled.as_text()}


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="gpt", choices=sorted(
      realistic.SCALES["full"]))
  p.add_argument("--scale", default="smoke", choices=realistic.SCALE_NAMES)
  p.add_argument("--batch", type=int, default=None,
                 help="batch size (default: the scale's first)")
  p.add_argument("--method", default="plain,dp_all,gram")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--gram_precision", default="highest")
  p.add_argument("--loose_inf", action="store_true")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  if a.loose_inf:
    from gram_haiku._src.compute import norm_bounds  # pylint: disable=g-import-not-at-top
    norm_bounds.LOOSE = float("inf")
  b = a.batch or realistic.SCALES[a.scale][a.model][1][0]
  prep = jax_methods.prepare(realistic.make(a.model, a.scale, b),
                             gram_precision=a.gram_precision)
  print(f"{a.model} ({prep.bench.description}), B = {b}, "
        f"{jax.devices()[0].device_kind}")
  results = {}
  for method in a.method.split(","):
    step, args = realistic.build(prep, method)
    r = profile_step(step, args, a.steps)
    hlo = r.pop("hlo")
    if a.out:
      os.makedirs(a.out, exist_ok=True)
      with open(os.path.join(a.out, f"{a.model}_{method}.hlo.txt"),
                "w") as f:
        f.write(hlo)
    results[method] = r
    total = r["total_ns"] or 1.0
    temp = r["temp_bytes"]
    print(f"\n{method}: {total / 1e6:.2f} ms of ops per step "
          f"(compiled in {r['compile_s']:.0f} s; temp "
          f"{(temp or 0) / 2**20:.0f} MiB)")
    for op in r["ops"][:a.top]:
      print(f"  {op['ns'] / 1e3:9.1f} us {100 * op['ns'] / total:5.1f}%  "
            f"x{op['calls']:<5g} {op['name']}")
  if a.out:
    with open(os.path.join(a.out, "profile.json"), "w") as f:
      json.dump({"model": a.model, "scale": a.scale, "batch": b,
                 "device": jax.devices()[0].device_kind,
                 "loose_inf": a.loose_inf,
                 "gram_precision": a.gram_precision,
                 "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
