"""The conformance families over every registered op (``pytest --pyargs
gram_haiku.conformance``).

Each test takes the ``conformance_op`` and ``conformance_platform`` fixtures
from :mod:`gram_haiku.conformance.plugin`: ops are the registered
:class:`OpSpec` s, platforms those ``jax.devices()`` reports (an absent one
is skipped, and the skip says so).
"""

import pytest

from gram_haiku.conformance import checks
from gram_haiku.conformance import plugin

pytestmark = pytest.mark.conformance


def _run(check, *args, **kwargs):
  try:
    check(*args, **kwargs)
  except checks.NotApplicable as e:
    pytest.skip(f"not applicable: {e}")


@pytest.mark.conformance_family("parity")
@pytest.mark.parametrize("case", list(checks.DTYPE_CASES))
def test_backward_parity(conformance_op, conformance_platform, case):
  with checks.on_platform(conformance_platform):
    _run(checks.check_backward_parity, conformance_op, case)


def _batched_both_ways(values, default_keeps):
  """``pytest.param(value, vmapped)`` for each value explicitly batched and
  under vmap; in the default (CI) budget only the pairs
  ``default_keeps(index, value, vmapped)`` keeps."""
  return [pytest.param(v, vmapped,
                       id=f"{v}-{'vmap' if vmapped else 'explicit'}")
          for i, v in enumerate(values) for vmapped in (False, True)
          if plugin.thorough() or default_keeps(i, v, vmapped)]


def _reference_cases():
  """Every dtype explicitly batched and under vmap; in the default (CI)
  budget, the low-precision dtypes only explicitly batched."""
  return _batched_both_ways(checks.REFERENCE_CASES,
                            lambda i, case, vmapped: (not vmapped or
                                                      case == "float32"))


@pytest.mark.conformance_family("reference")
@pytest.mark.parametrize("case,vmapped", _reference_cases())
def test_reference_equality(conformance_op, conformance_platform, case,
                            vmapped):
  with checks.on_platform(conformance_platform):
    checks.check_reference_equality(conformance_op, case, vmapped)


LAYOUTS = [(d, ins, outs) for d, layouts in checks.VMAP_LAYOUTS.items()
           for ins, outs in layouts]


#: Layouts per depth in the default (CI) budget; all with --conformance-thorough.
DEFAULT_LAYOUTS_PER_DEPTH = 3


def _vmap_cases():
  """Up to three layouts per depth without jit, spread over the listed
  ones; jit inside/outside on the first layout of each depth. Every layout
  and jit placement with ``--conformance-thorough``."""
  cases = []
  firsts = {}
  per_depth = {}
  for d, ins, outs in LAYOUTS:
    per_depth.setdefault(d, []).append((ins, outs))
  chosen = set()
  for d, layouts in per_depth.items():
    step = max(1, len(layouts) // DEFAULT_LAYOUTS_PER_DEPTH)
    chosen.update((d,) + l for l in layouts[::step][:DEFAULT_LAYOUTS_PER_DEPTH])
  for d, ins, outs in LAYOUTS:
    if not plugin.thorough() and (d, ins, outs) not in chosen:
      continue
    firsts.setdefault(d, (ins, outs))
    for jit in ("none", "inside", "outside"):
      if jit == "inside" and d == 0:
        continue  # depth 0 has no vmap to jit inside of
      if jit != "none" and not plugin.thorough() and firsts[d] != (ins, outs):
        continue
      cases.append(pytest.param(
          ins, outs, jit,
          id=f"depth{d}-in{''.join(map(str, ins))}-"
             f"out{''.join(map(str, outs))}-jit_{jit}"))
  return cases


@pytest.mark.conformance_family("vmap")
@pytest.mark.parametrize("in_axes,out_axes,jit", _vmap_cases())
def test_vmap_depth_invariance(conformance_op, conformance_platform, in_axes,
                               out_axes, jit):
  with checks.on_platform(conformance_platform):
    checks.check_vmap_depth_invariance(conformance_op, in_axes, out_axes, jit)


@pytest.mark.conformance_family("vmap")
@pytest.mark.parametrize("case", checks.EXAMPLE_AXIS_CASES)
def test_example_axis_selection(conformance_op, conformance_platform, case):
  with checks.on_platform(conformance_platform):
    checks.check_example_axis_selection(conformance_op, case)


def _checkpoint_cases():
  """Every policy under vmap and explicitly batched; in the default (CI)
  budget, every policy once (alternating the batching style)."""
  return _batched_both_ways(checks.CHECKPOINT_POLICIES,
                            lambda i, policy, vmapped: vmapped == bool(i % 2))


@pytest.mark.conformance_family("transforms")
@pytest.mark.parametrize("policy,vmapped", _checkpoint_cases())
def test_checkpoint(conformance_op, conformance_platform, policy, vmapped):
  with checks.on_platform(conformance_platform):
    checks.check_checkpoint(conformance_op, policy, vmapped)


@pytest.mark.conformance_family("transforms")
@pytest.mark.parametrize("name", list(checks.TRANSFORM_CHECKS))
def test_transforms(conformance_op, conformance_platform, name):
  with checks.on_platform(conformance_platform):
    checks.TRANSFORM_CHECKS[name](conformance_op)


@pytest.mark.conformance_family("frozen")
def test_frozen(conformance_op, conformance_platform):
  with checks.on_platform(conformance_platform):
    _run(checks.check_frozen, conformance_op)


@pytest.mark.conformance_family("bounds")
@pytest.mark.parametrize("mode", ["norms", "per_example"])
@pytest.mark.parametrize("case", list(checks.BOUND_CASES))
def test_norm_bounds(conformance_op, conformance_platform, case, mode):
  with checks.on_platform(conformance_platform):
    _run(checks.check_norm_bounds, conformance_op, case, mode)
