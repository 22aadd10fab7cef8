"""Command line: ``python -m gram_haiku demo`` (also ``gram-haiku demo``) and
``python -m gram_haiku dp-demo`` (DP-SGD on the same data).

The parser needs only the standard library: JAX, Haiku and the demos are
imported once the arguments have parsed, so ``--help``, ``--version`` and
a bad flag answer at once.
"""

from __future__ import annotations

import argparse
import sys

import gram_haiku  # Light: its public names are imported on first use.


def _positive_int(text: str) -> int:
  """An argparse type: an int >= 1 (a layer of width 0, 0 steps, ...)."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
  return value


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
      description="Train an MLP on scikit-learn's bundled digits (80% for "
      "training, 20% held out), computing the per-example gradient Gram of "
      "every batch in the same backward pass; check it against the "
      "vmap(grad) reference at step 0; write plots and stats.json to --out.")
  p.add_argument("--steps", type=_positive_int, default=300,
                 help="training steps (default: %(default)s)")
  p.add_argument("--batch_size", "--batch-size", type=int, default=64,
                 help="examples per step, B: 2 to 1437, the training "
                 "examples (default: %(default)s)")
  p.add_argument("--hidden", type=_positive_int, nargs="+", default=[64, 64],
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
  d = sub.add_parser(
      "dp-demo", help="train the digits MLP with DP-SGD at a target epsilon",
      description="DP-SGD on scikit-learn's digits: Poisson sampling, "
      "gram_haiku.clipped_grad (all-layer clipping in one backward pass), "
      "jax-privacy's Gaussian noise and calibration, dp-accounting's PLD "
      "accountant. Prints the clipped gradient's relative error against "
      "the vmap(grad) reference on the first batch, the epsilon spent, the "
      "held-out accuracy and the step time against non-private training; "
      "writes dp_stats.json and dp_accuracy.png to --out.")
  d.add_argument("--epsilon", type=float, default=3.0,
                 help="target epsilon (default: %(default)s)")
  d.add_argument("--delta", type=float, default=1e-5,
                 help="target delta (default: %(default)s)")
  d.add_argument("--steps", type=_positive_int, default=300,
                 help="DP-SGD steps (default: %(default)s)")
  d.add_argument("--expected_batch_size", "--expected-batch-size", type=int,
                 default=128, help="expected Poisson batch size: 2 to 718, "
                 "half of the 1437 training examples (a sampling rate q of "
                 "at most 1/2; default: %(default)s)")
  d.add_argument("--l2_clip_norm", "--l2-clip-norm", type=float, default=1.0,
                 help="per-example clipping norm C (default: %(default)s)")
  d.add_argument("--hidden", type=_positive_int, nargs="+", default=[64, 64],
                 help="hidden layer sizes (default: 64 64)")
  d.add_argument("--learning_rate", "--learning-rate", type=float,
                 default=2e-3, help="Adam learning rate (default: %(default)s)")
  d.add_argument("--seed", type=int, default=0,
                 help="seed (default: %(default)s)")
  d.add_argument("--timing_rounds", "--timing-rounds", type=int, default=20,
                 help="steps timed for the step-time ratio (default: "
                 "%(default)s)")
  d.add_argument("--out", default="dp_out",
                 help="output directory (default: ./%(default)s)")
  d.add_argument("--no_progress", "--no-progress", action="store_true",
                 help="hide the progress bar")
  parser.commands = {"demo": p, "dp-demo": d}  # For their errors.
  return parser


def _run_dp(args) -> int:
  from gram_haiku._src import demo  # pylint: disable=g-import-not-at-top
  from gram_haiku._src import dp_demo  # pylint: disable=g-import-not-at-top
  cfg = dp_demo.DPDemoConfig(
      epsilon=args.epsilon, delta=args.delta, steps=args.steps,
      expected_batch_size=args.expected_batch_size,
      l2_clip_norm=args.l2_clip_norm, hidden=tuple(args.hidden),
      learning_rate=args.learning_rate, seed=args.seed,
      timing_rounds=args.timing_rounds, out=args.out,
      progress=not args.no_progress)
  try:
    dp_demo.run_dp_demo(cfg)
  except (demo.OutputDirError, ValueError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0


def run(argv=None) -> int:
  """Entry point of the ``gram-haiku`` console script."""
  parser = _parser()
  args, extra = parser.parse_known_args(argv)
  if extra:  # The command's own usage, not the top-level one.
    parser.commands.get(args.command, parser).error(
        f"unrecognized arguments: {' '.join(extra)}")
  if args.command is None:
    parser.print_help(sys.stderr)
    print("\nerror: give a command, e.g. `gram-haiku demo`.", file=sys.stderr)
    return 2
  if args.command == "dp-demo":
    return _run_dp(args)
  from gram_haiku._src import demo  # pylint: disable=g-import-not-at-top
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
