"""Which Haiku module classes ``track()`` routes to a Gram op: the handlers.

A *layer handler* replaces a module class's ``__call__`` inside ``track()``.
It is called as ``handler(call, module, *args, **kwargs)``: ``call`` is a
:class:`gram_haiku.LayerCall` whose :meth:`~gram_haiku.LayerCall.apply` runs
the handler's Gram op for ``module``. The built-in handlers live in
:mod:`gram_haiku._src.layers` and are registered when :mod:`gram_haiku` is
imported.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

#: module class -> handler(call, module, *args, **kwargs).
_HANDLERS: dict[type, Callable[..., Any]] = {}


def register_layer(module_cls: type):
  """Decorator: ``handler(call, module, *args, **kwargs)`` replaces
  ``module_cls.__call__`` inside ``track()``. Looked up by the module's
  own class first (exact match, also for a subclass that inherits
  ``__call__``), then by the class that defines the ``__call__`` being
  run (a subclass of a registered class that does not override it).

  The handler reads the module's parameters with ``hk.get_parameter`` (as
  the module's own ``__call__`` does, so that they are recorded as tracked)
  and returns ``call.apply(op, x, params)``, where ``call`` is the
  :class:`gram_haiku.LayerCall` it receives. Registering a class again
  replaces its handler. See the extension docs for a worked example.
  """
  def decorate(handler):
    _HANDLERS[module_cls] = handler
    return handler
  return decorate


def handler_for(module_cls: type) -> Optional[Callable[..., Any]]:
  """The handler registered for exactly ``module_cls``, or None."""
  return _HANDLERS.get(module_cls)
