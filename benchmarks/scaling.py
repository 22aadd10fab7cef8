"""The ``scaling`` suite: time and memory against plain as B and T grow.

* **batch sweep**: the MLP 784-512-512-10 at ``B = 16 ... 4096`` (powers of
  two), ``plain``, ``norms`` and full ``gram``.
* **sequence sweep**: one ``hk.Linear(256)`` on ``f32[B=32, T, 256]``
  (loss ``0.5 * sum(y**2)``, every position within-example) at
  ``T = 1 ... 1024``: ``plain``, and ``gram`` and ``norms`` each with
  ``strategy="auto"``, ``"ghost"`` and ``"materialize"``. Which strategy
  ``auto`` took is *measured*: its lowered program is compared with the
  forced ones' (the same text means the same kernel).

Caps (2-core CPU, a few minutes in all): forced ``ghost`` is timed only up
to ``T = 128`` for the Gram (``B^2 T^2 (N+M)`` multiply-adds: 17 GFLOP
there, and ``(B, T, B, T)`` kernel blocks) and up to ``T = 512`` for the
norms (``B T^2 (N+M)``); it is still compiled beyond, to identify ``auto``'s
choice. ``auto`` is not timed on its own: its program is the chosen
strategy's, whose timing it reports. Each point is timed over
``rounds x repeats`` steps (5 x 3 by default), interleaved with its own
plain step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from benchmarks import analytic
from benchmarks import harness
from benchmarks import jax_methods
from benchmarks import models


@dataclasses.dataclass
class ScalingOptions:
  batch_sizes: Sequence[int] = tuple(2 ** k for k in range(4, 13))
  seq_lens: Sequence[int] = tuple(2 ** k for k in range(0, 11))
  seq_batch: int = 32
  features: int = 256
  max_ghost_gram_seq: int = 128
  max_ghost_norms_seq: int = 512
  repeats: int = 3
  rounds: int = 5
  warmup: int = 1
  min_block_s: float = 0.25
  progress: bool = True


def _mem(c, plain):
  m = c.memory()
  pt = plain.memory()["temp_bytes"]
  m["temp_ratio"] = (m["temp_bytes"] / pt if pt and m["temp_bytes"]
                     is not None else None)
  return m


def batch_sweep(opts: ScalingOptions, log=print) -> list[dict]:
  records = []
  for b in opts.batch_sizes:
    bench = models.make_mlp(batch_size=b)
    prep = jax_methods.prepare(bench)
    compiled = {}
    for method in ("plain", "norms", "gram"):
      try:
        step, args = jax_methods.build(prep, method)
        compiled[method] = harness.compile_jax(step, args)
      except Exception as e:  # pylint: disable=broad-except
        records.append({"suite": "scaling", "sweep": "batch", "x": b,
                        "method": method, "status": "unsupported: " +
                        jax_methods.first_line(e)})
    steps = {m: c.run for m, c in compiled.items()}
    times = harness.time_steps(
        steps, {m: "plain" for m in steps if m != "plain"},
        repeats=opts.repeats, rounds=opts.rounds, warmup=opts.warmup,
        min_block_s=opts.min_block_s, progress=opts.progress,
        desc=f"B={b}")
    for method, c in compiled.items():
      extra = analytic.extra_flops(bench.layers, b, method)
      records.append({
          "suite": "scaling", "sweep": "batch", "x": b, "method": method,
          "strategy": "auto", "status": "ok", "time": times[method],
          "memory": _mem(c, compiled["plain"]),
          "flops": {"measured": c.flops,
                    "ratio": c.flops / compiled["plain"].flops,
                    "analytic_extra_min": extra}})
    log(f"  B={b}: " + ", ".join(
        f"{m} {times[m]['median_s'] * 1e3:.1f} ms" +
        (f" ({times[m]['ratio']:.2f}x)" if times[m]["ratio"] else "")
        for m in steps))
  return records


def _linear_transform(mode, strategy, features):
  def plain_loss(x):
    y = hk.Linear(features)(x)
    return 0.5 * jnp.sum(y * y)

  def tracked_loss(x):
    with gram_haiku.track(mode=mode, strategy=strategy):
      y = hk.Linear(features)(x)
    return 0.5 * jnp.sum(y * y)
  if mode is None:
    return hk.without_apply_rng(hk.transform(plain_loss))
  return hk.without_apply_rng(hk.transform_with_state(tracked_loss))


def seq_sweep(opts: ScalingOptions, log=print) -> list[dict]:
  records = []
  for t in opts.seq_lens:
    try:
      records += _seq_point(opts, t, log)
    except Exception as e:  # pylint: disable=broad-except
      records.append({"suite": "scaling", "sweep": "seq", "x": t,
                      "method": "gram", "strategy": None, "chosen": None,
                      "status": "unsupported: " + jax_methods.first_line(e),
                      "time": None, "memory": None, "flops": None})
      log(f"  T={t}: {records[-1]['status']}")
  return records


def _seq_point(opts: ScalingOptions, t: int, log) -> list[dict]:
  records = []
  b, n = opts.seq_batch, opts.features
  x = jnp.asarray(np.random.default_rng(t).standard_normal(
      (b, t, n), np.float32))
  plain = _linear_transform(None, None, n)
  params = plain.init(jax.random.PRNGKey(0), x)
  vg = jax.value_and_grad(plain.apply)
  compiled = {"plain": harness.compile_jax(vg, (params, x))}
  for mode in ("gram", "norms"):
    for strategy in ("auto", "ghost", "materialize"):
      tr = _linear_transform(mode, strategy, n)
      _, state = tr.init(jax.random.PRNGKey(0), x)
      vgg = gram_haiku.value_grad_and_gram(tr.apply)

      def step(p, s, x, vgg=vgg, mode=mode):
        loss, grads, grams = vgg(p, s, x)
        return loss, grads, (grams.total if mode == "gram" else grams.norms)
      compiled[f"{mode}:{strategy}"] = harness.compile_jax(
          step, (params, state, x))
  chosen = {}
  for mode in ("gram", "norms"):
    auto = compiled[f"{mode}:auto"].lowered_text
    chosen[mode] = next(
        (s for s in ("ghost", "materialize")
         if compiled[f"{mode}:{s}"].lowered_text == auto), "unknown")
  caps = {"gram": opts.max_ghost_gram_seq, "norms": opts.max_ghost_norms_seq}
  # "auto" compiles to the same program as the strategy it picked: it is
  # timed once, under that strategy's name, and reported under both.
  alias = {f"{m}:auto": f"{m}:{chosen[m]}" for m in chosen
           if chosen[m] != "unknown"}
  timed = {k: c for k, c in compiled.items()
           if k not in alias
           and not (k.endswith(":ghost") and t > caps[k.split(":")[0]])}
  times = harness.time_steps(
      {k: c.run for k, c in timed.items()},
      {k: "plain" for k in timed if k != "plain"}, repeats=opts.repeats,
      rounds=opts.rounds, warmup=opts.warmup, min_block_s=opts.min_block_s,
      progress=opts.progress, desc=f"T={t}")
  for k, v in alias.items():
    if v in times:
      times[k] = times[v]
  layer = [analytic.Layer("linear", t, n, n, bias=True, input_grad=False)]
  for key, c in compiled.items():
    method, _, strategy = key.partition(":")
    rec = {"suite": "scaling", "sweep": "seq", "x": t, "batch_size": b,
           "features": n, "method": method, "strategy": strategy or None,
           "chosen": chosen.get(method) if strategy == "auto" else
           (strategy or None),
           "status": "ok" if key in times else "not timed (cap)",
           "time": times.get(key), "memory": _mem(c, compiled["plain"]),
           "flops": {"measured": c.flops,
                     "loops_counted_once": c.has_loops,
                     "analytic_extra_min": analytic.extra_flops(
                         layer, b, method)}}
    records.append(rec)
  log(f"  T={t}: auto picks gram={chosen['gram']}, norms={chosen['norms']}; "
      + ", ".join(f"{k} {v['ratio']:.2f}x" for k, v in times.items()
                  if v["ratio"]))
  return records


def run(opts: ScalingOptions, sweeps=("batch", "seq"), log=print):
  out = []
  if "batch" in sweeps:
    log("scaling: batch sweep (MLP) ...")
    out += batch_sweep(opts, log)
  if "seq" in sweeps:
    log("scaling: sequence sweep (one linear layer) ...")
    out += seq_sweep(opts, log)
  return out
