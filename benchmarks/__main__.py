"""``python -m benchmarks``: see :mod:`benchmarks.cli`."""

import sys

from benchmarks.cli import main

if __name__ == "__main__":
  sys.exit(main())
