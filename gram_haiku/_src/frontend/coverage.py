"""Which parameters the Gram covers: every parameter read inside ``track()``.

``track()`` installs a Haiku custom getter that sees every
``hk.get_parameter`` inside the context. A read from inside a layer handler
is *tracked* (by that handler's rule); any other read is *untracked*, and is
reported by the context's ``untracked`` policy. A parameter read both ways
is the layer's; under a pass the traced program decides whether its
outside uses can be added to the layer's part
(:attr:`gram_haiku._src.analysis.dataflow.Discovery.mixed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from typing import Callable, Optional

import haiku as hk

from gram_haiku._src.core import errors
from gram_haiku._src.core import warning_site

UNTRACKED_POLICIES = ("warn", "error", "ignore")

#: Parameters already warned about (``untracked="warn"`` warns once each).
_WARNED: set[str] = set()


@dataclasses.dataclass(frozen=True)
class ParamCoverage:
  """How one parameter is covered by the Gram.

  Attributes:
    tracked: whether every use of the parameter is inside a Gram op (or it
      has no gradient at all).
    rule: the layer handler that tracks it (e.g. ``"linear"``); ``"unused"``
      for a parameter the loss does not read; ``"frozen"`` for one with
      zero gradient that no rule covers (read only through
      ``stop_gradient``, or declared ``frozen=``); ``"reparametrised"``
      for one read outside the layers but only by a tracked layer's
      reparametrising getter; or None.
    module_type: the Haiku module class that reads it (``"(none)"`` for a
      bare ``hk.get_parameter`` outside any module).
  """
  tracked: bool
  rule: Optional[str]
  module_type: str


def policy_cast(module, value, out) -> bool:
  """Whether ``out`` may be ``value`` cast by the module's mixed-precision
  policy (``hk.mixed_precision.set_policy``): a new dtype, the policy's
  compute dtype. (A getter that also changes the values cannot be told
  from it here.)"""
  policy = (hk.mixed_precision.get_policy(type(module))
            if module is not None else None)
  dtype = getattr(out, "dtype", None)
  return (policy is not None and dtype != getattr(value, "dtype", None) and
          dtype == policy.compute_dtype)


class UntrackedParameterWarning(UserWarning):
  """A parameter read inside ``track()`` is not covered by any Gram op."""


class Coverage:
  """The parameters one ``track()`` context has seen, and how."""

  def __init__(self, untracked: str, active: Callable[[], bool] = lambda: True,
               defer: bool = False):
    """``active()``: whether reads are this context's to record (the
    innermost of nested ``track()`` contexts records them). ``defer``:
    untracked reads are kept in :attr:`deferred` instead of reported, for
    :func:`report_untracked` to report once the traced program tells which
    of them have a gradient at all."""
    if untracked not in UNTRACKED_POLICIES:
      raise ValueError(f"track(untracked={untracked!r}): expected one of "
                       f"{UNTRACKED_POLICIES}.")
    self.policy = untracked
    self._active = active
    self.seen: dict[str, ParamCoverage] = {}
    self._defer = defer
    #: Untracked reads not yet reported: name -> (policy, module type).
    self.deferred: dict[str, tuple[str, str]] = {}
    self._rule: Optional[str] = None

  @contextlib.contextmanager
  def tracking_rule(self, rule: str):
    """Parameters read inside this block are tracked by ``rule``."""
    previous, self._rule = self._rule, rule
    try:
      yield
    finally:
      self._rule = previous

  def getter(self, next_getter, value, context):
    """A Haiku custom getter: records the read, then reads."""
    if not self._active():
      return next_getter(value)
    name = context.full_name
    module_type = (type(context.module).__name__ if context.module is not None
                   else "(none)")
    seen = self.seen.get(name)
    if self._rule is not None:
      self.seen[name] = ParamCoverage(True, self._rule, module_type)
    else:
      # A parameter a tracked layer reads too stays the layer's: under a
      # pass, the traced program decides whether the outside uses can be
      # added to it (Discovery.mixed); elsewhere the read is reported as
      # any untracked read is.
      if seen is None or not seen.tracked:
        self.seen[name] = ParamCoverage(False, None, module_type)
      self._report_untracked(name, module_type)
    out = next_getter(value)
    return out

  def _report_untracked(self, name: str, module_type: str) -> None:
    if self._defer:
      self.deferred[name] = (self.policy, module_type)
    else:
      report_untracked(name, self.policy, module_type)


def merge_deferred(into: dict, deferred: dict) -> None:
  """Adds one context's :attr:`Coverage.deferred` reads to ``into``; a
  parameter read in several ``track()`` blocks keeps the strictest policy
  (``"error"``, then ``"warn"``, then ``"ignore"``)."""
  strictness = {"ignore": 0, "warn": 1, "error": 2}
  for name, (policy, module_type) in deferred.items():
    old = into.get(name)
    if old is None or strictness[policy] > strictness[old[0]]:
      into[name] = (policy, module_type)


#: The module type of a plain-JAX loss's parameters (no module reads them).
BARE_MODULE_TYPE = "(plain JAX)"


def report_untracked(name: str, policy: str, module_type: str,
                     why: str = "") -> None:
  """Reports an untracked read of parameter ``name`` by ``policy``: raises
  ``ValueError`` (``"error"``), warns once per name (``"warn"``) or does
  nothing (``"ignore"``). ``why``: why no program-level rule covers it
  (:data:`errors.PROGRAM_REFUSED`), or empty."""
  if policy == "ignore":
    return
  if module_type == BARE_MODULE_TYPE:
    message = errors.BARE_UNCOVERED.format(param=name, why=why)
  else:
    message = errors.UNTRACKED_PARAM.format(param=name,
                                            module_type=module_type) + why
  if policy == "error":
    raise ValueError(message)
  if name not in _WARNED:
    _WARNED.add(name)
    warnings.warn(message, UntrackedParameterWarning,
                  stacklevel=warning_site.user_stacklevel())
