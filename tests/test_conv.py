"""Convolutions (hk.ConvND, hk.ConvNDTranspose) against the reference F @ F.T.

Op level: :func:`gram_conv` / :func:`gram_conv_transpose` against
``vmap(grad)`` of plain ``lax.conv_general_dilated`` / ``lax.conv_transpose``
(independent of the op's own im2col formula). Track level: Haiku models
inside ``gram_haiku.track()`` against the untracked model.
"""

import dataclasses
import functools
import zlib

import chex
import haiku as hk
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.compute import cost_model
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import assert_probe_value_close
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import relative_error as rel_err
from gram_haiku._src.core.reference import RTOL_BF16
from gram_haiku._src.layers import conv as conv_layers
from gram_haiku._src.ops.conv import dimension_numbers
from gram_haiku._src.ops.conv import gram_conv
from gram_haiku._src.ops.conv import gram_conv_transpose
from gram_haiku._src.ops.conv import im2col
from tests import problems


def reference_gram(per_example_loss, params, *batch):
  """``gram_haiku._src.core.reference.reference_gram`` with ``F`` computed under one ``jit``
  (same ``F``, far fewer compilations on CPU), then ``F @ F.T`` in float64."""
  f = jax.jit(functools.partial(per_example_grads, per_example_loss))(
      params, *batch)
  f = np.asarray(f, np.float64)
  return f @ f.T


# -- op level ------------------------------------------------------------------


def _normal(rng, shape, dtype, scale=1.0):
  """Random normal data from numpy (jax.random would compile per shape)."""
  return jax.device_put((rng.standard_normal(shape) * scale).astype(
      jnp.dtype(dtype)))


@dataclasses.dataclass(frozen=True)
class Case:
  n: int
  channels_last: bool = True
  transpose: bool = False
  stride: object = 1
  padding: object = "SAME"
  rate: object = 1
  groups: int = 1
  bias: bool = True
  kernel: tuple = (3, 2, 2)
  spatial: tuple = (7, 6, 5)
  c_per_group: int = 2
  o_per_group: int = 3

  @property
  def data_format(self):
    return "channels_last" if self.channels_last else "channels_first"

  def make(self, seed, lead=(4,), dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    n, c = self.n, self.c_per_group * self.groups
    o = self.o_per_group * self.groups
    sp = self.spatial[:n]
    x = _normal(rng, lead + (sp + (c,) if self.channels_last else (c,) + sp),
                dtype)
    kern = self.kernel[:n]
    w_shape = kern + ((o, c) if self.transpose else (self.c_per_group, o))
    p = {"w": _normal(rng, w_shape, dtype, 1 / np.sqrt(np.prod(w_shape[:-1])))}
    if self.bias:
      b_shape = (o,) if self.channels_last else (o,) + (1,) * n
      p["b"] = _normal(rng, b_shape, dtype)
    return p, x

  def plain(self, p, x):
    """Untracked, explicitly batched ``(B, ...)``: plain lax, as Haiku."""
    n = self.n
    dn = dimension_numbers(n, self.channels_last, self.transpose)
    stride = (self.stride,) * n if isinstance(self.stride, int) else self.stride
    if self.transpose:
      out = lax.conv_transpose(x, p["w"], stride, self.padding,
                               dimension_numbers=dn)
    else:
      rate = (self.rate,) * n if isinstance(self.rate, int) else self.rate
      out = lax.conv_general_dilated(x, p["w"], stride, self.padding,
                                     rhs_dilation=rate, dimension_numbers=dn,
                                     feature_group_count=self.groups)
    if "b" in p:
      out = out + p["b"]
    return out

  def tracked(self, p, probe, x, **kw):
    if self.transpose:
      return gram_conv_transpose(x, p["w"], p.get("b"), probe,
                                 stride=self.stride, padding=self.padding,
                                 data_format=self.data_format, **kw)
    return gram_conv(x, p["w"], p.get("b"), probe, stride=self.stride,
                     padding=self.padding, rate=self.rate,
                     feature_group_count=self.groups,
                     data_format=self.data_format, **kw)


CASES = {
    "1d_nwc": Case(1),
    "1d_ncw_s2_valid_rate2_nobias": Case(1, False, stride=2, padding="VALID",
                                         rate=2, bias=False),
    "1d_explicit_groups3": Case(1, padding=((2, 1),), groups=3, kernel=(4,)),
    "2d_nhwc_s2_groups2": Case(2, stride=2, groups=2),
    "2d_nchw_explicit_rate21_groups3": Case(2, False, padding=((1, 2), (0, 1)),
                                            rate=(2, 1), groups=3),
    "2d_nhwc_stride12_valid_nobias": Case(2, stride=(1, 2), padding="VALID",
                                          bias=False),
    "2d_depthwise": Case(2, groups=4, c_per_group=1, o_per_group=2),
    "3d_ndhwc_s121_valid": Case(3, stride=(1, 2, 1), padding="VALID",
                                spatial=(5, 6, 4)),
    "3d_ncdhw_groups2_nobias": Case(3, False, groups=2, bias=False,
                                    spatial=(4, 5, 4)),
    "1dT_nwc_s2_same": Case(1, transpose=True, stride=2),
    "1dT_ncw_s3_valid": Case(1, False, transpose=True, stride=3,
                             padding="VALID"),
    "2dT_nhwc_s2_valid": Case(2, transpose=True, stride=2, padding="VALID"),
    "2dT_nchw_s3_same_nobias": Case(2, False, transpose=True, stride=(3, 1),
                                    bias=False, kernel=(2, 3)),
    "2dT_nhwc_explicit": Case(2, transpose=True, stride=2,
                              padding=((2, 1), (0, 2))),
    "3dT_ndhwc_s2_same": Case(3, transpose=True, stride=2, spatial=(3, 4, 2)),
    "3dT_ncdhw_valid": Case(3, False, transpose=True, stride=(1, 2, 2),
                            padding="VALID", spatial=(3, 3, 2)),
}

#: Largest relative error seen per case (printed with -s, for the report).
MAX_REL_ERR = {}


def _seed(name):
  return zlib.crc32(name.encode()) % 1000


def _head(out):
  return 0.5 * jnp.sum(jnp.tanh(out.astype(jnp.float32)) ** 2)


def _ref(case, p, x):
  return reference_gram(lambda p, x: _head(case.plain(p, x)), p, x)


def _record(name, gram, ref):
  err = rel_err(gram, ref)
  MAX_REL_ERR[name] = max(MAX_REL_ERR.get(name, 0.0), err)
  return err


#: Cases also run with each strategy forced (auto picks one per shape).
STRATEGY_CASES = ("1d_ncw_s2_valid_rate2_nobias",
                  "2d_nchw_explicit_rate21_groups3", "2d_depthwise",
                  "3d_ndhwc_s121_valid", "2dT_nhwc_explicit",
                  "3dT_ncdhw_valid")


@pytest.mark.parametrize("name", list(CASES))
def test_op_explicit_batch(name):
  """Gram (auto, and ghost/materialise for some cases), norms and forward.

  Each variant is a separate, independent call of the op in one jitted
  function (one compilation per case): each call's probe gets that call's
  Gram only.
  """
  case = CASES[name]
  p, x = case.make(_seed(name))
  b = x.shape[0]
  strategies = ("auto",) + (("ghost", "materialize")
                            if name in STRATEGY_CASES else ())
  probes = {s: jnp.zeros((b, b)) for s in strategies}
  probes["norms"] = jnp.zeros((b,))
  def loss(probes):
    total, outs = 0.0, []
    for s in strategies:
      outs.append(case.tracked(p, probes[s], x, strategy=s))
      total = total + _head(outs[-1])
    total = total + _head(case.tracked(p, probes["norms"], x, mode="norms"))
    return total, (outs[0], case.plain(p, x))
  grams, (out, plain_out) = jax.jit(jax.grad(loss, has_aux=True))(probes)
  ref = _ref(case, p, x)
  for s in strategies:
    _record(name, grams[s], ref)
    assert_gram_close(grams[s], ref)
  chex.assert_shape(grams["norms"], (b,))
  _record(name, grams["norms"], np.diag(ref))
  np.testing.assert_allclose(grams["norms"], np.diag(ref), rtol=1e-4)
  # The forward pass is the plain convolution, bit for bit.
  np.testing.assert_array_equal(out, plain_out)


def test_patch_block_sizes():
  # Patches that fit the input (or are small): one block; else the largest
  # block whose patches fit, a divisor of B where one is at least half of it.
  mb = 2**20
  assert cost_model.patch_block(64, 100 * mb, 100 * mb) == 64
  assert cost_model.patch_block(64, 9 * 64 * mb, 64 * mb) == 4  # largest 7
  assert cost_model.patch_block(64, 9 * 64 * mb, 28 * 9 * mb) == 16
  assert cost_model.patch_block(61, 9 * 61 * mb, 61 * mb) == 6  # B prime
  assert cost_model.patch_block(8, 1000 * 8 * mb, 8 * mb) == 1
  assert cost_model.patch_block(1, 1000 * mb, 1 * mb) == 1
  small = cost_model.PATCH_BLOCK_MIN_BYTES
  assert cost_model.patch_block(64, small, 1) == 64
  assert cost_model.patch_block(64, 2 * small, small // 2) == 16


@pytest.mark.parametrize("name,block", problems.spread(
    [(n, n) for n in ("2d_nhwc_s2_groups2", "1dT_nwc_s2_same",
                      "3d_ncdhw_groups2_nobias")],
    [(b, b) for b in ("all", 2, 3)]))
def test_per_example_gradients_by_blocks_of_examples(name, block, monkeypatch):
  """The materialised per-example gradients formed a block of examples at
  a time (B = 7: 2 and 3 leave a remainder block) equal the reference, in
  every mode, with the parameter gradients they also give."""
  monkeypatch.setattr(cost_model, "patch_block",
                      lambda b, *_: b if block == "all" else block)
  case = CASES[name]
  p, x = case.make(_seed(name) + 2, lead=(7,))
  ref = _ref(case, p, x)

  def loss(p, probe, mode):
    return _head(case.tracked(p, probe, x, mode=mode, strategy="materialize"))
  want = jax.grad(lambda p: _head(case.plain(p, x)))(p)
  for mode, probe in (("gram", jnp.zeros((7, 7))), ("norms", jnp.zeros(7)),
                      ("per_example", None)):
    if mode == "per_example":
      f = per_example_grads(lambda p, x: _head(case.plain(p, x)), p, x)
      probe = jnp.zeros(f.shape)
    got, value = jax.jit(jax.grad(loss, argnums=(0, 1)),
                         static_argnums=2)(p, probe, mode)
    assert_probe_value_close(mode, value, ref, norms_rtol=1e-4)
    for k in want:
      chex.assert_trees_all_close(got[k], want[k], rtol=1e-5, atol=1e-6 * (
          float(jnp.abs(want[k]).max())), custom_message=f"{mode}: {k}")


def test_patches_are_blocked_on_the_cpu_only(monkeypatch):
  """Blocks of examples are a loop: kept on the CPU, where the loop is
  free; on GPUs (one program lowered for each platform here, no GPU
  needed) the patches are formed whole, unless they exceed the budget."""
  seen = {}

  def patch_block(b, patch_bytes, live_bytes):
    del live_bytes
    seen["patch_bytes"] = patch_bytes
    return 2
  chosen = cost_model.conv_method

  def conv_method(*args, **kwargs):
    seen["methods"].append(chosen(*args, **kwargs))
    return seen["methods"][-1]
  monkeypatch.setattr(cost_model, "patch_block", patch_block)
  monkeypatch.setattr(cost_model, "conv_method", conv_method)
  name = "2d_nhwc_s2_groups2"
  case = CASES[name]
  p, x = case.make(_seed(name) + 5, lead=(7,))

  def gram(p, budget):
    def loss(p, probe):
      return _head(case.tracked(p, probe, x, mode="gram",
                                strategy="materialize",
                                memory_budget_bytes=budget))
    return jax.grad(loss, argnums=1)(p, jnp.zeros((7, 7)))

  def lowered(platform, budget):
    seen["methods"] = []
    fn = jax.jit(functools.partial(gram, budget=budget))
    text = jax.export.export(fn, platforms=(platform,))(p).mlir_module()
    # Every group's per-example gradients at once: no loop over groups.
    assert seen["methods"] == ["materialize"], seen
    return text

  assert "stablehlo.while" in lowered("cpu", 2**28)
  assert "stablehlo.while" not in lowered("cuda", 2**28)
  over = seen["patch_bytes"] - 1  # The patches exceed it, not the gradients.
  assert "stablehlo.while" in lowered("cuda", over)
  assert_gram_close(gram(p, over), _ref(case, p, x))


@pytest.mark.parametrize("name", STRATEGY_CASES)
def test_parameter_gradients_from_per_example_sum(name):
  """Where the Gram's per-example gradients also give ``dw`` and ``db``
  (materialised), they equal the plain convolution's gradients; so do the
  ghost path's (JAX's own VJP), in both modes."""
  case = CASES[name]
  p, x = case.make(_seed(name) + 1)
  b = x.shape[0]
  variants = [(m, s) for m in ("gram", "norms")
              for s in ("ghost", "materialize")]

  def loss(p, probe, mode, strategy):
    return _head(case.tracked(p, probe, x, mode=mode, strategy=strategy))
  want = jax.grad(lambda p: _head(case.plain(p, x)))(p)
  for mode, strategy in variants:
    probe = jnp.zeros((b, b) if mode == "gram" else (b,))
    got, gram = jax.jit(jax.grad(loss, argnums=(0, 1)),
                        static_argnums=(2, 3))(p, probe, mode, strategy)
    assert float(jnp.abs(gram).max()) > 0  # the Gram was asked for too
    for k in want:
      chex.assert_trees_all_close(got[k], want[k], rtol=1e-5, atol=1e-6 * (
          float(jnp.abs(want[k]).max())), custom_message=f"{mode}/{strategy}"
                                  f" gradient of {k}")


@pytest.mark.parametrize("name", [
    "1d_explicit_groups3", "2d_nhwc_s2_groups2",
    "2d_nchw_explicit_rate21_groups3", "2d_depthwise",
    "3d_ncdhw_groups2_nobias", "2dT_nhwc_s2_valid"])
def test_per_example_gradients_are_in_the_kernels_layout(name):
  """``mode="per_example"`` gives each example's gradient of ``w`` in the
  kernel's own layout, then ``b``'s, entry by entry as ``vmap(grad)``
  (a Gram cannot tell a reordering of the entries; this can)."""
  case = CASES[name]
  p, x = case.make(_seed(name) + 3, lead=(5,))

  def one_leaf(k):
    return per_example_grads(
        lambda q, x: _head(case.plain({**p, k: q[k]}, x)), {k: p[k]}, x)
  want = np.concatenate([one_leaf(k) for k in ("w", "b") if k in p], axis=1)

  def loss(probe):
    return _head(case.tracked(p, probe, x, mode="per_example",
                              strategy="materialize"))
  got = jax.jit(jax.grad(loss))(jnp.zeros(want.shape))
  np.testing.assert_allclose(got, want, rtol=1e-5,
                             atol=1e-6 * np.abs(want).max())


@pytest.mark.filterwarnings("ignore:divide by zero")  # the init scale of w
@pytest.mark.parametrize("groups", [1, 2])
def test_zero_input_channels_leave_the_bias_gram(groups):
  """A convolution of zero input channels has a kernel of no entries: its
  Gram is the bias's alone, by every method and mode (was a reshape
  error where the empty patch features made ``-1`` undefined)."""
  case = Case(2, groups=groups, c_per_group=0)
  p, x = case.make(7, lead=(4,))
  assert p["w"].size == 0
  ref = _ref(case, p, x)
  assert np.abs(ref).max() > 0
  for mode, strategy in (("gram", "ghost"), ("gram", "materialize"),
                         ("norms", "auto"), ("per_example", "auto")):
    shape = {"gram": (4, 4), "norms": (4,),
             "per_example": (4, p["b"].size)}[mode]

    def loss(probe):
      return _head(case.tracked(p, probe, x, mode=mode, strategy=strategy))
    got = jax.jit(jax.grad(loss))(jnp.zeros(shape))
    assert_probe_value_close(mode, got, ref, norms_rtol=1e-5)


VMAP_PARAMS = [(n, d, True) for n in ("2d_nchw_explicit_rate21_groups3",
                                      "2dT_nhwc_s2_valid", "1d_nwc")
               for d in (1, 2)] + [("3d_ncdhw_groups2_nobias", 2, False)]


@pytest.mark.parametrize("name,depth,jit", VMAP_PARAMS)
def test_op_vmap_depth(name, depth, jit):
  # depth 1: vmap over examples of (spatial, C); depth 2: the second vmap
  # maps a within-example axis T, so per example the gradient sums over T.
  case = CASES[name]
  t = 2
  p, x = case.make(7, lead=(4, t) if depth == 2 else (4,))
  b = x.shape[0]
  def loss(probe, x):
    f = lambda xi: case.tracked(p, probe, xi)
    for _ in range(depth):
      f = jax.vmap(f)
    return _head(f(x))
  g = jax.grad(loss)
  if jit:
    g = jax.jit(g)
  gram = g(jnp.zeros((b, b)), x)
  if depth == 2:
    def plain_example(p, xi):  # xi: (1, T, ...)
      return _head(case.plain(p, xi[0]))
    ref = reference_gram(plain_example, p, x)
  else:
    ref = _ref(case, p, x)
  _record(name, gram, ref)
  assert_gram_close(gram, ref)


def test_op_within_example_axis_explicit():
  # Explicitly batched (B, T, H, W, C): T is a within-example axis.
  case = CASES["2d_nhwc_s2_groups2"]
  p, x = case.make(8, lead=(3, 2))
  def loss(probe):
    return _head(case.tracked(p, probe, x))
  gram = jax.jit(jax.grad(loss))(jnp.zeros((3, 3)))
  ref = reference_gram(lambda p, xi: _head(case.plain(p, xi[0])), p, x)
  assert_gram_close(gram, ref)


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
def test_grouped_gram_blocked_by_memory_budget(strategy):
  # A tiny budget: the per-group lax.map path (and blocked ghost rows).
  case = CASES["2d_nhwc_s2_groups2"]
  p, x = case.make(9, lead=(5,))
  def loss(probes):
    return (_head(case.tracked(p, probes[0], x, strategy=strategy,
                               memory_budget_bytes=1000)) +
            _head(case.tracked(p, probes[1], x, strategy=strategy,
                               mode="norms", memory_budget_bytes=1000)))
  probes = (jnp.zeros((5, 5)), jnp.zeros((5,)))
  assert "scan" in str(jax.make_jaxpr(jax.grad(loss))(probes))
  gram, sq = jax.jit(jax.grad(loss))(probes)
  ref = _ref(case, p, x)
  assert_gram_close(gram, ref)
  np.testing.assert_allclose(sq, np.diag(ref), rtol=1e-4)


def test_op_parameter_gradients_unchanged():
  case = CASES["2d_nchw_explicit_rate21_groups3"]
  p, x = case.make(10)
  def tracked(p, x):
    return _head(case.tracked(p, jnp.zeros((4, 4)), x))
  def plain(p, x):
    return _head(case.plain(p, x))
  chex.assert_trees_all_close(
      jax.jit(jax.value_and_grad(tracked, argnums=(0, 1)))(p, x),
      jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(p, x),
      rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,x_dtype,w_dtype", [
    ("2d_nhwc_s2_groups2", jnp.bfloat16, jnp.bfloat16),
    ("2dT_nhwc_explicit", jnp.bfloat16, jnp.bfloat16),
    ("1d_explicit_groups3", jnp.float16, jnp.float16)])
def test_op_dtype_parity_and_f32_gram(name, x_dtype, w_dtype):
  case = CASES[name]
  p, x = case.make(11)
  p = jax.tree.map(lambda a: a.astype(w_dtype), p)
  x = x.astype(x_dtype)
  probe = jnp.zeros((4, 4), jnp.float32)
  def loss(p, probe, x):
    return _head(jax.vmap(lambda xi: case.tracked(p, probe, xi))(x))
  grad = jax.grad(loss, argnums=(0, 1, 2))
  values = jax.jit(grad)(p, probe, x)
  for cts in (values, jax.eval_shape(grad, p, probe, x)):
    for ct, primal in zip(jax.tree.leaves(cts),
                          jax.tree.leaves((p, probe, x))):
      assert ct.shape == primal.shape and ct.dtype == primal.dtype
      assert getattr(ct, "weak_type", False) == getattr(primal, "weak_type",
                                                        False)
  gram = values[1]
  assert gram.dtype == jnp.float32
  f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
  ref = _ref(case, f32(p), f32(x))
  _record(name + f"[{jnp.dtype(x_dtype).name}]", gram, ref)
  assert_gram_close(gram, ref, rtol=RTOL_BF16)


def test_op_float64_under_x64():
  with jax.enable_x64(True):
    case = CASES["1d_explicit_groups3"]
    p, x = case.make(12, dtype=jnp.float64)
    def loss(probe):
      return 0.5 * jnp.sum(jnp.tanh(case.tracked(p, probe, x)) ** 2)
    gram = jax.jit(jax.grad(loss))(jnp.zeros((4, 4), jnp.float64))
    assert gram.dtype == jnp.float64
    ref = reference_gram(
        lambda p, x: 0.5 * jnp.sum(jnp.tanh(case.plain(p, x)) ** 2), p, x)
    np.testing.assert_allclose(gram, ref, rtol=1e-10)


def test_op_checkpoint_keeps_the_gram():
  case = CASES["1d_explicit_groups3"]
  p, x = case.make(13)
  def loss(probe, x):
    return _head(jax.vmap(lambda xi: case.tracked(p, probe, xi))(x))
  ref = _ref(case, p, x)
  for policy in [None, jax.checkpoint_policies.nothing_saveable]:
    ck = jax.checkpoint(loss, policy=policy)
    assert_gram_close(jax.jit(jax.grad(ck))(jnp.zeros((4, 4)), x), ref)


def test_op_bad_data_format():
  with pytest.raises(ValueError, match="data_format"):
    gram_conv(jnp.ones((2, 4, 3)), jnp.ones((3, 3, 2)), None,
              jnp.zeros((2, 2)), data_format="WEIRD")


# -- track level ---------------------------------------------------------------


def _sq(out):
  return 0.5 * jnp.sum(jnp.tanh(out.astype(jnp.float32)) ** 2)


def _setup(model, x, **track_kw):
  def tracked(x):
    with gram_haiku.track(**track_kw):
      return _sq(model(x))
  f = hk.transform_with_state(tracked)
  g = hk.without_apply_rng(hk.transform(lambda x: _sq(model(x))))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  return f, g, params, state


def _check(name, model, x, jit=True, **track_kw):
  """Gram, loss, gradients and norms of the tracked model vs the untracked.

  ``jit=True`` (the default, for test speed) jits both sides; a few tests
  run ``jit=False`` for the eager path.
  """
  f, g, params, state = _setup(model, x, **track_kw)
  chex.assert_trees_all_equal(params, jax.jit(g.init)(jax.random.PRNGKey(0), x))
  fn = gram_haiku.value_grad_and_gram(f.apply)
  plain = g.apply
  if jit:
    fn, plain = jax.jit(fn), jax.jit(plain)
  value, grads, grams = fn(params, state, None, x)
  ref = reference_gram(plain, params, x)
  _record(name, grams.total, ref)
  assert_gram_close(grams.total, ref)
  value0, grads0 = jax.jit(jax.value_and_grad(plain))(params, x)
  np.testing.assert_allclose(value, value0, rtol=1e-6)
  chex.assert_trees_all_close(grads, grads0, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grams.norms, np.sqrt(np.diag(ref)), rtol=1e-4)
  return grams


def _x(seed, shape, dtype=jnp.float32):
  return _normal(np.random.default_rng(seed), shape, dtype)


def _np_init(shape, dtype):
  """Random N(0, 1/fan_in) parameters from numpy, seeded by the shape.

  Deterministic (the tracked and the untracked init agree) and cheap: no
  per-shape compilation of jax.random kernels, which dominates test time on
  CPU. Haiku's default initialisers are covered by
  test_track_default_initialisers_and_inference_bitwise.
  """
  shape = tuple(shape)
  rng = np.random.default_rng(zlib.crc32(repr(shape).encode()))
  fan_in = max(int(np.prod(shape[:-1])), 1)
  return _normal(rng, shape, dtype, 1 / np.sqrt(fan_in))


_I = dict(w_init=_np_init, b_init=_np_init)

TRACK_MODELS = {
    "conv1d_stack": (lambda x: hk.Conv1D(3, 3, rate=2, **_I)(jnp.tanh(
        hk.Conv1D(4, 2, stride=2, padding="VALID", **_I)(x))), (4, 9, 2)),
    "conv1d_ncw_causal_padfn": (
        lambda x: hk.Conv1D(3, 3, padding=hk.pad.causal, data_format="NCW",
                            with_bias=False, **_I)(x), (4, 2, 8)),
    "conv2d_grouped_nchw": (
        lambda x: hk.Conv2D(6, (3, 2), stride=(2, 1), feature_group_count=3,
                            padding=[(1, 0), (0, 2)], data_format="NCHW",
                            **_I)(x),
        (4, 3, 6, 5)),
    "conv2d_then_linear": (
        lambda x: hk.Linear(3, **_I)(hk.Flatten()(jnp.tanh(
            hk.Conv2D(4, 3, stride=2, **_I)(x)))), (5, 6, 6, 2)),
    "conv3d": (lambda x: hk.Conv3D(3, 2, stride=(2, 1, 1), rate=(1, 2, 1),
                                   **_I)(x),
               (3, 4, 5, 4, 2)),
    "conv1d_transpose_ncw": (
        lambda x: hk.Conv1DTranspose(3, 3, stride=2, data_format="NCW",
                                     **_I)(x),
        (4, 2, 5)),
    "conv2d_transpose_output_shape": (
        lambda x: hk.Conv2DTranspose(3, 3, stride=2, output_shape=(9, 7),
                                     padding="VALID", **_I)(x), (4, 4, 3, 2)),
    "conv2d_transpose_explicit_nobias": (
        lambda x: hk.Conv2DTranspose(2, (2, 3), stride=(1, 2),
                                     padding=((1, 1), (2, 0)),
                                     with_bias=False, **_I)(x), (4, 4, 3, 2)),
    "conv3d_transpose_ncdhw": (
        lambda x: hk.Conv3DTranspose(2, 2, stride=2, data_format="NCDHW",
                                     **_I)(x),
        (3, 2, 2, 3, 2)),
}


@pytest.mark.parametrize("name", list(TRACK_MODELS))
def test_track_models(name):
  model, shape = TRACK_MODELS[name]
  grams = _check(name, model, _x(_seed(name), shape))
  assert all("conv" in k or "linear" in k for k in grams.by_layer)


def test_track_registers_the_method_defining_classes():
  seen = []
  def spy(next_f, args, kwargs, context):
    if context.method_name == "__call__":
      seen.append(context.orig_class)
    return next_f(*args, **kwargs)
  def fn(x):
    with hk.intercept_methods(spy):
      hk.Conv2D(2, 3)(x)
      hk.Conv2DTranspose(2, 3)(x)
  hk.transform(fn).init(jax.random.PRNGKey(0), jnp.ones((1, 4, 4, 2)))
  assert seen == [hk.ConvND, hk.ConvNDTranspose]
  from gram_haiku._src.frontend import registry  # pylint: disable=g-import-not-at-top
  assert registry.handler_for(hk.ConvND) is conv_layers.conv_nd
  assert registry.handler_for(hk.ConvNDTranspose) is (
      conv_layers.conv_nd_transpose)


@pytest.mark.parametrize("jit", problems.JIT_CASES)
def test_track_conv2d_jit(jit):
  model = lambda x: hk.Conv2D(3, 3, stride=2, **_I)(jnp.tanh(
      hk.Conv2DTranspose(2, 2, stride=2, **_I)(x)))
  _check(f"track_jit_{jit}", model, _x(20, (4, 3, 3, 2)), jit=jit)


@pytest.mark.parametrize("transpose", [False, True])
def test_track_unbatched_hk_vmap_depth_1(transpose):
  # Per-example code: the module sees unbatched (H, W, C).
  def per_example(xi):
    if transpose:
      return hk.Conv2DTranspose(3, 3, stride=2, **_I)(xi)
    return hk.Conv2D(4, 3, stride=2, feature_group_count=2, **_I)(xi)
  model = hk.vmap(per_example, split_rng=False)
  _check(f"hk_vmap1_{transpose}", model, _x(21, (4, 5, 4, 2)),
         jit=not transpose)


def test_track_unbatched_hk_vmap_depth_2_jit_inside():
  # vmap over examples, then over a within-example axis T of 2 images.
  def per_image(xi):  # (C, W): NCW, unbatched
    return hk.Conv1D(3, 3, stride=2, data_format="NCW", **_I)(xi)
  inner = hk.vmap(per_image, split_rng=False)
  model = hk.vmap(inner, split_rng=False)
  _check("hk_vmap2", model, _x(22, (4, 2, 2, 7)), jit=True)


@pytest.mark.parametrize("transpose", [False, True])
def test_track_norms_mode(transpose):
  x = _x(24, (5, 4, 4, 2))
  def model(x):
    if transpose:
      return hk.Conv2DTranspose(2, 3, stride=2, data_format="NHWC", **_I)(x)
    return hk.Conv2D(4, 3, feature_group_count=2, rate=2, **_I)(x)
  f, g, params, state = _setup(model, x, mode="norms")
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x)
  ref = reference_gram(g.apply, params, x)
  assert not grams.by_layer
  chex.assert_shape(grams.sq_norms, (5,))
  _record(f"track_norms_{transpose}", grams.sq_norms, np.diag(ref))
  np.testing.assert_allclose(grams.sq_norms, np.diag(ref), rtol=1e-4)


def test_track_bf16_parity_and_f32_gram():
  x = _x(25, (4, 5, 5, 2))
  def model(x):
    h = hk.Conv2D(4, 3, stride=2, feature_group_count=2, **_I)(
        x.astype(jnp.bfloat16))
    return hk.Conv2DTranspose(2, 2, stride=2, **_I)(jnp.tanh(h))
  f, _, params, state = _setup(model, x)
  assert all(l.dtype == jnp.bfloat16 for l in jax.tree.leaves(params))
  _, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x)
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
  assert grams.total.dtype == jnp.float32
  def plain32(p, x):
    return hk.without_apply_rng(hk.transform(
        lambda x: _sq(hk.Conv2DTranspose(2, 2, stride=2, **_I)(jnp.tanh(
            hk.Conv2D(4, 3, stride=2, feature_group_count=2, **_I)(x))))
    )).apply(p, x)
  p32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  x32 = x.astype(jnp.bfloat16).astype(jnp.float32)
  ref = reference_gram(plain32, p32, x32)
  _record("track_bf16", grams.total, ref)
  assert_gram_close(grams.total, ref, rtol=RTOL_BF16)


def test_track_default_initialisers_and_inference_bitwise():
  # Haiku's default initialisers: the same parameters, tracked or not.
  x = _x(26, (3, 6, 5, 4))
  model = lambda x: hk.Conv2DTranspose(2, 3, stride=2, output_shape=(8, 6))(
      hk.Conv2D(4, 3, feature_group_count=2, padding="VALID")(x))
  f = hk.transform_with_state(lambda x: _track_out(model, x))
  g = hk.transform(model)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x)
  chex.assert_trees_all_equal(params, jax.jit(g.init)(jax.random.PRNGKey(0), x))
  out, _ = jax.jit(f.apply)(params, state, None, x)
  np.testing.assert_array_equal(out, jax.jit(g.apply)(params, None, x))


def _track_out(model, x):
  with gram_haiku.track():
    return model(x)


def test_track_conv_called_twice_has_cross_terms():
  x = _x(27, (4, 6, 2))
  def model(x):
    conv = hk.Conv1D(2, 3, **_I)
    return conv(jnp.tanh(conv(x)))
  grams = _check("conv_twice", model, x)
  assert list(grams.by_layer) == ["conv1_d"]


def test_track_mask_of_the_wrong_shape_is_haikus_error():
  # (Masks of the right shape are tracked: tests/test_reparam.py.)
  mask = jnp.ones((3, 3, 2, 5))
  def tracked(x):
    with gram_haiku.track():
      return hk.Conv2D(4, 3, mask=mask, name="masked")(x).sum()
  with pytest.raises(ValueError, match="Mask needs to have the same shape"):
    hk.transform_with_state(tracked).init(jax.random.PRNGKey(0),
                                          jnp.ones((2, 5, 5, 2)))


def test_a_mask_on_the_raw_path_is_refused_naming_the_mask():
  # The op receives w * mask; the raw jax.grad path cannot pull its Gram
  # back to w. The refusal names the mask (not a custom getter the user
  # does not have) and the entry point that is exact for it.
  mask = jnp.asarray(np.tril(np.ones((3, 3)))[:, :, None, None]
                     * np.ones((1, 1, 2, 4)), jnp.float32)
  x = _x(28, (2, 5, 5, 2))

  def tracked(x):
    with gram_haiku.track():
      return jnp.sum(hk.Conv2D(4, 3, mask=mask, name="masked")(x) ** 2)
  f = hk.transform_with_state(tracked)
  params, state = f.init(jax.random.PRNGKey(0), x)
  state = gram_haiku.resize_probes(state, 2)
  with pytest.raises(ValueError, match=r"'masked' multiplies its weight by "
                     r"its mask(.|\n)*value_grad_and_gram"):
    jax.grad(lambda s: f.apply(params, s, None, x)[0])(state)


def test_track_rank_and_group_errors_match_haiku():
  def tracked(x, groups=1):
    with gram_haiku.track():
      return hk.Conv2D(4, 3, feature_group_count=groups)(x).sum()
  init = hk.transform_with_state(tracked).init
  with pytest.raises(ValueError, match="rank"):
    init(jax.random.PRNGKey(0), jnp.ones((5, 2)))
  with pytest.raises(ValueError, match="feature_group_count"):
    init(jax.random.PRNGKey(0), jnp.ones((1, 5, 5, 3)), groups=2)


def test_report_max_rel_err():
  # Runs last in this file; prints the per-variant errors (pytest -s).
  for k in sorted(MAX_REL_ERR):
    print(f"max rel err {k}: {MAX_REL_ERR[k]:.2e}")



@pytest.mark.parametrize("mode", ["gram", "norms"])
def test_rule_hooks_answer_in_any_mode(mode):
  # The op's rule's gram/sq_norms give the Gram and its diagonal whatever
  # mode the op was bound in, equal to the exact per-example formula (vmap
  # of the VJP of the rule's forward).
  from gram_haiku._src.compat import hijax_compat as hx  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.compute import kernels  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.rules import rule as rule_lib  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.ops import op as op_lib  # pylint: disable=g-import-not-at-top
  case = CASES["2d_nhwc_s2_groups2"]
  p, x = case.make(12, lead=(4,))
  probe = jnp.zeros((4, 4) if mode == "gram" else (4,))
  jaxpr = jax.make_jaxpr(lambda p, q: case.tracked(p, q, x, mode=mode))(
      p, probe)
  (op,) = [o for o in (hx.gram_op_of(e, op_lib.RuleOp)
                       for e in jaxpr.jaxpr.eqns) if o is not None]
  g = problems.normal(jax.random.PRNGKey(13), op.out_aval.shape)
  params = (p["w"], p.get("b"))
  want = rule_lib.gram_from_per_example(
      functools.partial(rule_lib.per_example_grads_by_vjp, op.rule.forward),
      x, g, params, 0, kernels.LOCAL)
  gram = rule_lib.gram_of(op.rule, x, g, params, 0, kernels.LOCAL)
  sq = rule_lib.sq_norms_of(op.rule, x, g, params, 0, kernels.LOCAL)
  assert_gram_close(gram, want)
  np.testing.assert_allclose(sq, np.diag(np.asarray(want)), rtol=1e-4,
                             atol=1e-6 * float(np.abs(want).max()))


def _random_conv_args(rng, n):
  kernel = tuple(int(v) for v in rng.integers(1, 4, n))
  args = dict(window_strides=tuple(int(v) for v in rng.integers(1, 3, n)),
              rhs_dilation=tuple(int(v) for v in rng.integers(1, 3, n)))
  if rng.random() < 0.4:  # A transposed conv's form: input dilation.
    args["lhs_dilation"] = tuple(int(v) for v in rng.integers(1, 3, n))
    args["padding"] = tuple((int(a), int(b)) for a, b in
                            rng.integers(0, 3, (n, 2)))
  else:
    args["lhs_dilation"] = (1,) * n
    args["padding"] = (["SAME", "VALID"] + [tuple(
        (int(a), int(b)) for a, b in rng.integers(-1, 3, (n, 2)))])[
            rng.integers(0, 3)]
  return kernel, args


@pytest.mark.parametrize("n", [1, 2, 3])
def test_im2col_equals_the_patches_convolution(n):
  """The slice-built patches are ``lax.conv_general_dilated_patches``'
  exactly (values and output positions; features tap-major, where lax
  orders them channel-major), for random strides, kernel and input
  dilations and paddings (negative ones included)."""
  rng = np.random.default_rng(n)
  spec = (0, n + 1) + tuple(range(1, n + 1))
  dn = lax.ConvDimensionNumbers(spec, (n + 1, n) + tuple(range(n)), spec)
  checked = 0
  for _ in range(8):
    kernel, args = _random_conv_args(rng, n)
    spatial = tuple(int(v) for v in rng.integers(2, 7, n))
    x = _normal(rng, (2,) + spatial + (3,), jnp.float32)
    want = jax.jit(lambda x, kernel=kernel, args=args:
                   lax.conv_general_dilated_patches(
                       x, kernel, dimension_numbers=dn,
                       precision=lax.Precision.HIGHEST, **args))(x)
    got = jax.jit(lambda x, kernel=kernel, args=args: im2col(
        x, kernel, **args))(x)
    taps = int(np.prod(kernel))
    want = want.reshape(want.shape[:-1] + (3, taps))  # (c, k)
    want = np.swapaxes(want, -1, -2).reshape(got.shape)  # (k, c)
    np.testing.assert_array_equal(got, want)
    checked += 1
  assert checked == 8


_DEPTHWISE = {
    "1d": (lambda: hk.DepthwiseConv1D(2, 3, padding="VALID"), (7, 3)),
    "2d_nchw_rate": (lambda: hk.DepthwiseConv2D(
        3, (3, 2), rate=2, data_format="NCHW"), (2, 6, 6)),
    "2d_stride_explicit": (lambda: hk.DepthwiseConv2D(
        1, 3, stride=2, padding=((1, 0), (0, 2))), (6, 5, 3)),
    "3d_no_bias_first": (lambda: hk.DepthwiseConv3D(
        2, 2, with_bias=False, data_format="NCDHW"), (2, 3, 4, 3)),
    "3d": (lambda: hk.DepthwiseConv3D(2, 2), (3, 4, 3, 2)),
}


@pytest.mark.parametrize("name", sorted(_DEPTHWISE))
def test_depthwise_convolutions_match_the_reference(name):
  make, shape = _DEPTHWISE[name]
  kx, ky = jax.random.split(jax.random.PRNGKey(_seed(name)))
  x = jax.random.normal(kx, (5,) + shape)
  y = jax.random.normal(ky, (5, 2))

  def model(x, y):
    h = make()(x)
    out = hk.Linear(2)(jnp.tanh(h.reshape(h.shape[0], -1)))
    return 0.5 * jnp.sum((out - y) ** 2)

  def tracked(x, y):
    with gram_haiku.track(untracked="error"):
      return model(x, y)
  f = hk.transform_with_state(tracked)
  params, state = f.init(jax.random.PRNGKey(1), x, y)
  plain = hk.without_apply_rng(hk.transform(model))
  chex.assert_trees_all_equal_shapes(params, plain.init(
      jax.random.PRNGKey(1), x, y))
  value, grads, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, y)
  np.testing.assert_allclose(value, plain.apply(params, x, y), rtol=1e-5)
  assert_gram_close(grams.total, reference_gram(plain.apply, params, x, y))


def test_depthwise_bias_with_channels_first_outside_2d_is_refused():
  # Haiku's [O, 1, 1] bias broadcasts along a spatial axis there.
  def tracked(x):
    with gram_haiku.track():
      return hk.DepthwiseConv3D(2, 2, data_format="NCDHW")(x).sum()
  with pytest.raises(NotImplementedError, match="spatial axis"):
    hk.transform_with_state(tracked).init(jax.random.PRNGKey(0),
                                          jnp.ones((2, 3, 4, 4, 4)))
