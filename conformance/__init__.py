"""conformance: a reusable chex-based suite for Gram-emitting backward rules.

A Gram op is described by an :class:`OpSpec` (how to build inputs, how to call
the op, and the matching untracked per-example loss) and registered with
:func:`register`. The check families in :mod:`conformance.checks` then run
every registered op. At this stage the suite has the backward-parity and
vmap-depth-invariance families (reference equality is part of the latter).

Run it with ``pytest conformance`` or ``tox -e conformance``.
"""

from conformance.registry import OpSpec
from conformance.registry import register
from conformance.registry import registered_ops

__all__ = ("OpSpec", "register", "registered_ops")
