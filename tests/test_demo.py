"""The demo (main job) end to end on the bundled digits data."""

import json
import os

import numpy as np
import pytest

from gram_haiku import __main__ as cli
from gram_haiku._src import demo


def test_demo_runs_and_writes_outputs(tmp_path):
  out = tmp_path / "out"
  summary = demo.run_demo(demo.DemoConfig(steps=30, batch_size=32,
                                          out=str(out), progress=False))
  assert summary["rel_err_step0"] < 1e-4
  for name in ("gram_heatmap.png", "norms.png", "stats.json"):
    path = out / name
    assert path.exists() and path.stat().st_size > 0
  with open(out / "stats.json") as f:
    stats = json.load(f)
  assert len(stats["history"]) == 30
  losses = [r["loss"] for r in stats["history"]]
  assert np.mean(losses[-5:]) < np.mean(losses[:5])  # it trains
  assert all(r["mean_norm"] > 0 for r in stats["history"])


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
  assert "relative error of the Gram" in capsys.readouterr().out
  assert os.path.exists(tmp_path / "stats.json")


def test_gram_stats_values():
  g = np.array([[4.0, 2.0], [2.0, 1.0]])  # collinear gradients
  stats = demo.gram_stats(g)
  assert stats["mean_norm"] == pytest.approx(1.5)
  assert stats["mean_cosine"] == pytest.approx(1.0)
