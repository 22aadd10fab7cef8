"""Runs Haiku's own tests with ``gram_haiku.track()`` around every transform.

    python -m tests.haiku_suite                  # the modules below
    python -m tests.haiku_suite -n 2 bias_test nets.mlp_test -- -x
    python -m tests.haiku_suite --plain          # the baseline: no tracking

From the repository root. Each module is one of the installed package's test
files (``bias_test`` means ``haiku._src.bias_test``); arguments after ``--``
go to pytest. Two pytest sessions run: the tests themselves (see plugin.py),
then, if any is selected, the allowlisted ``state`` ones with the probes
kept, each expected to fail (an entry that no longer differs is stale). The
exit status is non-zero if either fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time

#: Haiku's test files for the modules gram_haiku tracks, and the composites
#: built from them.
MODULES = (
    "basic_test",            # hk.Linear
    "bias_test",
    "conv_test",
    "depthwise_conv_test",
    "embed_test",
    "layer_norm_test",
    "rms_norm_test",
    "group_norm_test",
    "batch_norm_test",
    "recurrent_test",        # LSTM, GRU, dynamic_unroll
    "attention_test",
    "nets.mlp_test",
    "nets.resnet_test",
    "layer_stack_test",
    "integration.hk_transforms_test",
    "integration.jax_transforms_test",
    "integration.numpy_inputs_test",
    "stateful_test",         # hk.scan, hk.vmap, hk.remat, ... around modules
    "lift_test",
    "mixed_precision_test",
    "multi_transform_test",
    "jaxpr_info_test",
    "integration.half_test",  # bfloat16 and float16 through every module
    "integration.float64_test",
    "integration.check_tracer_leaks_test",
    "integration.rank_promotion_test",
    "integration.summarise_test",
    "integration.jaxpr_info_test",
    "integration.to_dot_test",
)

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _module(name: str) -> str:
  return name if name.startswith("haiku.") else f"haiku._src.{name}"


def _run(args, env) -> int:
  print("$", " ".join(args), flush=True)
  return subprocess.call(args, cwd=_ROOT, env=env)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra = []
  if "--" in argv:
    at = argv.index("--")
    argv, extra = argv[:at], argv[at + 1:]
  parser = argparse.ArgumentParser(prog="python -m tests.haiku_suite",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("modules", nargs="*", help=f"default: {MODULES}")
  parser.add_argument("-n", dest="workers", metavar="N",
                      help="pytest-xdist's workers: a number or auto")
  parser.add_argument("--plain", action="store_true",
                      help="run the tests without track() (the baseline)")
  opts = parser.parse_args(argv)
  from tests.haiku_suite import plugin  # pylint: disable=g-import-not-at-top
  modules = [_module(m) for m in opts.modules or MODULES]
  # Not the repository's conftest.py (its sampling and summary are for our
  # suite), but its compile-time settings: XLA's optimisation passes off
  # (Haiku's tests pass with them off, --plain shows it) and the compilation
  # cache in .jax_cache.
  env = dict(os.environ)
  env.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  env.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, ".jax_cache"))
  pytest = [sys.executable, "-m", "pytest", "--noconftest",
            "-p", "tests.haiku_suite.plugin",
            "-p", "no:cacheprovider", "-p", "no:gram_haiku_conformance",
            "--rootdir", os.path.dirname(importlib.util.find_spec("haiku").origin),
            "-q",
            "--pyargs", *modules]
  listed = {key.split("::")[0] for key, (kind, _) in
            plugin.load_allowlist().items() if kind == "state"}
  if opts.workers:
    extra = ["-n", opts.workers, *extra]
  start = time.perf_counter()
  if opts.plain:
    rc = _run(pytest + ["--haiku-plain", *extra], env)
  else:
    rc = _run(pytest + extra, env)
    if listed & set(modules):
      check = _run(pytest + ["--haiku-check-allowlist", *extra], env)
      rc = rc or (0 if check == 5 else check)  # 5: -k left none of them.
  print(f"haiku_suite: {time.perf_counter() - start:.0f} s, exit status {rc}")
  return rc


if __name__ == "__main__":
  sys.exit(main())
