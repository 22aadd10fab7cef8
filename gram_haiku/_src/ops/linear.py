"""``y = x @ w (+ b)`` as a primitive whose backward pass also emits the Gram.

The op takes a fourth input, the zero *probe* ``p: f32[B, B]``, which the
forward pass ignores. Its cotangent is the per-example gradient Gram matrix of
``w`` and ``b`` over the example axis (see :mod:`gram_haiku._src.gram_math`
for the formula and its source). Under ``vmap`` the batching rule rebuilds the
op with the mapped axis at the front of ``x``, so the backward rule sees every
example at once; :mod:`gram_haiku._src.example_axis` says which leading axis
is the example axis.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from gram_haiku._src import errors
from gram_haiku._src import gram_math
from gram_haiku._src import hijax_compat as hx
from gram_haiku._src import probe_sizes
from gram_haiku._src.example_axis import ExampleAxis


def linear_forward(x, w, b, precision=None):
  """The exact computation of ``hk.Linear.__call__`` (same ops, same order)."""
  out = jnp.dot(x, w, precision=precision)
  if b is not None:
    out = out + jnp.broadcast_to(b, out.shape)
  return out


def _aval(x) -> Any:
  return None if x is None else jax.typeof(x)


class GramLinear(hx.VJPHiPrimitive):
  """Primitive for ``x @ w + b`` with the Gram of ``(w, b)`` as probe cotangent.

  Inputs: ``x: [..., N]`` (any float dtype), ``w: [N, M]``, ``b: [M]`` or
  None, ``probe: [B, B]`` (float32, or float64 under x64). Output: the same
  array as ``hk.Linear``. Cotangents: ``x``, ``w``, ``b`` as JAX's own
  transpose rules give them (so shapes, dtypes and weak types match the
  primals exactly); ``probe`` gets the Gram, accumulated in float32 or
  float64 and cast to the probe's dtype.
  """

  def __init__(self, x_aval, w_aval, b_aval, probe_aval, *,
               example_axis: ExampleAxis, precision, name: str,
               strategy: str):
    self.in_avals = (x_aval, w_aval, b_aval, probe_aval)
    out = jax.eval_shape(
        functools.partial(linear_forward, precision=precision),
        jax.ShapeDtypeStruct(x_aval.shape, x_aval.dtype),
        jax.ShapeDtypeStruct(w_aval.shape, w_aval.dtype),
        None if b_aval is None else jax.ShapeDtypeStruct(b_aval.shape,
                                                         b_aval.dtype))
    self.out_aval = x_aval.update(shape=out.shape, dtype=out.dtype,
                                  weak_type=out.weak_type)
    self.params = dict(example_axis=example_axis, precision=precision,
                       name=name, strategy=strategy)
    super().__init__()

  # -- forward ---------------------------------------------------------------

  def expand(self, x, w, b, probe):
    del probe  # Only its cotangent matters.
    return linear_forward(x, w, b, self.precision)

  def jvp(self, primals, tangents):
    x, w, b, _ = primals
    xd, wd, bd, probe_dot = tangents
    if not hx.is_zero(probe_dot):
      # The probe is being differentiated: this JVP will be transposed (e.g.
      # by jax.checkpoint), and the Gram only exists in the backward rule.
      return hx.jvp_by_vjp(self, primals, tangents)
    out = linear_forward(x, w, b, self.precision)
    terms = []
    if not hx.is_zero(xd):
      terms.append(jnp.dot(xd, w, precision=self.precision))
    if not hx.is_zero(wd):
      terms.append(jnp.dot(x, wd, precision=self.precision))
    if b is not None and not hx.is_zero(bd):
      terms.append(jnp.broadcast_to(bd, out.shape))
    if not terms:
      return out, hx.Zero(self.out_aval.to_tangent_aval())
    tangent = functools.reduce(jnp.add, terms).astype(out.dtype)
    return out, tangent

  # -- reverse mode ----------------------------------------------------------

  def _example_size(self, x_shape) -> int:
    """Size of the example axis in ``x``, or raises a teaching error."""
    position = self.example_axis.position
    if position is None:
      raise ValueError(errors.NAMED_AXIS_NOT_FOUND.format(
          module=self.name, axis=self.example_axis.name))
    lead = x_shape[:-1]
    if position >= len(lead):
      raise ValueError(errors.NO_EXAMPLE_AXIS.format(
          module=self.name, shape=tuple(x_shape),
          rule=self.example_axis.describe()))
    return lead[position]

  def vjp_fwd(self, nzs_in, x, w, b, probe):
    nz_x, nz_w, nz_b, nz_p = nzs_in
    out = linear_forward(x, w, b, self.precision)
    gram_wanted = bool(nz_p)
    probe_ok = True
    if gram_wanted:
      size = self._example_size(x.shape)
      expected = (size, size)
      probe_ok = tuple(probe.shape) == expected
      if not probe_sizes.record(self.name, size) and not probe_ok:
        raise ValueError(errors.PROBE_SHAPE_MISMATCH.format(
            module=self.name, expected=expected, got=tuple(probe.shape),
            x_shape=tuple(x.shape), rule=self.example_axis.describe()))
    keep_x = bool(nz_w) or (b is not None and bool(nz_b)) or gram_wanted
    flags = hx.StaticFlags((("gram", gram_wanted and probe_ok),
                            ("probe_shape", tuple(probe.shape)),
                            ("probe_dtype", jnp.dtype(probe.dtype).name)))
    residuals = (x if keep_x else None, w if nz_x else None,
                 jax.typeof(x), jax.typeof(w),
                 None if b is None else jax.typeof(b), flags)
    return out, _Residuals(*residuals)

  def vjp_bwd(self, res, g, x_acc, w_acc, b_acc, probe_acc):
    if hx.is_zero(g):
      return
    x, w = res.x, res.w
    prec = self.precision
    # As in JAX's own AD of `dot(x, w) + b`: the add's transpose casts the
    # cotangent back to the dot's dtype (and to b's dtype for the bias).
    g_dot = g.astype(jnp.result_type(res.x_aval.dtype, res.w_aval.dtype))
    if hx.wants_cotangent(x_acc):
      ct_x, = jax.linear_transpose(
          lambda x_: jnp.dot(x_, w, precision=prec), _struct(res.x_aval))(g_dot)
      x_acc.accum(ct_x)
    if hx.wants_cotangent(w_acc):
      ct_w, = jax.linear_transpose(
          lambda w_: jnp.dot(x, w_, precision=prec), _struct(res.w_aval))(g_dot)
      w_acc.accum(ct_w)
    if res.b_aval is not None and hx.wants_cotangent(b_acc):
      ct_b, = jax.linear_transpose(
          lambda b_: jnp.broadcast_to(b_, g.shape).astype(g.dtype),
          _struct(res.b_aval))(g)
      b_acc.accum(ct_b)
    if hx.wants_cotangent(probe_acc):
      dtype = jnp.dtype(res.flags["probe_dtype"])
      if res.flags["gram"]:
        gram = gram_math.linear_gram(
            x, g, example_dim=self.example_axis.position,
            with_bias=res.b_aval is not None, strategy=self.strategy)
        probe_acc.accum(gram.astype(dtype))
      else:  # Probe-size discovery pass: the shape is wrong on purpose.
        probe_acc.accum(jnp.zeros(res.flags["probe_shape"], dtype))

  # -- vmap ------------------------------------------------------------------

  def batch(self, axis_data, args, dims):
    x, w, b, probe = args
    x_dim, w_dim, b_dim, probe_dim = dims
    if probe_dim is not None:
      raise ValueError(errors.PROBE_BATCHED.format(
          module=self.name, shape=tuple(probe.shape), dim=probe_dim))
    if w_dim is not None or b_dim is not None:
      raise NotImplementedError(errors.PARAMS_BATCHED.format(
          module=self.name))
    x = jnp.moveaxis(x, x_dim, 0)
    batched = GramLinear(
        jax.typeof(x), self.in_avals[1], self.in_avals[2], self.in_avals[3],
        example_axis=self.example_axis.after_vmap(hx.axis_name(axis_data)),
        precision=self.precision, name=self.name, strategy=self.strategy)
    return batched(x, w, b, probe), 0

  # -- checkpointing -----------------------------------------------------------

  def remat(self, policy, *args):
    del policy  # A matmul is cheap to recompute; always rematerialise it.
    return self(*args), self


def _struct(aval):
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


@jax.tree_util.register_pytree_node_class
class _Residuals:
  """What the backward rule needs: arrays as leaves, avals/flags as static."""

  def __init__(self, x, w, x_aval, w_aval, b_aval, flags):
    self.x, self.w = x, w
    self.x_aval, self.w_aval, self.b_aval = x_aval, w_aval, b_aval
    self.flags = flags

  def tree_flatten(self):
    return (self.x, self.w), (self.x_aval, self.w_aval, self.b_aval,
                              self.flags)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children, *aux)


def gram_linear(x: jax.Array, w: jax.Array, b: Optional[jax.Array],
                probe: jax.Array, *, name: str = "linear",
                example_axis: ExampleAxis | None = None,
                precision: lax.Precision | None = None,
                strategy: str = "auto") -> jax.Array:
  """``x @ w + b`` whose backward pass writes the per-example Gram into ``probe``.

  Args:
    x: ``[..., N]`` input; its leading axes are the example axis and
      within-example axes (see ``example_axis``).
    w: ``[N, M]`` weight.
    b: ``[M]`` bias, or None.
    probe: ``[B, B]`` zeros (float32, or float64 under x64). ``B`` is the size
      of the example axis as seen by the differentiated function.
    name: module name used in error messages.
    example_axis: which axis is the example axis; default: outermost vmap,
      else axis 0 of ``x``.
    precision: passed to ``jnp.dot`` as in ``hk.Linear``.
    strategy: ``"auto"``, ``"ghost"`` or ``"materialize"``.

  Returns:
    ``[..., M]``, exactly ``hk.Linear``'s output. The cotangent of ``probe`` is
    ``G[i, j] = <g_i, g_j>`` over ``w`` and ``b``.

  Raises:
    ValueError: at differentiation time when ``probe`` is not ``[B, B]``, or
      under ``vmap`` when ``probe`` is batched.
    NotImplementedError: under ``vmap`` when ``w`` or ``b`` is batched.
  """
  if example_axis is None:
    example_axis = ExampleAxis.from_spec(None)
  gram_math.choose_strategy(1, 1, 1, 1, 4, strategy)  # validates `strategy`
  prim = GramLinear(_aval(x), _aval(w), _aval(b), _aval(probe),
                    example_axis=example_axis, precision=precision, name=name,
                    strategy=strategy)
  return prim(x, w, b, probe)
