"""The Pallas per-example convolution gradients (``pallas_conv``).

CI has no TPU, so the kernel runs in Pallas interpret mode on the CPU and
is checked against a float64 numpy evaluation of
``g_i[k, c, o] = sum_p xpad_i[s p + r k, c] d_i[p, o]`` and against the
patch path of ``ops/conv.py`` (``im2col`` patches, one product), over
strides, rates, kernel shapes, paddings (negative ones too), odd widths
(the sublane padding), several examples a program with a remainder, both
shift layouts and bfloat16. End to end, a tracked CNN's Gram and its
all-layer clipped gradient through the kernel (``PALLAS_CONV_GRADS`` on
the CPU) are compared with float64 references, and the patch-free bound
of the per-example rounding (``conv._triangle``) with its definition from
patches.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.test_util import check_grads

import gram_haiku
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import pallas_conv as pc
from gram_haiku._src.core import reference
from gram_haiku._src.ops import conv as conv_op
from tests import problems


def _out_size(size, lo_hi, k, s, r):
  return (size + lo_hi[0] + lo_hi[1] - (k - 1) * r - 1) // s + 1


def _reference(x, d, kernel, strides, pads, rate):
  """(1) in float64 numpy, from an explicitly padded (or cropped) input."""
  x = np.asarray(x, np.float64)
  d = np.asarray(d, np.float64)
  for axis, (lo, hi) in ((1, pads[0]), (2, pads[1])):
    widths = [(0, 0)] * 4
    widths[axis] = (max(lo, 0), max(hi, 0))
    x = np.pad(x, widths)
    index = [slice(None)] * 4
    index[axis] = slice(max(-lo, 0), x.shape[axis] - max(-hi, 0))
    x = x[tuple(index)]
  _, ho, wo, _ = d.shape
  out = []
  for ky, kx in np.ndindex(*kernel):
    a, b = rate[0] * ky, rate[1] * kx
    win = x[:, a:a + strides[0] * (ho - 1) + 1:strides[0],
            b:b + strides[1] * (wo - 1) + 1:strides[1]]
    out.append(np.einsum("bhwc,bhwo->bco", win, d))
  return np.stack(out, 1).reshape(x.shape[0], -1, d.shape[-1])


# (B, H, W, C, O, kernel, strides, pads, rate, block_examples)
CASES = [
    (3, 8, 8, 5, 7, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), None),
    (3, 9, 7, 4, 6, (3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1), None),
    (2, 9, 10, 3, 5, (1, 1), (2, 2), ((0, 0), (0, 0)), (1, 1), None),
    (2, 11, 9, 3, 5, (3, 2), (1, 2), ((2, 1), (0, -1)), (2, 1), None),
    (7, 5, 6, 9, 4, (2, 3), (3, 1), ((0, 2), (1, 1)), (1, 2), 3),
    (10, 4, 4, 16, 8, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), None),
    # Rows cropped into their own low padding, columns whose low crop
    # exceeds the input (only the layer's padded size is nonnegative; it
    # reads padding only).
    (2, 2, 3, 2, 3, (1, 2), (3, 1), ((2, -3), (-4, 3)), (1, 1), None),
]


LAYOUTS = ([("kernel", form) for form in pc.FORMS] +
           [("input", pc.DEFAULT_FORM)])
DEFAULT_LAYOUT = (pc.DEFAULT_SHIFT, pc.DEFAULT_FORM)

#: Every case in the default layout; the other layouts on the strided
#: case and the one with several examples a program and a remainder.
LAYOUT_CASES = ([case + DEFAULT_LAYOUT for case in CASES] +
                [CASES[i] + layout for i in (1, 4) for layout in LAYOUTS
                 if layout != DEFAULT_LAYOUT])


@pytest.mark.parametrize(
    "b,h,w,c,o,kernel,strides,pads,rate,be,shift,form", LAYOUT_CASES)
def test_matches_float64_and_the_patch_path(b, h, w, c, o, kernel, strides,
                                            pads, rate, be, shift, form):
  rng = np.random.default_rng(b * h + w)
  ho = _out_size(h, pads[0], kernel[0], strides[0], rate[0])
  wo = _out_size(w, pads[1], kernel[1], strides[1], rate[1])
  x = jnp.asarray(rng.standard_normal((b, h, w, c)), jnp.float32)
  d = jnp.asarray(rng.standard_normal((b, ho, wo, o)), jnp.float32)
  got = pc.per_example_conv_grads_pallas(
      x, d, kernel, strides=strides, padding=pads, rhs_dilation=rate,
      interpret=True, shift=shift, form=form, block_examples=be)
  assert got.shape == (b, kernel[0] * kernel[1] * c, o)
  assert got.dtype == jnp.float32
  want = _reference(x, d, kernel, strides, pads, rate)
  assert reference.relative_error(got, want) < 2e-6
  patches = conv_op.im2col(x, kernel, window_strides=strides, padding=pads,
                           lhs_dilation=(1, 1), rhs_dilation=rate)
  via_patches = jnp.einsum("bhwn,bhwo->bno", patches, d,
                           precision=lax.Precision.HIGHEST)
  np.testing.assert_allclose(got, via_patches, rtol=1e-5,
                             atol=1e-5 * float(jnp.abs(via_patches).max()))


def test_bfloat16_inputs_multiply_exactly():
  """bfloat16 products are exact in float32: the float64 value of the
  rounded inputs, to float32 accumulation."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((4, 6, 12, 8)), jnp.bfloat16)
  d = jnp.asarray(rng.standard_normal((4, 6, 12, 16)), jnp.bfloat16)
  pads = ((1, 1), (1, 1))
  got = pc.per_example_conv_grads_pallas(x, d, (3, 3), padding=pads,
                                         interpret=True)
  want = _reference(x, d, (3, 3), (1, 1), pads, (1, 1))
  assert reference.relative_error(got, want) < 2e-6


def test_huge_offset_and_cancellation_stay_within_float32():
  """An input with a large common offset whose per-example gradient
  nearly cancels: the kernel's error is float32 accumulation's, as the
  patch path's."""
  rng = np.random.default_rng(5)
  x = 1e4 + rng.standard_normal((3, 8, 8, 4))
  d = rng.standard_normal((3, 8, 8, 6))
  d = d - d.mean(axis=(1, 2), keepdims=True)  # sum_p d ~ 0
  pads = ((1, 1), (1, 1))
  got = pc.per_example_conv_grads_pallas(
      jnp.asarray(x, jnp.float32), jnp.asarray(d, jnp.float32), (3, 3),
      padding=pads, interpret=True, precision=lax.Precision.HIGHEST)
  want = _reference(np.float32(x), np.float32(d), (3, 3), (1, 1), pads,
                    (1, 1))
  # |error| <= T u sum_p |x_p| |d_p| entrywise (T = 64 positions).
  bound = 64 * 2.0**-24 * _reference(np.abs(np.float32(x)),
                                     np.abs(np.float32(d)), (3, 3), (1, 1),
                                     pads, (1, 1))
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound)


@pytest.mark.parametrize("shift", pc.SHIFTS)
def test_the_input_the_layer_skips_is_never_read(shift):
  """The window width padded to the sublane tile reads past the last
  output column; where the layer's negative padding crops columns (and
  rows), or its stride and rate skip them, it must read zeros there, not
  the input: an inf or NaN the layer never reads made every tap's
  gradient NaN."""
  rng = np.random.default_rng(6)
  x = rng.standard_normal((2, 6, 10, 3)).astype(np.float32)
  x[:, :, -3:] = np.nan
  x[:, -1:] = np.inf
  pads = ((1, -1), (0, -3))
  d = rng.standard_normal((2, 4, 6, 4)).astype(np.float32)
  got = pc.per_example_conv_grads_pallas(
      jnp.asarray(x), jnp.asarray(d), (3, 2), padding=pads, interpret=True,
      shift=shift)
  x[:, :, -3:] = x[:, -1:] = 0  # (cropped, as the layer does)
  want = _reference(x, d, (3, 2), (1, 1), pads, (1, 1))
  assert reference.relative_error(got, want) < 2e-6
  # Columns a stride and rate skip: a 2-tap kernel at rate 3 and stride 2
  # over 9 columns reads 0, 2, 3, 4, 5 and 7; the padded width, 6 and 8.
  x = rng.standard_normal((2, 3, 9, 3)).astype(np.float32)
  x[:, :, [1, 6, 8]] = np.nan
  d = rng.standard_normal((2, 3, 3, 4)).astype(np.float32)
  got = pc.per_example_conv_grads_pallas(
      jnp.asarray(x), jnp.asarray(d), (1, 2), strides=(1, 2),
      rhs_dilation=(1, 3), interpret=True, shift=shift)
  x[:, :, [1, 6, 8]] = 0  # (never read by the layer)
  want = _reference(x, d, (1, 2), (1, 2), ((0, 0), (0, 0)), (1, 3))
  assert reference.relative_error(got, want) < 2e-6


def test_empty_batch_and_bad_inputs():
  x = jnp.zeros((0, 4, 4, 3))
  d = jnp.zeros((0, 4, 4, 2))
  pads = ((1, 1), (1, 1))
  assert pc.per_example_conv_grads_pallas(
      x, d, (3, 3), padding=pads, interpret=True).shape == (0, 27, 2)
  with pytest.raises(ValueError, match="gives 4 outputs.*d has 3"):
    pc.per_example_conv_grads_pallas(jnp.zeros((2, 4, 4, 3)),
                                     jnp.zeros((2, 3, 4, 2)), (3, 3),
                                     padding=pads, interpret=True)
  with pytest.raises(ValueError, match="shift="):
    pc.per_example_conv_grads_pallas(jnp.zeros((2, 4, 4, 3)),
                                     jnp.zeros((2, 4, 4, 2)), (3, 3),
                                     padding=pads, interpret=True,
                                     shift="sideways")
  with pytest.raises(TypeError, match="float64"):
    pc.per_example_conv_grads_pallas(jnp.zeros((2, 4, 4, 3), jnp.int32),
                                     jnp.zeros((2, 4, 4, 2)), (3, 3),
                                     padding=pads, interpret=True)
  with pytest.raises(ValueError, match="MiB of VMEM"):
    pc.plan((1, 1024, 1024, 64), (1, 1024, 1024, 64), (3, 3), (1, 1),
            pads, (1, 1), jnp.float32)


def test_tpu_lowering():
  """The kernel lowers to Mosaic for a TPU (from the CPU, by ``jax.export``)
  at both precisions and both layouts, for a strided layer."""
  args = (jax.ShapeDtypeStruct((16, 32, 32, 64), jnp.float32),
          jax.ShapeDtypeStruct((16, 16, 16, 128), jnp.float32))
  for shift, form in LAYOUTS:
    for p in (lax.Precision.DEFAULT, lax.Precision.HIGHEST):
      exported = jax.export.export(
          jax.jit(lambda x, d, p=p, shift=shift, form=form:
                  pc.per_example_conv_grads_pallas(
                      x, d, (3, 3), strides=(2, 2), padding=((0, 1), (0, 1)),
                      precision=p, shift=shift, form=form)),
          platforms=["tpu"])(*args)
      assert "tpu_custom_call" in exported.mlir_module()


# -- Through the conv rule ------------------------------------------------------


@pytest.mark.parametrize("taken", [False, True])
def test_a_tpu_program_takes_the_kernel_in_its_measured_scope(taken,
                                                              monkeypatch):
  """``clipped_grad`` of a two-conv model exported for a TPU from the CPU
  (``jax.export``): by default neither conv takes the kernel (it was slower
  in a whole WRN step); with ``"tpu"`` in ``PALLAS_CONV_GRADS`` the 64 ->
  64 channel conv at 32x32 (the measured scope) lowers to the Pallas
  kernel and the 8-channel one keeps the patch path; what a TPU
  compiles."""
  assert cost_model.PALLAS_CONV_GRADS == ()
  if taken:
    monkeypatch.setattr(cost_model, "PALLAS_CONV_GRADS", ("tpu",))
  def loss(x):
    with gram_haiku.track(strategy="materialize"):
      h = hk.Conv2D(64, 3, with_bias=False)(x)
      return jnp.sum(hk.Conv2D(64, 3)(jax.nn.relu(h)) ** 2)
  f = hk.transform_with_state(loss)
  x = jnp.zeros((2, 32, 32, 8), jnp.float32)
  params, state = f.init(jax.random.key(0), x)
  exported = jax.export.export(
      jax.jit(gram_haiku.clipped_grad(f.apply, 1.0)),
      platforms=["tpu"])(params, state, None, x)
  text = exported.mlir_module()
  assert text.count("tpu_custom_call") == int(taken)
  assert ("_per_example_conv_kernel" in text) == taken


@pytest.fixture
def kernel_on_the_cpu(monkeypatch):
  """The kernel selected for every layer it can run, in interpret mode on
  the CPU (on a TPU only the measured scope takes it)."""
  monkeypatch.setattr(cost_model, "PALLAS_CONV_GRADS", ("cpu",))
  monkeypatch.setattr(cost_model, "PALLAS_CONV_MIN_CHANNELS", 0)
  monkeypatch.setattr(cost_model, "PALLAS_CONV_MIN_POSITIONS", 0)
  monkeypatch.setattr(cost_model, "PALLAS_CONV_STRIDED", True)


@pytest.mark.parametrize("size,cin,stride,platforms", [
    (32, 64, 1, ("tpu",)),   # measured 1.35x faster than the patches
    (32, 256, 1, ("tpu",)),
    (32, 16, 1, ()),         # measured slower
    (32, 3, 1, ()),
    (32, 64, 2, ()),         # strided: not measured on the chip
    (16, 128, 1, ()),        # 256 positions: several examples a program
])
def test_the_measured_scope_selects_the_kernel(size, cin, stride,
                                               platforms, monkeypatch):
  monkeypatch.setattr(cost_model, "PALLAS_CONV_GRADS", ("tpu",))
  spec = conv_op.ConvSpec(num_spatial_dims=2, stride=(stride, stride),
                          rate=(1, 1))
  out = -(-size // stride)
  got = conv_op._pallas_platforms(  # pylint: disable=protected-access
      spec, jnp.zeros((8, size, size, cin)), jnp.zeros((8, out, out, 64)),
      jnp.zeros((3, 3, cin, 64)), 0, jnp.float32, conv_op.KernelConfig())
  assert got == platforms


def _cnn(data_format):
  def net(x):
    h = hk.Conv2D(6, 3, stride=2, data_format=data_format)(x)
    h = jax.nn.relu(h)
    h = hk.Conv2D(5, (2, 3), rate=2, padding="VALID",
                  data_format=data_format)(h)
    h = hk.Conv2D(4, 1, data_format=data_format, with_bias=False)(h)
    return jnp.sum(jnp.tanh(h) ** 2, axis=(1, 2, 3))
  return net


@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
def test_a_tracked_cnn_through_the_kernel(data_format, monkeypatch,
                                         kernel_on_the_cpu):
  """``value_grad_and_gram`` with per-example gradients forced, each conv
  by the kernel (interpret mode), against ``F F^T`` in float64; and the
  all-layer clipped gradient against the clipped sum of float64
  per-example gradients, its norms sound and tight."""
  del kernel_on_the_cpu
  calls = []
  kernel = pc.per_example_conv_grads_pallas

  def spy(x, d, k, **kw):
    calls.append((tuple(x.shape), tuple(k)))
    return kernel(x, d, k, **kw)
  monkeypatch.setattr(pc, "per_example_conv_grads_pallas", spy)
  net = _cnn(data_format)

  def tracked(x):
    with gram_haiku.track(strategy="materialize"):
      return net(x).sum()

  shape = (5, 9, 9, 3) if data_format == "NHWC" else (5, 3, 9, 9)
  x = jnp.asarray(np.random.default_rng(2).standard_normal(shape),
                  jnp.float32)
  params, state, plain, grads, grams, ref = problems.tracked_gram(
      net, tracked, x)
  assert len(calls) == 3
  assert reference.relative_error(grams.total, ref) < 1e-5
  # The summed gradient is the kernel's per-example gradients' sum.
  want_grads = jax.grad(lambda p: plain.apply(p, x).sum())(params)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())

  calls.clear()
  clip = 0.3
  with_rng = hk.transform_with_state(tracked)
  grads, aux = jax.jit(gram_haiku.clipped_grad(with_rng.apply, clip))(
      params, state, None, x)
  assert len(calls) >= 3
  x64 = np.asarray(x, np.float64)
  with jax.enable_x64(True):
    p64 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    per = jax.vmap(jax.grad(lambda p, xi: plain.apply(p, xi[None]).sum()),
                   in_axes=(None, 0))(p64, jnp.asarray(x64))
    norms = np.sqrt(sum(np.sum(np.asarray(a).reshape(a.shape[0], -1) ** 2, 1)
                        for a in jax.tree.leaves(per)))
    scale = np.minimum(1.0, clip / norms)
    want = jax.tree.map(lambda a: np.tensordot(scale, np.asarray(a), 1), per)
  bounds = np.asarray(aux.grad_norms, np.float64)
  assert np.all(bounds >= norms)
  assert np.all(bounds <= norms * (1 + 1e-4))
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-4,
                               atol=1e-5 * clip)


def test_not_selected_where_it_cannot_run(kernel_on_the_cpu):
  """A transposed conv, 1-d convs, feature groups, within-example axes and
  float64 keep the patch path even where the kernel is enabled."""
  del kernel_on_the_cpu
  cfg = conv_op.KernelConfig()
  f32 = jnp.float32

  def platforms(spec_kw, x_shape, g_shape, w_shape, dtype=f32):
    spec = conv_op.ConvSpec(**spec_kw)
    return conv_op._pallas_platforms(  # pylint: disable=protected-access
        spec, jnp.zeros(x_shape, dtype), jnp.zeros(g_shape, dtype),
        jnp.zeros(w_shape, dtype), 0, dtype, cfg)
  two_d = dict(num_spatial_dims=2, stride=(1, 1), rate=(1, 1))
  assert platforms(two_d, (2, 6, 6, 3), (2, 6, 6, 4), (3, 3, 3, 4)) == (
      "cpu",)
  assert platforms(dict(two_d, transpose=True), (2, 6, 6, 3), (2, 6, 6, 4),
                   (3, 3, 4, 3)) == ()
  assert platforms(dict(two_d, feature_group_count=3), (2, 6, 6, 3),
                   (2, 6, 6, 6), (3, 3, 1, 6)) == ()
  assert platforms(dict(num_spatial_dims=1, stride=(1,), rate=(1,)),
                   (2, 6, 3), (2, 6, 4), (3, 3, 4)) == ()
  with jax.enable_x64(True):
    assert platforms(two_d, (2, 6, 6, 3), (2, 6, 6, 4), (3, 3, 3, 4),
                     jnp.float64) == ()
  # Within-example leading axes ([B, T, H, W, C]) keep the patch path.
  assert platforms(two_d, (2, 5, 6, 6, 3), (2, 5, 6, 6, 4),
                   (3, 3, 3, 4)) == ()


#: (spec, x shape, w shape[, example_dim, offset, dtype]).
_TRIANGLE_CASES = [
    (dict(num_spatial_dims=2, stride=(2, 1), rate=(1, 2),
          padding=((1, 0), (2, -1))), (3, 9, 8, 4), (3, 2, 4, 5)),
    (dict(num_spatial_dims=2, feature_group_count=2, stride=(1, 1),
          rate=(1, 1)), (3, 6, 5, 4), (3, 3, 2, 6)),
    (dict(num_spatial_dims=2, transpose=True, stride=(2, 2), rate=(1, 1)),
     (3, 5, 4, 4), (3, 3, 6, 4)),
    (dict(num_spatial_dims=1, channels_last=False, stride=(3,), rate=(1,),
          padding="VALID"), (3, 4, 11), (2, 4, 5)),
    # Within-example axes ([T, B, H, W, C], the examples second), negative
    # padding larger than the kernel, a huge common offset.
    (dict(num_spatial_dims=2, stride=(1, 2), rate=(2, 1),
          padding=((-3, -2), (4, -1))), (2, 3, 9, 8, 3), (2, 2, 3, 4), 1,
     1e5),
    # A 3-d transposed conv over channels first, bfloat16.
    (dict(num_spatial_dims=3, channels_last=False, transpose=True,
          stride=(2, 1, 3), rate=(1, 1, 1), padding="SAME"), (2, 2, 3, 2, 2),
     (2, 1, 3, 3, 2), 0, 1e3, jnp.bfloat16),
]


@pytest.mark.parametrize(
    "spec_kw,x_shape,w_shape,example_dim,offset,dtype",
    [c + (0, 0.0, jnp.float32)[len(c) - 3:] for c in _TRIANGLE_CASES])
def test_the_patch_free_triangle_is_the_patch_triangle(
    spec_kw, x_shape, w_shape, example_dim, offset, dtype):
  """``conv._triangle`` (window sums of the input's squared norms) is at
  least ``sum_{t,f} |p_tf| |d_tf|`` from the patches themselves, in
  float64, and above it by no more than its rounding allowance."""
  spec = conv_op.ConvSpec(**spec_kw)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal(x_shape) + offset, dtype)
  w = jnp.asarray(rng.standard_normal(w_shape), dtype)
  y = conv_op.conv_forward(x, w, None, spec=spec)
  g = jnp.asarray(rng.standard_normal(y.shape), dtype)
  tri, t = conv_op._triangle(  # pylint: disable=protected-access
      spec, x, g, tuple(w_shape[:spec.num_spatial_dims]), example_dim, True,
      jnp.float32)
  with jax.enable_x64(True):
    p, d = conv_op._patches_and_cotangents(  # pylint: disable=protected-access
        spec, jnp.asarray(x, jnp.float64), jnp.asarray(g, jnp.float64),
        jnp.asarray(w, jnp.float64), jnp.float64)
    p = np.moveaxis(np.asarray(p), example_dim, 0)
    d = np.moveaxis(np.asarray(d), example_dim, 0)
  b = x.shape[example_dim]
  p, d = p.reshape(b, -1, *p.shape[-2:]), d.reshape(b, -1, *d.shape[-2:])
  assert t == p.shape[1]
  want = (np.linalg.norm(p, axis=-1) * np.linalg.norm(d, axis=-1)).sum(
      (1, 2)) + np.linalg.norm(d.reshape(b, t, -1), axis=-1).sum(1)
  tri = np.asarray(tri, np.float64)
  assert np.all(tri >= want)
  # Its allowance: the patch norms' and cotangent norms' rounding (n and m
  # squares) and the sum's (t (F + 1) terms), each 2 u (count + 4).
  groups = p.shape[-2]
  u = 2.0**-24
  slack = 2 * u * (t * (groups + 1) + p.shape[-1] + d.shape[-1] + 12)
  assert np.all(tri <= want * (1 + slack))


def test_the_kernels_branch_differentiates_like_the_patch_path(
    kernel_on_the_cpu, monkeypatch):
  """A loss of the rule's Gram differentiates through the kernel's branch
  (the kernel has no JVP of its own: the patch path's is used), with the
  patch path's values."""
  del kernel_on_the_cpu
  calls = []
  kernel = pc.per_example_conv_grads_pallas
  monkeypatch.setattr(pc, "per_example_conv_grads_pallas",
                      lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
  spec = conv_op.ConvSpec(num_spatial_dims=2, stride=(1, 1), rate=(1, 1))
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((3, 5, 5, 2)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((3, 3, 2, 4)), jnp.float32)
  b = jnp.zeros((4,), jnp.float32)
  g = jnp.asarray(rng.standard_normal((3, 5, 5, 4)), jnp.float32)
  cfg = conv_op.KernelConfig(method="materialize",
                             precision=lax.Precision.HIGHEST)
  loss = lambda x, g: jnp.sum(jnp.sin(conv_op.gram(x, g, (w, b), 0, cfg,
                                                   spec=spec)))
  got = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, g)
  got_t = jax.jvp(loss, (x, g), (g[..., :2], x[..., :1] * g))[1]
  assert calls
  monkeypatch.setattr(cost_model, "PALLAS_CONV_GRADS", ())
  want = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, g)
  want_t = jax.jvp(loss, (x, g), (g[..., :2], x[..., :1] * g))[1]
  for a, c in zip(got, want):
    np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-5 * np.abs(c).max())
  np.testing.assert_allclose(got_t, want_t, rtol=1e-5)


def test_a_standardised_conv_clips_through_the_kernel(kernel_on_the_cpu,
                                                      monkeypatch):
  """A WRN block's conv (``standardise_weight``, then GroupNorm), its
  per-example gradients materialised by the kernel (the closed form reads
  them in the kernel's layout): the clip norms are sound and tight against
  float64, and the clipped sum is the float64 one."""
  del kernel_on_the_cpu
  calls = []
  kernel = pc.per_example_conv_grads_pallas
  monkeypatch.setattr(pc, "per_example_conv_grads_pallas",
                      lambda *a, **kw: calls.append(1) or kernel(*a, **kw))

  def body(x):
    with hk.custom_getter(lambda nxt, w, c: gram_haiku.standardise_weight(
        nxt(w)) if c.name == "w" else nxt(w)):
      h = hk.Conv2D(8, 3, name="conv")(x)
    return hk.GroupNorm(4, name="norm")(h)

  def loss_fn(x, v):
    with gram_haiku.track(strategy="materialize"):
      return jnp.sum(body(x) * v)
  f = hk.transform_with_state(loss_fn)
  rng = np.random.RandomState(3)
  x = np.maximum(rng.normal(size=(4, 6, 6, 5)), 0).astype(np.float32)
  v = rng.normal(size=(4, 6, 6, 8)).astype(np.float32)
  params, state = f.init(jax.random.PRNGKey(0), x, v)
  clip = 0.5
  grads, aux = jax.jit(gram_haiku.clipped_grad(f.apply, clip))(
      params, state, None, x, v)
  assert calls
  with jax.enable_x64(True):
    wide = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    per = jax.vmap(lambda xi, vi: jax.grad(lambda p: jnp.sum(
        hk.transform(body).apply(p, None, xi[None]) * vi[None]))(wide))(
            jnp.float64(x), jnp.float64(v))
    true = np.sqrt(sum(np.sum(np.asarray(a).reshape(4, -1) ** 2, 1)
                       for a in jax.tree.leaves(per)))
    scale = np.minimum(1.0, clip / true)
    want = jax.tree.map(lambda a: np.tensordot(scale, np.asarray(a), 1), per)
  norms = np.asarray(aux.grad_norms, np.float64)
  assert np.all(norms >= true) and np.all(norms <= 1.01 * true), norms / true
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-4,
                               atol=1e-5 * clip)


def test_the_patch_free_bound_differentiates():
  """The rule's sound norm bound (``sq_norms`` with ``upper_bound``, whose
  rounding allowance is :func:`conv._triangle`'s window sums) has the
  derivatives of its finite differences in both modes, in float64, as it
  had when the triangle was formed from patches (a window sum with a traced
  zero is a ``reduce_window`` that cannot be transposed)."""
  spec = conv_op.ConvSpec(num_spatial_dims=2, stride=(2, 1), rate=(1, 2),
                          padding=((1, 0), (2, -1)))
  rng = np.random.default_rng(4)
  with jax.enable_x64(True):
    x = jnp.asarray(rng.standard_normal((2, 5, 6, 2)))
    w = jnp.asarray(rng.standard_normal((2, 2, 2, 3)))
    g = jnp.asarray(rng.standard_normal(
        conv_op.conv_forward(x, w, None, spec=spec).shape))
    cfg = conv_op.KernelConfig(method="materialize", upper_bound=True)
    bound = jax.jit(lambda x, g: conv_op.sq_norms(
        x, g, (w, w[0, 0, 0]), 0, cfg, spec=spec))
    check_grads(bound, (x, g), order=1, modes=("fwd", "rev"))


def test_per_example_gradients_and_bounds_through_the_kernel(
    kernel_on_the_cpu):
  """The rule's per-example gradients (in the kernel's layout, with the
  summed ``dw``, ``db``) and its sound squared norms, through the kernel,
  for a channels-first layer striding past a 1-wide kernel row, dilated,
  one row cropped and a bias: against float64 per-example gradients."""
  del kernel_on_the_cpu
  spec = conv_op.ConvSpec(num_spatial_dims=2, channels_last=False,
                          stride=(2, 3), rate=(1, 2),
                          padding=((0, -1), (2, 1)))
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 2, 7, 9)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((2, 1, 2, 5)), jnp.float32)
  b = jnp.asarray(rng.standard_normal((5, 1, 1)), jnp.float32)
  g = jnp.asarray(rng.standard_normal(
      conv_op.conv_forward(x, w, b, spec=spec).shape), jnp.float32)
  cfg = conv_op.KernelConfig(method="materialize", upper_bound=True)
  assert conv_op._pallas_platforms(  # pylint: disable=protected-access
      spec, x, g, w, 0, jnp.float32, cfg) == ("cpu",)
  with jax.enable_x64(True):
    one = lambda p, xi, gi: jnp.sum(
        conv_op.conv_forward(xi[None], *p, spec=spec) * gi[None])
    per = jax.vmap(jax.grad(one), in_axes=(None, 0, 0))(
        (jnp.asarray(w, jnp.float64), jnp.asarray(b, jnp.float64)),
        jnp.asarray(x, jnp.float64), jnp.asarray(g, jnp.float64))
    ref = np.concatenate([np.asarray(a).reshape(3, -1) for a in per], 1)
  run = lambda mode: jax.jit(lambda x, g: conv_op.probe_cotangent_and_grads(
      x, g, (w, b), 0, mode, (0, 1), cfg, spec=spec))(x, g)
  f, sums = run("per_example")
  np.testing.assert_allclose(f, ref, rtol=1e-5,
                             atol=1e-6 * np.abs(ref).max())
  for got, want in zip((sums[0], sums[1]), per):
    np.testing.assert_allclose(got, np.asarray(want).sum(0), rtol=1e-5,
                               atol=1e-5)
  bounds, _ = run("norms")
  true = np.sum(ref ** 2, axis=1)
  assert np.all(np.asarray(bounds, np.float64) >= true)
  assert np.all(np.asarray(bounds, np.float64) <= true * (1 + 1e-4))
