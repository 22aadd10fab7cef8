"""Command line: ``python -m gram_haiku demo`` (also ``gram-haiku demo``),
``python -m gram_haiku dp-demo`` (DP-SGD on the same data) and
``python -m gram_haiku attribution-demo`` (finding flipped labels and
influential training digits).

The parser needs only the standard library: JAX, Haiku and the demos are
imported once the arguments have parsed, so ``--help``, ``--version`` and
a bad flag answer at once. Every value is checked by the parser (a bad
one is an error of its command, with its usage, exit status 2). Exit
status: 0 done, 2 a usage error, an unwritable ``--out`` or a missing
extra, 130 interrupted.
"""

from __future__ import annotations

import argparse
import math
import sys

import gram_haiku  # Light: its public names are imported on first use.

#: Training examples of scikit-learn's digits once the demos hold out 20%
#: (1797 - 360; gram_haiku.apps.demo.split_heldout, tested).
DIGITS_TRAIN = 1437


def _int_in(low: int, high: int | None = None):
  """An argparse type: an int in ``[low, high]``."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"{text!r} is not an integer") from None
    if value < low:
      raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
    if high is not None and value > high:
      raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
    return value
  return parse


_positive_int = _int_in(1)


def _float_in(low: float, high: float = math.inf):
  """An argparse type: a finite float with ``low < value < high``."""
  def parse(text: str) -> float:
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and low < value < high):
      bound = (f"between {low:g} and {high:g} (exclusive)"
               if math.isfinite(high) else f"a finite number above {low:g}")
      raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
    return value
  return parse


_positive_float = _float_in(0.0)


def _parser() -> argparse.ArgumentParser:
  """The whole command line; builds from the standard library alone."""
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
  p.add_argument("--batch_size", "--batch-size",
                 type=_int_in(2, DIGITS_TRAIN), default=64,
                 help=f"examples per step, B: 2 to {DIGITS_TRAIN}, the "
                 "training examples (default: %(default)s)")
  p.add_argument("--hidden", type=_positive_int, nargs="+", default=[64, 64],
                 help="hidden layer sizes (default: 64 64)")
  p.add_argument("--learning_rate", "--learning-rate", type=_positive_float,
                 default=1e-3, help="Adam learning rate (default: %(default)s)")
  p.add_argument("--seed", type=_int_in(0, 2**32 - 1), default=0,
                 help="seed of the initialisation, the batches and the "
                 "held-out split, 0 to 2**32-1 (default: %(default)s)")
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
      "accountant. The clip norm C is by default the median per-example "
      "gradient norm of the initial model over the held-out examples, which "
      "the guarantee does not cover (so choosing it spends no privacy "
      "budget); --clip-norm fixes it. Prints the clipped gradient's "
      "relative error against the vmap(grad) reference on the first batch, "
      "the fraction of the examples clipped per epoch, the epsilon spent, "
      "the held-out accuracy against a non-private baseline (the same "
      "model, optimiser and batches without clipping or noise) and the "
      "step time against the baseline's; writes dp_stats.json and "
      "dp_accuracy.png to --out.")
  d.add_argument("--epsilon", type=_positive_float, default=3.0,
                 help="target epsilon (default: %(default)s)")
  d.add_argument("--delta", type=_float_in(0.0, 1.0), default=1e-5,
                 help="target delta, between 0 and 1 (default: %(default)s)")
  d.add_argument("--steps", type=_positive_int, default=300,
                 help="DP-SGD steps (default: %(default)s)")
  d.add_argument("--expected_batch_size", "--expected-batch-size",
                 type=_int_in(2, DIGITS_TRAIN // 2), default=128,
                 help=f"expected Poisson batch size: 2 to "
                 f"{DIGITS_TRAIN // 2}, half of the {DIGITS_TRAIN} training "
                 "examples (a sampling rate q of at most 1/2; default: "
                 "%(default)s)")
  d.add_argument("--clip_norm", "--clip-norm", "--l2_clip_norm",
                 "--l2-clip-norm", dest="clip_norm", type=_positive_float,
                 default=None, metavar="C",
                 help="per-example clipping norm C, a public value (default: "
                 "the median per-example gradient norm at initialisation "
                 "over the held-out examples)")
  d.add_argument("--hidden", type=_positive_int, nargs="+", default=[64, 64],
                 help="hidden layer sizes (default: 64 64)")
  d.add_argument("--learning_rate", "--learning-rate", type=_positive_float,
                 default=2e-3, help="Adam learning rate (default: %(default)s)")
  d.add_argument("--seed", type=_int_in(0, 2**32 - 1), default=0,
                 help="seed, 0 to 2**32-1 (default: %(default)s)")
  d.add_argument("--timing_rounds", "--timing-rounds", type=_positive_int,
                 default=20, help="steps timed for the step-time ratio "
                 "(default: %(default)s)")
  d.add_argument("--out", default="dp_out",
                 help="output directory (default: ./%(default)s)")
  d.add_argument("--no_progress", "--no-progress", action="store_true",
                 help="hide the progress bar")
  a = sub.add_parser(
      "attribution-demo",
      help="find flipped labels and influential training digits from the "
      "training steps' Grams",
      description="Train an MLP with SGD on scikit-learn's digits with a "
      "fraction of the training labels flipped to another class. Each step "
      "is one gram_haiku.cross_gram pass whose queries are a few fixed "
      "held-out digits and the batch itself; over training it accumulates "
      "each training example's self-influence sum_t eta |g_i|^2 (eta = "
      "learning rate / batch size, the step each example's gradient gets) "
      "and its influence sum_t eta <g_i, h_q> on each held-out query q "
      "(TracIn). Prints how well the self-influence ranks the flipped "
      "examples first (precision at k = the number flipped, ROC AUC) "
      "against the final per-example loss; writes attribution_stats.json "
      "and the plots self_influence.png, top_self_influence.png and "
      "influence_grid.png (the most helpful and harmful training digits of "
      "each query) to --out.")
  a.add_argument("--flip_fraction", "--flip-fraction",
                 type=_float_in(0.0, 1.0), default=0.1,
                 help="fraction of the training labels flipped to another "
                 "class, between 0 and 1 (default: %(default)s)")
  a.add_argument("--epochs", type=_positive_int, default=10,
                 help="passes over the training examples (default: "
                 "%(default)s)")
  a.add_argument("--batch_size", "--batch-size",
                 type=_int_in(1, DIGITS_TRAIN), default=64,
                 help=f"examples per step, 1 to {DIGITS_TRAIN} (default: "
                 "%(default)s)")
  a.add_argument("--hidden", type=_positive_int, nargs="+", default=[64],
                 help="hidden layer sizes (default: 64)")
  a.add_argument("--learning_rate", "--learning-rate", type=_positive_float,
                 default=0.5, help="SGD learning rate on the batch-mean loss "
                 "(default: %(default)s)")
  a.add_argument("--queries", type=_int_in(1, 10), default=6,
                 help="held-out query digits, each of another class, 1 to "
                 "10 (default: %(default)s)")
  a.add_argument("--top", type=_positive_int, default=6,
                 help="helpful and harmful training digits shown per query "
                 "(default: %(default)s)")
  a.add_argument("--train_examples", "--train-examples",
                 type=_int_in(2, DIGITS_TRAIN), default=None,
                 help=f"use only the first N of the {DIGITS_TRAIN} training "
                 "examples (default: all)")
  a.add_argument("--seed", type=_int_in(0, 2**32 - 1), default=0,
                 help="seed of the split, the flips, the queries, the "
                 "initialisation and the batches (default: %(default)s)")
  a.add_argument("--out", default="attribution_out",
                 help="output directory (default: ./%(default)s)")
  a.add_argument("--no_progress", "--no-progress", action="store_true",
                 help="hide the progress bar")
  parser.commands = {"demo": p, "dp-demo": d,
                     "attribution-demo": a}  # For their errors.
  return parser


def _train(args) -> None:
  """Runs the parsed command (imports JAX, Haiku and the demo)."""
  from gram_haiku.apps import demo  # pylint: disable=g-import-not-at-top
  if args.command == "dp-demo":
    from gram_haiku.apps import dp_demo  # pylint: disable=g-import-not-at-top
    dp_demo.run_dp_demo(dp_demo.DPDemoConfig(
        epsilon=args.epsilon, delta=args.delta, steps=args.steps,
        expected_batch_size=args.expected_batch_size,
        l2_clip_norm=args.clip_norm, hidden=tuple(args.hidden),
        learning_rate=args.learning_rate, seed=args.seed,
        timing_rounds=args.timing_rounds, out=args.out,
        progress=not args.no_progress))
  elif args.command == "attribution-demo":
    from gram_haiku.apps import attribution_demo  # pylint: disable=g-import-not-at-top
    attribution_demo.run_attribution_demo(attribution_demo.AttributionConfig(
        flip_fraction=args.flip_fraction, epochs=args.epochs,
        batch_size=args.batch_size, hidden=tuple(args.hidden),
        learning_rate=args.learning_rate, queries=args.queries,
        top=args.top, seed=args.seed, train_examples=args.train_examples,
        out=args.out, progress=not args.no_progress))
  else:
    demo.run_demo(demo.DemoConfig(
        steps=args.steps, batch_size=args.batch_size,
        hidden=tuple(args.hidden), learning_rate=args.learning_rate,
        seed=args.seed, out=args.out, progress=not args.no_progress))


def run(argv=None) -> int:
  """Entry point of the ``gram-haiku`` console script; returns the exit
  status (argparse exits with 2 itself on a usage error, 0 on --help)."""
  parser = _parser()
  args, extra = parser.parse_known_args(argv)
  if extra:  # The command's own usage, not the top-level one.
    parser.commands.get(args.command, parser).error(
        f"unrecognized arguments: {' '.join(extra)}")
  if args.command is None:
    parser.print_help(sys.stderr)
    print("\nerror: give a command, e.g. `gram-haiku demo`.", file=sys.stderr)
    return 2
  # Imported here, after parsing: errors a user can fix are reported
  # without a traceback; any other exception keeps its traceback.
  from gram_haiku.apps import demo  # pylint: disable=g-import-not-at-top
  try:
    _train(args)
  except (demo.OutputDirError, demo.ConfigError,
          demo.MissingExtraError) as e:
    print(f"gram-haiku {args.command}: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"\ngram-haiku {args.command}: interrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(run())
