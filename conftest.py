"""Repository-wide pytest setup (not shipped).

XLA's CPU backend spends most of this suite's time compiling many small
programs; its optimisation passes buy nothing at these sizes, so the suite
runs with ``jax_disable_most_optimizations`` (about 1.7x faster here), and
with XLA's classic CPU code generator (see ``_FAST_COMPILE``). The math is
unchanged: XLA's optimisations reorder floating-point work only within the
tolerances the tests use. The multi-device runner subprocesses set their
own optimisation level (the case whose HLO collective counts are checked
compiles with JAX's defaults).
"""

import importlib.metadata
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

# XLA's CPU fusion emitters take about 1.5x longer to compile each of this
# suite's many small programs than the classic code generator, and run them
# no faster at these sizes (measured: a tiny elementwise program 62 -> 42 ms;
# two heavy tests 30 -> 18 s). The flag only changes code generation, not the
# program's math. jaxlib 0.9 and 0.10 have it; 0.11 removed it (an unknown
# XLA flag aborts the process), so it is set for those releases only. The
# runner subprocesses inherit it.
_FAST_COMPILE = "--xla_cpu_use_fusion_emitters=false"
_JAXLIB = importlib.metadata.version("jaxlib").split(".")[:2]
if (tuple(int(p) for p in _JAXLIB) < (0, 11) and
    "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = " ".join(
      f for f in (os.environ.get("XLA_FLAGS", ""), _FAST_COMPILE) if f)

# The documentation's example processes (tests/test_docs.py) read it from the
# environment at import; this process has imported JAX already (the pytest
# plugin's package did), so it is also set here.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
import jax  # pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_disable_most_optimizations", True)

# The documented third-party example runs every family in our own run, as a
# registered op (the sharded family's runner imports this module for it).
import conformance  # pylint: disable=g-import-not-at-top,wrong-import-position
from conformance.examples import scaled_linear  # pylint: disable=g-import-not-at-top,wrong-import-position

conformance.register(scaled_linear.SPEC)
