"""Tracked-to-plain step-time ratio on the demo's MLP (digits, B=64).

Run: ``python -m benchmarks.step_ratio [--batch_size 64] [--repeats 50]``.
Both steps are jitted, warmed up, then timed alternately in one run; the
ratio of medians is printed with the spread (interquartile range).
"""

import argparse
import time

import jax
import numpy as np

import gram_haiku
from gram_haiku.apps import demo


def _time(fn, args, repeats):
  out = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    out.append(time.perf_counter() - t0)
  return np.array(out)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch_size", type=int, default=64)
  parser.add_argument("--hidden", type=int, nargs="+", default=[64, 64])
  parser.add_argument("--repeats", type=int, default=50)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  x, y = demo.load_digits_data()
  x, y = x[:args.batch_size], y[:args.batch_size]
  tracked, plain = demo.make_model(tuple(args.hidden))
  params, state = tracked.init(jax.random.PRNGKey(0), x, y)
  plain_step = jax.jit(jax.value_and_grad(plain.apply))
  vgg = gram_haiku.value_grad_and_gram(tracked.apply, has_aux=True)
  tracked_step = jax.jit(lambda p, s, x, y: vgg(p, s, None, x, y))
  for _ in range(5):
    jax.block_until_ready(plain_step(params, x, y))
    jax.block_until_ready(tracked_step(params, state, x, y))
  ratios, tp, tt = [], [], []
  for _ in range(args.rounds):
    a = _time(plain_step, (params, x, y), args.repeats)
    b = _time(tracked_step, (params, state, x, y), args.repeats)
    tp.append(np.median(a))
    tt.append(np.median(b))
    ratios.append(np.median(b) / np.median(a))
  q = np.percentile(ratios, [25, 50, 75])
  print(f"MLP 64-{'-'.join(map(str, args.hidden))}-10, B={args.batch_size}, "
        f"backend={jax.default_backend()}")
  print(f"plain value_and_grad: median {np.median(tp) * 1e6:.1f} us")
  print(f"tracked (loss+grads+Gram): median {np.median(tt) * 1e6:.1f} us")
  print(f"ratio tracked/plain: median {q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}) "
        f"over {args.rounds} rounds x {args.repeats} steps")


if __name__ == "__main__":
  main()
