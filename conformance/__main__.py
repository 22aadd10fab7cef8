"""Deprecated: ``python -m conformance`` is now
``python -m gram_haiku.conformance``.

Runs the same suite, with the same options, after a deprecation warning.
"""

import sys
import warnings

warnings.warn(
    "python -m conformance is deprecated and will be removed in the next "
    "release: run python -m gram_haiku.conformance instead (same options).",
    DeprecationWarning, stacklevel=1)

# pylint: disable=g-import-not-at-top,wrong-import-position
from gram_haiku.conformance.__main__ import main

if __name__ == "__main__":
  sys.exit(main())
