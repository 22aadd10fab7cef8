"""The transforms a check runs an op under, as named values (chex-style).

In the spirit of ``chex``'s variants (``chex.with_jit``,
``chex.without_jit``...): each transform placement is a value with a name
(the one test ids show) and a method that applies it, so that a check says
*which* variant it runs and the suite's case lists are built from these
values alone:

* :data:`JIT` (``none``, ``inside``, ``outside``): where ``jax.jit`` goes
  (:class:`Jit`): nowhere, around the op inside the vmaps, or around the
  gradient;
* :data:`BATCHING` (``explicit``, ``vmap``): the op called on the batch, or
  under one ``vmap`` over the examples (:class:`Batching`);
* :data:`VMAP_LAYOUTS`: ``vmap`` depth 0 to 3 with permuted
  ``in_axes``/``out_axes`` (:class:`VmapLayout`);
* :data:`CHECKPOINTS` (``default``, ``nothing_saveable``,
  ``everything_saveable``, ``dots_saveable``): ``jax.checkpoint`` with a
  policy (:class:`Checkpoint`).

Importing this module imports JAX (the policies are JAX's).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional

import jax

#: Example-axis size and within-example axes the checks use: the canonical
#: input is ``x: (B, T1, T2, *features)``.
B = 4
WITHIN = (3, 2)


@dataclasses.dataclass(frozen=True)
class Jit:
  """Where ``jax.jit`` goes: ``"none"``, ``"inside"`` (around the op,
  inside the vmaps) or ``"outside"`` (around the gradient)."""
  name: str

  def around_op(self, f: Callable) -> Callable:
    return jax.jit(f) if self.name == "inside" else f

  def around_grad(self, g: Callable) -> Callable:
    return jax.jit(g) if self.name == "outside" else g

  def __str__(self):
    return self.name


JIT_NONE = Jit("none")
JIT_INSIDE = Jit("inside")
JIT_OUTSIDE = Jit("outside")
#: name -> :class:`Jit`.
JIT = {v.name: v for v in (JIT_NONE, JIT_INSIDE, JIT_OUTSIDE)}


@dataclasses.dataclass(frozen=True)
class Batching:
  """How the op sees the examples: ``"explicit"`` (the whole batch, example
  axis first) or ``"vmap"`` (one example at a time under ``jax.vmap``)."""
  name: str

  @property
  def vmapped(self) -> bool:
    return self.name == "vmap"

  def __call__(self, f: Callable) -> Callable:
    return jax.vmap(f) if self.vmapped else f

  def __str__(self):
    return self.name


EXPLICIT = Batching("explicit")
VMAPPED = Batching("vmap")
#: name -> :class:`Batching`.
BATCHING = {v.name: v for v in (EXPLICIT, VMAPPED)}


def batching(vmapped: bool) -> Batching:
  return VMAPPED if vmapped else EXPLICIT


@dataclasses.dataclass(frozen=True)
class VmapLayout:
  """``len(in_axes)`` nested vmaps: level ``k`` (outermost first) maps lead
  axis ``k`` of the canonical ``(B, T1, T2, ...)`` input, taking it at
  ``in_axes[k]`` and putting it at ``out_axes[k]``. Depth 0 is the op
  explicitly batched; the outermost vmap is the example axis."""
  in_axes: tuple[int, ...]
  out_axes: tuple[int, ...]

  @property
  def depth(self) -> int:
    return len(self.in_axes)

  @property
  def name(self) -> str:
    return (f"depth{self.depth}-in{''.join(map(str, self.in_axes))}-"
            f"out{''.join(map(str, self.out_axes))}")

  def order(self, nlead: int) -> list[int]:
    """:func:`layout_order` of this layout."""
    return layout_order(self.in_axes, nlead)

  def __call__(self, f: Callable, axis_names=None) -> Callable:
    """``f`` under the nested vmaps (``axis_names``: one per level)."""
    return nest(f, self.in_axes, self.out_axes, axis_names)

  def __iter__(self):  # ``ins, outs = layout``
    return iter((self.in_axes, self.out_axes))

  def __str__(self):
    return self.name


def layout_order(in_axes, nlead):
  """Axis order putting lead axes ``0..d-1`` where nested vmaps map them.

  ``in_axes[k]`` is the ``in_axes`` of vmap level ``k`` (outermost first);
  level ``k`` maps lead axis ``k`` of the canonical ``(B, T1, T2, ...)``
  layout. Feature axes stay last.
  """
  d = len(in_axes)
  order = list(range(d, nlead))
  for k in reversed(range(d)):
    order.insert(in_axes[k], k)
  return order


def nest(f, in_axes, out_axes, axis_names=None):
  """``f`` under ``len(in_axes)`` nested ``jax.vmap`` s (outermost first)."""
  for k in reversed(range(len(in_axes))):
    name = axis_names[k] if axis_names else None
    f = jax.vmap(f, in_axes=in_axes[k], out_axes=out_axes[k],
                 axis_name=name)
  return f


def vmap_layouts(max_depth=3) -> dict[int, list[VmapLayout]]:
  """``{depth: [VmapLayout, ...]}``: a fixed, varied selection.

  Every valid ``in_axes`` permutation is listed for depth 1 and 2; depth 3
  takes four, spread over the space. ``out_axes`` vary with them.
  """
  nlead = 1 + len(WITHIN)
  out = {0: [VmapLayout((), ())]}
  for depth in range(1, max_depth + 1):
    choices = [range(0, nlead - k) for k in range(depth)]
    all_in = list(itertools.product(*choices))
    if depth == 3:
      all_in = all_in[::max(1, len(all_in) // 4)][:4]
    out[depth] = [VmapLayout(tuple(ins), tuple((a + i) % 2 for a in ins))
                  for i, ins in enumerate(all_in)]
  return out


#: ``{depth: [VmapLayout, ...]}``, depth 0 to 3.
VMAP_LAYOUTS = vmap_layouts()


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """``jax.checkpoint`` with a policy (None: JAX's default)."""
  name: str
  policy: Optional[Any] = None

  def __call__(self, f: Callable) -> Callable:
    return jax.checkpoint(f, policy=self.policy)

  def __str__(self):
    return self.name


#: name -> :class:`Checkpoint`.
CHECKPOINTS = {v.name: v for v in (
    Checkpoint("default"),
    Checkpoint("nothing_saveable", jax.checkpoint_policies.nothing_saveable),
    Checkpoint("everything_saveable",
               jax.checkpoint_policies.everything_saveable),
    Checkpoint("dots_saveable", jax.checkpoint_policies.dots_saveable),
)}
