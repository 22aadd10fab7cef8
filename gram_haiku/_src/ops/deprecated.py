"""``GramOp`` and ``GramFunction``: the old ways to write a Gram op, kept for
one release as shims over :class:`~gram_haiku._src.rules.rule.Rule` (accessing
``gram_haiku.GramOp`` or ``gram_haiku.GramFunction`` warns; see
``gram_haiku/__init__.py``).

A Gram op binds a rule now (:func:`gram_haiku.ops.bind`, or
:meth:`gram_haiku.LayerCall.apply` in a ``track()`` handler). These shims
turn the old forms into a rule and bind it:

* a ``GramOp`` subclass's hooks (``forward``, ``gram``, ``sq_norms``,
  ``per_example_grads``, and the attributes ``param_names``,
  ``feature_ndim``, ``droppable``, ``sharding_aware``) become the rule's
  fields; its layer parameters (keywords of ``apply``) are attributes of
  the instance each hook is called on;
* ``GramFunction.apply(..., rule=...)`` binds that rule; its keyword form
  (``fn=``, ``param_names=``, ``gram_fn=``, ``sq_norms_fn=``) builds one;
  a subclass may set ``rule`` as a class attribute.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from gram_haiku._src.ops import op as op_lib
from gram_haiku._src.rules import rule as rule_lib
from gram_haiku._src.rules.rule import Rule

#: The hooks of a ``GramOp`` subclass that become the rule's functions.
_HOOKS = ("forward", "gram", "sq_norms", "per_example_grads")


@dataclasses.dataclass(frozen=True)
class _Hook:
  """A ``GramOp`` subclass's method as a rule function: called on an
  instance holding the layer parameters (hashable, so the rule is)."""
  cls: type
  method: str
  layer_params: tuple

  def __call__(self, *args):
    obj = self.cls.__new__(self.cls)
    obj.__dict__.update(self.layer_params)
    return getattr(obj, self.method)(*args)

  def __repr__(self):
    return f"{self.cls.__name__}.{self.method}"


class GramOp:
  """Deprecated: write a :class:`gram_haiku.Rule` and bind it with
  :func:`gram_haiku.ops.bind` (or give it to
  :meth:`gram_haiku.LayerCall.apply`).

  A subclass defines ``forward(self, x, *params)`` and optionally ``gram``,
  ``sq_norms`` and ``per_example_grads`` (the rule's functions, with
  ``self``), ``param_names``, ``feature_ndim``, ``droppable`` and
  ``sharding_aware``; :meth:`apply` binds the rule they make.
  """

  param_names: tuple[str, ...] = ()
  feature_ndim: int = 1
  droppable: tuple[int, ...] = ()
  sharding_aware: bool = False

  def forward(self, x, *params):
    raise NotImplementedError(
        f"{type(self).__name__} must define forward(self, x, *params): the "
        "layer's output from its input and parameters (see GramOp).")

  def gram(self, x, g, params, example_dim, cfg):
    return rule_lib.gram_from_per_example(self.per_example_grads, x, g,
                                          params, example_dim, cfg)

  def sq_norms(self, x, g, params, example_dim, cfg):
    return rule_lib.sq_norms_from_per_example(self.per_example_grads, x, g,
                                              params, example_dim, cfg)

  def per_example_grads(self, x, g, params, example_dim):
    return rule_lib.per_example_grads_by_vjp(self.forward, x, g, params,
                                             example_dim)

  @classmethod
  def rule_of(cls, **layer_params) -> Rule:
    """The :class:`Rule` of this subclass's hooks, with these layer
    parameters (hashable) as the instance's attributes."""
    items = tuple(sorted(layer_params.items()))
    hooks = {}
    for name in _HOOKS:
      overridden = getattr(cls, name) is not getattr(GramOp, name)
      if name == "forward" or overridden:
        hooks[name] = _Hook(cls, name, items)
    return Rule(param_names=tuple(cls.param_names),
                feature_ndim=cls.feature_ndim,
                droppable=tuple(cls.droppable),
                sharding_aware=cls.sharding_aware, **hooks)

  @classmethod
  def apply(cls, x, params, probe, *, name: str, plan=None,
            example_axis=None, mode: str = "gram", strategy: str = "auto",
            memory_budget_bytes: Optional[int] = None, **layer_params):
    """Binds the subclass's rule: :func:`gram_haiku.ops.bind` (same
    arguments; ``layer_params`` are the hooks' attributes)."""
    rule = cls.rule_of(**layer_params)
    budget = {} if memory_budget_bytes is None else dict(
        memory_budget_bytes=memory_budget_bytes)
    return op_lib.bind(rule, x, params, probe, name=name, plan=plan,
                       example_axis=example_axis, mode=mode,
                       strategy=strategy, **budget)


@dataclasses.dataclass(frozen=True)
class _WithoutConfig:
  """A Gram or norms function of ``(x, g, params, example_dim)`` (the
  ``gram_fn``/``sq_norms_fn`` form) as a rule's, which also takes ``cfg``."""
  fn: Callable[..., Any]

  def __call__(self, x, g, params, example_dim, cfg):
    del cfg
    return self.fn(x, g, params, example_dim)

  def __repr__(self):
    return rule_lib.name_of(self.fn)


def function_rule(fn, param_names, feature_ndim: int = 1, gram_fn=None,
                  sq_norms_fn=None) -> Rule:
  """The :class:`Rule` of ``GramFunction``'s keyword form."""
  if param_names is None:
    raise TypeError("GramFunction(fn=...) needs param_names: a tuple naming "
                    "the parameter inputs of fn(x, *params).")
  return Rule(
      forward=fn, param_names=tuple(param_names), feature_ndim=feature_ndim,
      gram=None if gram_fn is None else _WithoutConfig(gram_fn),
      sq_norms=None if sq_norms_fn is None else _WithoutConfig(sq_norms_fn))


class GramFunction(GramOp):
  """Deprecated: bind a :class:`gram_haiku.Rule` with
  :func:`gram_haiku.ops.bind` (``bind(rule, x, params, probe, name=...)``).

  ``GramFunction.apply(x, params, probe, rule=rule, name=...)`` binds
  ``rule``; the keyword form ``fn=``, ``param_names=``, ``feature_ndim=``,
  ``gram_fn=``, ``sq_norms_fn=`` builds the rule; a subclass may set
  ``rule`` as a class attribute.
  """

  rule: Optional[Rule] = None

  @classmethod
  def apply(cls, x, params, probe, *, rule: Optional[Rule] = None, fn=None,
            param_names=None, feature_ndim: int = 1, gram_fn=None,
            sq_norms_fn=None, **kwargs):
    if fn is not None:
      if rule is not None:
        raise TypeError("GramFunction takes rule= or fn= (with "
                        "param_names, gram_fn, ...), not both.")
      rule = function_rule(fn, param_names, feature_ndim, gram_fn,
                           sq_norms_fn)
    if rule is None:
      rule = cls.rule
    if rule is None:
      raise TypeError(
          f"{cls.__name__} needs rule=, a gram_haiku.Rule (at least "
          "Rule(forward=f, param_names=(...))), or fn= and param_names=.")
    if not isinstance(rule, Rule):
      raise TypeError(f"GramFunction: rule must be a gram_haiku.Rule, got "
                      f"{type(rule).__name__}.")
    return op_lib.bind(rule, x, params, probe, **kwargs)
