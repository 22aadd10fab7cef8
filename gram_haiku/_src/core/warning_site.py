"""Where a gram_haiku warning points: the user's line, not a library's.

A warning is raised while the user's function is traced, deep inside JAX
(``jax.jit``, ``jax.make_jaxpr``), Haiku (``transform``, interceptors),
jax-privacy (whose ``BoundedSensitivityCallable`` wraps
:func:`gram_haiku.clipped_grad`), Flax (a linen ``apply``, ``nn.RNN``'s
scan: a message names the user's model line, not Flax's) and gram_haiku
itself, at a depth that differs between those paths; a fixed
``stacklevel`` points into one of them. :func:`user_stacklevel` counts
the frames up to the first one outside them instead.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import haiku
import jax


def _package_dir(name: str) -> tuple[str, ...]:
  """The directory of an installed package, found without importing it."""
  spec = importlib.util.find_spec(name)
  if spec is None or not spec.submodule_search_locations:
    return ()
  return tuple(os.path.abspath(d) + os.sep
               for d in spec.submodule_search_locations)


_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules[__name__.split(".")[0]], jax, haiku, contextlib)
) + _package_dir("jax_privacy") + _package_dir("flax")


def _in_library(filename: str) -> bool:
  return (filename.startswith("<") or  # <frozen ...>, generated code
          os.path.abspath(filename).startswith(_LIBRARY_DIRS))


def user_stacklevel() -> int:
  """The ``warnings.warn`` ``stacklevel``, for a warning raised by the
  caller of this function, of the innermost frame outside gram_haiku, JAX,
  Haiku, jax-privacy, Flax and the standard library."""
  level, frame = 1, sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None and _in_library(frame.f_code.co_filename):
    frame, level = frame.f_back, level + 1
  return level


def user_line(frames) -> str:
  """``" (at file:line)"`` of the innermost of ``frames`` (``(file,
  line)`` pairs, innermost first, e.g. :func:`hijax_compat.source_frames`)
  outside the libraries, for an error message; ``""`` if there is none."""
  for filename, line in frames:
    if not _in_library(filename):
      return f" (at {filename}:{line})"
  return ""
