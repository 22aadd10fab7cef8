"""The attribution demo: which training digits are mislabeled, and which
training digits helped or hurt a held-out one, from the training steps'
own Grams.

Run ``python -m gram_haiku attribution-demo --flip-fraction 0.1 --out
attribution_out``. Data: scikit-learn's bundled digits, the demos' split
(:func:`gram_haiku.apps.demo.split_heldout`: 20% held out, stratified);
a fraction of the training labels is replaced by a different class drawn
at random (the "flipped" examples; the held-out labels are left clean).
The MLP trains with plain SGD on the batch-mean cross-entropy, every
training example once per epoch (the last batch of an epoch is padded with
zero-weight rows, whose gradients are exactly zero).

Each step is one :func:`gram_haiku.cross_gram` call. Its training loss is
the batch's summed (weighted) cross-entropy and its queries are a few fixed
held-out digits followed by the batch itself, so one backward pass gives

* the update (the queries never enter it),
* ``<g_i, h_q>`` for every batch example ``i`` and held-out query ``q``,
* ``<g_i, g_j>`` within the batch, whose diagonal is ``|g_i|^2``.

With ``eta = learning_rate / batch_size``, the coefficient of each
``g_i`` in the SGD update, the demo accumulates over the steps (TracIn,
Pruthi et al. 2020, summed over every step, the example's own steps only):

* self-influence ``sum_t eta |g_i(theta_t)|^2``: how much an example's
  own updates lowered its own loss, to first order. Mislabeled examples
  disagree with the rest of their class, so their gradients stay large
  for longer; the demo ranks the training examples by it and reports the
  precision at ``k`` (``k`` = the number flipped) and the ROC AUC
  (scikit-learn's ``roc_auc_score``) of finding the flipped ones, against
  the same scores of the final per-example training loss (a common
  baseline, read from the last model alone);
* influence on a held-out digit ``sum_t eta <g_i(theta_t), h_q(theta_t)>``:
  positive when training on ``i`` lowered ``q``'s loss (helpful,
  "proponents"), negative when it raised it (harmful, "opponents").

At step 0 the demo checks the step's cross block and squared norms
against the ``jax.vmap(jax.grad(...))`` reference
(:func:`gram_haiku.testing.per_example_grads`).

Outputs (``--out``): ``attribution_stats.json`` holds every number and
image the plots show, and :func:`plot` rebuilds the plots from it alone:
``self_influence.png`` (the distribution of the self-influence of clean
and flipped examples, and the ROC curves), ``top_self_influence.png`` (the
training digits of highest self-influence, with their given and true
labels) and ``influence_grid.png`` (per held-out query, its most helpful
and most harmful training digits); all at :data:`gram_haiku.apps.demo.DPI`
dpi.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku import testing as reference
from gram_haiku.apps import demo

#: What the demo needs beyond gram_haiku's requirements (all in the
#: ``demo`` extra): import name -> pip name.
PACKAGES = {"sklearn": "scikit-learn", "matplotlib": "matplotlib",
            "tqdm": "tqdm"}
STATS = "attribution_stats.json"
PLOTS = ("self_influence.png", "top_self_influence.png",
         "influence_grid.png")


@dataclasses.dataclass
class AttributionConfig:
  flip_fraction: float = 0.1
  epochs: int = 10
  batch_size: int = 64
  hidden: tuple[int, ...] = (64,)
  # SGD on the batch-mean loss: each example's gradient enters the update
  # with eta = learning_rate / batch_size.
  learning_rate: float = 0.5
  queries: int = 6
  top: int = 6
  seed: int = 0
  # Use only the first train_examples of the 1437 training examples (None:
  # all of them); for quick runs.
  train_examples: Optional[int] = None
  out: str = "attribution_out"
  progress: bool = True


def _check(cfg: AttributionConfig, n: int, n_heldout: int) -> None:
  if not 2 <= n:
    raise demo.ConfigError(f"need at least 2 training examples, got {n}.")
  n_flip = n_flipped(cfg.flip_fraction, n)
  if not 0 < cfg.flip_fraction < 1 or not 1 <= n_flip < n:
    raise demo.ConfigError(
        f"--flip-fraction must flip at least one of the {n} training "
        f"examples and leave one clean (0 < fraction < 1), got "
        f"{cfg.flip_fraction} ({n_flip} flipped).")
  if cfg.epochs < 1 or not 1 <= cfg.batch_size <= n:
    raise demo.ConfigError(
        f"need epochs >= 1 and 1 <= batch_size <= {n} (the training "
        f"examples), got epochs={cfg.epochs}, batch_size={cfg.batch_size}.")
  if not 1 <= cfg.queries <= min(10, n_heldout) or not 1 <= cfg.top <= n:
    raise demo.ConfigError(
        f"need 1 <= queries <= 10 (one held-out digit per class) and "
        f"1 <= top <= {n}, got queries={cfg.queries}, top={cfg.top}.")
  if not (np.isfinite(cfg.learning_rate) and cfg.learning_rate > 0):
    raise demo.ConfigError(
        f"the learning rate must be a finite number > 0, got "
        f"{cfg.learning_rate}.")


def n_flipped(fraction: float, n: int) -> int:
  """The number of labels flipped: ``round(fraction * n)``."""
  return int(round(fraction * n))


def flip_labels(y: np.ndarray, fraction: float, rng: np.random.Generator
                ) -> tuple[np.ndarray, np.ndarray]:
  """``(noisy labels, flipped mask)``: ``round(fraction * len(y))``
  examples, drawn without replacement, get a different class drawn
  uniformly from the other nine."""
  n = len(y)
  idx = rng.choice(n, n_flipped(fraction, n), replace=False)
  noisy = y.copy()
  noisy[idx] = (y[idx] + rng.integers(1, 10, len(idx))) % 10
  flipped = np.zeros(n, bool)
  flipped[idx] = True
  return noisy, flipped


def pick_queries(y_heldout: np.ndarray, count: int,
                 rng: np.random.Generator) -> np.ndarray:
  """Indices of ``count`` held-out digits of ``count`` different classes."""
  classes = rng.permutation(10)[:count]
  return np.array([rng.choice(np.flatnonzero(y_heldout == c))
                   for c in classes])


def make_model(hidden):
  """``(tracked, plain, net)``: the summed weighted cross-entropy
  ``sum_i w_i l_i`` of the MLP inside ``track()`` (its aux: the logits),
  the same loss untracked (``(params, x, y, w) -> scalar``, for the
  reference) and the logits."""
  def logits_of(x):
    return hk.nets.MLP(list(hidden) + [10])(x)

  def tracked_loss(x, y, w):
    with gram_haiku.track():
      logits = logits_of(x)
    return (w * demo.per_example_xent(logits, y)).sum(), logits

  def plain_loss(x, y, w):
    return (w * demo.per_example_xent(logits_of(x), y)).sum()

  return (hk.transform_with_state(tracked_loss),
          hk.without_apply_rng(hk.transform(plain_loss)),
          hk.without_apply_rng(hk.transform(logits_of)))


def epoch_batches(n: int, batch_size: int, rng: np.random.Generator):
  """One epoch's batches: ``(indices i32[batch_size], real bool[batch])``,
  every example once; the last batch is padded (with index 0, not real)."""
  perm = rng.permutation(n)
  for start in range(0, n, batch_size):
    idx = perm[start:start + batch_size]
    real = np.ones(batch_size, bool)
    real[len(idx):] = False
    yield np.concatenate([idx, np.zeros(batch_size - len(idx), idx.dtype)]
                         ), real


def detection_scores(scores: np.ndarray, flipped: np.ndarray
                     ) -> dict[str, float]:
  """How well ``scores`` (higher: more suspect) find the flipped examples:
  ``precision_at_k`` with ``k`` = the number flipped (the fraction of the
  ``k`` highest that are flipped; the fraction flipped by chance) and the
  ROC AUC (scikit-learn's ``roc_auc_score``; 0.5 by chance)."""
  from sklearn.metrics import roc_auc_score  # pylint: disable=g-import-not-at-top
  k = int(flipped.sum())
  top = np.argsort(-scores, kind="stable")[:k]
  return {"precision_at_k": float(flipped[top].mean()),
          "roc_auc": float(roc_auc_score(flipped, scores)), "k": k}


def _example(index, x, given, true, **values) -> dict[str, Any]:
  return {"train_index": int(index), "image": np.round(x, 4).tolist(),
          "given_label": int(given), "true_label": int(true),
          **{k: float(v) for k, v in values.items()}}


def run_attribution_demo(
    cfg: AttributionConfig,
    on_step: Optional[Callable[..., None]] = None) -> dict[str, Any]:
  """Trains on partly flipped labels, accumulating self-influence and
  held-out influence from each step's Grams; writes plots and statistics.

  Args:
    cfg: the settings.
    on_step: called before each step as ``on_step(step, params, x, y, w,
      indices, eta)`` (the parameters the step differentiates at, its
      padded batch, weights ``w`` 1 for real rows and 0 for padding, their
      training indices and the step's ``eta``), e.g. to recompute the
      accumulation independently.

  Returns:
    The summary written to ``attribution_stats.json``: ``detection``
    (``self_influence`` and the ``final_loss`` baseline, each with
    ``precision_at_k``, ``roc_auc``, ``k``), ``n_flipped``,
    ``fraction_flipped``, ``steps``, ``eta``, ``rel_err_step0``,
    ``heldout_accuracy`` and ``train_accuracy`` (per epoch; the training
    accuracy against the given, partly flipped, labels), ``wall_time_s``,
    ``config``, ``data``; per training example ``self_influence``,
    ``final_loss``, ``flipped``, ``given_label``, ``true_label``;
    ``top_self_influence`` and ``queries`` (each held-out query with its
    ``helpful`` and ``harmful`` training examples, influences and images);
    plus ``files``.

  Raises:
    demo.OutputDirError: if ``cfg.out`` cannot be written (before training).
    demo.ConfigError: for a setting out of range.
    demo.MissingExtraError: without the ``demo`` extra.
  """
  demo.require(PACKAGES, "attribution demo")
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  x_tr, y_true, x_ho, y_ho = demo.split_heldout(*demo.load_digits_data(),
                                                seed=cfg.seed)
  if cfg.train_examples is not None:
    x_tr, y_true = x_tr[:cfg.train_examples], y_true[:cfg.train_examples]
  n, b = x_tr.shape[0], cfg.batch_size
  _check(cfg, n, x_ho.shape[0])
  out_dir = demo.prepare_out_dir(cfg.out, example="./attribution_out")
  start = time.perf_counter()
  rng = np.random.default_rng(cfg.seed)
  y_given, flipped = flip_labels(y_true, cfg.flip_fraction, rng)
  q_idx = pick_queries(y_ho, cfg.queries, rng)
  xq, yq = x_ho[q_idx], y_ho[q_idx]
  v = len(q_idx)

  tracked, plain, net = make_model(cfg.hidden)
  params, state = jax.jit(tracked.init)(jax.random.PRNGKey(cfg.seed),
                                        x_tr[:b], y_given[:b],
                                        np.ones(b, np.float32))
  eta = cfg.learning_rate / b
  cross_step = gram_haiku.cross_gram(tracked.apply, has_aux=True)

  @jax.jit
  def step(params, x, y, w):
    # Queries: the held-out digits, then the batch itself (its block with
    # the batch is the batch's Gram; the diagonal is |g_i|^2). One pass;
    # a second, value_grad_and_gram pass for the norms cost the same here
    # (64 examples, 8 queries, the compiled steps: 0.30 ms either way
    # against 0.21 ms for the cross block alone).
    queries = (jnp.concatenate([xq, x]), jnp.concatenate([yq, y]),
               jnp.concatenate([jnp.ones(v, jnp.float32), w]))
    (loss, _), grads, cross = cross_step(params, state, None, x, y, w,
                                         queries=queries)
    block = cross.total
    params = jax.tree.map(lambda p, g: p - eta * g, params, grads)
    return params, loss / w.sum(), block[:, :v], jnp.diagonal(block[:, v:])

  @jax.jit
  def reference_grads(params, *batch):
    return reference.per_example_grads(plain.apply, params, *batch)

  @jax.jit
  def evaluate(params, x, y):
    logits = net.apply(params, x)
    return (demo.per_example_xent(logits, y),
            jnp.argmax(logits, -1) == y)

  # Evaluated in one call: the training examples (given labels), then the
  # held-out ones.
  x_all, y_all = np.concatenate([x_tr, x_ho]), np.concatenate([y_given, y_ho])
  self_influence = np.zeros(n)
  influence = np.zeros((n, v))
  steps_per_epoch = -(-n // b)
  total = cfg.epochs * steps_per_epoch
  heldout_acc, train_acc = [], []
  rel_err, bar, i = None, None, 0
  for epoch in range(cfg.epochs):
    for idx, real in epoch_batches(n, b, rng):
      x, y, w = x_tr[idx], y_given[idx], real.astype(np.float32)
      if on_step is not None:
        on_step(i, params, x, y, w, idx, eta)
      if i == 0:
        f = np.asarray(reference_grads(params, x, y, w), np.float64)
        h = np.asarray(reference_grads(params, xq, yq,
                                       np.ones(v, np.float32)), np.float64)
        t0 = time.perf_counter()
      params, loss, cross_q, sq = step(params, x, y, w)
      cross_q = np.asarray(cross_q, np.float64)
      sq = np.asarray(sq, np.float64)
      if i == 0:
        compile_s = time.perf_counter() - t0
        rel_err = max(
            reference.relative_error(cross_q, f @ h.T),
            reference.relative_error(sq, (f * f).sum(1)))
        print(f"step 0: relative error of the step's <g_i, h_q> and |g_i|^2 "
              f"against the vmap(grad) reference: {rel_err:.2e} (compiled "
              f"in {compile_s:.1f} s)")
        bar = tqdm(total=total, initial=1, desc="train", unit="step",
                   disable=None if cfg.progress else True)
      else:
        bar.update(1)
      r = idx[real]
      self_influence[r] += eta * sq[real]
      influence[r] += eta * cross_q[real]
      bar.set_postfix(loss=f"{float(loss):.3f}", refresh=False)
      i += 1
    loss_all, ok = evaluate(params, x_all, y_all)
    heldout_acc.append(float(np.mean(ok[n:])))
    train_acc.append(float(np.mean(ok[:n])))
    bar.write(f"epoch {epoch}: accuracy on the given (partly flipped) "
              f"training labels {train_acc[-1]:.3f}  held-out accuracy "
              f"{heldout_acc[-1]:.3f}")
  bar.close()

  final_loss = np.asarray(loss_all[:n], np.float64)
  detection = {"self_influence": detection_scores(self_influence, flipped),
               "final_loss": detection_scores(final_loss, flipped)}
  order = np.argsort(-self_influence, kind="stable")
  top_self = [_example(j, x_tr[j], y_given[j], y_true[j],
                       self_influence=self_influence[j])
              for j in order[:max(cfg.top * 4, 1)]]
  queries = []
  for c, qi in enumerate(q_idx):
    by = np.argsort(-influence[:, c], kind="stable")
    queries.append({
        "heldout_index": int(qi), "label": int(y_ho[qi]),
        "image": np.round(x_ho[qi], 4).tolist(),
        "helpful": [_example(j, x_tr[j], y_given[j], y_true[j],
                             influence=influence[j, c])
                    for j in by[:cfg.top]],
        "harmful": [_example(j, x_tr[j], y_given[j], y_true[j],
                             influence=influence[j, c])
                    for j in by[::-1][:cfg.top]]})
  wall = time.perf_counter() - start
  summary = {
      "detection": detection, "n_flipped": int(flipped.sum()),
      "fraction_flipped": float(flipped.mean()), "steps": i, "eta": eta,
      "rel_err_step0": rel_err, "heldout_accuracy": heldout_acc,
      "train_accuracy": train_acc, "wall_time_s": wall,
      "config": dataclasses.asdict(cfg),
      "data": {"n_train": int(n), "n_heldout": int(x_ho.shape[0]),
               "steps_per_epoch": steps_per_epoch},
      "self_influence": self_influence.tolist(),
      "final_loss": final_loss.tolist(), "flipped": flipped.tolist(),
      "given_label": y_given.tolist(), "true_label": y_true.tolist(),
      "top_self_influence": top_self, "queries": queries}
  si, fl = detection["self_influence"], detection["final_loss"]
  print(f"{summary['n_flipped']} of {n} training labels flipped "
        f"({summary['fraction_flipped']:.1%}), {i} steps, seed {cfg.seed}: "
        f"self-influence finds them with ROC AUC {si['roc_auc']:.3f} and "
        f"precision at k={si['k']} {si['precision_at_k']:.3f} (chance: "
        f"{summary['fraction_flipped']:.3f}); the final per-example loss: "
        f"AUC {fl['roc_auc']:.3f}, precision {fl['precision_at_k']:.3f}")
  files = demo.write_stats(summary, out_dir, STATS, plot(summary, out_dir))
  print(f"wrote {', '.join(files)} in {time.perf_counter() - start:.1f} s")
  return summary


def _digit(ax, image, title: str, color: str = "k") -> None:
  ax.imshow(np.asarray(image).reshape(8, 8), cmap="gray_r", vmin=0, vmax=1,
            interpolation="nearest")
  ax.set_xticks([])
  ax.set_yticks([])
  ax.set_title(title, fontsize=7, color=color)
  for s in ax.spines.values():
    s.set_edgecolor(color)
    s.set_linewidth(2 if color != "k" else 0.5)


def _save_grid(plt, fig, out_dir: str, name: str, margin: float,
               title_inches: float, hspace: float) -> str:
  """Saves a grid of digits (``margin``: the figure fraction left at its
  sides; ``title_inches`` above it for the title) at the demos' dpi, closes
  it and returns its path."""
  path = os.path.join(out_dir, name)
  fig.subplots_adjust(left=margin, right=1 - margin, bottom=margin,
                      top=1 - title_inches / fig.get_figheight(),
                      hspace=hspace)
  fig.savefig(path, dpi=demo.DPI)
  plt.close(fig)
  return path


def _label(e: dict[str, Any]) -> tuple[str, str]:
  """A training example's caption and colour: red when flipped."""
  if e["given_label"] != e["true_label"]:
    return f"given {e['given_label']} (is {e['true_label']})", "tab:red"
  return f"given {e['given_label']}", "k"


def plot(summary: dict[str, Any], out_dir: str) -> list[str]:
  """Draws the three plots from a summary (``attribution_stats.json``).

  Returns:
    The paths written, all ``.png`` at :data:`gram_haiku.apps.demo.DPI`.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from sklearn.metrics import roc_curve  # pylint: disable=g-import-not-at-top

  flipped = np.asarray(summary["flipped"], bool)
  si = np.asarray(summary["self_influence"], np.float64)
  files = []

  fig, (ax_h, ax_r) = plt.subplots(1, 2, figsize=(10, 4))
  logs = np.log10(np.maximum(si, np.min(si[si > 0], initial=1e-30)))
  bins = np.linspace(logs.min(), logs.max(), 40)
  for mask, name, color in [(~flipped, "clean", "tab:blue"),
                            (flipped, "flipped", "tab:red")]:
    ax_h.hist(logs[mask], bins=bins, density=True, alpha=0.5, color=color,
              label=f"{name} ({int(mask.sum())})")
  ax_h.set_xlabel(r"$\log_{10}$ self-influence $\sum_t \eta\,|g_i|^2$")
  ax_h.set_ylabel("density")
  ax_h.set_title("Self-influence over training")
  ax_h.legend()
  for key, name in [("self_influence", "self-influence"),
                    ("final_loss", "final loss (baseline)")]:
    fpr, tpr, _ = roc_curve(flipped, np.asarray(summary[key]))
    d = summary["detection"][key]
    ax_r.plot(fpr, tpr, label=f"{name}: AUC {d['roc_auc']:.3f}, "
              f"P@{d['k']} {d['precision_at_k']:.2f}")
  ax_r.plot([0, 1], [0, 1], "k:", lw=0.8)
  ax_r.set_xlabel("false positive rate (clean flagged)")
  ax_r.set_ylabel("true positive rate (flipped found)")
  ax_r.set_title(f"Finding the {int(flipped.sum())} flipped labels "
                 f"({summary['steps']} steps)")
  ax_r.legend(loc="lower right", fontsize=8)
  files.append(os.path.join(out_dir, "self_influence.png"))
  fig.tight_layout()
  fig.savefig(files[-1], dpi=demo.DPI)
  plt.close(fig)

  top = summary["top_self_influence"]
  cols = min(8, len(top))
  rows = -(-len(top) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(1.3 * cols, 1.75 * rows),
                           squeeze=False)
  for ax in axes.flat:
    ax.axis("off")
  for ax, e in zip(axes.flat, top):
    ax.axis("on")
    text, color = _label(e)
    _digit(ax, e["image"], f"#{e['train_index']}\n{text}", color)
  n_bad = sum(e["given_label"] != e["true_label"] for e in top)
  fig.suptitle(f"Highest self-influence: {n_bad} of {len(top)} are flipped "
               f"(red)", fontsize=10)
  files.append(_save_grid(plt, fig, out_dir, "top_self_influence.png",
                          margin=0.02, title_inches=0.55, hspace=0.45))

  queries = summary["queries"]
  k = len(queries[0]["helpful"])
  fig, axes = plt.subplots(len(queries), 2 * k + 1,
                           figsize=(1.25 * (2 * k + 1), 1.45 * len(queries)),
                           squeeze=False)
  for row, q in zip(axes, queries):
    _digit(row[0], q["image"], f"held out\n{q['label']}", "tab:blue")
    for ax, e in zip(row[1:], q["helpful"] + q["harmful"]):
      text, color = _label(e)
      _digit(ax, e["image"], f"{e['influence']:+.2g}\n{text}", color)
  axes[0][1].annotate("most helpful", (0, 1.6), xycoords="axes fraction",
                      fontsize=9, weight="bold", annotation_clip=False)
  axes[0][k + 1].annotate("most harmful", (0, 1.6),
                          xycoords="axes fraction", fontsize=9,
                          weight="bold", annotation_clip=False)
  fig.suptitle(r"Influence on held-out digits, $\sum_t \eta\,\langle g_i, "
               r"h_q\rangle$ (red: flipped label)", fontsize=10)
  files.append(_save_grid(plt, fig, out_dir, "influence_grid.png",
                          margin=0.01, title_inches=0.8, hspace=0.5))
  return files
