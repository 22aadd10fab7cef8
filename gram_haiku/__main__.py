"""Command line: ``python -m gram_haiku demo`` (also ``gram-haiku demo``)."""

from __future__ import annotations

import argparse
import sys

from gram_haiku._src import demo


def run(argv=None) -> int:
  """Entry point of the ``gram-haiku`` console script."""
  parser = argparse.ArgumentParser(
      prog="gram-haiku",
      description="Per-example gradient Gram matrices for Haiku models.")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser(
      "demo", help="train an MLP on scikit-learn's digits, tracking the Gram")
  p.add_argument("--steps", type=int, default=300,
                 help="training steps (default: %(default)s)")
  p.add_argument("--batch_size", "--batch-size", type=int, default=64,
                 help="examples per step, B (default: %(default)s)")
  p.add_argument("--hidden", type=int, nargs="+", default=[64, 64],
                 help="hidden layer sizes (default: 64 64)")
  p.add_argument("--learning_rate", "--learning-rate", type=float,
                 default=1e-3, help="Adam learning rate (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="gram_out",
                 help="output directory (default: ./%(default)s)")
  p.add_argument("--no_progress", "--no-progress", action="store_true",
                 help="hide the progress bar")
  args = parser.parse_args(argv)
  cfg = demo.DemoConfig(steps=args.steps, batch_size=args.batch_size,
                        hidden=tuple(args.hidden),
                        learning_rate=args.learning_rate, seed=args.seed,
                        out=args.out, progress=not args.no_progress)
  try:
    demo.run_demo(cfg)
  except (demo.OutputDirError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(run())
