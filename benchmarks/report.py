"""Tables (terminal and reStructuredText), JSON, plots, and the targets."""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

#: Performance targets: (name, model, method, field, bound, "<=" | ">=").
TARGETS = (
    ("MLP B=128 full Gram step / plain", "mlp", "gram", "ratio", 1.15, "<="),
    ("CNN full Gram step / plain", "cnn", "gram", "ratio", 1.3, "<="),
    ("LM full Gram step / plain", "lm", "gram", "ratio", 1.3, "<="),
    ("MLP norms step / plain", "mlp", "norms", "ratio", 1.08, "<="),
    ("MLP naive vmap(grad) / full Gram", "mlp", "naive", "naive_speedup",
     50.0, ">="),
    ("MLP B=128 full Gram temp memory / plain", "mlp", "gram", "temp_ratio",
     1.2, "<="),
    # The DP step's clipped gradient (no noise): issue "reweighting".
    ("MLP B=128 DP all-layer clipped grad / plain", "mlp", "dp_all", "ratio",
     1.15, "<="),
    ("CNN DP all-layer clipped grad / plain", "cnn", "dp_all", "ratio", 1.3,
     "<="),
    ("LM DP all-layer clipped grad / plain", "lm", "dp_all", "ratio", 1.3,
     "<="),
    ("MLP DP all-layer temp memory / plain", "mlp", "dp_all", "temp_ratio",
     1.3, "<="),
    ("CNN DP all-layer temp memory / plain", "cnn", "dp_all", "temp_ratio",
     1.3, "<="),
    ("LM DP all-layer temp memory / plain", "lm", "dp_all", "temp_ratio",
     1.3, "<="),
    # Shared modules in loops (issue "performance round 2").
    ("LSTM full Gram step / plain", "lstm", "gram", "ratio", 3.0, "<="),
    ("LSTM norms step / plain", "lstm", "norms", "ratio", 1.3, "<="),
) + tuple(
    # Never slower than naive vmap(grad) + F F^T, on every model.
    (f"{m} naive vmap(grad) / full Gram", m, "naive", "naive_speedup", 1.0,
     ">=") for m in ("cnn", "lm", "lstm", "tiny_mlp", "small_cnn", "attn64"))
MLP_DESCRIPTION = "MLP 784-512-512-10"
#: Scaling target: norms temp memory at the largest B.
SCALING_TARGET = ("MLP B=4096 norms temp memory / plain", 4096, 2.0)


def _fmt_ms(s: Optional[float]) -> str:
  return "-" if s is None else f"{s * 1e3:.2f}"


def _fmt_x(r: Optional[float], digits=2) -> str:
  return "-" if r is None else f"{r:.{digits}f}x"


def _fmt_mb(b: Optional[float]) -> str:
  if b is None:
    return "-"
  return f"{b / 2**20:.1f}" if b >= 2**20 else f"{b / 2**20:.3f}"


def model_rows(records: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
  """Header and rows of the ``models`` table."""
  header = ["model", "B", "T", "framework", "method", "status",
            "step ms (IQR)", "ratio (IQR)", "temp/peak MB", "mem ratio",
            "GFLOP", "FLOP ratio", "min FLOP ratio"]
  rows = []
  for r in records:
    t, m, f = r.get("time"), r.get("memory") or {}, r.get("flops") or {}
    step = ratio = "-"
    if t:
      step = (f"{_fmt_ms(t['median_s'])} "
              f"({_fmt_ms(t['q25_s'])}-{_fmt_ms(t['q75_s'])})")
      if t["ratio"] is not None:
        ratio = (f"{t['ratio']:.2f}x "
                 f"({t['ratio_q25']:.2f}-{t['ratio_q75']:.2f})")
    mem = m.get("temp_bytes", m.get("peak_alloc_bytes"))
    mem_ratio = m.get("temp_ratio", m.get("peak_ratio"))
    gflop = "-" if not f.get("measured") else f"{f['measured'] / 1e9:.3f}"
    min_ratio = _fmt_x(f.get("analytic_min_ratio"))
    if f.get("loops_counted_once") and gflop != "-":
      gflop += "*"
      if min_ratio != "-":
        min_ratio += "*"
    rows.append([r["model"], str(r["batch_size"]),
                 str(r["seq_len"] or "-"), r["framework"], r["method"],
                 r["status"], step, ratio, _fmt_mb(mem), _fmt_x(mem_ratio),
                 gflop, _fmt_x(f.get("ratio")), min_ratio])
  return header, rows


def text_table(header, rows, max_status=48) -> str:
  rows = [[c if i != 5 or len(c) <= max_status else c[:max_status - 3] +
           "..." for i, c in enumerate(row)] for row in rows]
  widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
            for i, h in enumerate(header)]
  line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))
  out = [line(header), line(["-" * w for w in widths])]
  out += [line(r) for r in rows]
  return "\n".join(out)


def rst_table(header, rows, title: str = "") -> str:
  """A ``list-table`` directive (safe for long cells)."""
  out = [f".. list-table:: {title}".rstrip(), "   :header-rows: 1", ""]
  for row in [header, *rows]:
    out.append("   * - " + _rst_cell(row[0]))
    out += ["     - " + _rst_cell(c) for c in row[1:]]
  return "\n".join(out) + "\n"


def _rst_cell(text: str) -> str:
  text = str(text).replace("*", r"\*").replace("`", "'").replace("|", "/")
  if text.startswith(("-", "+")):  # not a bullet list
    text = "\\" + text
  return text if text.strip() else "\\ "


def targets(records: Sequence[dict], scaling: Sequence[dict] = ()) -> list:
  """``[(name, bound, measured or None, "met" | "missed" | "n/a")]``."""
  by = {(r["model"], r["method"]): r for r in records
        if r.get("suite") == "models"}
  out = []
  for name, model, method, field, bound, op in TARGETS:
    value = None
    r = by.get((model, method))
    if r is not None and r.get("time"):
      if field == "ratio":
        value = r["time"]["ratio"]
      elif field == "temp_ratio":
        value = (r.get("memory") or {}).get("temp_ratio")
      elif field == "naive_speedup":
        g = by.get((model, "gram"))
        if g is not None and g.get("time"):
          value = r["time"]["median_s"] / g["time"]["median_s"]
    if model == "mlp" and r is not None and (
        r["batch_size"] != 128 or r["description"] != MLP_DESCRIPTION):
      value = None  # the targets are for the MLP at B=128
    out.append(_verdict(name, bound, op, value))
  name, b, bound = SCALING_TARGET
  value = next((r["memory"]["temp_ratio"] for r in scaling
                if r.get("sweep") == "batch" and r["x"] == b
                and r["method"] == "norms" and r.get("memory")), None)
  out.append(_verdict(name, bound, "<=", value))
  return out


def _verdict(name, bound, op, value):
  if value is None or (isinstance(value, float) and math.isnan(value)):
    return (name, f"{op} {bound}", None, "n/a")
  ok = value <= bound if op == "<=" else value >= bound
  return (name, f"{op} {bound}", value, "met" if ok else "missed")


def targets_text(rows) -> str:
  header = ["target", "bound", "measured", "verdict"]
  body = [[n, b, "-" if v is None else f"{v:.2f}", s] for n, b, v, s in rows]
  return text_table(header, body, max_status=200)


def write_json(path: str, payload: dict) -> None:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, default=str)


# -- plots -------------------------------------------------------------------

def _plt():
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  return plt


_COLORS = {"gram": "tab:blue", "norms": "tab:green", "naive": "tab:red",
           "opacus_ghost_norms": "tab:olive", "backpack_l2": "tab:cyan",
           "backpack_gram": "tab:purple", "plain": "black"}


def plot_models(records: Sequence[dict], path: str, title: str) -> None:
  """Grouped bars: step-time ratio to own plain, log scale, IQR whiskers."""
  plt = _plt()
  model_names = list(dict.fromkeys(r["model"] for r in records))
  methods = [m for m in _COLORS if m != "plain" and any(
      r["method"] == m for r in records)]
  fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(model_names)), 4.2))
  width = 0.8 / max(1, len(methods))
  for j, method in enumerate(methods):
    for i, model in enumerate(model_names):
      r = next((r for r in records if r["model"] == model
                and r["method"] == method), None)
      x = i + (j - (len(methods) - 1) / 2) * width
      if r is None:
        continue
      t = r.get("time")
      if t and t.get("ratio"):
        err = [[t["ratio"] - t["ratio_q25"]], [t["ratio_q75"] - t["ratio"]]]
        ax.bar(x, t["ratio"], width, color=_COLORS[method],
               label=method if i == 0 or not ax.containers else None,
               yerr=err, capsize=2)
        ax.text(x, t["ratio_q75"] * 1.08, f"{t['ratio']:.2f}",
                ha="center", va="bottom", fontsize=6, rotation=90)
      else:
        ax.text(x, 1.0, "n/a", ha="center", va="bottom", fontsize=6,
                rotation=90, color=_COLORS[method])
  handles = {}
  for c in ax.containers:
    lab = c.get_label()
    if lab and not lab.startswith("_"):
      handles.setdefault(lab, c)
  ax.legend(handles.values(), handles.keys(), fontsize=7, ncol=3)
  ax.axhline(1.0, color="black", lw=0.8)
  ax.set_yscale("log")
  ax.set_xticks(range(len(model_names)))
  ax.set_xticklabels(model_names)
  ax.set_ylabel("step time / own framework's plain step")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def plot_batch_sweep(records: Sequence[dict], path: str, title: str) -> None:
  plt = _plt()
  recs = [r for r in records if r.get("sweep") == "batch" and r.get("time")]
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  for method in ("plain", "norms", "gram"):
    pts = sorted((r["x"], r) for r in recs if r["method"] == method)
    if not pts:
      continue
    xs = [p[0] for p in pts]
    axes[0].plot(xs, [p[1]["time"]["median_s"] * 1e3 for p in pts], "o-",
                 color=_COLORS[method], label=method)
    if method != "plain":
      axes[1].plot(xs, [p[1]["time"]["ratio"] for p in pts], "o-",
                   color=_COLORS[method], label=method)
      axes[1].fill_between(xs, [p[1]["time"]["ratio_q25"] for p in pts],
                           [p[1]["time"]["ratio_q75"] for p in pts],
                           color=_COLORS[method], alpha=0.2)
      axes[2].plot(xs, [p[1]["memory"]["temp_ratio"] for p in pts], "o-",
                   color=_COLORS[method], label=method)
  plain_flops = {r["x"]: r["flops"]["measured"] for r in recs
                 if r["method"] == "plain" and r.get("flops")}
  for method in ("norms", "gram"):
    pts = sorted((r["x"], r["flops"]["analytic_extra_min"]) for r in recs
                 if r["method"] == method and r.get("flops")
                 and r["flops"].get("analytic_extra_min") is not None
                 and plain_flops.get(r["x"]))
    if pts:
      axes[1].plot([x for x, _ in pts],
                   [1 + e / plain_flops[x] for x, e in pts], ":",
                   color=_COLORS[method], label=f"{method}: FLOP floor")
  axes[0].set_ylabel("step time (ms)")
  axes[0].set_yscale("log")
  axes[1].set_ylabel("step time / plain")
  axes[2].set_ylabel("compiled temp memory / plain")
  for ax in axes[1:]:
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_yscale("log")
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B")
    ax.legend(fontsize=8)
  fig.suptitle(title + " (cost model: ghost at every B, T=1)", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def switch_points(records: Sequence[dict], method: str) -> list[int]:
  """T values where ``auto``'s measured choice changes (the new T)."""
  pts = sorted((r["x"], r["chosen"]) for r in records
               if r.get("sweep") == "seq" and r["method"] == method
               and r.get("strategy") == "auto")
  return [t for (_, a), (t, b) in zip(pts, pts[1:]) if a != b]


def plot_seq_sweep(records: Sequence[dict], path: str, title: str) -> None:
  plt = _plt()
  recs = [r for r in records if r.get("sweep") == "seq" and r.get("memory")]
  fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
  styles = {"auto": ("o-", "tab:blue"), "ghost": ("s--", "tab:orange"),
            "materialize": ("^--", "tab:green")}
  for row, method in enumerate(("gram", "norms")):
    for strategy, (style, color) in styles.items():
      pts = sorted((r["x"], r) for r in recs if r["method"] == method
                   and r["strategy"] == strategy)
      timed = [(x, r) for x, r in pts if r.get("time")]
      if timed:
        axes[row, 0].plot([x for x, _ in timed],
                          [r["time"]["ratio"] for _, r in timed], style,
                          color=color, label=f"{strategy}")
      axes[row, 1].plot([x for x, _ in pts],
                        [r["memory"]["temp_ratio"] for _, r in pts], style,
                        color=color, label=strategy)
    for t in switch_points(recs, method):
      for ax in axes[row]:
        ax.axvline(t, color="grey", ls=":", lw=1.2)
        ax.text(t, 1.0, f" auto switches at T={t}", rotation=90, fontsize=7,
                va="bottom", color="grey")
    axes[row, 0].set_ylabel(f"{method}: step time / plain")
    axes[row, 1].set_ylabel(f"{method}: temp memory / plain")
  for ax in axes.flat:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.legend(fontsize=8)
  for ax in axes[1]:
    ax.set_xlabel("within-example positions T")
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def scaling_rows(records: Sequence[dict]):
  header = ["sweep", "x", "method", "strategy", "auto chose", "step ms",
            "ratio (IQR)", "temp MB", "temp ratio"]
  rows = []
  for r in records:
    t, m = r.get("time"), r.get("memory") or {}
    ratio = "-"
    if t and t.get("ratio") is not None:
      ratio = f"{t['ratio']:.2f}x ({t['ratio_q25']:.2f}-{t['ratio_q75']:.2f})"
    rows.append([r["sweep"], str(r["x"]), r["method"],
                 str(r.get("strategy") or "-"),
                 str(r.get("chosen") or "-") if r.get("strategy") == "auto"
                 else "-",
                 _fmt_ms(t["median_s"]) if t else r.get("status", "-"),
                 ratio, _fmt_mb(m.get("temp_bytes")),
                 _fmt_x(m.get("temp_ratio"))])
  return header, rows


# -- the ``real`` suite ------------------------------------------------------

_REAL_AGAINST = {"jaxp_clipped": "jax-privacy", "naive": "vmap F F^T",
                 "jaxp_clipped per-layer": "jax-privacy per-layer"}


def real_rows(data: dict) -> tuple[list[str], list[list[str]]]:
  """Header and rows of the ``real`` suite's table from its JSON (one row
  per model, batch size and method)."""
  budget = data.get("budget_bytes")
  head_fit = ("largest B" if not budget else
              f"largest B in {budget / 2**30:.3g} GiB")
  header = ["model", "B", "method", "step ms", "x plain", "temp MiB",
            "x plain temp", head_fit, "max rel diff (vs)", "note"]
  fits = {(f["model"], f["method"]): f for f in data.get("fits", [])}
  rows = []
  for r in data["records"]:
    t, m = r.get("time"), r.get("memory") or {}
    f = fits.get((r["model"], r["method"]))
    largest = "-"
    if f is not None and f.get("probes") == [] and f.get("predicted"):
      # Nothing compiled past the timed batch sizes (--fit_steps 0).
      largest = f"~{int(f['predicted'])} (secant, not compiled)"
    elif f is not None:
      largest = str(f["max_batch"])
      if f.get("first_over") is None:
        largest = ">= " + largest
      elif f["first_over"] - f["max_batch"] > max(1, f["max_batch"] // 16):
        largest += f" (< {f['first_over']})"
    a = r.get("agreement")
    agree = "-" if not a else (
        f"{a['max_rel_diff']:.1e} "
        f"({_REAL_AGAINST.get(a['reference'], a['reference'])})")
    note = [] if r["status"] == "ok" else [r["status"]]
    if r.get("microbatch_size"):
      note.append(f"microbatch {r['microbatch_size']}")
    rows.append([r["model"], str(r["batch_size"]), r["method"],
                 _fmt_ms(t["median_s"]) if t else "-",
                 _fmt_x(t.get("ratio")) if t else "-",
                 _fmt_mb(m.get("temp_bytes")), _fmt_x(m.get("temp_ratio")),
                 largest, agree, "; ".join(note)])
  return header, rows


def real_rst(data: dict) -> str:
  """The ``real`` suite's JSON as a reStructuredText ``list-table``, titled
  with the hardware and the date (for ``docs/performance.rst``)."""
  env = data.get("environment") or {}
  timers = sorted({r["time"]["timer"] for r in data["records"]
                   if r.get("time") and r["time"].get("timer")})
  device = env.get("device_kind")
  if device and env.get("cpu_count"):
    device += f" ({env.get('backend')}, {env['cpu_count']} CPU cores)"
  title = ", ".join(str(x) for x in (
      device, f"jax {env['jax']}" if env.get("jax") else None,
      env.get("date", "")[:10] or None,
      " and ".join(timers) + " time" if timers else None) if x)
  header, rows = real_rows(data)
  models = {}
  for r in data["records"]:
    models.setdefault(r["model"], r["description"])
  legend = "".join(f"* ``{k}``: {v}\n" for k, v in models.items())
  for m in data.get("merged", []):
    e = m["environment"]
    legend += (f"* {', '.join(m['models'])}: measured "
               f"{e.get('date', '')[:10]} on {e.get('device_kind')}, "
               f"jax {e.get('jax')}\n")
  return (rst_table(header, rows, title) + "\n" + legend)
