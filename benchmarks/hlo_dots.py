"""Where the FLOPs go: every dot and convolution of a compiled step.

``python -m benchmarks.hlo_dots --model lm --method gram --filter attn_0``
compiles the step (as :mod:`benchmarks.runner` does), reads XLA's optimised
HLO and lists each ``dot``/``convolution`` with its result shape, its FLOPs
(dots: ``2 * |result| * |contracted dims|``; convolutions: ``2 * |result| *
window size * input features per group``) and the JAX op that produced it
(from the HLO metadata; empty when XLA merged or created the op). With
``--diff`` it prints the ops of the method whose (shape, FLOPs) do not occur
in ``plain``: the extra work of tracking, to compare with
:mod:`benchmarks.analytic`. Ops inside loop bodies are listed once (as in
``cost_analysis``).
"""

from __future__ import annotations

import argparse
import collections
import math
import re
from typing import Optional

from benchmarks import harness
from benchmarks import jax_methods
from benchmarks import models

_DEF = re.compile(r"\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[([\d,]*)\]")
_OP = re.compile(r"\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[([\d,]*)\]\S* "
                 r"(dot|convolution)\(([^)]*)\)")


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def parse(hlo: str) -> list[dict]:
  """Dots and convolutions of optimised HLO text, with FLOPs."""
  shapes = {}
  for line in hlo.splitlines():
    m = _DEF.match(line)
    if m:
      shapes[m.group(1)] = _dims(m.group(3))
  out = []
  for line in hlo.splitlines():
    m = _OP.match(line)
    if not m:
      continue
    result = _dims(m.group(3))
    operands = [o.strip().split(" ")[-1] for o in m.group(5).split(",")]
    lhs = shapes.get(operands[0])
    flops = None
    if m.group(4) == "dot" and lhs is not None:
      c = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
      contracted = [lhs[i] for i in _dims(c.group(1))] if c else []
      flops = 2 * math.prod(result) * math.prod(contracted)
    elif m.group(4) == "convolution" and lhs is not None:
      rhs = shapes.get(operands[1]) if len(operands) > 1 else None
      labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
      groups = re.search(r"feature_group_count=(\d+)", line)
      if rhs is not None and labels:
        kernel = labels.group(2)
        window = math.prod(rhs[i] for i, ch in enumerate(kernel)
                           if ch.isdigit())
        in_feat = rhs[kernel.index("i")]
        flops = 2 * math.prod(result) * window * in_feat
        del groups  # the kernel's "i" extent is already per group
    name = re.search(r'op_name="([^"]*)"', line)
    out.append({"kind": m.group(4), "dtype": m.group(2), "shape": result,
                "flops": flops, "op": name.group(1) if name else ""})
  return out


def compile_step(model: str, method: str, batch_size: Optional[int] = None,
                 seq_len: Optional[int] = None, strategy: str = "auto"):
  bench = models.make(model, batch_size, seq_len)
  prep = jax_methods.prepare(bench, strategy)
  step, args = jax_methods.build(prep, method)
  import jax  # pylint: disable=g-import-not-at-top
  compiled = jax.jit(step).lower(*args).compile()
  return compiled, harness._cost(compiled)  # pylint: disable=protected-access


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m benchmarks.hlo_dots")
  p.add_argument("--model", default="mlp", choices=models.MODEL_NAMES,
                 help="benchmark model (default: %(default)s)")
  p.add_argument("--method", default="gram",
                 choices=jax_methods.JAX_METHODS,
                 help="step to compile (default: %(default)s)")
  p.add_argument("--batch_size", type=int, default=None,
                 help="B (default: the model's benchmark B)")
  p.add_argument("--seq_len", type=int, default=None,
                 help="T for lm and lstm (default: the benchmark T)")
  p.add_argument("--strategy", default="auto",
                 choices=("auto", "ghost", "materialize"),
                 help="track(strategy=...) (default: %(default)s)")
  p.add_argument("--filter", default="", help="substring of the JAX op name")
  p.add_argument("--diff", action="store_true",
                 help="only ops not also in plain (by shape and FLOPs)")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  compiled, cost = compile_step(args.model, args.method, args.batch_size,
                                args.seq_len, args.strategy)
  ops = parse(compiled.as_text())
  if args.diff:
    plain, _ = compile_step(args.model, "plain", args.batch_size,
                            args.seq_len)
    left = collections.Counter((o["kind"], tuple(o["shape"]), o["flops"])
                               for o in parse(plain.as_text()))
    extra = []
    for o in ops:
      key = (o["kind"], tuple(o["shape"]), o["flops"])
      if left[key] > 0:
        left[key] -= 1
      else:
        extra.append(o)
    ops = extra
  ops = [o for o in ops if args.filter in o["op"]]
  total = 0
  for o in sorted(ops, key=lambda o: -(o["flops"] or 0)):
    total += o["flops"] or 0
    f = "?" if o["flops"] is None else f"{o['flops'] / 1e6:10.1f}"
    shape = "x".join(map(str, o["shape"]))
    print(f"{f} MFLOP  {o['kind']:<11} {o['dtype']}[{shape}]  {o['op']}")
  print(f"{total / 1e9:.3f} GFLOP in {len(ops)} ops listed; cost_analysis "
        f"of the whole step: {cost.get('flops', 0) / 1e9:.3f} GFLOP")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
