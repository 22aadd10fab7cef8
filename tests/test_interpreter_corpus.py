"""Every row of the interpreter's red-team corpus (tests/interpreter_corpus.py):
the Gram verdict (the reference Gram, or which refusal) and whether
``clipped_grad`` refuses (else its clipped sum is the reference's)."""

import chex
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import ATOL_F32
from gram_haiku._src.core.reference import clip_reference
from gram_haiku._src.core.reference import per_example_grads
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.core.reference import RTOL_F32
from gram_haiku._src.core.reference import weighted_sum
from tests import interpreter_corpus as corpus
from tests import problems


def _data(seed):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return (problems.normal(k1, (corpus.B, corpus.T, corpus.F)),
          problems.normal(k2, (corpus.B, corpus.T, 3)))


def _tracked(body):
  def tracked(*args):
    with gram_haiku.track():
      return body(*args)
  return hk.transform_with_state(tracked)


def _plain_inputs(row, x):
  """The reference's model and its input (a statistic of the input data
  computed once for the batch, for ``data_centred``)."""
  if row.reference_body is None:
    return hk.without_apply_rng(hk.transform(row.body)), x
  xc = (x - x.mean(axis=0)) / (x.std(axis=0) + 1.0)
  return hk.without_apply_rng(hk.transform(row.reference_body)), xc


def _check_gram(row, f, params, state, x, y):
  fn = jax.jit(gram_haiku.value_grad_and_gram(f.apply))
  if row.gram != corpus.EXACT:
    with pytest.raises(ValueError, match=row.gram):
      fn(params, state, None, x, y)
    return
  _, _, grams = fn(params, state, None, x, y)
  plain, xr = _plain_inputs(row, x)
  assert_gram_close(grams.total, reference_gram(plain.apply, params, xr, y))


def _check_clipped(row, f, params, state, x, y):
  clipped = gram_haiku.clipped_grad(f.apply, 1.0)
  if row.clip_refuses:
    with pytest.raises(ValueError):
      clipped(params, state, None, x, y)
    return
  plain, xr = _plain_inputs(row, x)
  ref = per_example_grads(plain.apply, params, xr, y)
  norms = np.linalg.norm(np.asarray(ref, np.float64), axis=1)
  clip = float(np.median(norms))
  grads, _ = jax.jit(gram_haiku.clipped_grad(f.apply, clip))(
      params, state, None, x, y)
  want = weighted_sum(ref, clip_reference(norms, clip), params)
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want))
  chex.assert_trees_all_close(grads, want, rtol=RTOL_F32,
                              atol=ATOL_F32 * scale)


@pytest.mark.parametrize("row", corpus.rows(), ids=lambda r: r.id)
# (A refused model may read a parameter no rule covers: its warning is
# expected here, the verdict is what is tested.)
@pytest.mark.filterwarnings("ignore::gram_haiku.UntrackedParameterWarning")
def test_corpus_row(row):
  x, y = _data(0)
  f = _tracked(row.body)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _check_gram(row, f, params, state, x, y)
  _check_clipped(row, f, params, state, x, y)


def test_corpus_covers_both_verdicts_and_both_clipping_answers():
  rows = corpus.rows()
  assert {r.gram == corpus.EXACT for r in rows} == {True, False}
  assert {r.clip_refuses for r in rows} == {True, False}
  # An exact Gram that clipping must refuse is the table's point too.
  assert any(r.gram == corpus.EXACT and r.clip_refuses for r in rows)
