"""What a sharded step communicates, read from its compiled HLO.

``python -m benchmarks.collectives`` compiles one data-parallel step of the
MLP (784-512-512-10 by default) inside ``jax.shard_map`` over ``n`` CPU
devices, three ways: plain ``jax.value_and_grad``, tracked with the full
Gram (``value_grad_and_gram(mesh_axes="data")``) and tracked with norms only
(``track(mode="norms")``). For each it counts the collectives of XLA's
optimised HLO and their bytes, and prints them next to the formula of the
docs' "Distributed" page: per device, the Gram's all-gathers receive

    (n - 1) / n * B * sum over layers of (T (N + M))      floats (ghost)
    (n - 1) / n * B * sum over layers of (N M + M)        floats (materialised)

and the all-reduce of the parameter gradients is the plain step's. Norms
gather nothing.

:func:`stats` is what the tests use: ``{kind: {"count", "bytes"}}`` where
``bytes`` is the size of each collective's result (for an all-gather,
``n`` times what one device sends).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
         "collective-permute")
_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
          "s64": 8, "u64": 8, "s8": 1, "u8": 1, "pred": 1, "s16": 2,
          "u16": 2}
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_INSTR = re.compile(r"\s*(?:ROOT )?%[\w.\-]+ = (.*?) ([a-z\-]+)\(")


def _result_bytes(result: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(result):
    if dtype not in _BYTES:
      continue
    total += _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def stats(hlo: str) -> dict[str, dict[str, int]]:
  """Count and result bytes of each collective kind in HLO text.

  An asynchronous pair (``all-gather-start``/``-done``) counts once, at its
  start; its result tuple holds the operand too, so only the last shape of
  the start's result is counted.
  """
  out = {k: {"count": 0, "bytes": 0} for k in KINDS}
  for line in hlo.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    result, op = m.group(1), m.group(2)
    kind = op[:-len("-start")] if op.endswith("-start") else op
    if kind not in out:
      continue
    if op.endswith("-start"):
      shapes = _SHAPE.findall(result)
      result = "{}[{}]".format(*shapes[-1]) if shapes else ""
    out[kind]["count"] += 1
    out[kind]["bytes"] += _result_bytes(result)
  return out


def mlp_formula(batch: int, sizes: list[int], n_devices: int,
                itemsize: int = 4) -> int:
  """Bytes one device receives for the MLP's Gram by the ghost method.

  Every Linear layer (``T = 1``) gathers its inputs and output cotangents,
  ``N + M`` numbers per example; the bias Gram reuses the gathered
  cotangents.
  """
  per_example = sum(n + m for n, m in zip(sizes[:-1], sizes[1:]))
  return (n_devices - 1) * (batch // n_devices) * per_example * itemsize


def _run(batch: int, sizes: list[int], n_devices: int) -> str:
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top

  def make(mode):
    def loss(x, y):
      mlp = hk.nets.MLP(sizes[1:])
      if mode is None:
        out = mlp(x)
      else:
        with gram_haiku.track(mode=mode):
          out = mlp(x)
      logp = jax.nn.log_softmax(out)
      return -jnp.sum(jnp.take_along_axis(logp, y[:, None], axis=1))
    return hk.transform_with_state(loss)

  mesh = jax.make_mesh((n_devices,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, sizes[0]))
  y = jax.random.randint(jax.random.PRNGKey(1), (batch,), 0, sizes[-1])
  rows = {}
  for name, mode in (("plain", None), ("gram", "gram"), ("norms", "norms")):
    f = make(mode)
    params, state = f.init(jax.random.PRNGKey(2), x[:1], y[:1])
    if mode is None:
      def local(params, state, x, y, f=f):
        (v, _), g = jax.value_and_grad(
            lambda p: f.apply(p, state, None, x, y), has_aux=True)(params)
        return v[None], g
      out_specs = (P("data"), P())
    else:
      def local(params, state, x, y, f=f):
        v, g, grams = gram_haiku.value_grad_and_gram(
            f.apply, mesh_axes="data")(params, state, None, x, y)
        return v[None], g, grams
      out_specs = (P("data"), P(), P("data"))
    step = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
        out_specs=out_specs))
    rows[name] = stats(step.lower(params, state, x, y).compile().as_text())
  lines = [f"MLP {'-'.join(map(str, sizes))}, B={batch}, {n_devices} CPU "
           "devices, shard_map over 'data' (bytes per step, from the "
           "compiled HLO)",
           "| method | all-reduce (count, bytes) | all-gather (count, bytes) "
           "| other collectives |", "|---|---|---|---|"]
  for name, s in rows.items():
    other = sum(s[k]["count"] for k in KINDS
                if k not in ("all-reduce", "all-gather"))
    lines.append(f"| {name} | {s['all-reduce']['count']}, "
                 f"{s['all-reduce']['bytes']:,} | {s['all-gather']['count']}, "
                 f"{s['all-gather']['bytes']:,} | {other} |")
  gathered = rows["gram"]["all-gather"]["bytes"]
  received = gathered * (n_devices - 1) // n_devices
  lines.append(
      f"\nGram all-gathers: {gathered:,} bytes of results per device, of "
      f"which {received:,} come from the other devices; formula "
      f"(n-1)/n * B * sum(N+M) * 4 = "
      f"{mlp_formula(batch, sizes, n_devices):,} bytes.")
  return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m benchmarks.collectives",
                              description=__doc__.splitlines()[0])
  p.add_argument("--batch", type=int, default=128,
                      help="global batch size B (default: %(default)s)")
  p.add_argument("--sizes", default="784,512,512,10",
                      help="MLP layer sizes, comma-separated "
                      "(default: %(default)s)")
  p.add_argument("--devices", type=int, default=8,
                      help="fake CPU devices of the mesh "
                      "(default: %(default)s)")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  os.environ.pop("XLA_FLAGS", None)
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update("jax_num_cpu_devices", args.devices)
  print(_run(args.batch, [int(s) for s in args.sizes.split(",")],
             args.devices))
  return 0


if __name__ == "__main__":
  sys.exit(main())
