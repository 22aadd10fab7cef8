"""The benchmark models, in Haiku, with their per-example losses and data.

Each model is a Haiku function ``net(*batch) -> f32[B]`` (one loss per
example; the step differentiates their sum) plus synthetic data with the
example axis first, and the shapes of its parameterised layers for the
analytic FLOP count (:mod:`benchmarks.analytic`).

* ``mlp``: ``hk.nets.MLP`` 784-512-512-10 on ``f32[B, 784]`` (B=128).
* ``cnn``: three 3x3 ``hk.Conv2D`` (32, 64/2, 128/2 channels, SAME padding),
  each followed by ``hk.GroupNorm(8)`` and ReLU, global mean pool,
  ``hk.Linear(10)``, on ``f32[B, 32, 32, 3]`` (B=64).
* ``lm``: pre-LayerNorm transformer language model, 4 layers, d=256, 4 heads
  of 64, MLP 1024 with GELU, causal mask, sinusoidal positions, vocabulary
  512, ``T=128``, logits ``h @ embed.embeddings.T`` (tied embedding), next
  token cross-entropy summed over positions (B=8). The tied product is
  written ``gram_haiku.unembed(embed, h)`` (the same ``h @ E.T``, tracked as
  a second use of ``E``) when gram_haiku has it, else raw (``tied="raw"``
  forces the raw form, which ``track()`` rejects).
* ``lstm``: ``hk.LSTM(128)`` under ``hk.dynamic_unroll`` over ``T=32`` steps
  of ``f32[B, T, 32]`` inputs (batch major), ``hk.Linear(10)`` on the last
  output (B=64). The LSTM's gate ``hk.Linear`` is applied at every step with
  the same parameters (a shared module).

Small models, where per-layer overheads rather than FLOPs decide and the
tracked Gram must still be no slower than naive ``vmap(grad)``:

* ``tiny_mlp``: ``hk.nets.MLP`` 64-32-10 on ``f32[B, 64]`` (the digits'
  size, B=32).
* ``small_cnn``: 3x3 ``hk.Conv2D`` 8 then 16/2 channels with ReLU, mean
  pool, ``hk.Linear(10)``, on ``f32[B, 8, 8, 1]`` (B=32).
* ``attn64``: one pre-LayerNorm transformer block, d=64, 4 heads of 16,
  MLP 256 with GELU, on ``f32[B, 16, 64]``, mean pool, ``hk.Linear(10)``
  (B=16).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Sequence

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from benchmarks import analytic

MODEL_NAMES = ("mlp", "cnn", "lm", "lstm", "tiny_mlp", "small_cnn", "attn64")


@dataclasses.dataclass
class Bench:
  """One model instance at one size.

  Attributes:
    name: model name (``mlp``, ...).
    net: Haiku function ``net(*batch) -> f32[B]``, per-example losses.
    batch: arrays, example axis first.
    layers: parameterised layers for :mod:`benchmarks.analytic`.
    batch_size: ``B``.
    seq_len: ``T`` for sequence models, else None.
    description: one line for the table.
  """
  name: str
  net: Callable[..., jax.Array]
  batch: tuple
  layers: list[analytic.Layer]
  batch_size: int
  seq_len: Optional[int]
  description: str


def xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Cross-entropy per row: ``f32[..., C], i32[...] -> f32[...]``."""
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]


# -- MLP ---------------------------------------------------------------------

def make_mlp(batch_size: int = 128, hidden: Sequence[int] = (512, 512),
             input_dim: int = 784, classes: int = 10, seed: int = 0) -> Bench:
  sizes = [input_dim, *hidden, classes]

  def net(x, y):
    return xent(hk.nets.MLP([*hidden, classes])(x), y)

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, input_dim), np.float32)
  y = rng.integers(0, classes, (batch_size,)).astype(np.int32)
  layers = [analytic.Layer("linear", 1, n, m, bias=True, input_grad=i > 0)
            for i, (n, m) in enumerate(zip(sizes[:-1], sizes[1:]))]
  return Bench("mlp", net, (jnp.asarray(x), jnp.asarray(y)), layers,
               batch_size, None, "MLP " + "-".join(map(str, sizes)))


# -- CNN ---------------------------------------------------------------------

#: (channels, stride) of the three conv blocks.
CNN_BLOCKS = ((32, 1), (64, 2), (128, 2))
CNN_GROUPS = 8


def _conv_problem(batch_size: int, image: int, cin: int, classes: int,
                  blocks, seed: int, norms: bool):
  """Images ``f32[B, image, image, cin]`` and labels, and the analytic layers
  of 3x3 SAME convs ``blocks`` ((channels, stride), each followed by a
  GroupNorm when ``norms``) and a linear head."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, image, image, cin), np.float32)
  y = rng.integers(0, classes, (batch_size,)).astype(np.int32)
  layers, side = [], image
  for i, (channels, stride) in enumerate(blocks):
    side = -(-side // stride)
    layers.append(analytic.Layer("linear", side * side, 9 * cin, channels,
                                 bias=True, input_grad=i > 0))
    if norms:
      layers.append(analytic.Layer("norm", side * side, channels, channels))
    cin = channels
  layers.append(analytic.Layer("linear", 1, cin, classes, bias=True))
  return (jnp.asarray(x), jnp.asarray(y)), layers


def make_cnn(batch_size: int = 64, image: int = 32, classes: int = 10,
             seed: int = 0) -> Bench:
  def net(x, y):
    h = x
    for channels, stride in CNN_BLOCKS:
      h = hk.Conv2D(channels, 3, stride=stride)(h)
      h = hk.GroupNorm(CNN_GROUPS)(h)
      h = jax.nn.relu(h)
    h = h.mean(axis=(1, 2))
    return xent(hk.Linear(classes)(h), y)

  batch, layers = _conv_problem(batch_size, image, 3, classes, CNN_BLOCKS,
                                seed, norms=True)
  return Bench("cnn", net, batch, layers,
               batch_size, None,
               "CNN 32x32x3, 3x(conv3x3+GroupNorm+ReLU) 32/64/128, pool, 10")


# -- transformer LM ----------------------------------------------------------

def sinusoid(t: int, d: int) -> np.ndarray:
  pos = np.arange(t)[:, None]
  freq = np.exp(-np.log(10000.0) * np.arange(0, d, 2) / d)[None]
  out = np.zeros((t, d), np.float32)
  out[:, 0::2] = np.sin(pos * freq)
  out[:, 1::2] = np.cos(pos * freq)
  return out


TIED_FORMS = ("auto", "unembed", "raw")


def make_lm(batch_size: int = 8, seq_len: int = 128, layers: int = 4,
            d_model: int = 256, heads: int = 4, vocab: int = 512,
            seed: int = 0, tied: str = "auto") -> Bench:
  key_size = d_model // heads
  unembed = getattr(gram_haiku, "unembed", None)
  if tied not in TIED_FORMS:
    raise ValueError(f"tied={tied!r}: expected one of {TIED_FORMS}.")
  if tied == "unembed" and unembed is None:
    raise ValueError("tied='unembed': this gram_haiku has no unembed().")
  if tied == "raw":
    unembed = None
  init = hk.initializers.VarianceScaling(2.0 / layers)

  def net(tokens, targets):
    t = tokens.shape[-1]
    embed = hk.Embed(vocab, d_model, name="embed")
    h = embed(tokens) + sinusoid(t, d_model)
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    for i in range(layers):
      a = hk.LayerNorm(-1, True, True, name=f"ln_attn_{i}")(h)
      h = h + hk.MultiHeadAttention(heads, key_size, w_init=init,
                                    name=f"attn_{i}")(a, a, a, mask=mask)
      a = hk.LayerNorm(-1, True, True, name=f"ln_mlp_{i}")(h)
      a = jax.nn.gelu(hk.Linear(4 * d_model, w_init=init,
                                name=f"mlp_in_{i}")(a))
      h = h + hk.Linear(d_model, w_init=init, name=f"mlp_out_{i}")(a)
    h = hk.LayerNorm(-1, True, True, name="ln_final")(h)
    if unembed is not None:
      logits = unembed(embed, h)  # h @ embed.embeddings.T, tracked
    else:
      logits = h @ embed.embeddings.T  # tied embedding
    return xent(logits, targets).sum(axis=-1)

  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch_size, seq_len + 1)).astype(np.int32)
  t, d = seq_len, d_model
  spec = []
  for _ in range(layers):
    spec += [analytic.Layer("norm", t, d, d)]
    spec += [analytic.Layer("linear", t, d, d, bias=True)] * 4
    spec += [analytic.Layer("attention", t, d, heads)]
    spec += [analytic.Layer("norm", t, d, d),
             analytic.Layer("linear", t, d, 4 * d, bias=True),
             analytic.Layer("linear", t, 4 * d, d, bias=True)]
  spec += [analytic.Layer("norm", t, d, d),
           analytic.Layer("tied_embed", t, d, vocab)]
  return Bench("lm", net, (jnp.asarray(tokens[:, :-1]),
                           jnp.asarray(tokens[:, 1:])), spec, batch_size,
               seq_len, f"Transformer LM {layers}x d={d_model}, T={seq_len}, "
               f"vocab {vocab}, tied embedding "
               f"({'gram_haiku.unembed' if unembed else 'raw h @ E.T'})")


# -- LSTM --------------------------------------------------------------------

def make_lstm(batch_size: int = 64, seq_len: int = 32, features: int = 32,
              hidden: int = 128, classes: int = 10, seed: int = 0) -> Bench:
  def net(x, y):
    core = hk.LSTM(hidden)
    state = core.initial_state(x.shape[0])
    outs, _ = hk.dynamic_unroll(core, x, state, time_major=False)
    return xent(hk.Linear(classes)(outs[:, -1]), y)

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, seq_len, features), np.float32)
  y = rng.integers(0, classes, (batch_size,)).astype(np.int32)
  spec = [analytic.Layer("linear", seq_len, features + hidden, 4 * hidden,
                         bias=True),
          analytic.Layer("linear", 1, hidden, classes, bias=True)]
  return Bench("lstm", net, (jnp.asarray(x), jnp.asarray(y)), spec,
               batch_size, seq_len,
               f"LSTM {hidden} under hk.dynamic_unroll, T={seq_len}, "
               f"{features} features")


# -- small models ------------------------------------------------------------

def make_tiny_mlp(batch_size: int = 32, seed: int = 0) -> Bench:
  b = make_mlp(batch_size, hidden=(32,), input_dim=64, seed=seed)
  return dataclasses.replace(b, name="tiny_mlp")


def make_small_cnn(batch_size: int = 32, image: int = 8, classes: int = 10,
                   seed: int = 0) -> Bench:
  blocks = ((8, 1), (16, 2))

  def net(x, y):
    h = x
    for channels, stride in blocks:
      h = jax.nn.relu(hk.Conv2D(channels, 3, stride=stride)(h))
    return xent(hk.Linear(classes)(h.mean(axis=(1, 2))), y)

  batch, layers = _conv_problem(batch_size, image, 1, classes, blocks, seed,
                                norms=False)
  return Bench("small_cnn", net, batch, layers,
               batch_size, None,
               f"CNN {image}x{image}x1, conv3x3 8, conv3x3/2 16, pool, 10")


def make_attn64(batch_size: int = 16, seq_len: int = 16, d_model: int = 64,
                heads: int = 4, classes: int = 10, seed: int = 0) -> Bench:
  def net(x, y):
    a = hk.LayerNorm(-1, True, True, name="ln_attn")(x)
    h = x + hk.MultiHeadAttention(
        heads, d_model // heads,
        w_init=hk.initializers.VarianceScaling(1.0), name="attn")(a, a, a)
    a = hk.LayerNorm(-1, True, True, name="ln_mlp")(h)
    a = jax.nn.gelu(hk.Linear(4 * d_model, name="mlp_in")(a))
    h = h + hk.Linear(d_model, name="mlp_out")(a)
    return xent(hk.Linear(classes, name="head")(h.mean(axis=1)), y)

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, seq_len, d_model), np.float32)
  y = rng.integers(0, classes, (batch_size,)).astype(np.int32)
  t, d = seq_len, d_model
  spec = [analytic.Layer("norm", t, d, d)]
  spec += [analytic.Layer("linear", t, d, d, bias=True)] * 4
  spec += [analytic.Layer("attention", t, d, heads),
           analytic.Layer("norm", t, d, d),
           analytic.Layer("linear", t, d, 4 * d, bias=True),
           analytic.Layer("linear", t, 4 * d, d, bias=True),
           analytic.Layer("linear", 1, d, classes, bias=True)]
  return Bench("attn64", net, (jnp.asarray(x), jnp.asarray(y)), spec,
               batch_size, seq_len,
               f"Transformer block d={d_model}, {heads} heads, T={seq_len}")


def make(name: str, batch_size: Optional[int] = None,
         seq_len: Optional[int] = None,
         hidden: Optional[Sequence[int]] = None, tied: str = "auto") -> Bench:
  """Builds model ``name``; None keeps each model's default size."""
  kwargs = {}
  if batch_size is not None:
    kwargs["batch_size"] = batch_size
  if name == "mlp":
    if hidden is not None:
      kwargs["hidden"] = tuple(hidden)
    return make_mlp(**kwargs)
  if name == "cnn":
    return make_cnn(**kwargs)
  if seq_len is not None:
    kwargs["seq_len"] = seq_len
  if name == "lm":
    return make_lm(tied=tied, **kwargs)
  if name == "lstm":
    return make_lstm(**kwargs)
  kwargs.pop("seq_len", None)
  small = {"tiny_mlp": make_tiny_mlp, "small_cnn": make_small_cnn,
           "attn64": make_attn64}
  if name in small:
    return small[name](**kwargs)
  raise ValueError(f"Unknown model {name!r}; expected one of {MODEL_NAMES}.")


# -- realistic models (the ``real`` suite, :mod:`benchmarks.realistic`) -------
#
# Sized by keyword so that one builder serves the full size (a TPU), a
# CPU-scaled size and the test suite's smoke size.

REAL_MODEL_NAMES = ("wrn", "vit", "gpt")


def standardise(w: jax.Array, eps: float = 1e-4) -> jax.Array:
  """Weight standardisation of a kernel ``[..., C_in, C_out]``: zero mean
  and unit variance over everything but the output channel
  (:func:`gram_haiku.standardise_weight`, whose mark lets the pass read
  the layer's norms and Gram in closed form)."""
  return gram_haiku.standardise_weight(w, eps)


def _ws_getter(next_getter, value, context):
  """A custom getter standardising every convolution kernel (rank 4)."""
  value = next_getter(value)
  if context.name == "w" and value.ndim == 4:
    return standardise(value)
  return value


def make_wrn(batch_size: int = 256, depth: int = 16, width: int = 4,
             base: int = 16, image: int = 32, groups: int = 16,
             classes: int = 10, weight_standardisation: bool = True,
             seed: int = 0) -> Bench:
  """A pre-activation wide ResNet ``WRN-depth-width`` with GroupNorm (and
  weight standardisation of every convolution kernel by a custom getter),
  as in DP image classification (De et al. 2022): a 3x3 stem of ``base``
  channels, three groups of ``(depth - 4) / 6`` blocks of ``base * width
  * (1, 2, 4)`` channels (strides 1, 2, 2; a 1x1 projection where the
  shape changes), GroupNorm + ReLU, mean pool, ``hk.Linear(classes)``."""
  if (depth - 4) % 6:
    raise ValueError(f"depth={depth}: expected 6 n + 4.")
  per_group = (depth - 4) // 6
  stages = [(base * width, 1), (2 * base * width, 2), (4 * base * width, 2)]

  def net(x, y):
    ctx = (hk.custom_getter(_ws_getter) if weight_standardisation
           else contextlib.nullcontext())
    with ctx:
      h = hk.Conv2D(base, 3, name="stem")(x)
      for g, (channels, stride) in enumerate(stages):
        for b in range(per_group):
          s = stride if b == 0 else 1
          name = f"g{g}_b{b}"
          a = jax.nn.relu(hk.GroupNorm(groups, name=f"{name}_norm1")(h))
          shortcut = h
          if s != 1 or h.shape[-1] != channels:
            shortcut = hk.Conv2D(channels, 1, stride=s,
                                 name=f"{name}_proj")(a)
          a = hk.Conv2D(channels, 3, stride=s, name=f"{name}_conv1")(a)
          a = jax.nn.relu(hk.GroupNorm(groups, name=f"{name}_norm2")(a))
          h = shortcut + hk.Conv2D(channels, 3, name=f"{name}_conv2")(a)
      h = jax.nn.relu(hk.GroupNorm(groups, name="final_norm")(h))
      return xent(hk.Linear(classes, name="head")(h.mean(axis=(1, 2))), y)

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, image, image, 3), np.float32)
  y = rng.integers(0, classes, (batch_size,)).astype(np.int32)
  ws = ", weight standardisation" if weight_standardisation else ""
  return Bench("wrn", net, (jnp.asarray(x), jnp.asarray(y)), [], batch_size,
               None, f"WRN-{depth}-{width} (base {base}), GroupNorm({groups})"
               f"{ws}, {image}x{image}x3, {classes} classes")


def _block(h, i: int, heads: int, mlp: int, mask=None, init=None):
  """A pre-LayerNorm transformer block (attention, then a GELU MLP)."""
  d = h.shape[-1]
  a = hk.LayerNorm(-1, True, True, name=f"ln_attn_{i}")(h)
  h = h + hk.MultiHeadAttention(
      heads, d // heads, w_init=init or hk.initializers.VarianceScaling(1.0),
      name=f"attn_{i}")(a, a, a, mask=mask)
  a = hk.LayerNorm(-1, True, True, name=f"ln_mlp_{i}")(h)
  a = jax.nn.gelu(hk.Linear(mlp, w_init=init, name=f"mlp_in_{i}")(a))
  return h + hk.Linear(d, w_init=init, name=f"mlp_out_{i}")(a)


#: Learned CLS token and positions: small random values (zeros would make
#: the first block's attention scores constant at initialisation).
_POSITION_INIT = hk.initializers.RandomNormal(0.02)


def make_vit(batch_size: int = 128, d_model: int = 384, layers: int = 6,
             heads: int = 6, patch: int = 4, image: int = 32,
             classes: int = 10, seed: int = 0) -> Bench:
  """A ViT encoder on ``image x image x 3``: ``patch x patch`` patches
  embedded by ``hk.Linear(d)``, a learned CLS token and learned positions
  (``hk.Bias`` over the token and position axes), pre-LN blocks with an MLP
  of ``4 d``, LayerNorm of the CLS token, ``hk.Linear(classes)``."""
  side = image // patch
  tokens = side * side + 1

  def net(x, y):
    b = x.shape[0]
    p = x.reshape(b, side, patch, side, patch, 3).transpose(0, 1, 3, 2, 4, 5)
    h = hk.Linear(d_model, name="patch_embed")(
        p.reshape(b, side * side, patch * patch * 3))
    cls = hk.Bias(bias_dims=[-2, -1], b_init=_POSITION_INIT, name="cls")(
        jnp.zeros((b, 1, d_model), h.dtype))
    h = hk.Bias(bias_dims=[-2, -1], b_init=_POSITION_INIT, name="positions")(
        jnp.concatenate([cls, h], axis=1))
    for i in range(layers):
      h = _block(h, i, heads, 4 * d_model)
    h = hk.LayerNorm(-1, True, True, name="ln_final")(h[:, 0])
    return xent(hk.Linear(classes, name="head")(h), y)

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, image, image, 3), np.float32)
  y = rng.integers(0, classes, (batch_size,)).astype(np.int32)
  return Bench("vit", net, (jnp.asarray(x), jnp.asarray(y)), [], batch_size,
               tokens, f"ViT/{patch} d={d_model}, {layers} layers, {heads} "
               f"heads, {tokens} tokens, {image}x{image}x3, {classes} classes")


def make_gpt(batch_size: int = 16, seq_len: int = 256, d_model: int = 768,
             layers: int = 6, heads: int = 12, vocab: int = 32000,
             seed: int = 0) -> Bench:
  """A GPT-2-style decoder: token embedding tied with the output layer
  (``gram_haiku.unembed``), learned positions (``hk.Bias`` over the
  position and feature axes), causal pre-LN blocks with an MLP of ``4 d``,
  a final LayerNorm; next-token cross-entropy summed over positions."""
  init = hk.initializers.VarianceScaling(2.0 / layers)

  def net(tokens, targets):
    t = tokens.shape[-1]
    embed = hk.Embed(vocab, d_model, name="embed")
    h = hk.Bias(bias_dims=[-2, -1], b_init=_POSITION_INIT,
                name="positions")(embed(tokens))
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    for i in range(layers):
      h = _block(h, i, heads, 4 * d_model, mask=mask, init=init)
    h = hk.LayerNorm(-1, True, True, name="ln_final")(h)
    return xent(gram_haiku.unembed(embed, h), targets).sum(axis=-1)

  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch_size, seq_len + 1)).astype(np.int32)
  return Bench("gpt", net, (jnp.asarray(tokens[:, :-1]),
                            jnp.asarray(tokens[:, 1:])), [], batch_size,
               seq_len, f"GPT-2-style decoder d={d_model}, {layers} layers, "
               f"{heads} heads, T={seq_len}, vocab {vocab}, tied embedding, "
               "learned positions")


def make_real(name: str, **kwargs) -> Bench:
  """Builds realistic model ``name`` (:data:`REAL_MODEL_NAMES`)."""
  makers = {"wrn": make_wrn, "vit": make_vit, "gpt": make_gpt}
  if name not in makers:
    raise ValueError(f"Unknown model {name!r}; expected one of "
                     f"{REAL_MODEL_NAMES}.")
  return makers[name](**kwargs)
