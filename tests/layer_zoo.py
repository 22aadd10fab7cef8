"""Every tracked layer and composite model, in four batching styles.

Each entry is a per-example Haiku function ``f(x_i) -> out`` plus how to draw
an example. A style says how the batch is written:

* ``explicit``: the same function on the batch ``(B, ...)`` (Haiku's usual
  style; the modules see a leading batch axis);
* ``vmap1``: ``hk.vmap`` over examples of ``f``;
* ``vmap2``: ``hk.vmap`` over examples of ``hk.vmap`` over an extra
  within-example axis ``K`` of ``f`` (the per-example loss sums over ``K``);
* ``eager``: ``explicit`` without ``jax.jit`` (op-by-op dispatch).

Every style but ``eager`` runs under ``jax.jit`` (one compilation per case
rather than one per primitive).

The reference for each style is ``F @ F.T`` from ``vmap(grad)`` of that
style's own untracked function on batches of one, so every style is compared
with the model it actually runs. Run ``python -m tests.layer_zoo`` to print
the table of max relative errors (layer x style).
"""

from __future__ import annotations

import dataclasses
from typing import Callable
import zlib

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np

import gram_haiku
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import relative_error as rel_err
from tests import problems

B, K = 4, 2
STYLES = ("explicit", "vmap1", "vmap2", "eager")


@dataclasses.dataclass(frozen=True)
class Entry:
  """A layer or model: ``fn`` maps a batch (or one example) to outputs."""
  name: str
  fn: Callable[[jax.Array], jax.Array]
  example_shape: tuple[int, ...]
  ids: int = 0  # > 0: integer inputs in [0, ids)
  explicit_ok: bool = True  # fn accepts a leading batch axis
  styles: tuple[str, ...] = STYLES


def _conv(n, **kw):
  return lambda x: hk.ConvND(n, 3, 2, **kw)(x)


def _unbatched_ok(module_fn):
  """Modules whose convolution needs a batch axis (hk.DepthwiseConv*D):
  one example gets one added and removed (under hk.vmap)."""
  def fn(x, n=2):
    if x.ndim == n + 1:
      return module_fn()(x[None])[0]
    return module_fn()(x)
  return fn


def _transformer_block(x):
  # x: (T, D) per example, or (B, T, D).
  t, d = x.shape[-2], x.shape[-1]
  h = hk.LayerNorm(-1, True, True)(x)
  mask = jnp.tril(jnp.ones((t, t), bool))[(None,) * (x.ndim - 1)]
  h = x + hk.MultiHeadAttention(num_heads=2, key_size=4, model_size=d,
                                w_init=hk.initializers.VarianceScaling(1.0))(
                                    h, h, h, mask=mask)
  m = hk.RMSNorm(-1)(h)
  return h + hk.nets.MLP([2 * d, d], activation=jax.nn.gelu)(m)


def _lm(ids):
  embed = hk.Embed(13, 8)
  # Position ids built from `ids` so that they carry its example axis (a
  # tracked layer's input must; jnp.arange(T) or jnp.zeros_like(ids),
  # which do not depend on ids, would not).
  positions = ids * 0 + jnp.arange(ids.shape[-1])
  h = embed(ids) + hk.Embed(ids.shape[-1], 8, name="pos_embed")(positions)
  h = _transformer_block(h)
  h = hk.LayerNorm(-1, True, True)(h)
  return gram_haiku.unembed(embed, h)


def _resnet(x):  # (H, W, C) or (B, H, W, C)
  h = hk.Conv2D(4, 3)(x)
  for i in range(2):
    r = hk.GroupNorm(2)(h)
    r = hk.Conv2D(4, 3, name=f"block{i}_conv")(jax.nn.relu(r))
    h = h + hk.LayerNorm((-3, -2, -1), True, True)(r)
  h = jnp.mean(h, axis=(-3, -2))
  return hk.Linear(3)(h)


def _rnn(core_fn, unroll):
  def f(x):  # (T, F) or (B, T, F)
    core = core_fn()
    batched = x.ndim == 3
    xs = jnp.swapaxes(x, 0, 1) if batched else x
    state = core.initial_state(x.shape[0] if batched else None)
    out, _ = unroll(core, xs, state)
    return jnp.swapaxes(out, 0, 1) if batched else out
  return f


def _layer_stack(x):
  stack = hk.layer_stack(3)(lambda h: jnp.tanh(hk.Linear(5)(h)))
  return stack(x)


POLICY = jmp.get_policy("params=float32,compute=bfloat16,output=float32")


def _mixed_precision(order):
  """An MLP under a bf16-compute policy; ``order`` says whether the policy
  is set before ``track()`` is entered or inside it."""
  def f(x):
    hk.mixed_precision.set_policy(hk.Linear, POLICY)
    try:
      return hk.nets.MLP([6, 3])(x)
    finally:
      hk.mixed_precision.clear_policy(hk.Linear)
  f.order = order
  return f


def _batch_norm_eval(x):
  # Training mode only at init, to create the moving averages (as a user
  # would); evaluation mode (an affine layer) whenever it is differentiated.
  bn = hk.BatchNorm(True, True, 0.9, eps=1.0)
  return bn(x, is_training=hk.running_init())


ENTRIES = [
    Entry("Linear", lambda x: hk.Linear(3)(x), (3, 5)),
    Entry("MLP", lambda x: hk.nets.MLP([6, 3])(x), (3, 5)),
    Entry("Conv1D", _conv(1, stride=2), (7, 3)),
    Entry("Conv2D", _conv(2, stride=1, padding="VALID"), (5, 5, 2)),
    Entry("Conv2D-grouped-dilated",
          lambda x: hk.Conv2D(4, 3, rate=2, feature_group_count=2)(x),
          (6, 6, 2)),
    Entry("Conv3D", _conv(3, stride=1), (4, 4, 3, 2)),
    Entry("Conv2DTranspose", lambda x: hk.Conv2DTranspose(3, 3, stride=2)(x),
          (3, 3, 2)),
    Entry("DepthwiseConv2D", _unbatched_ok(
        lambda: hk.DepthwiseConv2D(2, 3, stride=2)), (5, 5, 3)),
    Entry("SeparableDepthwiseConv2D", _unbatched_ok(
        lambda: hk.SeparableDepthwiseConv2D(4, 3, 2, padding="VALID")),
          (5, 5, 3)),
    Entry("Embed", lambda ids: hk.Embed(9, 4)(ids), (5,), ids=9),
    Entry("Embed-one-hot",
          lambda ids: hk.Embed(9, 4, lookup_style="ONE_HOT")(ids), (5,),
          ids=9),
    Entry("LayerNorm", lambda x: hk.LayerNorm(-1, True, True)(x), (3, 5)),
    Entry("RMSNorm", lambda x: hk.RMSNorm(-1)(x), (3, 5)),
    Entry("Bias", lambda x: hk.Bias()(x), (3, 5)),
    Entry("GroupNorm", lambda x: hk.GroupNorm(2)(x), (3, 3, 4)),
    Entry("InstanceNorm", lambda x: hk.InstanceNorm(True, True)(x), (3, 3, 4)),
    Entry("BatchNorm-eval", _batch_norm_eval, (3, 5),
          styles=("explicit", "eager")),  # init updates state: no hk.vmap
    Entry("GRU-dynamic", _rnn(lambda: hk.GRU(4), hk.dynamic_unroll), (4, 3)),
    Entry("GRU-static", _rnn(lambda: hk.GRU(4), hk.static_unroll), (4, 3)),
    Entry("LSTM-dynamic", _rnn(lambda: hk.LSTM(4), hk.dynamic_unroll),
          (4, 3)),
    Entry("LSTM-static", _rnn(lambda: hk.LSTM(4), hk.static_unroll), (4, 3)),
    Entry("layer_stack", _layer_stack, (3, 5)),
    Entry("transformer-block", _transformer_block, (5, 8)),
    Entry("tied-LM", _lm, (6,), ids=13),
    Entry("ResNet-GroupNorm", _resnet, (6, 6, 3)),
    Entry("mixed-precision-policy-first", _mixed_precision("policy_first"),
          (3, 5)),
    Entry("mixed-precision-track-first", _mixed_precision("track_first"),
          (3, 5)),
]

BY_NAME = {e.name: e for e in ENTRIES}


def seed_of(name: str) -> int:
  """A seed per entry name, the same in every process (``hash`` of a str is
  salted per process)."""
  return zlib.crc32(name.encode()) % 1000


def _draw(entry: Entry, lead, seed):
  key = jax.random.PRNGKey(seed)
  shape = tuple(lead) + entry.example_shape
  if entry.ids:
    ids = problems.randint(key, shape, 0, entry.ids)
    return ids.at[..., 1].set(ids[..., 0])  # a repeated id per example
  return problems.normal(key, shape)


def _styled(entry: Entry, style: str):
  """The batch function of ``style`` and the batch's leading shape."""
  if style in ("explicit", "eager"):
    return entry.fn, (B,)
  if style == "vmap1":
    return hk.vmap(entry.fn, split_rng=False), (B,)
  inner = hk.vmap(entry.fn, split_rng=False)
  return hk.vmap(inner, split_rng=False), (B, K)


def _tracked(fn, entry, **track_kw):
  def loss(x):
    if getattr(entry.fn, "order", None) == "policy_first":
      hk.mixed_precision.set_policy(hk.Linear, POLICY)
    try:
      with gram_haiku.track(untracked="error", **track_kw):
        return _tail(fn(x))
    finally:
      hk.mixed_precision.clear_policy(hk.Linear)
  return loss


def is_low_precision(entry: Entry) -> bool:
  return hasattr(entry.fn, "order")


def _tail(out):
  return 0.5 * jnp.sum(jnp.tanh(out.astype(jnp.float32)) ** 2)


def run(entry: Entry, style: str, seed=0, **track_kw):
  """``(grams, reference, value, plain value, grads, plain grads)``;
  ``track_kw``: options of the model's ``gram_haiku.track()``."""
  fn, lead = _styled(entry, style)
  x = _draw(entry, lead, seed)
  tracked = hk.transform_with_state(_tracked(fn, entry, **track_kw))
  plain = hk.transform_with_state(lambda x: _tail(fn(x)))
  # Both inits in one program.
  (params, state), (_, plain_state) = jax.jit(lambda k, x: (
      tracked.init(k, x), plain.init(k, x)))(jax.random.PRNGKey(1), x)
  plain_loss = lambda p, x: plain.apply(p, plain_state, None, x)[0]
  vgg = gram_haiku.value_grad_and_gram(tracked.apply)
  if style == "eager":
    value, grads, grams = vgg(params, state, None, x)
    ref = reference_gram(plain_loss, params, x)
    plain_value, plain_grads = jax.value_and_grad(plain_loss)(params, x)
    return grams, ref, value, plain_value, grads, plain_grads
  value, grads, grams = jax.jit(vgg)(params, state, None, x)
  # The untracked model's loss, gradient and per-example gradients ``F``
  # in one program; the reference ``F @ F.T`` as reference_gram forms it.
  plain_value, plain_grads, flat = jax.jit(lambda p, x: (
      *jax.value_and_grad(plain_loss)(p, x),
      per_example_grads(plain_loss, p, x)))(params, x)
  flat = np.asarray(flat, np.float64)
  return grams, flat @ flat.T, value, plain_value, grads, plain_grads


def table(seed=0) -> str:
  rows = [("layer",) + STYLES]
  for entry in ENTRIES:
    cells = []
    for style in STYLES:
      if style not in entry.styles:
        cells.append("n/a")
        continue
      grams, ref, *_ = run(entry, style, seed)
      cells.append(f"{rel_err(grams.total, ref):.1e}")
    rows.append((entry.name, *cells))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join("| " + " | ".join(v.ljust(w) for v, w in zip(r, widths))
                   + " |" for r in rows)


if __name__ == "__main__":
  print(table())
