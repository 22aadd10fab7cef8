"""The Pallas ghost Gram and ghost norms (``pallas_ghost``), in interpret mode.

CI has no TPU, so the kernels run in Pallas interpret mode on the CPU and
are checked against a float64 numpy evaluation of
``G[i, j] = sum_{t,s} (x_it . x_js)(d_it . d_js)`` and against the XLA path
(``kernels.ghost_gram``, ``kernels.ghost_sq_norms`` at ``HIGHEST``), for
float32 and bfloat16 inputs, sizes that are no tile multiples, several
tiles of examples and positions, and a zero cotangent beside an ``inf``
input. The benchmark script's smoke shape runs too.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import pallas_ghost as pg

HIGHEST = lax.Precision.HIGHEST
XLA = kernels.LOCAL.replace(precision=HIGHEST)

#: The largest difference relative to the largest entry: both paths
#: accumulate in float32 (bfloat16 products are exact in float32).
TOL = {"float32": 2e-6, "bfloat16": 2e-6}


def _inputs(b, t, n, m, dtype, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, t, n)), dtype)
  d = jnp.asarray(rng.standard_normal((b, t, m)), dtype)
  return x, d


def _reference(x, d):
  x = np.asarray(x, np.float64)
  d = np.asarray(d, np.float64)
  kx = np.einsum("itn,jsn->itjs", x, x)
  kd = np.einsum("itm,jsm->itjs", d, d)
  return np.einsum("itjs->ij", kx * kd)


def _rel(a, ref):
  ref = np.asarray(ref, np.float64)
  return np.max(np.abs(np.asarray(a, np.float64) - ref)) / np.max(np.abs(ref))


# (B, T, N, M, dtype, tiling): odd sizes in one tile; then several example
# blocks (20 = 3 blocks of 8) with several position tiles (37 = 3 of 16),
# so that off-diagonal block pairs, diagonal tile pairs t < s and the
# padding all occur.
CASES = [
    (5, 7, 33, 17, "float32", {}),
    (5, 7, 33, 17, "bfloat16", {}),
    (20, 37, 40, 130, "float32", dict(block_examples=8, block_positions=16)),
]


@pytest.mark.parametrize("b,t,n,m,dtype,tiling", CASES)
def test_gram_matches_float64_and_the_xla_path(b, t, n, m, dtype, tiling):
  x, d = _inputs(b, t, n, m, dtype)
  g = pg.ghost_gram_pallas(x, d, precision=HIGHEST, interpret=True,
                           **tiling)
  assert g.shape == (b, b) and g.dtype == jnp.float32
  ref = _reference(x, d)
  assert _rel(g, ref) < TOL[dtype]
  xla = kernels.ghost_gram(x.astype(jnp.float32), d.astype(jnp.float32), XLA)
  assert _rel(g, xla) < TOL[dtype]
  np.testing.assert_array_equal(g, g.T)  # G = U + U^T: exactly symmetric


@pytest.mark.parametrize("b,t,n,m,dtype,tiling", CASES)
def test_sq_norms_match_float64_and_the_xla_path(b, t, n, m, dtype, tiling):
  x, d = _inputs(b, t, n, m, dtype)
  # Two position tiles where the case has several (pairs t < s count twice).
  bp = tiling.get("block_positions")
  nrm = pg.ghost_sq_norms_pallas(x, d, precision=HIGHEST, interpret=True,
                                 block_positions=bp)
  assert nrm.shape == (b,) and nrm.dtype == jnp.float32
  assert _rel(nrm, np.diag(_reference(x, d))) < TOL[dtype]
  xla = kernels.ghost_sq_norms(x.astype(jnp.float32), d.astype(jnp.float32),
                               XLA)
  assert _rel(nrm, xla) < TOL[dtype]


def test_zero_cotangent_beside_inf_input_gives_zero_not_nan():
  """An example whose cotangent is 0 has gradient 0 even where its input
  overflowed: its kernel entries are inf (or NaN against a zero column),
  its cotangent's are 0, and their product counts 0, as in
  ``kernels._product_of_kernels``."""
  x, d = _inputs(5, 7, 33, 17, "float32", seed=1)
  x = x.at[2, 3, 0].set(jnp.inf)
  d = d.at[2].set(0.0)
  g = pg.ghost_gram_pallas(x, d, precision=HIGHEST, interpret=True)
  nrm = pg.ghost_sq_norms_pallas(x, d, precision=HIGHEST, interpret=True)
  assert np.all(np.isfinite(g)) and np.all(np.isfinite(nrm))
  np.testing.assert_array_equal(g[2], 0.0)
  np.testing.assert_array_equal(g[:, 2], 0.0)
  assert nrm[2] == 0.0
  ref = _reference(x.at[2].set(0.0), d)
  assert _rel(g, ref) < TOL["float32"]
  assert _rel(nrm, np.diag(ref)) < TOL["float32"]
  xla = kernels.ghost_gram(x, d, XLA)
  assert np.all(np.isfinite(xla)) and _rel(g, xla) < TOL["float32"]


def test_default_precision_and_mixed_dtypes_run():
  """``precision=None`` is the library's ``HIGHEST``; a bfloat16 input
  beside a float32 one is computed in float32."""
  x, d = _inputs(5, 7, 33, 17, "float32")
  g = pg.ghost_gram_pallas(x.astype(jnp.bfloat16), d, interpret=True)
  ref = _reference(x.astype(jnp.bfloat16), d)
  assert _rel(g, ref) < TOL["float32"]


def test_empty_and_featureless_inputs_give_zeros():
  x, d = _inputs(0, 3, 4, 5, "float32")
  assert pg.ghost_gram_pallas(x, d).shape == (0, 0)
  assert pg.ghost_sq_norms_pallas(x, d).shape == (0,)
  x, d = _inputs(3, 4, 0, 5, "float32")
  np.testing.assert_array_equal(pg.ghost_gram_pallas(x, d), np.zeros((3, 3)))
  np.testing.assert_array_equal(pg.ghost_sq_norms_pallas(x, d), np.zeros(3))


def test_bad_shapes_dtypes_and_tilings_are_refused():
  x, d = _inputs(3, 4, 5, 6, "float32")
  with pytest.raises(ValueError, match=r"x: \(B, T, N\)"):
    pg.ghost_gram_pallas(x, d[:2])
  with pytest.raises(ValueError, match=r"ghost_sq_norms_pallas"):
    pg.ghost_sq_norms_pallas(x[:, 0], d)
  with pytest.raises(TypeError, match="float32 or bfloat16"):
    pg.ghost_gram_pallas(x.astype(jnp.int32), d)
  with pytest.raises(ValueError, match="block_examples=24"):
    pg.ghost_gram_pallas(x, d, block_examples=24)
  with pytest.raises(ValueError, match="block_positions=4"):
    pg.ghost_gram_pallas(x, d, block_examples=8, block_positions=4)
  wide = jax.ShapeDtypeStruct((2, 3, 30000), jnp.float32)
  with pytest.raises(ValueError, match="N \\+ M = 60000 features"):
    jax.eval_shape(pg.ghost_gram_pallas, wide, wide)
  with pytest.raises(ValueError, match="ghost_sq_norms_pallas: the smallest"):
    jax.eval_shape(pg.ghost_sq_norms_pallas, wide, wide)
  with pytest.raises(ValueError, match="multiple of 16 for bfloat16"):
    pg.ghost_sq_norms_pallas(x.astype(jnp.bfloat16), d.astype(jnp.bfloat16),
                             block_positions=8)


def test_default_precision_on_a_tpu_reads_bfloat16():
  """At ``DEFAULT`` on a TPU the float32 inputs are rounded to bfloat16
  ahead of the kernel (one MXU pass, as XLA's); interpret mode and
  ``HIGHEST`` keep float32."""
  x, d = _inputs(2, 3, 4, 5, "float32")
  default, highest = lax.Precision.DEFAULT, HIGHEST
  assert pg.compute_dtype(x, d, default, False) == jnp.bfloat16
  assert pg.compute_dtype(x, d, default, True) == jnp.float32
  assert pg.compute_dtype(x, d, highest, False) == jnp.float32


@pytest.mark.parametrize("b,t,n,m", [(128, 65, 384, 1536),
                                     (16, 256, 768, 3072),
                                     (8, 1024, 512, 512),
                                     (1000, 50, 1024, 4096)])
def test_tiles_of_the_benchmark_layers_fit_vmem(b, t, n, m):
  """The tiling (no kernel runs): whole 128-lane rows, the VMEM budget."""
  for dtype in (jnp.float32, jnp.bfloat16):
    tiles = pg.gram_tiles(b, t, n, m, dtype)
    assert (tiles.tp * tiles.be) % pg.LANES == 0
    assert tiles.be <= pg.LANES and tiles.b % tiles.be == 0
    assert tiles.t % tiles.tp == 0 and tiles.t >= t
    assert tiles.vmem_bytes <= pg.VMEM_BUDGET_BYTES
    eb, ntiles = pg.norm_tiles(b, t, n, m, dtype)
    assert ntiles.tp % pg.LANES == 0 and 1 <= eb <= 8
    assert ntiles.vmem_bytes <= pg.VMEM_BUDGET_BYTES


def test_tpu_lowering_of_both_kernels():
  """Both kernels lower to Mosaic for a TPU (from the CPU, by
  ``jax.export``), at both precisions: what a TPU compiles."""
  args = (jax.ShapeDtypeStruct((20, 37, 40), jnp.float32),
          jax.ShapeDtypeStruct((20, 37, 130), jnp.float32))
  for fn in (pg.ghost_gram_pallas, pg.ghost_sq_norms_pallas):
    for p in (lax.Precision.DEFAULT, HIGHEST):
      exported = jax.export.export(
          jax.jit(lambda x, d, fn=fn, p=p: fn(x, d, precision=p)),
          platforms=["tpu"])(*args)
      assert "tpu_custom_call" in exported.mlir_module()


def test_benchmark_smoke(tmp_path):
  """``python -m benchmarks.pallas_ghost --smoke``: the tiny shape, in
  interpret mode off a TPU, every method within float32 rounding of the
  XLA path at ``HIGHEST``."""
  from benchmarks import pallas_ghost as bench  # pylint: disable=g-import-not-at-top
  assert bench.main(["--out", str(tmp_path), "--smoke", "--calls", "1"]) == 0
  result = json.loads((tmp_path / "pallas_ghost.json").read_text())
  rows = result["rows"]
  assert {r["method"] for r in rows} == {
      "xla_default", "xla_highest", "pallas_default", "pallas_highest"}
  assert all("error" not in r and r["time_ms"] > 0 for r in rows), rows
  if result["backend"] != "tpu":  # Off a TPU, DEFAULT is float32 too.
    assert all(r["rel_err"] < 1e-5 for r in rows), rows


# -- the cost model's selection (kernels.ghost_gram) ---------------------------

def test_ghost_gram_selects_the_pallas_kernel_on_its_platforms(monkeypatch):
  """``kernels.ghost_gram`` runs the Pallas kernel on the platforms of
  ``cost_model.PALLAS_GHOST_GRAM`` (a TPU; here the CPU, in interpret
  mode) and XLA's path elsewhere: the lowered program holds the kernel
  only when the platform is listed, and both agree with float64."""
  from gram_haiku._src.compute import cost_model  # pylint: disable=g-import-not-at-top
  x, d = _inputs(6, 9, 24, 40, "float32", seed=3)
  ref = _reference(x, d)
  gram = jax.jit(lambda x, d: kernels.ghost_gram(x, d, XLA))
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ())
  xla_text = gram.lower(x, d).as_text()
  xla = gram(x, d)
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ("cpu",))
  gram = jax.jit(lambda x, d: kernels.ghost_gram(x, d, XLA))
  pallas_text = gram.lower(x, d).as_text()
  got = gram(x, d)
  assert pallas_text != xla_text
  assert _rel(xla, ref) < TOL["float32"]
  assert _rel(got, ref) < TOL["float32"]
  assert got.dtype == xla.dtype == jnp.float32


@pytest.mark.parametrize("case", ["spread", "float64", "symbolic"])
def test_pallas_is_not_selected_where_it_cannot_run(case, monkeypatch):
  """The XLA path is kept where the examples are spread over a mesh, for
  float64 factors and for ``jax.export``'s symbolic sizes."""
  from gram_haiku._src.compute import cost_model  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ("cpu", "tpu"))
  x = jax.ShapeDtypeStruct((4, 3, 8), jnp.float32)
  d = jax.ShapeDtypeStruct((4, 3, 5), jnp.float32)
  axes = False
  if case == "spread":
    axes = True
  elif case == "float64":
    x = jax.ShapeDtypeStruct((4, 3, 8), np.float64)
  else:
    b, = jax.export.symbolic_shape("b")
    x = jax.ShapeDtypeStruct((b, 3, 8), jnp.float32)
  assert cost_model.pallas_ghost_gram_platforms(x, d, axes) == ()
  x = jax.ShapeDtypeStruct((4, 3, 8), jnp.float32)
  assert cost_model.pallas_ghost_gram_platforms(x, d, False) == ("cpu",
                                                                 "tpu")


@pytest.mark.parametrize("spec", ["rows", "replicated"])
def test_examples_sharded_on_an_explicit_mesh_keep_the_xla_path(
    spec, monkeypatch):
  """Under an Explicit mesh, rows sharded or not, no Pallas call is traced
  (the XLA path's blocks follow the mesh; the kernel's own ops carry no
  sharding types: in interpret mode they failed with a ShardingTypeError)."""
  from gram_haiku._src.compute import cost_model  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ("cpu",))
  calls = []
  kernel = pg.ghost_gram_pallas
  monkeypatch.setattr(pg, "ghost_gram_pallas",
                      lambda *a, **k: calls.append(1) or kernel(*a, **k))
  mesh = jax.make_mesh((1,), ("data",),
                       axis_types=(jax.sharding.AxisType.Explicit,))
  p = jax.sharding.PartitionSpec("data" if spec == "rows" else None)
  x, d = _inputs(4, 3, 8, 5, "float32", seed=2)
  with jax.set_mesh(mesh):
    x = jax.device_put(x, p)
    d = jax.device_put(d, p)
    got = jax.jit(lambda x, d: kernels.ghost_gram(x, d, XLA))(x, d)
  assert not calls
  assert _rel(got, _reference(x, d)) < TOL["float32"]


def test_a_tracked_sequence_model_through_the_pallas_ghost_gram(monkeypatch):
  """End to end: ``value_grad_and_gram`` of a two-layer sequence model with
  the ghost method forced, its ghost Grams by the Pallas kernel (interpret
  mode), against ``F F^T`` of ``vmap(grad)`` in float64 numpy."""
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import gram_haiku  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.compute import cost_model  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.core import reference  # pylint: disable=g-import-not-at-top
  from tests import problems  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ("cpu",))
  calls = []
  kernel = pg.ghost_gram_pallas

  def spy(x, d, **kw):
    calls.append((*x.shape, d.shape[-1]))
    return kernel(x, d, **kw)
  monkeypatch.setattr(pg, "ghost_gram_pallas", spy)

  def net(x):
    h = jnp.tanh(hk.Linear(12)(x))
    return jnp.sum(hk.Linear(3)(h) ** 2, axis=(-2, -1))

  def tracked(x):
    with gram_haiku.track(strategy="ghost"):
      return net(x).sum()

  x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 6, 7)),
                  jnp.float32)
  grams, ref = problems.tracked_gram(net, tracked, x)[4:]
  assert sorted(calls) == [(5, 6, 7, 12), (5, 6, 12, 3)]
  assert reference.relative_error(grams.total, ref) < 1e-5


def test_the_selected_kernel_is_differentiable_like_the_xla_path(
    monkeypatch):
  """A loss of the Gram differentiates through the Pallas branch (the
  kernel has no JVP of its own; XLA's path's is used), under ``grad`` and
  ``jvp``, with the XLA path's values."""
  from gram_haiku._src.compute import cost_model  # pylint: disable=g-import-not-at-top
  x, d = _inputs(4, 5, 9, 6, "float32", seed=7)
  loss = lambda x, d: jnp.sum(jnp.sin(kernels.ghost_gram(x, d, XLA)))
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ())
  want = jax.grad(loss, argnums=(0, 1))(x, d)
  want_t = jax.jvp(loss, (x, d), (d[..., :1] * x, x[..., :6]))[1]
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ("cpu",))
  got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, d)
  got_t = jax.jvp(loss, (x, d), (d[..., :1] * x, x[..., :6]))[1]
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
  np.testing.assert_allclose(got_t, want_t, rtol=1e-5)


# -- the block across two sets (cross_gram) -------------------------------------

@pytest.mark.parametrize("b,v,t,tiling", [
    (5, 3, 7, None),        # one tile each, fewer columns than rows
    (9, 20, 37, (8, 16)),   # several example blocks and position tiles
])
def test_cross_block_matches_float64(b, v, t, tiling):
  """``ghost_cross_pallas``: every pair of example blocks, nothing
  mirrored, equal to ``F_rows F_cols^T`` of the ghost products."""
  x, d = _inputs(b, t, 6, 5, "float32", seed=b)
  x2, d2 = _inputs(v, t, 6, 5, "float32", seed=v + 100)
  x2 = x2 + 30.0  # a large offset between the sets
  be, tp = tiling or (None, None)
  got = pg.ghost_cross_pallas(x, d, x2, d2, precision=HIGHEST, interpret=True,
                              block_examples=be, block_positions=tp)
  x64, d64 = np.asarray(x, np.float64), np.asarray(d, np.float64)
  y64, e64 = np.asarray(x2, np.float64), np.asarray(d2, np.float64)
  ref = np.einsum("itjs->ij", np.einsum("itn,jsn->itjs", x64, y64) *
                  np.einsum("itm,jsm->itjs", d64, e64))
  assert got.shape == (b, v)
  assert _rel(got, ref) < TOL["float32"]
  with pytest.raises(ValueError, match="differ from the rows'"):
    pg.ghost_cross_pallas(x, d, x2[:, :2], d2[:, :2], interpret=True)


def test_a_cross_block_selects_the_pallas_kernel_like_the_gram(monkeypatch):
  """``kernels.ghost_gram`` with ``row_split`` (cross_gram's block) runs
  the cross kernel where the Gram runs the Pallas kernel, and both paths
  agree with the block of the float64 Gram."""
  from gram_haiku._src.compute import cost_model  # pylint: disable=g-import-not-at-top
  x, d = _inputs(7, 9, 24, 40, "float32", seed=5)
  cfg = XLA.replace(row_split=4)
  ref = _reference(x, d)[:4, 4:]
  gram = jax.jit(lambda x, d: kernels.ghost_gram(x, d, cfg))
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ())
  xla_text, xla = gram.lower(x, d).as_text(), gram(x, d)
  monkeypatch.setattr(cost_model, "PALLAS_GHOST_GRAM", ("cpu",))
  gram = jax.jit(lambda x, d: kernels.ghost_gram(x, d, cfg))
  pallas_text, got = gram.lower(x, d).as_text(), gram(x, d)
  assert pallas_text != xla_text
  assert got.shape == xla.shape == (4, 3)
  assert _rel(xla, ref) < TOL["float32"]
  assert _rel(got, ref) < TOL["float32"]
