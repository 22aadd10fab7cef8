"""gram_haiku's implementation (private: the API is ``gram_haiku``'s names).

Importing any module here first registers the built-in layer handlers
(``hk.Linear``, ``hk.Conv*``, ``hk.Embed``, ...) and the result types'
``Exported.serialize()`` support, whichever public name or private module
is used first.
"""

from gram_haiku._src import layers as _layers  # noqa: F401
from gram_haiku._src.api import export_serialization as _export  # noqa: F401
