"""Repository-wide pytest setup (not shipped).

XLA's CPU backend spends most of this suite's time compiling many small
programs; its optimisation passes buy nothing at these sizes, so the suite
runs with ``jax_disable_most_optimizations`` (about 1.7x faster here). The
math is unchanged: XLA's optimisations reorder floating-point work only
within the tolerances the tests use. Subprocesses (the multi-device runners,
whose HLO collective counts are checked) keep JAX's defaults.
"""

import os

# XLA's compilations persist across runs (and across this run's workers and
# subprocesses, which inherit the environment) in the ignored folder
# .jax_cache: a first run compiles everything (about 10% of it is repeated,
# and then read back), a second run on the same machine takes about a third
# of the time. Set JAX_COMPILATION_CACHE_DIR yourself to use another folder.
_ROOT = os.path.dirname(os.path.abspath(__file__))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(_ROOT, ".jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_disable_most_optimizations", True)

# The documented third-party example runs every family in our own run, as a
# registered op (the sharded family's runner imports this module for it).
import conformance  # pylint: disable=g-import-not-at-top,wrong-import-position
from conformance.examples import scaled_linear  # pylint: disable=g-import-not-at-top,wrong-import-position

conformance.register(scaled_linear.SPEC)
