"""Layer handlers: one module per Haiku layer kind, registered on import.

Each handler re-creates the Haiku module's parameters exactly as the module
does (names, shapes, dtypes, initialisers) and runs the matching Gram op
through :meth:`gram_haiku.LayerCall.apply`.
"""

from gram_haiku._src.layers import batch_norm  # noqa: F401
from gram_haiku._src.layers import conv  # noqa: F401
from gram_haiku._src.layers import embed  # noqa: F401
from gram_haiku._src.layers import linear  # noqa: F401
from gram_haiku._src.layers import norms  # noqa: F401
from gram_haiku._src.layers import recurrent  # noqa: F401
