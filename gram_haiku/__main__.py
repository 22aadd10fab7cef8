"""Command line: ``python -m gram_haiku demo`` (also ``gram-haiku demo``)."""

from __future__ import annotations

import argparse
import sys

import gram_haiku
from gram_haiku._src import demo


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="gram-haiku",
      description="Per-example gradient Gram matrices for Haiku models.")
  parser.add_argument("--version", action="version",
                      version=f"%(prog)s {gram_haiku.__version__}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                              title="commands")
  p = sub.add_parser(
      "demo", help="train an MLP on scikit-learn's digits, tracking the Gram",
      description="Train an MLP on scikit-learn's bundled digits (80%% for "
      "training, 20%% held out), computing the per-example gradient Gram of "
      "every batch in the same backward pass; check it against the "
      "vmap(grad) reference at step 0; write plots and stats.json to --out.")
  p.add_argument("--steps", type=int, default=300,
                 help="training steps (default: %(default)s)")
  p.add_argument("--batch_size", "--batch-size", type=int, default=64,
                 help="examples per step, B: 2 to 1437, the training "
                 "examples (default: %(default)s)")
  p.add_argument("--hidden", type=int, nargs="+", default=[64, 64],
                 help="hidden layer sizes (default: 64 64)")
  p.add_argument("--learning_rate", "--learning-rate", type=float,
                 default=1e-3, help="Adam learning rate (default: %(default)s)")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the initialisation, the batches and the "
                 "held-out split (default: %(default)s)")
  p.add_argument("--out", default="gram_out",
                 help="output directory (default: ./%(default)s)")
  p.add_argument("--no_progress", "--no-progress", action="store_true",
                 help="hide the progress bar (it is hidden anyway when "
                 "stdout is not a terminal)")
  return parser


def run(argv=None) -> int:
  """Entry point of the ``gram-haiku`` console script."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.command is None:
    parser.print_help(sys.stderr)
    print("\nerror: give a command, e.g. `gram-haiku demo`.", file=sys.stderr)
    return 2
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
