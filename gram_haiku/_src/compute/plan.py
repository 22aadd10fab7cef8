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
:func:`gram_haiku.ops.gram_linear` from its arguments.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal, Optional, Union, get_args

from jax import lax
import numpy as np

from gram_haiku._src.compute.example_axis import ExampleAxis
from gram_haiku._src.compute.example_axis import ExampleAxisSpec

#: What the probe's cotangent holds: the Gram ``[B, B]``, its diagonal
#: ``[B]`` (squared per-example gradient norms), the flattened per-example
#: gradients ``[B, P]`` (a module applied more than once), the layer's
#: book-keeping factors ``[B, K]`` (its input and output cotangent per
#: example, for re-contraction after the pass: ``"factors"``) or, in
#: ``"clip"`` mode, the squared norms while the parameters' cotangents are
#: clipped per example inside the backward rule (:class:`Clip`).
Mode = Literal["gram", "norms", "per_example", "factors", "clip"]
#: How a per-example weight is formed from a per-example gradient norm:
#: ``"abadi"``: ``min(1, C / |g|)`` (Abadi et al. 2016); ``"automatic"``:
#: ``C / (|g| + gamma)`` (Bu et al. 2022, automatic clipping).
ClipFunction = Literal["abadi", "automatic"]
#: How a Gram is computed where a layer has more than one exact method:
#: ``"auto"`` (the cost model's choice), ``"ghost"`` or ``"materialize"``.
Strategy = Literal["auto", "ghost", "materialize"]

MODES: tuple[str, ...] = get_args(Mode)
#: The trailing axes of a probe in each :data:`Mode`, which hold what it
#: keeps (more leading axes are ``hk.layer_stack``'s); the examples are the
#: first of them: ``[B, B]``, ``[B]``, ``[B, P]``, ``[B, K]``, ``[B]``.
PROBE_NDIM: dict[str, int] = {"gram": 2, "norms": 1, "per_example": 2,
                              "factors": 2, "clip": 1}
CLIP_FUNCTIONS: tuple[str, ...] = get_args(ClipFunction)
STRATEGIES: tuple[str, ...] = get_args(Strategy)

#: Default largest intermediate, in bytes, that a Gram kernel may build at
#: once: the ``(rows, T, cols, T)`` kernel blocks of the ghost method and the
#: ``(B, N, M)`` per-example gradients of the materialised one.
DEFAULT_MEMORY_BUDGET_BYTES = 256 * 2**20

#: A Gram kernel precision as given by a user: a ``jax.lax.Precision`` or
#: its name (``"highest"``, ``"high"``, ``"default"``, any case).
PrecisionSpec = Union[lax.Precision, str]
#: The default precision of the Gram kernels' products: float32 products
#: are float32-exact on every backend (on a TPU, 6 bf16 passes; on an
#: Ampere-or-later GPU, no TF32).
DEFAULT_PRECISION = lax.Precision.HIGHEST


def to_precision(value: PrecisionSpec) -> lax.Precision:
  """``value`` as a ``jax.lax.Precision``.

  Raises:
    ValueError: for anything but a ``lax.Precision`` or one's name.
  """
  if isinstance(value, lax.Precision):
    return value
  names = tuple(p.name.lower() for p in lax.Precision)
  if isinstance(value, str) and value.lower() in names:
    return lax.Precision[value.upper()]
  raise ValueError(f"precision must be a jax.lax.Precision or one of "
                   f"{names}, got {value!r}.")


def check_mode(mode) -> None:
  """Raises ValueError for a mode that is not one of :data:`MODES`."""
  if mode not in MODES:
    raise ValueError(f"Unknown Gram mode {mode!r}; expected one of {MODES}.")


def check_clip(what: str, mode: Optional[str], clip) -> None:
  """Raises ValueError unless a :class:`Clip` is given exactly in
  ``"clip"`` mode (``what``: the record, for the message)."""
  if (mode == "clip") != (clip is not None):
    raise ValueError(f"{what}(mode={mode!r}, clip={clip!r}): a Clip is "
                     f"given exactly in 'clip' mode.")


def check_strategy(strategy) -> None:
  """Raises ValueError for a strategy that is not one of :data:`STRATEGIES`."""
  if strategy not in STRATEGIES:
    raise ValueError(f"Unknown Gram strategy {strategy!r}; expected one of "
                     f"{STRATEGIES}.")


def check_memory_budget(value) -> int:
  """``value`` as a Python int (bytes; a NumPy integer too), or ValueError
  unless it is a positive integer."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(
      value, numbers.Integral) or value < 1:
    raise ValueError(f"memory_budget_bytes must be a positive integer "
                     f"(bytes), got {value!r}.")
  return int(value)


def check_clip_function(clip_fn) -> None:
  """Raises ValueError for a clip function not in :data:`CLIP_FUNCTIONS`."""
  if clip_fn not in CLIP_FUNCTIONS:
    raise ValueError(f"Unknown clip function {clip_fn!r}; expected one of "
                     f"{CLIP_FUNCTIONS}.")


@dataclasses.dataclass(frozen=True)
class Clip:
  """A per-example clipping rule: ``c_i = w(|g_i|)``, ``g_i -> c_i g_i``.

  Attributes:
    l2_clip_norm: ``C``, the clipping norm (same units as the gradient).
    function: :data:`ClipFunction`.
    gamma: the stabiliser of ``"automatic"`` clipping (ignored otherwise).
  """
  l2_clip_norm: float
  function: ClipFunction = "abadi"
  gamma: float = 0.01

  def __post_init__(self):
    check_clip_function(self.function)
    c = self.l2_clip_norm
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not (
        c >= 0):
      raise ValueError(f"l2_clip_norm must be a non-negative number, got "
                       f"{c!r}.")
    if not isinstance(self.gamma, (int, float)) or not self.gamma > 0:
      raise ValueError(f"gamma must be a positive number, got "
                       f"{self.gamma!r}.")


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static decisions of one Gram op application (decisions only: why
  an application has no Gram, or that it runs at ``init``, are the op's
  own parameters, see :class:`gram_haiku._src.ops.op.RuleOp`).

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
    clip: in ``"clip"`` mode, the per-example clipping rule applied to this
      layer's own parameter gradients inside its backward rule; None in
      every other mode.
    frozen: indices (into the op's ``param_names``) of parameters that no
      differentiated parameter reaches (a frozen weight: closed over, read
      through ``stop_gradient``, or declared ``frozen=``), as read from the
      traced program by :func:`gram_haiku.value_grad_and_gram`. Their
      gradient is zero, so their terms are left out of the Gram, the norms
      and the per-example gradients (whose columns for them are zero).
      None where nothing says (the raw ``jax.grad`` path, the ``gram_*``
      binders): the Gram then covers every parameter, and a layer whose
      parameters are differentiated only in part is refused.
    precision: the ``jax.lax.Precision`` of the kernels' products (the
      Gram, the squared norms, and weight gradients summed from
      materialised per-example gradients). ``HIGHEST`` (default): exact in
      float32 on every backend. ``DEFAULT``: the backend's fastest (one
      bf16 pass on a TPU, TF32 on recent GPUs; relative error about
      ``1e-3`` there, identical on a CPU).
    upper_bound: the pass clips: squared norms (``"norms"``, ``"clip"``)
      are sound upper bounds of the exact values, and a ``"per_example"``
      probe has one more column, which receives the bound of its row's
      rounding error in norm units (the rule's ``per_example_error``),
      summed over the applications like the gradients
      (:mod:`gram_haiku._src.compute.norm_bounds`).
  """
  mode: Mode = "gram"
  strategy: Strategy = "auto"
  example_axis: ExampleAxis = ExampleAxis.default()
  column_axes: Optional[tuple[str, ...]] = ()
  memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
  clip: Optional[Clip] = None
  frozen: Optional[tuple[int, ...]] = None
  upper_bound: bool = False
  precision: lax.Precision = DEFAULT_PRECISION

  def __post_init__(self):
    check_mode(self.mode)
    check_clip("Plan", self.mode, self.clip)
    check_strategy(self.strategy)
    object.__setattr__(self, "memory_budget_bytes",
                       check_memory_budget(self.memory_budget_bytes))
    if not isinstance(self.example_axis, ExampleAxis):
      raise TypeError(f"Plan.example_axis must be an ExampleAxis, got "
                      f"{self.example_axis!r}.")
    if self.column_axes is not None and not (
        isinstance(self.column_axes, tuple) and
        all(isinstance(a, str) for a in self.column_axes)):
      raise TypeError(f"Plan.column_axes must be None or a tuple of mesh axis "
                      f"names, got {self.column_axes!r}.")
    if self.frozen is not None and not (
        isinstance(self.frozen, tuple) and all(
            isinstance(i, int) and i >= 0 for i in self.frozen)):
      raise TypeError(f"Plan.frozen must be None or a tuple of parameter "
                      f"indices, got {self.frozen!r}.")
    if not isinstance(self.precision, lax.Precision):
      raise TypeError(f"Plan.precision must be a jax.lax.Precision, got "
                      f"{self.precision!r} (see to_precision).")

  def replace(self, **changes) -> "Plan":
    return dataclasses.replace(self, **changes)

  @classmethod
  def make(cls, *, mode: str = "gram", strategy: str = "auto",
           example_axis: ExampleAxisSpec | ExampleAxis = None,
           column_axes: Optional[tuple[str, ...]] = None,
           memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
           precision: PrecisionSpec = DEFAULT_PRECISION) -> "Plan":
    """A plan from a binder's arguments (example axis as ``None``, ``0`` or
    a vmap axis name, or an :class:`ExampleAxis`; precision as a
    ``lax.Precision`` or its name).

    Raises:
      ValueError: for a bad mode, strategy, example axis, budget or
        precision.
    """
    if not isinstance(example_axis, ExampleAxis):
      example_axis = ExampleAxis.from_spec(example_axis)
    return cls(mode=mode, strategy=strategy, example_axis=example_axis,
               column_axes=column_axes,
               memory_budget_bytes=memory_budget_bytes,
               precision=to_precision(precision))
