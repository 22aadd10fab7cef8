"""The demo: train an MLP on scikit-learn's digits, tracking the Gram each step.

Run ``python -m gram_haiku demo --steps 300 --out gram_out``. Data:
``sklearn.datasets.load_digits`` (1797 8x8 images, 10 classes), bundled with
scikit-learn, no download; a fixed, class-stratified 20% is held out. Every
step computes the loss, the parameter gradients and the per-example gradient
Gram of the training batch, for the whole model and per layer, in one
backward pass. At step 0 it checks the Gram against the
``jax.vmap(jax.grad(...))`` reference; per epoch it logs the training-batch
loss and accuracy, the held-out accuracy, the median per-example gradient
norm and the mean off-diagonal gradient cosine.

Outputs (``--out``): ``stats.json`` holds every number the plots show, and
:func:`plot` rebuilds the plots from it alone: ``gram_heatmap.png`` (cosines
of the last batch's per-example gradients, sorted by class),
``gram_by_layer.png`` (the same per layer), ``norms.png`` (the median and
10-90th percentiles of the per-example gradient norms per step) and
``training.png`` (loss, training-batch and held-out accuracy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from absl import logging
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku import testing as reference

#: Fraction of the digits held out for evaluation.
HELDOUT_FRACTION = 0.2
DPI = 200


@dataclasses.dataclass
class DemoConfig:
  steps: int = 300
  batch_size: int = 64
  hidden: tuple[int, ...] = (64, 64)
  learning_rate: float = 1e-3
  seed: int = 0
  out: str = "gram_out"
  progress: bool = True


class OutputDirError(ValueError):
  """``--out`` cannot be created or written."""


class ConfigError(ValueError):
  """A demo setting out of range (the command line reports it, no traceback)."""


class MissingExtraError(ImportError):
  """A package of the ``demo`` extra is not installed."""


#: Import name -> pip name of what the demos need beyond gram_haiku's own
#: requirements (the ``demo`` extra).
DEMO_PACKAGES = {"sklearn": "scikit-learn", "optax": "optax",
                 "matplotlib": "matplotlib", "tqdm": "tqdm"}
DP_PACKAGES = {**DEMO_PACKAGES, "jax_privacy": "jax-privacy",
               "dp_accounting": "dp-accounting"}
NEEDS_DEMO_EXTRA = (
    "the {what} needs {missing}, not installed here.\n"
    "What to do: pip install 'gram_haiku[demo]' (in a checkout: pip "
    "install '.[demo]').")


def require(packages: dict[str, str], what: str) -> None:
  """Raises :class:`MissingExtraError` naming every package of
  ``packages`` (import name -> pip name) that is not installed."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  missing = [pip for name, pip in packages.items()
             if importlib.util.find_spec(name) is None]
  if missing:
    raise MissingExtraError(NEEDS_DEMO_EXTRA.format(
        what=what, missing=", ".join(missing)))


def prepare_out_dir(path: str, example: str = "./gram_out") -> str:
  """Creates ``path`` and checks it is writable, before any training
  (``example``: a directory the error message suggests).

  Raises:
    OutputDirError: with the path and the reason, if it cannot be written.
  """
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, ".gram_haiku_write_test")
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise OutputDirError(
        f"cannot write to --out={path!r} ({e.strerror or e}). "
        f"Pass a directory you can write to, e.g. --out {example}.") from e
  return path


def load_digits_data():
  """Digits as ``(x: f32[1797, 64] in [0, 1], y: i32[1797])``."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  digits = load_digits()
  x = np.asarray(digits.data, np.float32) / 16.0
  y = np.asarray(digits.target, np.int32)
  return x, y


def split_heldout(x, y, seed: int):
  """A class-stratified split: ``(x_train, y_train, x_heldout, y_heldout)``
  with :data:`HELDOUT_FRACTION` of each class held out."""
  from sklearn.model_selection import train_test_split  # pylint: disable=g-import-not-at-top
  x_tr, x_ho, y_tr, y_ho = train_test_split(
      x, y, test_size=HELDOUT_FRACTION, stratify=y, random_state=seed)
  return x_tr, y_tr, x_ho, y_ho


def per_example_xent(logits, labels):
  """``f32[B]``: each example's cross-entropy (``labels``: ``i32[B]``)."""
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def make_model(hidden):
  """Returns ``(tracked loss, untracked loss, untracked logits)`` transforms
  of the same MLP (the same parameters)."""
  def net(x):
    return hk.nets.MLP(list(hidden) + [10])(x)

  def tracked_loss(x, y):
    with gram_haiku.track():
      logits = net(x)
    return per_example_xent(logits, y).sum(), logits

  def plain_loss(x, y):
    return per_example_xent(net(x), y).sum()

  return (hk.transform_with_state(tracked_loss),
          hk.without_apply_rng(hk.transform(plain_loss)),
          hk.without_apply_rng(hk.transform(net)))


def reference_gram(plain_apply, params, x, y):
  """``F @ F.T`` from ``jax.vmap(jax.grad(...))`` of the untracked model."""
  return reference.reference_gram(plain_apply, params, x, y)


def cosines(gram: np.ndarray) -> np.ndarray:
  """``G[i, j] / (|g_i| |g_j|)``; 0 where a norm is 0."""
  norms = np.sqrt(np.maximum(np.diag(gram), 0))
  denom = np.outer(norms, norms)
  return np.divide(gram, denom, out=np.zeros_like(gram), where=denom > 0)


def gram_stats(gram: np.ndarray) -> dict[str, float]:
  """Per-example gradient norms (mean, median, 10th and 90th percentiles)
  and the mean off-diagonal cosine of a Gram ``f64[B, B]``."""
  norms = np.sqrt(np.maximum(np.diag(gram), 0))
  b = gram.shape[0]
  off = cosines(gram)[~np.eye(b, dtype=bool)]
  p10, p50, p90 = np.percentile(norms, [10, 50, 90])
  return {"mean_norm": float(norms.mean()), "median_norm": float(p50),
          "norm_p10": float(p10), "norm_p90": float(p90),
          "mean_cosine": float(off.mean()) if off.size else 0.0}


def _check_config(cfg: DemoConfig, n_train: int) -> None:
  if cfg.steps < 1:
    raise ConfigError(f"--steps must be >= 1, got {cfg.steps}.")
  if not 2 <= cfg.batch_size <= n_train:
    raise ConfigError(
        f"--batch_size must be between 2 and the {n_train} training examples "
        f"of the digits data ({1 - HELDOUT_FRACTION:.0%} of 1797; the rest "
        f"is held out), got {cfg.batch_size}.")


def _class_ticks(ax, labels_sorted: np.ndarray) -> None:
  """Class names at the middle of each class block, and separators."""
  edges = np.flatnonzero(np.diff(labels_sorted)) + 0.5
  bounds = np.concatenate([[-0.5], edges, [len(labels_sorted) - 0.5]])
  mids = (bounds[:-1] + bounds[1:]) / 2
  classes = labels_sorted[np.r_[0, np.flatnonzero(np.diff(labels_sorted)) + 1]]
  for e in edges:
    ax.axhline(e, color="k", lw=0.4)
    ax.axvline(e, color="k", lw=0.4)
  ax.set_xticks(mids, [str(c) for c in classes])
  ax.set_yticks(mids, [str(c) for c in classes])


def _cosine_panel(ax, gram: np.ndarray, labels: np.ndarray, title: str):
  order = np.argsort(labels, kind="stable")
  im = ax.imshow(cosines(gram)[np.ix_(order, order)], cmap="RdBu_r", vmin=-1,
                 vmax=1, interpolation="nearest")
  _class_ticks(ax, labels[order])
  ax.set_title(title)
  return im


def plot(summary: dict[str, Any], out_dir: str) -> list[str]:
  """Draws the four plots from a summary (the ``stats.json`` contents).

  Returns:
    The paths written, all ``.png`` at :data:`DPI` dpi.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  last = summary["last_batch"]
  labels = np.asarray(last["labels"])
  step = last["step"]
  files = []

  fig, ax = plt.subplots(figsize=(6.4, 5.4))
  im = _cosine_panel(ax, np.asarray(last["gram"]), labels,
                     f"Per-example gradient cosine, batch of step {step}")
  ax.set_xlabel("example, sorted by class (digit)")
  ax.set_ylabel("example, sorted by class (digit)")
  fig.colorbar(im, ax=ax, label=r"cosine$(g_i, g_j)$ = $G_{ij}/"
               r"\sqrt{G_{ii} G_{jj}}$")
  files.append(os.path.join(out_dir, "gram_heatmap.png"))
  fig.tight_layout()
  fig.savefig(files[-1], dpi=DPI)
  plt.close(fig)

  layers = last["by_layer"]
  total_sq = max(float(np.trace(np.asarray(last["gram"]))), 1e-30)
  fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 4.4),
                           squeeze=False)
  for ax, (name, g) in zip(axes[0], sorted(layers.items())):
    g = np.asarray(g)
    share = float(np.trace(g)) / total_sq
    im = _cosine_panel(ax, g, labels, f"{name}\n{share:.0%} of " r"$\sum_i |g_i|^2$")
    ax.set_xlabel("example, sorted by class")
  axes[0][0].set_ylabel("example, sorted by class")
  fig.colorbar(im, ax=list(axes[0]), label="cosine of the layer's "
               "per-example gradients", shrink=0.85)
  fig.suptitle(f"Per-layer Grams, batch of step {step}")
  files.append(os.path.join(out_dir, "gram_by_layer.png"))
  fig.savefig(files[-1], dpi=DPI, bbox_inches="tight")
  plt.close(fig)

  hist = summary["history"]
  steps = np.array([r["step"] for r in hist])
  fig, ax = plt.subplots(figsize=(6.4, 4))
  ax.fill_between(steps, [r["norm_p10"] for r in hist],
                  [r["norm_p90"] for r in hist], alpha=0.3,
                  label="10th-90th percentile")
  ax.plot(steps, [r["median_norm"] for r in hist], label="median")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel(r"per-example gradient norm $|g_i|$")
  ax.set_title("Per-example gradient norms of each training batch")
  ax.legend()
  files.append(os.path.join(out_dir, "norms.png"))
  fig.tight_layout()
  fig.savefig(files[-1], dpi=DPI)
  plt.close(fig)

  fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(10, 4))
  ax_l.plot(steps, [r["loss"] for r in hist], lw=0.8)
  ax_l.set_yscale("log")
  ax_l.set_xlabel("step")
  ax_l.set_ylabel("cross-entropy (mean over the batch)")
  ax_l.set_title("Training-batch loss")
  ax_a.plot(steps, [r["train_batch_accuracy"] for r in hist], lw=0.8,
            alpha=0.6, label="training batch")
  ev = summary["heldout"]
  ax_a.plot([r["step"] for r in ev], [r["accuracy"] for r in ev], "o-",
            label=f"held out ({summary['data']['n_heldout']} examples)")
  ax_a.set_xlabel("step")
  ax_a.set_ylabel("accuracy")
  ax_a.set_ylim(0, 1.02)
  ax_a.set_title("Accuracy")
  ax_a.legend(loc="lower right")
  files.append(os.path.join(out_dir, "training.png"))
  fig.tight_layout()
  fig.savefig(files[-1], dpi=DPI)
  plt.close(fig)
  return files


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
  """Trains, tracks the Gram every step, writes plots and statistics.

  Returns:
    The summary written to ``stats.json``: ``rel_err_step0``,
    ``final_loss``, ``final_train_batch_accuracy``,
    ``final_heldout_accuracy``, ``wall_time_s``, ``compile_time_s``,
    ``config``, ``data`` (example counts), ``history`` (per step),
    ``heldout`` (per epoch), ``last_batch`` (its labels, Gram and
    per-layer Grams); plus ``files`` (paths written).

  Raises:
    OutputDirError: if ``cfg.out`` cannot be written (before training).
    ConfigError: for ``steps < 1``, or a ``batch_size`` below 2 or above the
      number of training examples.
    MissingExtraError: without the ``demo`` extra (scikit-learn, optax,
      matplotlib, tqdm).
  """
  require(DEMO_PACKAGES, "demo")
  import optax  # pylint: disable=g-import-not-at-top
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  x_tr, y_tr, x_ho, y_ho = split_heldout(*load_digits_data(), seed=cfg.seed)
  n = x_tr.shape[0]
  _check_config(cfg, n)
  out_dir = prepare_out_dir(cfg.out)
  start = time.perf_counter()
  rng = np.random.default_rng(cfg.seed)
  tracked, plain, net = make_model(cfg.hidden)
  params, state = tracked.init(jax.random.PRNGKey(cfg.seed),
                               x_tr[:cfg.batch_size], y_tr[:cfg.batch_size])
  opt = optax.adam(cfg.learning_rate)
  opt_state = opt.init(params)
  vgg = gram_haiku.value_grad_and_gram(tracked.apply, has_aux=True)

  @jax.jit
  def step(params, opt_state, x, y):
    (loss, logits), grads, grams = vgg(params, state, None, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    acc = jnp.mean(jnp.argmax(logits, -1) == y)
    return (params, opt_state, loss / x.shape[0], acc, grams.total,
            grams.by_layer)

  @jax.jit
  def evaluate(params, x, y):
    logits = net.apply(params, x)
    return (per_example_xent(logits, y).mean(),
            jnp.mean(jnp.argmax(logits, -1) == y))

  steps_per_epoch = max(1, n // cfg.batch_size)
  history, heldout, epoch_rows = [], [], []
  rel_err, compile_s, bar = None, 0.0, None
  perm = rng.permutation(n)
  for i in range(cfg.steps):
    j = i % steps_per_epoch
    if j == 0 and i > 0:
      perm = rng.permutation(n)
    idx = perm[j * cfg.batch_size:(j + 1) * cfg.batch_size]
    x, y = x_tr[idx], y_tr[idx]
    if i == 0:
      ref = np.asarray(reference_gram(plain.apply, params, x, y), np.float64)
      t0 = time.perf_counter()
    params, opt_state, loss, acc, gram, by_layer = step(params, opt_state, x,
                                                        y)
    gram = np.asarray(gram, np.float64)
    if i == 0:
      compile_s = time.perf_counter() - t0
      rel_err = reference.relative_error(gram, ref)
      logging.info("step 0: Gram relative error vs vmap(grad) reference: "
                   "%.2e", rel_err)
      print(f"step 0: relative error of the Gram against the vmap(grad) "
            f"reference: {rel_err:.2e} (compiled in {compile_s:.1f} s)")
      # The bar starts after compilation, so its rate and ETA are the
      # training steps' own. disable=None: no bar off a terminal.
      bar = tqdm(total=cfg.steps, initial=1, desc="train", unit="step",
                 disable=None if cfg.progress else True)
    else:
      bar.update(1)
    row = {"step": i, "loss": float(loss), "train_batch_accuracy": float(acc),
           **gram_stats(gram)}
    history.append(row)
    epoch_rows.append(row)
    bar.set_postfix(loss=f"{row['loss']:.3f}",
                    batch_acc=f"{row['train_batch_accuracy']:.2f}",
                    refresh=False)
    if j == steps_per_epoch - 1 or i == cfg.steps - 1:
      ho_loss, ho_acc = evaluate(params, x_ho, y_ho)
      heldout.append({"step": i, "loss": float(ho_loss),
                      "accuracy": float(ho_acc)})
      mean = {k: float(np.mean([r[k] for r in epoch_rows]))
              for k in ("loss", "train_batch_accuracy", "median_norm",
                        "mean_cosine")}
      bar.write(f"epoch {i // steps_per_epoch}: train-batch loss "
                f"{mean['loss']:.4f}  train-batch accuracy "
                f"{mean['train_batch_accuracy']:.3f}  held-out accuracy "
                f"{float(ho_acc):.3f}  median grad norm "
                f"{mean['median_norm']:.4f}  mean off-diag cosine "
                f"{mean['mean_cosine']:.4f}")
      epoch_rows = []
  bar.close()
  wall = time.perf_counter() - start
  summary = {
      "rel_err_step0": rel_err, "final_loss": history[-1]["loss"],
      "final_train_batch_accuracy": history[-1]["train_batch_accuracy"],
      "final_heldout_accuracy": heldout[-1]["accuracy"],
      "wall_time_s": wall, "compile_time_s": compile_s,
      "config": dataclasses.asdict(cfg),
      "data": {"n_train": int(n), "n_heldout": int(x_ho.shape[0]),
               "steps_per_epoch": steps_per_epoch},
      "history": history, "heldout": heldout,
      "last_batch": {"step": cfg.steps - 1, "labels": y.tolist(),
                     "gram": gram.tolist(),
                     "by_layer": {k: np.asarray(v, np.float64).tolist()
                                  for k, v in by_layer.items()}}}
  files = write_stats(summary, out_dir, "stats.json", plot(summary, out_dir))
  print(f"wrote {', '.join(files)} in {wall:.1f} s")
  return summary


def write_stats(summary: dict, out_dir: str, name: str,
                files: list[str]) -> list[str]:
  """Writes ``summary`` as JSON to ``out_dir/name``; returns ``files`` and
  that path, also recorded as ``summary["files"]``."""
  path = os.path.join(out_dir, name)
  with open(path, "w") as f:
    json.dump(summary, f, indent=1)
  files = list(files) + [path]
  summary["files"] = files
  return files
