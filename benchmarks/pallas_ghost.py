"""The Pallas ghost Gram and ghost norms against the XLA path, per layer.

``python -m benchmarks.pallas_ghost --out DIR``

Times, on whatever backend is present, for the sequence ghost Gram (1) of
:mod:`gram_haiku._src.compute.kernels` and its diagonal:

* the XLA path, :func:`kernels.ghost_gram` and :func:`kernels.ghost_sq_norms`
  with a :class:`kernels.KernelConfig` of the default memory budget, at
  precision ``DEFAULT`` and ``HIGHEST``;
* the Pallas kernels, :func:`pallas_ghost.ghost_gram_pallas` and
  :func:`pallas_ghost.ghost_sq_norms_pallas`, at the same two precisions;

at the shapes of a ViT-S/4 layer (``B=128, T=65, N=384``, ``M=384`` and
``1536``), a GPT-style layer (``B=16, T=256, N=768``, ``M=768`` and
``3072``) and a longer sequence (``B=8, T=1024, N=M=512``), float32 inputs.
Each time is the wall time of one jitted call with ``block_until_ready``,
the median of ``--calls`` calls after two warm-up calls (the calls take
milliseconds, so dispatch adds little). The error of each result is its
largest difference from the XLA ``HIGHEST`` result, relative to that
result's largest entry. Writes ``DIR/pallas_ghost.json`` and prints a table.

Off a TPU, the Pallas kernels run in interpret mode, which is only meant for
correctness: there the script runs one tiny shape (``--smoke`` forces that
on any backend), so that it can be tested on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import pallas_ghost

#: (name, B, T, N, M) of the layers measured on a TPU.
SHAPES = (
    ("vit_s4_qkvo", 128, 65, 384, 384),
    ("vit_s4_mlp", 128, 65, 384, 1536),
    ("gpt_attn", 16, 256, 768, 768),
    ("gpt_mlp", 16, 256, 768, 3072),
    ("long_t", 8, 1024, 512, 512),
)

#: The shape run off a TPU (interpret mode) or with ``--smoke``.
SMOKE_SHAPES = (("smoke", 5, 7, 33, 17),)

PRECISIONS = (("default", lax.Precision.DEFAULT),
              ("highest", lax.Precision.HIGHEST))


def _time_s(fn: Callable[[], object], calls: int) -> float:
  jax.block_until_ready(fn())
  jax.block_until_ready(fn())
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _rel(a, ref) -> float:
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  scale = max(float(np.max(np.abs(ref))), 1e-30)
  return float(np.max(np.abs(a - ref))) / scale


def methods(interpret: bool):
  """``{name: (gram_fn, norms_fn)}`` for each path and precision."""
  out = {}
  for pname, p in PRECISIONS:
    cfg = kernels.KernelConfig(precision=p)
    out[f"xla_{pname}"] = (
        jax.jit(lambda x, d, cfg=cfg: kernels.ghost_gram(x, d, cfg)),
        jax.jit(lambda x, d, cfg=cfg: kernels.ghost_sq_norms(x, d, cfg)))
    out[f"pallas_{pname}"] = (
        jax.jit(lambda x, d, p=p: pallas_ghost.ghost_gram_pallas(
            x, d, precision=p, interpret=interpret)),
        jax.jit(lambda x, d, p=p: pallas_ghost.ghost_sq_norms_pallas(
            x, d, precision=p, interpret=interpret)))
  return out


def measure(shapes=SHAPES, *, interpret: bool = False, calls: int = 10,
            seed: int = 0) -> list[dict]:
  """One row per (shape, method, output) with ``time_ms`` and ``rel_err``
  (against the XLA ``HIGHEST`` result of the same shape)."""
  rows = []
  fns = methods(interpret)
  for name, b, t, n, m in shapes:
    kx, kd = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (b, t, n), jnp.float32)
    d = jax.random.normal(kd, (b, t, m), jnp.float32)
    ref_g = fns["xla_highest"][0](x, d)
    ref_n = fns["xla_highest"][1](x, d)
    for method, (gram_fn, norms_fn) in fns.items():
      for output, fn, ref in (("gram", gram_fn, ref_g),
                              ("norms", norms_fn, ref_n)):
        row = dict(shape=name, B=b, T=t, N=n, M=m, method=method,
                   output=output)
        try:
          value = fn(x, d)
          row["rel_err"] = _rel(value, ref)
          row["time_ms"] = 1e3 * _time_s(lambda fn=fn: fn(x, d), calls)
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(_line(row), flush=True)
  return rows


def _line(row: dict) -> str:
  head = (f"{row['shape']:<12} {row['output']:<6} {row['method']:<15}")
  if "error" in row:
    return f"{head} ERROR {row['error']}"
  return f"{head} {row['time_ms']:10.3f} ms  rel_err {row['rel_err']:.2e}"


def table(rows: Sequence[dict]) -> str:
  """A markdown table: per shape and output, each method's time, its
  speed-up over the XLA path at the same precision, and its error."""
  lines = ["| layer (B, T, N, M) | output | method | time (ms) | vs XLA same "
           "precision | max rel. diff. vs XLA highest |",
           "|---|---|---|---|---|---|"]
  by = {(r["shape"], r["output"], r["method"]): r for r in rows}
  for r in rows:
    shape = f"{r['shape']} ({r['B']}, {r['T']}, {r['N']}, {r['M']})"
    if "error" in r:
      lines.append(f"| {shape} | {r['output']} | {r['method']} | error | | "
                   f"{r['error'][:80]} |")
      continue
    prec = r["method"].split("_")[1]
    xla = by.get((r["shape"], r["output"], f"xla_{prec}"), {})
    ratio = (f"{xla['time_ms'] / r['time_ms']:.2f}x"
             if "time_ms" in xla and r["method"].startswith("pallas")
             else "")
    lines.append(f"| {shape} | {r['output']} | {r['method']} | "
                 f"{r['time_ms']:.3f} | {ratio} | {r['rel_err']:.1e} |")
  return "\n".join(lines)


#: Shapes that are not tile multiples, several tiles, and bfloat16: checked
#: against a float64 reference with ``--check`` (compiled on a TPU).
CHECK_SHAPES = ((5, 7, 33, 17, "float32", {}),
                (5, 7, 33, 17, "bfloat16", {}),
                (20, 37, 40, 130, "float32",
                 dict(block_examples=8, block_positions=16)),
                (130, 9, 64, 64, "float32", {}),
                (3, 300, 16, 8, "float32", {}))


def check(interpret: bool) -> list[dict]:
  """Each of :data:`CHECK_SHAPES` at ``HIGHEST`` against float64 numpy:
  the largest difference relative to the largest entry."""
  rows = []
  rng = np.random.default_rng(0)
  for b, t, n, m, dtype, kw in CHECK_SHAPES:
    x = jnp.asarray(rng.standard_normal((b, t, n)), dtype)
    d = jnp.asarray(rng.standard_normal((b, t, m)), dtype)
    x64, d64 = np.asarray(x, np.float64), np.asarray(d, np.float64)
    ref = np.einsum("itjs,itjs->ij", np.einsum("itn,jsn->itjs", x64, x64),
                    np.einsum("itm,jsm->itjs", d64, d64))
    g = pallas_ghost.ghost_gram_pallas(x, d, precision=lax.Precision.HIGHEST,
                                       interpret=interpret, **kw)
    nrm = pallas_ghost.ghost_sq_norms_pallas(
        x, d, precision=lax.Precision.HIGHEST, interpret=interpret)
    row = dict(B=b, T=t, N=n, M=m, dtype=dtype, tiling=str(kw),
               gram_rel_err=_rel(g, ref),
               norms_rel_err=_rel(nrm, np.diag(ref)))
    print(row, flush=True)
    rows.append(row)
  return rows


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="bench_out",
                      help="folder for pallas_ghost.json")
  parser.add_argument("--calls", type=int, default=10,
                      help="timed calls per measurement (median)")
  parser.add_argument("--smoke", action="store_true",
                      help="only the tiny shape, in interpret mode off a TPU")
  parser.add_argument("--check", action="store_true",
                      help="also check odd shapes against float64 numpy")
  args = parser.parse_args(argv)
  backend = jax.default_backend()
  on_tpu = backend == "tpu"
  smoke = args.smoke or not on_tpu
  shapes = SMOKE_SHAPES if smoke else SHAPES
  checks = check(not on_tpu) if args.check else []
  rows = measure(shapes, interpret=not on_tpu,
                 calls=min(args.calls, 3) if not on_tpu else args.calls)
  device = jax.devices()[0]
  result = dict(
      backend=backend, device=getattr(device, "device_kind", str(device)),
      jax=jax.__version__, interpret=not on_tpu, smoke=smoke,
      timing=("wall time of a jitted call with block_until_ready, median "
              f"of {args.calls} after 2 warm-up calls"),
      date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
      rows=rows, checks=checks)
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "pallas_ghost.json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(f"\n{result['device']} ({backend}), jax {jax.__version__}, "
        f"{result['date']}\n")
  print(table(rows))
  print(f"\nwrote {path}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
