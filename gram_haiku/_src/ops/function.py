"""``GramFunction``: the Gram op of a layer given as a :class:`Rule`.

A :class:`~gram_haiku._src.rule.Rule` is a layer's Gram rule as pure
functions (``forward``, and optionally ``gram``, ``sq_norms``,
``per_example_grads``, a fused form and a cost function); this op binds one
to its inputs, so that ``jax.grad`` of the probe gives the rule's Gram. Every
built-in layer is a subclass whose rule comes from its static parameters
(:class:`~gram_haiku._src.ops.linear.GramLinear`: ``precision``); a
third-party layer passes ``rule=`` (or, in a ``track()`` handler, gives the
rule to :meth:`gram_haiku.LayerCall.apply`).

What the rule leaves out comes from its defaults
(:mod:`gram_haiku._src.rule`): exact per-example gradients by ``vmap`` of
the VJP of ``forward`` (one extra VJP per example, ``B x P`` memory for
``P`` parameter entries, ``G = F F^T`` at ``B^2 P``), which suits layers
with few parameters (a GRU cell, whose weights are sliced and used in
several matmuls per step). A closed-form ``gram`` is what makes a rule
cheap, and it can be tested against the reference without any primitive.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from gram_haiku._src import rule as rule_lib
from gram_haiku._src.ops import base
from gram_haiku._src.rule import Rule


@dataclasses.dataclass(frozen=True)
class _WithoutConfig:
  """A Gram or norms function of ``(x, g, params, example_dim)`` (the
  ``gram_fn``/``sq_norms_fn`` form) as a rule's, which also takes ``cfg``."""
  fn: Callable[..., Any]

  def __call__(self, x, g, params, example_dim, cfg):
    del cfg
    return self.fn(x, g, params, example_dim)

  def __repr__(self):
    return rule_lib._name_of(self.fn)  # pylint: disable=protected-access


def function_rule(fn, param_names, feature_ndim: int = 1, gram_fn=None,
                  sq_norms_fn=None) -> Rule:
  """The :class:`Rule` of ``GramFunction``'s keyword form (see its
  docstring)."""
  if param_names is None:
    raise TypeError("GramFunction(fn=...) needs param_names: a tuple naming "
                    "the parameter inputs of fn(x, *params).")
  return Rule(
      forward=fn, param_names=tuple(param_names), feature_ndim=feature_ndim,
      gram=None if gram_fn is None else _WithoutConfig(gram_fn),
      sq_norms=None if sq_norms_fn is None else _WithoutConfig(sq_norms_fn))


class GramFunction(base.GramOp):
  """``y = rule.forward(x, *params)``, the probe's cotangent by the rule.

  Op params (static, hashable):

  * ``rule``: a :class:`gram_haiku.Rule`, e.g. ``Rule(forward=f,
    param_names=("w",), gram=my_gram)``.

  or, the same rule in keyword form:

  * ``fn(x, *params) -> y``: the layer; must accept ``x`` with any number
    of leading axes.
  * ``param_names``: a tuple naming the parameter inputs.
  * ``feature_ndim``: the trailing axes of ``x`` one application consumes.
  * ``gram_fn(x, g, params, example_dim) -> (B, B)`` (optional): the Gram
    of the per-example gradients, given the input ``x``, the output
    cotangent ``g`` (example axis at ``example_dim`` in both) and the
    parameters, in float32 (float64 for float64 inputs). Default: ``F F^T``
    of exact per-example gradients.
  * ``sq_norms_fn(x, g, params, example_dim) -> (B,)`` (optional): its
    diagonal. Default: from exact per-example gradients.

  A subclass may instead define ``rule`` itself (the built-in layers build
  it from their own static parameters). Unless the rule is
  ``sharding_aware``, examples split over devices (``shard_map``, Explicit
  meshes) get their Gram from per-example gradients: its ``gram`` always
  sees one device's whole batch.

  Example, binding a rule directly (inside ``track()``, a layer handler
  passes the rule to :meth:`gram_haiku.LayerCall.apply` instead):

  >>> import jax, jax.numpy as jnp, gram_haiku
  >>> def scaled(x, w):
  ...   return 2.0 * jnp.dot(x, w)
  >>> rule = gram_haiku.Rule(forward=scaled, param_names=("w",))
  >>> x, w = jnp.ones((4, 3)), jnp.ones((3, 2))
  >>> def loss(w, probe):
  ...   y = gram_haiku.GramFunction.apply(x, (w,), probe, rule=rule,
  ...                                     name="scaled")
  ...   return jnp.sum(y ** 2)
  >>> jax.grad(loss, argnums=1)(w, jnp.zeros((4, 4))).shape
  (4, 4)
  """

  def __init__(self, x_aval, param_avals, probe_aval, *,
               rule: Optional[Rule] = None, fn=None, **kwargs):
    if fn is not None:  # The keyword form.
      if rule is not None:
        raise TypeError("GramFunction takes rule= or fn= (with "
                        "param_names, gram_fn, ...), not both.")
      rule = function_rule(
          fn, kwargs.pop("param_names", None),
          kwargs.pop("feature_ndim", 1), kwargs.pop("gram_fn", None),
          kwargs.pop("sq_norms_fn", None))
    if rule is not None:
      if not isinstance(rule, Rule):
        raise TypeError(f"GramFunction: rule must be a gram_haiku.Rule, got "
                        f"{type(rule).__name__}.")
      kwargs["rule"] = rule
    elif getattr(type(self), "rule", None) is None:
      raise TypeError(
          f"{type(self).__name__} needs rule=, a gram_haiku.Rule (at least "
          "Rule(forward=f, param_names=(...))), or fn= and param_names=.")
    super().__init__(x_aval, param_avals, probe_aval, **kwargs)

  # The hooks of GramOp, answered by the rule (its defaults included).

  @property
  def param_names(self) -> tuple[str, ...]:
    return self.rule.param_names

  @property
  def feature_ndim(self) -> int:
    return self.rule.feature_ndim

  @property
  def droppable(self) -> tuple[int, ...]:
    return self.rule.droppable

  @property
  def sharding_aware(self) -> bool:
    return self.rule.sharding_aware

  def forward(self, x, *params):
    return self.rule.forward(x, *params)

  def gram(self, x, g, params, example_dim, cfg):
    if self.rule.gram is None:
      return super().gram(x, g, params, example_dim, cfg)
    return self.rule.gram(x, g, params, example_dim, cfg)

  def sq_norms(self, x, g, params, example_dim, cfg):
    if self.rule.sq_norms is None:
      return super().sq_norms(x, g, params, example_dim, cfg)
    return self.rule.sq_norms(x, g, params, example_dim, cfg)

  def per_example_grads(self, x, g, params, example_dim):
    if self.rule.per_example_grads is None:
      return super().per_example_grads(x, g, params, example_dim)
    return self.rule.per_example_grads(x, g, params, example_dim)


def rule_binder(rule: Rule) -> Callable[..., Any]:
  """``op(x, *params, probe, **kwargs)`` binding ``rule`` by
  :class:`GramFunction` (the form :meth:`gram_haiku.LayerCall.apply`
  calls)."""
  def op(x, *args, **kwargs):
    return GramFunction.apply(x, args[:-1], args[-1], rule=rule, **kwargs)
  return op
