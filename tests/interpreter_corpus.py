"""The red-team corpus of the program interpreter, as a table.

Every program the analyses on :mod:`gram_haiku._src.analysis.interpreter`
were taught about (which parameter reaches which Gram op,
:mod:`~gram_haiku._src.analysis.dataflow`; where the examples flow,
:mod:`~gram_haiku._src.analysis.example_flow`; a getter's pull-back,
:mod:`~gram_haiku._src.analysis.reparam`) is a row: a
small Haiku loss ``body(x, y)`` over ``x: f32[B, T, F]``, ``y: f32[B, T, 3]``
(``T == B`` on purpose: sizes cannot tell the axes apart), what
``value_grad_and_gram`` must give (:data:`EXACT`: the reference Gram, or a
refusal: a pattern of its ``ValueError``), and whether ``clipped_grad`` must
refuse it (``True``, or a pattern of its ``ValueError``; else its clipped sum
is the reference's). A row whose program takes other arrays says how they
come from ``x`` and ``y`` (:attr:`Row.batch`: labels, a time-major view, a
table given with ``example_axes=``). The rows come from the tests added for
each special case (``tests/test_example_flow.py``, ``tests/test_sharing.py``,
``tests/test_soundness_flow.py``, ``tests/test_frozen.py``,
``tests/test_reparam.py``, ``tests/test_loops.py``); where such a test said
no more than a row does, the row replaced it and its program moved here;
the others keep their own, finer assertions.
``tests/test_interpreter_corpus.py`` runs every row. Teaching the
interpreter a new primitive or shape of program is one rule and one row
here.
"""

# The programs shared with the special-case tests are their modules' own.
# pylint: disable=protected-access

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional, Union

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from tests import problems
from tests import test_example_flow as ef
from tests import test_soundness_flow as sf

B, T, F = ef.B, ef.T, ef.F

#: The Gram verdict of a program whose Gram is the reference.
EXACT = "exact"

# Stable parts of the refusals (errors.py), as the special-case tests match
# them.
COMBINED = ef._COMBINED
OTHER_AXIS = "meets them along another axis"
MERGED = "merges the examples with other positions"
COUPLED = "depends on several examples"
REORDERED = "reordered, repeated or a subset"
NOT_A_SUM = "not a sum"
PENALTY = "optimizer's weight decay"
OTHERS_DATA = "reads data of other examples"
PAIRED = "another example's data"
CANDIDATE_REORDERED = "along that axis are reordered, repeated or subset"
CLOSED = "closes over"
TRANSFORMED = "changes its values"


@dataclasses.dataclass(frozen=True)
class Row:
  """One program of the corpus.

  Attributes:
    id: the test id.
    body: ``body(x, y) -> loss`` (Haiku code; run inside ``track()``), or
      ``body(*batch(x, y))``.
    gram: :data:`EXACT`, or a pattern of ``value_grad_and_gram``'s
      refusal.
    clip_refuses: whether ``clipped_grad`` must refuse the program (a
      privacy guarantee needs each example's gradient to depend on its own
      data only, which the Gram does not), or a pattern of its refusal.
    reference_body: the loss whose per-example gradients are the
      reference, where it is not ``body`` itself.
    source: the test the row comes from.
    batch: ``batch(x, y) -> arrays``: what the transforms take (computed
      once, outside them), where it is not ``(x, y)``.
    example_axes: given to both transforms (and the reference's
      ``vmap``): each batch array's example axis, or None for one every
      example reads.
    reference_data: ``reference_data(*batch) -> arrays``: what the
      reference's examples are, where the program computes them from the
      whole batch (a statistic of the input data, labels paired with
      other rows) or closes over them.
    reference_terms: ``terms(*batch) -> [B]``: for a program whose
      examples cannot be run one at a time (values of the batch held
      fixed by ``stop_gradient``, rows picked by constant indices), the
      per-example terms of its loss; the reference's rows are their
      Jacobian's.
    warns: a pattern of the :class:`gram_haiku.ExampleFlowWarning` that an
      :data:`EXACT` Gram comes with (None: it must come with none).
  """
  id: str
  body: Callable
  gram: str
  clip_refuses: Union[bool, str]
  reference_body: Optional[Callable] = None
  source: str = ""
  batch: Optional[Callable] = None
  example_axes: Optional[tuple] = None
  reference_data: Optional[Callable] = None
  reference_terms: Optional[Callable] = None
  warns: Optional[str] = None


def _sq(out, y):
  return 0.5 * jnp.sum((out - y) ** 2)


def _losses(out, y):  # per-example squared losses, [B]
  return 0.5 * jnp.sum((out - y) ** 2, tuple(range(1, out.ndim)))


_PERM = np.array([2, 0, 3, 1])


# -- where the examples flow (tests/test_example_flow.py) ----------------------


def _positions_broadcast(x, y):
  ids = jnp.broadcast_to(jnp.arange(T), (x.shape[0], T))
  return _sq(hk.Linear(3)(x + hk.Embed(T, F)(ids)), y)


def _data_centred(x, y):  # coupling confined to the input data
  x = (x - x.mean(axis=0)) / (x.std(axis=0) + 1.0)
  return _sq(hk.Linear(3)(jnp.tanh(hk.Linear(F)(x))), y)


def _centred_input_reference(x, y):
  return _sq(hk.Linear(3)(jnp.tanh(hk.Linear(F)(x))), y)


def _centred(x, y):  # the input data as the reference's examples see it
  return (x - x.mean(axis=0)) / (x.std(axis=0) + 1.0), y


def _attention(x, y):
  attn = hk.MultiHeadAttention(
      2, 3, w_init=hk.initializers.VarianceScaling(1.0), model_size=3)
  return _sq(attn(x, x, x), y)


def _stack_and_scan(x, y):
  h = hk.layer_stack(2)(lambda h: jnp.tanh(hk.Linear(F)(h)))(x)
  core = hk.GRU(3)
  out, _ = hk.dynamic_unroll(core, jnp.swapaxes(h, 0, 1),
                             core.initial_state(x.shape[0]))
  return _sq(jnp.swapaxes(out, 0, 1), y)


def _per_example_vmap(x, y):
  h = hk.vmap(lambda xi: jnp.tanh(hk.Linear(F)(xi)), split_rng=False)(x)
  return _sq(hk.Conv1D(3, 2)(h), y)


# A batched product whose operands hold the examples on axes of their own
# (each example's row paired with its own by one batch or contracting
# dimension): jax.nn.dot_product_attention's XLA path puts them on axis 0
# of one operand and axis 1 of the other.
def _dot_product_attention(x, y, **kw):
  q, k, v = (hk.Linear(4)(x).reshape(x.shape[:2] + (2, 2)) for _ in range(3))
  out = jax.nn.dot_product_attention(q, k, v, **kw)
  return _sq(hk.Linear(3)(out.reshape(x.shape[:2] + (4,))), y)


def _dot_product_attention_causal(x, y):
  return _dot_product_attention(x, y, is_causal=True)


def _attention_over_time_major(x, y):  # (B, H) queries, (T, B, H) keys
  enc = jnp.swapaxes(jnp.tanh(hk.Linear(5)(x)), 0, 1)
  q = hk.Linear(5)(x[:, 0])
  weights = jax.nn.softmax(jnp.einsum("bh,tbh->bt", q, enc), axis=-1)
  ctx = jnp.einsum("bt,tbh->bh", weights, enc)
  return _sq(hk.Linear(3)(ctx)[:, None, :], y[:, :1])


def _contracted_with_transposed_targets(x, y):  # sum_i <out_i, y_i>
  out = hk.Linear(3)(x).reshape(x.shape[0], -1)
  return jnp.einsum("bf,fb->", jnp.tanh(out), y.reshape(y.shape[0], -1).T)


# Per-example code under hk.vmap whose tracked layers take inputs that do
# not depend on the example (ef._vmapped_*: positions, a memory, which is
# frozen here so that the clipped sum is defined).
def _vmapped(per_example):
  def body(x, y):
    return jnp.sum(hk.vmap(per_example, split_rng=False)(x, y))
  return body


def _frozen_memory_rows():
  return jax.lax.stop_gradient(ef._memory_rows())


def _vmapped_frozen_memory_mean(xi, yi):
  pooled = jnp.mean(jnp.tanh(hk.Linear(F)(_frozen_memory_rows())), axis=0)
  return _sq(hk.Linear(3)(xi * pooled), yi)


def _vmapped_cross_attention_to_a_frozen_memory(xi, yi):
  memory = _frozen_memory_rows()
  attn = hk.MultiHeadAttention(2, 3, w_init=hk.initializers.VarianceScaling(
      1.0), model_size=3, with_bias=False)
  return _sq(attn(xi, memory, memory), yi)


def _vmapped_penalty_on_a_frozen_memory(xi, yi):
  penalty = jnp.sum(hk.Linear(3)(_frozen_memory_rows()) ** 2)
  return _sq(hk.Linear(3)(xi), yi) + 1e-2 * penalty


# Losses whose terms come in another order or with weights.
def _linear_losses(x, y):
  return _losses(hk.Linear(3)(x), y)


_HALVES = np.array([1.0, 1.0, 0.5, 0.5], np.float32)


def _weighted_halves(x, y):
  l = _linear_losses(x, y)
  return l[:2].sum() + 0.5 * l[2:].sum()


def _reversed_loss(x, y):
  return 0.5 * jnp.sum((hk.Linear(3)(x) - y)[::-1] ** 2)


def _permuted_pairs(x, y):
  perm = jnp.array([1, 0, 3, 2])
  return _sq(hk.Linear(3)(x)[perm], y[perm])


def _cumsum_loss(x, y):
  return jnp.cumsum(_linear_losses(x, y))[-1]


# Values of the batch under stop_gradient: constants for differentiation.
def _two_layer_losses(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  return _losses(hk.Linear(3, name="second")(h), y)


_STOPPED_TOTALS = {  # loss = sum(l * stop_gradient(total(l)))
    "softmax_weights": jax.nn.softmax,
    "normaliser": lambda l: 1. / jnp.sum(l),
    "count": lambda l: 1. / (jnp.sum(l > jnp.median(l)) + 1.),
}


def _stopped(total, terms=False):
  def body(x, y):
    l = _two_layer_losses(x, y)
    out = l * jax.lax.stop_gradient(total(l))
    return out if terms else jnp.sum(out)
  return body


def _stopped_centring_between_layers(x, y, terms=False):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  h = h - jax.lax.stop_gradient(h.mean(0))
  l = _losses(hk.Linear(3, name="second")(h), y)
  return l if terms else jnp.sum(l)


def _unstopped(coupling):
  return lambda x, y: coupling(_two_layer_losses(x, y))


_UNSTOPPED = {
    "softmax_weights": lambda l: jnp.sum(l * jax.nn.softmax(l)),
    "normaliser": lambda l: jnp.sum(l) / jnp.sum(l),
    "comparison": lambda l: jnp.sum(l * (l > jnp.median(l))),
}

# Keys computed by a tracked layer from a closed-over (6, F) memory next to
# a batch of 4.
_MEMORY_OF_SIX = np.random.RandomState(24).randn(6, F).astype(np.float32)


def _layer_on_a_memory_of_another_size(x, y):
  q = hk.Linear(3, name="q")(x)  # (B, T, 3)
  k = hk.Linear(3, name="k")(_MEMORY_OF_SIX)  # (6, 3)
  return _sq(jax.nn.softmax(q @ k.T) @ k, y)


# Layer inputs reordered between layers.
def _hidden_reversed_then_layer(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))[::-1]
  return _sq(hk.Linear(3, name="second")(h), y)


def _paired_outputs(x, y):
  out = hk.Linear(3)(x)
  return _sq(out + out[::-1], y)


def _one_example_per_call(x, y):
  lin = hk.Linear(3, name="per_example")
  out = jnp.concatenate([lin(x[i:i + 1]) for i in range(x.shape[0])])
  return _sq(out, y)


def _between(reorder, terms=False):
  def body(x, y):
    h = jnp.tanh(hk.Linear(F, name="first")(x))
    l = _losses(hk.Linear(3, name="second")(reorder(h)), y)
    return l if terms else jnp.sum(l)
  return body


#: Rows taken apart and put back in the batch's order: exact.
_ROWS_PUT_BACK = {
    "halves": lambda h: jnp.concatenate([h[:2], h[2:]]),
    "flip_flip": lambda h: jnp.flip(jnp.flip(h, 0), 0),
    "reversed_twice": lambda h: h[::-1][::-1],
    "split": lambda h: jnp.concatenate(jnp.split(h, [1, 3])),
    "first_copy": lambda h: jnp.concatenate([h, h])[:h.shape[0]],
    "halves_of_two_values": lambda h: jnp.concatenate([h[:2], 2. * h[2:]]),
}

#: Rows put back in another order: refused.
_ROWS_PUT_BACK_ELSEWHERE = {
    "rotated": lambda h: jnp.concatenate([h[2:], h[:2]]),
    "flipped": lambda h: jnp.flip(h, 0),
    "repeated": lambda h: jnp.concatenate([h[:2], h[:2]]),
    "shifted_copy": lambda h: jnp.concatenate([h, h])[1:h.shape[0] + 1],
    # Interleaving merges two axes.
    "odd_even": lambda h: jnp.stack([h[0::2], h[1::2]], 1).reshape(h.shape),
}


def _input_data_reordered(x, y):  # by a fixed permutation (bucketing)
  return _sq(hk.Linear(3)(jnp.tanh(hk.Linear(F)(x[_PERM]))), y)


# A loss that reorders the last layer's rows and/or the labels'
# (ef._after). Each pairs one example's outputs with another's labels ...
_PERM_J = jnp.asarray(_PERM)
_PICKED_BY_OTHER_INDEX_ARRAYS = {
    "reversed_index_array": (lambda o: o[_PERM_J],
                             lambda y: y[_PERM_J[::-1]]),
    "shifted_index_array": (lambda o: o[_PERM_J],
                            lambda y: y[(_PERM_J + 1) % B]),
    "rolled_index_array": (lambda o: o[_PERM_J],
                           lambda y: y[jnp.roll(_PERM_J, 1)]),
}

_SWAP = lambda a: jnp.concatenate([a[2:], a[:2]])

# ... or its own: (outputs' order, labels' order, each example's labels).
_REORDERED_WITH_OWN_DATA = {
    "both_reversed": (lambda o: o[::-1], lambda y: y[::-1], None),
    "both_halves_swapped": (_SWAP, _SWAP, None),
    "both_by_one_index_array": (lambda o: o[_PERM_J], lambda y: y[_PERM_J],
                                None),
    "both_by_equal_index_arrays": (ef._SHUFFLE, ef._SHUFFLE, None),
    "both_by_one_index_array_one_jitted": (
        jax.jit(lambda o: o[_PERM_J]), lambda y: y[_PERM_J], None),
    "outputs_reversed_no_data": (lambda o: o[::-1], jnp.zeros_like,
                                 jnp.zeros_like),
    # Labels rolled: the terms' rows are the inputs' rows, each with
    # another example's labels.
    "labels_rolled": (lambda o: o, lambda y: jnp.roll(y, 1, axis=0),
                      lambda y: jnp.roll(y, 1, axis=0)),
}


def _own_data(per_y):
  """``reference_data``: each input row with the labels it is paired
  with."""
  if per_y is None:
    return None
  return lambda x, y: (x, per_y(y))


_ONE_ORDER = ef._after(lambda o: o)


# Custom derivatives on the examples' path.
@jax.custom_jvp
def _mixes_tangents(h):
  return h


@_mixes_tangents.defjvp
def _mixes_tangents_jvp(primals, tangents):
  (h,), (t,) = primals, tangents
  return h, t + 0.3 * jnp.roll(t, 1, axis=0)  # a neighbour's row


@jax.custom_jvp
def _own_rule_per_row(h):
  return jnp.tanh(h)


@_own_rule_per_row.defjvp
def _own_rule_per_row_jvp(primals, tangents):
  (h,), (t,) = primals, tangents
  return jnp.tanh(h), 2.0 * t / jnp.cosh(h) ** 2  # a gradient scale per row


# Gathers, pools and sorts.
_LENGTHS = np.array([4, 2, 3, 1])


def _last_step_take_along_axis(x, y, terms=False):
  h = jnp.tanh(hk.Linear(F)(x))
  last = jnp.take_along_axis(h, (_LENGTHS - 1)[:, None, None], axis=1)[:, 0]
  l = _losses(hk.Linear(3)(last), y[:, 0])
  return l if terms else jnp.sum(l)


def _integer_label_cross_entropy(x, y):
  logits = hk.Linear(3)(x.mean(1))
  labels = jnp.argmax(y[:, 0], axis=-1)
  picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  return jnp.sum(jax.nn.logsumexp(logits, -1) - picked)


def _coupled_after_integer_labels(x, y):
  logits = hk.Linear(3)(x.mean(1))
  labels = jnp.argmax(y[:, 0], axis=-1)
  picked = jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]
  return jax.nn.logsumexp(jax.nn.logsumexp(logits, -1) - picked)


def _hardest_examples(x, y):
  return jax.lax.top_k(_linear_losses(x, y), 2)[0].sum()


def _pooled_over_batch(x, y):
  h = jnp.tanh(hk.Linear(F)(x))
  h = hk.avg_pool(h, (2, 1, 1), (1, 1, 1), "SAME")
  return _sq(hk.Linear(3)(h), y)


# Writes, transforms and loops over the batch. Found by an outside check:
# each of these once returned a wrong Gram with no error (the operation was
# not modelled, so nothing was concluded).
def _two_layers(between):
  def body(x, y):
    h = jnp.tanh(hk.Linear(F, name="first")(x))
    return _sq(hk.Linear(3, name="second")(between(h)), y)
  body.__name__ = between.__name__
  return body


def _scatter_permuted(h):
  return jnp.zeros_like(h).at[_PERM].set(h)


def _scatter_added(h):
  return jnp.zeros_like(h).at[_PERM].add(h)


def _rows_overwritten(h):
  return jax.lax.dynamic_update_slice(h, h[:1], (2, 0, 0))


def _fft_over_batch(h):
  return jnp.fft.fft(h, axis=0).real


def _ema_over_batch(h):
  step = lambda c, hi: (0.5 * c + hi, 0.5 * c + hi)
  return jax.lax.scan(step, jnp.zeros(h.shape[1:]), h)[1]


def _branch_on_one_example(h):
  return jax.lax.cond(h[0, 0, 0] > 0, lambda a: 2 * a, lambda a: -a, h)


def _constant_query(x, y):  # its (1, F) rows broadcast over the batch
  q = hk.Linear(3, name="q")(jnp.ones((1, 1, F)))
  return _sq(x[..., :3] * q, y)


def _one_example_per_scan_step(x, y):
  lin = hk.Linear(3)
  def step(c, xi):
    return c, lin(xi[None])[0]
  return _sq(hk.scan(step, 0.0, x)[1], y)


def _positions_scanned_with_time(x, y):  # T == B: rows of a (T, F) input
  pos = hk.Linear(F, name="pos")(jnp.eye(T, F))
  h = hk.Linear(F, name="inp")(x)
  def step(c, inp):
    ht, pt = inp
    return jnp.tanh(c + ht + pt), c
  _, hs = jax.lax.scan(step, jnp.zeros((x.shape[0], F)),
                       (jnp.swapaxes(h, 0, 1), pos))
  return _sq(hk.Linear(3, name="out")(jnp.swapaxes(hs, 0, 1)), y)


def _sorted_max_loss(x, y):
  return jnp.sort(_linear_losses(x, y))[-1]


def _sorted_top2_loss(x, y):
  return jnp.sort(_linear_losses(x, y))[-2:].sum()


def _scanned_product_loss(x, y):
  step = lambda c, li: (c * li, None)
  return jax.lax.scan(step, 1.0, _linear_losses(x, y))[0]


def _looped_product_loss(x, y):
  l = _linear_losses(x, y)
  return jax.lax.fori_loop(0, l.shape[0], lambda i, c: c * l[i], 1.0)


# Writes and transforms within each example.
def _feature_column_zeroed(h):
  return h.at[:, :, 1].set(0.0)


def _features_padded(h):
  return jnp.zeros(h.shape[:-1] + (F + 2,)).at[..., :F].set(h)[..., 1:F + 1]


def _first_step_shifted(h):  # a constant added at every example's step 0
  return h.at[:, 0].add(1.0)


def _feature_fft(h):  # an FFT within each example
  return jnp.fft.fft(h, axis=-1).real


def _steps_unstacked_and_stacked(h):
  return jnp.stack([jnp.tanh(s) for s in jnp.unstack(h, axis=1)], axis=1)


# A second outside check: loops, sorts and candidates.
def _h_and_mean(x):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  return h, h.mean(0)


def _centred_in_second_branch(x, y):  # the mean is met in branch 2 of 2
  h, m = _h_and_mean(x)
  z = jax.lax.cond(jnp.sum(x) > -1e9, lambda h, m: h - m,
                   lambda h, m: h * 1.0, h, m)
  return _sq(hk.Linear(3, name="second")(z), y)


def _centred_in_a_later_scan_round(x, y):
  h, m = _h_and_mean(x)
  def step(c, t):
    return h * t, (h - m, x * 2.0)
  c, (ys, _) = jax.lax.scan(step, jnp.zeros_like(h), jnp.arange(3.0))
  return _sq(hk.Linear(3, name="second")(ys[1] + c), y)


def _centred_through_a_delay_line(x, y):  # reached after five rounds
  h, _ = _h_and_mean(x)
  def step(c, _):
    return c[1:] + (h,), None
  c, _ = jax.lax.scan(step, (jnp.zeros_like(h),) * 5, None, length=6)
  return _sq(hk.Linear(3, name="second")(h - c[0].mean(0)), y)


def _max_by_sort_and_mask(x, y):
  return jnp.sort(_linear_losses(x, y)) @ (jnp.arange(B) == B - 1)


def _max_by_sort_and_index(x, y):
  return jnp.sort(_linear_losses(x, y))[jnp.array([B - 1])].sum()


def _max_by_sort_and_cumsum(x, y):
  return jnp.cumsum(jnp.sort(_linear_losses(x, y)))[1:2].sum()


def _candidate_rows_permuted(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  q = jnp.tanh(hk.Linear(F, name="q")(jnp.ones((B, T, 2))))
  q = q[jnp.array([1, 2, 3, 0])]
  return _sq(hk.Linear(3)(q * 0.0 + jnp.einsum("btf,btf->bt", q, h)[
      ..., None]), y)


def _candidate_concatenated_first(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  c = hk.Linear(F, name="c")(jnp.ones((B, T, 2)))
  z = jnp.concatenate([c, h[::-1]], 0)[B:]  # == h[::-1]
  return _sq(hk.Linear(3, name="second")(z), y)


# One-hot labels written by a scatter at closed-over labels.
_CLOSED_LABELS = np.array([2, 0, 1, 2], np.int32)


def _xent(x, onehot):
  return -jnp.sum(jax.nn.log_softmax(hk.Linear(3)(x.mean(1))) * onehot)


def _one_hot_written_by_scatter(x, y):
  del y
  rows = jnp.arange(x.shape[0])
  return _xent(x, jnp.zeros((x.shape[0], 3)).at[rows, _CLOSED_LABELS].set(
      1.0))


# example_axes: where the examples are (x read as time-major (T, B, F); the
# programs ef._time_major_lstm, ef._time_major_vmapped and
# ef._attends_to_a_memory).
def _time_major_layer_on_time(x, y):  # the layer's axis 0 is time
  return _sq(jnp.tanh(hk.Linear(3)(x)).sum(0), y)


_TIME_MAJOR = lambda x, y: (x, y[:, 0])
_WITH_A_MEMORY = lambda x, y: (x, y[:, 0], y)


# Per-token losses summed by segments.
def _token_losses(x, y):
  h = jnp.tanh(hk.Linear(F, name="first")(x))
  out = hk.Linear(3, name="second")(h)
  return 0.5 * jnp.sum((out - y) ** 2, -1).reshape(-1)  # [B T]


_TOKEN_IDS = np.repeat(np.arange(B), T)  # position -> its example


def _segment_sums(ids=_TOKEN_IDS, tokens=None, num_segments=B):
  def sums(x, y):
    l = _token_losses(x, y) if tokens is None else tokens(
        _token_losses(x, y))
    return jax.ops.segment_sum(l, jnp.asarray(ids), num_segments=num_segments)
  return sums


def _of_segments(fn, sums=_segment_sums()):
  return lambda x, y: fn(sums(x, y))


def _segment_ids_computed_mean(x, y):  # ids from iota; a mean over examples
  ids = jnp.repeat(jnp.arange(B), T)
  return jnp.mean(jax.ops.segment_sum(_token_losses(x, y), ids,
                                      num_segments=B)) * B


def _at_add_loss(x, y):
  return jnp.sum(jnp.zeros(B).at[jnp.asarray(_TOKEN_IDS)].add(
      _token_losses(x, y)))


def _sum_of_tokens(x, y):
  return jnp.sum(_token_losses(x, y))


def _data_weight(x):  # a per-example weight read from the input data
  return jnp.abs(x[:, 0, 0]) + 0.5


def _per_example_of_tokens(fn, weighted=False):
  """The reference's loss: ``fn`` of one example's token losses, summed
  over the examples (weighted by :func:`_data_weight`)."""
  def body(x, y):
    per = jax.vmap(fn)(_token_losses(x, y).reshape(x.shape[0], -1))
    return jnp.sum(_data_weight(x) * per if weighted else per)
  return body


_SEGMENT_OF = np.array([1, 3, 0, 2])  # example e's tokens -> segment
_MIXING_IDS = (np.arange(B * T) * 3) % B  # a segment mixes examples
_TIME_MAJOR_TOKENS = lambda l: jnp.swapaxes(l.reshape(B, T), 0, 1).reshape(-1)
_FORTRAN_TOKENS = lambda l: l.reshape(B, T).ravel(order="F")


def _segment_pooling(ids):
  """Per-token features pooled by a segment sum, then a tracked head."""
  def body(x, y):
    h = jnp.tanh(hk.Linear(F, name="token")(x))
    b, t = h.shape[:2]
    pooled = jax.ops.segment_sum(h.reshape(b * t, -1), ids(b, t),
                                 num_segments=b)
    return _sq(hk.Linear(3, name="head")(pooled), y[:, 0])
  return body


# A helper called twice holds the same program (and variables) in both
# calls: what it reads in each call must be told apart.
_ROW = jax.jit(lambda a, i: jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0))
_ROW_REMAT = jax.checkpoint(
    lambda a, i: jax.lax.dynamic_slice_in_dim(a, i, 1, axis=0))


def _rows_by_helper(row, shift):
  """Term ``i`` pairs output row ``i`` with label row ``i + shift``."""
  def body(x, y):
    out = ef._head(x)
    return sum(0.5 * jnp.sum((row(out, i) - row(y, (i + shift) % B)) ** 2)
               for i in range(B))
  return body


def _outer_product_with_labels(x, y, terms=False):
  l = 0.5 * jnp.sum(jnp.einsum("btf,ctf->bc", ef._head(x), y) ** 2, 1)
  return l if terms else jnp.sum(l)


def _per_example_product_with_labels(x, y):
  return 0.5 * jnp.sum(jnp.einsum("btf,btf->b", ef._head(x), y) ** 2)


# Index arrays of equal contents however written, and of other contents.
_PERM_I32 = jnp.asarray(_PERM, jnp.int32)
_EQUAL_INDEX_ARRAYS = {
    "numpy_and_jnp": (lambda o: o[_PERM], lambda y: y[_PERM_I32]),
    "jnp_and_numpy": (lambda o: o[_PERM_I32], lambda y: y[_PERM]),
    "negative_and_positive": (lambda o: o[_PERM - B], lambda y: y[_PERM_I32]),
    "iota_built": (lambda o: o[(jnp.arange(B) * 3 + 2) % B],  # [2, 1, 0, 3]
                   lambda y: y[np.array([2, 1, 0, 3])]),
}


def _bits_identity():  # [0, 1, 2, 3] on the device, by integer bit ops
  i = jnp.arange(B)
  return ((i | 3) + i + 1) % B


def _lagged_rows(x, y):
  """Round ``t`` pairs the output row of round ``t - 1`` with ``y[t]``."""
  out = ef._head(x)

  def step(i, carry):
    loss, prev = carry
    loss = loss + 0.5 * jnp.sum(
        (prev - jax.lax.dynamic_slice_in_dim(y, i, 1, 0)) ** 2)
    return loss, jax.lax.dynamic_slice_in_dim(out, i, 1, 0)
  init = (0.0, jnp.zeros((1,) + out.shape[1:]))
  return jax.lax.fori_loop(0, B, step, init)[0]


# Gathers whose index array holds data (the labels): x[rows, labels], on
# x: [B, F] and integer labels [B].
_CLASSES = 5


def _logits_picked(pick):
  """``-sum(pick(log_softmax(out), labels))``."""
  def body(x, labels, *extra):
    out = hk.Linear(_CLASSES, name="head")(
        jnp.tanh(hk.Linear(F, name="first")(x)))
    return -jnp.sum(pick(jax.nn.log_softmax(out), labels, *extra))
  return body


def _labelled(x, y):
  return x[:, 0], jnp.argmax(y[:, 0], -1).astype(jnp.int32)


_OWN_ROWS = {
    "arange": lambda lp, l: lp[jnp.arange(lp.shape[0]), l],
    "numpy_arange": lambda lp, l: lp[np.arange(B), l],
    "column_indices": lambda lp, l: lp[jnp.arange(lp.shape[0])[:, None],
                                       l[:, None]],
    "take_along_axis": lambda lp, l: jnp.take_along_axis(
        lp, l[:, None], axis=1),
    "each_row_twice": lambda lp, l: lp[jnp.arange(lp.shape[0])[:, None],
                                       jnp.stack([l, (l + 1) % _CLASSES], 1)],
}

_PAIRED_WITH_OTHERS = {
    "rows_reversed": lambda lp, l: lp[jnp.arange(lp.shape[0])[::-1], l],
    "rows_rolled": lambda lp, l: lp[(jnp.arange(lp.shape[0]) + 1) % B, l],
    "outputs_reversed_first": lambda lp, l: lp[::-1][jnp.arange(B), l],
    "flat_index": lambda lp, l: lp.ravel()[
        jnp.arange(B)[::-1] * _CLASSES + l],
    "rows_by_data": lambda lp, l, idx: lp[idx, l],
    "rows_in_fortran_order": lambda lp, l: lp[
        jnp.arange(B).reshape(2, B // 2).ravel(order="F"), l],
    "every_row_sliced": lambda lp, l: jax.lax.gather(
        lp, jnp.stack([jnp.zeros_like(l), l], 1),
        jax.lax.GatherDimensionNumbers(offset_dims=(0,),
                                       collapsed_slice_dims=(1,),
                                       start_index_map=(0, 1)),
        (B, 1), mode="clip").sum(0),
    "windows_of_two_rows": lambda lp, l: jax.lax.gather(
        lp, jnp.stack([jnp.arange(B), l], 1),
        jax.lax.GatherDimensionNumbers(offset_dims=(1,),
                                       collapsed_slice_dims=(1,),
                                       start_index_map=(0, 1)),
        (2, 1), mode="clip"),
}


def _labelled_with_rows(x, y):  # (rows_by_data: the rows are data too)
  return _labelled(x, y) + (jnp.asarray(np.arange(B)[::-1]),)


# Losses the check cannot separate (refused, naming the operation that
# first combined the examples), and what the refusal says to write.
def _loss_of_outputs(loss):
  return lambda x, y: loss(hk.Linear(3)(x), y)


_CANNOT_SEPARATE = {
    "trace_of_output_gram": (
        lambda out, y: jnp.trace(out[:, 0] @ out[:, 0].T), "dot_general"),
    "reshape_alike": (
        lambda out, y: jnp.sum((out.reshape(3, B * T) -
                                y.reshape(3, B * T)) ** 2), "reshape"),
    "convolve_losses": (
        lambda out, y: jnp.sum(jnp.convolve(out.sum((1, 2)),
                                            jnp.array([1., 2.]))),
        "conv_general_dilated"),
    "square_of_sum": (lambda out, y: jnp.sum(out) ** 2, "integer_pow"),
    # A batch softmax under stop_gradient is a weight (its reduce_max is
    # not where the loss couples the examples); the square of the mean is.
    "weighted_then_square_of_mean": (
        lambda out, y: jnp.sum(out.sum((1, 2)) * jax.lax.stop_gradient(
            jax.nn.softmax(out.sum((1, 2))))) + jnp.mean(out) ** 2,
        "integer_pow"),
}


def _cannot_separate(primitive):
  return rf"not a sum(.|\n)*first combined by {primitive} \(operands \("


# A loop over the examples, and the same per-example code under hk.vmap.
def _loop_step(x_one, y_one):
  out = hk.Linear(2, name="o")(jnp.tanh(hk.Linear(3, name="l")(x_one)))
  return jnp.sum((out - y_one) ** 2)


def _looped(loop):
  """``loop(step, xs, ys)`` over the examples, with the layers made (and
  initialised) before the loop as hk.scan and hk.map need."""
  def body(x, y):
    lin, out = hk.Linear(3, name="l"), hk.Linear(2, name="o")
    out(lin(x[:1, 0]))
    step = lambda xe, ye: jnp.sum((out(jnp.tanh(lin(xe[None]))) - ye) ** 2)
    return jnp.sum(loop(step, x[:, 0], y[:, 0, :2]))
  return body


_scanned_examples = _looped(lambda step, xs, ys: hk.scan(
    lambda c, xy: (c, step(*xy)), 0.0, (xs, ys))[1])
_mapped_examples = _looped(
    lambda step, xs, ys: hk.map(lambda xy: step(*xy), (xs, ys)))


def _python_loop_over_examples(x, y):
  return sum(_loop_step(x[i:i + 1, 0], y[i, 0, :2]) for i in range(B))


def _per_example_code_under_hk_vmap(x, y):
  return jnp.sum(hk.vmap(_loop_step, split_rng=False)(x[:, 0], y[:, 0, :2]))


_VMAP_ADVICE = "(.|\n)*map the per-example code with hk.vmap instead"


def _batch_term_in_every_loss(x, y):  # (l_i + c).sum(), c a batch mean
  out = hk.Linear(3)(x)
  per = jnp.sum((out - y) ** 2, axis=(1, 2))
  return jnp.sum(per + 0.1 * jnp.mean(out ** 2))


def _batch_term_once(x, y):  # the same total, the batch term added once
  out = hk.Linear(3)(x)
  per = jnp.sum((out - y) ** 2, axis=(1, 2))
  return jnp.sum(per) + 0.1 * x.shape[0] * jnp.mean(out ** 2)


# -- soundness of the clipped sum (tests/test_soundness_flow.py) ---------------
# On x: [B, F], y: [B, 2] (sf._model's head on pre(x)).


def _flat(x, y):
  return x[:, 0], y[:, 0, :2]


def _head_on(pre=lambda x: x, labels=lambda y: y):
  def body(x, y):
    return jnp.sum((hk.Linear(2, name="head")(pre(x)) - labels(y)) ** 2)
  return body


_PLAIN_HEAD = _head_on()


def _computed_once(pre):
  """``reference_data``: ``pre`` of the batch, computed once for it."""
  return lambda x, y: (pre(x), y)


def _fori_to_a_batch_count(x):
  return jax.lax.fori_loop(0, jnp.sum(x > 1.0), lambda i, v: v * 0.5, x)


def _stop_on_example_0(x):
  return jax.lax.while_loop(lambda v: jnp.abs(v[0, 0]) > 1.0,
                            lambda v: v * 0.5, x)


def _count_to_a_batch_count(x):
  def body(c):
    return c[0] * 0.9, c[1] + 1
  return jax.lax.while_loop(lambda c: c[1] < jnp.sum(x > 0.0), body,
                            (x, 0))[0]


def _scale_chosen_by_example_0(x):
  scale = jax.lax.cond(x[0, 0] > 0.0, lambda: 0.5, lambda: 2.0)
  return x * scale


def _halve_each_until_its_max(x):
  return jax.vmap(sf._halve_until_batch_max)(x)


def _count_each_to_its_own(x):
  def one(r):
    def body(c):
      return c[0] * 0.9, c[1] + 1
    return jax.lax.while_loop(lambda c: c[1] < jnp.sum(r > 0.0), body,
                              (r, 0))[0]
  return jax.vmap(one)(x)


def _loop_inside_hk_vmap(x, y):
  def per_example(xi, yi):
    h = hk.Linear(2, name="head")(sf._halve_until_batch_max(xi))
    return jnp.sum((h - yi) ** 2)
  return jnp.sum(hk.vmap(per_example, split_rng=False)(x, y))


# Data the loss closes over (the transforms take the rest of the batch).
_CLOSED_RNG = np.random.RandomState(4)
_CLOSED_X = _CLOSED_RNG.randn(B, F).astype(np.float32)
_CLOSED_Y = _CLOSED_RNG.randn(B, 2).astype(np.float32)
_CLOSED_INT = np.argmax(_CLOSED_Y, -1).astype(np.int32)

_CLOSED_LABELS_OF = {
    "labels_numpy": _CLOSED_Y,
    "labels_jax": jnp.asarray(_CLOSED_Y),
    "labels_centred": _CLOSED_Y - _CLOSED_Y.mean(0),
}


def _closing_over_labels(labels):
  def body(x):
    return jnp.sum((hk.Linear(2, name="head")(x) - labels) ** 2)
  return body


def _closing_over_int_labels(x):
  logp = jax.nn.log_softmax(hk.Linear(2, name="head")(x))
  return -jnp.sum(jnp.take_along_axis(logp, _CLOSED_INT[:, None], axis=1))


def _int_labels_reference(x, labels):
  logp = jax.nn.log_softmax(hk.Linear(2, name="head")(x))
  return -jnp.sum(jnp.take_along_axis(logp, labels[:, None], axis=1))


def _one_hot_of_closed_over_int_labels(x):
  out = hk.Linear(2, name="head")(x)
  return jnp.sum((out - jax.nn.one_hot(_CLOSED_INT, 2)) ** 2)


def _closing_over_inputs(inputs):
  def body(y):
    return jnp.sum((hk.Linear(2, name="head")(inputs) - y) ** 2)
  return body


_PROJ = np.random.RandomState(9).randn(F, F).astype(np.float32)
_CLASS_W = np.array([0.5, 2.0], np.float32)


def _small_closed_over_constants(x, y):
  """A scale, a fixed projection and per-class weights (no axis of the
  batch's size), and index arrays that pick rows: constants."""
  out = hk.Linear(2, name="head")((x @ _PROJ) * np.float32(0.5))
  l = jnp.sum(_CLASS_W * (out[_PERM] - y[_PERM]) ** 2, -1)
  return jnp.sum(l[np.arange(B)])


def _small_constants_reference(x, y):
  return jnp.sum(_CLASS_W * (
      hk.Linear(2, name="head")((x @ _PROJ) * 0.5) - y) ** 2)


def _labels_picked_by_a_closed_over_arange(x, labels):
  logp = jax.nn.log_softmax(hk.Linear(2, name="head")(x))
  return -jnp.sum(logp[np.arange(len(labels)), labels])


def _flat_labelled(x, y):
  return x[:, 0], jnp.argmax(y[:, 0, :2], -1).astype(jnp.int32)


_TABLE = np.random.RandomState(12).randn(B, F).astype(np.float32)


def _reads_a_table(x, y, table):
  h = jnp.tanh(x @ table.T)  # (B, B): every example reads the table
  return jnp.sum((hk.Linear(2, name="head")(h) - y) ** 2)


# Augmentation multiplicity: K views of each example, flat or grouped.
def _views_head(h):
  return hk.Linear(2, name="head")(jnp.tanh(hk.Linear(4, name="first")(h)))


def _flat_views(x, y):  # x: [B K, F], y: [B, 2]
  out = _views_head(x)
  return jnp.sum((out.reshape(y.shape[0], -1, 2) - y[:, None]) ** 2)


_VIEWS_SPLIT = r"split the examples' axis of 16 rows into \(4, 4\)"


def _grouped_views(x, y):  # x: [B, K, F]
  return jnp.sum((_views_head(x) - y[:, None]) ** 2)


# -- which parameter reaches which Gram op (tests/test_sharing.py) -----------


def _applied_twice(x, y):  # one module, two applications
  lin = hk.Linear(F, name="lin")
  return _sq(hk.Linear(3)(jnp.tanh(lin(jnp.tanh(lin(x))))), y)


def _in_a_cond_branch_and_outside(x, y):
  lin = hk.Linear(F, name="lin")
  h = jnp.tanh(lin(x))
  h = hk.cond(jnp.sum(x) > -1e9, lambda a: lin(a), lambda a: a * 2., h)
  return _sq(hk.Linear(3)(h), y)


def _layer_stack(x, y):  # different parameters per step: not sharing
  h = hk.layer_stack(2)(lambda h: jnp.tanh(hk.Linear(F)(h)))(x)
  return _sq(hk.Linear(3)(h), y)


def _weight_penalty(x, y):  # the parameter read outside every Gram op
  lin = hk.Linear(3, name="head")
  out = lin(x)
  return _sq(out, y) + 0.01 * jnp.sum(lin.params_dict()["head/w"] ** 2)


def _shared_block_under_remat_and_outside(x, y):  # ALBERT-style
  block = hk.Linear(F, name="albert_block")
  h = hk.remat(lambda a: jnp.tanh(block(a)))(x)
  return _sq(hk.Linear(3)(jnp.tanh(block(h))), y)


def _siamese_encoder_in_two_hk_vmaps(x, y):
  enc = hk.Linear(3, name="encoder")
  a = hk.vmap(lambda xi: jnp.tanh(enc(xi)), split_rng=False)(x[:, 0])
  b = hk.vmap(lambda xi: jnp.tanh(enc(xi)), split_rng=False)(x[:, 1])
  return _sq(a * b, y[:, 0])


def _same_module_in_both_cond_branches(x, y):
  lin = hk.Linear(3, name="lin")
  # A predicate that every example (and the batch) agrees on.
  return _sq(hk.cond(jnp.sum(x) < 1e9, lambda a: lin(2. * a),
                     lambda a: lin(a), x), y)


def _copying_getter(next_getter, value, context):
  del context
  return jnp.array(next_getter(value), copy=True)  # a new array per read


def _called_twice_under_a_copying_getter(x, y):
  with hk.custom_getter(_copying_getter):
    lin = hk.Linear(3, name="lin")
    return _sq(jnp.tanh(lin(x)) + lin(x ** 2 / 5), y)


def _unrolled_lstm(unroll):
  def body(x, y):
    core = hk.LSTM(5)
    out, _ = unroll(core, jnp.swapaxes(x, 0, 1),
                    core.initial_state(x.shape[0]))
    return _sq(hk.Linear(3)(jnp.swapaxes(out, 0, 1)), y)
  return body


def _applied_twice_without_its_first_parameter(make):
  def body(x, y):
    m = make()
    return _sq(hk.Linear(3)(m(jnp.tanh(m(x)))), y)
  return body


def linear_then(second):
  def body(x, y):
    lin = hk.Linear(x.shape[-1], name="l1")
    h = jnp.tanh(lin(x))
    forced = hk.experimental.force_name(lin.module_name)
    return _sq(hk.Linear(3)(second(forced)(h)), y)
  return body


# -- modules in loops (tests/test_loops.py) ------------------------------------


def _loop_head(model):
  """``model(x)`` (``[B, 2]``) against ``y[:, 0, :2]``."""
  def body(x, y):
    return _sq(model(x), y[:, 0, :2])
  return body


def _raw_lax_scan_body(x):  # jax.lax.scan, not hk.scan: no slots
  lin = hk.Linear(F, name="cell")
  h0 = jnp.tanh(lin(jnp.zeros((x.shape[0], 2 * F))))  # creates w, b
  def step(h, xt):
    return jnp.tanh(lin(jnp.concatenate([xt, h], -1))), None
  h, _ = jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1))
  return hk.Linear(2, name="head")(h)


def _in_a_cond_branch_after_a_call(x):
  lin = hk.Linear(F, name="cell")
  h = jnp.tanh(lin(x[:, 0]))
  flag = jnp.ones((), jnp.float32) * x.shape[0] > 0  # not the examples
  h = hk.cond(flag, lambda h: jnp.tanh(lin(h)), lambda h: h, h)
  return hk.Linear(2, name="head")(h)


def _called_on_two_shapes(x):  # [B, F] then [B, 2, F]
  lin = hk.Linear(F, name="shared")
  h = jnp.tanh(lin(x[:, 0]))
  h2 = jnp.tanh(lin(jnp.stack([h, x[:, 1]], axis=1))).sum(1)
  return hk.Linear(2, name="head")(h2)


def _nested_scans(x):  # an outer hk.scan over 2 chunks of a dynamic unroll
  x = x.reshape(x.shape[0], 2, T // 2, F)
  core = hk.LSTM(5)
  def chunk(state, xc):  # xc: [B, T / 2, F]
    outs, state = hk.dynamic_unroll(core, jnp.swapaxes(xc, 0, 1), state)
    return state, outs[-1]
  state, last = hk.scan(chunk, core.initial_state(x.shape[0]),
                        jnp.swapaxes(x, 0, 1))
  return hk.Linear(2, name="head")(last[-1] + state.hidden)


def _core_under_hk_vmap(x):
  def one(xi):  # [T, F]
    core = hk.LSTM(5)
    outs, _ = hk.dynamic_unroll(core, xi, core.initial_state(None))
    return hk.Linear(2, name="head")(outs[-1])
  return hk.vmap(one, split_rng=False)(x)


def _dead_last_step(x):  # the last application's output is never used
  lin = hk.Linear(F, name="cell")
  h, hs = jnp.zeros((x.shape[0], F)), []
  for t in range(T):
    h = jnp.tanh(lin(jnp.concatenate([x[:, t], h], -1)))
    hs.append(h)
  return hk.Linear(2, name="head")(sum(hs[:-1]))


def _dead_warm_up(x):  # a call whose output is dropped, then a scan
  lin = hk.Linear(F, name="cell")
  lin(jnp.zeros((x.shape[0], 2 * F)))
  def step(h, xt):
    return jnp.tanh(lin(jnp.concatenate([xt, h], -1))), None
  h, _ = hk.scan(step, jnp.zeros((x.shape[0], F)), jnp.swapaxes(x, 0, 1))
  return hk.Linear(2, name="head")(h)


# -- frozen parameters (tests/test_frozen.py) ----------------------------------


def _stop_gradient_of(*names):
  """A getter freezing the parameters called ``names``."""
  def getter(next_getter, value, context):
    value = next_getter(value)
    return jax.lax.stop_gradient(value) if context.name in names else value
  return getter


def _bitfit(x, y):  # weights frozen, biases trained
  with hk.custom_getter(_stop_gradient_of("w")):
    return _sq(hk.Linear(3)(jnp.tanh(hk.Linear(F)(x))), y)


def _frozen_in_one_use_only(x, y):
  lin = hk.Linear(F, name="lin")
  h = jnp.tanh(lin(x))
  with hk.custom_getter(lambda nxt, v, c: jax.lax.stop_gradient(nxt(v))):
    h = lin(h)
  return _sq(hk.Linear(3)(h), y)


def _untracked_slope_under_stop_gradient(x, y):  # a PReLU, slope frozen
  h = hk.Linear(F, name="l1")(x)
  alpha = jax.lax.stop_gradient(hk.get_parameter(
      "alpha", (F,), init=hk.initializers.Constant(0.2)))
  return _sq(hk.Linear(3, name="l2")(jnp.where(h > 0, h, alpha * h)), y)


# -- getters between a parameter and its layer (tests/test_reparam.py) --------


def _only(name, fn):
  """A getter applying ``fn`` to the parameters called ``name``."""
  return lambda nxt, v, c: fn(nxt(v)) if c.name == name else nxt(v)


_SCALE = lambda n, v, c: 2.0 * n(v)
_WEIGHT_NORM = _only("w", lambda w: w / jnp.linalg.norm(w, axis=0))


@jax.custom_vjp
def _double_grad(w):
  return w


_double_grad.defvjp(lambda w: (w, None), lambda _, g: (2.0 * g,))


def _under_getter(getter):
  def body(x, y):
    with hk.custom_getter(getter):
      h = jnp.tanh(hk.Linear(F, name="target")(x))
    return _sq(hk.Linear(3, name="head")(h), y)
  return body


def _getter_called_twice(x, y):
  with hk.custom_getter(_WEIGHT_NORM):
    lin = hk.Linear(F, name="lin")
    h = lin(jnp.tanh(lin(x)))
  return _sq(hk.Linear(3, name="head")(h), y)


def _getter_static_unroll(x, y):
  with hk.custom_getter(_WEIGHT_NORM):
    core = hk.LSTM(4)
    out, _ = hk.static_unroll(core, jnp.swapaxes(x, 0, 1),
                              core.initial_state(x.shape[0]))
  return _sq(hk.Linear(3, name="head")(jnp.swapaxes(out, 0, 1)), y)


def _gain_read_by_the_getter_alone(x, y):
  s = hk.get_parameter("s", (), init=hk.initializers.Constant(1.5))
  with hk.custom_getter(_only("w", lambda w: s * w)):
    h = jnp.tanh(hk.Linear(5, name="l1")(x))
  return _sq(hk.Linear(3, name="l2")(h), y)


def _getter_applied_twice_differently(x, y):
  lin = hk.Linear(F)
  with hk.custom_getter(_SCALE):
    h = jnp.tanh(lin(x))
  with hk.custom_getter(lambda n, v, c: 3.0 * n(v)):
    return _sq(hk.Linear(3)(lin(h)), y)


def _getter_parameter_read_elsewhere(x, y):
  with hk.custom_getter(_SCALE):
    lin = hk.Linear(3, name="lin")
    out = lin(x)
  # A weight-decay term reads the raw parameter again, outside the getter.
  return _sq(out, y) + jnp.sum(lin.params_dict()["lin/w"] ** 2)


def _getter_inside(where):
  def body(x, y):
    with hk.custom_getter(_SCALE):
      if where == "dynamic_unroll":
        core = hk.VanillaRNN(3)
        out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1),
                                   core.initial_state(x.shape[0]))
        return _sq(jnp.swapaxes(out, 0, 1), y)
      lin = hk.Linear(3)
      if where == "cond":
        out = hk.cond(jnp.sum(x) > 0, lin, lambda a: lin(-a), x)
      else:
        out = hk.remat(lin)(x)
      return _sq(out, y)
  return body


_GETTER_INSIDE = "inside a call, loop or branch|more than once"


# -- bare parameters read from the program (tests/test_program_rules.py) ------
# (A bare parameter is read inside a track(untracked="error") block, so that
# a use no rule covers is refused rather than left out of the Gram; the
# reference runs the same body without it: _bare_row.)


def _bare(name, shape, scale=1.0):
  return hk.get_parameter(name, shape, init=hk.initializers.RandomNormal(
      scale))


def _bare_row(body, gram, clip_refuses) -> Row:
  """The row of ``body(x, y, strict)``: its bare parameters read under
  ``track(untracked="error")``, and as plain Haiku by the reference."""
  return Row(body.__name__.lstrip("_"),
             lambda x, y: body(x, y, strict=True), gram, clip_refuses,
             reference_body=lambda x, y: body(x, y, strict=False),
             source=_PR)


def _uses(strict):
  return (gram_haiku.track(untracked="error") if strict
          else contextlib.nullcontext())


def _bare_weight_matmul(x, y, strict):  # W through an elementwise prefix
  with _uses(strict):
    h = jnp.tanh(x @ (_bare("w", (F, 3)) * 0.5))
  return _sq(h + hk.Linear(3)(x), y)


def _bare_weight_first_in_einsum(x, y, strict):
  with _uses(strict):
    h = jnp.einsum("df,btf->btd", _bare("w", (3, F)), x)
  return _sq(jnp.tanh(h) * hk.Linear(3)(x), y)


def _bare_kernel_conv(x, y, strict):
  with _uses(strict):
    h = jax.lax.conv_general_dilated(
        x, _bare("k", (2, F, 3)), (1,), "SAME",
        dimension_numbers=("NWC", "WIO", "NWC"))
  return _sq(jnp.tanh(h + hk.Linear(3)(x)), y)


def _ids(x, vocab=7):
  return (jnp.abs(x[..., 0]) * 3).astype(jnp.int32) % vocab


def _bare_table_gather(x, y, strict):  # ids from each example's data
  with _uses(strict):
    h = _bare("table", (7, 3))[_ids(x)]
  return _sq(h * hk.Linear(3)(x), y)


def _bare_table_take(x, y, strict):  # jnp.take: a gather inside a jit call
  with _uses(strict):
    h = jnp.take(_bare("table", (7, 3)), _ids(x), axis=0)
  return _sq(jnp.tanh(h + hk.Linear(3)(x)), y)


def _bare_weights_time_major(x, y, strict):  # x: [T, B, F], example axis 1
  with _uses(strict):
    h = jnp.einsum("tbf,fd->btd", x, _bare("w", (F, 3)))
    h = jnp.tanh(h) * _bare("table", (7, 3))[_ids(jnp.swapaxes(x, 0, 1))]
  return _sq(h + hk.Linear(3)(jnp.swapaxes(x, 0, 1)), y)


def _bare_token_tiled(x, y, strict):  # jnp.tile (a lax primitive), Flax ViT
  with _uses(strict):
    cls = _bare("cls", (1, 1, F))
    h = jnp.concatenate([jnp.tile(cls, [x.shape[0], 1, 1]), x], axis=1)
    h = jnp.tanh(hk.Linear(3)(h))[:, :T]
  return _sq(h, y)


def _bare_rnn_from_zero_carry(x, y, strict):
  # Unrolled in Python from a zero carry: the first step's
  # zeros @ w_h + b is the same for every example (a prefix value).
  with _uses(strict):
    w_h, w_x, b = _bare("w_h", (3, 6)), _bare("w_x", (F, 3)), _bare("b", (6,))
    h, outs = jnp.zeros((x.shape[0], 3)), []
    for t in range(T):
      a, g = jnp.split(h @ w_h + b, 2, axis=-1)
      h = jnp.tanh(a + x[:, t] @ w_x) * jax.nn.sigmoid(g)
      outs.append(h)
  return _sq(jnp.stack(outs, 1) + hk.Linear(3)(x), y)


def _bare_weight_of_example_index(x, y, strict):
  # A constant that differs along the examples (their index) times w.
  with _uses(strict):
    rows = jnp.arange(x.shape[0], dtype=x.dtype)[:, None] * jnp.ones((1, F))
    h = rows @ _bare("w", (F, 3))
  return _sq(jnp.tanh(h[:, None] + hk.Linear(3)(x)), y)


def _bare_weight_broadcast_then_contracted(x, y, strict):
  # A sum of w's copies over the batch: each example's share depends on B.
  with _uses(strict):
    w = jnp.broadcast_to(_bare("w", (3,)), (x.shape[0], 3))
    h = jnp.ones((T, x.shape[0]), x.dtype) @ w
  return _sq(jnp.tanh(h + hk.Linear(3)(x)), y)


def _bare_weight_contracts_the_examples(x, y, strict):
  # Summed over the examples: no example's share can be told apart.
  with _uses(strict):
    h = jnp.einsum("btf,bd->tfd", x, _bare("w", (B, 3)))
  return _sq(hk.Linear(3)(x), y) + jnp.sum(h)


def _bare_table_dynamic_slice(x, y, strict):  # one row for the whole batch
  with _uses(strict):
    row = jax.lax.dynamic_slice_in_dim(_bare("table", (7, 3)),
                                       _ids(x)[0, 0], 1)
  return _sq(hk.Linear(3)(x) + row, y)


def _tracked_weight_read_by_a_matmul(x, y):
  # Its layer's part and the matmul's (a program-level site) add up.
  lin = hk.Linear(3)
  h = jnp.tanh(lin(x))
  return _sq(h + jnp.tanh(x @ lin.params_dict()["linear/w"]), y)


def _tracked_weight_read_in_a_scan(x, y):
  # The outside use is inside a loop (its body's matmul, a per-example
  # site summed over the steps), the layer applied outside it.
  lin = hk.Linear(3)
  h = lin(x)
  w = lin.params_dict()["linear/w"]
  _, o = jax.lax.scan(lambda c, xt: (c, jnp.tanh(xt @ w)), 0.0,
                      jnp.swapaxes(x, 0, 1))
  return _sq(h + jnp.swapaxes(o, 0, 1), y)


def _tracked_layer_in_a_scan_read_outside(x, y):
  # The layer is applied inside a loop (it keeps no per-example gradients
  # of its own there), its weight read by a matmul outside it.
  lin = hk.Linear(3)
  _, o = hk.scan(lambda c, xt: (c, jnp.tanh(lin(xt))), 0.0,
                 jnp.swapaxes(x, 0, 1))
  return _sq(jnp.swapaxes(o, 0, 1) + x @ lin.params_dict()["linear/w"], y)


def _tracked_layer_in_a_remat_read_outside(x, y):
  # The layer applied inside a checkpoint, its weight read outside it.
  lin = hk.Linear(3)
  h = hk.remat(lambda a: jnp.tanh(lin(a)))(x)
  return _sq(h + jnp.tanh(x @ lin.params_dict()["linear/w"]), y)


def _tracked_layer_in_a_cond_read_inside(x, y):
  # The layer applied outside, its weight read in the branch a parameter
  # chose (and by a broadcast in the other one).
  lin = hk.Linear(3)
  h = jnp.tanh(lin(x))
  w, b = lin.params_dict()["linear/w"], lin.params_dict()["linear/b"]
  h = jax.lax.cond(jnp.sum(b) < 1e9, lambda h: h + jnp.tanh(x @ w),
                   lambda h: h * b, h)
  return _sq(h, y)


def _tracked_layer_in_a_cond_read_outside(x, y):
  # The layer applied in the branch a constant chose, its weight read
  # outside.
  lin = hk.Linear(3)
  h = hk.cond(jnp.float32(1.0) > 0, lambda a: jnp.tanh(lin(a)),
              lambda a: jnp.tanh(lin(-a)), x)
  return _sq(h + jnp.tanh(x @ lin.params_dict()["linear/w"]), y)


_MIXED = r"(?s)'linear/w' is used both inside a tracked layer.*`scan`"
_PR = "tests/test_program_rules.py"
_PROGRAM_REFUSED = "No program-level rule covers its use by `{}`.*{}"
_EF = "tests/test_example_flow.py"
_SF = "tests/test_soundness_flow.py"
_SH = "tests/test_sharing.py"
_LO = "tests/test_loops.py"
_FR = "tests/test_frozen.py"
_RP = "tests/test_reparam.py"

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
    Row("layer_on_a_memory_of_another_size",
        _layer_on_a_memory_of_another_size, r"(?s)'k'.*broadcast", True,
        source=_EF),
    # -- where the examples flow: exact ----------------------------------------
    Row("positions_broadcast", _positions_broadcast, EXACT, False,
        source=_EF),
    Row("attention", _attention, EXACT, False, source=_EF),
    Row("stack_and_scan", _stack_and_scan, EXACT, False, source=_EF),
    Row("per_example_vmap", _per_example_vmap, EXACT, False, source=_EF),
    Row("dot_product_attention", _dot_product_attention, EXACT, False,
        source=_EF),
    Row("dot_product_attention_causal", _dot_product_attention_causal,
        EXACT, False, source=_EF),
    Row("attention_over_time_major", _attention_over_time_major, EXACT,
        False, source=_EF),
    # (Refused for clipping: the strict check pairs the outputs' and the
    # targets' example axes by position, and the targets' is axis 1 here. A
    # conservative refusal, pinned as today's behaviour.)
    Row("contracted_with_transposed_targets",
        _contracted_with_transposed_targets, EXACT, True, source=_EF),
    # A statistic of the input data: exact for the Gram (input data for
    # every example's gradient), refused for clipping (one example's
    # gradient then reads the others' data).
    Row("data_centred", _data_centred, EXACT, True,
        reference_body=_centred_input_reference, reference_data=_centred,
        source=_EF),
    # Per-example code under hk.vmap on inputs that do not depend on the
    # example (explicitly batched, such layers are refused above).
    Row("vmapped_positions", _vmapped(ef._vmapped_positions), EXACT, False,
        source=_EF),
    Row("vmapped_frozen_memory_mean", _vmapped(_vmapped_frozen_memory_mean),
        EXACT, False, source=_EF),
    Row("vmapped_cross_attention",
        _vmapped(_vmapped_cross_attention_to_a_frozen_memory), EXACT, False,
        source=_EF),
    Row("vmapped_penalty", _vmapped(_vmapped_penalty_on_a_frozen_memory),
        EXACT, False, source=_EF),
    # Losses whose terms are reordered or weighted: a sum of per-example
    # terms still.
    Row("weighted_halves", _weighted_halves, EXACT, False,
        reference_terms=lambda x, y: _HALVES * _linear_losses(x, y),
        source=_EF),
    *[Row(f.__name__.lstrip("_"), f, EXACT, False,
          reference_terms=_linear_losses, source=_EF)
      for f in (_reversed_loss, _permuted_pairs, _cumsum_loss)],
    # What the model stops the gradient of is data for differentiation: the
    # Gram is of the terms with those values held fixed (rows of jacrev);
    # clipping refuses (one example's gradient reads others' data).
    *[Row(f"stopped_{name}", _stopped(total), EXACT, OTHERS_DATA,
          reference_terms=_stopped(total, terms=True), source=_EF)
      for name, total in _STOPPED_TOTALS.items()],
    Row("stopped_centring", _stopped_centring_between_layers, EXACT,
        OTHERS_DATA, reference_terms=lambda x, y: (
            _stopped_centring_between_layers(x, y, terms=True)),
        source=_EF),
    *[Row(f"unstopped_{name}", _unstopped(coupling), NOT_A_SUM, True,
          source=_EF) for name, coupling in _UNSTOPPED.items()],
    # Layer inputs reordered, gathers and pools over the batch.
    Row("hidden_reversed_then_layer", _hidden_reversed_then_layer,
        REORDERED, True, source=_EF),
    Row("paired_outputs", _paired_outputs, NOT_A_SUM, True, source=_EF),
    Row("one_example_per_call", _one_example_per_call, REORDERED, True,
        source=_EF),
    *[Row(f"rows_put_back_{name}", _between(reorder), EXACT, False,
          reference_terms=_between(reorder, terms=True), source=_EF)
      for name, reorder in _ROWS_PUT_BACK.items()],
    *[Row(f"rows_put_back_{name}", _between(reorder),
          "reordered|merges|several" if name == "odd_even" else REORDERED,
          True, source=_EF)
      for name, reorder in _ROWS_PUT_BACK_ELSEWHERE.items()],
    Row("input_data_reordered", _input_data_reordered, REORDERED, True,
        source=_EF),
    # A loss pairing one example's outputs with another's labels ...
    *[Row(f"outputs_paired_{name}", ef._after(*pair), PAIRED,
          f"{PAIRED}|other examples", source=_EF)
      for name, pair in sorted(ef._OUTPUTS_PAIRED_WITH_OTHERS_DATA.items())],
    *[Row(f"outputs_paired_{name}", ef._after(*pair), PAIRED, True,
          source=_EF)
      for name, pair in _PICKED_BY_OTHER_INDEX_ARRAYS.items()],
    # ... or with its own, in another order: exact (each input row with the
    # labels it is paired with; rolled labels are another example's data).
    *[Row(f"outputs_reordered_{name}", ef._after(o, l), EXACT,
          OTHERS_DATA if name == "labels_rolled" else False,
          reference_body=_ONE_ORDER, reference_data=_own_data(per_y),
          source=_EF)
      for name, (o, l, per_y) in _REORDERED_WITH_OWN_DATA.items()],
    # Custom derivatives: a jvp rule that mixes the examples' tangents; rules
    # per row (built-in ones too); a custom_vjp, whose backward is Python
    # code: a warning, and clipping refuses.
    Row("custom_jvp_mixing_examples", ef._through(_mixes_tangents),
        "mixes|coupl", True, source=_EF),
    *[Row(f"custom_jvp_{name}", ef._through(fn), EXACT, False, source=_EF)
      for name, fn in (("own_rule", _own_rule_per_row), ("relu", jax.nn.relu),
                       ("softplus", jax.nn.softplus),
                       ("silu", jax.nn.silu))],
    Row("custom_vjp_per_row", ef._through(ef._scales_cotangents), EXACT,
        "custom_vjp", warns="custom_vjp", source=_EF),
    # (The per-example lengths are closed over: clipping refuses.)
    Row("last_step_take_along_axis", _last_step_take_along_axis, EXACT,
        CLOSED, reference_terms=lambda x, y: _last_step_take_along_axis(
            x, y, terms=True), source=_EF),
    Row("integer_label_cross_entropy", _integer_label_cross_entropy,
        EXACT, False, source=_EF),
    Row("coupled_after_integer_labels", _coupled_after_integer_labels,
        NOT_A_SUM, True, source=_EF),
    Row("hardest_examples", _hardest_examples, NOT_A_SUM, True, source=_EF),
    Row("pooled_over_batch", _pooled_over_batch, COUPLED, True, source=_EF),
    # Writes, transforms and loops over the batch.
    *[Row(f"between_{f.__name__.lstrip('_')}", _two_layers(f), match,
          True, source=_EF)
      for f, match in ((_scatter_permuted, COUPLED),
                       (_scatter_added, REORDERED),
                       (_rows_overwritten, COUPLED),
                       (_fft_over_batch, COUPLED),
                       (_ema_over_batch, COUPLED),
                       (_branch_on_one_example, COUPLED))],
    Row("constant_query", _constant_query, CANDIDATE_REORDERED, True,
        source=_EF),
    Row("one_example_per_scan_step", _one_example_per_scan_step,
        r"row\(s\) of a loop over the examples", True, source=_EF),
    Row("positions_scanned_with_time", _positions_scanned_with_time,
        COMBINED, True, source=_EF),
    Row("sorted_max_loss", _sorted_max_loss, NOT_A_SUM, True, source=_EF),
    Row("sorted_top2_loss", _sorted_top2_loss, NOT_A_SUM, True, source=_EF),
    Row("scanned_product_loss", _scanned_product_loss, NOT_A_SUM, True,
        source=_EF),
    Row("looped_product_loss", _looped_product_loss, NOT_A_SUM, True,
        source=_EF),
    # Writes and transforms within each example: exact.
    *[Row(f"between_{f.__name__.lstrip('_')}", _two_layers(f), EXACT,
          False, source=_EF)
      for f in (_feature_column_zeroed, _features_padded, _first_step_shifted,
                _feature_fft, _steps_unstacked_and_stacked)],
    # Loops, sorts and candidates (a second outside check).
    *[Row(f.__name__.lstrip("_"), f, match, True, source=_EF)
      for f, match in ((_centred_in_second_branch, COUPLED),
                       (_centred_in_a_later_scan_round, COUPLED),
                       (_centred_through_a_delay_line, COUPLED),
                       (_max_by_sort_and_mask, NOT_A_SUM),
                       (_max_by_sort_and_index, NOT_A_SUM),
                       (_max_by_sort_and_cumsum, NOT_A_SUM),
                       (_candidate_rows_permuted, CANDIDATE_REORDERED),
                       (_candidate_concatenated_first, CANDIDATE_REORDERED))],
    # Each example's one-hot row is its own label's (closed over: clipping
    # refuses, as for any closed-over labels).
    Row("one_hot_written_by_scatter", _one_hot_written_by_scatter, EXACT,
        CLOSED, reference_body=_xent,
        reference_data=lambda x, y: (x, jax.nn.one_hot(_CLOSED_LABELS, 3)),
        source=_EF),
    # example_axes: where the examples are (T == B: by size alone axis 0,
    # time, would be taken for the examples).
    Row("time_major_lstm_with_example_axes", ef._time_major_lstm, EXACT,
        False, batch=_TIME_MAJOR, example_axes=(1, 0), source=_EF),
    Row("time_major_vmapped", ef._time_major_vmapped,
        r"'step' takes axis 0 .* holds the examples along axis 1",
        r"'step' takes axis 0 .* holds the examples along axis 1",
        batch=_TIME_MAJOR, source=_EF),
    Row("time_major_vmapped_with_example_axes", ef._time_major_vmapped,
        EXACT, False, batch=_TIME_MAJOR, example_axes=(1, 0), source=_EF),
    Row("memory_of_b_rows", ef._attends_to_a_memory,
        r"'multi_head_attention/key' takes axis 0 .* holds the examples along "
        r"axis 1", OTHERS_DATA, batch=_WITH_A_MEMORY, source=_EF),
    Row("memory_of_b_rows_with_example_axes", ef._attends_to_a_memory,
        EXACT, False, batch=_WITH_A_MEMORY, example_axes=(0, None, 0),
        source=_EF),
    # Told that axis 1 holds the examples, a layer applied to the time-major
    # input directly (its example axis 0 is time) is refused, not trusted.
    Row("time_major_layer_with_example_axes", _time_major_layer_on_time,
        "along axis 1", True, batch=_TIME_MAJOR, example_axes=(1, 0),
        source=_EF),
    # segment_sum (a scatter-add at constant indices) of per-token losses,
    # then a sum: a sum of per-example terms, whatever the segments.
    *[Row(name, body, EXACT, False, reference_body=_sum_of_tokens,
          source=_EF)
      for name, body in (
          ("segment_sum_loss", _of_segments(jnp.sum)),
          ("segment_ids_computed_mean", _segment_ids_computed_mean),
          ("at_add_loss", _at_add_loss),
          ("segments_of_other_examples", _of_segments(
              jnp.sum, _segment_sums(_MIXING_IDS))))],
    # Segments that each gather one example's tokens (ids known on the host):
    # any function of a segment sum, or a per-example weight from the data.
    Row("sqrt_of_segment_sums", _of_segments(lambda s: jnp.sum(jnp.sqrt(s))),
        EXACT, False, reference_body=_per_example_of_tokens(
            lambda l: jnp.sqrt(jnp.sum(l))), source=_EF),
    Row("data_weighted_segment_sums", lambda x, y: jnp.sum(
        _data_weight(x) * _segment_sums()(x, y)), EXACT, False,
        reference_body=_per_example_of_tokens(jnp.sum, weighted=True),
        source=_EF),
    Row("segments_in_another_order", _of_segments(
        lambda s: jnp.sum(s ** 1.5), _segment_sums(_SEGMENT_OF[_TOKEN_IDS])),
        EXACT, False, reference_body=_per_example_of_tokens(
            lambda l: jnp.sum(l) ** 1.5), source=_EF),
    Row("time_major_segments", _of_segments(
        lambda s: jnp.sum(jnp.log1p(s)), _segment_sums(
            np.tile(np.arange(B), T), _TIME_MAJOR_TOKENS)),
        EXACT, False, reference_body=_per_example_of_tokens(
            lambda l: jnp.log1p(jnp.sum(l))), source=_EF),
    Row("fortran_order_segments", _of_segments(
        lambda s: jnp.sum(jnp.sqrt(s)), _segment_sums(
            np.broadcast_to(np.arange(B)[None], (T, B)).ravel(),
            _FORTRAN_TOKENS)),
        EXACT, False, reference_body=_per_example_of_tokens(
            lambda l: jnp.sqrt(jnp.sum(l))), source=_EF),
    Row("segment_pooling", _segment_pooling(
        lambda b, t: jnp.repeat(jnp.arange(b), t)), EXACT, False,
        source=_EF),
    # A segment mixing examples couples them; two segments of one example
    # are not known to be a per-example term once a nonlinear function is
    # taken of each.
    *[Row(name, body, "not a sum|several examples at once", True,
          source=_EF)
      for name, body in (
          ("segment_sums_squared_across_examples", _of_segments(
              lambda s: jnp.sum(s ** 2), _segment_sums(_MIXING_IDS))),
          ("fortran_order_ids", _of_segments(
              lambda s: jnp.sum(jnp.sqrt(s)), _segment_sums(
                  np.broadcast_to(np.arange(B)[:, None], (B, T)).ravel(
                      order="F")))),
          ("fortran_order_tokens", _of_segments(
              lambda s: jnp.sum(jnp.sqrt(s)), _segment_sums(
                  tokens=_FORTRAN_TOKENS))),
          ("two_segments_per_example", _of_segments(
              lambda s: jnp.sum(jnp.sqrt(s)), _segment_sums(
                  np.arange(B * T) // (T // 2), num_segments=2 * B))),
          ("segment_pooling_across_examples", _segment_pooling(
              lambda b, t: jnp.asarray(_MIXING_IDS))))],
    Row("largest_segment_sum", _of_segments(lambda s: jnp.sort(s)[-1]),
        NOT_A_SUM, NOT_A_SUM, source=_EF),
    # A helper called twice (jit, remat) reading other rows in each call.
    *[Row(f"helper_{kind}_shifted_{shift}", _rows_by_helper(row, shift),
          "another example's|another order", OTHERS_DATA, source=_EF)
      for kind, row in (("jit", _ROW), ("remat", _ROW_REMAT))
      for shift in (1, B - 1)],
    *[Row(f"helper_{kind}_reading_equal_rows", _rows_by_helper(row, 0),
          EXACT, False, reference_body=_ONE_ORDER, source=_EF)
      for kind, row in (("jit", _ROW), ("remat", _ROW_REMAT))],
    # Each term of sum_bc (o_b . y_c)^2 reads every example's labels: a Gram
    # over the outputs' rows, but no per-example privacy bound; paired rows
    # (a batch axis of the product) read each example's own.
    Row("outer_product_with_labels", _outer_product_with_labels, EXACT,
        "a product of every example", reference_terms=lambda x, y: (
            _outer_product_with_labels(x, y, terms=True)), source=_EF),
    Row("per_example_product_with_labels", _per_example_product_with_labels,
        EXACT, False, source=_EF),
    # Index arrays of equal contents however written pick the same rows;
    # other contents (also built with integer bit operations) stay apart.
    *[Row(f"index_arrays_{name}", ef._after(o, l), EXACT, False,
          reference_body=_ONE_ORDER, source=_EF)
      for name, (o, l) in _EQUAL_INDEX_ARRAYS.items()],
    Row("index_arrays_of_other_contents", ef._after(
        lambda o: o[_PERM], lambda y: y[jnp.array([1, 0, 3, 2])]),
        "another example's|another order", OTHERS_DATA, source=_EF),
    Row("index_array_of_bit_operations", ef._after(
        lambda o: o[_bits_identity()], lambda y: y[np.arange(B)]), EXACT,
        False, reference_body=_ONE_ORDER, source=_EF),
    Row("index_array_of_bit_operations_paired_with_others", ef._after(
        lambda o: o[_bits_identity()], lambda y: y[np.array([2, 3, 0, 1])]),
        "another example's|another order", OTHERS_DATA, source=_EF),
    # Keyed alike within a round, the carried row and the next round's
    # labels are other examples' rows.
    Row("row_carried_over_a_loop_round", _lagged_rows, NOT_A_SUM,
        f"{OTHERS_DATA}|{NOT_A_SUM}", source=_EF),
    # Rows picked with integer labels: each example's own row with its own
    # label, or another's (in the index array itself).
    # (numpy_arange's reference picks by jnp.arange: np.arange(B) of one
    # example's [1, K] reads its row B times.)
    *[Row(f"labels_pick_{name}", _logits_picked(pick), EXACT, False,
          batch=_labelled, reference_body=_logits_picked(
              _OWN_ROWS["arange"]) if name == "numpy_arange" else None,
          source=_EF)
      for name, pick in _OWN_ROWS.items()],
    *[Row(f"labels_pick_{name}", _logits_picked(pick),
          f"{PAIRED}|{NOT_A_SUM}", f"{PAIRED}|{OTHERS_DATA}|{NOT_A_SUM}",
          batch=_labelled_with_rows if name == "rows_by_data" else _labelled,
          source=_EF)
      for name, pick in _PAIRED_WITH_OTHERS.items()],
    # Labels reordered inside the index array: the Gram is over the model's
    # input rows (labels are data), each with the label it is paired with.
    Row("labels_reordered_inside_the_index_array", _logits_picked(
        lambda lp, l: lp[jnp.arange(lp.shape[0]), l[::-1]]), EXACT,
        OTHERS_DATA, batch=_labelled,
        reference_body=_logits_picked(_OWN_ROWS["arange"]),
        reference_data=lambda x, l: (x, l[::-1]), source=_EF),
    *[Row(f"cannot_separate_{name}", _loss_of_outputs(loss),
          _cannot_separate(primitive), True, source=_EF)
      for name, (loss, primitive) in _CANNOT_SEPARATE.items()],
    # What the refusal above says to write instead; complex() of a sum is
    # linear in it.
    Row("rewritten_per_example_sum", _loss_of_outputs(
        lambda out, y: jnp.sum(out[:, 0] ** 2)), EXACT, False, source=_EF),
    Row("complex_of_a_sum", _loss_of_outputs(lambda out, y: jnp.real(
        jax.lax.complex(*(2 * [jnp.sum(out ** 2)])))), EXACT, False,
        source=_EF),
    Row("examples_scanned", _scanned_examples,
        r"row\(s\) of a loop over the examples \(hk.scan or hk.map"
        + _VMAP_ADVICE, True, source=_EF),
    Row("examples_mapped", _mapped_examples,
        r"row\(s\) of a loop over the examples \(hk.scan or hk.map"
        + _VMAP_ADVICE, True, source=_EF),
    Row("python_loop_over_examples", _python_loop_over_examples,
        REORDERED + _VMAP_ADVICE, True, source=_EF),
    Row("per_example_code_under_hk_vmap", _per_example_code_under_hk_vmap,
        EXACT, False, source=_EF),
    Row("batch_term_in_every_loss", _batch_term_in_every_loss,
        r"batch-wide term added to every example's\s+loss", True,
        source=_EF),
    # Per example (a batch of one), both forms are l_i + 0.1 mean(out_i^2).
    Row("batch_term_once", _batch_term_once, EXACT, False,
        reference_body=_batch_term_in_every_loss, source=_EF),
    # -- soundness of the clipped sum ------------------------------------------
    # A loop or branch whose rounds read several examples: the Gram takes
    # the input as computed once for the batch; clipping refuses.
    *[Row(f"rounds_{f.__name__.lstrip('_')}", _head_on(f), EXACT, match,
          batch=_flat, reference_body=_PLAIN_HEAD,
          reference_data=_computed_once(f), source=_SF)
      for f, match in (
          (sf._halve_until_batch_max, OTHERS_DATA),
          (_fori_to_a_batch_count, OTHERS_DATA),
          (_stop_on_example_0, OTHERS_DATA),
          (_count_to_a_batch_count,
           rf"(?s)(?=.*{OTHERS_DATA})(?=.*number of rounds depends on)"),
          (_scale_chosen_by_example_0, OTHERS_DATA))],
    # Batched, a while_loop runs until every row stops, but a row that has
    # stopped keeps its value: each example's result is its own.
    *[Row(f"rounds_{f.__name__.lstrip('_')}", _head_on(f), EXACT, False,
          batch=_flat, source=_SF)
      for f in (_halve_each_until_its_max, _count_each_to_its_own)],
    Row("rounds_inside_hk_vmap", _loop_inside_hk_vmap, EXACT, False,
        batch=_flat, source=_SF),
    # Data the loss closes over: data of any example for the Gram (exact,
    # the reference given it as arguments), refused for clipping, which
    # says to pass it (example_axes= for its examples).
    *[Row(f"closed_over_{name}", _closing_over_labels(labels), EXACT,
          rf"(?s){CLOSED}.*example_axes", batch=lambda x, y: _flat(x, y)[:1],
          reference_body=_PLAIN_HEAD,
          reference_data=lambda x, labels=labels: (x, labels), source=_SF)
      for name, labels in _CLOSED_LABELS_OF.items()],
    Row("closed_over_labels_int", _closing_over_int_labels, EXACT,
        rf"(?s){CLOSED}.*example_axes", batch=lambda x, y: _flat(x, y)[:1],
        reference_body=_int_labels_reference,
        reference_data=lambda x: (x, _CLOSED_INT), source=_SF),
    Row("closed_over_int_labels_one_hot", _one_hot_of_closed_over_int_labels,
        EXACT, CLOSED, batch=lambda x, y: _flat(x, y)[:1],
        reference_body=_head_on(labels=lambda l: jax.nn.one_hot(l, 2)),
        reference_data=lambda x: (x, _CLOSED_INT), source=_SF),
    *[Row(f"closed_over_{name}", _closing_over_inputs(inputs), EXACT,
          rf"(?s){CLOSED}.*example_axes", batch=lambda x, y: _flat(x, y)[1:],
          reference_body=lambda y, x: _PLAIN_HEAD(x, y),
          reference_data=lambda y, inputs=inputs: (y, inputs), source=_SF)
      for name, inputs in (("inputs_numpy", _CLOSED_X),
                           ("inputs_jax", jnp.asarray(_CLOSED_X)))],
    Row("labels_centred_as_arguments", _head_on(
        labels=lambda y: y - y.mean(0)), EXACT, OTHERS_DATA, batch=_flat,
        reference_body=_PLAIN_HEAD,
        reference_data=lambda x, y: (x, y - y.mean(0)), source=_SF),
    Row("small_closed_over_constants", _small_closed_over_constants, EXACT,
        False, batch=_flat, reference_body=_small_constants_reference,
        source=_SF),
    Row("labels_picked_by_a_closed_over_arange",
        _labels_picked_by_a_closed_over_arange, EXACT, False,
        batch=_flat_labelled, source=_SF),
    # A table that merely has B rows: closed over, refused for clipping;
    # the fix the refusal teaches is exact.
    Row("table_of_b_rows_closed_over",
        lambda x, y: _reads_a_table(x, y, _TABLE), EXACT, CLOSED,
        batch=_flat, source=_SF),
    Row("table_of_b_rows_with_example_axes", _reads_a_table, EXACT, False,
        batch=lambda x, y: _flat(x, y) + (_TABLE,),
        example_axes=(0, 0, None), source=_SF),
    # Taken as B K examples each view would be clipped alone (K C per
    # example): refused, with the rewrite that is exact.
    Row("views_split_by_a_reshape", _flat_views,
        rf"(?s){NOT_A_SUM}.*{_VIEWS_SPLIT}", _VIEWS_SPLIT,
        batch=lambda x, y: (x.reshape(B * T, F), y[:, 0, :2]), source=_SF),
    Row("views_grouped", _grouped_views, EXACT, False,
        batch=lambda x, y: (x, y[:, 0, :2]), source=_SF),
    # -- which parameter reaches which Gram op, and how often ------------------
    Row("applied_twice", _applied_twice, EXACT, False, source=_SH),
    # (Refused for clipping: the branch is chosen from every example's
    # data, so each example's gradient reads the others'.)
    Row("in_a_cond_branch_and_outside", _in_a_cond_branch_and_outside, EXACT,
        True, source=_SH),
    Row("layer_stack", _layer_stack, EXACT, False, source=_SH),
    Row("weight_penalty", _weight_penalty, PENALTY, True, source=_SF),
    Row("shared_block_under_remat_and_outside",
        _shared_block_under_remat_and_outside, EXACT, False, source=_SH),
    Row("siamese_encoder_in_two_hk_vmaps", _siamese_encoder_in_two_hk_vmaps,
        EXACT, False, source=_SH),
    Row("same_module_in_both_cond_branches",
        _same_module_in_both_cond_branches, EXACT, True, source=_SH),
    Row("called_twice_under_a_copying_getter",
        _called_twice_under_a_copying_getter, EXACT, False, source=_SH),
    Row("lstm_static_unroll", _unrolled_lstm(hk.static_unroll), EXACT, False,
        source=_SH),
    Row("lstm_dynamic_unroll", _unrolled_lstm(hk.dynamic_unroll), EXACT,
        False, source=_SH),
    *[Row(f"applied_twice_{name}", _applied_twice_without_its_first_parameter(
        make), EXACT, False, source=_SH)
      for name, make in (("bias", hk.Bias),
                         ("layer_norm_offset_only",
                          lambda: hk.LayerNorm(-1, False, True)))],
    # One probe per module name: it cannot hold two kinds of layer's Grams.
    *[Row(f"two_layer_kinds_under_one_name_{name}", linear_then(second),
          r"module name 'l1' is used by two different tracked layers: "
          r"linear\(w\[6, 6\], b\[6\]\) and .*force_name", True,
          batch=lambda x, y: (x[:, 0], y[:, 0]), source=_SH)
      for name, second in (
          ("bias", lambda name: hk.Bias(name=name)),
          ("linear_without_bias",
           lambda name: hk.Linear(F, with_bias=False, name=name)))],
    Row("one_layer_kind_recreated_under_its_name", linear_then(
        lambda name: hk.Linear(F, name=name)), EXACT, False, source=_SH),
    # Modules applied at every step of a loop (slots, or per-example
    # accumulation where the slots cannot be counted).
    *[Row(f"loop_{f.__name__.lstrip('_')}", _loop_head(f), EXACT, False,
          source=_LO)
      for f in (_raw_lax_scan_body, _in_a_cond_branch_after_a_call,
                _called_on_two_shapes, _nested_scans, _core_under_hk_vmap,
                _dead_last_step, _dead_warm_up)],
    # -- frozen parameters -----------------------------------------------------
    Row("frozen_weights_bitfit", _bitfit, EXACT, False, source=_FR),
    Row("frozen_in_one_use_only", _frozen_in_one_use_only,
        "'lin'.*different parameters frozen", True, source=_FR),
    Row("untracked_parameter_under_stop_gradient",
        _untracked_slope_under_stop_gradient, EXACT, False, source=_FR),
    # -- getters: pulled back, or refused --------------------------------------
    Row("getter_weight_norm", _under_getter(_WEIGHT_NORM), EXACT, False,
        source=_RP),
    Row("getter_lora", _under_getter(problems.lora), EXACT, False,
        source=_RP),
    Row("getter_custom_vjp", _under_getter(_only("b", _double_grad)), EXACT,
        False, source=_RP),
    Row("getter_called_twice", _getter_called_twice, EXACT, False,
        source=_RP),
    Row("getter_static_unroll", _getter_static_unroll, EXACT, False,
        source=_RP),
    Row("getter_gain_read_by_the_getter_alone",
        _gain_read_by_the_getter_alone, EXACT, False, source=_RP),
    Row("getter_applied_twice_differently",
        _getter_applied_twice_differently,
        rf"(?s)(?=.*{TRANSFORMED})(?=.*computed differently)", True,
        source=_RP),
    Row("getter_parameter_read_elsewhere", _getter_parameter_read_elsewhere,
        rf"(?s)(?=.*{TRANSFORMED})(?=.*also read by)", True, source=_RP),
    *[Row(f"getter_inside_{where}", _getter_inside(where),
          rf"(?s)(?=.*{TRANSFORMED})(?=.*({_GETTER_INSIDE}))", True,
          source=_RP)
      for where in ("cond", "remat", "dynamic_unroll")],
    # -- bare parameters: program-level rules, or refused ----------------------
    *[_bare_row(body, EXACT, False) for body in (
        _bare_weight_matmul, _bare_weight_first_in_einsum, _bare_kernel_conv,
        _bare_table_gather, _bare_table_take, _bare_token_tiled,
        _bare_rnn_from_zero_carry)],
    _bare_row(_bare_weight_of_example_index,
              _PROGRAM_REFUSED.format("add", "not broadcast along that "
                                      "axis"), "no Gram rule"),
    _bare_row(_bare_weight_broadcast_then_contracted,
              _PROGRAM_REFUSED.format("dot_general", "reduced, reshaped or "
                                      "reordered"), "no Gram rule"),
    dataclasses.replace(_bare_row(_bare_weights_time_major, EXACT, False),
                        batch=lambda x, y: (jnp.swapaxes(x, 0, 1), y),
                        example_axes=(1, 0)),
    _bare_row(_bare_weight_contracts_the_examples,
              _PROGRAM_REFUSED.format("dot_general",
                                      "no axis with one example"),
              "no Gram rule"),
    _bare_row(_bare_table_dynamic_slice,
              _PROGRAM_REFUSED.format("dynamic_slice",
                                      "hold no examples' axis"), OTHERS_DATA),
    # -- a tracked parameter also read outside its layer (a tied output) -------
    Row("tracked_weight_read_by_a_matmul", _tracked_weight_read_by_a_matmul,
        EXACT, False, source=_PR),
    Row("tracked_weight_read_in_a_scan", _tracked_weight_read_in_a_scan,
        EXACT, False, source=_PR),
    Row("tracked_layer_in_a_remat_read_outside",
        _tracked_layer_in_a_remat_read_outside, EXACT, False, source=_PR),
    Row("tracked_layer_in_a_cond_read_inside",
        _tracked_layer_in_a_cond_read_inside, EXACT, False, source=_PR),
    Row("tracked_layer_in_a_cond_read_outside",
        _tracked_layer_in_a_cond_read_outside, EXACT, False, source=_PR),
    Row("tracked_layer_in_a_scan_read_outside",
        _tracked_layer_in_a_scan_read_outside, _MIXED, _MIXED, source=_PR),
]


def rows() -> list[Row]:
  ids = [r.id for r in ROWS]
  assert len(ids) == len(set(ids)), "corpus ids must be unique"
  return ROWS
