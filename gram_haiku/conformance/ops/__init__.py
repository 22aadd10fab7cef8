"""gram_haiku's own ops, registered with the suite: one module per op kind.

Every module in this package is imported by
:func:`conformance.registered_ops`, so adding an op is adding a file that
calls :func:`conformance.register`.
"""

import importlib
import pkgutil


def load_all() -> None:
  """Imports every module of this package (each registers its ops)."""
  for info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{info.name}")
