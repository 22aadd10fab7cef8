"""gram_haiku.testing: the reference every Gram is checked against.

The tests, the conformance suite (:mod:`gram_haiku.conformance`), the
benchmarks and the demos compare with these, and a user's own tests can
too:

* :func:`per_example_grads`: ``F``, ``[B, P]``, the flattened
  ``jax.vmap(jax.grad(per_example_loss))`` of the *untracked* model, each
  example evaluated alone; :func:`reference_gram` is ``F @ F.T`` and
  :func:`jacobian_gram` the same from a function returning every
  example's loss.
* :func:`clip_reference` (the clip weights ``min(1, C / |g_i|)`` in
  float64) and :func:`weighted_sum` (``sum_i c_i g_i`` from ``F``): the
  reference of :func:`gram_haiku.reweighted_grad` and
  :func:`gram_haiku.clipped_grad`.
* :data:`TOLERANCES` (dtype case -> ``(rtol, atol fraction)``), with
  :func:`assert_gram_close` and :func:`relative_error` that read it.
* :func:`verify` (and its :class:`VerifyReport`): a tracked model's Grams
  and clipping bounds against this reference, layer by layer.
* :func:`gram_ops_in`: the Gram ops bound in a jaxpr, each with its
  equation (what a test of a rule's binding reads).
* :func:`squared_norm_bounds`: the float-sound upper bound of each
  example's squared gradient norm from per-example gradient rows, the bound
  a clip factor is formed from.
"""

from gram_haiku._src.api.verify import verify
from gram_haiku._src.api.verify import VerifyReport
from gram_haiku._src.compat import hijax_compat as _hx
from gram_haiku._src.compute import norm_bounds as _norm_bounds
from gram_haiku._src.core import reference as _reference
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import jacobian_gram
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import relative_error
from gram_haiku._src.core.reference import weighted_sum
from gram_haiku._src.ops import op as _op

#: dtype case -> ``(rtol, atol)``, ``atol`` a fraction of the largest
#: reference entry: the tolerance every Gram is held to. ``"float32"``: the
#: same sums in another order; ``"float64"``; ``"bfloat16"`` and
#: ``"float16"``: the layer computes in that dtype; ``"mixed"``: bfloat16
#: parameters with float32 activations.
TOLERANCES = _reference.TOLERANCES


def gram_ops_in(jaxpr) -> list:
  """``[(equation, rule op)]``: the Gram ops bound at the top level of
  ``jaxpr`` (a ``jax.core.Jaxpr``, e.g. ``jax.make_jaxpr(f)(...).jaxpr``),
  in program order. Each op has ``name``, ``rule`` and ``param_avals``
  (one abstract value per rule parameter, None where the rule was bound
  without it); the equation's ``invars`` are ``(x, *present params,
  probe)``."""
  found = [(eqn, _hx.gram_op_of(eqn, _op.RuleOp)) for eqn in jaxpr.eqns]
  return [(eqn, op) for eqn, op in found if op is not None]


def squared_norm_bounds(rows, err=None):
  """``[B]``: an upper bound, sound in floating point, of each example's
  squared gradient norm ``|g_i|^2`` from per-example gradient rows
  ``rows: [B, P]`` that are off by at most ``err: [B]`` (in norm units;
  None: the rows are exact). The sum of squares is rounded up by its
  worst-case relative error for ``P`` terms in the rows' dtype (the
  derivation is in ``docs/reweighting.rst``, *Formal guarantees*)."""
  return _norm_bounds.of_rows(rows, err)


__all__ = (
    "TOLERANCES",
    "VerifyReport",
    "assert_gram_close",
    "clip_reference",
    "gram_ops_in",
    "jacobian_gram",
    "per_example_grads",
    "reference_gram",
    "relative_error",
    "squared_norm_bounds",
    "verify",
    "weighted_sum",
)
