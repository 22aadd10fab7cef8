"""The zero probes: where a tracked module's Gram leaves the backward pass.

Each tracked module keeps its probe in its own ``hk.State`` entry
``gram_probe``: zeros, ``[B, B]`` in ``"gram"`` mode, ``[B]`` in
``"norms"`` mode (:func:`gram_haiku._src.ops.adapter.probe_shape`), float32
(float64 for float64 inputs). The op ignores it in the forward pass; its
gradient is the module's Gram. A module applied several times inside a
:func:`gram_haiku.value_grad_and_gram` pass may instead get a *slotted*
probe ``[U, B, K]`` with a counter ``gram_slot`` beside it (see
:mod:`gram_haiku._src.passes.slots`), and a module applied once by each
of several rules (a tied embedding) a tuple of one ``[B, K_u]`` probe per
application (see :mod:`gram_haiku._src.passes.parts`).
"""

from __future__ import annotations

from typing import Optional

import haiku as hk
import jax
import jax.numpy as jnp

from gram_haiku._src.compat import haiku_compat as hkc
from gram_haiku._src.compute import kernels
from gram_haiku._src.ops import adapter

#: Name of the probe entry in each tracked module's ``hk.State``.
PROBE_NAME = "gram_probe"
#: The slot counter of a slotted probe (only during a
#: ``value_grad_and_gram`` pass, which adds and removes it).
SLOT_NAME = "gram_slot"


def _read(shape=None, dtype=None, init=None):
  """The current module's probe as its state holds it (created by
  ``hk.get_state`` where absent): the custom state getters are not applied.
  A mixed-precision policy's getter (``hk.mixed_precision.set_policy``
  casts a module's state too) would hand the op a probe in the policy's
  compute dtype, and the Gram, cast to the probe's dtype, would be rounded
  to it: bfloat16's ``2^-9``, inf above float16's 65504. The op ignores
  the probe's value; only its dtype, the Gram's, would change."""
  if hkc.stored_state(PROBE_NAME) is None:
    hk.get_state(PROBE_NAME, shape, dtype, init=init)
  return hkc.stored_state(PROBE_NAME)


def probe_dtype(*dtypes) -> jnp.dtype:
  """float32, or float64 for float64 inputs (under ``jax_enable_x64``)."""
  return kernels.accumulation_dtype(*dtypes)


def module_probe(x: jax.Array, mode: str, num_params: int,
                 dtypes) -> jax.Array:
  """The current module's probe (created as zeros at ``init``).

  Args:
    x: the layer input.
    mode: the op's probe mode (``"gram"``, ``"norms"``, ...).
    num_params: the module's parameter entries (a ``"per_example"`` probe's
      width).
    dtypes: the parameters' dtypes; with a float input's, they set the
      probe's dtype (:func:`probe_dtype`).
  """
  # At init, per-example code under vmap cannot see B: the size here is a
  # placeholder that value_grad_and_gram / resize_probes corrects.
  size = x.shape[0] if x.ndim >= 2 else 1
  shape = adapter.probe_shape(mode, size, num_params)
  dtypes = [x.dtype, *dtypes] if kernels.is_float(x.dtype) else list(dtypes)
  # Under hk.transform (no state) Haiku itself raises NonEmptyStateError
  # after the function returns, telling the user to use
  # hk.transform_with_state.
  return _read(shape, probe_dtype(*dtypes), init=jnp.zeros)


def part(kind: str, parts) -> jax.Array:
  """This application's probe ``[B, width]``, for the application of rule
  ``kind``: the current module's probe is a tuple of one probe per
  application (see :attr:`gram_haiku._src.frontend.ambient.ModulePass
  .parts`), so that each application's cotangent leaves the backward pass
  as it is (columns of one shared probe would be padded back to the
  shared width and added).

  Raises:
    ValueError: for a rule the pass did not plan for (the traced program
      and the pass disagree: an internal error).
  """
  for i, (k, _) in enumerate(parts):
    if k == kind:
      return _read()[i]
  raise ValueError(
      f"gram_haiku: internal error: a {kind!r} application of a module whose "
      f"probe was planned for the applications {[k for k, _ in parts]}.")


def next_slot(reads: Optional[list]) -> jax.Array:
  """This application's slot ``[B, K]`` of the current module's slotted
  probe ``[U, B, K]``; advances the module's slot counter.

  Inside ``hk.scan`` (``hk.dynamic_unroll``) the counter is part of the
  carried state, so every step gets its own slot. The counter value read is
  appended to ``reads`` (two applications reading the same one would share
  a slot).
  """
  stack = _read()
  slot = hk.get_state(SLOT_NAME)
  if reads is not None:
    reads.append(slot)
  hk.set_state(SLOT_NAME, slot + 1)
  return jax.lax.dynamic_index_in_dim(stack, slot, 0, keepdims=False)
