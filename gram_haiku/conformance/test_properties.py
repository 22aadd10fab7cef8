"""Property-based search over random small models (hypothesis).

The example budget is small by default so that CI stays fast;
``--conformance-thorough`` (or ``CONFORMANCE_THOROUGH=1``) raises it for
nightly runs. hypothesis shrinks a failing model to a minimal one (fewest
ops, smallest shapes, shallowest vmap nesting) and prints it.
"""

from hypothesis import given
from hypothesis import HealthCheck
from hypothesis import settings
from hypothesis import strategies as st
import pytest

from gram_haiku.conformance import plugin
from gram_haiku.conformance import properties
from gram_haiku.conformance.registry import registered_ops

pytestmark = pytest.mark.conformance

BUDGET, THOROUGH_BUDGET = 3, 150




def _ops(selected):
  ops = registered_ops()
  names = [n for n in selected.split(",") if n]
  return [op for op in ops if not names or op.name in names]


@st.composite
def random_models(draw, ops):
  first = draw(st.sampled_from(ops))
  rest_pool = [op for op in ops if not op.integer_input]
  rest = draw(st.lists(st.sampled_from(rest_pool), max_size=2))
  depth = draw(st.integers(0, 2))
  in_axes = tuple(draw(st.integers(0, 1 - level)) for level in range(depth))
  return properties.RandomModel(
      ops=(first, *rest), batch=draw(st.integers(1, 5)),
      within=draw(st.integers(1, 3)), in_axes=in_axes,
      seed=draw(st.integers(0, 2**16)))


def test_random_models_match_reference(pytestconfig):
  thorough = plugin.thorough()
  ops = _ops(pytestconfig.getoption("--conformance-ops"))

  @settings(max_examples=THOROUGH_BUDGET if thorough else BUDGET, deadline=None,
            derandomize=not thorough, database=None,
            suppress_health_check=[HealthCheck.too_slow])
  @given(random_models(ops))
  def search(model):
    properties.check_random_model(model)
  search()
