"""``GramFunction``: any layer given as a function, exact per-example Grams.

For layers without a closed-form Gram rule of their own (a GRU cell, whose
weights are sliced and used in several matmuls per step), the op takes the
layer's forward as a static function ``fn(x, *params)`` and gets the Gram
from exact per-example gradients: ``vmap`` over the example axis of the VJP
of ``fn`` with respect to the parameters (see
:meth:`gram_haiku.GramOp.per_example_grads`). Cost: one extra VJP per
example and ``B x P`` memory for ``P`` parameter entries, so it suits layers
with few parameters; ``G = F F^T`` then costs ``B^2 P``.
"""

from __future__ import annotations

from gram_haiku._src.ops import base


class GramFunction(base.GramOp):
  """``y = fn(x, *params)`` with the Gram of the per-example gradients.

  Op params: ``fn`` (static, hashable: a module-level function or a
  ``functools.partial`` of one with hashable arguments), ``param_names``
  (a tuple naming the parameter inputs) and ``feature_ndim`` (the trailing
  axes of ``x`` one application consumes). ``fn`` must accept ``x`` with any
  number of leading axes.
  """

  def __init__(self, x_aval, param_avals, probe_aval, *, fn, param_names,
               feature_ndim, **kwargs):
    self.param_names = tuple(param_names)
    self.feature_ndim = feature_ndim
    super().__init__(x_aval, param_avals, probe_aval, fn=fn,
                     param_names=self.param_names, feature_ndim=feature_ndim,
                     **kwargs)

  def forward(self, x, *params):
    return self.fn(x, *params)
