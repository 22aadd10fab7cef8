"""Device time of a step, with the dispatch amortised.

``python -m benchmarks.device_time --model lstm --method plain,gram,norms``

A small step on an accelerator can take less device time than its dispatch
from Python: on a TPU v5e the plain LSTM step ran 58 us on the chip within
a 0.8 ms wall-clock step, so the wall-clock ratios of ``python -m
benchmarks`` hide most of what a method adds on the device. Here each step
is compiled inside a ``lax.fori_loop`` of ``k`` iterations; the parameters
are perturbed by a runtime zero carried from one iteration to the next (so
the compiler can neither hoist a step out of the loop nor run two at once),
and the device time of a step is ``(t(k + 1) - t(1)) / k``, the median of
``--reps`` such differences, each of the median of ``--calls`` timed calls.
The ratios are to the plain step measured in the same process. A step
whose difference is not above zero took less device time than the timer's
noise over ``k`` steps resolves: its time is NaN (printed as unresolved),
never a negative or zero number; a larger ``--k`` resolves it.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import jax_methods
from benchmarks import models


def looped(step: Callable, args: tuple, k: int) -> Callable[[], object]:
  """``step(*args)`` run ``k`` times in one compiled program, in sequence.

  ``args[0]`` (the parameters) gets ``+ e`` at every iteration, where ``e``
  is a runtime zero that each iteration passes on through its outputs."""
  def run(eps, *args):
    def body(_, carry):
      e, acc = carry
      params = jax.tree.map(lambda a: a + e.astype(a.dtype), args[0])
      out = step(params, *args[1:])
      s = sum(jnp.sum(leaf).astype(jnp.float32)
              for leaf in jax.tree.leaves(out))
      return e * s * 0.0 + e, acc + s
    return jax.lax.fori_loop(0, k, body, (eps, jnp.float32(0)))[1]
  compiled = jax.jit(run).lower(jnp.float32(0), *args).compile()
  return lambda: jax.block_until_ready(compiled(jnp.float32(0), *args))


def _median_call_s(fn: Callable[[], object], calls: int) -> float:
  fn()
  fn()
  times = []
  for _ in range(calls):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def per_step_s(one: Callable[[], object], many: Callable[[], object], *,
               k: int, reps: int, calls: int) -> float:
  """Seconds a step adds: the median over ``reps`` of ``(t(many) -
  t(one)) / k`` (``many`` runs ``k`` steps more than ``one``; each ``t``
  the median of ``calls`` timings), or NaN where that is not above zero
  (the step is below what ``k`` steps resolve against the timer's noise)."""
  s = float(np.median([
      (_median_call_s(many, calls) - _median_call_s(one, calls)) / k
      for _ in range(reps)]))
  return s if s > 0 else float("nan")


def format_time(seconds: Optional[float], unit: str = "us") -> str:
  """``seconds`` in ``unit`` (``"us"`` or ``"ms"``) for a table, or
  ``"unresolved"`` (NaN, :func:`per_step_s`; None, as a JSON record keeps
  it)."""
  if seconds is None or np.isnan(seconds):
    return "unresolved"
  return f"{seconds * {'us': 1e6, 'ms': 1e3}[unit]:.2f} {unit}"


def step_device_s(step: Callable, args: tuple, *, k: int, reps: int,
                  calls: int) -> float:
  """Seconds of device time one ``step(*args)`` takes (module docstring;
  NaN where unresolved)."""
  return per_step_s(looped(step, args, 1), looped(step, args, k + 1), k=k,
                    reps=reps, calls=calls)


def dispatched_step_s(dispatch: Callable[[], object], *, k: int,
                      reps: int, calls: int) -> float:
  """Seconds of device time of one step, from ``k + 1`` steps dispatched
  back to back (``dispatch()`` starts one and returns at once, as a
  compiled JAX function does) against one: ``(t(k + 1) - t(1)) / k``, the
  median of ``reps`` such differences, each of the median of ``calls``
  timings. The device runs the queued steps in sequence while Python
  dispatches the next, so the dispatch is amortised as in
  :func:`step_device_s`, without compiling the step again (a looped
  program is a new compile: tens of seconds for a large model on a TPU
  host). It measures the device time when one step's device time exceeds
  its dispatch (large steps); for steps of microseconds use
  :func:`step_device_s`. The two agreed on a TPU v5e (2026-12-06, the
  ``real`` suite's WRN-16-4 at B=128): 3.27 / 3.25 ms (plain), 49.62 /
  49.76 ms (``dp_all``), 51.24 / 51.20 ms (``dp_layer``), looped /
  dispatched.
  """
  def run(n):
    def go():
      out = None
      for _ in range(n):
        out = dispatch()
      jax.block_until_ready(out)
    return go
  return per_step_s(run(1), run(k + 1), k=k, reps=reps, calls=calls)


def measure(model: str, methods: Sequence[str], *, k: int = 20, reps: int = 3,
            calls: int = 11, gram_precision: str = "highest") -> dict:
  """``{method: {"device_s", "ratio"}}`` for one benchmark model; the
  ratio is to ``"plain"``, which is always measured."""
  bench = getattr(models, "make_" + model)()
  prep = jax_methods.prepare(bench, gram_precision=gram_precision)
  out = {}
  for method in ["plain"] + [m for m in methods if m != "plain"]:
    step, args = jax_methods.build(prep, method)
    out[method] = {"device_s": step_device_s(step, args, k=k, reps=reps,
                                             calls=calls)}
  plain = out["plain"]["device_s"]
  for v in out.values():
    v["ratio"] = v["device_s"] / plain if plain > 0 else float("nan")
  return out


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="lstm",
                      help="comma-separated benchmark models (models.py)")
  parser.add_argument("--method", default="plain,gram,norms,naive",
                      help="comma-separated methods (jax_methods.py)")
  parser.add_argument("--gram_precision", default="highest")
  parser.add_argument("--k", type=int, default=20,
                      help="steps in the long program")
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--calls", type=int, default=11)
  a = parser.parse_args(argv)
  print(f"device: {jax.devices()[0].device_kind}; gram_precision "
        f"{a.gram_precision}; k = {a.k}")
  for model in a.model.split(","):
    res = measure(model, a.method.split(","), k=a.k, reps=a.reps,
                  calls=a.calls, gram_precision=a.gram_precision)
    for method, v in res.items():
      print(f"{model:10s} {method:8s} {format_time(v['device_s']):>13s} "
            f"{v['ratio']:7.2f}x")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
