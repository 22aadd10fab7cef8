"""The red-team corpus of the program interpreter, as a table.

Every program the analyses on :mod:`gram_haiku._src.analysis.interpreter` were taught
about (which parameter reaches which Gram op, :mod:`~gram_haiku._src.analysis.dataflow`;
where the examples flow, :mod:`~gram_haiku._src.analysis.example_flow`) is a row: a
small Haiku loss ``body(x, y)`` over ``x: f32[B, T, F]``, ``y: f32[B, T, 3]``
(``T == B`` on purpose: sizes cannot tell the axes apart), what
``value_grad_and_gram`` must give (:data:`EXACT`: the reference Gram, or a
refusal: a pattern of its ``ValueError``), and whether ``clipped_grad`` must
refuse it (else its clipped sum is the reference's). The rows come from the
tests added for each special case (``tests/test_example_flow.py``,
``tests/test_sharing.py``, ``tests/test_soundness_flow.py``), which keep
their own, finer assertions; ``tests/test_interpreter_corpus.py`` runs every
row. Teaching the interpreter a new primitive or shape of program is one
rule and one row here.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import haiku as hk
import jax.numpy as jnp

from tests import test_example_flow as ef

B, T, F = ef.B, ef.T, ef.F

#: The Gram verdict of a program whose Gram is the reference.
EXACT = "exact"

# Stable parts of the refusals (errors.py), as the special-case tests match
# them.
COMBINED = ef._COMBINED  # pylint: disable=protected-access
OTHER_AXIS = "meets them along another axis"
MERGED = "merges the examples with other positions"
COUPLED = "depends on several examples"
REORDERED = "reordered, repeated or a subset"
NOT_A_SUM = "not a sum"
PENALTY = "optimizer's weight decay"


@dataclasses.dataclass(frozen=True)
class Row:
  """One program of the corpus.

  Attributes:
    id: the test id.
    body: ``body(x, y) -> loss`` (Haiku code; run inside ``track()``).
    gram: :data:`EXACT`, or a pattern of ``value_grad_and_gram``'s
      refusal.
    clip_refuses: whether ``clipped_grad`` must refuse the program (a
      privacy guarantee needs each example's gradient to depend on its own
      data only, which the Gram does not).
    reference_body: the loss whose per-example gradients are the
      reference, where it is not ``body`` itself (a statistic of the input
      data, computed once for the batch).
    source: the test the row comes from.
  """
  id: str
  body: Callable
  gram: str
  clip_refuses: bool
  reference_body: Optional[Callable] = None
  source: str = ""


def _applied_twice(x, y):  # one module, two applications (tests/test_sharing)
  lin = hk.Linear(F, name="lin")
  return ef._sq(hk.Linear(3)(jnp.tanh(lin(jnp.tanh(lin(x))))), y)


def _in_a_cond_branch_and_outside(x, y):
  lin = hk.Linear(F, name="lin")
  h = jnp.tanh(lin(x))
  h = hk.cond(jnp.sum(x) > -1e9, lambda a: lin(a), lambda a: a * 2., h)
  return ef._sq(hk.Linear(3)(h), y)


def _layer_stack(x, y):  # different parameters per step: not sharing
  h = hk.layer_stack(2)(lambda h: jnp.tanh(hk.Linear(F)(h)))(x)
  return ef._sq(hk.Linear(3)(h), y)


def _weight_penalty(x, y):  # the parameter read outside every Gram op
  lin = hk.Linear(3, name="head")
  out = lin(x)
  return ef._sq(out, y) + 0.01 * jnp.sum(lin.params_dict()["head/w"] ** 2)


def _centred_input_reference(x, y):
  return ef._sq(hk.Linear(3)(jnp.tanh(hk.Linear(F)(x))), y)


_EF = "tests/test_example_flow.py"

ROWS: list[Row] = [
    # -- where the examples flow: refused for the Gram, and for clipping ------
    Row("shared_sum_scales", ef._shared_sum_scales, COMBINED, True, source=_EF),
    Row("shared_mean_added", ef._shared_mean_added, COMBINED, True, source=_EF),
    Row("shared_max_added", ef._shared_max_added, COMBINED, True, source=_EF),
    Row("shared_contracted", ef._shared_contracted, COMBINED, True, source=_EF),
    Row("shared_cumsum", ef._shared_cumsum, COMBINED, True, source=_EF),
    Row("shared_regulariser", ef._shared_regulariser, COMBINED, True,
        source=_EF),
    Row("positions_late", ef._positions_late, OTHER_AXIS, True, source=_EF),
    Row("time_major", ef._time_major, "along axis 1", True, source=_EF),
    Row("memory", ef._memory, OTHER_AXIS, True, source=_EF),
    Row("learned_query", ef._learned_query, OTHER_AXIS, True, source=_EF),
    Row("batch_apply", ef._batch_apply, MERGED, True, source=_EF),
    Row("flattened", ef._flattened, MERGED, True, source=_EF),
    Row("hidden_centred", ef._hidden_centred, COUPLED, True, source=_EF),
    Row("hidden_permuted", ef._hidden_permuted, REORDERED, True, source=_EF),
    Row("hidden_subset", ef._hidden_subset, REORDERED, True, source=_EF),
    Row("batch_softmax_loss", ef._batch_softmax_loss, NOT_A_SUM, True,
        source=_EF),
    Row("contrastive_loss", ef._contrastive_loss, NOT_A_SUM, True,
        source=_EF),
    # -- where the examples flow: exact -----------------------------------------
    Row("positions_broadcast", ef._positions_broadcast, EXACT, False,
        source=_EF),
    Row("attention", ef._attention, EXACT, False, source=_EF),
    Row("stack_and_scan", ef._stack_and_scan, EXACT, False, source=_EF),
    Row("per_example_vmap", ef._per_example_vmap, EXACT, False, source=_EF),
    Row("dot_product_attention", ef._dot_product_attention, EXACT, False,
        source=_EF),
    Row("dot_product_attention_causal", ef._dot_product_attention_causal,
        EXACT, False, source=_EF),
    Row("attention_over_time_major", ef._attention_over_time_major, EXACT,
        False, source=_EF),
    # (Refused for clipping: the strict check pairs the outputs' and the
    # targets' example axes by position, and the targets' is axis 1 here. A
    # conservative refusal, pinned as today's behaviour.)
    Row("contracted_with_transposed_targets",
        ef._contracted_with_transposed_targets, EXACT, True, source=_EF),
    # A statistic of the input data: exact for the Gram (input data for
    # every example's gradient), refused for clipping (one example's
    # gradient then reads the others' data).
    Row("data_centred", ef._data_centred, EXACT, True,
        reference_body=_centred_input_reference, source=_EF),
    # Layer inputs reordered, gathers and pools over the batch.
    Row("hidden_reversed_then_layer", ef._hidden_reversed_then_layer,
        REORDERED, True, source=_EF),
    Row("paired_outputs", ef._paired_outputs, NOT_A_SUM, True, source=_EF),
    Row("one_example_per_call", ef._one_example_per_call, REORDERED, True,
        source=_EF),
    Row("coupled_after_integer_labels", ef._coupled_after_integer_labels,
        NOT_A_SUM, True, source=_EF),
    Row("hardest_examples", ef._hardest_examples, NOT_A_SUM, True,
        source=_EF),
    Row("pooled_over_batch", ef._pooled_over_batch, COUPLED, True,
        source=_EF),
    Row("integer_label_cross_entropy", ef._integer_label_cross_entropy,
        EXACT, False, source=_EF),
    # Writes, transforms and loops over the batch (each once a silently
    # wrong Gram: the operation was not modelled).
    *[Row(f"between_{f.__name__.lstrip('_')}", ef._two_layers(f), match,
          True, source=_EF)
      for f, match in ((ef._scatter_permuted, COUPLED),
                       (ef._scatter_added, REORDERED),
                       (ef._rows_overwritten, COUPLED),
                       (ef._fft_over_batch, COUPLED),
                       (ef._ema_over_batch, COUPLED),
                       (ef._branch_on_one_example, COUPLED))],
    Row("constant_query", ef._constant_query, ef._REORDERED, True,
        source=_EF),
    Row("one_example_per_scan_step", ef._one_example_per_scan_step,
        r"row\(s\) of a loop over the examples", True, source=_EF),
    Row("positions_scanned_with_time", ef._positions_scanned_with_time,
        COMBINED, True, source=_EF),
    Row("sorted_max_loss", ef._sorted_max_loss, NOT_A_SUM, True, source=_EF),
    Row("sorted_top2_loss", ef._sorted_top2_loss, NOT_A_SUM, True,
        source=_EF),
    Row("scanned_product_loss", ef._scanned_product_loss, NOT_A_SUM, True,
        source=_EF),
    Row("looped_product_loss", ef._looped_product_loss, NOT_A_SUM, True,
        source=_EF),
    # Writes and transforms within each example: exact.
    *[Row(f"between_{f.__name__.lstrip('_')}", ef._two_layers(f), EXACT,
          False, source=_EF)
      for f in (ef._feature_column_zeroed, ef._features_padded,
                ef._first_step_shifted, ef._feature_fft,
                ef._steps_unstacked_and_stacked)],
    # -- which parameter reaches which Gram op, and how often ------------------
    Row("applied_twice", _applied_twice, EXACT, False,
        source="tests/test_sharing.py"),
    # (Refused for clipping: the branch is chosen from every example's
    # data, so each example's gradient reads the others'.)
    Row("in_a_cond_branch_and_outside", _in_a_cond_branch_and_outside, EXACT,
        True, source="tests/test_sharing.py"),
    Row("layer_stack", _layer_stack, EXACT, False,
        source="tests/test_sharing.py"),
    Row("weight_penalty", _weight_penalty, PENALTY, True,
        source="tests/test_soundness_flow.py"),
]


def rows() -> list[Row]:
  ids = [r.id for r in ROWS]
  assert len(ids) == len(set(ids)), "corpus ids must be unique"
  return ROWS
