"""The pass pipeline's one decision: what each module keeps (its Store).

Traced only (``jax.make_jaxpr``): no pass is run here; the passes
themselves are tested against the reference by every other test file.
"""

import dataclasses

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import gram_haiku
from gram_haiku._src.compute import plan as plan_lib
from gram_haiku._src.compute.plan import Clip
from gram_haiku._src.frontend.ambient import ModulePass
from gram_haiku._src.frontend.ambient import PassPlan
from gram_haiku._src.passes import pass_pipeline as pipeline
from gram_haiku._src.passes.pass_pipeline import Store

B, N, M = 5, 4, 6


def _model(x, y):
  h = hk.Linear(M, name="a")(x)
  s = hk.Linear(M, name="s")  # applied twice: its parameters are shared
  return jnp.sum((s(jnp.tanh(s(h))) - y) ** 2)


def _traced(mode: str = "gram"):
  def loss(x, y):
    with gram_haiku.track(mode=mode):
      return _model(x, y)
  x = jnp.ones((B, N))
  y = jnp.zeros((B, M))
  f = hk.transform_with_state(loss)
  params, state = f.init(jax.random.PRNGKey(0), x, y)
  t = pipeline.trace(f.apply, False, params, state, None, (x, y), {}, ())
  return t, params


def _decide(objective, mode="gram", slotted=None):
  t, params = _traced(mode)
  t, live = pipeline.participants(t, objective, params)
  return pipeline.decide(t, objective, live, slotted or {})


def test_the_op_modes_are_stores():
  """One vocabulary: every op mode is the name of the store it fills."""
  assert set(plan_lib.MODES) <= set(Store.ALL)
  assert len(set(Store.ALL)) == len(Store.ALL)


def test_grams_keep_the_track_mode_or_per_example_gradients():
  assert _decide(pipeline.GRAMS) == {"a": Store.GRAM,
                                     "s": Store.PER_EXAMPLE}
  assert _decide(pipeline.GRAMS, mode="norms") == {"a": Store.NORMS,
                                                   "s": Store.PER_EXAMPLE}


def test_a_slotted_module_keeps_slots_in_every_objective():
  for objective in (pipeline.GRAMS,
                    pipeline.Objective(recontract=True, needs="norms")):
    assert _decide(objective, slotted={"s": 2})["s"] == Store.SLOTS


def test_recontraction_keeps_factors_clips_or_nothing():
  # Linear a: factors K = N + M = 10 < P = N M + M = 30 per example.
  norms = pipeline.Objective(recontract=True, needs="norms")
  assert _decide(norms) == {"a": Store.FACTORS, "s": Store.PER_EXAMPLE}
  per_layer = norms.with_clips({"a": Clip(1.0), "s": Clip(1.0)})
  # (A module applied twice is clipped after the pass, from its
  # per-example gradients.)
  assert _decide(per_layer) == {"a": Store.CLIP, "s": Store.PER_EXAMPLE}
  frozen = pipeline.Objective(recontract=True, needs="norms",
                              frozen=frozenset({"a/w", "a/b"}))
  assert _decide(frozen) == {"a": Store.NOTHING, "s": Store.PER_EXAMPLE}


def _pass_plan(objective):
  t, params = _traced()
  t, live = pipeline.participants(t, objective, params)
  stores = pipeline.decide(t, objective, live, {})
  return pipeline._pass_plan(t, objective, stores, {})  # pylint: disable=protected-access


def test_the_pass_plan_is_one_frozen_hashable_value_keyed_by_module():
  objective = pipeline.Objective(recontract=True, needs="norms",
                                 upper_bound=True).with_clips(
                                     {"a": Clip(1.0), "s": Clip(2.0)})
  plan, again = _pass_plan(objective), _pass_plan(objective)
  assert plan is not again and plan == again and hash(plan) == hash(again)
  assert {plan: "cached"}[again] == "cached"
  assert plan != dataclasses.replace(plan, upper_bound=False)
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.upper_bound = False  # pytype: disable=not-writable
  # Decisions only, by module; the layer name carried once per module.
  assert plan.modules == (
      ("a", ModulePass(layer="a", mode="clip", clip=Clip(1.0))),
      ("s", ModulePass(layer="s", mode="per_example")))
  assert plan.told("s") == ("s", ModulePass(layer="s", mode="per_example"))
  assert plan.told("elsewhere") is None
  # Grams: only the module applied twice is told something.
  assert _pass_plan(pipeline.GRAMS).modules == (
      ("s", ModulePass(layer="s", mode="per_example")),)


def test_a_pass_plan_from_a_mapping_equals_one_from_sorted_pairs():
  told = {"m2": ModulePass(layer="l2", slotted=True, mode="factors"),
          "m1": ModulePass(layer="l1", frozen=[1])}
  plan = PassPlan(column_axes=("data",), modules=told)
  assert plan == PassPlan(column_axes=("data",),
                          modules=sorted(told.items()))
  assert hash(plan) == hash(PassPlan(column_axes=("data",),
                                     modules=tuple(sorted(told.items()))))
  assert plan.told("l1") == ("m1", ModulePass(layer="l1", frozen=(1,)))
  # Two modules under one layer name must be told the same: track() sees
  # only the layer name.
  with pytest.raises(ValueError, match="one layer name 'l'"):
    PassPlan(modules={"x": ModulePass(layer="l", mode="per_example"),
                      "y": ModulePass(layer="l")})
