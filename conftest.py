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
