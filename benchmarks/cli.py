"""``python -m benchmarks``: command line of the benchmark runner.

Examples::

  python -m benchmarks                                  # models suite
  python -m benchmarks --model mlp --method plain,gram,norms
  python -m benchmarks --model lm --batch_size 4 --seq_len 64
  python -m benchmarks --suite scaling --out docs/perf  # curves for the docs
  python -m benchmarks --suite all --out docs/perf      # everything
  python -m benchmarks --suite real --scale cpu         # WRN, ViT, GPT
  python -m benchmarks --suite real --scale full        # the same, a TPU

Outputs in ``--out``: ``<suite>.json`` (every figure, the environment and
the command), ``<suite>*.png`` and ``<suite>*_table.inc`` (reStructuredText
tables kept in ``benchmarks/README.md`` and ``docs/performance.rst``); the
tables are also printed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import Optional, Sequence

from benchmarks import jax_methods
from benchmarks import models
from benchmarks import realistic
from benchmarks import report
from benchmarks import runner
from benchmarks import scaling
from benchmarks import torch_peers
from gram_haiku._src.compute import cost_model

ALL_METHODS = jax_methods.JAX_METHODS + torch_peers.TORCH_METHODS


def _csv(kind, choices=None):
  def parse(text):
    items = [s.strip() for s in text.split(",") if s.strip()]
    if choices is not None:
      bad = [s for s in items if s not in choices]
      if bad:
        raise argparse.ArgumentTypeError(
            f"unknown {kind} {bad}; choose from {', '.join(choices)}")
    return items
  return parse


def _ints(text):
  return [int(s) for s in text.split(",") if s.strip()]


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m benchmarks",
      description="Step time, memory and FLOPs of gram_haiku against plain "
      "value_and_grad, naive vmap(grad) and (with the bench-torch extra) "
      "Opacus and BackPACK.")
  p.add_argument("--suite", choices=("models", "scaling", "all", "real"),
                 default="models",
                 help="models: the step-time table of every model and "
                 "method; scaling: the B and T sweeps; all: both; real: "
                 "WRN-16-4, ViT-S/4 and a GPT-2-style decoder against "
                 "jax-privacy (see --scale; not part of all) "
                 "(default: %(default)s)")
  p.add_argument("--model", type=_csv("model", models.MODEL_NAMES +
                                      models.REAL_MODEL_NAMES),
                 default=None,
                 help="comma-separated: " + ",".join(models.MODEL_NAMES) +
                 " (models suite), " + ",".join(models.REAL_MODEL_NAMES) +
                 " (real suite) (default: all of the suite's)")
  p.add_argument("--method", type=_csv("method", ALL_METHODS),
                 default=None,
                 help="comma-separated, default all: " + ",".join(ALL_METHODS)
                 + " (real suite: " + ",".join(realistic.METHODS) + ")")
  p.add_argument("--batch_size", type=int, default=None,
                 help="B for every model (default: mlp 128, cnn 64, lm 8, "
                 "lstm 64, tiny_mlp 32, small_cnn 32, attn64 16)")
  p.add_argument("--seq_len", type=int, default=None,
                 help="T for lm (128) and lstm (32)")
  p.add_argument("--hidden", type=_ints, default=None,
                 help="MLP hidden sizes (default 512,512)")
  p.add_argument("--strategy", choices=("auto", "ghost", "materialize"),
                 default="auto", help="track(strategy=...)")
  p.add_argument("--gram_precision", choices=("highest", "high", "default"),
                 default="highest",
                 help="track(gram_precision=...): the Gram kernels' matmul "
                      "precision (lower is faster on a TPU or GPU)")
  p.add_argument("--tied", choices=models.TIED_FORMS, default="auto",
                 help="lm output layer: gram_haiku.unembed(embed, h) "
                 "(auto: when available) or raw h @ embed.embeddings.T")
  p.add_argument("--repeats", type=int, default=None,
                 help="timed steps per method per round (default 4; real "
                 "suite 3: on an accelerator, timed calls of each run of k "
                 "+ 1 and of 1 dispatched steps)")
  p.add_argument("--rounds", type=int, default=None,
                 help="rounds; methods interleaved, order rotated (default "
                 "8; real suite 2: on an accelerator, the device-time "
                 "differences whose median is taken)")
  p.add_argument("--scale", choices=realistic.SCALE_NAMES, default="cpu",
                 help="real suite: full (the issue's sizes, an "
                 "accelerator), cpu (scaled down) or smoke (tiny) "
                 "(default: %(default)s)")
  p.add_argument("--memory_budget_gb", type=float, default=None,
                 help="real suite: the budget of the largest-batch search "
                 "in GiB (default: the device's limit; on a CPU 16 (full), "
                 "1 (cpu), 1/256 (smoke))")
  p.add_argument("--fit_steps", type=int, default=2,
                 help="real suite: compiles per method of the largest-batch "
                 "search (default: %(default)s)")
  p.add_argument("--timer", choices=("auto", "wall", "device"),
                 default="auto",
                 help="real suite: device time (k + 1 steps dispatched back "
                 "to back against one, benchmarks.device_time; auto: off a "
                 "CPU) or wall time (default: %(default)s)")
  p.add_argument("--merge", action="store_true",
                 help="real suite: keep the other models' results of the "
                 "JSON already in --out (one table from runs of one model "
                 "each)")
  p.add_argument("--no_pallas", action="store_true",
                 help="real suite: XLA's paths only (the cost model's "
                 "Pallas kernels off: cost_model.PALLAS_GHOST_GRAM and "
                 "PALLAS_CONV_GRADS emptied), to measure what the kernels "
                 "bring to a whole step")
  p.add_argument("--k", type=int, default=4,
                 help="real suite, device time: k + 1 steps dispatched "
                 "against one (default: %(default)s)")
  p.add_argument("--warmup", type=int, default=2,
                 help="untimed steps per method after compilation "
                 "(default: %(default)s)")
  p.add_argument("--min_block_s", type=float, default=0.25,
                 help="fast steps repeat (up to 50 per block) until a block "
                 "lasts this long; 0: exactly --repeats")
  p.add_argument("--no_check", action="store_true",
                 help="skip the coverage and vmap(grad) check")
  p.add_argument("--check_rtol", type=float, default=1e-3,
                 help="tolerance of the correctness check, relative to the "
                 "largest reference entry (a TPU's default matmul precision "
                 "rounds float32 inputs to bfloat16: use about 3e-2 there)")
  p.add_argument("--allow_partial", action="store_true",
                 help="time tracked methods with untracked parameters too")
  p.add_argument("--no_torch", action="store_true",
                 help="leave out the torch peers")
  p.add_argument("--sweep", type=_csv("sweep", ("batch", "seq")),
                 default=["batch", "seq"], help="scaling sweeps to run")
  p.add_argument("--batch_sizes", type=_ints, default=None,
                 help="scaling: B values (default 16,...,4096); real: the "
                 "two batch sizes of every model")
  p.add_argument("--seq_lens", type=_ints, default=None,
                 help="scaling: T values (default 1,...,1024)")
  p.add_argument("--scaling_repeats", type=int, default=3,
                 help="scaling: timed steps per point per round "
                 "(default: %(default)s)")
  p.add_argument("--scaling_rounds", type=int, default=5,
                 help="scaling: rounds per point; the median is reported "
                 "(default: %(default)s)")
  p.add_argument("--out", default="bench_out",
                 help="output directory (default ./bench_out)")
  p.add_argument("--no_progress", action="store_true",
                 help="hide the progress bar (hidden anyway when stderr is "
                 "not a terminal)")
  p.add_argument("--replot", action="store_true",
                 help="only rebuild tables and plots from the JSON in --out")
  return p


def replot(out: str) -> int:
  """Rebuilds the ``.inc`` tables and PNGs from ``<out>/*.json``."""
  import json  # pylint: disable=g-import-not-at-top
  found = False
  path = os.path.join(out, "models.json")
  if os.path.exists(path):
    found = True
    with open(path) as f:
      data = json.load(f)
    header, rows = report.model_rows(data["records"])
    print(report.text_table(header, rows))
    with open(os.path.join(out, "models_table.inc"), "w") as f:
      f.write(report.rst_table(header, rows))
    report.plot_models(data["records"], os.path.join(out, "models.png"),
                       "Step-time ratio to own plain backward: " +
                       _title(data["environment"]))
  for scale in realistic.SCALE_NAMES:
    path = os.path.join(out, f"real_{scale}.json")
    if os.path.exists(path):
      found = True
      with open(path) as f:
        data = json.load(f)
      _real_outputs(data, out, scale)
  path = os.path.join(out, "scaling.json")
  if os.path.exists(path):
    found = True
    with open(path) as f:
      data = json.load(f)
    recs = data["records"]
    _scaling_outputs(recs, sorted({r["sweep"] for r in recs}), out,
                     data["environment"])
  if not found:
    print(f"no models.json, scaling.json or real_*.json in {out}",
          file=sys.stderr)
    return 2
  return 0


def _scaling_outputs(records, sweeps, out, env) -> None:
  for sweep in sweeps:
    recs = [r for r in records if r["sweep"] == sweep]
    with open(os.path.join(out, f"scaling_{sweep}_table.inc"), "w") as f:
      f.write(report.rst_table(*report.scaling_rows(recs)))
  if "batch" in sweeps:
    report.plot_batch_sweep(records, os.path.join(out, "scaling_batch.png"),
                            "MLP 784-512-512-10: " + _title(env))
  if "seq" in sweeps:
    report.plot_seq_sweep(
        records, os.path.join(out, "scaling_seq.png"),
        f"hk.Linear(256) on f32[B=32, T, 256]: {_title(env)}")


def _real_outputs(data: dict, out: str, scale: str) -> None:
  """Prints the real suite's table and writes it as ``.inc``."""
  print(report.text_table(*report.real_rows(data), max_status=200))
  with open(os.path.join(out, f"real_{scale}_table.inc"), "w") as f:
    f.write(report.real_rst(data))


def _main_real(args, argv) -> int:
  """``--suite real``: writes ``real_<scale>.json`` and its table."""
  bad = [m for m in args.model or () if m not in models.REAL_MODEL_NAMES]
  bad += [m for m in args.method or () if m not in realistic.METHODS]
  if bad:
    parser().error(f"not in the real suite: {bad}")
  os.makedirs(args.out, exist_ok=True)
  kept = cost_model.PALLAS_GHOST_GRAM, cost_model.PALLAS_CONV_GRADS
  if args.no_pallas:
    cost_model.PALLAS_GHOST_GRAM = cost_model.PALLAS_CONV_GRADS = ()
  try:
    return _run_real(args, argv)
  finally:
    cost_model.PALLAS_GHOST_GRAM, cost_model.PALLAS_CONV_GRADS = kept


def _run_real(args, argv) -> int:
  """:func:`_main_real` with the cost model as the options set it."""
  env = environment()
  if argv is not None:
    env["command"] = " ".join(["python -m benchmarks", *argv])
  log = lambda s: print(s, flush=True)
  log(f"# {_title(env)}; {env['command']}")
  opts = realistic.Options(
      models=args.model or list(models.REAL_MODEL_NAMES),
      methods=args.method or list(realistic.METHODS), scale=args.scale,
      batch_sizes=args.batch_sizes,
      budget_bytes=(None if args.memory_budget_gb is None
                    else int(args.memory_budget_gb * 2**30)),
      fit_steps=args.fit_steps, timer=args.timer,
      repeats=3 if args.repeats is None else args.repeats,
      rounds=2 if args.rounds is None else args.rounds, k=args.k,
      gram_precision=args.gram_precision,
      progress=not args.no_progress)
  t0 = time.perf_counter()
  result = realistic.run(opts, log)
  env["wall_s"] = time.perf_counter() - t0
  data = {"environment": env, "options": vars(args), **result}
  path = os.path.join(args.out, f"real_{args.scale}.json")
  if args.merge and os.path.exists(path):
    data = _merge_real(path, data, opts.models)
  report.write_json(path, data)
  log("")
  _real_outputs(data, args.out, args.scale)
  log(f"wrote {os.path.abspath(args.out)} in {env['wall_s']:.0f} s")
  return 0


def _merge_real(path: str, data: dict, ran) -> dict:
  """``data`` with the models of ``path``'s JSON that this run left out
  (their records, largest batches and environment, under ``"merged"``)."""
  import json  # pylint: disable=g-import-not-at-top
  with open(path) as f:
    old = json.load(f)
  if old.get("budget_bytes") != data["budget_bytes"]:
    print(f"note: {path} had another memory budget; not merged")
    return data
  keep = lambda rows: [r for r in rows if r["model"] not in ran]
  kept = keep(old["records"])
  if kept:
    merged = old.get("merged", []) + [
        {"models": sorted({r["model"] for r in kept}),
         "environment": old["environment"]}]
    merged = [m for m in merged if set(m["models"]) - set(ran)]
    data = {**data, "records": kept + data["records"],
            "fits": keep(old.get("fits", [])) + data["fits"],
            "merged": merged}
  return data


def environment() -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  env = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
         "command": " ".join(["python -m benchmarks", *sys.argv[1:]]),
         "python": platform.python_version(),
         "platform": platform.platform(),
         "cpu_count": os.cpu_count(),
         "jax": jax.__version__, "backend": jax.default_backend(),
         "devices": [str(d) for d in jax.devices()],
         "device_kind": jax.devices()[0].device_kind,
         "gram_haiku": gram_haiku.__version__}
  if torch_peers.available():
    env.update(torch_peers.versions())
  env["git"] = _git_state()
  return env


def _git_state() -> Optional[str]:
  """``<commit>`` or ``<commit>+dirty`` of the checkout, None outside git."""
  import subprocess  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  try:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                          capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--",
                            "gram_haiku"], cwd=root, capture_output=True,
                           text=True, timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return None
  return head + ("+dirty" if dirty else "")


def _title(env) -> str:
  return (f"{env['device_kind']} ({env['backend']}, {env['cpu_count']} CPU "
          f"cores), jax {env['jax']}")


def main(argv: Optional[Sequence[str]] = None) -> int:
  args = parser().parse_args(argv)
  if args.replot:
    return replot(args.out)
  if args.suite == "real":
    return _main_real(args, argv)
  bad = [m for m in args.model or () if m not in models.MODEL_NAMES]
  if bad:
    parser().error(f"--model {bad}: only in --suite real")
  args.model = args.model or list(models.MODEL_NAMES)
  args.method = args.method or list(ALL_METHODS)
  args.repeats = 4 if args.repeats is None else args.repeats
  args.rounds = 8 if args.rounds is None else args.rounds
  os.makedirs(args.out, exist_ok=True)
  env = environment()
  if argv is not None:
    env["command"] = " ".join(["python -m benchmarks", *argv])
  log = lambda s: print(s, flush=True)
  log(f"# {_title(env)}; {env['command']}")
  model_records, scaling_records = [], []

  if args.suite in ("models", "all"):
    methods = [m for m in args.method
               if not (args.no_torch and m in torch_peers.TORCH_METHODS)]
    opts = runner.Options(
        models=args.model, methods=methods, batch_size=args.batch_size,
        seq_len=args.seq_len, hidden=args.hidden, strategy=args.strategy,
        gram_precision=args.gram_precision, tied=args.tied,
        repeats=args.repeats, rounds=args.rounds, warmup=args.warmup,
        min_block_s=args.min_block_s, check=not args.no_check,
        check_rtol=args.check_rtol, allow_partial=args.allow_partial,
        progress=not args.no_progress)
    if args.repeats * args.rounds < 20:
      log(f"note: {args.repeats * args.rounds} timed steps per method "
          "(fewer than 20)")
    model_records = runner.run(opts, log)
    header, rows = report.model_rows(model_records)
    log("\n" + report.text_table(header, rows))
    log("ratio: step time / the same framework's plain step, median over "
        "rounds (IQR); mem: XLA compiled temp bytes (jax) or profiler peak "
        "allocation (torch); * = program has loops: cost_analysis counts a "
        "loop body once, and the min FLOP ratio is against the analytic "
        "plain count")
    rows_t = report.targets(model_records)
    log("\n" + report.targets_text(rows_t[:-1]))
    report.write_json(os.path.join(args.out, "models.json"),
                      {"environment": env, "options": vars(args),
                       "records": model_records,
                       "targets": rows_t[:-1]})
    with open(os.path.join(args.out, "models_table.inc"), "w") as f:
      f.write(report.rst_table(header, rows))
    report.plot_models(model_records, os.path.join(args.out, "models.png"),
                       "Step-time ratio to own plain backward: " + _title(env))

  if args.suite in ("scaling", "all"):
    sopts = scaling.ScalingOptions(
        repeats=args.scaling_repeats, rounds=args.scaling_rounds,
        min_block_s=args.min_block_s,
        progress=not args.no_progress)
    if args.batch_sizes:
      sopts.batch_sizes = tuple(args.batch_sizes)
    if args.seq_lens:
      sopts.seq_lens = tuple(args.seq_lens)
    scaling_records = scaling.run(sopts, args.sweep, log)
    header, rows = report.scaling_rows(scaling_records)
    log("\n" + report.text_table(header, rows))
    rows_t = report.targets([], scaling_records)[-1:]
    log("\n" + report.targets_text(rows_t))
    switches = {m: report.switch_points(scaling_records, m)
                for m in ("gram", "norms")}
    log(f"cost-model switch (ghost -> materialize) at T = {switches}")
    report.write_json(os.path.join(args.out, "scaling.json"),
                      {"environment": env, "options": vars(args),
                       "records": scaling_records, "switch_points": switches,
                       "targets": rows_t})
    _scaling_outputs(scaling_records, args.sweep, args.out, env)
  log(f"wrote {os.path.abspath(args.out)}")
  return 0
