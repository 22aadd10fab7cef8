"""Haiku's transforms, with ``gram_haiku.track()`` around the user function.

:func:`install` replaces ``hk.transform``, ``hk.transform_with_state`` and
``hk.multi_transform`` (and the names Haiku's own code and tests call them
by: ``haiku._src.transform.*`` and the ``hk`` stand-in inside
``haiku._src.multi_transform``) so that a transformed ``f`` runs as::

    with gram_haiku.track():
      f(*args, **kwargs)

Everything else is Haiku's: the transforms below are built from the
original ``transform_with_state`` and ``without_state``.

The one documented difference from plain Haiku is the probe entries
(``gram_probe``) that ``track()`` adds to ``hk.State``:

* a stateful transform returns them in its state (``keep`` mode), unless
  :data:`strip` is set, when ``init`` and ``apply`` leave them out (``apply``
  then recreates them, as zeros, inside the call);
* a pure transform (``hk.transform``, ``hk.multi_transform``) has no state
  to return them in (``track()`` refuses to run inside one), so it is built
  from the tracked stateful transform with the probes always left out, and
  Haiku's own ``without_state`` then checks that no other state is left.
"""

from __future__ import annotations

import functools

import gram_haiku  # Before any patch: its compat module reads the originals.
import haiku as hk
from haiku._src import multi_transform as hk_multi
from haiku._src import transform as hk_transform
import jax

#: Whether stateful transforms leave the probe entries out of the state
#: they return (set per test by the plugin, for the allowlisted tests).
strip = False

#: How many ``init``/``apply`` calls returned probe entries (the plugin
#: reports it: evidence that the layers were tracked).
probed_calls = 0

_ORIGINAL = {}


def without_probes(state):
  """``state`` less every ``gram_probe`` entry (and modules left empty)."""
  out = {}
  for module, entries in state.items():
    kept = {k: v for k, v in entries.items() if k != gram_haiku.PROBE_NAME}
    if kept:
      out[module] = kept
  return out


def _tracked(f):
  @functools.wraps(f)
  def tracked(*args, **kwargs):
    with gram_haiku.track():
      return f(*args, **kwargs)
  return tracked


def _returning_state(fn, always_strip: bool):
  """``fn`` (returning ``(x, state)``), counting and leaving out probes."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    global probed_calls
    x, state = fn(*args, **kwargs)
    if any(gram_haiku.PROBE_NAME in entries for entries in state.values()):
      probed_calls += 1
    return x, (without_probes(state) if always_strip or strip else state)
  return wrapped


def _without_any_probes(fn):
  """``fn`` (returning ``(x, state)``, counted already) without probes."""
  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    x, state = fn(*args, **kwargs)
    return x, without_probes(state)
  return wrapped


def _tracked_with_state(f, always_strip: bool) -> hk.TransformedWithState:
  hk_transform.check_not_jax_transformed(f)
  init, apply = _ORIGINAL["transform_with_state"](_tracked(f))
  init, apply = (_returning_state(fn, always_strip) for fn in (init, apply))
  hk_transform.tie_in_original_fn(f, init, apply)
  return hk.TransformedWithState(init, apply)


def transform_with_state(f) -> hk.TransformedWithState:
  return _tracked_with_state(f, always_strip=False)


def transform(f, *, apply_rng=True) -> hk.Transformed:
  if not apply_rng:  # Haiku's own error.
    return _ORIGINAL["transform"](f, apply_rng=apply_rng)
  return hk_transform.without_state(_tracked_with_state(f, always_strip=True))


def multi_transform(f) -> hk.MultiTransformed:
  stateful = hk.multi_transform_with_state(f)  # Tracked through hk_multi.hk.
  return hk_multi.without_state(hk.MultiTransformedWithState(
      _without_any_probes(stateful.init),
      jax.tree.map(_without_any_probes, stateful.apply)))


_PATCHES = (
    (hk, "transform_with_state", transform_with_state),
    (hk_transform, "transform_with_state", transform_with_state),
    (hk_multi.hk, "transform_with_state", transform_with_state),
    (hk, "transform", transform),
    (hk_transform, "transform", transform),
    (hk, "multi_transform", multi_transform),
    (hk_multi, "multi_transform", multi_transform),
)


def install() -> None:
  """Patches Haiku's transforms (idempotent)."""
  if _ORIGINAL:
    return
  _ORIGINAL["transform_with_state"] = hk_transform.transform_with_state
  _ORIGINAL["transform"] = hk_transform.transform
  for owner, name, fn in _PATCHES:
    setattr(owner, name, fn)
