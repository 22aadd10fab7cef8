"""Discovering the example-axis size each probe needs.

Per-example code under ``hk.vmap`` cannot see the batch size, so the probes it
creates at ``init`` have a placeholder size. :func:`value_grad_and_gram`
traces the model once abstractly inside :func:`recording`; each Gram op then
reports its example-axis size here instead of raising on a mismatched probe.
"""

from __future__ import annotations

import contextlib
import threading

_LOCAL = threading.local()


@contextlib.contextmanager
def recording():
  """Collects ``{module name: example-axis size}`` while active."""
  previous = getattr(_LOCAL, "sizes", None)
  sizes: dict[str, int] = {}
  _LOCAL.sizes = sizes
  try:
    yield sizes
  finally:
    _LOCAL.sizes = previous


def record(name: str, size: int) -> bool:
  """Records ``size`` for module ``name`` if recording; returns whether it did."""
  sizes = getattr(_LOCAL, "sizes", None)
  if sizes is None:
    return False
  sizes[name] = size
  return True
