"""Bare weights against ``hk.Linear``: one model written twice.

``python -m benchmarks.bare_weights``: an MLP and a small transformer LM,
each with its projections as ``hk.Linear`` and as bare
``hk.get_parameter`` weights used by ``x @ W`` / ``jnp.einsum`` (the same
shapes, initialisers and arithmetic), timed by
:func:`benchmarks.harness.time_steps` for the methods ``plain`` (a plain
``jax.value_and_grad``), ``gram`` and ``dp_all``
(:mod:`benchmarks.jax_methods`), each as a ratio to its model's plain
step (the median of the rounds' ratios, interleaved). A bare weight is
covered by the program-level rules
(:mod:`gram_haiku._src.analysis.program_rules`); the table says what it
costs against the tracked layer. Sizes are a CPU's (``--scale``).
"""

from __future__ import annotations

import argparse
import json

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku import functional as gf

from benchmarks import dp_methods
from benchmarks import harness
from benchmarks import jax_methods
from benchmarks.models import Bench
from benchmarks.models import sinusoid
from benchmarks.models import xent

METHODS = ("plain", "gram", "dp_all")


def _dense(x, n_out: int, name: str, bare: bool, einsum: str = "...d,de->...e"):
  """``x @ W + b``: ``hk.Linear``, or bare parameters of the same names'
  shapes and initialisers (``einsum``: how the product is written)."""
  if not bare:
    return hk.Linear(n_out, name=name)(x)
  n_in = x.shape[-1]
  w = hk.get_parameter(f"{name}_w", [n_in, n_out], x.dtype,
                       init=hk.initializers.TruncatedNormal(
                           1.0 / np.sqrt(n_in)))
  b = hk.get_parameter(f"{name}_b", [n_out], x.dtype, init=jnp.zeros)
  return jnp.einsum(einsum, x, w) + b


def make_mlp(bare: bool, batch_size: int = 64, sizes=(256, 256, 256, 10),
             seed: int = 0) -> Bench:
  """An MLP ``sizes[0]-...-sizes[-1]`` with ReLU; bare: ``x @ W + b``."""
  def net(x, y):
    h = x
    for i, n in enumerate(sizes[1:]):
      h = _dense(h, n, f"linear_{i}", bare)
      if i < len(sizes) - 2:
        h = jax.nn.relu(h)
    return xent(h, y)

  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, sizes[0]), np.float32)
  y = rng.integers(0, sizes[-1], (batch_size,)).astype(np.int32)
  return Bench("mlp_bare" if bare else "mlp", net,
               (jnp.asarray(x), jnp.asarray(y)), [], batch_size, None,
               "MLP " + "-".join(map(str, sizes)))


def make_lm(bare: bool, batch_size: int = 4, seq_len: int = 32,
            layers: int = 2, d_model: int = 128, heads: int = 4,
            vocab: int = 256, seed: int = 0) -> Bench:
  """A pre-LayerNorm causal LM (the benchmark LM's shape, smaller): its
  attention's q, k, v, o and MLP projections ``hk.Linear``, or bare
  weights by ``jnp.einsum("btd,de->bte")``; embedding, LayerNorms and the
  tied output (``gram_haiku.unembed``) tracked in both."""
  dk = d_model // heads
  einsum = "btd,de->bte"

  def attention(a, i, mask):
    t = a.shape[1]
    q, k, v = (_dense(a, d_model, f"attn_{i}_{n}", bare, einsum).reshape(
        -1, t, heads, dk) for n in "qkv")
    s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(dk)
    p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
    o = jnp.einsum("bhts,bshd->bthd", p, v).reshape(-1, t, d_model)
    return _dense(o, d_model, f"attn_{i}_o", bare, einsum)

  def net(tokens, targets):
    t = tokens.shape[-1]
    embed = hk.Embed(vocab, d_model, name="embed")
    h = embed(tokens) + sinusoid(t, d_model)
    mask = jnp.tril(jnp.ones((t, t), bool))[None, None]
    for i in range(layers):
      a = hk.LayerNorm(-1, True, True, name=f"ln_attn_{i}")(h)
      h = h + attention(a, i, mask)
      a = hk.LayerNorm(-1, True, True, name=f"ln_mlp_{i}")(h)
      a = jax.nn.gelu(_dense(a, 4 * d_model, f"mlp_in_{i}", bare, einsum))
      h = h + _dense(a, d_model, f"mlp_out_{i}", bare, einsum)
    h = hk.LayerNorm(-1, True, True, name="ln_final")(h)
    return xent(gram_haiku.unembed(embed, h), targets).sum(axis=-1)

  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (batch_size, seq_len + 1)).astype(np.int32)
  return Bench("lm_bare" if bare else "lm", net,
               (jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])),
               [], batch_size, seq_len,
               f"LM {layers}x d={d_model}, T={seq_len}, vocab {vocab}")


def _build(prep, method: str):
  """:func:`jax_methods.build`'s ``(step, args)``; a model with no tracked
  layer at all (every weight bare) through :mod:`gram_haiku.functional`
  on its plain ``apply`` (``track()`` needs one tracked layer)."""
  state = prep.states["gram"]
  if method == "plain" or not (isinstance(state, BaseException) or not any(
      gram_haiku.PROBE_NAME in v for v in state.values())):
    return jax_methods.build(prep, method)
  loss = prep.plain.apply
  if method == "gram":
    vgg = gf.value_grad_and_gram(loss)

    def step(params, state, *batch):
      del state
      value, grads, grams = vgg(params, *batch)
      return value, grads, grams.total
  else:
    clipped = gf.clipped_grad(loss, l2_clip_norm=dp_methods.CLIP)

    def step(params, state, *batch):
      del state
      return clipped(params, *batch)
  return step, (prep.params, {}, *prep.bench.batch)


def run(rounds: int = 5, repeats: int = 3) -> dict:
  """``{model: {method: record}}`` (:func:`harness.time_steps`'s)."""
  out = {}
  for bench in (make_mlp(False), make_mlp(True), make_lm(False),
                make_lm(True)):
    prep = jax_methods.prepare(bench)
    steps, compiled = {}, {}
    for method in METHODS:
      compiled[method] = harness.compile_jax(*_build(prep, method))
      steps[method] = compiled[method].run
    out[bench.name] = harness.time_steps(
        steps, {m: "plain" for m in METHODS if m != "plain"},
        repeats=repeats, rounds=rounds)
    for method, c in compiled.items():
      out[bench.name][method].update(flops=c.flops, temp_bytes=c.temp_bytes)
  return out


def table(results: dict) -> str:
  """A Markdown table: per model, the plain step's wall ms, GFLOP and
  temporary MB, and each method's ratio to plain in each (wall: the
  median of the rounds' ratios; GFLOP and memory: XLA's
  ``cost_analysis`` and ``memory_analysis`` of the compiled step)."""
  rows = ["| model | plain ms / GFLOP / temp MB | " + " | ".join(
      f"{m}: wall / FLOP / temp" for m in METHODS[1:]) + " |",
          "|---|---|" + "---|" * (len(METHODS) - 1)]
  for name, rec in results.items():
    p = rec["plain"]
    ratio = lambda m, k: (f"{rec[m][k] / p[k]:.2f}x" if rec[m][k] and p[k]
                          else "-")
    rows.append(
        f"| {name} | {p['median_s'] * 1e3:.2f} / {p['flops'] / 1e9:.3f} / "
        f"{p['temp_bytes'] / 2**20:.1f} | " + " | ".join(
            f"{rec[m]['ratio']:.2f}x / {ratio(m, 'flops')} / "
            f"{ratio(m, 'temp_bytes')}" for m in METHODS[1:]) + " |")
  return "\n".join(rows)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json", default=None, help="write the records here")
  a = p.parse_args()
  results = run(a.rounds, a.repeats)
  print(table(results))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
