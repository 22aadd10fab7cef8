"""Smoke test of ``python -m benchmarks`` on a tiny MLP (no timing asserts)."""

import json

import pytest

from benchmarks import cli
from gram_haiku.conformance.plugin import thorough
from benchmarks import torch_peers

_TINY = ["--model", "mlp", "--batch_size", "8", "--hidden", "16",
         "--repeats", "2", "--rounds", "1", "--warmup", "1", "--min_block_s", "0",
         "--no_progress"]


def _load(out):
  with open(out / "models.json") as f:
    return json.load(f)


def test_runner_writes_json_table_and_plot(tmp_path):
  out = tmp_path / "bench"
  rc = cli.main([*_TINY, "--method", "plain,gram,norms,naive", "--no_torch",
                 "--out", str(out)])
  assert rc == 0
  data = _load(out)
  assert data["environment"]["jax"] and data["environment"]["backend"]
  recs = {r["method"]: r for r in data["records"]}
  assert set(recs) == {"plain", "gram", "norms", "naive"}
  for method, r in recs.items():
    assert r["status"] == "ok", r["status"]
    assert r["framework"] == "jax" and r["model"] == "mlp"
    assert r["batch_size"] == 8
    t = r["time"]
    assert t["n_steps"] == 2 and t["median_s"] > 0
    assert t["q25_s"] <= t["median_s"] <= t["q75_s"]
    assert r["memory"]["temp_bytes"] is not None
    assert r["flops"]["measured"] > 0
    if method == "plain":
      assert t["ratio"] is None
    else:
      assert t["ratio"] > 0 and t["ratio_q25"] <= t["ratio_q75"]
      assert r["memory"]["temp_ratio"] > 0
  for method in ("gram", "norms"):
    f = recs[method]["flops"]
    assert f["analytic_extra_min"] > 0 and f["analytic_min_ratio"] > 1
  # The targets are for the 784-512-512-10 MLP at B=128 only.
  assert all(v == "n/a" for _, _, _, v in data["targets"])
  assert (out / "models.png").stat().st_size > 0
  assert "list-table" in (out / "models_table.inc").read_text()


def test_peers_without_torch_are_skipped(tmp_path):
  if torch_peers.available():
    return  # covered by running the suite in the bench-torch environment
  out = tmp_path / "bench"
  assert cli.main([*_TINY, "--method", "plain,torch_plain,backpack_gram",
                   "--out", str(out)]) == 0
  recs = {r["method"]: r for r in _load(out)["records"]}
  for method in ("torch_plain", "backpack_gram"):
    assert recs[method]["status"] == "skipped: install .[bench-torch]"
    assert recs[method]["time"] is None
  assert recs["plain"]["status"] == "ok"


def test_unsupported_method_is_reported_not_raised(tmp_path, monkeypatch):
  from benchmarks import jax_methods

  def broken(prep, method):
    if method == "gram":
      raise NotImplementedError("no Gram rule for this layer yet\nmore")
    return original(prep, method)
  original = jax_methods.build
  monkeypatch.setattr(jax_methods, "build", broken)
  out = tmp_path / "bench"
  assert cli.main([*_TINY, "--method", "plain,gram", "--no_torch",
                   "--out", str(out)]) == 0
  recs = {r["method"]: r for r in _load(out)["records"]}
  assert recs["gram"]["status"] == (
      "unsupported: NotImplementedError: no Gram rule for this layer yet")
  assert recs["plain"]["time"]["median_s"] > 0


def test_small_models_are_checked_against_naive(tmp_path):
  """The small models (where per-layer overheads decide) build, and their
  tracked Gram passes the runner's check against ``vmap(grad)``."""
  out = tmp_path / "bench"
  models = "small_cnn,attn64" if thorough() else "small_cnn"
  rc = cli.main([*_TINY[2:], "--model", models, "--batch_size", "4",
                 "--method", "plain,gram", "--no_torch", "--out", str(out)])
  assert rc == 0
  recs = {(r["model"], r["method"]): r for r in _load(out)["records"]}
  assert set(recs) == {(m, k) for m in models.split(",")
                       for k in ("plain", "gram")}
  assert all(r["status"] == "ok" for r in recs.values()), recs


def test_gram_precision_option_reaches_the_tracked_model():
  # pylint: disable=g-import-not-at-top
  import jax
  from benchmarks import jax_methods
  from benchmarks import models
  args = cli.parser().parse_args([*_TINY, "--gram_precision", "default"])
  assert args.gram_precision == "default"
  bench = models.make("mlp", 8, None, [16], "auto")
  for precision in ("default", "highest"):
    prep = jax_methods.prepare(bench, gram_precision=precision)
    jaxpr = str(jax.make_jaxpr(prep.tracked["gram"].apply)(
        prep.params, prep.states["gram"], *bench.batch))
    assert f"precision=Precision.{precision.upper()})" in jaxpr


def test_the_analytic_floor_counts_the_symmetric_blocks():
  # The MLP's Gram at the threshold is its products and nothing else: XLA's
  # FLOP count of the compiled step matches the floor with the blocks (10 of
  # 16 block products; the full products would be 1.6 times as many).
  # pylint: disable=g-import-not-at-top
  import jax
  from benchmarks import analytic
  from benchmarks import harness
  from benchmarks import jax_methods
  from benchmarks import models
  from gram_haiku._src.compute import kernels
  if jax.default_backend() != "cpu":
    pytest.skip("the blocks are lowered for the CPU only")
  b = kernels.SYMMETRIC_MIN_ROWS
  bench = models.make("mlp", b, None, [64], "auto")
  prep = jax_methods.prepare(bench)
  flops = {m: harness.compile_jax(*jax_methods.build(prep, m)).flops
           for m in ("plain", "gram")}
  extra = flops["gram"] - flops["plain"]
  floor = analytic.extra_flops(bench.layers, b, "gram")
  assert abs(extra / floor - 1) < 0.05, (extra, floor)
  assert analytic.symmetric_fraction(b) == 10 / 16
  assert analytic.symmetric_fraction(b - 1) == 1


def test_device_time_runs_k_unchanged_steps_in_one_program(capsys):
  # The looped program computes the step k times, each on the unperturbed
  # parameters (the runtime zero adds nothing), so its sum is k times one.
  import jax.numpy as jnp
  import numpy as np
  from benchmarks import device_time
  params = {"w": jnp.asarray([1.5, -2.0, 0.25])}
  step = lambda p, x: (jnp.sum(p["w"] * x), p["w"] ** 2)
  x = jnp.asarray([0.5, 3.0, -4.0])
  one = float(jnp.sum(step(params, x)[0]) + jnp.sum(step(params, x)[1]))
  for k in (1, 3, 7):
    np.testing.assert_allclose(device_time.looped(step, (params, x), k)(),
                               k * one, rtol=1e-6)
  assert device_time.main(["--model", "tiny_mlp", "--method", "gram,norms",
                           "--k", "2", "--reps", "1", "--calls", "1"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert [ln.split()[1] for ln in lines[1:]] == ["plain", "gram", "norms"]


def test_a_step_below_the_timers_noise_is_unresolved_not_negative():
  # (t(k + 1) - t(1)) / k of two noisy timings can be zero or negative for
  # a step of microseconds (the conv-kernel table printed negative times):
  # it is NaN, printed "unresolved"; a resolved step keeps its time.
  import time as _time
  import numpy as np
  from benchmarks import device_time
  slow = lambda: _time.sleep(2e-3)
  fast = lambda: None
  kw = dict(k=2, reps=1, calls=3)
  assert np.isnan(device_time.per_step_s(slow, fast, **kw))
  resolved = device_time.per_step_s(fast, slow, **kw)
  assert 0.5e-3 < resolved < 0.1, resolved  # (2 ms more over k = 2 steps)
  assert device_time.format_time(float("nan")) == "unresolved"
  assert device_time.format_time(None, "ms") == "unresolved"
  assert device_time.format_time(1.5e-3, "ms") == "1.50 ms"
  assert device_time.format_time(2.5e-6) == "2.50 us"


def test_conv_kernels_agree_with_the_plain_gradient_and_each_other(capsys):
  # Every per-example kernel of benchmarks.conv_kernels sums to the plain
  # kernel gradient and gives vmap's Gram; main checks the Grams itself.
  import jax
  import numpy as np
  from benchmarks import conv_kernels
  rng = np.random.default_rng(3)
  for size, cin, cout, stride in conv_kernels.layers(image=6, channels=2):
    x = jax.numpy.asarray(rng.normal(size=(3, size, size, cin)), "float32")
    w = jax.numpy.asarray(rng.normal(size=(3, 3, cin, cout)), "float32")
    out = -(-size // stride)
    d = jax.numpy.asarray(rng.normal(size=(3, out, out, cout)), "float32")
    # Under jit: one compilation per kernel and layer, not one per
    # primitive.
    want_dw = jax.jit(conv_kernels.plain_step(stride))(w, x, d)[1]
    grams = {}
    # The Pallas kernel (interpret mode: half this test's time on a CPU) is
    # checked against float64 and the patch path in test_pallas_conv, its
    # layouts too; here in the thorough budget only.
    skipped = ("pallas_in", "pallas_d", "pallas_s") + (
        () if thorough() else ("pallas",))
    names = [k for k in conv_kernels.KERNELS if k not in skipped]
    for name in names:
      dw, grams[name] = jax.jit(conv_kernels.per_example_step(
          name, stride, jax.lax.Precision.HIGHEST))(w, x, d)
      np.testing.assert_allclose(dw.reshape(w.shape), want_dw, rtol=1e-5,
                                 atol=1e-5, err_msg=name)
    for name in names:
      np.testing.assert_allclose(grams[name], grams["vmap"], rtol=1e-5,
                                 atol=1e-4, err_msg=name)
  # The command line on two kernels (each timed kernel compiles two
  # looped programs per layer; every kernel's values are checked above).
  assert conv_kernels.main(["--batch_size", "2", "--image", "8", "--k", "1",
                            "--reps", "1", "--calls", "1",
                            "--kernel", "patches,phases"]) == 0
  lines = capsys.readouterr().out.splitlines()[1:]
  assert len(lines) == 3 * 3
  assert {ln.split()[1] for ln in lines} == {"plain", "patches", "phases"}


# -- the ``real`` suite (benchmarks.realistic) -------------------------------

def test_largest_fitting_brackets_the_budget_in_few_compiles():
  from benchmarks import realistic
  mem = lambda b: 1000 + 37 * b + b * b // 8  # bytes at batch size b
  limit = mem(700) + 5  # the largest fitting B is 700
  found = realistic.largest_fitting(mem, {8: mem(8), 16: mem(16)}, limit,
                                    steps=5)
  assert len(found["probes"]) <= 5
  assert found["max_batch"] <= 700 < (found["first_over"] or 10**9)
  assert found["first_over"] - found["max_batch"] <= 700 // 8
  assert all(m == mem(b) for b, m in found["probes"])
  # A linear memory: a first probe short of the far secant (a lower bound
  # that fits), then the root, then one grain above it.
  lin = lambda b: 100 * b
  found = realistic.largest_fitting(lin, {2: 200, 4: 400}, 100 * 50, 3)
  assert found["max_batch"] == 50
  assert found["probes"][:2] == [[43, 4300], [50, 5000]]
  assert found["first_over"] == 52  # one grain above: the bracket
  # Without steps: the secant's prediction only; a failing measure (a
  # compile that raises) counts as not fitting.
  found = realistic.largest_fitting(lin, {2: 200, 4: 400}, 5000, 0)
  assert found == {"max_batch": 4, "first_over": None, "predicted": 50.0,
                   "probes": []}

  def broken(b):
    raise RuntimeError("resource exhausted")
  found = realistic.largest_fitting(broken, {2: 200}, 5000, 1)
  assert found["max_batch"] == 2 and found["first_over"] == 42
  assert found["probes"] == [[42, None,
                              "RuntimeError: resource exhausted"]]


def test_weight_standardisation_and_the_real_table():
  import jax.numpy as jnp
  import numpy as np
  from benchmarks import models
  from benchmarks import report
  w = jnp.asarray(np.random.default_rng(0).normal(2.0, 3.0, (3, 3, 4, 5)),
                  "float32")
  s = np.asarray(models.standardise(w))
  np.testing.assert_allclose(s.mean(axis=(0, 1, 2)), 0, atol=1e-5)
  np.testing.assert_allclose(s.std(axis=(0, 1, 2)), 1, atol=1e-3)
  rec = lambda method, **kw: {
      "model": "gpt", "description": "GPT", "batch_size": 8, "status": "ok",
      "method": method, "time": {"median_s": 0.002, "ratio": 2.0,
                                 "timer": "device"},
      "memory": {"temp_bytes": 3 * 2**20, "temp_ratio": 1.5},
      "agreement": None, "microbatch_size": None, **kw}
  data = {"environment": {"device_kind": "TPU v5 lite", "backend": "tpu",
                          "jax": "0.10.2", "date": "2026-12-06T07:00:00"},
          "budget_bytes": 2**34,
          "records": [rec("dp_all", agreement={"reference": "jaxp_clipped",
                                               "max_rel_diff": 1.5e-7}),
                      rec("jaxp_clipped", microbatch_size=4)],
          "fits": [{"model": "gpt", "method": "dp_all", "max_batch": 96,
                    "first_over": 100},
                   {"model": "gpt", "method": "jaxp_clipped", "max_batch": 32,
                    "first_over": None}]}
  header, rows = report.real_rows(data)
  assert header[7] == "largest B in 16 GiB"
  assert rows[0][3:9] == ["2.00", "2.00x", "3.0", "1.50x", "96",
                          "1.5e-07 (jax-privacy)"]
  assert rows[1][7] == ">= 32" and rows[1][9] == "microbatch 4"
  rst = report.real_rst(data)
  assert rst.startswith(".. list-table:: TPU v5 lite, jax 0.10.2, "
                        "2026-12-06, device time")
  assert "* ``gpt``: GPT" in rst


def test_real_runs_of_one_model_each_merge(tmp_path):
  # --merge keeps the other models' rows of the JSON already there.
  path = tmp_path / "real_full.json"
  row = lambda model, method: {"model": model, "method": method}
  env = lambda date: {"date": date, "device_kind": "TPU v5 lite",
                      "jax": "0.10.2"}
  old = {"environment": env("2026-12-05"), "budget_bytes": 8,
         "records": [row("wrn", "plain"), row("gpt", "plain")],
         "fits": [row("wrn", "plain"), row("gpt", "plain")]}
  path.write_text(json.dumps(old))
  new = {"environment": env("2026-12-06"), "budget_bytes": 8,
         "records": [row("gpt", "dp_all")], "fits": [row("gpt", "dp_all")]}
  got = cli._merge_real(str(path), new, ["gpt"])
  assert got["records"] == [row("wrn", "plain"), row("gpt", "dp_all")]
  assert got["fits"] == [row("wrn", "plain"), row("gpt", "dp_all")]
  assert got["merged"] == [{"models": ["wrn"],
                            "environment": env("2026-12-05")}]
  assert cli._merge_real(str(path), {**new, "budget_bytes": 9},
                         ["gpt"])["records"] == new["records"]


# jax-privacy's clipped_grad calls optax.global_norm.
@pytest.mark.filterwarnings("ignore:optax.global_norm is deprecated")
def test_real_suite_smoke(tmp_path):
  """The ``real`` suite's smoke scale from the command line: every method
  compiles, runs, agrees with its reference (jax-privacy, per-layer
  jax-privacy, ``vmap(grad)``), and the JSON renders to the table. The
  test suite runs the GPT decoder at one batch size (about 20 s of CPU);
  ``--thorough`` runs the whole smoke configuration."""
  from benchmarks import realistic
  from gram_haiku._src.core.reference import CLIP_BOUND_SLACK
  out = tmp_path / "real"
  args = ["--suite", "real", "--scale", "smoke", "--repeats", "1",
          "--rounds", "1", "--no_progress", "--out", str(out)]
  if thorough():
    args += ["--fit_steps", "1"]
  else:
    args += ["--model", "gpt", "--batch_sizes", "2", "--fit_steps", "0"]
  # --no_pallas empties the cost model's Pallas platforms for the run only.
  from gram_haiku._src.compute import cost_model
  kept = cost_model.PALLAS_GHOST_GRAM, cost_model.PALLAS_CONV_GRADS
  assert cli.main(args + ["--no_pallas"]) == 0
  assert (cost_model.PALLAS_GHOST_GRAM, cost_model.PALLAS_CONV_GRADS) == kept
  with open(out / "real_smoke.json") as f:
    data = json.load(f)
  names = ("wrn", "vit", "gpt") if thorough() else ("gpt",)
  recs = {(r["model"], r["batch_size"], r["method"]): r
          for r in data["records"]}
  sizes = (2, 4) if thorough() else (2,)
  assert set(recs) == {(m, b, k) for m in names for b in sizes
                       for k in realistic.METHODS}
  for r in recs.values():
    assert r["status"] == "ok", r
    assert r["time"]["median_s"] > 0 and r["memory"]["temp_bytes"] > 0
    # gram_haiku clips by sound upper bounds of the norms, up to
    # CLIP_BOUND_SLACK above them (the weight-standardised WRN's at 1.4e-4
    # here): its clipped sums differ from jax-privacy's by about as much.
    if r["method"] in ("dp_all", "dp_layer"):
      assert r["agreement"]["max_rel_diff"] < 2 * CLIP_BOUND_SLACK, r
    if r["method"] == "gram":
      assert r["agreement"]["max_rel_diff"] < 1e-5, r
  fits = {(f["model"], f["method"]): f for f in data["fits"]}
  assert set(fits) == {(m, k) for m in names for k in realistic.METHODS}
  assert all(f["max_batch"] >= 2 and f["predicted"] for f in fits.values())
  inc = (out / "real_smoke_table.inc").read_text()
  assert inc.startswith(".. list-table::") and "jax-privacy" in inc


def test_the_weight_standardised_wrn_is_exact():
  """The benchmarks' WRN (smoke size: every convolution weight-standardised
  by :func:`gram_haiku.standardise_weight`, read in closed form) against
  the float64 reference: its Gram, clip norms and clipped sum. Thorough
  only (its compiles take about a minute cold); the default run checks
  marked layers in tests/test_reparam.py and tests/test_clip_bound.py."""
  if not thorough():
    pytest.skip("thorough: the WRN's compiles take about a minute cold")
  import haiku as hk
  import jax
  import numpy as np
  import gram_haiku
  from benchmarks import models
  from benchmarks import realistic
  from gram_haiku._src.core.reference import assert_gram_close
  from gram_haiku._src.core.reference import clip_reference
  from gram_haiku._src.core.reference import per_example_grads
  kwargs, _ = realistic.SCALES["smoke"]["wrn"]
  bench = models.make_wrn(batch_size=3, **kwargs)

  def tracked(*batch):
    with gram_haiku.track():
      return bench.net(*batch).sum()
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), *bench.batch)
  plain = hk.without_apply_rng(hk.transform(lambda *b: bench.net(*b).sum()))
  with jax.enable_x64(True):
    fr = np.asarray(per_example_grads(
        plain.apply, jax.tree.map(lambda a: np.asarray(a, np.float64),
                                  params),
        *(np.asarray(a, np.float64) if a.dtype.kind == "f" else a
          for a in bench.batch)), np.float64)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, *bench.batch)
  assert_gram_close(grams.total, fr @ fr.T)
  norms = np.linalg.norm(fr, axis=1)
  c = float(np.median(norms))
  clipped, aux = jax.jit(gram_haiku.clipped_grad(f.apply, c))(
      params, state, None, *bench.batch)
  assert np.all(np.asarray(aux.grad_norms, np.float64) >= norms * (1 - 1e-9))
  np.testing.assert_allclose(aux.grad_norms, norms, rtol=1e-3)
  want = clip_reference(norms, c) @ fr
  got = np.concatenate([np.ravel(g) for g in jax.tree.leaves(clipped)])
  np.testing.assert_allclose(got, want, rtol=1e-3,
                             atol=1e-4 * np.max(np.abs(want)))
