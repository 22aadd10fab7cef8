"""The DP-SGD demo: the digits MLP trained with differential privacy.

Run ``python -m gram_haiku dp-demo --epsilon 3 --out dp_out``. Everything
but the clipped gradient comes from the field's own libraries:

* sampling: Poisson sampling (``jax_privacy.batch_selection``), each
  batch padded to one fixed size so that the step compiles once; padded
  rows are ``is_padding_example`` and contribute nothing;
* clipping: :func:`gram_haiku.clipped_grad`, all-layer, in one backward
  pass (its sensitivity is jax-privacy's ``BoundedSensitivityCallable``);
* noise: ``jax_privacy.noise_addition.gaussian_privatizer`` with standard
  deviation ``noise_multiplier * sensitivity``;
* accounting: the noise multiplier for the target ``(epsilon, delta)`` is
  calibrated with ``jax_privacy.accounting`` (PLD accountant from
  ``dp_accounting``), which also reports the epsilon spent so far.

The clipping norm ``C``. By default it is the median per-example gradient
norm of the initial model over the *held-out* examples (computed with
gram_haiku's Grams), so about half of the examples are clipped at the
start. The guarantee covers the 1437 training examples; the held-out 20%
play the part of public data from the same distribution (in practice: a
public or separately consented set), so choosing ``C`` from them spends no
privacy budget. Choosing it from the training examples' norms would not
be private: the printed epsilon does not account for that choice (a
private quantile estimate, as in Andrew et al. 2021, "Differentially
private learning with adaptive clipping", spends part of the budget on
it). ``--clip-norm C`` fixes a public value instead. The fraction of the
examples clipped is reported per epoch: here the norms grow as the noisy
training proceeds, so a ``C`` fixed at the start ends up clipping most
examples (the regime De et al. 2022, "Unlocking high-accuracy
differentially private image classification through scale", recommend: a
small ``C``, every example clipped).

What is private. Only the trained parameters carry the ``(epsilon,
delta)`` guarantee. The diagnostics read the data without noise and are
not part of it: the first batch's check (the relative error of the clipped
gradient against the ``vmap(grad)`` reference ``sum_i min(1, C/|g_i|)
g_i``), the fraction clipped, and the held-out accuracies.

Baseline. The same model, initialisation, optimiser and Poisson batches
trained without clipping or noise (``sum_i g_i / expected_batch_size``),
evaluated at the same steps. Its step also times the DP step against a
non-private one (median of ``--timing_rounds`` steps each, the same padded
batch). Writes ``dp_stats.json`` and ``dp_accuracy.png`` (held-out
accuracy of both against the step, with the epsilon spent on the top
axis; the fraction clipped per epoch below).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku import testing as reference
from gram_haiku.apps import demo


@dataclasses.dataclass
class DPDemoConfig:
  epsilon: float = 3.0
  delta: float = 1e-5
  steps: int = 300
  expected_batch_size: int = 128
  # None: the median per-example gradient norm at initialisation over the
  # held-out examples (see the module docstring).
  l2_clip_norm: Optional[float] = None
  hidden: tuple[int, ...] = (64, 64)
  learning_rate: float = 2e-3
  seed: int = 0
  timing_rounds: int = 20
  out: str = "dp_out"
  progress: bool = True


def _check(cfg: DPDemoConfig, n: int) -> None:
  if not cfg.epsilon > 0 or not 0 < cfg.delta < 1:
    raise demo.ConfigError(
        f"need epsilon > 0 and 0 < delta < 1, got "
        f"epsilon={cfg.epsilon}, delta={cfg.delta}.")
  if cfg.steps < 1 or not 2 <= cfg.expected_batch_size <= n // 2:
    raise demo.ConfigError(
        f"need steps >= 1 and 2 <= expected_batch_size <= "
        f"{n // 2}, got steps={cfg.steps}, expected_batch_size="
        f"{cfg.expected_batch_size}.")
  if cfg.l2_clip_norm is not None and not 0 < cfg.l2_clip_norm < np.inf:
    raise demo.ConfigError(f"the clip norm must be a finite "
                           f"number > 0, got {cfg.l2_clip_norm}.")


def _median_seconds(fn, rounds: int) -> float:
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def median_norm(tracked_apply, params, state, x, y) -> float:
  """The median per-example gradient norm of the loss at ``params`` over
  ``x: f32[N, 64]``, ``y: i32[N]``, from gram_haiku's Grams (the
  diagonal of one backward pass's Gram)."""
  vgg = gram_haiku.value_grad_and_gram(tracked_apply, has_aux=True)
  _, _, grams = jax.jit(vgg)(params, state, None, x, y)
  return float(np.median(np.asarray(grams.norms, np.float64)))


def fraction_per_epoch(fractions, counts, steps_per_epoch: float
                       ) -> list[float]:
  """The fraction of the real examples clipped in each epoch: step ``i``
  (fraction ``fractions[i]`` of ``counts[i]`` real examples) is in epoch
  ``floor(i / steps_per_epoch)``; the last epoch may be partial."""
  fractions, counts = np.asarray(fractions), np.asarray(counts)
  epoch = (np.arange(len(counts)) // steps_per_epoch).astype(int)
  clipped = np.bincount(epoch, fractions * counts)
  seen = np.bincount(epoch, counts)
  return [float(c / s) if s else 0.0 for c, s in zip(clipped, seen)]


def run_dp_demo(cfg: DPDemoConfig) -> dict[str, Any]:
  """Trains with DP-SGD and the non-private baseline.

  Returns:
    The summary written to ``dp_stats.json``: ``clip_norm`` (``C``, with
    ``clip_norm_source``), ``heldout_median_norm_at_init``,
    ``rel_err_first_batch``, ``noise_multiplier``, ``noise_stddev``,
    ``epsilon_spent``, ``final_heldout_accuracy`` and
    ``baseline_final_heldout_accuracy``, ``fraction_clipped_per_epoch``,
    ``steps_per_epoch``, the step times, ``curve`` (per evaluation: step,
    epsilon, both accuracies) and ``config``; plus ``files``.

  Raises:
    demo.OutputDirError: if ``cfg.out`` cannot be written (before training).
    demo.ConfigError: for a bad privacy target, step count, batch size or
      clip norm.
    demo.MissingExtraError: without the ``demo`` extra (jax-privacy,
      dp-accounting, ...).
  """
  demo.require(demo.DP_PACKAGES, "DP demo")
  import optax  # pylint: disable=g-import-not-at-top
  from jax_privacy import accounting  # pylint: disable=g-import-not-at-top
  from jax_privacy import batch_selection  # pylint: disable=g-import-not-at-top
  from jax_privacy import noise_addition  # pylint: disable=g-import-not-at-top
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  x_tr, y_tr, x_ho, y_ho = demo.split_heldout(*demo.load_digits_data(),
                                              seed=cfg.seed)
  n = x_tr.shape[0]
  _check(cfg, n)
  out_dir = demo.prepare_out_dir(cfg.out, example="./dp_out")
  start = time.perf_counter()

  # Privacy: Poisson sampling at rate q, truncated to a fixed padded size.
  q = cfg.expected_batch_size / n
  max_batch = int(cfg.expected_batch_size +
                  4 * np.sqrt(cfg.expected_batch_size) + 1)
  # The PLD accountant discretises pessimistically: a coarser interval
  # only overstates epsilon (at the defaults, 300 steps: 2.987 against
  # 2.971 at an interval of 1e-4, 0.5% relative), and calibrates in about
  # a second instead of a minute and a half.
  accountant = accounting.DpsgdTrainingAccountant(
      dp_accountant_config=accounting.PldAccountantConfig(
          value_discretization_interval=1e-2))

  def dp_params(noise_multiplier):
    return accounting.DpParams(
        noise_multipliers=noise_multiplier, num_samples=n, delta=cfg.delta,
        batch_size=cfg.expected_batch_size, truncated_batch_size=max_batch)
  noise_multiplier = accounting.calibrate_noise_multiplier(
      target_epsilon=cfg.epsilon, accountant=accountant,
      batch_sizes=cfg.expected_batch_size, num_updates=cfg.steps,
      num_samples=n, target_delta=cfg.delta, truncated_batch_size=max_batch)
  sampler = batch_selection.CyclicPoissonSampling(
      sampling_prob=q, iterations=cfg.steps, truncated_batch_size=max_batch,
      partition_type=batch_selection.PartitionType.INDEPENDENT)

  tracked, plain, net = demo.make_model(cfg.hidden)
  params, state = tracked.init(jax.random.PRNGKey(cfg.seed),
                               x_tr[:max_batch], y_tr[:max_batch])
  # C from the held-out examples only: no training example is read.
  heldout_median = median_norm(tracked.apply, params, state, x_ho, y_ho)
  if cfg.l2_clip_norm is None:
    clip_norm, source = heldout_median, "heldout median at init"
  else:
    clip_norm, source = float(cfg.l2_clip_norm), "--clip-norm"
  clipped = gram_haiku.clipped_grad(
      tracked.apply, clip_norm, has_aux=True,
      normalize_by=cfg.expected_batch_size)
  stddev = noise_multiplier * clipped.sensitivity()
  privatizer = noise_addition.gaussian_privatizer(
      stddev=stddev, prng_key=jax.random.key(cfg.seed + 1))
  opt = optax.adam(cfg.learning_rate)
  opt_state, noise_state = opt.init(params), privatizer.init(params)
  base_params, base_opt_state = params, opt.init(params)

  def batch_of(indices):
    pad = max_batch - len(indices)
    idx = np.concatenate([indices, np.zeros(pad, indices.dtype)])
    return (x_tr[idx], y_tr[idx],
            np.arange(max_batch) >= len(indices))

  @jax.jit
  def clipped_sum(params, x, y, padding):
    return clipped(params, state, None, x, y, is_padding_example=padding)

  @jax.jit
  def step(params, opt_state, noise_state, x, y, padding):
    grads, aux = clipped(params, state, None, x, y,
                         is_padding_example=padding)
    noisy, noise_state = privatizer.update(grads, noise_state)
    updates, opt_state = opt.update(noisy, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, noise_state,
            aux.fraction_clipped)

  def baseline_loss(params, x, y, padding):
    per_example = demo.per_example_xent(net.apply(params, x), y)
    return (jnp.where(padding, 0.0, per_example).sum()
            / cfg.expected_batch_size)

  @jax.jit
  def baseline_step(params, opt_state, x, y, padding):
    """The DP step without clipping and noise: the same model, optimiser,
    batch and normalisation."""
    grads = jax.grad(baseline_loss)(params, x, y, padding)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  @jax.jit
  def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(net.apply(params, x), -1) == y)

  batches = sampler.batch_iterator(n, rng=cfg.seed)
  first = next(batches)
  x, y, padding = batch_of(first)
  # First batch: the clipped sum against vmap(grad) of the untracked model.
  got, _ = clipped_sum(params, x, y, padding)
  real = ~padding
  f = np.asarray(reference.per_example_grads(plain.apply, params, x[real],
                                             y[real]), np.float64)
  c_ref = reference.clip_reference(np.sqrt((f ** 2).sum(1)), clip_norm)
  want = reference.weighted_sum(f, c_ref / cfg.expected_batch_size, params)
  rel_err = reference.relative_error(
      np.concatenate([np.ravel(a) for a in jax.tree.leaves(got)]),
      np.concatenate([np.ravel(a) for a in jax.tree.leaves(want)]))
  print(f"first batch: relative error of the clipped gradient against the "
        f"vmap(grad) reference: {rel_err:.2e}")
  if cfg.l2_clip_norm is None:
    print(f"clip norm C = {clip_norm:.4g}: the median per-example gradient "
          f"norm of the initial model over the {x_ho.shape[0]} held-out "
          f"examples, which the privacy guarantee does not cover (they "
          f"stand for public data), so choosing C spends no budget; C taken "
          f"from the training examples' norms would not be private. "
          f"--clip-norm C fixes a public value.")
  else:
    print(f"clip norm C = {clip_norm:.4g} (--clip-norm; the held-out median "
          f"norm at initialisation is {heldout_median:.4g})")
  print(f"DP-SGD at epsilon={cfg.epsilon}, delta={cfg.delta}: noise "
        f"multiplier {noise_multiplier:.3f}, expected batch "
        f"{cfg.expected_batch_size} of {n} (padded to {max_batch}), "
        f"{cfg.steps} steps; non-private baseline: the same model, "
        f"optimiser and batches without clipping or noise")

  # Step times, after compilation: the DP step against the baseline's.
  step(params, opt_state, noise_state, x, y, padding)
  baseline_step(params, opt_state, x, y, padding)
  dp_s = _median_seconds(lambda: step(params, opt_state, noise_state, x, y,
                                      padding), cfg.timing_rounds)
  plain_s = _median_seconds(lambda: baseline_step(
      params, opt_state, x, y, padding), cfg.timing_rounds)

  def evaluate(i, eps):
    return {"step": i, "epsilon": float(eps),
            "heldout_accuracy": float(accuracy(params, x_ho, y_ho)),
            "baseline_heldout_accuracy":
                float(accuracy(base_params, x_ho, y_ho))}

  curve = [evaluate(0, 0.0)]
  bar = tqdm(total=cfg.steps, desc="dp-sgd", unit="step",
             disable=None if cfg.progress else True)
  eval_every = max(1, cfg.steps // 10)
  fractions, counts = [], []
  indices = first
  for i in range(cfg.steps):
    if i > 0:
      indices = next(batches)
      x, y, padding = batch_of(indices)
    params, opt_state, noise_state, frac = step(params, opt_state,
                                                noise_state, x, y, padding)
    base_params, base_opt_state = baseline_step(base_params, base_opt_state,
                                                x, y, padding)
    fractions.append(frac)
    counts.append(len(indices))
    bar.update(1)
    if (i + 1) % eval_every == 0 or i == cfg.steps - 1:
      curve.append(evaluate(
          i + 1, accountant.compute_epsilon(i + 1,
                                            dp_params(noise_multiplier))))
      bar.set_postfix(eps=f"{curve[-1]['epsilon']:.2f}",
                      acc=f"{curve[-1]['heldout_accuracy']:.3f}",
                      refresh=False)
  bar.close()
  steps_per_epoch = n / cfg.expected_batch_size
  per_epoch = fraction_per_epoch(np.asarray(fractions, np.float64), counts,
                                 steps_per_epoch)
  summary = {
      "clip_norm": clip_norm, "clip_norm_source": source,
      "heldout_median_norm_at_init": heldout_median,
      "rel_err_first_batch": rel_err, "noise_multiplier": noise_multiplier,
      "noise_stddev": float(stddev), "epsilon_spent": curve[-1]["epsilon"],
      "delta": cfg.delta,
      "final_heldout_accuracy": curve[-1]["heldout_accuracy"],
      "baseline_final_heldout_accuracy":
          curve[-1]["baseline_heldout_accuracy"],
      "steps_per_epoch": steps_per_epoch,
      "fraction_clipped_per_epoch": per_epoch,
      "dp_step_ms": dp_s * 1e3, "plain_step_ms": plain_s * 1e3,
      "dp_over_plain": dp_s / plain_s, "prng": str(
          jax.config.jax_default_prng_impl),
      "wall_time_s": time.perf_counter() - start, "curve": curve,
      "config": dataclasses.asdict(cfg)}
  print(f"fraction of the examples clipped per epoch ({steps_per_epoch:.1f} "
        f"steps): " + " ".join(f"{v:.2f}" for v in per_epoch))
  print(f"epsilon spent {summary['epsilon_spent']:.2f} (delta {cfg.delta}); "
        f"held-out accuracy {summary['final_heldout_accuracy']:.3f} "
        f"(non-private baseline "
        f"{summary['baseline_final_heldout_accuracy']:.3f}); DP step "
        f"{summary['dp_step_ms']:.2f} ms against {summary['plain_step_ms']:.2f}"
        f" ms non-private ({summary['dp_over_plain']:.2f}x, noise included)")
  print("Only the trained parameters are (epsilon, delta)-private: the "
        "first-batch check, the fraction clipped and the accuracies read "
        "the data without noise.")
  files = demo.write_stats(summary, out_dir, "dp_stats.json",
                           [plot(summary, out_dir)])
  print(f"wrote {', '.join(files)}")
  return summary


def plot(summary: dict[str, Any], out_dir: str) -> str:
  """Draws ``dp_accuracy.png`` from a summary (``dp_stats.json``'s
  contents): held-out accuracy of DP-SGD and of the non-private baseline
  against the step (epsilon spent on the top axis), and the fraction of
  the examples clipped per epoch below. Returns its path."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  curve = summary["curve"]
  steps = np.array([r["step"] for r in curve], np.float64)
  eps = np.array([r["epsilon"] for r in curve], np.float64)
  fig, (ax, ax_c) = plt.subplots(
      2, 1, figsize=(6, 5.2), sharex=True,
      gridspec_kw={"height_ratios": [2.2, 1]})
  ax.plot(steps, [r["heldout_accuracy"] for r in curve], "o-",
          label=f"DP-SGD ($\\epsilon$ = {summary['epsilon_spent']:.2f}, "
          f"$\\delta$ = {summary['delta']:g})")
  ax.plot(steps, [r["baseline_heldout_accuracy"] for r in curve], "s--",
          label="non-private (no clipping, no noise)")
  ax.set_ylabel("held-out accuracy")
  ax.set_ylim(0, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right")
  top = ax.secondary_xaxis(
      "top", functions=(lambda s: np.interp(s, steps, eps),
                        lambda e: np.interp(e, eps, steps)))
  # Ticks from the first evaluation on (epsilon grows fastest at first).
  ticks = matplotlib.ticker.MaxNLocator(6).tick_values(eps[1], eps[-1])
  top.set_xticks([t for t in ticks if eps[1] <= t <= eps[-1]])
  top.set_xlabel(r"$\epsilon$ spent by DP-SGD")
  fig.suptitle(f"DP-SGD on digits (gram_haiku.clipped_grad, C = "
               f"{summary['clip_norm']:.3g})", fontsize=10)
  per_epoch = summary["fraction_clipped_per_epoch"]
  spe = summary["steps_per_epoch"]
  left = np.arange(len(per_epoch)) * spe
  right = np.minimum(left + spe, steps[-1])  # The last epoch may be partial.
  ax_c.bar(left, per_epoch, width=0.9 * (right - left), align="edge",
           color="0.6")
  ax_c.set_ylim(0, 1)
  ax_c.set_ylabel("fraction clipped\n(per epoch)")
  ax_c.set_xlabel("step")
  ax_c.grid(alpha=0.3, axis="y")
  fig.tight_layout()
  path = os.path.join(out_dir, "dp_accuracy.png")
  fig.savefig(path, dpi=demo.DPI)
  plt.close(fig)
  return path
