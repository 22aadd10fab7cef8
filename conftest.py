"""Repository-wide pytest setup (not shipped).

XLA's CPU backend spends most of this suite's time compiling many small
programs; its optimisation passes buy nothing at these sizes, so the suite
runs with ``jax_disable_most_optimizations`` (about 1.7x faster here), and
XLA compiles each program with its classic CPU code generator into one LLVM
module (see ``_FAST_COMPILE``). The math is unchanged: XLA's optimisations
reorder floating-point work only within the tolerances the tests use. The
multi-device runner subprocesses set their own optimisation level (the case
whose HLO collective counts are checked compiles with JAX's defaults).
"""

import gc
import importlib.metadata
import os

import pytest

# XLA's compilations persist across runs (and across this run's workers and
# subprocesses, which inherit the environment) in the ignored folder
# .jax_cache: a first run compiles everything (about 10% of it is repeated,
# and then read back), a second run on the same machine takes about a third
# of the time. Set JAX_COMPILATION_CACHE_DIR yourself to use another folder.
_ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(_ROOT, ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

# Two XLA CPU flags that only change how a program is compiled, not its math
# (the runner subprocesses inherit them; one already in XLA_FLAGS is left
# as it is):
# * the classic code generator: XLA's CPU fusion emitters take about 1.5x
#   longer to compile each of this suite's many small programs and run them
#   no faster at these sizes (measured: a tiny elementwise program 62 ->
#   42 ms; two heavy tests 30 -> 18 s). jaxlib 0.9 and 0.10 have the flag;
#   0.11 removed it (an unknown XLA flag aborts the process), so it is set
#   for those releases only;
# * one LLVM module per program: by default XLA splits each program's code
#   into up to 32 modules compiled in parallel, which costs more CPU time in
#   all than it saves on programs this small (measured, cold:
#   test_frozen.py and test_loops.py 59 -> 49 CPU-s). jaxlib 0.10 and 0.11
#   both have the flag.
_FAST_COMPILE = {"xla_cpu_parallel_codegen_split_count": "1"}
_JAXLIB = importlib.metadata.version("jaxlib").split(".")[:2]
if tuple(int(p) for p in _JAXLIB) < (0, 11):
  _FAST_COMPILE["xla_cpu_use_fusion_emitters"] = "false"
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")] +
    [f"--{name}={value}" for name, value in _FAST_COMPILE.items()
     if name not in os.environ.get("XLA_FLAGS", "")]).strip()

# The documentation's example processes (tests/test_docs.py) read it from the
# environment at import; this process has imported JAX already (the pytest
# plugin's package did), so it is also set here.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_disable_most_optimizations", True)

# The documented third-party example runs every family in our own run, as a
# registered op (the sharded family's runner imports this module for it).
from gram_haiku import conformance  # pylint: disable=g-import-not-at-top,wrong-import-position
from gram_haiku.conformance import plugin as _plugin  # pylint: disable=g-import-not-at-top,wrong-import-position
from gram_haiku.conformance.examples import scaled_linear  # pylint: disable=g-import-not-at-top,wrong-import-position

conformance.register(scaled_linear.SPEC)

# Python's cyclic garbage collector: tracing and lowering allocate millions
# of short-lived objects, and at the default thresholds (700, 10, 10) its
# collections took 8% of a test file's time (tests/test_reweight.py, cold
# compilation cache: 2.7 of 34 s in 2,082 collections, 14 of them full);
# at these thresholds 0.7 s. The objects alive after the imports are frozen
# (left out of every later collection). Tests that need garbage gone call
# gc.collect() themselves.
gc.freeze()
gc.set_threshold(50_000, 50, 100)


# The default budget (the README's test command, at most 6 minutes cold on
# 2 cores) samples the parametrised sweeps; the nightly conformance-thorough
# env (CONFORMANCE_THOROUGH=1 / --conformance-thorough) runs every case. A
# sweep of at least DEFAULT_MIN_CASES cases outside FULL_FILES keeps about
# one case in DEFAULT_EVERY and every value of every option (a parameter with
# at most OPTION_VALUES values: a dtype, a mode, eager or jit); a sweep of
# SAMPLED_SWEEPS keeps one in its k (its comment says which cases are
# kept). The classes sampled out stay covered by the suites that run every
# layer through the same code (test_composites, conformance/).
DEFAULT_MIN_CASES = 3
DEFAULT_EVERY = 4
OPTION_VALUES = 2
# Files whose sweeps all run every case by default (unless listed in
# SAMPLED_SWEEPS): the clip bound's attacks (a privacy bug there is silent),
# the real cases of shared/cases and the checks of every documentation page.
FULL_FILES = ("tests/test_clip_bound.py", "tests/test_cases.py",
              "tests/test_docs.py")
SAMPLED_SWEEPS = {
    "tests/test_export.py::test_every_layer_exports_with_a_symbolic_batch": 24,
    "tests/test_export.py::"
    "test_forced_methods_and_blocks_export_with_a_symbolic_batch": 6,
    "tests/test_export.py::test_a_symbolic_sequence_length_exports": 6,
    "tests/test_precision.py::test_every_kernel_takes_the_requested_precision":
        10,
    # The symmetric blocks of every layer: the layers' rules are each run
    # whole by test_composites; the heavy ResNet-GroupNorm (GroupNorm and
    # Conv2D, each a layer of the sweep) thorough (4 CPU-s).
    "tests/test_symmetric.py::"
    "test_every_layer_from_blocks_matches_the_reference": 16,
    "tests/test_reparam.py::test_reparametrised_layer_is_exact": 12,
    "tests/test_norms.py::test_every_module_and_flag_x64": 6,
    "tests/test_rules.py::test_conv_rule": 6,
    # Every layer and layout through its composite rule: one case in twelve
    # (1.7 CPU-s moved; every layer's rule also runs in the conformance
    # suite's families and in test_symmetric).
    "tests/test_composites.py::test_layer_matches_reference": 12,
    "tests/test_reweight.py::test_all_layer_clipping_matches_reference": 4,
    "tests/test_rules.py::test_embed_rule": 4,
    "tests/test_rules.py::test_linear_rule": 4,
    "tests/test_conv.py::test_parameter_gradients_from_per_example_sum": 4,
    "tests/test_conv.py::test_depthwise_convolutions_match_the_reference": 4,
    "tests/test_loops.py::test_cores_in_loops_match_reference": 4,
    # The refusals without jit, one model in four (each runs under jit as a
    # row of tests/interpreter_corpus.py).
    "tests/test_example_flow.py::test_refused_at_any_size": 4,
    # The interpreter's red-team corpus, one row in twenty-four (its rows
    # replaced the special-case tests that checked no more than a verdict;
    # each row is one verdict of the same interpreter, 2026-12-07: 3 CPU-s
    # of rows moved to the thorough env).
    "tests/test_interpreter_corpus.py::test_corpus_row": 24,
    "tests/test_example_flow.py::test_example_axes_say_where_the_examples_are":
        4,
    "tests/test_example_flow.py::"
    "test_example_independent_inputs_under_hk_vmap_are_exact": 4,
    "tests/test_inference_and_errors.py::test_empty_batch_after_init": 4,
    "tests/test_conv.py::test_op_explicit_batch": 4,
    "tests/test_reliability.py::"
    "test_complex_operands_are_refused_and_inference_still_works": 6,
    "tests/test_linear_op.py::test_zero_input_features_leave_the_bias_gram": 4,
    # Bare weights contracted, convolved or indexed (program-level rules),
    # one model in four (the others are rows of tests/interpreter_corpus.py).
    "tests/test_program_rules.py::"
    "test_a_bare_weight_contracted_or_indexed_is_exact": 4,
    # cross_gram's per-layer clipping: one threshold form in two (a split
    # number, a dict), the same pass either way.
    "tests/test_cross_gram.py::"
    "test_a_per_layer_clipped_update_is_exact_in_float64": 4,
    # Bare weights inside checkpoint, cond and scan: one model of each (the
    # nested ones, a checkpoint in a scan and hk.dynamic_unroll, thorough).
    "tests/test_program_rules_calls.py::"
    "test_sites_inside_calls_are_the_reference": 2,
    # The Pallas conv kernel in interpret mode (slow on the CPU; no platform
    # takes it by default): one case in eight against float64, one data
    # format of the tracked CNN.
    "tests/test_pallas_conv.py::test_matches_float64_and_the_patch_path": 8,
    "tests/test_pallas_conv.py::test_a_tracked_cnn_through_the_kernel": 4,
    "tests/test_pallas_conv.py::"
    "test_the_patch_free_triangle_is_the_patch_triangle": 4,
    # The model zoos (each model a few seconds of compiles): one
    # model in four; the clipping case of each kind and mode, one in four;
    # the Haiku zoo's jax-privacy clipping one model in eight (the decoder:
    # the mixer's layers are the decoder's, 2 CPU-s).
    "tests/test_flax_zoo.py::test_linen_model_is_the_haiku_gram": 4,
    "tests/test_flax_zoo.py::test_nnx_model_is_the_haiku_gram": 4,
    "tests/test_model_zoo.py::test_a_covered_model_clips_like_jax_privacy": 8,
    "tests/test_model_zoo.py::test_a_covered_model_gives_the_reference_gram":
        4,
    "tests/test_model_zoo.py::"
    "test_bare_parameters_are_covered_under_untracked_error": 4,
    "tests/test_clip_bound.py::test_a_cancelling_example_is_clipped": 2,
    # The unknown op's message from each entry point: the CLI (with xdist
    # workers, whose messages must not repeat) by default.
    "tests/test_conformance_plugin.py::"
    "test_an_unknown_op_is_one_message_saying_how_to_register": 3,
    # The sharded cases: every case of the default list of
    # tests/distributed_cases.py (cases(everything=False), which its one
    # runner computes whole; that list says what --all adds), each reported.
    "tests/test_distributed.py::test_sharded_case": 1,
    # The plain-JAX decoder with its own output layer (the tied one, whose
    # table is read by a gather and a transposed matmul: the Haiku tied LM
    # of test_coverage.test_tied_embedding_raw_matmul_adds_up).
    "tests/test_flax_zoo.py::test_plain_jax_gpt_is_the_haiku_gram": 2,
}


# Tests left to the thorough env (each key a test function), because a
# kindred test of the default budget runs the same code: the plain-JAX ViT
# (attention: the plain-JAX GPT; the class token: the Haiku ViT of
# test_model_zoo) and ResNet (convolved bare weights:
# test_program_rules.test_a_bare_weight_contracted_or_indexed_is_exact); the
# Haiku suite's bias tests (tox -e haiku-suite runs Haiku's whole suite);
# the benchmarks' per-layer convolution kernels and profiler (benchmark
# tools; test_real_suite_smoke runs the suite the docs' tables come from);
# the conformance CLI's third-party run (CI's .ci/third_party.sh runs it
# from a built wheel).
THOROUGH_ONLY = (
    "tests/test_flax_zoo.py::test_plain_jax_vit_is_the_haiku_gram",
    "tests/test_flax_zoo.py::test_plain_jax_resnet_is_the_haiku_gram",
    "tests/test_haiku_suite.py::test_haiku_bias_tests_pass_under_track",
    "tests/test_benchmarks.py::"
    "test_conv_kernels_agree_with_the_plain_gradient_and_each_other",
    "tests/test_benchmark_profile.py::test_profile_smoke",
    "tests/test_conformance_plugin.py::"
    "test_the_cli_finds_the_conftest_and_a_third_party_family",
    # The plain-JAX MLP-Mixer (6.5 CPU-s): linear, LayerNorm and gelu over
    # a sequence through gram_haiku.functional, as the plain-JAX GPT kept
    # by default (its Haiku model: test_model_zoo's mlp_mixer).
    "tests/test_flax_zoo.py::test_plain_jax_mixer_is_the_haiku_gram",
    # The plain-JAX two-tower model (2.2): linear layers through
    # gram_haiku.functional (the plain-JAX GPT) and a bare scalar parameter
    # broadcast (test_program_rules.
    # test_a_bare_parameter_broadcast_gives_the_reference_gram).
    "tests/test_flax_zoo.py::test_plain_jax_two_tower_is_the_haiku_gram",
    # The plain-JAX LSTM in a lax.scan (4.6): a parameter carried through a
    # scan under the program rules (test_program_rules_calls.
    # test_the_constants_of_a_loop_with_a_carried_parameter_are_exact and
    # test_scan_per_layer_clipping_is_the_reference).
    "tests/test_flax_zoo.py::test_plain_jax_lstm_is_the_haiku_gram",
    # The demo through the CLI at 3 steps (3.2): run_demo itself is
    # test_demo_runs_and_writes_outputs (the README's demo), the CLI's
    # demo command test_cli_unwritable_out_is_a_clear_error.
    "tests/test_demo.py::test_cli_demo_small",
    # The Pallas ghost kernel's benchmark (2.1): a benchmark tool; the
    # kernel is test_pallas_ghost.test_gram_matches_float64_and_the_xla_path
    # (the real suite's CPU smoke configuration, test_real_suite_smoke,
    # stays: issue 45 names it).
    "tests/test_pallas_ghost.py::test_benchmark_smoke",
    # Three of the absltest mixin's methods on the example op (3.1): the
    # same checks of the same op run as gram_haiku/conformance/
    # test_conformance.py's example_scaled_linear items (conftest.py
    # registers it), and the mixin itself as ScaledLinearTest.
    # test_transforms.
    "tests/test_conformance_example.py::test_vmap_depth_invariance",
    "tests/test_conformance_example.py::test_norm_bounds",
    "tests/test_conformance_example.py::test_backward_parity",
    # The Hessian of a tracked loss (2.5): forward-over-reverse through
    # tracked layers, as test_reliability.
    # test_forward_mode_through_tracked_layers_is_exact_or_refused and
    # test_linearize_of_a_tracked_loss.
    "tests/test_reliability.py::test_hessian_of_a_tracked_loss_still_works",
)


# Sweeps that run each case under every value of one parameter (function ->
# that parameter: the jit placement, or an option of the case): the default
# budget runs each case (the other parameters) once, with the parameter's
# values taken in turn over the cases, so that every case and every value
# still runs; the thorough env runs every pair. Each entry has at least as
# many cases as values; its comment says what the kept cases are. (The
# example-flow sweeps that alternated jit became rows of
# tests/interpreter_corpus.py, run under jit.)
ALTERNATED_SWEEPS = {
    # Each model once, frozen in turn: the stacked scan's [L, 5] bias and
    # the module called twice frozen, the plain stack and the getter not.
    "tests/test_reweight.py::test_by_size_counts_the_parameters_a_module_owns":
        "frozen",
    # Each loss once, with per-example labels (1,) and per-token ones (1, T)
    # in turn.
    "tests/test_example_flow.py::"
    "test_a_batch_of_one_is_exact_whatever_the_loss": "per_token",
    # The Gram of one position, the norms of a sequence's (t, s) blocks.
    "tests/test_reliability.py::"
    "test_masked_rows_with_huge_inputs_have_zero_gradient": "mode",
    # Each untracked= value once (its Gram and clipped sum against the
    # float64 reference), eager and under jit in turn.
    "tests/test_coverage.py::"
    "test_untracked_read_only_through_stop_gradient_is_not_reported": "jit",
    # Each gradless use once (compared, argmax, isfinite), eager and under
    # jit in turn.
    "tests/test_coverage.py::"
    "test_tracked_parameter_read_outside_without_a_gradient_is_exact": "jit",
}


def _alternated(items):
  """The items of :data:`ALTERNATED_SWEEPS` to keep: the case (the other
  parameters) ranked ``r`` in order of appearance runs with the parameter's
  ``r % n``-th value (``n`` values, in order of appearance)."""
  values, cases, keyed = {}, {}, []
  for item in items:
    key = f"{item.nodeid.split('::')[0]}::{getattr(item, 'originalname', '')}"
    name = ALTERNATED_SWEEPS.get(key)
    if name is None or name not in getattr(item, "callspec", None).params:
      continue
    params = item.callspec.params
    value = repr(params[name])
    case = tuple(sorted((k, repr(v)) for k, v in params.items() if k != name))
    vals = values.setdefault(key, {})
    vals.setdefault(value, len(vals))
    ranks = cases.setdefault(key, {})
    ranks.setdefault(case, len(ranks))
    keyed.append((item, key, value, case))
  return {id(item) for item, key, value, case in keyed
          if values[key][value] == cases[key][case] % len(values[key])}


def _sampled(items):
  """The items of the parametrised sweeps to keep in the default budget.

  Each function's cases (in order of appearance; the conformance suite's
  and :data:`ALTERNATED_SWEEPS`' are sampled elsewhere) keep about one in
  ``k`` (``k``: :data:`SAMPLED_SWEEPS`, else :data:`DEFAULT_EVERY` for a
  sweep of at least :data:`DEFAULT_MIN_CASES` outside :data:`FULL_FILES`):
  first each case that holds a value not yet kept of an option (a
  parameter with at most :data:`OPTION_VALUES` values over the sweep: a
  dtype, a mode, eager or jit), then cases taken in turn. Every value of
  every option then runs, whatever ``k``, except in a sweep of
  :data:`SAMPLED_SWEEPS` (whose comment says what its kept cases are)."""
  groups = {}
  for item in items:
    callspec = getattr(item, "callspec", None)
    key = f"{item.nodeid.split('::')[0]}::{getattr(item, 'originalname', '')}"
    if (callspec is None or "conformance_op" in callspec.params
        or key in ALTERNATED_SWEEPS or (key.split("::")[0] in FULL_FILES
                                        and key not in SAMPLED_SWEEPS)):
      continue
    groups.setdefault(key, []).append(item)
  keep = set()
  for key, group in groups.items():
    every = SAMPLED_SWEEPS.get(
        key, DEFAULT_EVERY if len(group) >= DEFAULT_MIN_CASES else 1)
    values = {}
    for item in group:
      for name, value in item.callspec.params.items():
        values.setdefault(name, set()).add(repr(value))
    options = [n for n, v in values.items() if len(v) <= OPTION_VALUES]
    held = [{(n, repr(item.callspec.params[n])) for n in options
             if n in item.callspec.params} for item in group]
    # First the cases that hold an option value not yet kept, then the
    # rest in turn, up to one case in `every`; then any value still missing.
    kept, covered = [], set()
    for i, h in enumerate(held):
      if not h <= covered and len(kept) * every < len(group):
        kept.append(i)
        covered |= h
    for i in range(0, len(group), every):
      if len(kept) * every >= len(group):
        break
      if i not in kept:
        kept.append(i)
        covered |= held[i]
    if key not in SAMPLED_SWEEPS:  # (a listed sweep's comment says why not)
      kept += [i for i, h in enumerate(held) if not h <= covered
               and not covered.update(h)]
    keep.update(id(group[i]) for i in kept)
  return keep, {id(item) for group in groups.values() for item in group}


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
  """Under ``-n`` without ``--dist``, xdist's worksteal scheduler: a worker
  that runs out of tests takes some of the other's queue instead of
  idling while the other finishes it (its gain was within this suite's
  run-to-run noise on 2 cores, 2026-12-07)."""
  option = config.option
  if getattr(option, "numprocesses", None) and getattr(
      option, "dist", None) == "no":
    option.dist = "worksteal"


def pytest_collection_modifyitems(config, items):
  """Samples the parametrised sweeps (:func:`_sampled`) and
  :data:`ALTERNATED_SWEEPS` and leaves out :data:`THOROUGH_ONLY` outside the
  thorough budget, and says how many cases it left out."""
  if _plugin.thorough():
    return
  keep, drop = [], []
  alternated = _alternated(items)
  sampled, grouped = _sampled(items)
  for item in items:
    key = f"{item.nodeid.split('::')[0]}::{getattr(item, 'originalname', '')}"
    if key in THOROUGH_ONLY:
      drop.append(item)
    elif key in ALTERNATED_SWEEPS and hasattr(item, "callspec"):
      (keep if id(item) in alternated else drop).append(item)
    elif id(item) in grouped:
      (keep if id(item) in sampled else drop).append(item)
    else:
      keep.append(item)
  if drop:
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def pytest_terminal_summary(terminalreporter, config):
  del config
  if not _plugin.thorough():
    terminalreporter.write_line(
        "gram_haiku: the parametrised sweeps ran about one case in k, every "
        "value of their options included (conftest.SAMPLED_SWEEPS; the "
        "default budget; in the deselected count), and those of "
        "conftest.ALTERNATED_SWEEPS each case with one value of one "
        "parameter; tox -e conformance-thorough runs them all.")
