"""Wall time of the tracked steps of one ``real`` model under each forced
strategy (``auto``, ``ghost``, ``materialize``) and Gram precision: which
method a platform runs fastest, for the cost model.

``python -m benchmarks.strategy_probe --model vit --batch 64``
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np

from benchmarks import jax_methods
from benchmarks import realistic


def _wall_s(compiled, args, n: int = 10, reps: int = 3) -> float:
  """Median over ``reps`` of the mean wall time of ``n`` chained calls
  (dispatch overlaps the device's work; steps of milliseconds)."""
  jax.block_until_ready(compiled(*args))
  jax.block_until_ready(compiled(*args))
  out = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(n):
      r = compiled(*args)
    jax.block_until_ready(r)
    out.append((time.perf_counter() - t0) / n)
  return float(np.median(out))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--model", default="vit")
  p.add_argument("--scale", default="full")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--methods", default="plain,dp_all,dp_layer,gram")
  p.add_argument("--strategies", default="auto,ghost,materialize")
  p.add_argument("--precisions", default="highest")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  bench = realistic.make(a.model, a.scale, a.batch)
  rows = []
  for precision in a.precisions.split(","):
    for strategy in a.strategies.split(","):
      prep = jax_methods.prepare(bench, strategy=strategy,
                                 gram_precision=precision)
      for m in a.methods.split(","):
        if m == "plain" and (strategy, precision) != (
            a.strategies.split(",")[0], a.precisions.split(",")[0]):
          continue
        t0 = time.perf_counter()
        try:
          fn, args = jax_methods.build(prep, m)
          c = jax.jit(fn).lower(*args).compile()
          temp = c.memory_analysis().temp_size_in_bytes
          s = _wall_s(c, args)
          row = dict(method=m, strategy=strategy, precision=precision,
                     ms=s * 1e3, temp_mb=temp / 2**20)
        except Exception as e:  # pylint: disable=broad-except
          row = dict(method=m, strategy=strategy, precision=precision,
                     error=jax_methods.first_line(e))
        row["wall_s"] = time.perf_counter() - t0
        print(row, flush=True)
        rows.append(row)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(dict(model=a.model, batch=a.batch, rows=rows,
                     device=str(jax.devices()[0].device_kind)), f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
