"""The one place that touches JAX's experimental hijax API and its internals.

``jax.experimental.hijax`` is experimental: its names move between releases.
Everything gram_haiku needs from it, and from the JAX internals that its
backward rules receive (gradient accumulators, symbolic zeros, vmap axis
data), is imported here and nowhere else, so that supporting a new JAX
release means editing this module only.

Supported range: see ``setup.cfg`` (``jax>=0.10.0,<0.12``; 0.11 needs
Python 3.12). 0.11 renamed ``VJPHiPrimitive`` to ``HiPrim`` and changed
``fake_linear_op``'s and ``scan``'s parameters; both spellings are read
here. The oldest supported release is 0.10.0: 0.9 has every name below
but does not lower a hijax primitive under ``jax.checkpoint`` (``hk.remat``)
or ``jax.linearize`` under ``jit``, and 0.8 lacks
``hijax.instantiate_zeros``. :data:`MIN_JAX_VERSION` is checked at
import time so that an unsupported JAX fails with a clear message instead of
an ``AttributeError`` deep inside a trace.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Any, Optional, Sequence

import jax
import jax.extend.core  # noqa: F401
import jax.numpy as jnp
from jax import lax
import numpy as np

MIN_JAX_VERSION = (0, 10, 0)
MAX_JAX_VERSION_EXCLUSIVE = (0, 12, 0)


def _parse_version(text: str) -> tuple[int, ...]:
  parts = []
  for piece in text.split(".")[:3]:
    digits = "".join(ch for ch in piece if ch.isdigit())
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


JAX_VERSION = _parse_version(jax.__version__)

if not MIN_JAX_VERSION <= JAX_VERSION < MAX_JAX_VERSION_EXCLUSIVE:
  raise ImportError(
      f"gram_haiku supports jax>={'.'.join(map(str, MIN_JAX_VERSION))},"
      f"<{'.'.join(map(str, MAX_JAX_VERSION_EXCLUSIVE))} (the releases whose "
      "jax.experimental.hijax.VJPHiPrimitive API it is written against), but "
      f"jax {jax.__version__} is installed. Install a supported release, e.g. "
      f"`pip install 'jax>={'.'.join(map(str, MIN_JAX_VERSION))},"
      f"<{'.'.join(map(str, MAX_JAX_VERSION_EXCLUSIVE[:2]))}'`.")

# pylint: disable=g-import-not-at-top,g-bad-import-order
from jax.experimental import hijax as _public_hijax  # noqa: E402
from jax.experimental.hijax import Zero  # noqa: E402
from jax.experimental.hijax import instantiate_zeros  # noqa: E402
from jax._src import hijax as _hijax  # noqa: E402
from jax._src.interpreters import ad as _ad  # noqa: E402
from jax._src.interpreters import partial_eval as _pe  # noqa: E402
from jax.extend.core import Literal  # noqa: E402
# pylint: enable=g-import-not-at-top,g-bad-import-order

# 0.9 and 0.10 call the primitive base class VJPHiPrimitive; 0.11 HiPrim.
VJPHiPrimitive = getattr(_public_hijax, "VJPHiPrimitive", None) or (
    _public_hijax.HiPrim)
# 0.11's fake_linear_op also takes the output nonzeros and static residuals.
_FAKE_LINEAR_OP_TAKES_OUT_NZS = "nz_out_flat" in inspect.signature(
    _hijax.fake_linear_op).parameters

__all__ = [
    "VJPHiPrimitive",
    "Zero",
    "is_zero",
    "wants_cotangent",
    "accumulator_ref_type",
    "axis_name",
    "jvp_by_vjp",
    "varying_axes",
    "vary_like",
    "vary_over",
    "reduce_to_type_of",
    "Literal",
    "gram_op_of",
    "jaxprs_of",
    "closed_consts_of",
    "custom_jvp_rule",
    "scan_counts",
    "may_carry_gradient",
    "inside_loop_trace",
    "is_differentiated",
    "live_part",
]


def is_zero(x: Any) -> bool:
  """True for JAX's symbolic zero cotangent/tangent (``ad_util.Zero``)."""
  return isinstance(x, Zero)


def wants_cotangent(accum: Any) -> bool:
  """True when a backward rule's accumulator will use what it is given.

  In ``VJPHiPrimitive.vjp_bwd`` every input gets an accumulator; inputs that
  are not differentiated get a null one. Skipping their work is what keeps a
  tracked layer as cheap as a plain one when its Gram is not requested.
  """
  return isinstance(accum, _ad.GradAccum) and not isinstance(
      accum, _ad.NullAccum)


def jvp_by_vjp(prim: Any, primals: tuple, tangents: tuple):
  """A JVP whose tangent output, when transposed, runs ``prim.vjp_bwd``.

  JAX differentiates some regions (``jax.checkpoint``'s default
  implementation, for one) by JVP + partial evaluation + transposition
  instead of by ``vjp_fwd``/``vjp_bwd``. An ordinary JVP rule would then lose
  everything the backward rule adds on top of the plain derivative: here, the
  Gram written into the probe's cotangent. This emits JAX's opaque linear op
  for VJP primitives instead (what ``custom_vjp`` does), so transposition
  calls ``vjp_bwd``. Forward-mode evaluation of that op raises JAX's
  "can't apply forward-mode autodiff (jvp) to a custom_vjp function" error,
  as ``custom_vjp`` does: never a wrong number.
  """
  flat_tangents = [instantiate_zeros(t) for t in
                   jax.tree_util.tree_leaves(tangents, is_leaf=is_zero)]
  nzs = jax.tree_util.tree_map(lambda _: True, primals)
  out, residuals = prim.vjp_fwd(nzs, *primals)[:2]
  nz_flat = [True] * len(flat_tangents)
  if _FAKE_LINEAR_OP_TAKES_OUT_NZS:  # 0.11: (prim, nz_in, nz_out, rs, sres)
    nz_out = [True] * len(prim.out_avals_flat)
    out_tangents = _hijax.fake_linear_op(prim, nz_flat, nz_out, residuals,
                                         None, *flat_tangents)
  else:
    out_tangents = _hijax.fake_linear_op(prim, nz_flat, residuals,
                                         *flat_tangents)
  return out, jax.tree_util.tree_unflatten(prim.out_tree, out_tangents)


def accumulator_ref_type(accum: Any):
  """``(shape, dtype)`` of the user's ref behind a ``with_refs`` accumulator.

  ``jax.vjp(f, ...).with_refs(*refs)`` accumulates cotangents into
  ``jax.new_ref`` arrays; inside a backward rule such an input has a ref
  accumulator. Returns None for every other accumulator.
  """
  if not isinstance(accum, _ad.RefAccum):
    return None
  ref = getattr(accum, "ref", None)
  if ref is None:
    return None
  aval = jax.typeof(ref)
  inner = getattr(aval, "inner_aval", aval)
  return tuple(inner.shape), inner.dtype


def axis_name(axis_data: Any) -> Any:
  """The ``axis_name`` of the vmap whose batching rule is running, or None."""
  return getattr(axis_data, "name", None)


def axis_size(axis_data: Any) -> int:
  """The size of the vmap whose batching rule is running."""
  return int(axis_data.size)


def varying_axes(x: Any) -> frozenset:
  """Mesh axes along which ``x`` varies inside ``shard_map`` (its VMA type).

  JAX 0.9 spells it ``aval.vma``; 0.10 ``aval.manual_axis_type.varying``.
  Empty outside ``shard_map`` or with ``check_vma=False``.
  """
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(getattr(mat, "varying", ()))
  return frozenset(getattr(aval, "vma", ()) or ())


def vary_like(p: Any, *likes: Any) -> Any:
  """``p`` cast to vary over every mesh axis any of ``likes`` varies over.

  A parameter is invariant inside ``shard_map`` (replicated) while the
  layer input varies over the example axes. ``jax.vjp`` with respect to an
  invariant value sums its cotangent over devices (the transpose of the
  implicit ``pvary``); per-example gradients must not be summed, so they
  are taken with respect to the parameter cast to varying first.
  """
  extra = frozenset().union(*(varying_axes(a) for a in likes))
  extra = extra - varying_axes(p)
  if not extra:
    return p
  return jax.lax.pcast(p, tuple(sorted(extra)), to="varying")


def reduce_to_type_of(ct: Any, primal: Any) -> Any:
  """A cotangent summed over the mesh axes along which ``primal`` is invariant.

  What JAX's AD does for a plain layer inside ``shard_map``: the gradient of
  a replicated parameter is the sum of the devices' contributions. Backward
  rules that compute a parameter's cotangent from varying values (the sum
  of materialised per-example gradients) call this before accumulating, so
  the parameter gets exactly the all-reduce a plain layer would, no more.
  """
  extra = varying_axes(ct) - varying_axes(primal)
  if not extra:
    return ct
  return jax.lax.psum(ct, tuple(sorted(extra)))


def vary_over(x: Any, axes: tuple[str, ...]) -> Any:
  """``x`` cast to vary over mesh ``axes`` (no-op where it already does)."""
  extra = frozenset(axes) - varying_axes(x)
  if not extra:
    return x
  return jax.lax.pcast(x, tuple(sorted(extra)), to="varying")


def gram_op_of(eqn: Any, op_type: type):
  """The bound op of a jaxpr equation of a hijax primitive of ``op_type``.

  A ``VJPHiPrimitive`` application is printed (and stored) as a
  ``call_hi_primitive`` equation whose ``_prim`` parameter (``prim`` in
  jax 0.9, below the supported range) is the op instance. None for every
  other equation.
  """
  op = eqn.params.get("_prim") if hasattr(eqn, "params") else None
  return op if isinstance(op, op_type) else None


def may_carry_gradient(v: Any) -> bool:
  """Whether jaxpr variable ``v`` may have a nonzero cotangent: a float or
  complex value (or one whose type is not known)."""
  dtype = getattr(getattr(v, "aval", None), "dtype", None)
  # jnp's, not numpy's: bfloat16 and the float8 types are inexact there.
  return dtype is None or jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def custom_jvp_rule(eqn: Any) -> Any:
  """The JVP rule of a ``custom_jvp_call`` equation as a program.

  Returns:
    ``(jaxpr, consts, out_zeros)``: ``jaxpr(*primals, *tangents) ->
    (*primal_outs, *tangent_outs)`` for the equation's operands after its
    ``num_consts`` constants, every input tangent nonzero, with a tangent
    output for each ``False`` in ``out_zeros``; None for any other equation
    or where this JAX's equation does not carry its rule as expected.
  """
  if eqn.primitive.name != "custom_jvp_call":
    return None
  fun = eqn.params.get("jvp_jaxpr_fun", eqn.params.get("jvp_jaxpr_thunk"))
  if fun is None:
    return None
  n = len(eqn.invars) - eqn.params.get("num_consts", 0)
  try:
    jaxpr, consts, out_zeros = getattr(fun, "call_wrapped", fun)(
        *([False] * n))
  except Exception:  # pylint: disable=broad-except
    return None
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # (a ClosedJaxpr in some releases)
  if len(jaxpr.invars) != 2 * n:
    return None
  return jaxpr, list(consts), [bool(z) for z in out_zeros]


def scan_counts(eqn: Any) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation's operands.

  Its operands are the constants, then the initial carry, then the scanned
  inputs. JAX 0.9 and 0.10 give the counts as parameters; 0.11 gives the
  three groups as one ``ft_in`` tree instead.
  """
  params = eqn.params
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].update(list(eqn.invars)).unpack()
  return len(list(consts)), len(list(carry))


def closed_consts_of(eqn: Any) -> dict:
  """The constants of the closed sub-jaxprs in a jaxpr equation's
  parameters, by constant variable."""
  out = {}
  for value in eqn.params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        out.update(zip(v.jaxpr.constvars, v.consts))
  return out


def jaxprs_of(eqn: Any) -> list:
  """The (open) sub-jaxprs in a jaxpr equation's parameters, in order."""
  out = []

  def visit(v):
    if isinstance(v, jax.extend.core.ClosedJaxpr):
      out.append(v.jaxpr)
    elif isinstance(v, jax.extend.core.Jaxpr):
      out.append(v)
    elif isinstance(v, (tuple, list)):
      for item in v:
        visit(item)
  for value in eqn.params.values():
    visit(value)
  return out


def source_frames(eqn: Any) -> tuple[tuple[str, int], ...]:
  """``(file, line)`` of each frame of the Python stack that traced a
  jaxpr equation, innermost first; ``()`` where JAX kept no traceback
  (``eqn.source_info.traceback``, a jaxlib ``Traceback``)."""
  try:
    frames = eqn.source_info.traceback.frames
    return tuple((str(f.file_name), int(f.line_num)) for f in frames)
  except Exception:  # pylint: disable=broad-except
    return ()  # No traceback, or its fields renamed: the message says less.


_JAX_LOOPS = os.path.join("jax", "_src", "lax", "control_flow", "loops.py")
_HK_LAYER_STACK = os.path.join("haiku", "_src", "layer_stack.py")


def inside_loop_trace() -> bool:
  """Whether the caller is being traced as a loop body that reuses its
  parameters (the raw ``jax.grad`` path's only loop check).

  Walks the Python stack from the innermost frame: ``hk.layer_stack`` (a
  new slice of parameters per step) is fine; a JAX loop (``lax.scan``,
  ``map``, ``fori_loop``, ``while_loop``, and Haiku's wrappers of them) is
  not. It reads JAX's and Haiku's source file names, so it lives here.
  :func:`gram_haiku.value_grad_and_gram` does not use it: it reads loops
  from the traced program instead.
  """
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None:
    filename = frame.f_code.co_filename
    if filename.endswith(_HK_LAYER_STACK):
      return False
    if filename.endswith(_JAX_LOOPS):
      return True
    frame = frame.f_back
  return False


def is_differentiated(x: Any) -> bool:
  """Whether ``x`` is being differentiated by an enclosing reverse- or
  forward-mode transform (it is one of JAX's AD tracers)."""
  return isinstance(x, (_ad.JVPTracer, _ad.LinearizeTracer))


def sub_program(jaxpr: Any, consts: Any, invars: list, outvars: list,
                eqns: list):
  """``(fn, key)``: ``fn(*inputs) -> list`` runs the equations ``eqns`` of
  ``jaxpr`` (in order) as a function of ``invars``, giving ``outvars``; its
  constant variables take their values from ``consts`` (by variable).
  ``key`` is equal for two sub-programs that compute alike (the printed
  program, and the identities of the constants it reads)."""
  used = {v for e in eqns for v in e.invars if not isinstance(v, Literal)}
  used |= {v for v in outvars if not isinstance(v, Literal)}
  constvars = [v for v in jaxpr.constvars if v in used]
  info = jaxpr.debug_info
  if info is not None and hasattr(info, "with_unknown_names"):
    info = info.with_unknown_names()  # (other inputs and outputs)
  effects = frozenset().union(*(e.effects for e in eqns)) if eqns else (
      frozenset())
  sub = jax.extend.core.Jaxpr(constvars, list(invars), list(outvars),
                              list(eqns), effects, info)
  values = [consts[v] for v in constvars]
  key = (str(sub), tuple(id(c) for c in values))
  return functools.partial(_eval_varying, list(eqns), constvars, values,
                           list(invars), list(outvars)), key


def replay(jaxpr: Any, consts: Any, args: list,
           operands: Optional[dict] = None,
           per_example: Optional[dict] = None,
           taps: Optional[dict] = None) -> list:
  """A program's outputs at ``args`` (its constants' values ``consts``, by
  variable), each equation bound again (a hijax primitive's included), as
  :func:`sub_program` does.

  Args:
    jaxpr: the program.
    consts: its constants' values, by constant variable.
    args: its inputs' values.
    operands: ``{(path, id(eqn), k): value}``, the values taken for
      operand ``k`` of those equations instead of their variables' (an
      input put in place of a value). ``path``: the ids of the call-like
      equations (outermost first: ``jit``, ``checkpoint``, ``cond``,
      ``scan``; :func:`call_bodies`) whose programs hold the equation,
      ``()`` for the program's own; those are evaluated with their
      programs replayed the same way (:func:`_eval_into`).
    per_example: ``{(path, id(eqn)): (axes, stacked, out_axis)}``,
      equations bound once per example instead (:func:`bind_per_example`);
      or ``{(path, id(eqn)): fn}``, equations replaced by ``fn(operand
      values) -> [outputs]`` (a program-level site bound as a Gram op).
    taps: ``{(path, id(eqn), k): probe}``: operand ``k`` of those
      equations (after ``operands``) passed through :func:`abs_tap` with
      ``probe``: its cotangent's absolute value is added to ``probe``'s
      at each evaluation (each step of a loop).
  """
  constvars = list(jaxpr.constvars)
  return _eval_varying(list(jaxpr.eqns), constvars,
                       [consts[v] for v in constvars], list(jaxpr.invars),
                       list(jaxpr.outvars), *args, operands=operands,
                       per_example=per_example, taps=taps)


@jax.custom_vjp
def abs_tap(x: Any, probe: Any) -> Any:
  """``x``, whose VJP also gives ``probe`` (zeros shaped like ``x``) the
  absolute value of ``x``'s cotangent: inside a loop body that closes
  over ``probe``, ``probe``'s cotangent is ``sum_t |d_t|`` over the steps,
  where ``x``'s is ``sum_t d_t`` (what bounds that sum's rounding)."""
  del probe
  return x


def _abs_tap_fwd(x, probe):
  del probe
  return x, None


def _abs_tap_bwd(_, d):
  return d, jnp.abs(d)


abs_tap.defvjp(_abs_tap_fwd, _abs_tap_bwd)


#: The names of ``jax.jit``'s call primitive across the supported releases.
JIT_NAMES = ("pjit", "jit")


def jit_body(eqn: Any) -> Optional[tuple]:
  """``(body, consts)``: the program a ``jit`` call ``eqn`` runs (an open
  jaxpr) and its constants' values by variable; None for any other
  equation."""
  if eqn.primitive.name not in JIT_NAMES:
    return None
  closed = eqn.params.get("jaxpr")
  if closed is None:
    return None
  body = getattr(closed, "jaxpr", closed)
  return body, dict(zip(body.constvars, getattr(closed, "consts", ())))


#: The names of ``jax.checkpoint``'s primitive (``hk.remat``) across the
#: supported releases.
REMAT_NAMES = ("checkpoint", "remat", "remat2")


def call_bodies(eqn: Any) -> Optional[list]:
  """The programs a call-like equation runs, as the replay follows them
  (:func:`replay`): ``[(body, consts, operands)]``, ``body`` an open jaxpr,
  ``consts`` its constants' values by variable, ``operands`` for each
  input of ``body`` the equation's operand it is bound to (None for a
  ``scan``'s carry or scanned slice, which change from step to step).
  A ``jit`` or ``checkpoint`` call runs one body on its operands; a
  ``cond`` one of its branches on its operands after the index; a
  ``scan`` its body on its constants, carries and slices. None for any
  other equation (a custom derivative's: its rule, not its body, is what
  differentiation runs)."""
  name = eqn.primitive.name
  if name in JIT_NAMES:
    call = jit_body(eqn)
    if call is None:
      return None
    return [(*call, list(eqn.invars))]
  closed = lambda c: (c.jaxpr, dict(zip(c.jaxpr.constvars, c.consts)))
  if name in REMAT_NAMES:
    body = eqn.params.get("jaxpr")
    if isinstance(body, jax.extend.core.ClosedJaxpr):
      return [(*closed(body), list(eqn.invars))]
    return None if body is None else [(body, {}, list(eqn.invars))]
  if name == "cond":
    return [(*closed(b), list(eqn.invars[1:]))
            for b in eqn.params["branches"]]
  if name == "scan":
    n_consts, _ = scan_counts(eqn)
    body, consts = closed(eqn.params["jaxpr"])
    return [(body, consts, list(eqn.invars[:n_consts]) +
             [None] * (len(body.invars) - n_consts))]
  return None


#: The calls whose outputs are those of their one program run on their
#: operands (a ``jit`` call, a checkpoint: their derivative is that
#: program's), by primitive name: a value that one of them returns can be
#: computed by its program's equations alone (:func:`inline_body`).
INLINE_CALLS = frozenset((*JIT_NAMES, *REMAT_NAMES))


def inline_body(eqn: Any) -> Optional[tuple]:
  """``(body, consts)``: the program that a call of :data:`INLINE_CALLS`
  runs on its operands (an open jaxpr whose inputs are the equation's
  operands, in order) and its constants' values by variable; None for any
  other equation."""
  if eqn.primitive.name not in INLINE_CALLS:
    return None
  bodies = call_bodies(eqn)
  if not bodies:
    return None
  (body, consts, _), = bodies
  return body, consts


def body_holding(eqn: Any, inner: Any) -> tuple:
  """``(body, consts, operands)`` of :func:`call_bodies` whose program
  holds equation ``inner`` (by identity)."""
  for body, consts, operands in call_bodies(eqn) or ():
    if any(e is inner for e in body.eqns):
      return body, consts, operands
  raise AssertionError("gram_haiku internal error: an equation not found in "
                       f"the programs of `{eqn.primitive.name}`.")


def bind_per_example(eqn: Any, ins: list, axes: Sequence[Optional[int]],
                     stacked: Sequence[int], out_axis: int,
                     abs_probe: Any = None) -> list:
  """``eqn``'s outputs, its primitive bound once per example under
  ``jax.vmap``.

  Args:
    eqn: a jaxpr equation with one output.
    ins: its operands' values. Operand ``k`` in ``stacked`` holds one value
      per example along a new axis 0 (``[B, *shape]``: the equation's own
      operand for example ``i`` is its slice ``i``); operand ``k`` with an
      int ``axes[k]`` holds the examples along that axis (each call sees
      its slice, the axis kept with size 1, so the equation's parameters
      still fit); the others (``axes[k]`` None) are given whole to every
      call.
    axes: per operand, its examples' axis, or None.
    stacked: the operands with a new per-example axis 0.
    out_axis: the examples' axis of the output (size 1 in each call).
    abs_probe: None, or zeros shaped like the one stacked operand: the
      output then gains a term of zeros whose VJP gives ``abs_probe`` the
      same equation's VJP with respect to the stacked operand at the
      absolute values of the other (floating) operands, of the absolute
      output cotangent: per example, ``sum |x| |d|`` for a contraction or
      convolution, ``sum |d|`` for a gather, the sums that bound the
      rounding of the stacked operand's cotangent
      (:mod:`gram_haiku._src.passes.program_pass`).

  Returns:
    The outputs (a list), the examples along ``out_axis``.
  """
  outs = _bind_per_example(eqn, ins, axes, stacked, out_axis)
  if abs_probe is None:
    return outs
  return [outs[0] + _abs_term(eqn, ins, axes, stacked, out_axis, abs_probe,
                              outs[0])]


def _abs_term(eqn, ins, axes, stacked, out_axis, probe, out):
  """Zeros like ``out``, whose VJP gives ``probe`` the cotangent described
  by :func:`bind_per_example`'s ``abs_probe``."""
  (k,) = stacked
  data = [x for j, x in enumerate(ins) if j != k]
  shape, dtype = out.shape, out.dtype

  @jax.custom_vjp
  def term(p, *data):
    del p
    return vary_like(jnp.zeros(shape, dtype), *data)

  def fwd(p, *data):
    return term(p, *data), data

  def bwd(data, d):
    full = [jnp.abs(x) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
            else x for x in data]
    full.insert(k, None)

    def f(z):
      full[k] = z
      return _bind_per_example(eqn, full, axes, stacked, out_axis)[0]
    _, vjp = jax.vjp(f, jnp.zeros_like(probe))
    (dp,) = vjp(jnp.abs(d))
    zero = [jnp.zeros_like(x) if jnp.issubdtype(jnp.result_type(x),
                                                jnp.inexact)
            else np.zeros(np.shape(x), jax.dtypes.float0) for x in data]
    return (dp, *zero)

  term.defvjp(fwd, bwd)
  return term(probe, *data)


def _bind_per_example(eqn, ins, axes, stacked, out_axis) -> list:
  """:func:`bind_per_example` without ``abs_probe``."""
  mapped = [k for k in range(len(ins)) if k in stacked or axes[k] is not None]

  def one(*vals):
    full = list(ins)
    for k, v in zip(mapped, vals):
      full[k] = v if k in stacked else jnp.expand_dims(v, axes[k])
    return [jnp.squeeze(o, out_axis) for o in bind_equation(eqn, full)]
  in_axes = tuple(0 if k in stacked else axes[k] for k in mapped)
  return jax.vmap(one, in_axes=in_axes, out_axes=out_axis)(
      *[ins[k] for k in mapped])


def _eval_varying(eqns: list, constvars: list, consts: list, invars: list,
                  outvars: list, *args: Any, operands=None,
                  per_example=None, taps=None, path: tuple = ()) -> list:
  """The program ``eqns`` (with ``constvars`` bound to ``consts``) at
  ``args``, equation by equation, each equation's operands first cast to
  vary over the same mesh axes.

  Inside ``shard_map`` a replayed equation may meet a replicated constant
  (a literal, a mask) and a value varying over the examples' axes; JAX's
  own ops insert that cast (``pvary``) when traced, but a recorded
  equation is bound as it was. Outside ``shard_map`` nothing varies and
  this is JAX's ``eval_jaxpr``. Calls of sub-programs (``jit``) are
  evaluated inline, the same way; the call-like equations that hold an
  equation of ``operands`` or ``per_example`` are evaluated with their
  programs replayed (:func:`_eval_into`; see :func:`replay`; ``path``:
  the ids of the calls these ``eqns`` are inside). (The parts are passed
  apart: JAX 0.11 folds a closed program's constants into its
  ``Jaxpr``.)
  """
  into = {k[0][:n] for k in (*(operands or {}), *(per_example or {}))
          for n in range(len(path) + 1, len(k[0]) + 1)}
  env = {}
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  for v, c in zip(constvars, consts):
    env[v] = c
  for v, a in zip(invars, args):
    env[v] = a
  for eqn in eqns:
    ins = [read(v) for v in eqn.invars]
    if operands:
      ins = [operands.get((path, id(eqn), k), x) for k, x in enumerate(ins)]
    if taps:
      ins = [abs_tap(x, taps[(path, id(eqn), k)])
             if (path, id(eqn), k) in taps else x for k, x in enumerate(ins)]
    axes = frozenset().union(*(varying_axes(x) for x in ins))
    if axes:
      ins = [vary_like(jnp.asarray(x), *ins) for x in ins]
    inner = (eqn.params.get("jaxpr") if eqn.primitive.name in JIT_NAMES
             else None)
    if (axes and inner is None and jaxprs_of(eqn) and
        path + (id(eqn),) not in into):
      # A custom derivative's rule was traced for replicated operands. (A
      # call replayed by _eval_into is traced again, from Python.)
      raise NotImplementedError(
          f"gram_haiku: a parameter reaches a tracked layer through "
          f"`{eqn.primitive.name}` (a function with a custom derivative, "
          "e.g. in a custom getter), which cannot be replayed for one "
          "device's examples inside shard_map.\n"
          "What to do: run this model without mesh=/mesh_axes, or apply "
          "the function inside the layer's own computation instead of a "
          "getter.")
    if eqn.primitive.name == "pvary" and all(
        frozenset(eqn.params.get("axes", ())) <= varying_axes(x)
        for x in ins):
      # A recorded cast to vary over axes its operands already vary over
      # (a parameter's prefix evaluated again for values that vary with
      # the examples' cotangents): the identity (pvary would refuse).
      outs = list(ins)
    elif per_example and (path, id(eqn)) in per_example:
      how = per_example[(path, id(eqn))]
      outs = how(ins) if callable(how) else bind_per_example(eqn, ins, *how)
    elif path + (id(eqn),) in into:
      outs = _eval_into(eqn, ins, operands, per_example, taps,
                        path + (id(eqn),))
    elif axes and inner is not None:
      body = getattr(inner, "jaxpr", inner)
      outs = _eval_varying(list(body.eqns), list(body.constvars),
                           list(inner.consts), list(body.invars),
                           list(body.outvars), *ins)
    else:
      outs = bind_equation(eqn, ins)
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in outvars]


def _eval_into(eqn, ins, operands, per_example, taps, path) -> list:
  """A call-like equation (:func:`call_bodies`) evaluated with its
  programs replayed by :func:`_eval_varying` (``operands`` and
  ``per_example`` applied inside, ``path`` the call's): a ``jit`` call
  inline, a ``checkpoint`` under ``jax.checkpoint`` with its policy, a
  ``cond`` by ``lax.switch`` on its index, a ``scan`` by ``lax.scan`` with
  its length, direction and unrolling. The values put in place inside
  (``Z``) are closed over: differentiation sums a loop's steps' parts."""
  def run(body, consts, *args):
    return _eval_varying(list(body.eqns), list(body.constvars),
                         [consts[v] for v in body.constvars],
                         list(body.invars), list(body.outvars), *args,
                         operands=operands, per_example=per_example,
                         taps=taps, path=path)
  name = eqn.primitive.name
  bodies = call_bodies(eqn)
  if name in REMAT_NAMES:
    (body, consts, _), = bodies
    fn = jax.checkpoint(functools.partial(run, body, consts),
                        prevent_cse=eqn.params.get("prevent_cse", True),
                        policy=eqn.params.get("policy"))
    return list(fn(*ins))
  if name == "cond":
    branches = [functools.partial(run, body, consts)
                for body, consts, _ in bodies]
    return list(lax.switch(ins[0], branches, *ins[1:]))
  if name == "scan":
    (body, consts, _), = bodies
    n_consts, n_carry = scan_counts(eqn)
    fixed = ins[:n_consts]

    def step(carry, xs):
      outs = run(body, consts, *fixed, *carry, *xs)
      return outs[:n_carry], outs[n_carry:]
    carry, ys = lax.scan(step, list(ins[n_consts:n_consts + n_carry]),
                         list(ins[n_consts + n_carry:]),
                         length=eqn.params["length"],
                         reverse=eqn.params.get("reverse", False),
                         unroll=eqn.params.get("unroll", 1))
    return [*carry, *ys]
  (body, consts, _), = bodies  # a jit call: inline
  return run(body, consts, *ins)


def bind_equation(eqn: Any, ins: list) -> list:
  """A jaxpr equation's primitive applied to the values ``ins``: its
  outputs, as a list."""
  bind = eqn.primitive.get_bind_params(eqn.params)
  # (A dict since JAX 0.10; (subfuns, params) before.)
  subfuns, params = bind if isinstance(bind, tuple) else ((), bind)
  with eqn.ctx.manager:
    outs = eqn.primitive.bind(*subfuns, *ins, **params)
  return list(outs) if eqn.primitive.multiple_results else [outs]


def live_part(jaxpr: Any) -> Any:
  """``jaxpr`` without the equations its outputs do not depend on (JAX's
  dead-code elimination; every input is kept, so input positions hold)."""
  live, _ = _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars),
                          instantiate=[True] * len(jaxpr.invars))
  return live


# -- primitives and their parameters, for the program interpreter -------------


def primitive_named(name: str) -> Any:
  """JAX's primitive called ``name`` where ``jax.extend.core.primitives``
  exports it (``add`` -> ``add_p``, ``jit``, ``remat2`` -> ``remat_p``),
  else the name itself: a rule table (:mod:`gram_haiku._src.analysis.interpreter`)
  is keyed by the primitive object where this JAX names it publicly, by
  its name otherwise (``pvary``, ``shard_map``, a hijax primitive)."""
  table = _exported_primitives()
  return table.get(name, name)


@functools.lru_cache(maxsize=None)
def _exported_primitives() -> dict:
  from jax.extend.core import primitives  # pylint: disable=g-import-not-at-top
  out = {}
  for attr in dir(primitives):
    prim = getattr(primitives, attr)
    name = getattr(prim, "name", None)
    if attr.endswith("_p") and isinstance(name, str):
      out.setdefault(name, prim)
  return out


def rule_table(rules: dict) -> dict:
  """``rules`` (primitive name -> rule) keyed by primitive (see
  :func:`primitive_named`)."""
  return {primitive_named(name) if isinstance(name, str) else name: rule
          for name, rule in rules.items()}


def rule_of(table: dict, eqn: Any) -> Any:
  """The rule of ``eqn``'s primitive in a :func:`rule_table`, or None."""
  rule = table.get(eqn.primitive)
  if rule is None:  # (another primitive object of an exported name)
    rule = table.get(primitive_named(eqn.primitive.name))
  return rule


def scan_parts(eqn: Any) -> tuple[Any, int, int, int]:
  """``(body, num_consts, num_carry, length)`` of a ``scan`` equation; the
  body an open jaxpr."""
  n_consts, n_carry = scan_counts(eqn)
  return eqn.params["jaxpr"].jaxpr, n_consts, n_carry, eqn.params["length"]


def while_parts(eqn: Any) -> tuple[Any, int, Any, int]:
  """``(cond, cond_nconsts, body, body_nconsts)`` of a ``while``
  equation; both programs open jaxprs. Its operands are the condition's
  constants, the body's, then the carries."""
  p = eqn.params
  return (p["cond_jaxpr"].jaxpr, p["cond_nconsts"], p["body_jaxpr"].jaxpr,
          p["body_nconsts"])


def cond_branches(eqn: Any) -> list:
  """The branches (open jaxprs) of a ``cond`` equation, whose operands are
  the branch index, then the branches' operands."""
  return [b.jaxpr for b in eqn.params["branches"]]


def num_consts(eqn: Any) -> int:
  """The leading constant operands of a call (``custom_jvp_call``'s
  ``num_consts``; 0 where it has none)."""
  return eqn.params.get("num_consts", 0)
