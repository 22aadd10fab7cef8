"""``Rule``: a layer's Gram rule as pure functions, testable without hijax.

A rule says what one layer computes and how its per-example gradients, their
Gram and their squared norms are formed from the layer's input ``x`` and
output cotangent ``g``. It is a frozen, hashable record of functions of
arrays: none of them knows about primitives, ``vmap`` or the probe, so each
can be called on plain arrays and checked against
``jax.vmap(jax.grad(...))``. A Gram op binds a rule
(:func:`gram_haiku.ops.bind`, or :meth:`gram_haiku.LayerCall.apply` in a
``track()`` handler); the op decides the mode and consults the rule's cost
function once per application
(:mod:`gram_haiku._src.ops.modes`).

Shapes, with ``B`` examples: ``x`` has the example axis at ``example_dim``
among its leading axes, then ``feature_ndim`` trailing axes that one
application of the layer consumes; every other leading axis is a
within-example axis (sequence positions, an inner ``vmap``), summed over in
a per-example gradient. ``g`` is the cotangent of ``forward``'s output, with
the same leading axes. ``params`` is a tuple with one entry per name in
``param_names``: an array, or None for an absent parameter (no bias) or one
left out because it is frozen (see ``droppable``). ``cfg`` is a
:class:`~gram_haiku._src.compute.kernels.KernelConfig`: the method the cost
function chose (``cfg.method``), the memory budget, the precision of its
products (``cfg.precision``, from ``track(gram_precision=...)``) and, for
a ``sharding_aware`` rule, the mesh axes the Gram's columns come from.
Results are in the accumulation dtype: float32, or float64 where ``x`` or a
present parameter is float64.

Defaults, one implementation for every rule: a rule without ``gram`` or
``sq_norms`` gets them from its per-example gradients (``F F^T`` and the
row sums of ``F * F``, ``F`` the flattened per-example gradients); a rule
without ``per_example_grads`` gets them by ``vmap`` over the example axis of
the VJP of ``forward`` with respect to the parameters (exact for any layer,
at ``B x P`` memory for ``P`` parameter entries). So the smallest rule is
``Rule(forward=f, param_names=("w",))``; a closed-form ``gram`` is what
makes it cheap.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute.kernels import KernelConfig

_FUNCTIONS = ("forward", "gram", "sq_norms", "per_example_grads",
              "probe_cotangent_and_grads", "cost", "factors_exact",
              "per_example_error")


def _short(v) -> str:
  """``repr(v)``, or its type and shape for an array."""
  if getattr(v, "ndim", 0):
    return f"{type(v).__name__}{list(v.shape)}"
  return repr(v)


def name_of(fn) -> str:
  """A short, stable name for a rule's function (its ``repr`` in a jaxpr)."""
  if isinstance(fn, functools.partial):
    args = [name_of(a) if callable(a) else _short(a) for a in fn.args]
    args += [f"{k}={_short(v)}" for k, v in fn.keywords.items()]
    return f"{name_of(fn.func)}({', '.join(args)})"
  name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
  return name if name is not None else repr(fn)


class _ById:
  """An unhashable value (an array bound by a partial), compared by
  identity."""

  def __init__(self, value):
    self.value = value

  def __eq__(self, other):
    return isinstance(other, _ById) and other.value is self.value

  def __hash__(self):
    return id(self.value)


def _key(v):
  """``v`` in a form that compares by value: a ``functools.partial`` (which
  compares by identity) as its function and arguments, so that a rule built
  afresh per call is the same rule."""
  if isinstance(v, functools.partial):
    return (functools.partial, _key(v.func),
            tuple(_key(a) for a in v.args),
            tuple(sorted((k, _key(a)) for k, a in v.keywords.items())))
  try:
    hash(v)
  except TypeError:
    return _ById(v)
  return v


@dataclasses.dataclass(frozen=True, repr=False, eq=False)
class Rule:
  """One layer's Gram rule: pure functions of arrays (the shapes every
  function receives: "Writing a Gram rule" in the API docs).

  A rule is a static parameter of its op (hashed into the ``jit`` cache key
  and printed in the jaxpr), so its functions should be module-level
  functions, or ``functools.partial`` of them with hashable arguments
  (layer configuration such as ``precision``). Rules compare by value: two
  partials of the same function with equal arguments are equal, so a rule
  built afresh per call (e.g. in a layer handler) is the same rule each
  time.

  Attributes:
    forward: ``forward(x, *params) -> y``: the plain layer (required). It
      must accept ``x`` with any number of leading axes and return one
      array; a None in ``params`` is an absent parameter.
    param_names: one name per parameter input, in order (for messages).
    feature_ndim: the trailing axes of ``x`` one application consumes
      (``0``: every axis is leading, e.g. an embedding's ids).
    gram: ``gram(x, g, params, example_dim, cfg) -> [B, B]``, the Gram
      ``G[i, j] = <g_i, g_j>`` of the per-example gradients of the present
      parameters (``[b, B]``: this device's rows, when ``cfg.column_axes``
      gathers the columns). Default: from ``per_example_grads``.
    sq_norms: ``sq_norms(x, g, params, example_dim, cfg) -> [B]``, its
      diagonal ``|g_i|^2``; with ``cfg.upper_bound`` (clip factors), a
      sound upper bound of the exact values given ``x`` and ``g``, rounding
      included (:mod:`gram_haiku._src.compute.norm_bounds`). Default: from
      ``per_example_grads`` (bounded for the rounding of their sum of
      squares only: exact for a rule whose per-example gradients are what
      is summed).
    per_example_grads: ``per_example_grads(x, g, params, example_dim)``,
      one ``[B, *p.shape]`` array per present parameter ``p``, in order.
      Default: ``vmap`` of the VJP of ``forward`` (exact, ``B x P``).
    probe_cotangent_and_grads: optional fused form, for a rule whose
      per-example gradients also give the parameters' ordinary gradients:
      ``(x, g, params, example_dim, mode, wanted, cfg) -> (value,
      provided)`` with ``value`` the Gram (``mode="gram"``), the squared
      norms (``"norms"``) or the flattened ``[B, P]`` per-example gradients
      (``"per_example"``, columns in parameter order, each parameter's
      entries row-major), and ``provided`` ``{i: cotangent}`` for any
      ``i`` in ``wanted`` (indices into ``params``) whose ordinary
      gradient it computed anyway, in ``params[i]``'s dtype. When given,
      it is used instead of the three functions above in the backward pass.
    cost: ``cost(x, g, params, example_dim, cfg, *, mode, strategy,
      reuse) -> str``: the method the rule's functions should use (e.g.
      ``"ghost"`` or ``"materialize"``), from the shapes and dtypes of its
      arguments only (they may be ``jax.ShapeDtypeStruct``). ``mode`` is
      ``"gram"``, ``"norms"`` or ``"per_example"``; ``strategy`` the plan's
      (``"auto"``, ``"ghost"``, ``"materialize"``); ``reuse``: whether
      materialised per-example gradients would also give the ordinary
      parameter gradients (True in the backward pass, False after it, from
      kept factors). The op consults it once per application and passes
      the answer as ``cfg.method``; a function given ``cfg.method=None``
      decides for itself.
    factors_exact: ``factors_exact(x, params, dtype) -> bool`` (``x`` and
      ``params`` as types: shape and dtype): whether the input survives a
      cast to the float ``dtype`` of a book-keeping probe. Default: a float
      input does, an integer one does not.
    per_example_error: ``per_example_error(x, g, params, example_dim, cfg)
      -> [B]``: a bound, in norm units, of ``|F_i - g_i|``, the rounding
      error of the per-example gradients the rule's functions materialise
      (``per_example_grads``, and ``probe_cotangent_and_grads`` in
      ``"per_example"`` mode) against the exact gradients given ``x`` and
      ``g`` (e.g. ``gamma_T sum_t |x_t| |d_t|`` for a sum over ``T``
      positions; :mod:`gram_haiku._src.compute.norm_bounds`). Clipping adds it to
      the norm of kept per-example gradients. Default: the bound of their
      sum over the within-example positions, ``gamma_T sum_t |g_t|``, from
      the rule's squared norms of each position taken as an example (a
      rule whose per-position gradients themselves sum cancelling terms
      should give its own).
    droppable: indices (into ``param_names``) of parameters whose terms
      the functions above leave out, exactly, when given None for them
      (``forward`` included: the per-example gradients of the others are
      taken through ``forward`` with None in their place, so ``x * gamma
      + beta`` must read ``x if gamma is None else x * gamma``), and
      whose values no other parameter's gradient reads (``x @ w + b``:
      both). A frozen parameter among them costs nothing; for any other,
      the Gram of the trainable parameters is formed from their exact
      per-example gradients.
    sharding_aware: whether ``gram`` takes its row factors through
      ``cfg.rows`` and its column factors through ``cfg.columns`` (which
      gathers them under ``shard_map``, and splits them for a block across
      two sets of examples, :func:`gram_haiku.cross_gram`), returning
      ``[cfg.row_count(B), cfg.column_count(B)]``, and gives its
      contractions row shardings under Explicit meshes. If False (the
      default), such Grams are formed from per-example gradients instead,
      and ``gram`` (or ``probe_cotangent_and_grads`` in ``"gram"`` mode)
      only ever sees one device's whole batch, as one set.

  Raises:
    TypeError: from the constructor, for a missing or non-callable
      function, or a malformed ``param_names``, ``feature_ndim`` or
      ``droppable``.
  """
  forward: Callable[..., jax.Array]
  param_names: tuple[str, ...] = ()
  feature_ndim: int = 1
  gram: Optional[Callable[..., jax.Array]] = None
  sq_norms: Optional[Callable[..., jax.Array]] = None
  per_example_grads: Optional[Callable[..., Sequence[jax.Array]]] = None
  probe_cotangent_and_grads: Optional[Callable[..., Any]] = None
  cost: Optional[Callable[..., str]] = None
  factors_exact: Optional[Callable[..., bool]] = None
  per_example_error: Optional[Callable[..., jax.Array]] = None
  droppable: tuple[int, ...] = ()
  sharding_aware: bool = False

  def __post_init__(self):
    for field in _FUNCTIONS:
      fn = getattr(self, field)
      if (field == "forward" or fn is not None) and not callable(fn):
        raise TypeError(
            f"gram_haiku.Rule: {field} must be a function, got {fn!r}."
            + (" A rule needs at least forward(x, *params) -> y, the plain "
               "layer." if field == "forward" else ""))
    names = self.param_names
    if not (isinstance(names, tuple) and all(isinstance(n, str)
                                             for n in names)):
      raise TypeError(f"gram_haiku.Rule (forward {name_of(self.forward)}): "
                      f"param_names must be a tuple of strings, got "
                      f"{names!r}.")
    if (isinstance(self.feature_ndim, bool) or
        not isinstance(self.feature_ndim, int) or self.feature_ndim < 0):
      raise TypeError(f"gram_haiku.Rule (forward {name_of(self.forward)}): "
                      f"feature_ndim must be an int >= 0, got "
                      f"{self.feature_ndim!r}.")
    if not (isinstance(self.droppable, tuple) and all(
        isinstance(i, int) and 0 <= i < len(names) for i in self.droppable)):
      raise TypeError(f"gram_haiku.Rule (forward {name_of(self.forward)}): "
                      f"droppable must be a tuple of indices into "
                      f"param_names {names}, got {self.droppable!r}.")

  def _fields(self) -> tuple:
    return tuple(_key(getattr(self, f.name))
                 for f in dataclasses.fields(self))

  def __eq__(self, other):
    if not isinstance(other, Rule):
      return NotImplemented
    return self._fields() == other._fields()

  def __hash__(self):
    return hash(self._fields())

  def __repr__(self):
    parts = [f"forward={name_of(self.forward)}"]
    parts += [f"{f}={name_of(getattr(self, f))}" for f in _FUNCTIONS[1:]
              if getattr(self, f) is not None]
    parts += [f"param_names={self.param_names!r}",
              f"feature_ndim={self.feature_ndim}"]
    if self.droppable:
      parts.append(f"droppable={self.droppable!r}")
    if self.sharding_aware:
      parts.append("sharding_aware=True")
    return f"Rule({', '.join(parts)})"


# -- defaults ------------------------------------------------------------------


def accumulation_dtype(x, params) -> jnp.dtype:
  """float32, or float64 where ``x`` or a present parameter is float64."""
  return kernels.accumulation_dtype(*[
      a.dtype for a in (x, *params)
      if a is not None and kernels.is_float(a.dtype)])


def per_example_grads_by_vjp(forward, x, g, params, example_dim: int,
                             which: Optional[Sequence[int]] = None,
                             acc=None) -> list:
  """Exact per-example gradients of ``params[i]``, ``i`` in ``which``.

  ``vmap`` over the example axis of the VJP of ``forward`` with respect to
  those parameters at one example's input (within-example axes included, so
  they are summed over); the other parameters are held fixed. Computed in
  ``acc`` (default: :func:`accumulation_dtype`); memory ``B x P``.

  Args:
    forward: ``forward(x, *params) -> y``.
    x, g, params, example_dim: as in the module docstring.
    which: indices into ``params`` (default: every present one).
    acc: the accumulation dtype.

  Returns:
    One ``[B, *params[i].shape]`` array per index in ``which``.
  """
  if which is None:
    which = [i for i, p in enumerate(params) if p is not None]
  if acc is None:
    acc = accumulation_dtype(x, params)
  live = [hx.vary_like(params[i].astype(acc), x, g) for i in which]
  xm = jnp.moveaxis(x, example_dim, 0)
  if kernels.is_float(xm.dtype):
    xm = xm.astype(acc)
  gm = jnp.moveaxis(g, example_dim, 0).astype(acc)

  def one(xi, gi):
    def fwd(*ps):
      full = list(params)
      for i, p in zip(which, ps):
        full[i] = p
      full = [None if p is None else p.astype(acc) for p in full]
      try:
        return forward(xi, *full).astype(acc)
      except TypeError as e:
        if all(p is not None for p in full):
          raise
        dropped = [i for i, p in enumerate(full) if p is None]
        raise TypeError(
            f"gram_haiku: a rule's forward failed when given None for the "
            f"dropped (frozen) parameter(s) at {dropped} ({e}). A rule "
            "whose `droppable` lists a parameter must accept None for it "
            "in every function, forward included.\nWhat to do: leave "
            "None's term out in forward (e.g. `x if gamma is None else x "
            "* gamma`), or remove the index from droppable.") from e
    _, vjp = jax.vjp(fwd, *live)
    return vjp(gi)
  return jax.vmap(one)(xm, gm)


def flat(grads: Sequence[jax.Array]) -> jax.Array:
  """Per-example gradients ``[B, *shape]`` as one ``[B, P]`` matrix."""
  return jnp.concatenate([kernels.rows(a) for a in grads], axis=1)


def gram_from_per_example(per_example_grads, x, g, params, example_dim: int,
                          cfg: KernelConfig) -> jax.Array:
  """``F F^T`` of ``per_example_grads(x, g, params, example_dim)``: gathers
  its columns and shards its rows as ``cfg`` says."""
  f = flat(per_example_grads(x, g, params, example_dim))
  return kernels.gram_matmul(f, f, cfg)


def sq_norms_from_per_example(per_example_grads, x, g, params,
                              example_dim: int,
                              cfg: KernelConfig = kernels.LOCAL) -> jax.Array:
  """``sum(F * F, axis=1)`` of ``per_example_grads(...)``: ``[B]``
  (``cfg.upper_bound``: rounded up, :func:`kernels.probe_value`)."""
  f = flat(per_example_grads(x, g, params, example_dim))
  return kernels.probe_value("norms", f, cfg)


def per_example_grads_of(rule: Rule, x, g, params, example_dim: int,
                         acc=None):
  """The rule's per-example gradients, or the default (VJP by ``vmap``, in
  ``acc``: default :func:`accumulation_dtype`)."""
  if rule.per_example_grads is not None:
    return rule.per_example_grads(x, g, params, example_dim)
  return per_example_grads_by_vjp(rule.forward, x, g, params, example_dim,
                                  acc=acc)


def gram_of(rule: Rule, x, g, params, example_dim: int,
            cfg: KernelConfig = kernels.LOCAL, acc=None) -> jax.Array:
  """The rule's Gram ``[B, B]``, or the default (from per-example
  gradients, :func:`per_example_grads_of`)."""
  if rule.gram is not None:
    return rule.gram(x, g, params, example_dim, cfg)
  return gram_from_per_example(
      functools.partial(per_example_grads_of, rule, acc=acc), x, g, params,
      example_dim, cfg)


def sq_norms_of(rule: Rule, x, g, params, example_dim: int,
                cfg: KernelConfig = kernels.LOCAL, acc=None) -> jax.Array:
  """The rule's squared norms ``[B]``, or the default (from per-example
  gradients, :func:`per_example_grads_of`)."""
  if rule.sq_norms is not None:
    return rule.sq_norms(x, g, params, example_dim, cfg)
  return sq_norms_from_per_example(
      functools.partial(per_example_grads_of, rule, acc=acc), x, g, params,
      example_dim, cfg)


def rule_name(rule: Rule) -> str:
  """A rule's short name, for messages: its ``forward``'s function name
  without a ``_forward`` suffix or leading underscores (``linear``,
  ``conv``, ``gru_cell``)."""
  fn = rule.forward
  while isinstance(fn, functools.partial):
    fn = fn.func
  name = getattr(fn, "__name__", None) or type(fn).__name__
  name = name.lstrip("_")
  if name.endswith("_forward") and len(name) > len("_forward"):
    name = name[:-len("_forward")]
  return name or "rule"
