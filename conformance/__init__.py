"""Deprecated: the conformance suite is now :mod:`gram_haiku.conformance`.

This top-level package is kept for one release so that existing code,
``python -m conformance`` and ``pytest --pyargs conformance`` keep working;
each use warns (``DeprecationWarning``) with the new spelling. Its
submodules (``conformance.checks``, ``conformance.testing``,
``conformance.examples.scaled_linear``, ...) are the new package's modules
themselves, not copies: one registry, one set of tolerances.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

NEW = "gram_haiku.conformance"

warnings.warn(
    "the top-level package 'conformance' is deprecated and will be removed "
    f"in the next release: import {NEW} instead (python -m {NEW}, pytest "
    f"--pyargs {NEW}).", DeprecationWarning, stacklevel=2)


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports ``conformance.X`` as the module ``gram_haiku.conformance.X``.

  Test files (``test_*``) and ``__main__`` are not aliased: they are files
  of this package, so that ``pytest --pyargs conformance`` finds the tests
  here and ``python -m conformance`` warns. ``python -m conformance.X``
  runs ``gram_haiku.conformance.X``'s code.
  """

  def __init__(self):
    self._specs = {}

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if (not fullname.startswith(__name__ + ".") or
        fullname.rsplit(".", 1)[-1].startswith(("test_", "__main__"))):
      return None
    new = NEW + fullname[len(__name__):]
    target = importlib.util.find_spec(new)
    if target is None:
      return None
    return importlib.util.spec_from_loader(fullname, self,
                                           origin=target.origin)

  def create_module(self, spec):
    module = importlib.import_module(NEW + spec.name[len(__name__):])
    self._specs[spec.name] = module.__spec__
    return module

  def exec_module(self, module):
    # The import system set the alias's spec on the shared module object:
    # give it back its own (pickling, reloads and pytest read it).
    for alias, spec in list(self._specs.items()):
      if spec.name == module.__name__:
        module.__spec__ = self._specs.pop(alias)

  def get_code(self, fullname):  # For runpy: python -m conformance.X.
    new = NEW + fullname[len(__name__):]
    return importlib.util.find_spec(new).loader.get_code(new)


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
  sys.meta_path.insert(0, _AliasFinder())

# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
from gram_haiku.conformance import OpSpec
from gram_haiku.conformance import register
from gram_haiku.conformance import registered_ops

__all__ = ("OpSpec", "register", "registered_ops")
