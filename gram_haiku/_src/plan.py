"""``Plan``: everything a Gram op decides on, as one static parameter.

A Gram op is bound with one frozen, hashable :class:`Plan`. It is the op's
only static decision parameter, so it is part of the ``jit`` cache key and is
printed with the op in ``jax.make_jaxpr``. Nothing an op, a rule or a kernel
computes depends on ambient (thread-local) state: what they need comes from
the plan, from their inputs, or from the probe.

The plan is resolved once per application, before the op is bound: by
``track()`` from its options and from the pass of
:func:`gram_haiku.value_grad_and_gram` (which modules are shared, which
mesh axes split the examples), or by a binder such as
:func:`gram_haiku.gram_linear` from its arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional, get_args

from gram_haiku._src.example_axis import ExampleAxis
from gram_haiku._src.example_axis import ExampleAxisSpec

#: What the probe's cotangent holds: the Gram ``[B, B]``, its diagonal
#: ``[B]`` (squared per-example gradient norms) or the flattened per-example
#: gradients ``[B, P]`` (a module applied more than once).
Mode = Literal["gram", "norms", "per_example"]
#: How a Gram is computed where a layer has more than one exact method:
#: ``"auto"`` (the cost model's choice), ``"ghost"`` or ``"materialize"``.
Strategy = Literal["auto", "ghost", "materialize"]

MODES: tuple[str, ...] = get_args(Mode)
STRATEGIES: tuple[str, ...] = get_args(Strategy)

#: Default largest intermediate, in bytes, that a Gram kernel may build at
#: once: the ``(rows, T, cols, T)`` kernel blocks of the ghost method and the
#: ``(B, N, M)`` per-example gradients of the materialised one.
DEFAULT_MEMORY_BUDGET_BYTES = 256 * 2**20


def check_mode(mode) -> None:
  """Raises ValueError for a mode that is not one of :data:`MODES`."""
  if mode not in MODES:
    raise ValueError(f"Unknown Gram mode {mode!r}; expected one of {MODES}.")


def check_strategy(strategy) -> None:
  """Raises ValueError for a strategy that is not one of :data:`STRATEGIES`."""
  if strategy not in STRATEGIES:
    raise ValueError(f"Unknown Gram strategy {strategy!r}; expected one of "
                     f"{STRATEGIES}.")


def check_memory_budget(value) -> None:
  """Raises ValueError unless ``value`` is a positive int (bytes)."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"memory_budget_bytes must be a positive int (bytes), "
                     f"got {value!r}.")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static decisions of one Gram op application.

  Attributes:
    mode: what the probe's cotangent holds (:data:`Mode`).
    strategy: the requested method (:data:`Strategy`); the cost model
      resolves ``"auto"`` from the shapes, once per application.
    example_axis: which leading axis of the layer input is the example axis.
    column_axes: mesh axes over which the Gram's columns are gathered from
      other devices (``shard_map`` with the examples split over them); ``()``
      for none; ``None`` to read them from the probe (a ``[b, k b]`` probe
      varying over one mesh axis of size ``k``).
    memory_budget_bytes: the largest intermediate a kernel may build at once.
    refusal: why this application has no correct Gram (e.g. a module
      applied more than once on the raw ``jax.grad`` path), raised as a
      ``ValueError`` if its probe is differentiated; None otherwise. The
      forward pass and the other gradients are unaffected.
  """
  mode: Mode = "gram"
  strategy: Strategy = "auto"
  example_axis: ExampleAxis = ExampleAxis.default()
  column_axes: Optional[tuple[str, ...]] = ()
  memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
  refusal: Optional[str] = None

  def __post_init__(self):
    check_mode(self.mode)
    check_strategy(self.strategy)
    check_memory_budget(self.memory_budget_bytes)
    if not isinstance(self.example_axis, ExampleAxis):
      raise TypeError(f"Plan.example_axis must be an ExampleAxis, got "
                      f"{self.example_axis!r}.")
    if self.column_axes is not None and not (
        isinstance(self.column_axes, tuple) and
        all(isinstance(a, str) for a in self.column_axes)):
      raise TypeError(f"Plan.column_axes must be None or a tuple of mesh axis "
                      f"names, got {self.column_axes!r}.")

  def replace(self, **changes) -> "Plan":
    return dataclasses.replace(self, **changes)

  @classmethod
  def make(cls, *, mode: str = "gram", strategy: str = "auto",
           example_axis: ExampleAxisSpec | ExampleAxis = None,
           column_axes: Optional[tuple[str, ...]] = None,
           memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> "Plan":
    """A plan from a binder's arguments (example axis as ``None``, ``0`` or
    a vmap axis name, or an :class:`ExampleAxis`).

    Raises:
      ValueError: for a bad mode, strategy, example axis or budget.
    """
    if not isinstance(example_axis, ExampleAxis):
      example_axis = ExampleAxis.from_spec(example_axis)
    return cls(mode=mode, strategy=strategy, example_axis=example_axis,
               column_axes=column_axes,
               memory_budget_bytes=memory_budget_bytes)
