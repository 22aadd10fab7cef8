"""The demo: train an MLP on scikit-learn's digits, tracking the Gram each step.

Run ``python -m gram_haiku demo --steps 300 --out gram_out``. Data:
``sklearn.datasets.load_digits`` (1797 8x8 images, 10 classes), bundled with
scikit-learn, no download. Every step computes the loss, the parameter
gradients and the per-example gradient Gram of the batch in one backward
pass; per epoch it logs loss, accuracy, mean per-example gradient norm and
mean off-diagonal gradient cosine. At step 0 it checks the Gram against the
``jax.vmap(jax.grad(...))`` reference.
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


def prepare_out_dir(path: str) -> str:
  """Creates ``path`` and checks it is writable, before any training.

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
        f"gram_haiku demo: cannot write to --out={path!r} ({e.strerror or e}). "
        "Pass a directory you can write to, e.g. --out ./gram_out.") from e
  return path


def load_digits_data():
  """Digits as ``(x: f32[1797, 64] in [0, 1], y: i32[1797])``."""
  from sklearn.datasets import load_digits  # pylint: disable=g-import-not-at-top
  digits = load_digits()
  x = np.asarray(digits.data, np.float32) / 16.0
  y = np.asarray(digits.target, np.int32)
  return x, y


def _per_example_xent(logits, labels):
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0]


def make_model(hidden):
  """Returns ``(tracked transform, untracked transform)`` of the same MLP."""
  def net(x):
    return hk.nets.MLP(list(hidden) + [10])(x)

  def tracked_loss(x, y):
    with gram_haiku.track():
      logits = net(x)
    return _per_example_xent(logits, y).sum(), logits

  def plain_loss(x, y):
    return _per_example_xent(net(x), y).sum()

  return (hk.transform_with_state(tracked_loss),
          hk.without_apply_rng(hk.transform(plain_loss)))


def reference_gram(plain_apply, params, x, y):
  """``F @ F.T`` from ``jax.vmap(jax.grad(...))`` of the untracked model."""
  def one(p, xi, yi):
    return plain_apply(p, xi[None], yi[None])
  g = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(params, x, y)
  f = jnp.concatenate([l.reshape(x.shape[0], -1) for l in jax.tree.leaves(g)],
                      axis=1)
  return f @ f.T


def gram_stats(gram: np.ndarray) -> dict[str, float]:
  """Mean per-example gradient norm and mean off-diagonal cosine."""
  norms = np.sqrt(np.maximum(np.diag(gram), 0))
  denom = np.outer(norms, norms)
  cos = np.divide(gram, denom, out=np.zeros_like(gram), where=denom > 0)
  b = gram.shape[0]
  off = cos[~np.eye(b, dtype=bool)]
  return {"mean_norm": float(norms.mean()),
          "mean_cosine": float(off.mean()) if off.size else 0.0}


def _plot(out_dir: str, gram: np.ndarray, labels: np.ndarray,
          norms_history: np.ndarray) -> list[str]:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  order = np.argsort(labels, kind="stable")
  norms = np.sqrt(np.maximum(np.diag(gram), 0))
  denom = np.outer(norms, norms)
  cos = np.divide(gram, denom, out=np.zeros_like(gram), where=denom > 0)
  fig, ax = plt.subplots(figsize=(6, 5))
  im = ax.imshow(cos[np.ix_(order, order)], cmap="RdBu_r", vmin=-1, vmax=1)
  ax.set_title("Per-example gradient cosine, last batch (sorted by class)")
  ax.set_xlabel("example (sorted by class)")
  ax.set_ylabel("example (sorted by class)")
  fig.colorbar(im, ax=ax)
  heatmap = os.path.join(out_dir, "gram_heatmap.png")
  fig.tight_layout()
  fig.savefig(heatmap, dpi=100)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(6, 4))
  steps = np.arange(norms_history.shape[0])
  q = np.percentile(norms_history, [10, 50, 90], axis=1)
  ax.fill_between(steps, q[0], q[2], alpha=0.3, label="10-90th percentile")
  ax.plot(steps, q[1], label="median")
  ax.set_yscale("log")
  ax.set_xlabel("step")
  ax.set_ylabel("per-example gradient norm")
  ax.set_title("Per-example gradient norms over training")
  ax.legend()
  norms_png = os.path.join(out_dir, "norms.png")
  fig.tight_layout()
  fig.savefig(norms_png, dpi=100)
  plt.close(fig)
  return [heatmap, norms_png]


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
  """Trains, tracks the Gram every step, writes plots and statistics.

  Returns:
    A summary dict: ``rel_err_step0``, ``final_loss``, ``final_accuracy``,
    ``wall_time_s``, ``files`` (paths written), ``history`` (per step).

  Raises:
    OutputDirError: if ``cfg.out`` cannot be written (before training).
    ValueError: for a non-positive ``steps`` or ``batch_size``.
  """
  import optax  # pylint: disable=g-import-not-at-top
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  if cfg.steps < 1 or cfg.batch_size < 2:
    raise ValueError(f"--steps must be >= 1 and --batch_size >= 2, got "
                     f"{cfg.steps} and {cfg.batch_size}.")
  out_dir = prepare_out_dir(cfg.out)
  start = time.perf_counter()
  x_all, y_all = load_digits_data()
  n = x_all.shape[0]
  rng = np.random.default_rng(cfg.seed)
  tracked, plain = make_model(cfg.hidden)
  params, state = tracked.init(jax.random.PRNGKey(cfg.seed),
                               x_all[:cfg.batch_size], y_all[:cfg.batch_size])
  opt = optax.adam(cfg.learning_rate)
  opt_state = opt.init(params)
  vgg = gram_haiku.value_grad_and_gram(tracked.apply, has_aux=True)

  @jax.jit
  def step(params, opt_state, x, y):
    (loss, logits), grads, grams = vgg(params, state, None, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    acc = jnp.mean(jnp.argmax(logits, -1) == y)
    return params, opt_state, loss / x.shape[0], acc, grams.total

  steps_per_epoch = max(1, n // cfg.batch_size)
  history, norms_history = [], []
  epoch_rows: list[dict[str, float]] = []
  rel_err = None
  perm = rng.permutation(n)
  # disable=None: no bar when stdout is not a terminal (logs, pipes), where
  # it would interleave with the epoch lines.
  bar = tqdm(range(cfg.steps), disable=None if cfg.progress else True,
             desc="train", unit="step")
  for i in bar:
    j = i % steps_per_epoch
    if j == 0 and i > 0:
      perm = rng.permutation(n)
    idx = perm[j * cfg.batch_size:(j + 1) * cfg.batch_size]
    x, y = x_all[idx], y_all[idx]
    if i == 0:
      ref = np.asarray(reference_gram(plain.apply, params, x, y), np.float64)
    params, opt_state, loss, acc, gram = step(params, opt_state, x, y)
    gram = np.asarray(gram, np.float64)
    if i == 0:
      rel_err = float(np.abs(gram - ref).max() / np.abs(ref).max())
      logging.info("step 0: Gram relative error vs vmap(grad) reference: "
                   "%.2e", rel_err)
      print(f"step 0: relative error of the Gram against the vmap(grad) "
            f"reference: {rel_err:.2e}")
    stats = gram_stats(gram)
    row = {"step": i, "loss": float(loss), "accuracy": float(acc), **stats}
    history.append(row)
    norms_history.append(np.sqrt(np.maximum(np.diag(gram), 0)))
    epoch_rows.append(row)
    bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['accuracy']:.2f}",
                    refresh=False)
    if j == steps_per_epoch - 1 or i == cfg.steps - 1:
      mean = {k: float(np.mean([r[k] for r in epoch_rows]))
              for k in ("loss", "accuracy", "mean_norm", "mean_cosine")}
      bar.write(f"epoch {i // steps_per_epoch}: loss {mean['loss']:.4f}  "
                f"accuracy {mean['accuracy']:.3f}  "
                f"mean grad norm {mean['mean_norm']:.4f}  "
                f"mean off-diag cosine {mean['mean_cosine']:.4f}")
      epoch_rows = []
  wall = time.perf_counter() - start
  files = _plot(out_dir, gram, y, np.stack(norms_history))
  stats_path = os.path.join(out_dir, "stats.json")
  summary = {"rel_err_step0": rel_err, "final_loss": history[-1]["loss"],
             "final_accuracy": history[-1]["accuracy"], "wall_time_s": wall,
             "config": dataclasses.asdict(cfg), "history": history}
  with open(stats_path, "w") as f:
    json.dump(summary, f, indent=1)
  files.append(stats_path)
  summary["files"] = files
  print(f"wrote {', '.join(files)} in {wall:.1f} s")
  return summary

