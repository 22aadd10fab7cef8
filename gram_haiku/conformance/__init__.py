"""gram_haiku.conformance: a reusable chex-based suite for Gram-emitting
backward rules.

A Gram op is described by an :class:`OpSpec` (how to build inputs, how to
call the op, and the matching untracked per-example loss) and registered
with :func:`register` (for a :class:`gram_haiku.Rule`:
``OpSpec.from_rule``). The check families (parity, reference, vmap,
transforms, frozen, bounds, sharded, properties), each a :class:`Check` in
one registry (:mod:`gram_haiku.conformance.families`; add yours with
:func:`register_check`), then run every registered op, under the
transforms of :mod:`gram_haiku.conformance.variants`.

Run it with ``python -m gram_haiku.conformance`` (in parallel, with a
summary table), ``pytest --pyargs gram_haiku.conformance`` (an installed
package needs ``--pyargs``), the absltest mixin
:class:`gram_haiku.conformance.testing.GramOpTestMixin`, or ``tox -e
conformance``; see the Conformance page of the documentation. (The
top-level ``conformance`` package is a deprecated alias of this one.)
"""

from gram_haiku.conformance.families import Case
from gram_haiku.conformance.families import Check
from gram_haiku.conformance.families import NotApplicable
from gram_haiku.conformance.families import register_check
from gram_haiku.conformance.registry import OpSpec
from gram_haiku.conformance.registry import register
from gram_haiku.conformance.registry import registered_ops

__all__ = ("Case", "Check", "NotApplicable", "OpSpec", "register",
           "register_check", "registered_ops")
