"""The probe modes every rule gets: what the backward pass writes, by mode.

A rule (a :class:`~gram_haiku._src.rules.rule.Rule`) says how to compute one
layer's Gram, squared norms and per-example gradients (``gram``,
``sq_norms``, ``per_example_grads``, ``probe_cotangent_and_grads``) and
which method they use (``cost``). This module is the one place that turns
the op's plan (:class:`~gram_haiku._src.compute.plan.Plan`) into calls of those
functions, for every rule alike:

* ``"gram"``, ``"norms"``, ``"per_example"``: the rule's own products, of
  its trainable parameters only (:func:`products`: a parameter in
  ``Plan.frozen`` has no term), with the method its cost function chose,
  consulted once per application (:func:`with_method`);
* ``"factors"``: the layer's input and output cotangent per example
  (:mod:`gram_haiku._src.ops.factors`), for book-keeping after the pass;
* ``"clip"``: sound upper bounds of the squared norms
  (:mod:`gram_haiku._src.compute.norm_bounds`), while the parameters get the
  clipped sum ``sum_i m_i c_i g_i`` with ``c`` computed from those bounds
  (per-layer clipping inside the backward rule).

The adapter (:mod:`gram_haiku._src.ops.adapter`) calls
:func:`backward_products` once per application in the backward pass.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.compute import cost_model
from gram_haiku._src.compute import explicit_mesh
from gram_haiku._src.compute import kernels
from gram_haiku._src.compute import norm_bounds
from gram_haiku._src.compute.kernels import KernelConfig
from gram_haiku._src.ops import factors
from gram_haiku._src.rules import rule as rule_lib

#: The modes whose value the rule's own functions give (and whose method
#: its cost function decides): the rule's function for each, and what it
#: returns (for messages).
RULE_FUNCTIONS = {"gram": ("gram", "(B, B) Gram"),
                  "norms": ("sq_norms", "(B,) squared norms"),
                  "per_example": ("per_example_grads",
                                  "(B, P) per-example gradients")}
RULE_MODES = tuple(RULE_FUNCTIONS)


def value_shape(op, b: int, cfg: KernelConfig) -> tuple[int, ...]:
  """The shape of a rule mode's value for ``b`` examples on this device:
  the Gram's rows and columns (``cfg``), ``(b,)`` squared norms, or ``(b,
  P)`` per-example gradients of the op's ``P`` parameter entries."""
  return {"gram": (cfg.row_count(b), cfg.column_count(b)),
          "norms": (b,)}.get(op.mode, (b, op.num_params()))


def clip_weights(sq_norms, clip) -> jax.Array:
  """``c_i`` of a :class:`~gram_haiku._src.compute.plan.Clip` from squared norms.

  ``"abadi"``: ``min(1, C / |g_i|)``; ``"automatic"``: ``C / (|g_i| +
  gamma)``. A norm of zero gives 1 (``"abadi"``); a norm that is not finite
  gives 0, so that such an example contributes nothing.

  Args:
    sq_norms: ``[B]`` squared per-example gradient norms.
    clip: the :class:`~gram_haiku._src.compute.plan.Clip` (threshold ``C`` in the
      units of the gradient norm).

  Returns:
    ``[B]`` weights in the dtype of ``sq_norms``.
  """
  norm = jnp.sqrt(jnp.maximum(sq_norms, 0))
  c = jnp.asarray(clip.l2_clip_norm, norm.dtype)
  if clip.function == "automatic":
    w = c / (norm + jnp.asarray(clip.gamma, norm.dtype))
  else:
    w = jnp.where(norm > c, c / jnp.where(norm > 0, norm, 1), 1)
  return jnp.where(jnp.isfinite(norm), w, 0).astype(norm.dtype)


def probe_width(op) -> int:
  """The second axis of a ``"per_example"`` probe (``P``, the op's parameter
  entries, and one more for the rounding bound where ``Plan.upper_bound``)
  or of a ``"factors"`` probe (``K``, see
  :func:`~gram_haiku._src.ops.factors.factor_width`)."""
  if op.mode == "factors":
    return factors.factor_width(op)
  return op.num_params() + int(op.plan.upper_bound)


def per_example_error(op, x, g, params, cfg: KernelConfig) -> jax.Array:
  """``[B]``: the bound of the materialised per-example gradients' rounding
  error, in norm units: the rule's own (``Rule.per_example_error``), else
  that of their sum over the ``T`` within-example positions,
  ``e_T sum_t |g_t|`` with each position's gradient norm ``|g_t|`` from
  the op's own squared norms of the positions taken as examples (in blocks
  within the memory budget; :mod:`gram_haiku._src.compute.norm_bounds`)."""
  rule = op.rule
  e = op.example_axis.resolved_position()
  acc = op.accumulation_dtype()
  if rule.per_example_error is not None:
    return rule.per_example_error(x, g, params, e, cfg).astype(acc)
  lead_nd = x.ndim - op.feature_ndim
  b = x.shape[e]
  t = math.prod(x.shape[:lead_nd]) // max(b, 1) if b else 1
  if isinstance(t, int) and t <= 1:  # No sum over positions.
    return hx.vary_like(jnp.zeros((b,), acc), x, g)
  rows = lambda a: jnp.moveaxis(a, e, 0).reshape(
      (b * t,) + a.shape[lead_nd:])
  local = cfg.replace(upper_bound=False, column_axes=(), method=None)
  per_row = max(1, op.num_params() * jnp.dtype(acc).itemsize)
  block = max(1, cfg.memory_budget_bytes // per_row)
  sq = kernels.map_row_blocks(
      lambda xb, gb: rule_lib.sq_norms_of(rule, xb, gb, params, 0, local,
                                          acc=acc), block,
      (rows(x), rows(g)))
  norms = jnp.sqrt(jnp.maximum(sq, 0).astype(acc) * (
      1 + norm_bounds.squares_rel(op.num_params(), acc)))
  return norm_bounds.dot_error(t, acc, cfg.precision) * jnp.sum(
      norms.reshape(b, t), axis=1)


def with_method(op, x, g, params, cfg: KernelConfig,
                reuse: bool = True) -> KernelConfig:
  """``cfg`` with ``method`` set by the op's rule's cost function: the one
  consultation of the cost model for this application.

  Args:
    op: the Gram op (its plan gives the mode and the strategy).
    x, g, params: the op's input, output cotangent and parameters (only
      their shapes and dtypes are read).
    cfg: the kernel configuration (columns, memory budget).
    reuse: whether materialised per-example gradients also give the
      ordinary parameter gradients (in the backward pass; not after it,
      where a Gram is formed from kept factors).

  Returns:
    ``cfg`` itself for an op without a cost function (or outside the
    rule's modes), else ``cfg.replace(method=...)``.
  """
  rule = op.rule
  if rule.cost is None or op.mode not in RULE_MODES:
    return cfg
  x, g, params = jax.tree_util.tree_map(_costed, (x, g, params))
  method = rule.cost(x, g, params, op.example_axis.resolved_position(), cfg,
                     mode=op.mode, strategy=op.strategy, reuse=reuse)
  return cfg.replace(method=method)


def _costed(a):
  """``a`` itself when its sizes are known; else its shape and dtype with
  every symbolic size (``jax.export``'s shape polymorphism) replaced by
  :data:`~gram_haiku._src.compute.cost_model.SYMBOLIC_SIZE`. A cost function
  compares sizes, which a symbolic size cannot answer; every method is
  exact, so this choice moves only the time and memory of the program."""
  shape = getattr(a, "shape", None)
  if shape is None or all(isinstance(d, int) for d in shape):
    return a
  return jax.ShapeDtypeStruct(tuple(map(cost_model.size_hint, shape)),
                              a.dtype)


def rule_products(op, x, g, params, wanted, cfg: KernelConfig):
  """The probe's cotangent in ``"gram"``, ``"norms"`` or ``"per_example"``
  mode from the op's rule.

  The rule's fused ``probe_cotangent_and_grads`` where it has one (which
  may also give parameter cotangents); else, by mode, its ``gram``,
  ``sq_norms`` or flattened ``per_example_grads`` (each with its default,
  :mod:`gram_haiku._src.rules.rule`). A rule that is not ``sharding_aware``
  gets the Gram of a sharded example axis from exact per-example
  gradients, which gather their columns (``shard_map``) and place their
  rows (Explicit meshes).

  Args:
    op: the Gram op (its plan gives the mode; its rule the functions).
    x, g, params: the op's input, output cotangent and parameters (None
      for absent ones).
    wanted: indices (into ``params``) of the parameters whose ordinary
      cotangent is needed.
    cfg: as the rule's functions get it; ``cfg.method`` holds the method
      the rule's cost function chose for this application.

  Returns:
    ``(value, provided)``: the probe's cotangent (Gram, squared norms or
    per-example gradients, by mode) and ``{index: cotangent}`` for
    parameters whose ordinary gradient was computed anyway (the sum of
    materialised per-example gradients), in the parameter's dtype, so that
    it is not computed twice.

  Raises:
    ValueError: when the rule's Gram or norms have the wrong shape.
  """
  rule = op.rule
  acc = op.accumulation_dtype()
  e = op.example_axis.resolved_position()
  # A Gram whose examples are sharded (or a block across two sets of
  # examples), from a rule that does not take its rows and columns through
  # cfg itself: from exact per-example gradients (fused rules too).
  by_rows = op.mode == "gram" and not op.sharding_aware and bool(
      cfg.column_axes or cfg.row_split is not None or
      explicit_mesh.explicit_spec(x) is not None)
  fused = rule.probe_cotangent_and_grads is not None and not by_rows
  provided = {}
  if fused:
    value, provided = rule.probe_cotangent_and_grads(x, g, params, e, op.mode,
                                                     tuple(wanted), cfg)
  elif op.mode == "gram" and by_rows:
    value = rule_lib.gram_from_per_example(
        functools.partial(rule_lib.per_example_grads_of, rule, acc=acc),
        x, g, params, e, cfg)
  elif op.mode == "gram":
    value = rule_lib.gram_of(rule, x, g, params, e, cfg, acc=acc)
  elif op.mode == "norms":
    value = rule_lib.sq_norms_of(rule, x, g, params, e, cfg, acc=acc)
  else:
    value = rule_lib.flat(rule_lib.per_example_grads_of(rule, x, g, params,
                                                        e, acc=acc))
  _check_result(op, value, x, cfg, fused)
  return value, provided


def _check_result(op, value, x, cfg: KernelConfig, fused: bool) -> None:
  """A rule's value for the probe: a teaching error for a shape that is
  not the mode's or a dtype narrower than the accumulation dtype."""
  b = op.example_size(x.shape)
  want = value_shape(op, b, cfg)
  method, what = RULE_FUNCTIONS[op.mode]
  if op.mode != "per_example" and tuple(value.shape) != want:
    if fused:
      method = f"probe_cotangent_and_grads (mode {op.mode!r})"
    cols = want[-1]
    held = (f"b = {b} examples on this device, B = {cols} in all"
            if op.mode == "gram" and cols != b else f"B = {b} examples")
    raise ValueError(
        f"gram_haiku: the {method} of rule {op.kind!r} for layer "
        f"{op.name!r} returned shape {tuple(value.shape)}, expected "
        f"{want} ({held}, input shape {tuple(x.shape)}).\n"
        f"What to do: return the {what} of the per-example gradients; "
        "the conformance suite (python -m gram_haiku.conformance) checks a "
        "rule's shapes.")
  acc = jnp.dtype(op.accumulation_dtype())
  got = jnp.dtype(value.dtype)
  if (jnp.issubdtype(got, jnp.floating) and
      jnp.issubdtype(acc, jnp.floating) and got.itemsize < acc.itemsize):
    if fused:
      method = f"probe_cotangent_and_grads (mode {op.mode!r})"
    raise ValueError(
        f"gram_haiku: the {method} of rule {op.kind!r} for layer "
        f"{op.name!r} returned {got.name}, narrower than the accumulation "
        f"dtype {acc.name} of its operands: the {op.mode} would be rounded to "
        f"{got.name} (about {jnp.finfo(got).eps:.0e} relative).\n"
        "What to do: compute and return it in the accumulation dtype "
        "(float32, or float64 where x or a parameter is float64): cast x "
        "and g to it first, as the built-in rules do.")


def products(op, x, g, params, wanted, cfg: KernelConfig,
             reuse: bool = True):
  """The rule's ``probe_cotangent_and_grads``, of the trainable parameters
  only: those in ``Plan.frozen`` have no gradient, so they have no term in
  the Gram or the norms, and zero columns among the per-example gradients.

  ``params[i]`` may be None for a frozen one when the rule's ``droppable``
  holds it (after the pass, where only the parameter leaves are known).
  A frozen parameter the rule cannot drop is handled by exact per-example
  VJPs of the others (``B x P`` memory for those). ``reuse``: as
  :func:`with_method` (whose method ``cfg`` then carries).

  With ``Plan.upper_bound``, squared norms are sound upper bounds and
  per-example gradients carry one more column: their rounding bound
  (:func:`per_example_error`).

  Returns:
    ``(value, provided)`` as :func:`rule_products`.
  """
  if op.plan.upper_bound:
    cfg = cfg.replace(upper_bound=True)
  value, provided, own = _products(op, x, g, params, wanted, cfg, reuse)
  if op.mode == "per_example" and op.plan.upper_bound:
    err = per_example_error(op, x, g, params, cfg)
    value = jnp.concatenate([value, err[:, None].astype(value.dtype)], 1)
  elif op.mode == "norms" and cfg.upper_bound and not own:
    # Norms from materialised per-example gradients: add their rounding.
    err = per_example_error(op, x, g, params, cfg)
    value = jnp.square(jnp.sqrt(jnp.maximum(value, 0)) + err.astype(
        value.dtype))
  return value, provided


def _own_norms(op) -> bool:
  """Whether the op's rule forms its squared norms itself (and so honours
  ``cfg.upper_bound`` itself), rather than from per-example gradients."""
  rule = op.rule
  return (rule.sq_norms is not None or
          rule.probe_cotangent_and_grads is not None)


def _products(op, x, g, params, wanted, cfg: KernelConfig, reuse: bool):
  """:func:`products` without the rounding bound's column: ``(value,
  provided, own)``, ``own`` whether the rule's own functions formed the
  value (else it comes from materialised per-example gradients, whose
  rounding :func:`products` adds to bounded norms)."""
  cfg = with_method(op, x, g, params, cfg, reuse)
  frozen = [i for i in op.plan.frozen or ()
            if op.param_avals[i] is not None]
  if not frozen:
    return (*rule_products(op, x, g, params, wanted, cfg), _own_norms(op))
  wanted = [i for i in wanted if i not in frozen]
  keep = [i for i, a in enumerate(op.param_avals)
          if a is not None and i not in frozen]
  e = op.example_axis.resolved_position()
  if not keep:  # A frozen layer: no term at all.
    shape = value_shape(op, x.shape[e], cfg)
    return (hx.vary_like(jnp.zeros(shape, op.accumulation_dtype()), x, g),
            {}, True)
  if set(frozen) <= set(op.droppable):
    masked = [None if i in frozen else p for i, p in enumerate(params)]
    if op.mode != "per_example":
      return (*rule_products(op, x, g, masked, wanted, cfg), _own_norms(op))
    grads = rule_lib.per_example_grads_of(op.rule, x, g, masked, e,
                                          acc=op.accumulation_dtype())
  else:
    grads = rule_lib.per_example_grads_by_vjp(op.rule.forward, x, g, params,
                                              e, keep,
                                              acc=op.accumulation_dtype())
  f = jnp.concatenate([kernels.rows(a) for a in grads], axis=1)
  if op.mode != "per_example":
    return kernels.probe_value(op.mode, f, cfg), {}, False
  # Zero columns for the frozen parameters, so that the store keeps the
  # layout of every parameter (see :func:`probe_width`).
  cols, start = [], 0
  for i, a in enumerate(op.param_avals):
    if a is None:
      continue
    n = math.prod(a.shape)
    if i in frozen:
      cols.append(jnp.zeros((f.shape[0], n), f.dtype))
    else:
      cols.append(f[:, start:start + n])
      start += n
  return jnp.concatenate(cols, axis=1), {}, False


def backward_products(op, x, g, params, wanted, cfg: KernelConfig,
                      weights=None):
  """The probe's cotangent and the parameter cotangents found on the way,
  by the op's mode (see the module docstring).

  Args:
    op: the Gram op (its plan gives the mode, ``Plan.frozen`` and
      ``Plan.clip``).
    x: the op's input; ``g``: its output cotangent.
    params: the parameter inputs (None for absent ones).
    wanted: indices of the parameters whose ordinary cotangent is needed.
    cfg: the columns to gather and the memory budget.
    weights: ``"clip"`` mode only: ``[B]`` per-example weights ``m_i`` (the
      probe's value: 1, or 0 for a padded row).

  Returns:
    ``(value, provided)``: the probe's cotangent and ``{index: cotangent}``
    for parameters whose cotangent was computed here (the adapter runs
    JAX's own VJP for the others).
  """
  if op.mode == "factors":
    return factors.factor_matrix(op, x, g), {}
  if op.mode == "clip":
    # The clip factor comes from a norm not below the true one. Nothing
    # reuses materialised per-example gradients here (the clipped sum is
    # re-contracted from the factors below), so the cost model weighs
    # forming them whole against the ghost norms (reuse=False): counted as
    # reused, a ViT-S/4's per-layer step (T = 65) materialised every layer
    # and took 31.1 ms on a TPU v5e against 16.9 ms by the ghost norms.
    sq = products(op.in_mode("norms"), x, g, params, (),
                  cfg.replace(upper_bound=True), reuse=False)[0]
    c = clip_weights(sq, op.plan.clip) * weights.astype(sq.dtype)
    wanted = [i for i in wanted if i not in (op.plan.frozen or ())]
    provided = factors.reweighted_param_grads(op, x, g, params, c, wanted)
    return sq, {i: hx.reduce_to_type_of(ct, params[i]).astype(
        params[i].dtype) for i, ct in provided.items()}
  return products(op, x, g, params, wanted, cfg)
