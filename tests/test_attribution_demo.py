"""The attribution demo end to end on a small slice of the digits data, and
its accumulated influences against the ``vmap(grad)`` reference."""

import json
import os

import jax
import numpy as np
import pytest

from gram_haiku import __main__ as cli
from gram_haiku import testing
from gram_haiku.apps import attribution_demo as attr
from gram_haiku.apps import demo

#: 40 training examples in batches of 16: two full steps and one of 8 real
#: rows padded to 16; 10 of the 40 labels flipped.
SMALL = dict(train_examples=40, batch_size=16, epochs=1, hidden=(8,),
             queries=2, top=2, flip_fraction=0.25, learning_rate=0.5,
             seed=3, progress=False)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("attribution")
  steps = []
  summary = attr.run_attribution_demo(
      attr.AttributionConfig(out=str(out), **SMALL),
      on_step=lambda *a: steps.append(a))
  return out, summary, steps


def test_writes_outputs_and_the_json_rebuilds_the_plots(small_run, tmp_path):
  out, summary, _ = small_run
  for name in attr.PLOTS + (attr.STATS,):
    assert (out / name).stat().st_size > 0, name
  with open(out / attr.STATS) as f:
    stats = json.load(f)
  assert stats["steps"] == 3 and stats["data"]["n_train"] == 40
  assert stats["n_flipped"] == 10 and stats["fraction_flipped"] == 0.25
  assert sum(stats["flipped"]) == 10
  assert stats["eta"] == pytest.approx(0.5 / 16)
  assert stats["rel_err_step0"] < 1e-4
  flipped = np.asarray(stats["flipped"])
  for key in ("self_influence", "final_loss"):
    d = stats["detection"][key]
    assert d["k"] == 10
    for metric in ("precision_at_k", "roc_auc"):
      assert isinstance(d[metric], float) and 0.0 <= d[metric] <= 1.0, d
    # The stored scores give the stored metrics.
    assert d == attr.detection_scores(np.asarray(stats[key]), flipped)
  # A flipped example's given label differs from its true one, and only
  # a flipped one's.
  given, true = np.asarray(stats["given_label"]), np.asarray(stats["true_label"])
  np.testing.assert_array_equal(given != true, flipped)
  assert [len(q["helpful"]) for q in stats["queries"]] == [2, 2]
  # The plots rebuild from the JSON alone, byte for byte, at 200 dpi.
  files = attr.plot(stats, str(tmp_path))
  assert sorted(os.path.basename(f) for f in files) == sorted(attr.PLOTS)
  for f in files:
    with open(f, "rb") as a, open(out / os.path.basename(f), "rb") as b:
      assert a.read() == b.read(), f
  from PIL import Image  # pylint: disable=g-import-not-at-top
  with Image.open(tmp_path / "influence_grid.png") as im:
    assert round(im.info["dpi"][0]) == demo.DPI


def test_accumulated_influences_match_the_vmap_grad_reference(small_run):
  """Self-influence = sum over steps of eta |g_i|^2 and the influence on a
  query = sum of eta <g_i, h_q>, with g and h from jax.vmap(jax.grad)."""
  _, summary, steps = small_run
  _, plain, _ = attr.make_model(SMALL["hidden"])
  _, _, x_ho, y_ho = demo.split_heldout(*demo.load_digits_data(),
                                        seed=SMALL["seed"])
  q_idx = [q["heldout_index"] for q in summary["queries"]]
  xq, yq = x_ho[q_idx], y_ho[q_idx]
  grads = jax.jit(lambda p, *b: testing.per_example_grads(plain.apply, p, *b))
  want_self = np.zeros(40)
  want_cross = np.zeros((40, len(q_idx)))
  for _, params, x, y, w, idx, eta in steps:
    f = np.asarray(grads(params, x, y, w), np.float64)
    h = np.asarray(grads(params, xq, yq, np.ones(len(yq), np.float32)),
                   np.float64)
    real = w > 0
    np.testing.assert_array_equal(f[~real], 0.0)  # padding: no gradient
    want_self[idx[real]] += eta * (f[real] ** 2).sum(1)
    want_cross[idx[real]] += eta * f[real] @ h.T
  assert len(steps) == 3 and sorted(np.concatenate(
      [s[5][s[4] > 0] for s in steps])) == list(range(40))  # each once
  got = np.asarray(summary["self_influence"])
  assert (want_self > 0).all()
  np.testing.assert_allclose(got, want_self, rtol=1e-5)
  order = np.argsort(-want_self, kind="stable")
  assert [e["train_index"] for e in summary["top_self_influence"][:3]] == (
      order[:3].tolist())
  scale = np.abs(want_cross).max()
  assert scale > 0
  for c, q in enumerate(summary["queries"]):
    for e in q["helpful"] + q["harmful"]:
      assert e["influence"] == pytest.approx(
          want_cross[e["train_index"], c], abs=1e-5 * scale)
    assert q["helpful"][0]["influence"] == pytest.approx(
        want_cross[:, c].max(), abs=1e-5 * scale)
    assert q["harmful"][0]["influence"] == pytest.approx(
        want_cross[:, c].min(), abs=1e-5 * scale)


def test_flip_labels_and_detection_scores():
  y = np.arange(50) % 10
  noisy, flipped = attr.flip_labels(y, 0.2, np.random.default_rng(0))
  assert flipped.sum() == 10
  np.testing.assert_array_equal(noisy != y, flipped)
  assert ((0 <= noisy) & (noisy < 10)).all()
  scores = np.where(flipped, 2.0, 1.0)
  scores[np.flatnonzero(flipped)[0]] = 0.0  # one flipped ranked last
  d = attr.detection_scores(scores, flipped)
  assert d["k"] == 10 and d["precision_at_k"] == pytest.approx(0.9)
  assert d["roc_auc"] == pytest.approx(1 - 40 / 400)


def test_a_bad_config_writes_nothing(tmp_path):
  for cfg, match in [(dict(train_examples=4, flip_fraction=0.1),
                      "flip at least one"),
                     (dict(train_examples=20, batch_size=21), "batch_size"),
                     (dict(queries=11), "queries <= 10")]:
    with pytest.raises(demo.ConfigError, match=match):
      attr.run_attribution_demo(attr.AttributionConfig(
          out=str(tmp_path / "o"), **cfg))
  assert not (tmp_path / "o").exists()


def test_cli_flags(monkeypatch):
  seen = []
  monkeypatch.setattr(attr, "run_attribution_demo", seen.append)
  assert cli.run(["attribution-demo", "--flip-fraction", "0.2", "--epochs",
                  "2", "--batch-size", "32", "--hidden", "16", "16",
                  "--learning-rate", "0.1", "--queries", "3", "--top", "4",
                  "--train-examples", "100", "--seed", "7", "--out",
                  "/tmp/x", "--no-progress"]) == 0
  assert seen[0] == attr.AttributionConfig(
      flip_fraction=0.2, epochs=2, batch_size=32, hidden=(16, 16),
      learning_rate=0.1, queries=3, top=4, train_examples=100, seed=7,
      out="/tmp/x", progress=False)
  seen.clear()
  assert cli.run(["attribution-demo"]) == 0
  assert seen[0] == attr.AttributionConfig()  # the defaults agree


@pytest.mark.parametrize("argv,message", [
    (["--flip-fraction", "0"], "must be between 0 and 1"),
    (["--flip_fraction", "1"], "must be between 0 and 1"),
    (["--queries", "11"], "must be at most 10"),
    (["--epochs", "0"], "must be at least 1"),
    (["--train-examples", "1"], "must be at least 2"),
])
def test_cli_bad_values_are_usage_errors(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.run(["attribution-demo"] + argv)
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "gram-haiku attribution-demo: error:" in err and message in err, err
