"""``reweighted_grad``: ``sum_i c_i g_i``, ``c`` chosen from the same pass.

One backward pass of the tracked loss. Each tracked layer runs its op in a
book-keeping mode instead of its Gram mode: it keeps its factors or its
per-example gradients (:mod:`gram_haiku._src.bookkeeping`), or clips its own
parameter gradients inside its backward rule (``"clip"``, per-layer
clipping). The parameters themselves are not differentiated by the pass
(except those of ``"clip"`` layers), so the plain weight gradient is never
formed. After the pass the Grams (or norms) come from what the layers kept,
``c = weight_fn(grams)``, and every parameter's ``sum_i c_i g_i`` is
re-contracted from the same stores.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Mapping, Optional

import jax
import jax.numpy as jnp

from gram_haiku._src import ambient
from gram_haiku._src import bookkeeping as bk
from gram_haiku._src import cost_model
from gram_haiku._src import errors
from gram_haiku._src import example_sharding
from gram_haiku._src import hijax_compat as hx
from gram_haiku._src import value_grad_and_gram as vgg
from gram_haiku._src.coverage import ParamCoverage
from gram_haiku._src.ops import base
from gram_haiku._src.plan import Clip
from gram_haiku._src.result import Grams

#: What ``weight_fn`` is given: full Grams or their diagonals only.
Needs = Literal["norms", "gram"]
NEEDS = ("norms", "gram")

#: ``frozen=``: parameter names (``"module/name"``) or module names, or a
#: Haiku-style predicate ``(module_name, name, value) -> bool``.
Frozen = Any


@dataclasses.dataclass
class PassResult:
  """What one reweighted pass gives.

  Attributes:
    value: the loss (``(loss, aux)`` with ``has_aux``).
    state: the updated Haiku state.
    grads: ``sum_i c_i g_i`` for every parameter (zero for frozen ones).
    grams: the :class:`Grams` of the pass (``needs`` says full or norms).
    weights: module name -> the ``(B,)`` weights its gradient was formed
      with (one vector for all modules unless clipped per layer).
    modes: module name -> what the layer kept (``"factors"``,
      ``"per_example"``) or ``"clip"``.
  """
  value: Any
  state: Any
  grads: Any
  grams: Grams
  weights: Mapping[str, jax.Array]
  modes: Mapping[str, str]


def frozen_leaves(frozen: Frozen, params) -> set[str]:
  """Full names (``module/name``) of the frozen parameter leaves."""
  names = vgg.leaf_names(params)
  if frozen is None:
    return set()
  if callable(frozen):
    out = set()
    for module, entries in params.items():
      for name, value in entries.items():
        if frozen(module, name, value):
          out.add(f"{module}/{name}")
    return out
  if isinstance(frozen, str):
    frozen = (frozen,)
  wanted = set(frozen)
  out = {n for n in names if n in wanted or n.rsplit("/", 1)[0] in wanted}
  unknown = sorted(w for w in wanted if not any(
      n == w or n.rsplit("/", 1)[0] == w for n in names))
  if unknown:
    raise ValueError(f"gram_haiku: frozen={sorted(wanted)} names "
                     f"{unknown}, which are neither parameters nor modules "
                     f"of params (they are {names}).")
  return out


def _check_complete(fn_name: str, coverage, frozen: set[str],
                    privacy: bool) -> None:
  missing = sorted(k for k, c in coverage.items()
                   if not c.tracked and k not in frozen)
  if missing:
    why = "; ".join(f"{k}: read by {coverage[k].module_type}"
                    for k in missing)
    raise ValueError(errors.REWEIGHT_UNTRACKED.format(
        fn=fn_name, params=missing, why=why,
        privacy=(" (a privacy guarantee would silently break)"
                 if privacy else "")))


def _mode_of(module: str, op, stacked: bool, found, ambiguous: set,
             needs: str, axes, per_layer: bool, dtype) -> str:
  """What a layer keeps through the pass (see the module docstring)."""
  if (module in found.shared or stacked or module in found.example_specs or
      op.name in ambiguous):
    return "per_example"
  if per_layer:
    return "clip"
  if axes and needs == "gram":
    return "per_example"  # The Gram's columns are gathered from F rows.
  exact = op.factors_exact(dtype)
  if op.plan.strategy == "materialize" or not exact:
    return "per_example"  # track(strategy=...) also chooses the store.
  if op.plan.strategy == "ghost":
    return "factors"
  return cost_model.bookkeeping_method(op.num_params(), op.factor_width(),
                                       exact)


def run(apply_fn, params, state, rng, args, kwargs, *, fn_name: str,
        needs: str, has_aux: bool, axes: tuple[str, ...], frozen: Frozen,
        weight_fn: Optional[Callable[[Grams], jax.Array]] = None,
        clips: Optional[Callable[[list[str]], Mapping[str, Clip]]] = None,
        example_weights: Optional[jax.Array] = None,
        privacy: bool = False) -> PassResult:
  """One reweighted pass (see the module docstring).

  Exactly one of ``weight_fn`` (one ``c`` for every module, from the Grams)
  and ``clips`` (per-layer clipping: ``clips(modules) -> {module: Clip}``)
  is given. ``example_weights``: ``(B,)`` factors every ``c`` is multiplied
  by (a padding mask), or None.
  """
  rest, probes = vgg.split_probes(state)
  if not probes:
    raise ValueError(errors.NO_PROBES)
  n_devices = vgg._check_mesh_axes(axes)  # pylint: disable=protected-access
  leaves, treedef = jax.tree_util.tree_flatten(params)
  names = vgg.leaf_names(params)
  frozen_names = frozen_leaves(frozen, params)

  def loss_of(params, probes, rng, args, kwargs):
    out, new_state = apply_fn(params, vgg.merge_probes(rest, probes), rng,
                              *args, **kwargs)
    value, aux = out if has_aux else (out, None)
    if jnp.shape(value) != ():
      raise ValueError(errors.NOT_SCALAR.format(
          shape=jnp.shape(value), dtype=jnp.result_type(value)))
    return value, (aux, new_state)

  if axes:
    probes = {m: hx.vary_over(p, axes) for m, p in probes.items()}
  found, seen, check_examples = vgg._discover(  # pylint: disable=protected-access
      lambda *a: loss_of(*a)[0], params, probes, rng, args, kwargs, axes)
  if not found.sizes:
    raise ValueError(errors.NO_FORWARD_USE.format(
        modules=", ".join(sorted(probes))))
  size = vgg._check_example_axes(found, check_examples(strict=privacy))  # pylint: disable=protected-access
  coverage = vgg._coverage(params, seen, found)  # pylint: disable=protected-access
  _check_complete(fn_name, coverage, frozen_names, privacy)

  # Which modules are frozen (all their leaves), and a teaching error for
  # a tracked layer that is only partly frozen.
  frozen_modules = set()
  for m, idx in found.param_leaves.items():
    mine = [names[k] for k in idx if k is not None]
    cold = [n for n in mine if n in frozen_names]
    if cold and len(cold) < len(mine):
      raise ValueError(errors.PARTIALLY_FROZEN.format(
          fn=fn_name, module=m, frozen=cold,
          trainable=[n for n in mine if n not in frozen_names]))
    if cold or not mine:
      frozen_modules.add(m)
  live = sorted(m for m in probes if m in found.ops and
                m not in frozen_modules)
  layer_clips = dict(clips(live)) if clips is not None else {}

  by_name: dict[str, set] = {}
  for m in live:
    by_name.setdefault(found.ops[m].name, set()).add(m)
  ambiguous = {n for n, ms in by_name.items() if len(ms) > 1}
  modes, shapes = {}, {}
  for m in live:
    op, p = found.ops[m], probes[m]
    lead = tuple(p.shape[:p.ndim - vgg._probe_ndim(p, found, m)])  # pylint: disable=protected-access
    dtype = found.probe_dtypes.get(m, p.dtype)
    modes[m] = _mode_of(m, op, bool(lead), found, ambiguous, needs, axes,
                        m in layer_clips, dtype)
    width = op.num_params() if modes[m] == "per_example" else (
        op.factor_width())
    shapes[m] = lead + base.probe_shape(modes[m], size, width)

  ones = jnp.ones((size,), jnp.float32)
  mask = ones if example_weights is None else example_weights

  def fresh_probe(m):
    dtype = found.probe_dtypes.get(m, probes[m].dtype)
    if modes[m] == "clip":
      probe = jnp.broadcast_to(mask.astype(dtype), shapes[m])
    else:
      probe = jnp.zeros(shapes[m], dtype)
    own = 1 if modes[m] == "clip" else 2
    probe = vgg._rows_sharded(probe, found.example_specs.get(m), own)  # pylint: disable=protected-access
    return hx.vary_over(probe, axes) if axes else probe
  diff_probes = {m: fresh_probe(m) for m in live}
  fixed_probes = {m: p for m, p in probes.items() if m not in diff_probes}
  # Only the parameters of layers that clip inside their backward rule are
  # differentiated: every other gradient is re-contracted after the pass.
  diff_idx = sorted({k for m in live if modes[m] == "clip"
                     for k in found.param_leaves[m] if k is not None})

  def loss(diff_leaves, diff_probes):
    full = list(leaves)
    for k, v in zip(diff_idx, diff_leaves):
      full[k] = v
    p = jax.tree_util.tree_unflatten(treedef, full)
    return loss_of(p, {**fixed_probes, **diff_probes}, rng, args, kwargs)

  layer_name = {found.ops[m].name: modes[m] for m in live}
  clip_by_name = {found.ops[m].name: layer_clips[m] for m in live
                  if modes[m] == "clip"}
  with ambient.running(ambient.PassPlan(column_axes=axes, modes=layer_name,
                                        clips=clip_by_name)):
    (value, (aux, new_state)), (clip_grads, probe_grads) = (
        jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            [leaves[k] for k in diff_idx], diff_probes))
  if has_aux:
    value = (value, aux)
  del n_devices

  want = "gram" if needs == "gram" else "norms"
  full, diag = {}, {}
  for m in live:
    op, g = found.ops[m], probe_grads[m]
    if modes[m] == "factors":
      val = bk.from_factors(op, g, bk.op_params(op, leaves,
                                                found.param_leaves[m]), want)
    elif modes[m] == "per_example":
      val = vgg._from_per_example(g, want, axes)  # pylint: disable=protected-access
    else:
      val = g
    (full if want == "gram" and modes[m] != "clip" else diag)[m] = val
  for name in frozen_names:
    coverage[name] = ParamCoverage(True, "frozen", coverage[name].module_type)
  grams = Grams(full, diag, coverage, axes)

  weights = {}
  if weight_fn is not None:
    c = jnp.asarray(weight_fn(grams))
    if c.shape != (size,) or not jnp.issubdtype(c.dtype, jnp.floating):
      raise ValueError(errors.WEIGHTS_SHAPE.format(
          got=f"{c.dtype}{list(c.shape)}", size=size))
    c = c * mask.astype(c.dtype)
    weights = {m: c for m in live}
  else:
    for m in live:
      weights[m] = base.clip_weights(diag[m], layer_clips[m]) * mask

  grads = [jnp.zeros_like(l) for l in leaves]
  for k, ct in zip(diff_idx, clip_grads):
    grads[k] = ct
  for m in live:
    op, g, idx = found.ops[m], probe_grads[m], found.param_leaves[m]
    if modes[m] == "factors":
      cts = bk.recontract_factors(op, g, bk.op_params(op, leaves, idx),
                                  weights[m])
    elif modes[m] == "per_example":
      cts = bk.recontract_per_example(op, g, weights[m])
    else:
      continue
    for k, ct in cts.items():
      if idx[k] is not None:
        grads[idx[k]] = grads[idx[k]] + bk.to_leaf(ct, leaves[idx[k]])
  grads = jax.tree_util.tree_unflatten(treedef, grads)
  return PassResult(value, new_state, grads, grams, weights, modes)


def check_needs(needs) -> None:
  if needs not in NEEDS:
    raise ValueError(f"needs={needs!r}: expected one of {NEEDS}.")


def reweighted_grad(apply_fn: Callable[..., Any],
                    weight_fn: Callable[[Grams], jax.Array], *,
                    needs: str = "norms", has_aux: bool = False,
                    return_state: bool = False,
                    mesh_axes: str | tuple[str, ...] | None = None,
                    frozen: Frozen = None) -> Callable[..., Any]:
  """Transforms a tracked ``apply`` into one returning ``sum_i c_i g_i``.

  ``c = weight_fn(grams)`` is computed from the Grams of the same backward
  pass, and the gradient ``sum_i c_i g_i`` of every parameter is formed
  without a second backward pass: each tracked layer keeps its
  book-keeping factors (input and output cotangent) or its per-example
  gradients, whichever is smaller, and is re-contracted once ``c`` is
  known (Bu et al. 2023, the book-keeping trick; see
  :mod:`gram_haiku._src.bookkeeping`). Exact for every tracked layer,
  shared modules, :func:`gram_haiku.unembed`, ``hk.layer_stack`` and scans
  included. Any linear combination of per-example gradients is such a
  ``c``: clipping (:func:`gram_haiku.clipped_grad`), reweighting, dropping
  examples whose gradient disagrees with the batch.

  Args:
    apply_fn: ``apply`` of ``hk.transform_with_state(f)``, where ``f`` runs
      its model inside ``gram_haiku.track()`` and returns the scalar loss
      ``sum_i l_i`` (a mean scales every ``g_i`` by ``1/B``).
    weight_fn: ``grams -> f32[B]``, the weights ``c``; traced (jit-able).
      Given a :class:`Grams` whose ``norms``/``sq_norms`` are exact, and
      whose ``total`` exists when ``needs="gram"``.
    needs: ``"norms"`` (default; costs linear in ``B``) or ``"gram"`` (the
      full ``[B, B]`` Grams, e.g. for cosines between examples).
    has_aux, return_state, mesh_axes: as in
      :func:`gram_haiku.value_grad_and_gram`. Under ``shard_map``
      ``weight_fn`` sees this device's rows and returns its ``(b,)``
      weights; the gradients are summed over devices.
    frozen: parameters with zero gradient that need no Gram rule:
      ``"module/name"`` or module names, or a predicate
      ``(module_name, name, value) -> bool``. A tracked module must be
      frozen whole.

  Returns:
    ``fn(params, state, rng, *args, **kwargs) -> (value, grads, grams, c)``
    (``((value, new_state), grads, grams, c)`` with ``return_state``):
    ``grads`` has the structure of ``params``, ``c`` is ``f32[B]``.

  Raises:
    ValueError: for a trainable parameter no Gram rule covers (its
      per-example gradient is unknown), a partly frozen tracked module, a
      ``weight_fn`` result that is not ``(B,)`` floats, and every error of
      :func:`gram_haiku.value_grad_and_gram`.
  """
  check_needs(needs)
  axes = example_sharding.normalize_axes(mesh_axes)

  def fn(params, state, rng, *args, **kwargs):
    r = run(apply_fn, params, state, rng, args, kwargs,
            fn_name="reweighted_grad", needs=needs, has_aux=has_aux,
            axes=axes, frozen=frozen, weight_fn=weight_fn)
    c = next(iter(r.weights.values())) if r.weights else None
    value = (r.value, r.state) if return_state else r.value
    return value, r.grads, r.grams, c

  return fn
