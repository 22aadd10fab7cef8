"""Every row of the interpreter's red-team corpus (tests/interpreter_corpus.py):
the Gram verdict (the reference Gram, with the parameters' gradients and no
unexpected :class:`gram_haiku.ExampleFlowWarning`, or which refusal) and
whether ``clipped_grad`` refuses (else its clipped sum is the reference's).

The reference is ``F @ F.T`` in float64, ``F`` the per-example gradients of
the untracked model from ``vmap(grad)`` over each batch array's example axis
(or the Jacobian rows of a row's per-example terms)."""

import dataclasses
import re
from typing import Any
import warnings

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.analysis import dataflow
from gram_haiku._src.analysis import flow_rules
from gram_haiku._src.analysis import program_rules
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import assert_sound_norms
from gram_haiku._src.core.reference import ATOL_F32
from gram_haiku._src.core.reference import CLIP_BOUND_SLACK
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import RTOL_F32
from gram_haiku._src.core.reference import weighted_sum
from tests import interpreter_corpus as corpus
from tests import problems


def _data(seed):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (problems.normal(k1, (corpus.B, corpus.T, corpus.F)),
          problems.normal(k2, (corpus.B, corpus.T, 3)))


def _batch(row, x, y):
  return tuple(row.batch(x, y)) if row.batch is not None else (x, y)


def _tracked(body):
  def tracked(*args):
    with gram_haiku.track():
      return body(*args)
  return hk.transform_with_state(tracked)


def _flat(grads, b):
  return np.concatenate([np.asarray(l, np.float64).reshape(b, -1)
                         for l in jax.tree.leaves(grads)], axis=1)


def _reference_program(row, batch):
  """``(program, data)``: ``program(params, *data)`` (traceable) gives the
  arrays :func:`reference_rows` reads, on the data its reference takes."""
  if row.reference_terms is not None:
    terms = hk.without_apply_rng(hk.transform(row.reference_terms)).apply
    return (lambda p, *b: (jnp.sum(terms(p, *b)), jax.jacrev(terms)(p, *b)),
            tuple(batch))
  plain = hk.without_apply_rng(hk.transform(
      row.reference_body or row.body)).apply
  data = tuple(row.reference_data(*batch)) if row.reference_data else batch
  axes = row.example_axes or (0,) * len(data)

  def one(p, *example):  # one example, its example axis kept (size 1)
    return plain(p, *(e if ax is None else jnp.expand_dims(e, ax)
                      for e, ax in zip(example, axes)))
  return jax.vmap(jax.value_and_grad(one), in_axes=(None, *axes)), data


def _reference_of(values, grads) -> tuple[float, np.ndarray]:
  """``(loss, F)`` from the reference program's arrays."""
  return (float(np.sum(np.asarray(values, np.float64))),
          _flat(grads, jax.tree.leaves(grads)[0].shape[0]))


def reference_rows(row, params, batch) -> tuple[float, np.ndarray]:
  """``(loss, F)``: the sum of the untracked model's per-example losses, and
  ``F: float64[B, P]``, its per-example gradients (columns in
  ``jax.tree.leaves(params)`` order)."""
  program, data = _reference_program(row, batch)
  return _reference_of(*jax.jit(program)(params, *data))


def _axes(row):
  return {} if row.example_axes is None else {
      "example_axes": row.example_axes}


def _assert_sum_close(got, flat, c, params):
  want = weighted_sum(flat, c, params)
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
  chex.assert_trees_all_close(got, want, rtol=RTOL_F32,
                              atol=ATOL_F32 * max(scale, 1e-30))


@dataclasses.dataclass
class _Setup:
  """A row on the corpus's data: its tracked transform, parameters, state
  and batch, and what its unmutated checks computed (``outcomes``: check
  -> its results or its refusal). The rules' tables are the same in every
  unmodified run, so a row's programs are traced and compiled once per
  process: the mutation checks rerun rows that ``test_corpus_row`` runs."""
  f: Any
  params: Any
  state: Any
  batch: tuple
  outcomes: dict


_SETUPS: dict[str, _Setup] = {}


def _refused_only(row) -> bool:
  """Whether both checks of ``row`` are refusals (raised while tracing:
  the parameters' shapes are all they read)."""
  return row.gram != corpus.EXACT and bool(row.clip_refuses)


def _setup(row) -> _Setup:
  if row.id not in _SETUPS:
    batch = _batch(row, *_data(0))
    f = _tracked(row.body)
    key = jax.random.PRNGKey(0)
    if _refused_only(row):
      params, state = jax.eval_shape(f.init, key, *batch)
      _SETUPS[row.id] = _Setup(f, params, state, batch, {})
    else:  # The init and the reference in one program.
      program, data = _reference_program(row, batch)

      def init_and_reference(key, batch, data):
        params, state = f.init(key, *batch)
        return params, state, program(params, *data)
      params, state, arrays = jax.jit(init_and_reference)(key, batch, data)
      _SETUPS[row.id] = _Setup(f, params, state, batch, {
          "reference": (True, _reference_of(*arrays))})
  return _SETUPS[row.id]


def _outcome(s, key, compute, mutated):
  """``compute()``, or (unmutated) its result or refusal kept in ``s``."""
  if mutated:
    return compute()
  if key not in s.outcomes:
    try:
      s.outcomes[key] = (True, compute())
    except ValueError as e:
      s.outcomes[key] = (False, e)
  ok, out = s.outcomes[key]
  if not ok:
    raise out
  return out


def _check_gram(row, s, mutated):
  f, params, state, batch = s.f, s.params, s.state, s.batch

  vgg = gram_haiku.value_grad_and_gram(f.apply, **_axes(row))
  if row.gram != corpus.EXACT:
    # Refused while tracing: traced only (as jax.jit traces it first).
    with pytest.raises(ValueError, match=row.gram):
      _outcome(s, "gram", lambda: jax.eval_shape(
          vgg, params, state, None, *batch), mutated)
    return

  def compute():
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always", gram_haiku.ExampleFlowWarning)
      out = jax.jit(vgg)(params, state, None, *batch)
    return out, [str(w.message) for w in caught
                 if issubclass(w.category, gram_haiku.ExampleFlowWarning)]
  (value, grads, grams), said = _outcome(s, "gram", compute, mutated)
  if row.warns is None:
    assert not said, said
  else:
    assert any(re.search(row.warns, m) for m in said), said
  loss, flat = _reference(row, s)
  assert_gram_close(grams.total, flat @ flat.T)
  # The loss is the sum of the per-example terms: so is its gradient.
  np.testing.assert_allclose(value, loss, rtol=RTOL_F32)
  _assert_sum_close(grads, flat, np.ones(len(flat)), params)


def _reference(row, s):
  """``(loss, F)``, computed once per row where a check needs it."""
  return _outcome(s, "reference",
                  lambda: reference_rows(row, s.params, s.batch), False)


def _check_clipped(row, s, mutated):
  f, params, state, batch = s.f, s.params, s.state, s.batch
  if row.clip_refuses:
    match = row.clip_refuses if isinstance(row.clip_refuses, str) else None
    # Refused while tracing: traced only, as the eager call's one program.
    with pytest.raises(ValueError, match=match):
      _outcome(s, "clip_refusal", lambda: jax.eval_shape(
          gram_haiku.clipped_grad(f.apply, 1.0, **_axes(row)), params,
          state, None, *batch), mutated)
    return
  _, flat = _reference(row, s)
  norms = np.linalg.norm(flat, axis=1)
  clip = float(np.median(norms))  # some examples clipped, some not
  grads, aux = _outcome(s, "clip", lambda: jax.jit(gram_haiku.clipped_grad(
      f.apply, clip, **_axes(row)))(params, state, None, *batch), mutated)
  # Clipped with sound upper bounds of the norms (at most the slack above).
  assert_sound_norms(aux.grad_norms, norms * (1 - RTOL_F32),
                     slack=CLIP_BOUND_SLACK + 2 * RTOL_F32)
  _assert_sum_close(grads, flat, clip_reference(norms, clip), params)


def run_row(row, mutated=False):
  """Both checks of ``row`` on the corpus's data; ``mutated``: a rule table
  was changed, so nothing computed before is reused but the row's
  parameters and reference (of the untracked model)."""
  s = _setup(row)
  _check_gram(row, s, mutated)
  _check_clipped(row, s, mutated)


@pytest.mark.parametrize("row", corpus.rows(), ids=lambda r: r.id)
# (A refused model may read a parameter no rule covers: its warning is
# expected here, the verdict is what is tested.)
@pytest.mark.filterwarnings("ignore::gram_haiku.UntrackedParameterWarning")
def test_corpus_row(row):
  run_row(row)


def test_corpus_covers_both_verdicts_and_both_clipping_answers():
  rows = corpus.rows()
  assert {r.gram == corpus.EXACT for r in rows} == {True, False}
  assert {bool(r.clip_refuses) for r in rows} == {True, False}
  # An exact Gram that clipping must refuse is the table's point too.
  assert any(r.gram == corpus.EXACT and r.clip_refuses for r in rows)


#: name -> (a domain's rule table, the primitive whose rule is removed, the
#: row that must then fail).
_MUTATIONS = {
    # A wrong Gram, silent: the reversal is not seen.
    "example_flow-rev": (flow_rules.RULES, "rev", "hidden_permuted"),
    # A warning where none may be.
    "example_flow-gather": (flow_rules.RULES, "gather",
                            "integer_label_cross_entropy"),
    # A wrong Gram, silent: the unroll's applications are not counted.
    "dataflow-scan": (dataflow.RULES, "scan", "lstm_dynamic_unroll"),
    # A refusal where the Gram and the clipped sum are exact: the frozen
    # parameter is taken for an untracked one.
    "dataflow-stop_gradient": (dataflow.RULES, "stop_gradient",
                               "untracked_parameter_under_stop_gradient"),
    # A bare parameter refused (or, for a refusal row, refused for another
    # reason) without its program-level rule.
    **{f"program-{primitive}": (program_rules.SITE_RULES, primitive, row)
       for primitive, row in (
           ("dot_general", "bare_weight_matmul"),
           ("conv_general_dilated", "bare_kernel_conv"),
           ("gather", "bare_table_gather"),
           ("dynamic_slice", "bare_table_dynamic_slice"))},
    # A bare parameter refused without the prefix rule that says along
    # which axes its example-independent value is constant.
    **{f"program_prefix-{primitive}": (program_rules.PREFIX_RULES,
                                       primitive, row)
       for primitive, row in (
           ("tile", "bare_token_tiled"),
           ("dot_general", "bare_rnn_from_zero_carry"),
           ("split", "bare_rnn_from_zero_carry"))},
}


@pytest.mark.parametrize("name", sorted(_MUTATIONS))
@pytest.mark.filterwarnings("ignore::gram_haiku.UntrackedParameterWarning")
@pytest.mark.filterwarnings("ignore::gram_haiku.ExampleFlowWarning")
def test_a_rule_removed_from_its_table_fails_a_row(name, monkeypatch):
  """Mutation check: the corpus notices a domain losing one rule (the
  row fails without it, and passes with it)."""
  table, primitive, row_id = _MUTATIONS[name]
  row = {r.id: r for r in corpus.rows()}[row_id]
  key = hx.primitive_named(primitive)
  with monkeypatch.context() as m:
    m.delitem(table, key)
    with pytest.raises((AssertionError, ValueError, pytest.fail.Exception)):
      run_row(row, mutated=True)
  run_row(row)
