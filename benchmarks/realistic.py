"""The ``real`` suite: models at the sizes DP users train, with jax-privacy.

``python -m benchmarks --suite real --scale full`` (a TPU or GPU),
``--scale cpu`` (the same models scaled down for a CPU) or ``--scale
smoke`` (tiny, the test suite's). Three models (:mod:`benchmarks.models`):
a WRN-16-4 with GroupNorm and weight standardisation (a custom getter), a
ViT-S/4-style encoder on 32x32 images and a GPT-2-small-style decoder, each
at two batch sizes, and six methods:

* ``plain``: ``jax.value_and_grad`` of the summed loss;
* ``dp_all`` / ``dp_layer``: :func:`gram_haiku.clipped_grad`, all-layer and
  per-layer (``C_l = C / sqrt(L)``);
* ``gram``: :func:`gram_haiku.value_grad_and_gram`, the full ``[B, B]``
  Gram;
* ``jaxp_clipped``: ``jax_privacy.clipping.clipped_grad`` (``vmap`` over
  examples), un-microbatched where it fits in the memory budget, else with
  the largest power-of-two microbatch that fits;
* ``naive``: ``vmap(grad)``, ``F F^T``.

Per model, batch size and method, one run: the step time (on an
accelerator its device time,
:func:`benchmarks.device_time.dispatched_step_s`;
on a CPU the wall time of :func:`benchmarks.harness.time_steps`, methods
interleaved; both medians of a few repeats), XLA's compiled memory
(``memory_analysis``: temp bytes, and the total with arguments and
outputs), and agreement: ``dp_all`` against ``jaxp_clipped``, ``dp_layer``
against jax-privacy's ``clipped_grad`` with a per-layer clipping
``pre_clipping_transform`` (each module to ``C / sqrt(L)``; the global clip
at ``C`` then changes nothing), ``gram`` against ``naive`` (max relative
difference, ``max |a - b| / max |b|``; gram_haiku clips by sound upper
bounds of the norms, so its clipped sums differ from jax-privacy's by up to
about the bounds' excess: 1e-7 to 3e-4 on the CPU for the ViT and GPT, 4e-3
all-layer and 1e-2 per-layer for the weight-standardised WRN, whose bounds
lie 0.3 to 0.5% (per layer up to 1.5%) above the exact norms at the CPU
scale). Per model and method: the largest
batch whose compiled program fits the memory budget (total bytes), by a
secant search on ``memory_analysis`` from the two timed batch sizes
(compiles only, nothing runs; ``fit_steps`` compiles at most; jax-privacy
un-microbatched).

A method whose program does not fit the device (its total bytes above the
device's limit) is compiled and reported, never run.

Cost on one TPU v5e chip (2026-12-06, jax 0.10.2, 13 host cores): compiling
dominates. The WRN's 14 programs (6 methods at 2 batch sizes, and
jax-privacy's per-layer reference) compiled in 305 s at once (about 30 to
40 s each alone), the GPT's in 130 s; the timing took 50 s and 25 s, one
round of the largest-batch search 111 s (WRN). So one command for all three
models takes over 8 minutes; one per model with ``--merge`` (one JSON, one
table)::

  python -m benchmarks --suite real --scale full --fit_steps 1 --model wrn
  python -m benchmarks --suite real --scale full --fit_steps 1 --model vit \
      --merge
  python -m benchmarks --suite real --scale full --fit_steps 1 --model gpt \
      --merge
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_time
from benchmarks import dp_methods
from benchmarks import harness
from benchmarks import jax_methods
from benchmarks import models
from gram_haiku._src.core import reference

METHODS = ("plain", "dp_all", "dp_layer", "gram", "jaxp_clipped", "naive")
SCALE_NAMES = ("full", "cpu", "smoke")

#: scale -> model -> (builder keywords, the two batch sizes).
SCALES = {
    "full": {
        "wrn": (dict(depth=16, width=4, base=16, image=32, groups=16),
                (128, 256)),
        "vit": (dict(d_model=384, layers=6, heads=6, patch=4, image=32),
                (64, 128)),
        "gpt": (dict(seq_len=256, d_model=768, layers=6, heads=12,
                     vocab=32000), (8, 16)),
    },
    "cpu": {
        "wrn": (dict(depth=10, width=1, base=16, image=32, groups=8),
                (8, 16)),
        "vit": (dict(d_model=96, layers=2, heads=3, patch=4, image=32),
                (8, 16)),
        "gpt": (dict(seq_len=64, d_model=128, layers=2, heads=4,
                     vocab=2048), (4, 8)),
    },
    "smoke": {
        "wrn": (dict(depth=10, width=1, base=4, image=8, groups=2), (2, 4)),
        "vit": (dict(d_model=16, layers=1, heads=2, patch=4, image=8),
                (2, 4)),
        "gpt": (dict(seq_len=8, d_model=16, layers=1, heads=2, vocab=64),
                (2, 4)),
    },
}

#: The memory budget of the largest-batch search where the device states
#: no limit (a CPU), per scale.
DEFAULT_BUDGET = {"full": 16 * 2**30, "cpu": 2**30, "smoke": 2**22}


@dataclasses.dataclass
class Options:
  models: Sequence[str] = models.REAL_MODEL_NAMES
  methods: Sequence[str] = METHODS
  scale: str = "cpu"
  #: overrides every model's two batch sizes.
  batch_sizes: Optional[Sequence[int]] = None
  #: bytes; None: the device's limit, else :data:`DEFAULT_BUDGET`.
  budget_bytes: Optional[int] = None
  #: compiles of the largest-batch search per method (0: the secant's
  #: prediction from the two timed batch sizes alone, not verified).
  fit_steps: int = 2
  #: "auto" (device time off a CPU), "wall" or "device".
  timer: str = "auto"
  #: wall: timed steps per method per round; device: timed calls of each
  #: run of ``k + 1`` and of one dispatched steps.
  repeats: int = 3
  #: wall: rounds (methods interleaved); device: differences, median.
  rounds: int = 2
  #: device: ``k + 1`` steps dispatched back to back against one.
  k: int = 4
  gram_precision: str = "highest"
  #: pass the agreement checks' outputs through (tests only).
  keep_outputs: bool = False
  progress: bool = False


def device_limit() -> Optional[int]:
  """The default device's memory limit in bytes, None when not stated."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
  except Exception:  # pylint: disable=broad-except
    return None
  limit = stats.get("bytes_limit")
  return int(limit) if limit else None


def budget(opts: Options) -> int:
  if opts.budget_bytes is not None:
    return int(opts.budget_bytes)
  return device_limit() or DEFAULT_BUDGET[opts.scale]


def make(name: str, scale: str, batch_size: int) -> models.Bench:
  kwargs, _ = SCALES[scale][name]
  return models.make_real(name, batch_size=batch_size, **kwargs)


def batch_sizes(name: str, opts: Options) -> tuple[int, ...]:
  return tuple(opts.batch_sizes or SCALES[opts.scale][name][1])


# -- jax-privacy's per-layer clipped sum (the reference of dp_layer) ---------

def per_layer_transform(clip_by_module: dict) -> Callable:
  """A ``pre_clipping_transform`` clipping each module's part of one
  example's gradient to its own threshold."""
  def transform(g):
    out = {}
    for m, leaves in g.items():
      sq = sum(jnp.sum(jnp.square(a)) for a in jax.tree.leaves(leaves))
      norm = jnp.sqrt(sq)
      c = clip_by_module[m]
      f = jnp.where(norm > c, c / jnp.where(norm > 0, norm, 1.0), 1.0)
      out[m] = jax.tree.map(lambda a, f=f: a * f.astype(a.dtype), leaves)
    return out
  return transform


def jaxp_step(prep, microbatch_size: Optional[int] = None,
              per_layer: bool = False):
  """``(step, args)`` of ``jax_privacy.clipping.clipped_grad`` at ``C =
  dp_methods.CLIP``; ``per_layer``: each module clipped to ``C /
  sqrt(L)`` first (:func:`per_layer_transform`)."""
  from jax_privacy import clipping as jp_clipping  # pylint: disable=g-import-not-at-top
  bench = prep.bench
  loss = lambda p, *batch: prep.plain.apply(p, *batch)
  n_batch = len(bench.batch)
  extra = {}
  if per_layer:
    each = dp_methods.CLIP / math.sqrt(len(prep.params))
    extra["pre_clipping_transform"] = per_layer_transform(
        {m: each for m in prep.params})
  clipped = jp_clipping.clipped_grad(
      loss, l2_clip_norm=dp_methods.CLIP,
      batch_argnums=tuple(range(1, n_batch + 1)),
      microbatch_size=microbatch_size, **extra)
  return ((lambda p, s, *batch: clipped(p, *batch)),
          (prep.params, prep.states["norms"], *bench.batch))


def build(prep, method: str, microbatch_size: Optional[int] = None):
  if method == "jaxp_clipped":
    return jaxp_step(prep, microbatch_size)
  return jax_methods.build(prep, method)


# -- the largest batch in a memory budget ------------------------------------

#: The fraction of the way to the secant's estimate that a probe far past
#: every measured batch size goes (see :meth:`Search.next`).
SHORT = 0.85


class Search:
  """The largest batch ``B`` whose program fits ``limit`` bytes, by a
  secant search on measured sizes (see :func:`largest_fitting`).

  ``points``: ``{B: bytes}`` already measured (at least one; None: does
  not fit, e.g. a compile that failed). :meth:`next` proposes the next
  ``B`` to measure (None: done), :meth:`add` records it.
  """

  def __init__(self, points: dict, limit: int, steps: int,
               cap: int = 1 << 20):
    self.pts = {int(b): m for b, m in points.items()}
    self.limit, self.steps, self.cap = limit, steps, cap
    self.probes, self.predicted = [], None

  def _bracket(self):
    fit = [b for b, m in self.pts.items() if m is not None and m <= self.limit]
    over = [b for b, m in self.pts.items() if m is None or m > self.limit]
    return max(fit, default=0), min(over, default=None)

  def _secant(self, p1, p2) -> Optional[float]:
    (b1, m1), (b2, m2) = sorted([p1, p2])
    slope = (m2 - m1) / (b2 - b1)
    return b2 + (self.limit - m2) / slope if slope > 0 else None

  def _predict(self, lo, hi) -> Optional[float]:
    """Where the memory reaches the budget: the secant through the two
    largest fitting points (the local slope below the budget; past the
    root on a convex memory curve), and the chord across the bracket
    where both its ends were measured (short of the root on a convex
    curve): their mean where both exist."""
    known = sorted((b, m) for b, m in self.pts.items() if m is not None)
    if len(known) < 2:
      if known and known[0][1]:
        return known[0][0] * self.limit / known[0][1]
      return None
    fit = [(b, m) for b, m in known if m <= self.limit]
    ends = [(b, m) for b, m in known if b in (lo, hi)]
    guesses = []
    if len(fit) >= 2:
      guesses.append(self._secant(*fit[-2:]))
    if len(ends) == 2:
      guesses.append(self._secant(*ends))
    if not guesses:
      near = sorted(known, key=lambda bm: abs(bm[1] - self.limit))[:2]
      guesses.append(self._secant(*near))
    guesses = [g for g in guesses if g is not None]
    if hi is not None:
      guesses = [min(g, hi) for g in guesses]
    if guesses:
      return sum(guesses) / len(guesses)
    return 4.0 * max(lo, 1) if hi is None else None

  def next(self) -> Optional[int]:
    lo, hi = self._bracket()
    self.predicted = self._predict(lo, hi)
    if len(self.probes) >= self.steps:
      return None
    grain = 2 ** int(math.log2(lo / 16)) if lo >= 32 else 1
    if hi is not None and hi - lo <= grain:
      return None
    if self.predicted is None or not math.isfinite(self.predicted):
      cand = (lo + hi) // 2 if hi is not None else 2 * max(lo, 1)
    elif hi is None and self.predicted > 2 * lo:
      # Far past every measured point: compiled memory grows faster than
      # a line from small batches (on a CPU and a TPU the first secant
      # overshot by 10 to 20%), so aim short, for a lower bound that fits.
      cand = int(lo + SHORT * (self.predicted - lo)) // grain * grain
    else:
      cand = int(self.predicted) // grain * grain
    if hi is not None:
      # Safeguarded: at least 1/16 of the bracket from either end (a
      # secant alone creeps along a convex memory curve).
      quarter = (hi - lo) // 16
      cand = max(min(cand, hi - max(grain, quarter)), lo + max(grain, quarter))
      cand = cand // grain * grain if cand // grain * grain > lo else cand
    cand = max(min(cand, self.cap), lo + grain)
    if hi is not None and cand >= hi:
      cand = (lo + hi) // 2
    return cand if lo < cand <= self.cap else None

  def add(self, b: int, measured: Optional[int],
          error: Optional[str] = None) -> None:
    """Records a measurement (None: does not fit, ``error`` says why)."""
    self.pts[int(b)] = measured
    self.probes.append([int(b), measured] + ([error] if error else []))

  def result(self) -> dict:
    lo, hi = self._bracket()
    self.predicted = self._predict(lo, hi)
    return {"max_batch": lo, "first_over": hi,
            "predicted": (None if self.predicted is None
                          else float(self.predicted)),
            "probes": self.probes}


def largest_fitting(measure: Callable[[int], Optional[int]],
                    points: dict, limit: int, steps: int,
                    cap: int = 1 << 20) -> dict:
  """The largest batch ``B`` with ``measure(B) <= limit``, by a secant search.

  Args:
    measure: ``B -> bytes`` (None or an exception: does not fit, e.g. a
      compile that fails).
    points: ``{B: bytes}`` already measured (at least one).
    limit: the budget in bytes.
    steps: at most this many calls of ``measure``.
    cap: no ``B`` above this is tried.

  Returns:
    ``{"max_batch"`` (the largest measured ``B`` that fits, 0 if none),
    ``"first_over"`` (the smallest measured ``B`` over the budget, None if
    none), ``"predicted"`` (the secant's last estimate), ``"probes"``
    (``[[B, bytes], ...]`` in the order measured)``}``. Each probe is the
    secant's estimate rounded down to a grain of about 1/16 of the largest
    fitting ``B``; the search stops when the bracket is one grain wide.
  """
  search = Search(points, limit, steps, cap)
  while (b := search.next()) is not None:
    try:
      search.add(b, measure(b))
    except Exception as e:  # pylint: disable=broad-except
      search.add(b, None, jax_methods.first_line(e))
  return search.result()


# -- one model ---------------------------------------------------------------

def _total(c) -> Optional[int]:
  if isinstance(c, Exception):
    return None
  return c.memory()["total_bytes"]


def _record(bench, scale, method, status, **extra) -> dict:
  rec = {"suite": "real", "scale": scale, "model": bench.name,
         "description": bench.description, "method": method,
         "batch_size": bench.batch_size, "seq_len": bench.seq_len,
         "status": status, "time": None, "memory": None,
         "microbatch_size": None, "agreement": None, "compile_s": None}
  rec.update(extra)
  return rec


def _leaves(tree) -> np.ndarray:
  return np.concatenate([np.asarray(a, np.float64).ravel()
                         for a in jax.tree.leaves(tree)])


def _grads(method: str, out):
  """The clipped sum of a DP step's output."""
  return out[0] if method in ("dp_all", "dp_layer") else out


def _microbatches(b: int) -> list[int]:
  """Power-of-two microbatch sizes below ``b`` that divide it, largest
  first."""
  out, m = [], 1
  while m < b:
    if b % m == 0:
      out.append(m)
    m *= 2
  return out[::-1]


def _time(compiled: dict, opts: Options, desc: str, log=print) -> dict:
  """method -> time entry (seconds), ratios to ``plain``."""
  timer = opts.timer
  if timer == "auto":
    timer = "wall" if jax.default_backend() == "cpu" else "device"
  out = {}
  if timer == "wall":
    runs = {m: c.run for m, c in compiled.items()}
    base = {m: ("plain" if m != "plain" and "plain" in runs else None)
            for m in runs}
    times = harness.time_steps(runs, base, repeats=opts.repeats,
                               rounds=opts.rounds, warmup=1,
                               min_block_s=0.0, progress=opts.progress,
                               desc=desc)
    for m, t in times.items():
      out[m] = {"timer": "wall", "median_s": t["median_s"],
                "q25_s": t["q25_s"], "q75_s": t["q75_s"],
                "n_steps": t["n_steps"], "ratio": t["ratio"]}
    return out
  for m, c in compiled.items():
    t0 = time.perf_counter()
    s = device_time.dispatched_step_s(c.dispatch, k=opts.k,
                                      reps=opts.rounds, calls=opts.repeats)
    # (None where unresolved: a NaN is not JSON.)
    out[m] = {"timer": "device", "median_s": None if math.isnan(s) else s,
              "q25_s": None, "q75_s": None, "n_steps": opts.k,
              "ratio": None}
    log(f"    {m}: device time {device_time.format_time(s, 'ms')} "
        f"(measured in {time.perf_counter() - t0:.1f} s)")
  plain = out.get("plain", {}).get("median_s")
  for m, t in out.items():
    if plain and m != "plain" and t["median_s"] is not None:
      t["ratio"] = t["median_s"] / plain
  return out


def run_model(name: str, opts: Options, log=print) -> tuple[list, list]:
  """``(records, fits)``: one record per batch size and method, and one
  largest-batch entry per method. Every program of a phase (the timed
  steps of both batch sizes; the microbatched jax-privacy steps; each
  round of the largest-batch search) compiles at once
  (:func:`benchmarks.harness.compile_many`)."""
  limit = budget(opts)
  hard = device_limit() if jax.default_backend() != "cpu" else None
  methods = [m for m in METHODS if m in opts.methods]
  if "plain" not in methods:
    methods.insert(0, "plain")
  sizes = batch_sizes(name, opts)
  preps, params = {}, None
  for b in sizes:
    preps[b] = jax_methods.prepare(make(name, opts.scale, b), params=params,
                                   gram_precision=opts.gram_precision)
    params = preps[b].params
  n_params = int(sum(a.size for a in jax.tree.leaves(params)))
  log(f"  {name}: {preps[sizes[0]].bench.description}; "
      f"{n_params / 1e6:.2f}M parameters; B = {sizes}")

  # Phase 1: every timed program, and jax-privacy's per-layer reference.
  keys, jobs = [], []
  for b in sizes:
    for method in methods + (["jaxp_layer"] if "dp_layer" in methods
                             else []):
      try:
        step = (jaxp_step(preps[b], per_layer=True) if method == "jaxp_layer"
                else build(preps[b], method))
      except Exception as e:  # pylint: disable=broad-except
        step = (_raise(e), ())
      keys.append((b, method))
      jobs.append(step)
  t0 = time.perf_counter()
  done = dict(zip(keys, harness.compile_many(jobs)))
  log(f"    {len(jobs)} programs compiled in {time.perf_counter() - t0:.1f} s")
  totals = {m: {b: _total(done[(b, m)]) for b in sizes} for m in methods}
  micro = {}
  # Phase 2: jax-privacy microbatched where it does not fit.
  fit_limit = hard or limit
  redo = [b for b in sizes if "jaxp_clipped" in methods
          and _total(done[(b, "jaxp_clipped")]) is not None
          and _total(done[(b, "jaxp_clipped")]) > fit_limit]
  if redo:
    keys, jobs = [], []
    for b in redo:
      for mb in _microbatches(b):
        keys.append((b, mb))
        jobs.append(jaxp_step(preps[b], mb))
    t0 = time.perf_counter()
    got = dict(zip(keys, harness.compile_many(jobs)))
    log(f"    {len(jobs)} microbatched jax-privacy programs compiled in "
        f"{time.perf_counter() - t0:.1f} s")
    for b in redo:
      ok = [mb for mb in _microbatches(b) if _total(got[(b, mb)]) is not None
            and _total(got[(b, mb)]) <= fit_limit]
      mb = ok[0] if ok else 1
      micro[b] = mb
      done[(b, "jaxp_clipped")] = got[(b, mb)]

  records = []
  for b in sizes:
    bench = preps[b].bench
    compiled, recs = {}, {}
    for method in methods:
      c = done[(b, method)]
      if isinstance(c, Exception):
        recs[method] = _record(bench, opts.scale, method, "unsupported: " +
                               jax_methods.first_line(c), params=n_params)
        log(f"    {method} B={b}: {recs[method]['status']}")
        continue
      rec = _record(bench, opts.scale, method, "ok", params=n_params,
                    microbatch_size=micro.get(b) if method == "jaxp_clipped"
                    else None, compile_s=c.compile_s)
      rec["memory"] = c.memory()
      recs[method] = rec
      if hard is not None and _total(c) is not None and _total(c) > hard:
        rec["status"] = (f"does not fit: {_total(c) / 2**30:.2f} GiB > "
                         f"{hard / 2**30:.2f} GiB")
        log(f"    {method} B={b}: {rec['status']}")
        continue
      compiled[method] = c
    plain_mem = recs.get("plain", {}).get("memory") or {}
    for rec in recs.values():
      mem = rec.get("memory")
      if mem and plain_mem.get("temp_bytes"):
        mem["temp_ratio"] = mem["temp_bytes"] / plain_mem["temp_bytes"]
    ref = done.get((b, "jaxp_layer"))
    if (ref is not None and not isinstance(ref, Exception) and hard
        and _total(ref) > hard):
      try:
        ref = harness.compile_jax(*jaxp_step(preps[b], micro.get(b) or 1,
                                             per_layer=True))
      except Exception as e:  # pylint: disable=broad-except
        ref = e
    _agreement(compiled, ref, recs, opts, log)
    if compiled:
      times = _time(compiled, opts, f"{name} B={b}", log)
      for m, t in times.items():
        recs[m]["time"] = t
    for m in methods:
      if m in recs:
        records.append(recs[m])
        r = recs[m]
        t, mem = r["time"], r["memory"] or {}
        log(f"    B={b} {m:13s} " + (
            f"{device_time.format_time(t['median_s'], 'ms'):>12s} "
            f"({t['ratio'] or 1:.2f}x), temp "
            f"{(mem.get('temp_bytes') or 0) / 2**20:.1f} MiB" if t else
            r["status"]))

  # Phase 3: the largest batch in the budget, every method's search at once.
  searches = {m: Search({b: v for b, v in totals[m].items()}, limit,
                        opts.fit_steps) for m in methods
              if any(v is not None for v in totals[m].values())}
  t0 = time.perf_counter()
  while True:
    want = {m: s.next() for m, s in searches.items()}
    want = {m: b for m, b in want.items() if b is not None}
    if not want:
      break
    jobs = []
    for m, b in want.items():
      p = jax_methods.prepare(make(name, opts.scale, b), params=params,
                              gram_precision=opts.gram_precision,
                              abstract=True)
      try:
        jobs.append(jaxp_step(p) if m == "jaxp_clipped" else build(p, m))
      except Exception as e:  # pylint: disable=broad-except
        jobs.append((_raise(e), ()))
    for (m, b), c in zip(want.items(), harness.compile_many(jobs)):
      searches[m].add(b, _total(c), jax_methods.first_line(c)
                      if isinstance(c, Exception) else None)
  fits = []
  for m, s in searches.items():
    found = s.result()
    found.update(model=name, method=m, budget_bytes=limit, scale=opts.scale)
    log(f"    {m:13s} largest batch in {limit / 2**30:.3g} GiB: "
        f"{found['max_batch']} (first over: {found['first_over']}; "
        f"secant {found['predicted'] or 0:.0f}; probes {found['probes']})")
    fits.append(found)
  log(f"    largest-batch search: {time.perf_counter() - t0:.1f} s")
  return records, fits


def _raise(e: Exception):
  def fail(*_):
    raise e
  return fail


def _agreement(compiled: dict, layer_ref, recs: dict, opts: Options,
               log) -> None:
  """Runs each method once and records its agreement with its reference
  (``layer_ref``: jax-privacy's per-layer clipped sum, compiled)."""
  outs = {}

  def out(method):
    if method not in outs:
      outs[method] = compiled[method].run()
    return outs[method]
  pairs = [("dp_all", "jaxp_clipped"), ("gram", "naive"),
           ("dp_layer", "jaxp_layer")]
  if layer_ref is not None and not isinstance(layer_ref, Exception):
    compiled = {**compiled, "jaxp_layer": layer_ref}
  for method, ref in pairs:
    if method in compiled and ref in compiled:
      try:
        if method == "gram":
          got, want = out(method)[2], out(ref)[2]
        else:
          got, want = _grads(method, out(method)), out(ref)
        err = reference.relative_error(_leaves(got), _leaves(want))
        recs[method]["agreement"] = {
            "reference": ("jaxp_clipped per-layer" if ref == "jaxp_layer"
                          else ref), "max_rel_diff": err}
      except Exception as e:  # pylint: disable=broad-except
        log(f"    {method}: agreement not measured "
            f"({jax_methods.first_line(e)})")
  outs.pop("jaxp_layer", None)
  if opts.keep_outputs:
    for m, o in outs.items():
      recs[m]["output"] = o


def run(opts: Options, log=print) -> dict:
  """Every model: ``{"records": [...], "fits": [...], "budget_bytes"}``."""
  records, fits = [], []
  for name in opts.models:
    log(f"model {name} ({opts.scale}) ...")
    r, f = run_model(name, opts, log)
    records += r
    fits += f
  return {"records": records, "fits": fits, "budget_bytes": budget(opts)}
