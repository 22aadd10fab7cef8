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

from gram_haiku.conformance import checks
from gram_haiku.conformance import plugin
from gram_haiku.conformance import properties

pytestmark = pytest.mark.conformance

BUDGET, THOROUGH_BUDGET = 3, 150


@st.composite
def random_models(draw, group):
  first = draw(st.sampled_from(group.first))
  rest = draw(st.lists(st.sampled_from(group.rest), max_size=2)
              if group.rest else st.just([]))
  depth = draw(st.integers(0, 2))
  in_axes = tuple(draw(st.integers(0, 1 - level)) for level in range(depth))
  return properties.RandomModel(
      ops=(first, *rest), batch=draw(st.integers(1, 5)),
      within=draw(st.integers(1, 3)), in_axes=in_axes,
      seed=draw(st.integers(0, 2**16)))


@pytest.mark.conformance_family("properties")
def test_random_models_match_reference(conformance_group,
                                       conformance_platform):
  """One search per group of ops (:func:`plugin.op_groups`): a third
  party's op first in every model of its own search, the selected built-in
  ops together in one."""
  thorough = plugin.thorough()

  @settings(max_examples=THOROUGH_BUDGET if thorough else BUDGET, deadline=None,
            derandomize=not thorough, database=None,
            suppress_health_check=[HealthCheck.too_slow])
  @given(random_models(conformance_group))
  def search(model):
    properties.check_random_model(model)
  with checks.on_platform(conformance_platform):
    search()
