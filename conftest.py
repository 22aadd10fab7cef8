"""Repository-wide pytest setup (not shipped).

XLA's CPU backend spends most of this suite's time compiling many small
programs; its optimisation passes buy nothing at these sizes, so the suite
runs with ``jax_disable_most_optimizations`` (about 1.7x faster here). The
math is unchanged: XLA's optimisations reorder floating-point work only
within the tolerances the tests use. Subprocesses (the multi-device runners,
whose HLO collective counts are checked) keep JAX's defaults.
"""

import jax

jax.config.update("jax_disable_most_optimizations", True)

# The documented third-party example runs every family in our own run, as a
# registered op (the sharded family's runner imports this module for it).
import conformance  # pylint: disable=g-import-not-at-top,wrong-import-position
from conformance.examples import scaled_linear  # pylint: disable=g-import-not-at-top,wrong-import-position

conformance.register(scaled_linear.SPEC)
