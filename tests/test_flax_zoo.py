"""The model zoo (``tests/model_zoo.py``) as Flax linen and NNX models and
as plain-JAX functions, written the way their users write them, through
``gram_haiku.functional``.

Each model gets the Haiku model's weights (a small mapping per model) and
must give, in float64: the Haiku model's Gram (``gram_haiku.
value_grad_and_gram`` inside ``track()``), ``F @ F.T`` of its own
``vmap(grad)``, a complete coverage, and ``clipped_grad`` (all-layer) equal
to the reference's clipped sum (an ``nn.RNN`` LSTM included: its cell's
weights are used inside a ``lax.scan``).

The plain-JAX models run in CI; the Flax ones skip without flax (the tox
env ``flax`` runs them).
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku import functional as gf
from gram_haiku import testing
from tests import model_zoo

try:
  import flax.linen as nn
  from flax import nnx
except ImportError:  # (the Flax models skip; the plain-JAX ones run)
  nn = nnx = None

needs_flax = pytest.mark.skipif(nn is None, reason="flax is not installed "
                                "(pip install 'gram_haiku[flax]')")

ZOO = {m.name: m for m in model_zoo.ZOO}


def _f64(tree):
  return jax.tree.map(
      lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating)
      else a, tree)


@functools.cache
def _haiku(name: str):
  """``(params, batch, gram)``: the Haiku zoo model's float64 weights, a
  batch and its Gram (call inside ``jax.enable_x64``)."""
  model = ZOO[name]

  def loss(*batch):
    with gram_haiku.track(untracked="error"):
      return model.net(*batch).sum()
  f = hk.transform_with_state(loss)
  batch = _f64(tuple(jnp.asarray(a) for a in model.batch(0)))
  params, state = f.init(jax.random.PRNGKey(0), *batch)
  params = _f64(params)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, *batch)
  assert grams.complete
  return params, batch, np.asarray(grams.total)


def _check(name: str, loss, to_params):
  """``loss(params, *batch)`` with the Haiku model ``name``'s weights
  (``to_params(haiku_params)``): the Haiku Gram, ``F @ F.T`` and the
  reference clipped sum."""
  with jax.enable_x64(True):
    hparams, batch, want = _haiku(name)
    params = to_params(hparams)
    _, _, grams = jax.jit(gf.value_grad_and_gram(loss))(params, *batch)
    assert grams.complete, {k: c for k, c in grams.coverage.items()
                            if not c.tracked}
    got = np.asarray(grams.total)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12 * scale)
    f = np.asarray(testing.per_example_grads(loss, params, *batch))
    np.testing.assert_allclose(got, f @ f.T, rtol=1e-9, atol=1e-12 * scale)
    norms = np.linalg.norm(f, axis=1)
    c = float(np.median(norms))  # (some examples clipped, some not)
    clipped = jax.jit(gf.clipped_grad(loss, l2_clip_norm=c))(params, *batch)
    ref = testing.weighted_sum(f, testing.clip_reference(norms, c), params)
    top = max(float(np.abs(r).max()) for r in jax.tree.leaves(ref))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(
        a, b, rtol=1e-9, atol=1e-12 * top), clipped, ref)
    return grams


def _dense(p):
  return {"kernel": p["w"], "bias": p["b"]}


def _ln(p):
  return {"scale": p["scale"], "bias": p["offset"]}


# -- plain JAX: the GPT decoder over Haiku's own parameter dict ---------------


def _layer_norm(p, x, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["offset"]


def _linear(p, x):
  return x @ p["w"] + p["b"]


def _block_plain(params, blk: str, h, heads: int, causal: bool):
  """The zoo's pre-LayerNorm transformer block (its Haiku parameters under
  the prefix ``blk``) as plain JAX: an explicit attention with
  ``jnp.einsum`` over the heads (``causal``: masked), then the MLP."""
  a = _layer_norm(params[blk + "layer_norm"], h)
  split = lambda z: z.reshape(*z.shape[:-1], heads, -1)
  q, k, v = (split(_linear(params[blk + "multi_head_attention/" + n], a))
             for n in ("query", "key", "value"))
  logits = jnp.einsum("bthd,bThd->bhtT", q, k) / np.sqrt(q.shape[-1])
  if causal:
    t = h.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e30)
  att = jnp.einsum("bhtT,bThd->bthd", jax.nn.softmax(logits), v)
  h = h + _linear(params[blk + "multi_head_attention/linear"],
                  att.reshape(*att.shape[:2], -1))
  a = _layer_norm(params[blk + "layer_norm_1"], h)
  a = jax.nn.gelu(_linear(params[blk + "linear"], a))
  return h + _linear(params[blk + "linear_1"], a)


def _gpt_plain(params, tokens, targets, heads=2, tied=False):
  """The decoder as a plain function of a dict of arrays: an explicit
  causal attention with ``jnp.einsum`` over the heads; ``tied``: the
  output layer is the embedding table, transposed."""
  h = params["embed"]["embeddings"][tokens]
  h = h + params["~"]["positional_embeddings"]
  h = _block_plain(params, "__block/", h, heads, causal=True)
  h = _layer_norm(params["ln_f"], h)
  logits = (h @ params["embed"]["embeddings"].T if tied
            else _linear(params["unembed"], h))
  return model_zoo._xent(logits, targets).sum()


@pytest.mark.parametrize("name", ["gpt_haiku_example", "gpt_tied_output"])
def test_plain_jax_gpt_is_the_haiku_gram(name):
  _check(name, functools.partial(_gpt_plain, tied=name == "gpt_tied_output"),
         lambda p: p)


def _two_tower_plain(params, img, txt, target):
  zi = _linear(params["image_tower"], img)
  zt = _linear(params["text_tower"], txt)
  zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
  zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
  scale = jnp.exp(params["~"]["logit_scale"])
  return jnp.sum((scale * jnp.sum(zi * zt, -1) - target) ** 2)


def test_plain_jax_two_tower_is_the_haiku_gram():
  _check("two_tower_logit_scale", _two_tower_plain, lambda p: p)


def _mixer_plain(params, x, y):
  """The MLP-Mixer: token mixing over the swapped axes, then channel
  mixing."""
  h = _linear(params["stem"], x)
  a = jnp.swapaxes(_layer_norm(params["ln_token"], h), 1, 2)
  a = _linear(params["token_mix_out"],
              jax.nn.gelu(_linear(params["token_mix_in"], a)))
  h = h + jnp.swapaxes(a, 1, 2)
  a = _layer_norm(params["ln_channel"], h)
  h = h + _linear(params["channel_mix_out"],
                  jax.nn.gelu(_linear(params["channel_mix_in"], a)))
  return model_zoo._xent(_linear(params["head"], h.mean(1)), y).sum()


def test_plain_jax_mixer_is_the_haiku_gram():
  _check("mlp_mixer", _mixer_plain, lambda p: p)


def _vit_plain(params, x, y, heads=2, patch=2):
  """The ViT: patches by reshape, a class token broadcast along the batch
  and concatenated, learned positions, one non-causal block."""
  b, image = x.shape[0], x.shape[1]
  side = image // patch
  p = x.reshape(b, side, patch, side, patch, -1).transpose(0, 1, 3, 2, 4, 5)
  h = _linear(params["patch_embed"], p.reshape(b, side * side, -1))
  cls = params["~"]["cls_token"]
  h = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, h.shape[-1])), h],
                      axis=1)
  h = h + params["~"]["pos_embedding"]
  h = _block_plain(params, "block/", h, heads, causal=False)
  h = _layer_norm(params["ln_f"], h[:, 0])
  return model_zoo._xent(_linear(params["head"], h), y).sum()


def test_plain_jax_vit_is_the_haiku_gram():
  _check("vit_class_token", _vit_plain, lambda p: p)


def _group_norm(p, x, groups=2, eps=1e-5):
  """GroupNorm over ``[B, H, W, C]``: statistics per example and group of
  channels, over the spatial axes and the group's channels."""
  g = x.reshape(*x.shape[:-1], groups, x.shape[-1] // groups)
  mean = g.mean((1, 2, 4), keepdims=True)
  var = jnp.square(g - mean).mean((1, 2, 4), keepdims=True)
  g = (g - mean) * jax.lax.rsqrt(var + eps)
  return g.reshape(x.shape) * p["scale"] + p["offset"]


def _std_conv(p, x, eps=1e-4):
  """A SAME stride-1 convolution with a weight-standardised HWIO kernel."""
  w = p["w"]
  mean = w.mean((0, 1, 2), keepdims=True)
  w = (w - mean) * jax.lax.rsqrt(
      jnp.square(w - mean).mean((0, 1, 2), keepdims=True) + eps)
  return jax.lax.conv_general_dilated(
      x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  ) + p["b"]


def _resnet_plain(params, x, y):
  h = _std_conv(params["conv_stem"], x)
  r = jax.nn.relu(_group_norm(params["gn1"], h))
  r = _std_conv(params["conv1"], r)
  r = jax.nn.relu(_group_norm(params["gn2"], r))
  h = h + _std_conv(params["conv2"], r)
  h = jnp.mean(jax.nn.relu(h), axis=(1, 2))
  return model_zoo._xent(_linear(params["head"], h), y).sum()


def test_plain_jax_resnet_is_the_haiku_gram():
  _check("resnet_gn_ws", _resnet_plain, lambda p: p)


def _lstm_plain(params, tokens, targets):
  """The LSTM LM: a ``lax.scan`` over time of hk.LSTM's cell (one linear
  of ``[x, h]`` split into gates i, g, f, o; the forget gate's bias +1)."""
  h = params["embed"]["embeddings"][tokens]
  cell = params["lstm/linear"]
  d = cell["w"].shape[1] // 4

  def step(carry, x):
    hid, c = carry
    gated = jnp.concatenate([x, hid], axis=-1) @ cell["w"] + cell["b"]
    i, g, f, o = jnp.split(gated, 4, axis=-1)
    c = jax.nn.sigmoid(f + 1) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    hid = jax.nn.sigmoid(o) * jnp.tanh(c)
    return (hid, c), hid

  zeros = jnp.zeros((tokens.shape[0], d), h.dtype)
  _, out = jax.lax.scan(step, (zeros, zeros), jnp.swapaxes(h, 0, 1))
  logits = _linear(params["out"], jnp.swapaxes(out, 0, 1))
  return model_zoo._xent(logits, targets).sum()


def test_plain_jax_lstm_is_the_haiku_gram():
  _check("lstm_lm", _lstm_plain, lambda p: p)


# -- Flax linen ---------------------------------------------------------------

def _linen(module):
  def loss(params, *batch):
    return module.apply({"params": params}, *batch).sum()
  return loss


if nn is not None:

  class Block(nn.Module):
    """A pre-LayerNorm transformer block (Flax's own attention)."""
    heads: int

    @nn.compact
    def __call__(self, h, mask=None):
      d = h.shape[-1]
      a = nn.LayerNorm(epsilon=1e-5, name="ln1")(h)
      h = h + nn.MultiHeadDotProductAttention(
          num_heads=self.heads, qkv_features=d, name="attn")(a, mask=mask)
      a = nn.LayerNorm(epsilon=1e-5, name="ln2")(h)
      a = nn.gelu(nn.Dense(4 * d, name="mlp_in")(a))
      return h + nn.Dense(d, name="mlp_out")(a)

  class GPT(nn.Module):
    vocab: int = 13
    d: int = 8
    heads: int = 2
    tied: bool = False  # the output layer: the table (Embed.attend)

    @nn.compact
    def __call__(self, tokens, targets):
      embed = nn.Embed(self.vocab, self.d, name="embed")
      h = embed(tokens)
      h = h + self.param("pos", nn.initializers.normal(0.02),
                         (tokens.shape[-1], self.d))
      h = Block(self.heads, name="block")(h, nn.make_causal_mask(tokens))
      h = nn.LayerNorm(epsilon=1e-5, name="ln_f")(h)
      logits = (embed.attend(h) if self.tied else
                nn.Dense(self.vocab, name="unembed")(h))
      return model_zoo._xent(logits, targets).sum(-1)

  class ViT(nn.Module):
    """As google-research/vision_transformer: a strided convolution for the
    patches, a tiled class token, learned positions."""
    d: int = 8
    heads: int = 2
    patch: int = 2
    classes: int = 3

    @nn.compact
    def __call__(self, x, y):
      x = nn.Conv(self.d, (self.patch, self.patch), strides=self.patch,
                  padding="VALID", name="embedding")(x)
      n, hh, ww, c = x.shape
      x = jnp.reshape(x, [n, hh * ww, c])
      cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
      x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
      x = x + self.param("pos_embedding", nn.initializers.normal(0.02),
                         (1, x.shape[1], c))
      x = Block(self.heads, name="block")(x)
      x = nn.LayerNorm(epsilon=1e-5, name="ln_f")(x[:, 0])
      return model_zoo._xent(nn.Dense(self.classes, name="head")(x), y)

  def _standardize(x, axis, eps):
    x = x - jnp.mean(x, axis=axis, keepdims=True)
    return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=axis, keepdims=True)
                        + eps)

  class StdConv(nn.Conv):
    """Weight standardisation as big_transfer's Flax code writes it."""

    def param(self, name, *args, **kwargs):
      param = super().param(name, *args, **kwargs)
      if name == "kernel":
        param = _standardize(param, axis=[0, 1, 2], eps=1e-4)
      return param

  class ResNet(nn.Module):
    width: int = 4
    classes: int = 3

    @nn.compact
    def __call__(self, x, y):
      h = StdConv(self.width, (3, 3), name="conv_stem")(x)
      r = nn.relu(nn.GroupNorm(2, epsilon=1e-5, name="gn1")(h))
      r = StdConv(self.width, (3, 3), name="conv1")(r)
      r = nn.relu(nn.GroupNorm(2, epsilon=1e-5, name="gn2")(r))
      h = h + StdConv(self.width, (3, 3), name="conv2")(r)
      h = jnp.mean(nn.relu(h), axis=(1, 2))
      return model_zoo._xent(nn.Dense(self.classes, name="head")(h), y)

  class MlpBlock(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
      y = nn.gelu(nn.Dense(self.dim, name="in")(x))
      return nn.Dense(x.shape[-1], name="out")(y)

  class Mixer(nn.Module):
    """As google-research/vision_transformer's MlpMixer (one block)."""
    tokens: int = 4
    d: int = 6
    classes: int = 3

    @nn.compact
    def __call__(self, x, y):
      x = nn.Dense(self.d, name="stem")(x)
      a = nn.LayerNorm(epsilon=1e-5, name="ln_token")(x)
      a = jnp.swapaxes(a, 1, 2)
      a = MlpBlock(2 * self.tokens, name="token_mixing")(a)
      x = x + jnp.swapaxes(a, 1, 2)
      a = nn.LayerNorm(epsilon=1e-5, name="ln_channel")(x)
      x = x + MlpBlock(2 * self.d, name="channel_mixing")(a)
      return model_zoo._xent(nn.Dense(self.classes, name="head")(x.mean(1)),
                             y)

  class TwoTower(nn.Module):
    d: int = 6

    @nn.compact
    def __call__(self, img, txt, target):
      zi = nn.Dense(self.d, name="image")(img)
      zt = nn.Dense(self.d, name="text")(txt)
      zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
      zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
      scale = jnp.exp(self.param("logit_scale", nn.initializers.constant(
          np.log(1 / 0.07)), ()))
      return (scale * jnp.sum(zi * zt, -1) - target) ** 2

  class LSTMLM(nn.Module):
    """(float64 parameters: the cell's carry takes their dtype.)"""
    vocab: int = 11
    d: int = 6
    unrolled: bool = False

    @nn.compact
    def __call__(self, tokens, targets):
      h = nn.Embed(self.vocab, self.d, name="embed")(tokens)
      cell = nn.OptimizedLSTMCell(self.d, param_dtype=jnp.float64,
                                  name="cell")
      if self.unrolled:
        carry = cell.initialize_carry(jax.random.PRNGKey(0), h[:, 0].shape)
        outs = []
        for t in range(h.shape[1]):
          carry, out = cell(carry, h[:, t])
          outs.append(out)
        h = jnp.stack(outs, axis=1)
      else:
        h = nn.RNN(cell)(h)
      logits = nn.Dense(self.vocab, name="out")(h)
      return model_zoo._xent(logits, targets).sum(-1)


def _block(p, prefix):
  """A Haiku ``_Block``'s weights as :class:`Block`'s."""
  att = prefix + "multi_head_attention/"
  heads = lambda q: {"kernel": q["w"].reshape(q["w"].shape[0], 2, -1),
                     "bias": q["b"].reshape(2, -1)}
  out = p[att + "linear"]
  return {"ln1": _ln(p[prefix + "layer_norm"]),
          "attn": {"query": heads(p[att + "query"]),
                   "key": heads(p[att + "key"]),
                   "value": heads(p[att + "value"]),
                   "out": {"kernel": out["w"].reshape(2, -1, out["w"]
                                                      .shape[1]),
                           "bias": out["b"]}},
          "ln2": _ln(p[prefix + "layer_norm_1"]),
          "mlp_in": _dense(p[prefix + "linear"]),
          "mlp_out": _dense(p[prefix + "linear_1"])}


def _gpt_params(p):
  out = {"embed": {"embedding": p["embed"]["embeddings"]},
         "pos": p["~"]["positional_embeddings"],
         "block": _block(p, "__block/"), "ln_f": _ln(p["ln_f"])}
  if "unembed" in p:  # (the tied decoder has none)
    out["unembed"] = _dense(p["unembed"])
  return out


def _vit_params(p):
  w = p["patch_embed"]["w"]
  return {"embedding": {"kernel": w.reshape(2, 2, 1, w.shape[1]),
                        "bias": p["patch_embed"]["b"]},
          "cls": p["~"]["cls_token"], "pos_embedding": p["~"]["pos_embedding"],
          "block": _block(p, "block/"), "ln_f": _ln(p["ln_f"]),
          "head": _dense(p["head"])}


def _resnet_params(p):
  return {**{k: _dense(p[k]) for k in ("conv_stem", "conv1", "conv2",
                                       "head")},
          **{k: _ln(p[k]) for k in ("gn1", "gn2")}}


def _mixer_params(p):
  mlp = lambda n: {"in": _dense(p[n + "_in"]), "out": _dense(p[n + "_out"])}
  return {"stem": _dense(p["stem"]), "ln_token": _ln(p["ln_token"]),
          "token_mixing": mlp("token_mix"), "ln_channel": _ln(p["ln_channel"]),
          "channel_mixing": mlp("channel_mix"), "head": _dense(p["head"])}


def _two_tower_params(p):
  return {"image": _dense(p["image_tower"]), "text": _dense(p["text_tower"]),
          "logit_scale": p["~"]["logit_scale"]}


def _lstm_params(p):
  """hk.LSTM's one ``[x, h] -> (i, g, f, o)`` linear as the cell's eight
  kernels (its forget bias of 1 in ``hf``'s bias)."""
  w, b = p["lstm/linear"]["w"], p["lstm/linear"]["b"]
  d = w.shape[1] // 4
  cell = {}
  for k, gate in enumerate("igfo"):
    cols = slice(k * d, (k + 1) * d)
    cell["i" + gate] = {"kernel": w[:d, cols]}
    cell["h" + gate] = {"kernel": w[d:, cols],
                        "bias": b[cols] + (1.0 if gate == "f" else 0.0)}
  return {"embed": {"embedding": p["embed"]["embeddings"]},
          "cell": cell, "out": _dense(p["out"])}


LINEN = {
    "gpt_haiku_example": (lambda: GPT(), _gpt_params),
    "gpt_tied_output": (lambda: GPT(tied=True), _gpt_params),
    "vit_class_token": (lambda: ViT(), _vit_params),
    "resnet_gn_ws": (lambda: ResNet(), _resnet_params),
    "mlp_mixer": (lambda: Mixer(), _mixer_params),
    "two_tower_logit_scale": (lambda: TwoTower(), _two_tower_params),
    # The cell unrolled in a Python loop from initialize_carry's zeros (in
    # nn.RNN's scan: below).
    "lstm_lm": (lambda: LSTMLM(unrolled=True), _lstm_params),
}


@needs_flax
@pytest.mark.parametrize("name", sorted(LINEN))
def test_linen_model_is_the_haiku_gram(name):
  make, to_params = LINEN[name]
  module = make()
  with jax.enable_x64(True):
    _, batch, _ = _haiku(name)
    _same_tree(jax.eval_shape(module.init, jax.random.PRNGKey(0),
                              *batch)["params"],
               to_params(_haiku(name)[0]))
  _check(name, _linen(module), to_params)


def _same_tree(flax_params, mapped):
  """The mapping fills the Flax tree exactly (names and shapes; the Flax
  model's float32 made float64)."""
  assert (jax.tree.map(jnp.shape, flax_params) ==
          jax.tree.map(jnp.shape, mapped))


@needs_flax
def test_linen_lstm_in_nn_rnn_is_the_haiku_gram():
  """``nn.RNN`` runs its cell in a ``lax.scan`` whose body closes over the
  cell's weights: each is a per-example (or broadcast) site inside the
  loop, its ``Z`` a loop constant whose gradient sums the steps. The Gram
  is the Haiku ``hk.LSTM``'s (scanned by ``hk.dynamic_unroll``) and
  ``F @ F.T``; the clipped sum the reference's."""
  module = LSTMLM()
  with jax.enable_x64(True):
    hparams, batch, _ = _haiku("lstm_lm")
    _same_tree(jax.eval_shape(module.init, jax.random.PRNGKey(0),
                              *batch)["params"], _lstm_params(hparams))
  grams = _check("lstm_lm", _linen(module), _lstm_params)
  assert grams.coverage["cell/hi/kernel"].rule == "program: dot_general"


# -- Flax NNX -----------------------------------------------------------------

if nnx is not None:

  class NnxMixer(nnx.Module):

    def __init__(self, rngs, features=5, tokens=4, d=6, classes=3):
      self.stem = nnx.Linear(features, d, rngs=rngs)
      self.ln_token = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      self.token_in = nnx.Linear(tokens, 2 * tokens, rngs=rngs)
      self.token_out = nnx.Linear(2 * tokens, tokens, rngs=rngs)
      self.ln_channel = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      self.channel_in = nnx.Linear(d, 2 * d, rngs=rngs)
      self.channel_out = nnx.Linear(2 * d, d, rngs=rngs)
      self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, x, y):
      x = self.stem(x)
      a = jnp.swapaxes(self.ln_token(x), 1, 2)
      a = self.token_out(nnx.gelu(self.token_in(a)))
      x = x + jnp.swapaxes(a, 1, 2)
      a = self.ln_channel(x)
      x = x + self.channel_out(nnx.gelu(self.channel_in(a)))
      return model_zoo._xent(self.head(x.mean(1)), y)

  class NnxTwoTower(nnx.Module):

    def __init__(self, rngs, d=6):
      self.image = nnx.Linear(5, d, rngs=rngs)
      self.text = nnx.Linear(7, d, rngs=rngs)
      self.logit_scale = nnx.Param(jnp.asarray(np.log(1 / 0.07)))

    def __call__(self, img, txt, target):
      zi, zt = self.image(img), self.text(txt)
      zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
      zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
      return (jnp.exp(self.logit_scale[...]) * jnp.sum(zi * zt, -1)
              - target) ** 2

  def _nnx_attention(query, key, value, mask=None, **unused):
    """NNX's attention with its softmax in the inputs' dtype (without
    dropout its default goes to ``jax.nn.dot_product_attention``, whose
    softmax is in float32)."""
    del unused
    from flax.nnx.nn.attention import dot_product_attention_weights
    weights = dot_product_attention_weights(query, key, mask=mask)
    return jnp.einsum("...hqk,...khd->...qhd", weights, value)

  class NnxBlock(nnx.Module):
    """:class:`Block` in NNX (the same parameter tree)."""

    def __init__(self, rngs, d=8, heads=2):
      self.ln1 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(heads, d, qkv_features=d,
                                         attention_fn=_nnx_attention,
                                         decode=False, rngs=rngs)
      self.ln2 = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      self.mlp_in = nnx.Linear(d, 4 * d, rngs=rngs)
      self.mlp_out = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, h, mask=None):
      h = h + self.attn(self.ln1(h), mask=mask)
      return h + self.mlp_out(nnx.gelu(self.mlp_in(self.ln2(h))))

  class NnxGPT(nnx.Module):

    def __init__(self, rngs, vocab=13, d=8, heads=2, t=5, tied=False):
      # (float64: nnx.Embed computes in its table's dtype at creation.)
      self.embed = nnx.Embed(vocab, d, param_dtype=jnp.float64,
                             rngs=rngs)
      self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(),
                                                         (t, d)))
      self.block = NnxBlock(rngs, d, heads)
      self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      # tied: the output layer is the table (Embed.attend).
      self.unembed = None if tied else nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens, targets):
      h = self.embed(tokens) + self.pos[...]
      h = self.ln_f(self.block(h, nnx.make_causal_mask(tokens)))
      logits = (self.embed.attend(h) if self.unembed is None else
                self.unembed(h))
      return model_zoo._xent(logits, targets).sum(-1)

  class NnxViT(nnx.Module):
    """:class:`ViT` in NNX: a strided convolution for the patches, a tiled
    class token, learned positions."""

    def __init__(self, rngs, d=8, heads=2, patch=2, image=4, classes=3):
      self.embedding = nnx.Conv(1, d, (patch, patch), strides=patch,
                                padding="VALID", rngs=rngs)
      self.cls = nnx.Param(jnp.zeros((1, 1, d)))
      self.pos_embedding = nnx.Param(nnx.initializers.normal(0.02)(
          rngs.params(), (1, (image // patch) ** 2 + 1, d)))
      self.block = NnxBlock(rngs, d, heads)
      self.ln_f = nnx.LayerNorm(d, epsilon=1e-5, rngs=rngs)
      self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, x, y):
      x = self.embedding(x)
      n, hh, ww, c = x.shape
      x = jnp.reshape(x, [n, hh * ww, c])
      x = jnp.concatenate([jnp.tile(self.cls[...], [n, 1, 1]), x], axis=1)
      x = self.block(x + self.pos_embedding[...])
      return model_zoo._xent(self.head(self.ln_f(x[:, 0])), y)

  class NnxStdConv(nnx.Conv):
    """An ``nnx.Conv`` whose kernel is standardised as it is read."""

    def __call__(self, x):
      kernel = _standardize(self.kernel[...], axis=[0, 1, 2], eps=1e-4)
      return jax.lax.conv_general_dilated(
          x, kernel, (1, 1), "SAME",
          dimension_numbers=("NHWC", "HWIO", "NHWC")) + self.bias[...]

  class NnxResNet(nnx.Module):

    def __init__(self, rngs, channels=2, width=4, classes=3):
      self.conv_stem = NnxStdConv(channels, width, (3, 3), rngs=rngs)
      self.gn1 = nnx.GroupNorm(width, 2, epsilon=1e-5, rngs=rngs)
      self.conv1 = NnxStdConv(width, width, (3, 3), rngs=rngs)
      self.gn2 = nnx.GroupNorm(width, 2, epsilon=1e-5, rngs=rngs)
      self.conv2 = NnxStdConv(width, width, (3, 3), rngs=rngs)
      self.head = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x, y):
      h = self.conv_stem(x)
      r = self.conv1(nnx.relu(self.gn1(h)))
      h = h + self.conv2(nnx.relu(self.gn2(r)))
      h = jnp.mean(nnx.relu(h), axis=(1, 2))
      return model_zoo._xent(self.head(h), y)

  class NnxLSTMLM(nnx.Module):
    """An ``nnx.OptimizedLSTMCell`` in ``nnx.RNN`` (from a zero carry)."""

    def __init__(self, rngs, vocab=11, d=6):
      # (float64: nnx.Embed computes in its table's dtype at creation.)
      self.embed = nnx.Embed(vocab, d, param_dtype=jnp.float64,
                             rngs=rngs)
      self.rnn = nnx.RNN(nnx.OptimizedLSTMCell(d, d, rngs=rngs), rngs=False)
      self.out = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens, targets):
      h = self.embed(tokens)
      zeros = jnp.zeros(h[:, 0].shape, h.dtype)
      h = self.rnn(h, initial_carry=(zeros, zeros))
      return model_zoo._xent(self.out(h), targets).sum(-1)


def _nnx_mixer_params(p):
  return {"stem": _dense(p["stem"]), "ln_token": _ln(p["ln_token"]),
          "token_in": _dense(p["token_mix_in"]),
          "token_out": _dense(p["token_mix_out"]),
          "ln_channel": _ln(p["ln_channel"]),
          "channel_in": _dense(p["channel_mix_in"]),
          "channel_out": _dense(p["channel_mix_out"]),
          "head": _dense(p["head"])}


def _nnx_lstm_params(p):
  """hk.LSTM's one ``[x, h] -> (i, g, f, o)`` linear as the optimised
  cell's ``dense_i`` / ``dense_h``, its columns in ``(i, f, g, o)`` order
  (the forget bias of 1 in ``dense_h``'s bias)."""
  w, b = p["lstm/linear"]["w"], p["lstm/linear"]["b"]
  d = w.shape[1] // 4
  cols = {g: slice(k * d, (k + 1) * d) for k, g in enumerate("igfo")}
  order = lambda a: jnp.concatenate([a[..., cols[g]] for g in "ifgo"], -1)
  b = b.at[cols["f"]].add(1.0)
  return {"embed": {"embedding": p["embed"]["embeddings"]},
          "rnn": {"cell": {"dense_i": {"kernel": order(w[:d])},
                           "dense_h": {"kernel": order(w[d:]),
                                       "bias": order(b)}}},
          "out": _dense(p["out"])}


NNX = {
    "mlp_mixer": (lambda: NnxMixer, _nnx_mixer_params),
    "two_tower_logit_scale": (lambda: NnxTwoTower, _two_tower_params),
    # The linen models' parameter trees: their mappings.
    "gpt_haiku_example": (lambda: NnxGPT, _gpt_params),
    "gpt_tied_output": (lambda: functools.partial(NnxGPT, tied=True),
                        _gpt_params),
    "vit_class_token": (lambda: NnxViT, _vit_params),
    "resnet_gn_ws": (lambda: NnxResNet, _resnet_params),
    "lstm_lm": (lambda: NnxLSTMLM, _nnx_lstm_params),
}


@needs_flax
@pytest.mark.parametrize("name", sorted(NNX))
def test_nnx_model_is_the_haiku_gram(name):
  """An ``nnx.Module`` through ``nnx.split`` / ``nnx.merge``: the loss is
  a function of its ``nnx.Param`` state."""
  make, to_dict = NNX[name]
  with jax.enable_x64(True):
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: make()(nnx.Rngs(0))), nnx.Param)

    def to_params(hparams):
      state = jax.tree.map(lambda a: a, abstract)
      nnx.replace_by_pure_dict(state, to_dict(hparams))
      _same_tree(abstract, state)
      return state

    def loss(state, *batch):
      return nnx.merge(graphdef, state)(*batch).sum()
    _check(name, loss, to_params)
