"""The ambient state of gram_haiku: the only thread-local state it keeps.

Three things cannot travel as arguments through user code: the active
``track()`` contexts (a layer handler, or :func:`gram_haiku.unembed`, must
find its tracker from inside the user's Haiku modules), the running pass
(:mod:`gram_haiku._src.passes.pass_pipeline`: its :class:`PassPlan`, what each
module keeps and over which mesh axes the examples are split, and its
:class:`PassLog`, where ``track()`` records what the trace shows), and, on
the raw ``jax.grad`` path, the modules already applied in the current call
of the transformed function (:func:`raw_uses`) and the probe values handed
to ops (:func:`raw_probes`), which
:mod:`gram_haiku._src.frontend.raw_path` reads. All live here (and, while
a deprecated binder function given to ``LayerCall.apply`` runs, what the
op it binds is told beside its plan: :func:`deprecated_form_site`). They
are read when a ``track()`` context is entered or a layer is applied, and
by :func:`gram_haiku.unembed`, and turned into each op's static parameters
(its :class:`~gram_haiku._src.compute.plan.Plan`, and its refusal) before
the op is bound; no op, rule or kernel reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Iterator, Mapping, Optional

from gram_haiku._src.compute.plan import check_clip
from gram_haiku._src.compute.plan import Clip

_LOCAL = threading.local()


@dataclasses.dataclass(frozen=True)
class ModulePass:
  """What a pass tells ``track()`` about one module: decisions only.

  Attributes:
    layer: the module's layer name, as ``track()`` sees it
      (``module.module_name``; inside ``hk.layer_stack`` and other lifted
      transforms it lacks the prefix that the module's state name
      carries). Carried here once: everything else is keyed by module.
    mode: the mode its op runs in for this pass, in place of the
      context's own (the op mode of the module's
      :class:`~gram_haiku._src.passes.pass_pipeline.Store`):
      ``"per_example"``, ``"factors"`` or ``"clip"``; None: the context's.
    clip: in ``"clip"`` mode, its :class:`~gram_haiku._src.compute.plan
      .Clip`; else None.
    slotted: its ``"factors"`` probe is a stack of slots, one per
      application, picked by a counter in the module's state (a module
      applied at every step of a loop; see
      :func:`gram_haiku._src.passes.slots.slotted_modules`).
    frozen: indices of its op's parameters that have no gradient
      (``Plan.frozen``).
    parts: ``((kind, width), ...)``: its ``"factors"`` probe is a tuple
      of one ``[B, width]`` probe per application, in this order, the
      application of rule ``kind`` (:attr:`RuleOp.kind`) reading its own
      (a module applied once by each of several rules, e.g. a tied
      embedding; see :mod:`gram_haiku._src.passes.parts`); empty
      otherwise.
  """
  layer: str
  mode: Optional[str] = None
  clip: Optional[Clip] = None
  slotted: bool = False
  frozen: tuple[int, ...] = ()
  parts: tuple[tuple[str, int], ...] = ()

  def __post_init__(self):
    check_clip("ModulePass", self.mode, self.clip)
    object.__setattr__(self, "frozen", tuple(self.frozen))
    object.__setattr__(self, "parts", tuple(tuple(p) for p in self.parts))


@dataclasses.dataclass(frozen=True)
class PassPlan:
  """What a pass (:mod:`gram_haiku._src.passes.pass_pipeline`) tells ``track()``:
  its decisions only (what it learns while tracing goes to a
  :class:`PassLog`). Frozen and hashable: every field is static (a
  threshold that is a traced value never reaches it: per-layer clipping
  takes Python numbers, and all-layer clipping weighs the examples after
  the pass).

  Attributes:
    column_axes: mesh axes the examples are split over (``shard_map``);
      ``()`` on one device.
    disabled: every ``track()`` context is inert: the model runs as plain
      Haiku (:func:`gram_haiku.verify`'s reference).
    modules: ``(module, ModulePass)`` pairs, sorted by module (state)
      name: the modules told something (a mode, a clip, slots or frozen
      parameters); empty in the discovery trace. A mapping is accepted.
    upper_bound: the pass clips (:attr:`gram_haiku._src.compute.plan.Plan
      .upper_bound`): every op's norms are sound upper bounds.

  Raises:
    ValueError: where two modules under one layer name are told different
      things (``track()`` sees only the layer name, so it could not tell
      which applies).
  """
  column_axes: tuple[str, ...] = ()
  disabled: bool = False
  modules: tuple[tuple[str, ModulePass], ...] = ()
  upper_bound: bool = False

  def __post_init__(self):
    modules = self.modules
    if isinstance(modules, Mapping):
      modules = modules.items()
    modules = tuple(sorted(modules, key=lambda item: item[0]))
    object.__setattr__(self, "modules", modules)
    object.__setattr__(self, "column_axes", tuple(self.column_axes))
    by_layer = {}
    for module, told in modules:
      first = by_layer.setdefault(told.layer, (module, told))
      if first[1] != told:
        raise ValueError(
            f"gram_haiku: modules {first[0]!r} and {module!r} are applied "
            f"under one layer name {told.layer!r} but the pass tells them "
            f"different things ({first[1]} and {told}); track() sees only "
            f"the layer name. This is a bug in gram_haiku: please report it.")
    # (Not a field: derived, and left out of == and hash.)
    object.__setattr__(self, "_by_layer", by_layer)

  def told(self, layer: str) -> Optional[tuple[str, ModulePass]]:
    """``(module, what it is told)`` for the layer named ``layer``, or None
    where the pass tells it nothing (several modules under one name are
    told the same; the first is named)."""
    return self._by_layer.get(layer)  # pylint: disable=no-member


class PassLog:
  """What a pass learns while the model is traced, written by ``track()``.

  One per trace, given with its :class:`PassPlan` to :func:`running` and
  read by the pipeline afterwards.

  Attributes:
    coverage: parameter name -> :class:`~gram_haiku._src.frontend.coverage
      .ParamCoverage`: what the ``track()`` contexts' getters saw.
    untracked: parameter name -> ``(policy, module type)``: the untracked
      reads the contexts saw, for the pass to report once it knows which
      of them have a gradient.
    raw_traced: layer names applied inside a raw JAX transform
      (``jax.lax.scan``, ``jax.vmap`` opened inside the model): their
      modules cannot keep a slot counter in Haiku state. By layer name,
      not module (the one record that is): it is written in the discovery
      trace, whose plan names no module yet, and a layer knows only its
      layer name there (inside ``hk.layer_stack`` that lacks the prefix of
      its module's state name, which Haiku does not show a module). The
      pipeline reads it once, through :meth:`~gram_haiku._src.analysis
      .dataflow.Discovery.by_layer`.
    slot_reads: module -> the slot counter values its applications read,
      in a pass with slots (see :func:`gram_haiku._src.passes.slots
      .untrusted`).
  """

  def __init__(self):
    self.coverage: dict = {}
    self.untracked: dict = {}
    self.raw_traced: set = set()
    self.slot_reads: dict = {}

  def saw(self, seen: Mapping[str, Any]) -> None:
    """Records the parameters a ``track()`` context's getters saw."""
    self.coverage.update(seen)

  def applied_in_raw_transform(self, layer: str) -> None:
    """Records a layer applied inside a raw JAX transform."""
    self.raw_traced.add(layer)

  def slot_reads_of(self, module: str) -> list:
    """Where ``module``'s applications record the slot counters they read."""
    return self.slot_reads.setdefault(module, [])


@dataclasses.dataclass(frozen=True)
class Ambient:
  """A snapshot of the ambient state.

  Attributes:
    tracker: the innermost active ``track()`` context, or None.
    pass_plan: the running pass, or None on the raw ``jax.grad`` path.
    pass_log: where the running pass records what it learns, or None.
  """
  tracker: Any
  pass_plan: Optional[PassPlan]
  pass_log: Optional[PassLog] = None


def current() -> Ambient:
  """The ambient state now (the one reader)."""
  stack = getattr(_LOCAL, "trackers", ())
  return Ambient(stack[-1] if stack else None,
                 getattr(_LOCAL, "pass_plan", None),
                 getattr(_LOCAL, "pass_log", None))


def push_tracker(tracker) -> None:
  _LOCAL.trackers = getattr(_LOCAL, "trackers", ()) + (tracker,)


def pop_tracker(tracker) -> None:
  stack = getattr(_LOCAL, "trackers", ())
  if not stack or stack[-1] is not tracker:
    raise RuntimeError("gram_haiku.track() contexts must be exited in the "
                       "reverse order of entering them.")
  _LOCAL.trackers = stack[:-1]


@contextlib.contextmanager
def running(pass_plan: PassPlan,
            log: Optional[PassLog] = None) -> Iterator[None]:
  """Marks a pass (a trace of the model) as running, told ``pass_plan``
  and recording into ``log``."""
  previous = (getattr(_LOCAL, "pass_plan", None),
              getattr(_LOCAL, "pass_log", None))
  _LOCAL.pass_plan, _LOCAL.pass_log = pass_plan, log
  try:
    yield
  finally:
    _LOCAL.pass_plan, _LOCAL.pass_log = previous


def plain_haiku():
  """The model's ``track()`` contexts run it as plain Haiku inside (no Gram
  ops, no coverage reports): for a call made beside a pass, whose own
  trace reads what the model covers (a reference, a shape, a value)."""
  return running(PassPlan(disabled=True))


@contextlib.contextmanager
def deprecated_form_site(refusal: Optional[str],
                         at_init: bool) -> Iterator[None]:
  """The ops bound inside (by a deprecated binder function given to
  ``LayerCall.apply``, which passes only ``name`` and ``plan`` on) get
  ``refusal`` and ``at_init`` (:class:`gram_haiku._src.ops.op.RuleOp`):
  :func:`gram_haiku._src.ops.op.bind` reads them through
  :func:`deprecated_form_site_now`. Removed with the deprecated form."""
  previous = getattr(_LOCAL, "deprecated_form_site", None)
  _LOCAL.deprecated_form_site = (refusal, at_init)
  try:
    yield
  finally:
    _LOCAL.deprecated_form_site = previous


def deprecated_form_site_now() -> Optional[tuple[Optional[str], bool]]:
  """``(refusal, at_init)`` inside :func:`deprecated_form_site`, else None."""
  return getattr(_LOCAL, "deprecated_form_site", None)


def raw_uses(call_id: int) -> set:
  """The names of the modules applied so far in this call of a transformed
  function (raw ``jax.grad`` path), across ``track()`` contexts and Haiku's
  lifted transforms.

  ``call_id`` identifies that call: the ``frame_id`` of its outermost Haiku
  frame (the bottom of the frame stack, which ``hk.remat``, ``hk.vmap`` and
  ``hk.cond`` push their frames above; Haiku numbers every frame it makes,
  never reusing a number). A new call starts an empty set. Only that number
  and the names are held: never the frame, whose parameters, state and rng
  (tracers, under ``jit``) must not outlive the call (JAX's
  ``jax_check_tracer_leaks`` checks it).
  """
  held = getattr(_LOCAL, "raw_uses", None)
  if held is None or held[0] != call_id:
    held = (call_id, set())
    _LOCAL.raw_uses = held
  return held[1]


def raw_probes() -> "weakref.WeakValueDictionary":
  """Raw ``jax.grad`` path: the probe values handed to tracked ops so far,
  by ``id`` (held weakly: a value no longer alive is dropped); read and
  written by :mod:`gram_haiku._src.frontend.raw_path` only."""
  seen = getattr(_LOCAL, "probes", None)
  if seen is None:
    seen = _LOCAL.probes = weakref.WeakValueDictionary()
  return seen
