"""``GramFunction``: any layer given as functions, exact per-example Grams.

The op takes the layer's forward as a static function ``fn(x, *params)``
and, unless it is also given a closed form, gets the Gram from exact
per-example gradients: ``vmap`` over the example axis of the VJP of ``fn``
with respect to the parameters (see
:meth:`gram_haiku.GramOp.per_example_grads`). Cost: one extra VJP per
example and ``B x P`` memory for ``P`` parameter entries, so it suits layers
with few parameters (a GRU cell, whose weights are sliced and used in
several matmuls per step); ``G = F F^T`` then costs ``B^2 P``.

A rule with a cheaper closed form passes it as ``gram_fn`` (and
``sq_norms_fn`` for the diagonal): pure functions of arrays, so they can be
tested against the reference without any primitive.
"""

from __future__ import annotations

from gram_haiku._src.ops import base


class GramFunction(base.GramOp):
  """``y = fn(x, *params)`` with the Gram of the per-example gradients.

  Op params (static, hashable: module-level functions, or
  ``functools.partial`` of them with hashable arguments):

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

  Examples are split over devices (``shard_map``, Explicit meshes) by the
  base class, from per-example gradients: ``gram_fn`` always sees one
  device's whole batch.
  """

  def __init__(self, x_aval, param_avals, probe_aval, *, fn, param_names,
               feature_ndim, gram_fn=None, sq_norms_fn=None, **kwargs):
    self.param_names = tuple(param_names)
    self.feature_ndim = feature_ndim
    super().__init__(x_aval, param_avals, probe_aval, fn=fn,
                     param_names=self.param_names, feature_ndim=feature_ndim,
                     gram_fn=gram_fn, sq_norms_fn=sq_norms_fn, **kwargs)

  def forward(self, x, *params):
    return self.fn(x, *params)

  def gram(self, x, g, params, example_dim, cfg):
    if self.gram_fn is None:
      return super().gram(x, g, params, example_dim, cfg)
    return self.gram_fn(x, g, params, example_dim)

  def sq_norms(self, x, g, params, example_dim, cfg):
    if self.sq_norms_fn is None:
      return super().sq_norms(x, g, params, example_dim, cfg)
    return self.sq_norms_fn(x, g, params, example_dim)
