"""Which axis of a layer's input is the example axis.

The Gram is over the *example axis* (see the Semantics page of the
documentation). A Gram op starts with its
input as the user passed it and, each time a ``vmap`` batching rule fires, the
op is rebuilt with the mapped axis moved to the front of its input. Batching
rules fire innermost vmap first, so after all of them the outermost vmap's
axis is at position 0. :class:`ExampleAxis` records where the example axis is
at each step:

* ``ExampleAxis.default()``: the outermost vmap inside the differentiated
  function, else axis 0 of the input. Always position 0.
* ``ExampleAxis.leading()`` (``track(example_axis=0)``): the input's own axis
  0; every vmap is a within-example axis, so each one pushes it back by one.
* ``ExampleAxis.named("batch")``: the vmap with that ``axis_name``; unknown
  (``None``) until its batching rule fires, pushed back by outer vmaps. A
  layer outside every vmap (an explicitly batched part of the model) uses its
  input's axis 0; a layer under other vmaps but not that one is an error.

``vmapped`` records whether any vmap batching rule has fired, which is how
:func:`gram_haiku.value_grad_and_gram` notices a model whose layers resolve
the default rule in two different ways (see ``AMBIGUOUS_EXAMPLE_AXIS``).
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Literal, Optional, Union

ExampleAxisSpec = Union[None, int, str]


@dataclasses.dataclass(frozen=True)
class ExampleAxis:
  """Where the example axis is among a Gram op's leading input axes.

  Attributes:
    kind: ``"default"``, ``"leading"`` or ``"named"``.
    name: the vmap ``axis_name`` for ``"named"``.
    position: index of the example axis in the op's current input, or
      ``None`` while a named axis has not been met yet.
    vmapped: whether the op has been batched by at least one vmap.
  """
  kind: Literal["default", "leading", "named"]
  name: Optional[Hashable] = None
  position: Optional[int] = 0
  vmapped: bool = False

  @classmethod
  def default(cls) -> "ExampleAxis":
    """The outermost vmap inside the differentiated function, else axis 0."""
    return cls("default", None, 0)

  @classmethod
  def from_spec(cls, spec: ExampleAxisSpec) -> "ExampleAxis":
    """From ``track(example_axis=...)``: ``None``, ``0`` or an axis name.

    Raises:
      ValueError: for an integer other than 0 (only the input's own leading
        axis can be chosen by position).
    """
    if spec is None:
      return cls.default()
    if isinstance(spec, bool):
      raise ValueError(f"example_axis must be None, 0 or a vmap axis name, "
                       f"got {spec!r}.")
    if isinstance(spec, int):
      if spec != 0:
        raise ValueError(
            f"example_axis={spec} is not supported: pass example_axis=0 for "
            "the layer input's own leading axis, a vmap axis_name for a "
            "vmapped example axis, or None for the default rule.")
      return cls("leading", None, 0)
    return cls("named", spec, None)

  def after_vmap(self, vmap_axis_name: Hashable) -> "ExampleAxis":
    """The example axis after a vmap's axis is moved to the input's front."""
    if self.kind == "default":
      return dataclasses.replace(self, vmapped=True)
    if self.kind == "named" and vmap_axis_name == self.name:
      return dataclasses.replace(self, position=0, vmapped=True)
    if self.position is None:
      return dataclasses.replace(self, vmapped=True)
    return dataclasses.replace(self, position=self.position + 1, vmapped=True)

  def may_be_examples(self, vmap_axis_name: Hashable) -> bool:
    """Whether the vmap now batching the op may be the examples' own: any
    vmap under the default rule (the outermost one is), the named one under
    ``named``, none under ``leading``."""
    if self.kind == "default":
      return True
    return self.kind == "named" and vmap_axis_name == self.name

  def resolved_position(self) -> Optional[int]:
    """Where the example axis is now; None for a named axis not found."""
    if self.position is None and not self.vmapped:
      return 0  # A named axis, but the layer is outside every vmap.
    return self.position

  def describe(self) -> str:
    if self.kind == "default":
      return "the default example axis (outermost vmap, else input axis 0)"
    if self.kind == "leading":
      return "example_axis=0 (the layer input's own leading axis)"
    return f"example_axis={self.name!r} (the vmap with that axis_name)"
