"""The demo (main job) end to end on the bundled digits data."""

import json
import os

import numpy as np
import pytest

from gram_haiku import __main__ as cli
from gram_haiku._src import demo

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


def test_dp_demo_runs_private_training(tmp_path):
  from gram_haiku._src import dp_demo  # pylint: disable=g-import-not-at-top
  out = tmp_path / "dp"
  summary = dp_demo.run_dp_demo(dp_demo.DPDemoConfig(
      epsilon=8.0, steps=20, expected_batch_size=64, timing_rounds=2,
      out=str(out), progress=False))
  assert summary["rel_err_first_batch"] < 1e-4
  # The accountant spends the calibrated budget by the last step.
  assert summary["epsilon_spent"] == pytest.approx(8.0, rel=0.05)
  assert summary["noise_multiplier"] > 0
  eps = [r["epsilon"] for r in summary["curve"]]
  assert eps == sorted(eps) and len(eps) >= 2
  assert 0.0 <= summary["final_heldout_accuracy"] <= 1.0
  for name in ("dp_accuracy.png", "dp_stats.json"):
    assert (out / name).stat().st_size > 0


def test_dp_demo_cli_rejects_a_bad_target(capsys):
  assert cli.run(["dp-demo", "--epsilon", "0", "--out", "/tmp/x"]) == 2
  assert "epsilon > 0" in capsys.readouterr().err
