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

On the first batch it prints the relative error of the clipped gradient
against the ``vmap(grad)`` reference ``sum_i min(1, C/|g_i|) g_i``. It
times the DP step against a non-private step of the same model (median of
``--timing_rounds`` steps each) and writes ``dp_stats.json`` and
``dp_accuracy.png`` (held-out accuracy against epsilon spent).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku._src import demo
from gram_haiku._src import reference


@dataclasses.dataclass
class DPDemoConfig:
  epsilon: float = 3.0
  delta: float = 1e-5
  steps: int = 300
  expected_batch_size: int = 128
  l2_clip_norm: float = 1.0
  hidden: tuple[int, ...] = (64, 64)
  learning_rate: float = 2e-3
  seed: int = 0
  timing_rounds: int = 20
  out: str = "dp_out"
  progress: bool = True


def _check(cfg: DPDemoConfig, n: int) -> None:
  if not cfg.epsilon > 0 or not 0 < cfg.delta < 1:
    raise ValueError(f"dp-demo: need epsilon > 0 and 0 < delta < 1, got "
                     f"epsilon={cfg.epsilon}, delta={cfg.delta}.")
  if cfg.steps < 1 or not 2 <= cfg.expected_batch_size <= n // 2:
    raise ValueError(f"dp-demo: need steps >= 1 and 2 <= "
                     f"expected_batch_size <= {n // 2}, got steps="
                     f"{cfg.steps}, expected_batch_size="
                     f"{cfg.expected_batch_size}.")


def _median_seconds(fn, rounds: int) -> float:
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def run_dp_demo(cfg: DPDemoConfig) -> dict[str, Any]:
  """Trains with DP-SGD; returns the summary written to ``dp_stats.json``.

  Raises:
    demo.OutputDirError: if ``cfg.out`` cannot be written (before training).
    ValueError: for a bad privacy target, step count or batch size.
  """
  import optax  # pylint: disable=g-import-not-at-top
  from jax_privacy import accounting  # pylint: disable=g-import-not-at-top
  from jax_privacy import batch_selection  # pylint: disable=g-import-not-at-top
  from jax_privacy import noise_addition  # pylint: disable=g-import-not-at-top
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  x_tr, y_tr, x_ho, y_ho = demo.split_heldout(*demo.load_digits_data(),
                                              seed=cfg.seed)
  n = x_tr.shape[0]
  _check(cfg, n)
  out_dir = demo.prepare_out_dir(cfg.out)
  start = time.perf_counter()

  # Privacy: Poisson sampling at rate q, truncated to a fixed padded size.
  q = cfg.expected_batch_size / n
  max_batch = int(cfg.expected_batch_size +
                  4 * np.sqrt(cfg.expected_batch_size) + 1)
  # The PLD accountant discretises pessimistically: a coarser interval
  # only overstates epsilon (here by < 1e-4 relative), and calibrates in
  # about a second instead of a minute and a half.
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
  clipped = gram_haiku.clipped_grad(
      tracked.apply, cfg.l2_clip_norm, has_aux=True,
      normalize_by=cfg.expected_batch_size)
  stddev = noise_multiplier * clipped.sensitivity()
  privatizer = noise_addition.gaussian_privatizer(
      stddev=stddev, prng_key=jax.random.key(cfg.seed + 1))
  opt = optax.adam(cfg.learning_rate)
  opt_state, noise_state = opt.init(params), privatizer.init(params)

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

  @jax.jit
  def plain_step(params, opt_state, x, y):
    grads = jax.grad(plain.apply)(params, x, y)
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
  c_ref = reference.clip_reference(np.sqrt((f ** 2).sum(1)),
                                   cfg.l2_clip_norm)
  want = reference.weighted_sum(f, c_ref / cfg.expected_batch_size, params)
  rel_err = reference.relative_error(
      np.concatenate([np.ravel(a) for a in jax.tree.leaves(got)]),
      np.concatenate([np.ravel(a) for a in jax.tree.leaves(want)]))
  print(f"first batch: relative error of the clipped gradient against the "
        f"vmap(grad) reference: {rel_err:.2e}")
  print(f"DP-SGD at epsilon={cfg.epsilon}, delta={cfg.delta}: noise "
        f"multiplier {noise_multiplier:.3f}, clip norm {cfg.l2_clip_norm}, "
        f"expected batch {cfg.expected_batch_size} of {n} (padded to "
        f"{max_batch}), {cfg.steps} steps")

  # Step times, after compilation: the DP step against a plain one.
  step(params, opt_state, noise_state, x, y, padding)
  plain_step(params, opt_state, x[:cfg.expected_batch_size],
             y[:cfg.expected_batch_size])
  dp_s = _median_seconds(lambda: step(params, opt_state, noise_state, x, y,
                                      padding), cfg.timing_rounds)
  plain_s = _median_seconds(lambda: plain_step(
      params, opt_state, x[:cfg.expected_batch_size],
      y[:cfg.expected_batch_size]), cfg.timing_rounds)

  curve, bar = [], tqdm(total=cfg.steps, desc="dp-sgd", unit="step",
                        disable=None if cfg.progress else True)
  eval_every = max(1, cfg.steps // 10)
  indices = first
  for i in range(cfg.steps):
    if i > 0:
      indices = next(batches)
      x, y, padding = batch_of(indices)
    params, opt_state, noise_state, frac = step(params, opt_state,
                                                noise_state, x, y, padding)
    bar.update(1)
    if (i + 1) % eval_every == 0 or i == cfg.steps - 1:
      eps = accountant.compute_epsilon(i + 1, dp_params(noise_multiplier))
      acc = float(accuracy(params, x_ho, y_ho))
      curve.append({"step": i + 1, "epsilon": float(eps),
                    "heldout_accuracy": acc,
                    "fraction_clipped": float(frac)})
      bar.set_postfix(eps=f"{eps:.2f}", acc=f"{acc:.3f}", refresh=False)
  bar.close()
  summary = {
      "rel_err_first_batch": rel_err, "noise_multiplier": noise_multiplier,
      "noise_stddev": float(stddev), "epsilon_spent": curve[-1]["epsilon"],
      "delta": cfg.delta, "final_heldout_accuracy":
          curve[-1]["heldout_accuracy"],
      "dp_step_ms": dp_s * 1e3, "plain_step_ms": plain_s * 1e3,
      "dp_over_plain": dp_s / plain_s, "prng": str(
          jax.config.jax_default_prng_impl),
      "wall_time_s": time.perf_counter() - start, "curve": curve,
      "config": dataclasses.asdict(cfg)}
  print(f"epsilon spent {summary['epsilon_spent']:.2f} (delta {cfg.delta}); "
        f"held-out accuracy {summary['final_heldout_accuracy']:.3f}; DP step "
        f"{summary['dp_step_ms']:.2f} ms against {summary['plain_step_ms']:.2f}"
        f" ms non-private ({summary['dp_over_plain']:.2f}x, noise included)")
  files = demo.write_stats(summary, out_dir, "dp_stats.json",
                           [_plot(curve, out_dir)])
  print(f"wrote {', '.join(files)}")
  return summary


def _plot(curve, out_dir: str) -> str:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(5, 3.5))
  ax.plot([r["epsilon"] for r in curve],
          [r["heldout_accuracy"] for r in curve], marker="o")
  ax.set_xlabel("epsilon spent")
  ax.set_ylabel("held-out accuracy")
  ax.set_title("DP-SGD on digits (gram_haiku.clipped_grad)")
  ax.grid(alpha=0.3)
  fig.tight_layout()
  path = os.path.join(out_dir, "dp_accuracy.png")
  fig.savefig(path, dpi=demo.DPI)
  plt.close(fig)
  return path
