"""What one abstract trace of a tracked model tells the real pass.

Per-example code under ``hk.vmap`` cannot see the batch size, so the probes it
creates at ``init`` have a placeholder size; and whether a module is applied
more than once (a module called twice, an RNN cell in ``hk.dynamic_unroll``)
is only known once the whole model has been traced.
:func:`gram_haiku.value_grad_and_gram` therefore traces the model once with
:func:`jax.eval_shape` inside :func:`recording`. Each Gram op reports its
example-axis size and parameter count to the :class:`Discovery`, and
``track()`` reports modules whose parameters are used more than once instead
of raising. The real pass then runs inside :func:`planned`, which tells
``track()`` which modules need per-example gradient accumulation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Iterator, Optional

_LOCAL = threading.local()


@dataclasses.dataclass
class Discovery:
  """Facts gathered by the abstract trace.

  Attributes:
    sizes: module name -> size of its example axis.
    param_counts: module name -> number of parameter entries it tracks.
    shared: modules whose parameters are used more than once (each such
      module needs a per-example probe ``(B, P)`` instead of a Gram probe).
    vmapped: module name -> whether its example axis came from a vmap (True)
      or from the layer input's own axis 0 (False), under the default rule.
    modes: module name -> the ``track(mode=...)`` it ran under.
    coverage: parameter full name -> ``ParamCoverage`` (tracked or not).
    example_specs: module name -> the mesh axes its example axis is sharded
      over, under a mesh with Explicit axes (absent otherwise).
  """
  sizes: dict = dataclasses.field(default_factory=dict)
  param_counts: dict = dataclasses.field(default_factory=dict)
  shared: set = dataclasses.field(default_factory=set)
  vmapped: dict = dataclasses.field(default_factory=dict)
  modes: dict = dataclasses.field(default_factory=dict)
  coverage: dict = dataclasses.field(default_factory=dict)
  example_specs: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def recording() -> Iterator[Discovery]:
  """Collects a :class:`Discovery` while active (one abstract trace)."""
  previous = getattr(_LOCAL, "discovery", None)
  found = Discovery()
  _LOCAL.discovery = found
  try:
    yield found
  finally:
    _LOCAL.discovery = previous


def active() -> Optional[Discovery]:
  """The :class:`Discovery` being recorded, or None outside :func:`recording`."""
  return getattr(_LOCAL, "discovery", None)


@contextlib.contextmanager
def planned(shared: frozenset):
  """Tells ``track()`` which modules use per-example accumulation."""
  previous = getattr(_LOCAL, "shared", None)
  _LOCAL.shared = frozenset(shared)
  try:
    yield
  finally:
    _LOCAL.shared = previous


def is_planned_shared(name: str) -> bool:
  """Whether the real pass treats module ``name`` as shared."""
  shared = getattr(_LOCAL, "shared", None)
  return shared is not None and name in shared
