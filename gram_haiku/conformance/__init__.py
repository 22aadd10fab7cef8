"""gram_haiku.conformance: a reusable chex-based suite for Gram-emitting
backward rules.

A Gram op is described by an :class:`OpSpec` (how to build inputs, how to
call the op, and the matching untracked per-example loss) and registered
with :func:`register`. The check families in
:mod:`gram_haiku.conformance.checks` (parity, reference, vmap, transforms,
frozen, bounds, sharded, properties) then run every registered op.

Run it with ``python -m gram_haiku.conformance`` (in parallel, with a
summary table), ``pytest --pyargs gram_haiku.conformance`` (an installed
package needs ``--pyargs``), the absltest mixin
:class:`gram_haiku.conformance.testing.GramOpTestMixin`, or ``tox -e
conformance``; see the Conformance page of the documentation. (The
top-level ``conformance`` package is a deprecated alias of this one.)
"""

from gram_haiku.conformance.registry import OpSpec
from gram_haiku.conformance.registry import register
from gram_haiku.conformance.registry import registered_ops

__all__ = ("OpSpec", "register", "registered_ops")
