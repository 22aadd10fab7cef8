"""The demo (main job) end to end on the bundled digits data."""

import json
import os

import numpy as np
import pytest

from gram_haiku import __main__ as cli
from gram_haiku.apps import demo

PLOTS = ("gram_heatmap.png", "gram_by_layer.png", "norms.png", "training.png")


def test_demo_runs_and_writes_outputs(tmp_path):
  out = tmp_path / "out"
  summary = demo.run_demo(demo.DemoConfig(steps=30, batch_size=32,
                                          out=str(out), progress=False))
  assert summary["rel_err_step0"] < 1e-4
  for name in PLOTS + ("stats.json",):
    path = out / name
    assert path.exists() and path.stat().st_size > 0
  with open(out / "stats.json") as f:
    stats = json.load(f)
  assert len(stats["history"]) == 30
  assert stats["config"]["batch_size"] == 32
  assert stats["data"]["n_train"] + stats["data"]["n_heldout"] == 1797
  losses = [r["loss"] for r in stats["history"]]
  assert np.mean(losses[-5:]) < np.mean(losses[:5])  # it trains
  for r in stats["history"]:
    assert 0 < r["norm_p10"] <= r["median_norm"] <= r["norm_p90"]
  # Held out once per epoch (44 steps of 32 here) and at the end.
  assert [r["step"] for r in stats["heldout"]] == [29]
  assert 0.0 <= stats["final_heldout_accuracy"] <= 1.0
  # The JSON holds what the plots show: the last batch's Gram is the sum of
  # its per-layer Grams, with one label per example.
  last = stats["last_batch"]
  total = np.asarray(last["gram"])
  assert total.shape == (32, 32) and len(last["labels"]) == 32
  np.testing.assert_allclose(sum(np.asarray(g) for g in
                                 last["by_layer"].values()), total,
                             rtol=1e-5, atol=1e-6 * np.abs(total).max())
  assert stats["history"][-1]["median_norm"] == pytest.approx(
      float(np.median(np.sqrt(np.diag(total)))), rel=1e-6)
  # ... and rebuilds them alone.
  again = tmp_path / "again"
  again.mkdir()
  files = demo.plot(stats, str(again))
  assert sorted(os.path.basename(f) for f in files) == sorted(PLOTS)
  from PIL import Image  # pylint: disable=g-import-not-at-top
  with Image.open(again / "gram_heatmap.png") as im:
    assert round(im.info["dpi"][0]) == demo.DPI


@pytest.mark.parametrize("batch_size", [1, 1438, 5000])
def test_batch_size_outside_the_data_is_an_error(tmp_path, batch_size):
  with pytest.raises(ValueError, match=r"--batch_size.*1437 training"):
    demo.run_demo(demo.DemoConfig(steps=1, batch_size=batch_size,
                                  out=str(tmp_path / "o"), progress=False))
  assert not (tmp_path / "o").exists()  # nothing written before the check


def test_cli_unwritable_out_is_a_clear_error(tmp_path, capsys):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  rc = cli.run(["demo", "--steps", "1", "--out", str(blocker / "sub"),
                "--no_progress"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "cannot write to --out" in err and str(blocker / "sub") in err
  assert "gram-haiku demo: error:" in err and "--out ./gram_out" in err
  rc = cli.run(["dp-demo", "--out", str(blocker / "sub"), "--no_progress"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "gram-haiku dp-demo: error: cannot write to --out" in err
  assert "--out ./dp_out" in err


def test_cli_demo_small(tmp_path, capsys):
  rc = cli.run(["demo", "--steps", "3", "--batch_size", "16", "--out",
                str(tmp_path), "--no_progress"])
  assert rc == 0
  out = capsys.readouterr().out
  assert "relative error of the Gram" in out and "held-out accuracy" in out
  assert os.path.exists(tmp_path / "stats.json")


def test_cli_version_and_usage(capsys):
  import gram_haiku  # pylint: disable=g-import-not-at-top
  with pytest.raises(SystemExit) as e:
    cli.run(["--version"])
  assert e.value.code == 0
  assert gram_haiku.__version__ in capsys.readouterr().out
  assert cli.run([]) == 2
  err = capsys.readouterr().err
  assert "give a command" in err and "demo" in err and "dest" not in err


@pytest.mark.parametrize("argv,usage,message", [
    (["demo", "--epochs", "3"], "gram-haiku demo", "--epochs 3"),
    (["demo", "--hidden", "0"], "gram-haiku demo", "must be at least 1"),
    (["dp-demo", "--steps", "0"], "gram-haiku dp-demo",
     "must be at least 1"),
])
def test_cli_bad_arguments_name_the_command(argv, usage, message, capsys):
  """An unknown or out-of-range argument is an error of its command (its
  usage, not the top level's), before anything trains."""
  with pytest.raises(SystemExit) as e:
    cli.run(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"{usage}: error:" in err and message in err, err


def test_cli_help_shows_plain_percent(capsys):
  with pytest.raises(SystemExit):
    cli.run(["demo", "--help"])
  out = capsys.readouterr().out
  assert "80% for" in out and "%%" not in out
  with pytest.raises(SystemExit):
    cli.run(["dp-demo", "--help"])
  out = " ".join(capsys.readouterr().out.split())  # Unwrapped.
  # Where the bound 718 comes from, and what the default C is.
  assert "2 to 718, half of the 1437 training examples" in out
  assert "median per-example gradient norm at initialisation over the " \
      "held-out examples" in out


def test_gram_stats_values():
  g = np.array([[4.0, 2.0], [2.0, 1.0]])  # collinear gradients
  stats = demo.gram_stats(g)
  assert stats["mean_norm"] == pytest.approx(1.5)
  assert stats["median_norm"] == pytest.approx(1.5)
  assert stats["mean_cosine"] == pytest.approx(1.0)
  g = np.array([[1.0, -1.0, 0.0], [-1.0, 1.0, 0.0], [0.0, 0.0, 4.0]])
  stats = demo.gram_stats(g)
  assert stats["mean_cosine"] == pytest.approx(-1 / 3)
  assert stats["median_norm"] == pytest.approx(1.0)


def test_dp_demo_runs_private_training(tmp_path, capsys):
  """DP-SGD with the default clip norm (the held-out median at
  initialisation: about half the examples clipped at first, not all) and
  the non-private baseline on the same axes."""
  import jax  # pylint: disable=g-import-not-at-top
  from gram_haiku.apps import dp_demo  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core import reference  # pylint: disable=g-import-not-at-top
  out = tmp_path / "dp"
  summary = dp_demo.run_dp_demo(dp_demo.DPDemoConfig(
      epsilon=8.0, steps=24, expected_batch_size=128, timing_rounds=2,
      out=str(out), progress=False))
  assert summary["rel_err_first_batch"] < 1e-4
  # The accountant spends the calibrated budget by the last step.
  assert summary["epsilon_spent"] == pytest.approx(8.0, rel=0.05)
  assert summary["noise_multiplier"] > 0
  # The noise and the epsilon against dp_accounting directly: std z C / B
  # (B the expected batch size, normalize_by), and Poisson sampling at
  # q = B / n truncated to the padded size, add-or-remove neighbours, for
  # every step taken; the demo's coarse PLD interval (1e-2) may only
  # overstate. (The check's interval, 1e-3: within 3e-6 of epsilon at 1e-4
  # here, in a tenth of the time.)
  import dp_accounting  # pylint: disable=g-import-not-at-top
  z, n, b = summary["noise_multiplier"], 1437, 128
  assert summary["noise_stddev"] == pytest.approx(
      z * summary["clip_norm"] / b, rel=1e-12)
  pld = dp_accounting.pld.PLDAccountant(
      dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
      value_discretization_interval=1e-3)
  pld.compose(dp_accounting.TruncatedSubsampledGaussianDpEvent(
      dataset_size=n, sampling_probability=b / n,
      truncated_batch_size=int(b + 4 * np.sqrt(b) + 1), noise_multiplier=z),
              24)
  fine = pld.get_epsilon(1e-5)
  assert fine <= summary["epsilon_spent"] <= fine * 1.01, fine
  assert summary["epsilon_spent"] <= 8.0
  eps = [r["epsilon"] for r in summary["curve"]]
  assert eps == sorted(eps) and eps[0] == 0.0 and len(eps) >= 3
  # C: the median norm over the held-out examples at initialisation, as
  # vmap(grad) of the untracked model gives it; no training example read.
  x_tr, y_tr, x_ho, y_ho = demo.split_heldout(*demo.load_digits_data(),
                                              seed=0)
  tracked, plain, _ = demo.make_model((64, 64))
  params, _ = tracked.init(jax.random.PRNGKey(0), x_tr[:4], y_tr[:4])
  f = np.asarray(reference.per_example_grads(plain.apply, params, x_ho, y_ho),
                 np.float64)
  want = float(np.median(np.sqrt((f ** 2).sum(1))))
  assert summary["clip_norm"] == pytest.approx(want, rel=1e-5)
  assert summary["clip_norm_source"] == "heldout median at init"
  # 24 steps of 1437/128 = 11.2: two epochs and part of a third, the first
  # with a fraction of its examples clipped (it was 1.0 throughout with a
  # fixed C = 1).
  per_epoch = summary["fraction_clipped_per_epoch"]
  assert summary["steps_per_epoch"] == pytest.approx(1437 / 128)
  assert len(per_epoch) == 3 and 0.2 < per_epoch[0] < 0.8, per_epoch
  # The baseline: the same initialisation, then trained without clipping
  # or noise on the same batches.
  first, last = summary["curve"][0], summary["curve"][-1]
  assert first["heldout_accuracy"] == first["baseline_heldout_accuracy"]
  assert last["baseline_heldout_accuracy"] > 0.5
  assert summary["baseline_final_heldout_accuracy"] == (
      last["baseline_heldout_accuracy"])
  assert 0.0 <= summary["final_heldout_accuracy"] <= 1.0
  printed = capsys.readouterr().out
  assert "held-out examples, which the privacy guarantee does not cover" in (
      printed)
  assert "fraction of the examples clipped per epoch" in printed
  assert "non-private baseline" in printed
  assert "Only the trained parameters are (epsilon, delta)-private" in printed
  for name in ("dp_accuracy.png", "dp_stats.json"):
    assert (out / name).stat().st_size > 0
  # The plot rebuilds from the JSON alone.
  with open(out / "dp_stats.json") as fh:
    again = dp_demo.plot(json.load(fh), str(tmp_path))
  assert os.path.getsize(again) > 0


def test_dp_demo_fraction_per_epoch():
  from gram_haiku.apps import dp_demo  # pylint: disable=g-import-not-at-top
  # 2.5 steps per epoch: steps 0-2 in epoch 0, 3-4 in 1, 5 in 2 (partial).
  got = dp_demo.fraction_per_epoch([1.0, 0.5, 0.0, 0.25, 1.0, 0.5],
                                   [2, 4, 2, 4, 0, 2], 2.5)
  assert got == pytest.approx([(2 + 2) / 8, 1 / 4, 0.5])


@pytest.mark.parametrize("flag", ["--clip-norm", "--clip_norm",
                                  "--l2_clip_norm", "--l2-clip-norm"])
def test_dp_demo_cli_fixed_clip_norm(flag, monkeypatch):
  from gram_haiku.apps import dp_demo  # pylint: disable=g-import-not-at-top
  seen = []
  monkeypatch.setattr(dp_demo, "run_dp_demo", seen.append)
  assert cli.run(["dp-demo", flag, "0.5", "--out", "/tmp/x"]) == 0
  assert seen[0].l2_clip_norm == 0.5
  seen.clear()
  assert cli.run(["dp-demo", "--out", "/tmp/x"]) == 0
  assert seen[0].l2_clip_norm is None  # The held-out median.


def test_dp_demo_rejects_a_bad_config(tmp_path):
  """Outside the command line, the config is checked before training."""
  from gram_haiku.apps import dp_demo  # pylint: disable=g-import-not-at-top
  for cfg, match in [(dict(epsilon=0.0), "epsilon > 0"),
                     (dict(expected_batch_size=719), "<= 718"),
                     (dict(l2_clip_norm=float("inf")), "finite number > 0")]:
    with pytest.raises(demo.ConfigError, match=match):
      dp_demo.run_dp_demo(dp_demo.DPDemoConfig(out=str(tmp_path / "o"),
                                               **cfg))
  assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv,message", [
    (["dp-demo", "--epsilon", "0"], "must be a finite number above 0"),
    (["dp-demo", "--epsilon", "nan"], "must be a finite number above 0"),
    (["dp-demo", "--delta", "1"], "must be between 0 and 1"),
    (["dp-demo", "--clip-norm", "0"], "argument --clip_norm/--clip-norm"),
    (["dp-demo", "--clip-norm", "inf"], "must be a finite number above 0"),
    (["dp-demo", "--expected_batch_size", "719"], "must be at most 718"),
    (["dp-demo", "--timing_rounds", "0"], "must be at least 1"),
    (["dp-demo", "--learning_rate", "-1"], "must be a finite number"),
    (["dp-demo", "--seed", "-1"], "must be at least 0"),
    (["demo", "--batch_size", "1438"], "must be at most 1437"),
    (["demo", "--batch_size", "1"], "must be at least 2"),
    (["demo", "--steps", "two"], "'two' is not an integer"),
    (["demo", "--learning_rate", "fast"], "'fast' is not a number"),
])
def test_cli_bad_values_are_usage_errors(argv, message, capsys):
  """Each value is checked by the parser: its command's usage and exit
  status 2, before anything is imported or trained."""
  with pytest.raises(SystemExit) as e:
    cli.run(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert f"gram-haiku {argv[0]}: error:" in err and message in err, err


def test_cli_training_count_matches_the_split():
  x_tr, *_ = demo.split_heldout(*demo.load_digits_data(), seed=0)
  assert cli.DIGITS_TRAIN == x_tr.shape[0]


def test_cli_missing_extra_names_it(monkeypatch, capsys):
  import importlib.util  # pylint: disable=g-import-not-at-top
  find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if
                      name in ("jax_privacy", "dp_accounting") else
                      find_spec(name, *a))
  assert cli.run(["dp-demo", "--out", "/tmp/x"]) == 2
  err = capsys.readouterr().err
  assert "gram-haiku dp-demo: error: the DP demo needs jax-privacy, " \
      "dp-accounting" in err and "pip install 'gram_haiku[demo]'" in err, err


def test_cli_exit_status_of_interrupts_and_bugs(monkeypatch, capsys):
  """Ctrl-C is status 130 without a traceback; an unexpected error keeps
  its traceback (it is not reported as a usage error)."""
  def interrupt(args):
    raise KeyboardInterrupt
  monkeypatch.setattr(cli, "_train", interrupt)
  assert cli.run(["demo"]) == 130
  assert "gram-haiku demo: interrupted" in capsys.readouterr().err

  def bug(args):
    raise ValueError("an internal error")
  monkeypatch.setattr(cli, "_train", bug)
  with pytest.raises(ValueError, match="an internal error"):
    cli.run(["demo"])


_LIGHT_DRIVER = r"""
import runpy, sys
from gram_haiku import __main__ as cli
cli._parser()
for argv in {argvs!r}:
  sys.argv = ["gram-haiku"] + argv
  try:  # As `python -m gram_haiku ...` runs it.
    runpy.run_module("gram_haiku", run_name="__main__", alter_sys=True)
  except SystemExit as e:
    print(argv, "exit", e.code)
heavy = ("jax", "haiku", "numpy", "gram_haiku.apps.demo",
         "gram_haiku.apps.dp_demo", "gram_haiku.apps.attribution_demo",
         "gram_haiku._src")
print("imported:", [m for m in heavy if m in sys.modules])
"""


def test_cli_parses_without_jax_haiku_or_the_demos():
  """--help, --version and a bad flag answer before JAX, Haiku, NumPy or
  the demos are imported (they cost about 1.5 s of CPU)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  argvs = [["--help"], ["--version"], ["demo", "--help"],
           ["dp-demo", "--help"], ["demo", "--epochs", "3"],
           ["dp-demo", "--steps", "0"], ["dp-demo", "--clip-norm", "0"],
           ["attribution-demo", "--help"],
           ["attribution-demo", "--flip-fraction", "1"]]
  proc = subprocess.run([sys.executable, "-c",
                         _LIGHT_DRIVER.format(argvs=argvs)],
                        capture_output=True, text=True, check=True)
  out = proc.stdout
  assert "imported: []" in out, out
  for argv, code in zip(argvs, [0, 0, 0, 0, 2, 2, 2, 0, 2]):
    assert f"{argv} exit {code}" in out, out
  assert "usage: gram-haiku dp-demo" in out and "--version" in out
  assert "usage: gram-haiku attribution-demo" in out
