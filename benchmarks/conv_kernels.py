"""Per-example convolution gradients by several kernels, per layer.

``python -m benchmarks.conv_kernels``

For each convolution of the benchmarks' CNN (``models.CNN_BLOCKS`` on
32x32x3 images, ``B = 64``), the per-example kernel gradients and their
Gram ``F F^T``, formed several ways, against the layer's plain backward pass
(input and kernel gradients of the summed loss):

* ``patches``: the library's path, :func:`gram_haiku._src.ops.conv.im2col`
  patches (tap-major) and one batched product over positions;
* ``taps``: one batched product per kernel tap, on that tap's strided
  slice of the padded input, stacked;
* ``vmap``: ``jax.vmap`` over examples of the kernel's VJP, which JAX
  lowers to one convolution with the examples as feature groups;
* ``patches_t``: the patches and cotangents transposed first, so that the
  positions are the minor axis of both operands of the product;
* ``patches_cm``: the input transposed once to channels-first, its tap
  slices concatenated along the channels, so that the patches come out
  ``[B, (k, c), T]`` with the positions minor (one transpose of the input
  instead of one of the ``|K|`` times larger patches);
* ``phases``: the patches from unit-stride slices: each spatial axis of
  the padded input split as ``(L / s, s)`` with the phase axes moved
  ahead (one transpose of the input), so that a tap starting at
  ``s q + r`` is phase ``r`` from ``q`` on. A strided slice along a
  TPU's sublanes is a gather; these are not.
* ``blocked``: ``patches`` a block of examples at a time in a
  ``lax.map`` (``cost_model.patch_block``: no more patches at once than
  the layer's input), what the library does where the whole batch's
  patches exceed its memory budget;
* ``pallas``: the library's Pallas kernel
  (:mod:`gram_haiku._src.compute.pallas_conv`; interpret mode off a TPU)
  in its default layout; ``pallas_in`` with the window's column offset
  taken ahead of the kernel, ``pallas_d`` and ``pallas_s`` with the other
  two forms of its products (``pallas_conv.FORMS``).

``--model wrn`` measures the 3x3 convolutions of a WRN-16-4 on 32x32
images instead of the CNN's; ``--out DIR`` writes ``conv_kernels.json``.

Each is checked against the per-tap kernel at ``HIGHEST`` precision (the
Gram to ``--rtol``) before it is timed. Times are device time a step (:mod:`benchmarks.device_time`: ``k``
steps in one program, the dispatch amortised), so the figures mean
something on an accelerator, where one layer's work is shorter than a
dispatch; on a CPU, use the wall-clock protocol of ``python -m
benchmarks``. The ratios are to the layer's plain backward.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import device_time
from benchmarks import models
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import pallas_conv
from gram_haiku._src.ops.conv import im2col

#: ``vmap`` last: on a TPU v5e its program at ``HIGHEST`` had not compiled
#: after 150 s, so the others are measured (and printed) first.
KERNELS = ("patches", "taps", "patches_t", "patches_cm", "phases",
           "blocked", "pallas", "pallas_in", "pallas_d", "pallas_s", "vmap")

#: ``(spatial size, in channels, out channels, stride)`` of the 3x3
#: convolutions of a WRN-16-4 (widths 16, 64, 128, 256) on 32x32 images
#: (the 1x1 shortcuts left out).
WRN_LAYERS = ((32, 3, 16, 1), (32, 16, 64, 1), (32, 64, 64, 1),
              (32, 64, 128, 2), (16, 128, 128, 1), (16, 128, 256, 2),
              (8, 256, 256, 1))
_DN = lax.ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))


def _conv(x, w, stride: int, precision):
  return lax.conv_general_dilated(x, w, (stride, stride), "SAME",
                                  dimension_numbers=_DN, precision=precision)


def _sum_and_gram(per, precision):
  """The summed kernel gradient and the Gram of ``per: [B, ...]``."""
  flat = per.reshape(per.shape[0], -1)
  return per.sum(0), jnp.matmul(flat, flat.T, precision=precision)


def _tap_slices(x, d, stride: int):
  """One strided slice of the padded input per 3x3 tap, shaped like ``d``
  but with ``x``'s channels."""
  pads = lax.padtype_to_pads(x.shape[1:3], (3, 3), (stride, stride), "SAME")
  xp = jnp.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
  ho, wo = d.shape[1], d.shape[2]
  return [lax.slice(xp, (0, a, b, 0),
                    (x.shape[0], a + (ho - 1) * stride + 1,
                     b + (wo - 1) * stride + 1, x.shape[3]),
                    (1, stride, stride, 1))
          for a, b in itertools.product(range(3), range(3))]


def _phase_patches(x, stride: int, ho: int, wo: int):
  """``[B, ho, wo, 9 C]`` 3x3 SAME patches, tap-major, by unit-stride
  slices of the input split into stride phases."""
  b, h, w, c = x.shape
  s = stride
  pads = lax.padtype_to_pads((h, w), (3, 3), (s, s), "SAME")
  hp = -(-(h + sum(pads[0])) // s) * s
  wp = -(-(w + sum(pads[1])) // s) * s
  xp = jnp.pad(x, ((0, 0), (pads[0][0], hp - h - pads[0][0]),
                   (pads[1][0], wp - w - pads[1][0]), (0, 0)))
  xr = xp.reshape(b, hp // s, s, wp // s, s, c).transpose(0, 2, 4, 1, 3, 5)
  taps = []
  for a, bb in itertools.product(range(3), range(3)):
    (qa, ra), (qb, rb) = divmod(a, s), divmod(bb, s)
    taps.append(xr[:, ra, rb, qa:qa + ho, qb:qb + wo, :])
  return jnp.concatenate(taps, axis=-1)


def _patches(x, d, stride: int):
  p = im2col(x, (3, 3), window_strides=(stride, stride), padding="SAME",
             lhs_dilation=(1, 1), rhs_dilation=(1, 1))
  return (p.reshape(p.shape[0], -1, p.shape[-1]),
          d.reshape(d.shape[0], -1, d.shape[-1]))


def per_example_step(kernel: str, stride: int, precision) -> Callable:
  """``step(w, x, d) -> (summed kernel gradient, Gram)`` by ``kernel``."""
  def patches(w, x, d):
    del w
    p, dd = _patches(x, d, stride)
    return _sum_and_gram(jnp.einsum("itn,itm->inm", p, dd,
                                    precision=precision), precision)

  def patches_t(w, x, d):
    del w
    p, dd = _patches(x, d, stride)
    return _sum_and_gram(jnp.einsum(
        "int,imt->inm", jnp.swapaxes(p, 1, 2), jnp.swapaxes(dd, 1, 2),
        precision=precision), precision)

  def patches_cm(w, x, d):
    del w
    xt = jnp.moveaxis(x, -1, 1)  # [B, C, H, W]
    pads = lax.padtype_to_pads(x.shape[1:3], (3, 3), (stride, stride),
                               "SAME")
    xp = jnp.pad(xt, ((0, 0), (0, 0), pads[0], pads[1]))
    ho, wo = d.shape[1], d.shape[2]
    p = jnp.concatenate(
        [lax.slice(xp, (0, 0, a, b),
                   (x.shape[0], x.shape[3], a + (ho - 1) * stride + 1,
                    b + (wo - 1) * stride + 1), (1, 1, stride, stride))
         for a, b in itertools.product(range(3), range(3))], axis=1)
    p = p.reshape(p.shape[0], p.shape[1], -1)  # [B, (k, c), T]
    dd = d.reshape(d.shape[0], -1, d.shape[-1])
    return _sum_and_gram(jnp.einsum("int,itm->inm", p, dd,
                                    precision=precision), precision)

  def phases(w, x, d):
    del w
    p = _phase_patches(x, stride, d.shape[1], d.shape[2])
    p = p.reshape(p.shape[0], -1, p.shape[-1])
    dd = d.reshape(d.shape[0], -1, d.shape[-1])
    return _sum_and_gram(jnp.einsum("itn,itm->inm", p, dd,
                                    precision=precision), precision)

  def taps(w, x, d):
    del w
    per = jnp.stack([jnp.einsum("ihwc,ihwo->ico", t, d, precision=precision)
                     for t in _tap_slices(x, d, stride)], axis=1)
    return _sum_and_gram(per, precision)

  def vmapped(w, x, d):
    def one(xi, di):
      return jax.vjp(lambda w: _conv(xi[None], w, stride, precision),
                     w)[1](di[None])[0]
    return _sum_and_gram(jax.vmap(one)(x, d), precision)

  def blocked(w, x, d):
    del w
    b = x.shape[0]
    block = cost_model.patch_block(b, 9 * x.size * 4 // stride**2,
                                   x.size * 4)

    def one(xd):
      p, dd = _patches(xd[0][None], xd[1][None], stride)
      return jnp.einsum("itn,itm->inm", p, dd, precision=precision)[0]
    return _sum_and_gram(lax.map(one, (x, d), batch_size=block), precision)

  def pallas(shift, form):
    def step(w, x, d):
      del w
      pads = lax.padtype_to_pads(x.shape[1:3], (3, 3), (stride, stride),
                                 "SAME")
      per = pallas_conv.per_example_conv_grads_pallas(
          x, d, (3, 3), strides=(stride, stride), padding=pads,
          precision=precision, shift=shift, form=form,
          interpret=jax.default_backend() != "tpu")
      return _sum_and_gram(per, precision)
    return step

  return {"patches": patches, "patches_t": patches_t,
          "patches_cm": patches_cm, "phases": phases, "taps": taps,
          "blocked": blocked,
          "pallas": pallas("kernel", pallas_conv.DEFAULT_FORM),
          "pallas_in": pallas("input", pallas_conv.DEFAULT_FORM),
          "pallas_d": pallas("kernel", "d_t"),
          "pallas_s": pallas("kernel", "d_t_stacked"),
          "vmap": vmapped}[kernel]


def _all_args(step: Callable) -> Callable:
  """``step`` on one tuple of its arguments, so that the runtime zero of
  :func:`device_time.looped` perturbs all of them: the per-example kernels
  do not read ``w``, and a loop-invariant step would be hoisted."""
  return lambda args: step(*args)


def plain_step(stride: int) -> Callable:
  """The layer's plain backward: gradients of ``x`` and ``w``."""
  def step(w, x, d):
    return jax.vjp(lambda x, w: _conv(x, w, stride, None), x, w)[1](d)
  return step


def layers(image: int = 32, channels: int = 3
           ) -> list[tuple[int, int, int, int]]:
  """``(spatial size, in channels, out channels, stride)`` of the CNN's
  convolutions."""
  out, size, cin = [], image, channels
  for cout, stride in models.CNN_BLOCKS:
    out.append((size, cin, cout, stride))
    size, cin = -(-size // stride), cout  # SAME: ceil(size / stride)
  return out


def measure(kernels: Sequence[str] = KERNELS, *, batch_size: int = 64,
            image: int = 32, precision: str = "highest", k: int = 20,
            reps: int = 3, calls: int = 7, rtol: float = 1e-3,
            seed: int = 0, model: str = "cnn",
            only: Sequence[int] = (), timer: str = "looped"
            ) -> Iterator[dict]:
  """One record per (layer, kernel), as each is measured: ``device_s``,
  ``ratio`` to the layer's plain backward and ``gram_rel_err`` against the
  per-tap kernel at ``HIGHEST``."""
  prec = None if precision == "default" else lax.Precision[precision.upper()]
  key = jax.random.PRNGKey(seed)
  shapes = layers(image) if model == "cnn" else WRN_LAYERS
  if only:
    shapes = [shapes[i] for i in only]

  def timed(step, fn):
    if timer == "dispatched":  # one compile: fn, already run
      return device_time.dispatched_step_s(lambda: fn(w, x, d), k=k,
                                           reps=reps, calls=calls)
    return device_time.step_device_s(_all_args(step), ((w, x, d),), k=k,
                                     reps=reps, calls=calls)

  for size, cin, cout, stride in shapes:
    k1, k2, k3, key = jax.random.split(key, 4)
    x = jax.random.normal(k1, (batch_size, size, size, cin))
    w = jax.random.normal(k2, (3, 3, cin, cout))
    out = -(-size // stride)
    d = jax.random.normal(k3, (batch_size, out, out, cout))
    ref = jax.jit(per_example_step("taps", stride, lax.Precision.HIGHEST))(
        w, x, d)[1]
    plain_fn = jax.jit(plain_step(stride))
    jax.block_until_ready(plain_fn(w, x, d))
    plain = timed(plain_step(stride), plain_fn)
    layer = f"{cin}->{cout}/s{stride}"
    yield {"layer": layer, "kernel": "plain", "device_s": plain,
           "ratio": 1.0, "gram_rel_err": 0.0}
    for name in kernels:
      step = per_example_step(name, stride, prec)
      fn = jax.jit(step)
      try:
        gram = fn(w, x, d)[1]
      except Exception as e:  # pylint: disable=broad-except
        # A kernel that does not compile here (a Pallas layout Mosaic
        # refuses) is reported, and the others still measured.
        yield {"layer": layer, "kernel": name, "device_s": float("nan"),
               "ratio": float("nan"), "gram_rel_err": float("nan"),
               "error": f"{type(e).__name__}: {str(e)[:400]}"}
        continue
      err = float(jnp.max(jnp.abs(gram - ref)) / jnp.max(jnp.abs(ref)))
      if not err <= rtol:
        raise AssertionError(f"{name} on layer {layer}: Gram relative "
                             f"error {err:.2e} > {rtol:.0e}")
      t = timed(step, fn)
      yield {"layer": layer, "kernel": name, "device_s": t,
             "ratio": t / plain if plain > 0 else float("nan"),
             "gram_rel_err": err}


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernel", default=",".join(KERNELS))
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--image", type=int, default=32)
  parser.add_argument("--precision", default="highest",
                      choices=("highest", "high", "default"))
  parser.add_argument("--k", type=int, default=20)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--calls", type=int, default=7)
  parser.add_argument("--rtol", type=float, default=1e-3)
  parser.add_argument("--model", default="cnn", choices=("cnn", "wrn"))
  parser.add_argument("--layers", default="",
                      help="indices of the layers to measure, in order "
                      "(default: all)")
  parser.add_argument("--timer", default="looped",
                      choices=("looped", "dispatched"),
                      help="device time from a looped program, or from "
                      "steps dispatched back to back (one compile a "
                      "kernel; for steps of milliseconds)")
  parser.add_argument("--out", default=None,
                      help="folder for conv_kernels.json")
  a = parser.parse_args(argv)
  device = jax.devices()[0].device_kind
  print(f"device: {device}; precision {a.precision}; B = {a.batch_size}")
  rows = []

  def write():  # after every row: a run cut short keeps what it measured
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "conv_kernels.json"), "w") as f:
      json.dump(dict(device=device, backend=jax.default_backend(),
                     jax=jax.__version__, model=a.model,
                     batch_size=a.batch_size, precision=a.precision,
                     timing=f"device time a step ({a.timer}, "
                     f"benchmarks.device_time), k={a.k}, median of "
                     f"{a.reps} reps of {a.calls} calls",
                     date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     rows=rows), f, indent=1)

  for r in measure(a.kernel.split(","), batch_size=a.batch_size,
                   image=a.image, precision=a.precision, k=a.k, reps=a.reps,
                   calls=a.calls, rtol=a.rtol, model=a.model,
                   only=[int(i) for i in a.layers.split(",") if i],
                   timer=a.timer):
    rows.append(r)
    if a.out:
      write()
    if "error" in r:
      print(f"{r['layer']:14s} {r['kernel']:10s} ERROR {r['error']}",
            flush=True)
      continue
    print(f"{r['layer']:14s} {r['kernel']:10s} "
          f"{device_time.format_time(r['device_s']):>13s} {r['ratio']:7.2f}x"
          f"  err {r['gram_rel_err']:.1e}", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
