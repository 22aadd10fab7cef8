"""``gram_haiku.verify``: a cheap self-check of a tracked model's Grams.

On a few examples of the user's own batch it computes the Grams with
:func:`gram_haiku.value_grad_and_gram` and the reference ``F @ F.T`` of the
same model with every ``track()`` switched off (plain Haiku modules): ``F``
holds each example's gradient, from ``jax.vmap(jax.jacrev(loss))`` of the
loss on that example alone. It reports the largest error per tracked layer,
of the total and of the norms, the parameters the Gram leaves out, and
whether the loss is a sum or a mean over examples at all: a loss that is
neither (a batch softmax, a contrastive loss, batch statistics) couples the
examples, and no per-example Gram exists for it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gram_haiku._src.api import reweight
from gram_haiku._src.api import value_grad_and_gram as vgg
from gram_haiku._src.core import reference
from gram_haiku._src.frontend import ambient
from gram_haiku._src.passes import batch_args
from gram_haiku._src.passes.pass_trace import leaf_names


@dataclasses.dataclass(frozen=True)
class VerifyReport:
  """What :func:`verify` found.

  Attributes:
    ok: every check passed within ``tolerance``.
    examples: the number of examples checked.
    loss_scale: ``"sum"`` or ``"mean"`` (how the loss combines examples),
      or None when it is neither (coupled examples).
    layer_errors: tracked module -> max relative error of its Gram (or, for
      ``track(mode="norms")``, of its squared norms) against the reference.
    total_error: max relative error of the sum of the tracked layers' Grams
      against the reference over every parameter (large when parameters
      are untracked).
    norms_error: max relative error of ``grams.norms``.
    clip_norms_shortfall: how far below the reference norm the norm bounds
      of a clipping pass (what :func:`gram_haiku.clipped_grad` computes
      its clip factors from) fall, relative (0 when none is below; NaN
      when ``clipped_grad`` refuses the model).
    clip_refusal: why :func:`gram_haiku.clipped_grad` refuses the model
      (its error message), or None. Not a problem of the Grams.
    untracked: parameters the Gram leaves out (``grams.untracked``).
    problems: one sentence per failed check.
    tolerance: the relative tolerance used.
  """
  ok: bool
  examples: int
  loss_scale: Optional[str]
  layer_errors: Mapping[str, float]
  total_error: float
  norms_error: float
  untracked: tuple[str, ...]
  problems: tuple[str, ...]
  tolerance: float
  clip_norms_shortfall: float = 0.0
  clip_refusal: Optional[str] = None

  def __str__(self):
    lines = [f"gram_haiku.verify: {'OK' if self.ok else 'FAILED'} on "
             f"{self.examples} examples (loss: {self.loss_scale or 'coupled'}"
             f", tolerance {self.tolerance:.0e})"]
    for name, err in sorted(self.layer_errors.items()):
      lines.append(f"  {name:<40s} max rel. error {err:.2e}")
    lines.append(f"  {'(total)':<40s} max rel. error {self.total_error:.2e}")
    lines.append(f"  {'(norms)':<40s} max rel. error {self.norms_error:.2e}")
    lines.append(f"  {'(clip norm bounds)':<40s} below the reference by "
                 f"{self.clip_norms_shortfall:.2e}")
    lines.extend(f"  problem: {p}" for p in self.problems)
    return "\n".join(lines)


def _take(args, axes, n):
  """The first ``n`` examples of each batch argument (``axes[k]``: its
  example axis, or None for an argument without examples)."""
  return tuple(arg if ax is None else jax.tree.map(
      lambda a, ax=ax: jax.lax.slice_in_dim(a, 0, n, axis=ax), arg)
               for arg, ax in zip(args, axes))


def _tolerance(params) -> float:
  low = any(jnp.dtype(a.dtype).itemsize < 4 for a in jax.tree.leaves(params)
            if jnp.issubdtype(a.dtype, jnp.floating))
  return reference.TOLERANCES["bfloat16" if low else "float32"][0] * 10


def verify(apply_fn: Callable[..., Any], params, state, rng, *args,
           max_examples: int = 8, rtol: Optional[float] = None,
           example_axes: Optional[Sequence[Optional[int]]] = None,
           has_aux: bool = False, **kwargs) -> VerifyReport:
  """Checks a tracked model's Grams against the reference on a few examples.

  Run it once on a new architecture, with a real batch: it costs one
  ``value_grad_and_gram`` call, one pass of :func:`gram_haiku.clipped_grad`
  (whose norm bounds it checks) and ``max_examples`` plain backward
  passes.

  Args:
    apply_fn: ``apply`` of ``hk.transform_with_state(f)``, where ``f`` calls
      its model inside ``gram_haiku.track()`` and returns a scalar loss
      that is the sum or the mean of per-example losses.
    params, state, rng: as for ``apply_fn`` (``state`` from its ``init``).
    *args: the batch; every array's axis 0 is the example axis, unless
      ``example_axes`` says otherwise.
    max_examples: how many examples (the first ones) to check.
    rtol: the relative tolerance (default: 1e-3 for float32 parameters,
      0.2 with bfloat16 or float16 ones).
    example_axes: as in :func:`gram_haiku.value_grad_and_gram`: per
      argument, the axis that holds the examples, or None.
    has_aux: the function returns ``(loss, aux)``.
    **kwargs: passed to ``apply_fn``.

  Returns:
    A :class:`VerifyReport`; ``print`` it, and check ``report.ok``.

  A model that :func:`gram_haiku.value_grad_and_gram` refuses (a coupled
  loss, a layer input without the examples) gives a report whose problem is
  that error's message.

  Raises:
    ValueError: when the batch has no example axis, or no example.
  """
  axes, n, batch = _first_examples(args, example_axes, max_examples)
  tol = rtol if rtol is not None else _tolerance(params)
  # Each computation of the check runs under jit: one compiled program, not
  # one per primitive (op-by-op dispatch). The arguments are arrays (rng
  # may be None); **kwargs, which need not be, are closed over.
  grams_fn = vgg.value_grad_and_gram(apply_fn, example_axes=example_axes,
                                     has_aux=has_aux)
  try:
    grams = jax.jit(lambda *a: grams_fn(*a, **kwargs)[2])(
        params, state, rng, *batch)
  except ValueError as e:  # A model value_grad_and_gram refuses: say why.
    return VerifyReport(ok=False, examples=n, loss_scale=None,
                        layer_errors={}, total_error=float("nan"),
                        norms_error=float("nan"), untracked=(),
                        problems=(str(e),), tolerance=tol)
  per_loss, per_grad, batch_loss = _per_example_reference(
      apply_fn, params, state, rng, batch, axes, has_aux, kwargs)
  problems = []
  scale = _loss_scale(batch_loss, per_loss, n, tol)
  if scale is None:
    problems.append(
        f"the loss of the batch ({batch_loss:.6g}) is neither the sum "
        f"({float(jnp.sum(per_loss)):.6g}) nor the mean of the examples' "
        "losses: the examples are coupled (batch statistics, a softmax over "
        "the batch, a contrastive loss) and per-example gradients are not "
        "defined.")
  c = 1.0 if scale is None else scale[1]
  names = leaf_names(per_grad)
  flat = [np.asarray(l, np.float64).reshape(n, -1) * c
          for l in jax.tree.leaves(per_grad)]
  f = np.concatenate(flat, axis=1)
  ref_total = f @ f.T
  errors = _layer_errors(grams, names, flat, n)
  for module, err in sorted(errors.items()):
    if not err <= tol:
      problems.append(f"layer {module!r}: its Gram differs from the "
                      f"reference by {err:.2e} (relative).")
  if grams.sq_norms_by_layer:
    total_err = reference.relative_error(grams.sq_norms,
                                         np.diag(ref_total))
  else:
    total_err = reference.relative_error(grams.total, ref_total)
  norms_err = reference.relative_error(grams.norms,
                                       np.sqrt(np.diag(ref_total)))
  shortfall, refusal = _clip_norms_shortfall(
      apply_fn, params, state, rng, batch, kwargs, example_axes, has_aux,
      np.sqrt(np.diag(ref_total)))
  if shortfall > tol:  # (NaN: refused, which is not the Grams' problem.)
    problems.append(f"the norm bounds clipped_grad computes its clip "
                    f"factors from fall {shortfall:.2e} (relative) below "
                    "the reference norms.")
  untracked = tuple(grams.untracked)
  if untracked:
    problems.append(f"parameters outside every tracked layer: "
                    f"{', '.join(untracked)} (grams.complete is False).")
  elif not total_err <= tol:
    problems.append(f"the total Gram differs from the reference by "
                    f"{total_err:.2e} (relative).")
  return VerifyReport(
      ok=not problems, examples=n, loss_scale=scale[0] if scale else None,
      layer_errors=errors, total_error=total_err, norms_error=norms_err,
      untracked=untracked, problems=tuple(problems), tolerance=tol,
      clip_norms_shortfall=shortfall, clip_refusal=refusal)


def _clip_norms_shortfall(apply_fn, params, state, rng, batch, kwargs,
                          example_axes, has_aux, ref_norms):
  """``(shortfall, refusal)``: the largest relative shortfall of a clipping
  pass's norm bounds (the pass :func:`gram_haiku.clipped_grad` runs) below
  ``ref_norms``, and None; or NaN and the message when that pass refuses
  the model."""
  def norms(params, state, rng, *batch):
    return reweight.run(
        apply_fn, params, state, rng, batch, kwargs, fn_name="clipped_grad",
        needs="norms", has_aux=has_aux, axes=(), frozen=None,
        weight_fn=lambda g: jnp.ones(g.sq_norms.shape), privacy=True,
        example_axes=example_axes).grams.norms
  try:
    bounds = jax.jit(norms)(params, state, rng, *batch)
  except ValueError as e:
    return float("nan"), str(e)
  bounds = np.asarray(bounds, np.float64)
  short = (ref_norms - bounds) / np.maximum(ref_norms, 1e-30)
  return float(max(0.0, np.max(short, initial=0.0))), None


def _first_examples(args, example_axes, max_examples: int):
  """``(axes, n, batch)``: each argument's example axis (None: it has
  none), the number ``n`` of examples to check, and the first ``n``
  examples of the batch.

  Raises:
    ValueError: for malformed ``example_axes``, a batch with no example
      axis, or no example.
  """
  axes = [0] * len(args)
  if example_axes is not None:
    batch_args.leaf_example_axes(args, {}, example_axes)  # a teaching error if bad
    axes = list(example_axes)
  leaves = [(a, ax) for arg, ax in zip(args, axes) if ax is not None
            for a in jax.tree.leaves(arg)]
  if not leaves or any(jnp.ndim(a) == 0 for a, _ in leaves):
    raise ValueError("gram_haiku.verify: every array of the batch needs an "
                     "example axis (axis 0, or the one example_axes gives).")
  n = min(max_examples, min(jnp.shape(a)[ax] for a, ax in leaves))
  if n == 0:
    raise ValueError("gram_haiku.verify: the batch has no examples; give it "
                     "a batch of at least one (a few are best).")
  return axes, n, _take(args, axes, n)


def _per_example_reference(apply_fn, params, state, rng, batch, axes,
                           has_aux: bool, kwargs):
  """``(per_loss [n], per_grad, batch_loss)`` of the model with every
  ``track()`` switched off: each example's loss and gradient (a params
  tree with a leading axis ``n``) on that example alone, and the loss of
  the whole batch."""
  def plain(p, *example):
    with ambient.plain_haiku():
      out, _ = apply_fn(p, state, rng, *example, **kwargs)
    return out[0] if has_aux else out

  def one(p, *example):  # One example, its example axes of size 1 again.
    return plain(p, *(e if ax is None else jax.tree.map(
        lambda a, ax=ax: jnp.expand_dims(a, ax), e)
                      for e, ax in zip(example, axes)))
  in_axes = (None, *axes)
  per_loss = jax.jit(jax.vmap(one, in_axes=in_axes))(params, *batch)
  per_grad = jax.jit(jax.vmap(jax.jacrev(one), in_axes=in_axes))(
      params, *batch)
  return per_loss, per_grad, float(jax.jit(plain)(params, *batch))


def _loss_scale(batch_loss: float, per_loss, n: int, tol: float):
  """``("sum", 1.0)`` or ``("mean", 1 / n)``: how the batch's loss combines
  the examples' losses; None when it is neither (coupled examples)."""
  total_loss = float(jnp.sum(per_loss))
  for name, c in (("sum", 1.0), ("mean", 1.0 / n)):
    if np.isclose(batch_loss, c * total_loss, rtol=tol, atol=1e-12):
      return name, c
  return None


def _layer_errors(grams, names, flat, n: int) -> dict:
  """Tracked module -> max relative error of its Gram (or squared norms)
  against the reference from its parameters' per-example gradients
  ``flat`` (one ``f64[n, size]`` block per parameter leaf, named
  ``module/param`` in ``names``)."""
  modules = {}
  for name, block in zip(names, flat):
    modules.setdefault(name.rsplit("/", 1)[0], []).append(block)
    # (a parameter covered by a program-level rule is a layer of its own,
    # under its own name)
    modules.setdefault(name, []).append(block)
  errors = {}
  for module, g in grams.by_layer.items():
    fm = np.concatenate(modules.get(module, [np.zeros((n, 0))]), axis=1)
    errors[module] = reference.relative_error(g, fm @ fm.T)
  for module, g in grams.sq_norms_by_layer.items():
    fm = np.concatenate(modules.get(module, [np.zeros((n, 0))]), axis=1)
    errors[module] = reference.relative_error(g, np.sum(fm * fm, axis=1))
  return errors
