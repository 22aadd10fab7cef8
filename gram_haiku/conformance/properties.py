"""Random small models built from registered ops, for property-based search.

A model is a stack of registered ops. Between two ops a fixed random
(untrained) adapter maps the previous op's output features, per application,
to the next op's input features (``tanh(y @ R)``). The model runs under a
random nesting of ``vmap`` s with random ``in_axes``; its total Gram (the sum
of one probe per op) must equal the reference ``F @ F.T`` over every op's
parameters. :mod:`conformance.test_properties` draws these with hypothesis,
which shrinks a failure to a minimal model.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku import testing
from gram_haiku.conformance import checks
from gram_haiku.conformance import variants
from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec


@dataclasses.dataclass(frozen=True)
class RandomModel:
  """A drawn model: ops in order, batch shape, vmap layout and a seed."""
  ops: tuple[OpSpec, ...]
  batch: int
  within: int
  in_axes: tuple[int, ...]
  seed: int

  def __repr__(self):
    return (f"RandomModel(ops={[op.name for op in self.ops]}, "
            f"batch={self.batch}, within={self.within}, "
            f"in_axes={self.in_axes}, seed={self.seed})")


def _feature_shapes(spec: OpSpec, params):
  x = spec.make_example(jax.random.PRNGKey(0), (), jnp.float32)
  y = jax.eval_shape(spec.plain, params, x)
  return tuple(x.shape), tuple(y.shape)


def build(model: RandomModel):
  """``(params, adapters, x, run)`` for ``model``.

  ``run(params, probes, xs, tracked)`` applies the stack to ``xs`` with any
  number of leading axes: with the Gram ops (``tracked``, one probe each) or
  with the plain ops.
  """
  keys = jax.random.split(jax.random.PRNGKey(model.seed), 2 * len(model.ops)
                          + 1)
  params, shapes = [], []
  for i, spec in enumerate(model.ops):
    p = spec.make_params(keys[2 * i], jnp.float32)
    params.append(p)
    shapes.append(_feature_shapes(spec, p))
  adapters = []
  for i in range(1, len(model.ops)):
    fan_in = math.prod(shapes[i - 1][1])
    fan_out = math.prod(shapes[i][0])
    adapters.append(normal(keys[2 * i + 1], (fan_in, fan_out), jnp.float32)
                    / np.sqrt(fan_in))
  x = model.ops[0].make_example(keys[-1], (model.batch, model.within),
                                jnp.float32)

  def run(params, probes, h, tracked):
    for i, spec in enumerate(model.ops):
      if i:
        in_shape, out_shape = shapes[i][0], shapes[i - 1][1]
        lead = h.shape[:h.ndim - len(out_shape)]
        h = jnp.tanh(h.reshape(lead + (-1,)) @ adapters[i - 1])
        h = h.reshape(lead + in_shape)
      if tracked:
        h = spec.apply(params[i], probes[i], h)
      else:
        h = spec.plain(params[i], h)
    return h
  return params, x, run


def check_random_model(model: RandomModel):
  """The tracked stack under ``model.in_axes`` vmaps equals the reference."""
  params, x, run = build(model)
  b = model.batch

  def plain_one(params, xi):
    return checks._loss(run(params, None, xi, tracked=False))  # pylint: disable=protected-access
  ref = testing.reference_gram(plain_one, params, x, upcast=True)

  layout = variants.VmapLayout(tuple(model.in_axes),
                              (0,) * len(model.in_axes))
  xs = jnp.transpose(x, layout.order(2) + list(range(2, x.ndim)))

  def loss(probes, xs):
    g = layout(lambda xi: run(params, probes, xi, tracked=True))
    return checks._loss(g(xs))  # pylint: disable=protected-access
  probes = [checks._probe((b, b)) for _ in model.ops]  # pylint: disable=protected-access
  # One program (eagerly, each primitive of the model's pass is a program of
  # its own; the eager path is the vmap family's ``jit_none`` layouts).
  grams = jax.jit(jax.grad(loss))(probes, xs)
  checks.assert_close(sum(grams), ref, what=f"total Gram of {model!r}")
