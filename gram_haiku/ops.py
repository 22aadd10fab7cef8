"""gram_haiku.ops: the Gram ops as functions on arrays, below ``track()``.

Every Gram op binds one :class:`gram_haiku.Rule` (a layer's Gram rule as
pure functions): :func:`bind` is the one binder, and the ``gram_*``
functions are it for the built-in layers' rules, with Haiku's arguments.
Inside ``gram_haiku.track()`` a layer handler gives its rule to
:meth:`gram_haiku.LayerCall.apply` instead, which resolves the plan and
the probe for it.

* :func:`bind`: ``y = rule.forward(x, *params)``, and the probe's cotangent
  is the rule's Gram (its diagonal, or the per-example gradients).
* :func:`gram_linear`, :func:`gram_conv`, :func:`gram_conv_transpose`,
  :func:`gram_embed`, :func:`gram_affine`: the built-in layers' ops.
* :func:`linear_rule`, :func:`conv_rule`, :func:`embed_rule`,
  :func:`affine_rule`: the built-in layers' rules, plain :class:`Rule`
  values (``hk.Linear``'s is ``linear_rule(precision)``).
* :func:`rule_name`: a rule's short name, as messages and the conformance
  suite print it.
"""

from gram_haiku._src.ops.affine import affine_rule
from gram_haiku._src.ops.affine import gram_affine
from gram_haiku._src.ops.conv import conv_rule
from gram_haiku._src.ops.conv import gram_conv
from gram_haiku._src.ops.conv import gram_conv_transpose
from gram_haiku._src.ops.embed import embed_rule
from gram_haiku._src.ops.embed import gram_embed
from gram_haiku._src.ops.linear import gram_linear
from gram_haiku._src.ops.linear import linear_rule
from gram_haiku._src.ops.op import bind
from gram_haiku._src.rules.rule import rule_name

__all__ = (
    "affine_rule",
    "bind",
    "conv_rule",
    "embed_rule",
    "gram_affine",
    "gram_conv",
    "gram_conv_transpose",
    "gram_embed",
    "gram_linear",
    "linear_rule",
    "rule_name",
)
