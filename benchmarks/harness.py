"""Compiling, measuring and timing steps.

Timing protocol (the machine is shared, so nothing is timed alone): every
step is compiled ahead of time and warmed up; then, for each of ``rounds``
rounds, every method runs ``repeats`` steps back to back, each step timed on
its own (``perf_counter`` around the call and ``block_until_ready``), with
the order of methods rotated from round to round and a short pause before
each block. Fast steps run more times per block (see ``min_block_s``). A method's step time is
the median over all its ``rounds * repeats`` steps, with the interquartile
range; its ratio to the baseline is the median over rounds of (its median
in that round / the baseline's median in that round), with the IQR over
rounds. So a ratio always compares steps timed within seconds of each other.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np


@dataclasses.dataclass
class Compiled:
  """An AOT-compiled step with XLA's own memory and FLOP figures."""
  run: Callable[[], object]
  compile_s: float
  temp_bytes: Optional[int]
  argument_bytes: Optional[int]
  output_bytes: Optional[int]
  alias_bytes: Optional[int]
  flops: Optional[float]
  bytes_accessed: Optional[float]
  #: the lowered program (its text, :attr:`lowered_text`, is printed on
  #: first use: for a large model, seconds under the GIL).
  lowered: object = None
  #: runs the step without waiting for it (``jax``'s asynchronous
  #: dispatch); returns its outputs.
  dispatch: Optional[Callable[[], object]] = None

  @property
  def lowered_text(self) -> str:
    if self.lowered is None:
      return ""
    if not hasattr(self, "_text"):
      self._text = self.lowered.as_text()  # pylint: disable=attribute-defined-outside-init
    return self._text

  @property
  def has_loops(self) -> bool:
    """Whether the program has a while loop (``scan``, ``lax.map``): XLA's
    ``cost_analysis`` counts a loop body once, not once per iteration."""
    return "stablehlo.while" in self.lowered_text

  def memory(self) -> dict:
    total = None
    if self.temp_bytes is not None:
      total = (self.temp_bytes + self.argument_bytes + self.output_bytes
               - self.alias_bytes)
    return {"temp_bytes": self.temp_bytes,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "total_bytes": total}


def _cost(compiled) -> dict:
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jaxlibs: one dict per program
    cost = cost[0] if cost else {}
  return cost or {}


def compile_jax(fn: Callable, args: tuple) -> Compiled:
  """``jax.jit(fn).lower(*args).compile()``, its memory and cost analyses.

  ``args`` may be ``jax.ShapeDtypeStruct`` (enough for the analyses; such
  a program cannot run). Raises whatever tracing or compiling raises (an
  unsupported layer).
  """
  t0 = time.perf_counter()
  lowered = jax.jit(fn).lower(*args)
  return _compiled(lowered, args, time.perf_counter() - t0)


def compile_many(jobs: Sequence[tuple[Callable, tuple]],
                 workers: Optional[int] = None) -> list:
  """:func:`compile_jax` of each ``(fn, args)``, XLA's compiles at once.

  Tracing and lowering (Python, under the GIL) run in turn; the compiles
  run in a thread pool of ``workers`` threads (default: the CPU count, at
  most 16), since XLA releases the GIL while it compiles: on a many-core
  accelerator host a model's programs compile in about the time of the
  slowest. ``compile_s`` is then each program's lowering plus its own
  compile, timed in its thread. Returns, per job, its :class:`Compiled` or
  the exception it raised.
  """
  lowered = []
  for fn, args in jobs:
    t0 = time.perf_counter()
    try:
      lowered.append((jax.jit(fn).lower(*args), args,
                      time.perf_counter() - t0))
    except Exception as e:  # pylint: disable=broad-except
      lowered.append(e)

  def finish(item):
    if isinstance(item, Exception):
      return item
    try:
      return _compiled(*item)
    except Exception as e:  # pylint: disable=broad-except
      return e
  workers = workers or min(16, os.cpu_count() or 1)
  if workers <= 1 or len(lowered) <= 1:
    return [finish(item) for item in lowered]
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(finish, lowered))


def _compiled(lowered, args: tuple, lower_s: float) -> Compiled:
  t0 = time.perf_counter()
  compiled = lowered.compile()
  compile_s = lower_s + time.perf_counter() - t0
  mem = compiled.memory_analysis()
  cost = _cost(compiled)

  def run():
    return jax.block_until_ready(compiled(*args))
  get = lambda name: None if mem is None else int(getattr(mem, name))
  c = Compiled(run=run, compile_s=compile_s,
               temp_bytes=get("temp_size_in_bytes"),
               argument_bytes=get("argument_size_in_bytes"),
               output_bytes=get("output_size_in_bytes"),
               alias_bytes=get("alias_size_in_bytes"),
               flops=cost.get("flops"),
               bytes_accessed=cost.get("bytes accessed"),
               lowered=lowered)
  c.dispatch = lambda: compiled(*args)
  return c


def _quartiles(a) -> tuple[float, float, float]:
  q = np.percentile(np.asarray(a, np.float64), [25, 50, 75])
  return float(q[0]), float(q[1]), float(q[2])


def time_steps(steps: dict[str, Callable[[], object]], baselines: dict,
               *, repeats: int, rounds: int, warmup: int = 2,
               progress: bool = False, desc: str = "",
               settle_s: float = 0.05, min_block_s: float = 0.25,
               max_repeats: int = 50) -> dict[str, dict]:
  """Times ``steps`` interleaved; ratios against each method's baseline.

  Args:
    steps: name -> zero-argument callable running one step to completion.
    baselines: name -> name of its baseline in ``steps`` (or None).
    repeats: steps per method per round, at least; a fast step gets more,
      up to ``max_repeats``, so that a block lasts ``min_block_s`` (from the
      warm-up's timing): a short block is at the mercy of one scheduler
      hiccup on a shared machine.
    rounds: rounds (the method order rotates each round).
    warmup: untimed calls per method first.
    progress: show a tqdm bar.
    desc: bar label.
    settle_s: pause before each block of steps, so that the previous
      block's worker threads (XLA's, torch's OpenMP) stop spinning first.

  Returns:
    name -> ``{"median_s", "q25_s", "q75_s", "n_steps", "round_medians_s",
    "ratio", "ratio_q25", "ratio_q75", "round_ratios"}`` (ratios None
    without a baseline).
  """
  names = list(steps)
  per_block = {}
  for name in names:
    t0 = time.perf_counter()
    for _ in range(max(1, warmup)):
      steps[name]()
    guess = (time.perf_counter() - t0) / max(1, warmup)
    per_block[name] = int(min(max_repeats, max(
        repeats, math.ceil(min_block_s / max(guess, 1e-9)))))
  samples = {n: [] for n in names}
  round_medians = {n: [] for n in names}
  bar = None
  if progress:
    from tqdm import tqdm  # pylint: disable=g-import-not-at-top
    # disable=None: no bar (and no carriage returns) off a terminal.
    bar = tqdm(total=rounds * len(names), desc=desc, leave=False,
               disable=None)
  for r in range(rounds):
    order = names[r % len(names):] + names[:r % len(names)]
    for name in order:
      fn = steps[name]
      time.sleep(settle_s)
      times = []
      for _ in range(per_block[name]):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
      samples[name] += times
      round_medians[name].append(float(np.median(times)))
      if bar is not None:
        bar.update(1)
  if bar is not None:
    bar.close()
  out = {}
  for name in names:
    q25, q50, q75 = _quartiles(samples[name])
    rec = {"median_s": q50, "q25_s": q25, "q75_s": q75,
           "n_steps": len(samples[name]),
           "round_medians_s": round_medians[name],
           "ratio": None, "ratio_q25": None, "ratio_q75": None,
           "round_ratios": None}
    base = baselines.get(name)
    if base is not None:
      ratios = [a / b for a, b in zip(round_medians[name],
                                      round_medians[base])]
      rq25, rq50, rq75 = _quartiles(ratios)
      rec.update(ratio=rq50, ratio_q25=rq25, ratio_q75=rq75,
                 round_ratios=ratios)
    out[name] = rec
  return out
