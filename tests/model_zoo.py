"""Models as people write them, unmodified, at test sizes.

The models DP-SGD and data-attribution users train, each written the way
its usual public source writes it (Haiku's transformer example, ViT and
GPT ports, a GroupNorm ResNet with weight standardisation, an MLP-Mixer, a
CLIP-style two-tower model, an LSTM language model), with no concession
to gram_haiku: bare ``hk.get_parameter`` for positions, class tokens and
scales, a raw ``h @ embeddings.T`` for a tied output. Each entry says
whether gram_haiku covers every parameter today (``covered``) and, where
not, which parameters it reports as untracked. The bare positions, class
token and logit scale are covered by the program-level rules (a parameter
broadcast along the examples); an entry whose ``untracked`` becomes empty
moves from the refusal to the exactness checks.

Every net is ``net(*batch) -> [B]`` per-example losses of a batch; the
tests sum them inside ``gram_haiku.track()``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import models

_TRUNC = hk.initializers.TruncatedNormal(0.02)


@dataclasses.dataclass(frozen=True)
class ZooModel:
  name: str
  net: Callable
  batch: Callable[[int], tuple]  # seed -> the batch (numpy arrays)
  #: parameters reported as untracked today (module/name), empty if none.
  untracked: tuple[str, ...] = ()
  #: a pattern of the error every entry point raises today (a use that
  #: cannot even be reported as untracked), empty if none.
  refused: str = ""

  @property
  def covered(self) -> bool:
    return not self.untracked and not self.refused


_xent = models.xent


# -- a decoder written like Haiku's transformer example ----------------------

class _Block(hk.Module):
  """Pre-LayerNorm attention and dense blocks, causal by default (as
  Haiku's ``examples/transformer/model.py`` arranges them)."""

  def __init__(self, heads: int, causal: bool = True, name=None):
    super().__init__(name=name)
    self.heads = heads
    self.causal = causal

  def __call__(self, h):
    t, d = h.shape[-2:]
    mask = jnp.tril(jnp.ones((1, 1, t, t))) if self.causal else None
    a = hk.LayerNorm(-1, True, True)(h)
    h = h + hk.MultiHeadAttention(self.heads, d // self.heads,
                                  w_init=hk.initializers.VarianceScaling(
                                      1.0))(a, a, a, mask=mask)
    a = hk.LayerNorm(-1, True, True)(h)
    a = jax.nn.gelu(hk.Linear(4 * d, w_init=_TRUNC)(a))
    return h + hk.Linear(d, w_init=_TRUNC)(a)


def _decoder(tied: bool, vocab=13, d=8, heads=2, layers=1):
  def net(tokens, targets):
    t = tokens.shape[-1]
    embed = hk.Embed(vocab, d, w_init=_TRUNC, name="embed")
    pos = hk.get_parameter("positional_embeddings", [t, d], init=_TRUNC)
    h = embed(tokens) + pos
    for _ in range(layers):
      h = _Block(heads)(h)
    h = hk.LayerNorm(-1, True, True, name="ln_f")(h)
    logits = (h @ embed.embeddings.T if tied
              else hk.Linear(vocab, name="unembed")(h))
    return _xent(logits, targets).sum(-1)

  def batch(seed, b=4, t=5):
    tok = np.random.default_rng(seed).integers(0, vocab, (b, t + 1))
    return tok[:, :-1].astype(np.int32), tok[:, 1:].astype(np.int32)
  return net, batch


# -- a ViT with a class token and learned positions --------------------------

def _vit(d=8, heads=2, patch=2, image=4, classes=3):
  side = image // patch

  def net(x, y):
    b = x.shape[0]
    p = x.reshape(b, side, patch, side, patch, 1).transpose(0, 1, 3, 2, 4, 5)
    h = hk.Linear(d, name="patch_embed")(p.reshape(b, side * side, -1))
    cls = hk.get_parameter("cls_token", [1, 1, d], init=_TRUNC)
    h = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, d)), h], axis=1)
    h = h + hk.get_parameter("pos_embedding", [1, side * side + 1, d],
                             init=_TRUNC)
    # (Not causal: the class token attends to every patch.)
    h = _Block(heads, causal=False, name="block")(h)
    h = hk.LayerNorm(-1, True, True, name="ln_f")(h[:, 0])
    return _xent(hk.Linear(classes, name="head")(h), y)

  def batch(seed, b=4):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, image, image, 1)).astype(np.float32),
            rng.integers(0, classes, (b,)).astype(np.int32))
  return net, batch


# -- a ResNet with GroupNorm and weight standardisation ----------------------

def _standardise(next_getter, value, context):
  """Every convolution kernel (rank 4) standardised, as the getter reads
  it."""
  if context.name == "w" and value.ndim == 4:
    value = models.standardise(value)
  return next_getter(value)


def _resnet(width=4, classes=3):
  def net(x, y):
    with hk.custom_getter(_standardise):
      h = hk.Conv2D(width, 3, name="conv_stem")(x)
      r = jax.nn.relu(hk.GroupNorm(2, name="gn1")(h))
      r = hk.Conv2D(width, 3, name="conv1")(r)
      r = jax.nn.relu(hk.GroupNorm(2, name="gn2")(r))
      h = h + hk.Conv2D(width, 3, name="conv2")(r)
    h = jnp.mean(jax.nn.relu(h), axis=(1, 2))
    return _xent(hk.Linear(classes, name="head")(h), y)

  def batch(seed, b=4):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, 5, 5, 2)).astype(np.float32),
            rng.integers(0, classes, (b,)).astype(np.int32))
  return net, batch


# -- an MLP-Mixer ---------------------------------------------------------------

def _mixer(tokens=4, d=6, classes=3):
  def net(x, y):
    h = hk.Linear(d, name="stem")(x)
    a = hk.LayerNorm(-1, True, True, name="ln_token")(h)
    a = jnp.swapaxes(a, 1, 2)
    a = hk.Linear(tokens, name="token_mix_out")(
        jax.nn.gelu(hk.Linear(2 * tokens, name="token_mix_in")(a)))
    h = h + jnp.swapaxes(a, 1, 2)
    a = hk.LayerNorm(-1, True, True, name="ln_channel")(h)
    h = h + hk.Linear(d, name="channel_mix_out")(
        jax.nn.gelu(hk.Linear(2 * d, name="channel_mix_in")(a)))
    return _xent(hk.Linear(classes, name="head")(h.mean(1)), y)

  def batch(seed, b=4):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, tokens, 5)).astype(np.float32),
            rng.integers(0, classes, (b,)).astype(np.int32))
  return net, batch


# -- a CLIP-style two-tower model, per-example (paired) loss ----------------

def _two_tower(d=6):
  """Two encoders and a learned logit scale (``exp`` of a bare parameter,
  CLIP's ``logit_scale``); the loss is each pair's own scaled cosine
  similarity against a target, per example (a contrastive loss over the
  batch couples the examples and has no per-example gradients)."""
  def net(img, txt, target):
    zi = hk.Linear(d, name="image_tower")(img)
    zt = hk.Linear(d, name="text_tower")(txt)
    zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
    zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
    scale = jnp.exp(hk.get_parameter("logit_scale", [],
                                     init=hk.initializers.Constant(
                                         np.log(1 / 0.07))))
    return (scale * jnp.sum(zi * zt, -1) - target) ** 2

  def batch(seed, b=4):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((b, 5)).astype(np.float32),
            rng.standard_normal((b, 7)).astype(np.float32),
            rng.standard_normal((b,)).astype(np.float32))
  return net, batch


# -- an LSTM language model ---------------------------------------------------

def _lstm_lm(vocab=11, d=6):
  def net(tokens, targets):
    h = hk.Embed(vocab, d, name="embed")(tokens)
    core = hk.LSTM(d, name="lstm")
    out, _ = hk.dynamic_unroll(core, jnp.swapaxes(h, 0, 1),
                               core.initial_state(tokens.shape[0]))
    logits = hk.Linear(vocab, name="out")(jnp.swapaxes(out, 0, 1))
    return _xent(logits, targets).sum(-1)

  def batch(seed, b=4, t=4):
    tok = np.random.default_rng(seed).integers(0, vocab, (b, t + 1))
    return tok[:, :-1].astype(np.int32), tok[:, 1:].astype(np.int32)
  return net, batch


def _entry(name, made, untracked=(), refused=""):
  net, batch = made
  return ZooModel(name, net, batch, tuple(untracked), refused)


ZOO = (
    # Bare parameters broadcast along the examples: covered by the
    # program-level rules (gram_haiku._src.analysis.program_rules).
    _entry("gpt_haiku_example", _decoder(tied=False)),
    # The tied output's raw matmul reads the tracked table outside its
    # layer: a program-level site, whose per-example gradients are added
    # to the embedding layer's (with the cross terms of the two uses).
    _entry("gpt_tied_output", _decoder(tied=True)),
    _entry("vit_class_token", _vit()),
    _entry("resnet_gn_ws", _resnet()),
    _entry("mlp_mixer", _mixer()),
    _entry("two_tower_logit_scale", _two_tower()),
    _entry("lstm_lm", _lstm_lm()),
)
