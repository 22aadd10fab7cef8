"""The ``models`` suite: every model x method, one interleaved timing run.

For each model: compile every JAX method ahead of time (memory and FLOPs
from XLA), check that the tracked methods cover every parameter and agree
with ``vmap(grad)``, build the torch peers when installed, then time them
all together (:func:`benchmarks.harness.time_steps`): JAX methods against
``plain``, torch methods against ``torch_plain``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Sequence

from benchmarks import analytic
from benchmarks import harness
from benchmarks import dp_methods
from benchmarks import jax_methods
from benchmarks import models
from benchmarks import torch_peers


@dataclasses.dataclass
class Options:
  models: Sequence[str] = models.MODEL_NAMES
  methods: Sequence[str] = jax_methods.JAX_METHODS + torch_peers.TORCH_METHODS
  batch_size: Optional[int] = None
  seq_len: Optional[int] = None
  hidden: Optional[Sequence[int]] = None
  strategy: str = "auto"
  #: ``track(gram_precision=...)`` of every tracked method.
  gram_precision: str = "highest"
  tied: str = "auto"
  repeats: int = 4
  rounds: int = 8
  warmup: int = 2
  min_block_s: float = 0.25
  check: bool = True
  #: tolerance of those checks, relative to the largest reference entry
  #: (loosen it only for a platform whose default matmul precision is
  #: lower than float32, e.g. a TPU's bfloat16 passes).
  check_rtol: float = 1e-3
  allow_partial: bool = False
  progress: bool = True


def _record(bench, framework, method, status, **extra) -> dict:
  rec = {"suite": "models", "model": bench.name,
         "description": bench.description, "framework": framework,
         "method": method, "batch_size": bench.batch_size,
         "seq_len": bench.seq_len, "status": status,
         "time": None, "memory": None, "flops": None}
  rec.update(extra)
  return rec


def _flops_entry(c: harness.Compiled, plain: Optional[harness.Compiled],
                 bench, method: str) -> dict:
  """Measured FLOPs against plain, and the analytic floor.

  ``analytic_min_ratio`` is ``(plain + minimum extra) / plain`` with plain
  from ``cost_analysis``; when either program has a loop (whose body
  ``cost_analysis`` counts once) the analytic plain count is used instead,
  and ``min_ratio_base`` says so.
  """
  b = bench.batch_size
  loops = c.has_loops or (plain is not None and plain.has_loops)
  entry = {"measured": c.flops,
           "plain_measured": plain.flops if plain else None,
           "ratio": None, "analytic_plain": analytic.plain_flops(
               bench.layers, b),
           "analytic_extra_min": analytic.extra_flops(bench.layers, b, method),
           "analytic_min_ratio": None, "min_ratio_base": None,
           "extra_over_min": None,
           "loops_counted_once": loops}
  extra = entry["analytic_extra_min"]
  if c.flops and plain is not None and plain.flops:
    entry["ratio"] = c.flops / plain.flops
    if extra is not None and not loops:
      entry["analytic_min_ratio"] = (plain.flops + extra) / plain.flops
      entry["min_ratio_base"] = "cost_analysis plain"
      if extra > 0:
        entry["extra_over_min"] = (c.flops - plain.flops) / extra
  if extra is not None and loops and entry["analytic_plain"]:
    base = entry["analytic_plain"]
    entry["analytic_min_ratio"] = (base + extra) / base
    entry["min_ratio_base"] = "analytic plain"
  return entry


def _memory_entry(c: harness.Compiled, plain: Optional[harness.Compiled]):
  mem = c.memory()
  mem["temp_ratio"] = None
  mem["total_ratio"] = None
  if plain is not None:
    pm = plain.memory()
    if mem["temp_bytes"] is not None and pm["temp_bytes"]:
      mem["temp_ratio"] = mem["temp_bytes"] / pm["temp_bytes"]
    if mem["total_bytes"] is not None and pm["total_bytes"]:
      mem["total_ratio"] = mem["total_bytes"] / pm["total_bytes"]
  return mem


def run_model(name: str, opts: Options, log=print) -> list[dict]:
  """Benchmarks every requested method on model ``name``; JSON records."""
  bench = models.make(name, opts.batch_size, opts.seq_len, opts.hidden,
                      opts.tied)
  prep = jax_methods.prepare(bench, opts.strategy,
                             gram_precision=opts.gram_precision)
  wanted_jax = [m for m in jax_methods.JAX_METHODS if m in opts.methods]
  if wanted_jax and "plain" not in wanted_jax:
    wanted_jax.insert(0, "plain")  # the baseline of every ratio
  records, steps, baselines, compiled = {}, {}, {}, {}
  outs = {}

  for method in wanted_jax:
    try:
      step, args = jax_methods.build(prep, method)
      c = harness.compile_jax(step, args)
      compiled[method] = c
    except Exception as e:  # pylint: disable=broad-except
      records[method] = _record(bench, "jax", method,
                                "unsupported: " + jax_methods.first_line(e))
      log(f"  {name}/{method}: {records[method]['status']}")

  tracked = [m for m in jax_methods.CHECKED if m in compiled]
  if opts.check and tracked:
    try:
      if "naive" in compiled:
        ref = compiled["naive"].run()
      else:
        step, args = jax_methods.build(prep, "naive")
        ref = harness.compile_jax(step, args).run()
      for method in tracked:
        outs[method] = compiled[method].run()
        why = jax_methods.check(prep, method, outs[method], ref,
                                 rtol=opts.check_rtol)
        if why is not None:
          status = ("partial: " if opts.allow_partial and "untracked" in why
                    else "unsupported: ") + why
          records[method] = _record(bench, "jax", method, status)
          log(f"  {name}/{method}: {status}")
          if not status.startswith("partial"):
            del compiled[method]
    except Exception as e:  # pylint: disable=broad-except
      note = f"ok (not checked: {jax_methods.first_line(e)})"
      for method in tracked:
        if method in compiled and method not in records:
          records[method] = _record(bench, "jax", method, note)
      log(f"  {name}: check failed to run ({jax_methods.first_line(e)})")

  dp = [m for m in dp_methods.DP_METHODS if m in compiled]
  if opts.check and dp:
    try:
      refs = dp_methods.reference_sums(prep)
      for method in dp:
        why = dp_methods.check(method, compiled[method].run(), refs,
                               rtol=opts.check_rtol)
        if why is not None:
          records[method] = _record(bench, "jax", method,
                                    "unsupported: " + why)
          log(f"  {name}/{method}: {records[method]['status']}")
          del compiled[method]
    except Exception as e:  # pylint: disable=broad-except
      for method in dp:
        records.setdefault(method, _record(
            bench, "jax", method,
            f"ok (not checked: {jax_methods.first_line(e)})"))

  plain_c = compiled.get("plain")
  for method, c in compiled.items():
    steps[method] = c.run
    baselines[method] = "plain" if method != "plain" else None
    rec = records.get(method) or _record(bench, "jax", method, "ok")
    rec["memory"] = _memory_entry(c, plain_c)
    rec["flops"] = _flops_entry(c, plain_c, bench, method)
    rec["compile_s"] = c.compile_s
    records[method] = rec

  wanted_torch = [m for m in torch_peers.TORCH_METHODS if m in opts.methods]
  if wanted_torch and name in torch_peers.TORCH_MODELS:
    if "torch_plain" not in wanted_torch:
      wanted_torch.insert(0, "torch_plain")
    if not torch_peers.available():
      for method in wanted_torch:
        records[method] = _record(bench, "torch", method,
                                  torch_peers.SKIP_REASON)
    else:
      peaks = {}
      for method in wanted_torch:
        with warnings.catch_warnings(record=True) as caught:
          warnings.simplefilter("always")
          try:
            step = torch_peers.build(bench, method, hidden=opts.hidden or
                                     (512, 512))
            out = step()
            why = (torch_peers.check(bench, method, out,
                                     hidden=opts.hidden or (512, 512))
                   if opts.check else None)
          except Exception as e:  # pylint: disable=broad-except
            notes = [str(w.message).splitlines()[0] for w in caught
                     if "extension" in str(w.message).lower()]
            why = (notes[0][:160] if notes else jax_methods.first_line(e))
            step = None
        if why is not None or step is None:
          records[method] = _record(bench, "torch", method,
                                    "unsupported: " + why)
          log(f"  {name}/{method}: {records[method]['status']}")
          continue
        steps[method] = _quiet(step)
        baselines[method] = ("torch_plain" if method != "torch_plain"
                             else None)
        peaks[method] = torch_peers.peak_bytes(steps[method])
        records[method] = _record(bench, "torch", method, "ok")
      for method, peak in peaks.items():
        base = peaks.get("torch_plain")
        records[method]["memory"] = {
            "peak_alloc_bytes": peak,
            "peak_ratio": peak / base if peak and base else None}

  if steps:
    times = harness.time_steps(steps, baselines, repeats=opts.repeats,
                               rounds=opts.rounds, warmup=opts.warmup,
                               min_block_s=opts.min_block_s,
                               progress=opts.progress, desc=name)
    for method, t in times.items():
      records[method]["time"] = t
  order = list(jax_methods.JAX_METHODS) + list(torch_peers.TORCH_METHODS)
  return [records[m] for m in order if m in records]


def _quiet(step):
  def run():
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      return step()
  return run


def run(opts: Options, log=print) -> list[dict]:
  out = []
  for name in opts.models:
    log(f"model {name} ...")
    out += run_model(name, opts, log)
  return out
