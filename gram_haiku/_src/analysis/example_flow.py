"""Where the examples flow in a tracked loss's program.

A tracked layer's Gram is over the leading axis its op takes as the example
axis. That is only the Gram of per-example gradients if that axis of the
layer's input really holds the examples, one per row in the batch's order,
and if the loss is a sum of per-example terms. Sizes cannot tell (a sequence
of length ``T == B``, positions from ``jnp.arange``, an unbatched memory of
length ``B``); the program can. :func:`check` follows the example axis of the
batch through the traced loss (``jax.make_jaxpr``, after every ``vmap`` has
been batched) with a small abstract interpretation, a domain on the one
program interpreter (:mod:`gram_haiku._src.analysis.interpreter`, which runs the
programs, calls, loops and branches): this module holds the domain's step
per equation, its context, its log of findings (:class:`FlowLog`, read as a
:class:`FlowRecord`) and :func:`check`, the reader that turns the record
into errors; the states (``Ex``, ``CONST``, ``SUM``, ``MIXED``,
``UNKNOWN``) are :mod:`gram_haiku._src.analysis.flow_states`', the rules per
primitive :data:`gram_haiku._src.analysis.flow_rules.RULES`.

Each Gram op's input must be ``Ex`` at the op's example-axis position with
nothing merged into it; otherwise :func:`check` raises a teaching error.
Where the examples reach a tracked layer or the loss only through a
primitive without a rule, :func:`check` warns (:class:`ExampleFlowWarning`)
or, under ``strict``, raises.

What the analysis cannot show to be one example's is treated as coupling
the examples, never as safe:

* Loops. A ``while_loop``'s number of rounds is read from its condition
  (its constants and the carries, at the carries' fixed point). Where it
  depends on no example, the carries are the body's. Where the condition
  holds one predicate per example along an axis (a ``while_loop`` under
  ``vmap``: JAX runs it until every row stops, each row selected on its
  own predicate), a carry the body changes depends on its own example's
  rounds: it joins the predicate's state (``Ex`` where the carry holds the
  examples along the same axis, or did not depend on them). Otherwise (a
  batch-wide reduction, one example's entry, a count over the batch, a
  ``fori_loop`` bound computed from the data, anything ``UNKNOWN``) every
  carry the body changes is ``MIXED``. A carry the body hands on as it is
  keeps its state. Under ``strict`` a ``cond`` whose index is not constant
  makes every output ``MIXED``, constants chosen by it included.
* Closed-over arrays (``strict`` only: for a Gram, data of any example is
  a constant). A constant of the traced program (a NumPy or JAX array the
  loss closes over, or a tracer of an enclosing ``jit`` that enters as a
  constant) with an axis of the batch's size ``B`` holds rows of examples
  the program does not name. A float one (or one whose value is not known
  here) is data of unknown examples, ``MIXED``, from the start; an integer
  or boolean one whose value is known stays ``CONST`` (an index array:
  ``out[np.arange(B)]``, a fixed permutation, ``x[rows, labels]``'s row
  column, followed by value), noted ``CLOSED``, and becomes ``MIXED`` where
  it is used as anything else: cast to a float, met by the examples' or the
  parameters' values other than as an index picking rows along the
  examples' axis (``take_along_axis`` by closed-over labels reads each
  row's data), given to a tracked layer, or carried into a loop or branch.
  ``MIXED`` data then meets the parameters' values or a tracked layer and
  is refused (``CLOSED_OVER_BATCH_DATA``: pass the array as an argument of
  ``apply``, with ``example_axes=`` where its examples are, or None for a
  table that merely has ``B`` rows). Constants without an axis of size
  ``B`` (a weight-decay scalar, a fixed projection, per-class weights) and
  the model's own Haiku state (given to ``apply``) stay constants; with
  ``B == 1`` nothing can be another example's.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import jax
import numpy as np

from gram_haiku._src.analysis import const_eval
from gram_haiku._src.analysis import flow_rules
from gram_haiku._src.analysis import interpreter
from gram_haiku._src.analysis.flow_states import CLOSED
from gram_haiku._src.analysis.flow_states import CONST
from gram_haiku._src.analysis.flow_states import ELEMENTWISE as _ELEMENTWISE
from gram_haiku._src.analysis.flow_states import Ex
from gram_haiku._src.analysis.flow_states import join
from gram_haiku._src.analysis.flow_states import LINEAR as _LINEAR
from gram_haiku._src.analysis.flow_states import MIXED
from gram_haiku._src.analysis.flow_states import pick_rows as _pick_rows
from gram_haiku._src.analysis.flow_states import reordered as _reordered
from gram_haiku._src.analysis.flow_states import shape as _shape
from gram_haiku._src.analysis.flow_states import State
from gram_haiku._src.analysis.flow_states import SUM
from gram_haiku._src.analysis.flow_states import UNKNOWN
from gram_haiku._src.compat import hijax_compat as hx
from gram_haiku._src.core import errors
from gram_haiku._src.core import warning_site

__all__ = ["CONST", "Ex", "ExampleFlowWarning", "MIXED", "State", "SUM",
           "UNKNOWN", "check", "join"]


#: Custom-derivative calls whose backward rule is Python code.
_CUSTOM_VJP = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})

#: Constants of at most this many entries (index arrays) are told apart by
#: their contents; larger ones by identity.
_CONTENT_KEY_MAX = 1 << 16


def _used_as_index(eqn, ins) -> set:
  """The operands of ``eqn`` that it uses as an index picking rows along
  the examples' axis (``out[idx]``), placing rows (a scatter's known
  index: segments, permutations) or as a piece of such an index
  (``x[rows, cols]``'s columns)."""
  name = eqn.primitive.name
  if name == "gather" and _picks_rows(eqn, ins[0]) and (
      ins[1] != CONST or tuple(
          eqn.params["dimension_numbers"].start_index_map) == (ins[0].dim,)):
    return {1}
  if name.startswith("scatter") and len(ins) == 3 and isinstance(
      ins[2], Ex) and ins[2].tag is None:
    return {1}
  if (name == "concatenate" and
      eqn.params["dimension"] == len(_shape(eqn.outvars[0])) - 1 and
      not hx.may_carry_gradient(eqn.outvars[0])):
    return set(range(len(ins)))
  return set()


class ExampleFlowWarning(UserWarning):
  """The examples could not be followed to a tracked layer or the loss
  through a primitive this analysis does not model: the Gram is not
  verified there (see :func:`gram_haiku.verify`)."""




def _value_key(value: np.ndarray) -> tuple:
  """The origin of a known value: equal for equal contents."""
  return ("value", str(value.dtype), value.shape, value.tobytes())


def _user_line(eqn, ctx) -> str:
  """``" (at file:line)"``: the user's line that traced ``eqn``, where JAX
  kept its traceback (or, inside a library's jitted function, that of the
  call that holds it: :meth:`interpreter.Interpreter.line_of`); else ``""``."""
  return ctx.line_of(eqn)


def _operand_shapes(eqn) -> str:
  """``"(4, 3), (3,)"``: the shapes of an equation's operands."""
  return ", ".join(str(_shape(v)) for v in eqn.invars)


def _site(eqn, ctx) -> str:
  """An equation for a message: its primitive, its operands' shapes and
  the user's line that traced it (:func:`_user_line`)."""
  return (f"{eqn.primitive.name} (operands of shapes "
          f"{_operand_shapes(eqn)}){_user_line(eqn, ctx)}")


def _rows_paired(eqn, ins, deps) -> bool:
  """Whether a ``dot_general`` of the parameters' rows with data rows pairs
  each example's row with its own: the two example axes are a batch pair,
  or a contracting pair (a sum over examples of per-example products).
  Otherwise (``einsum('bf,cf->bc', out, y)``) every output meets every
  example's data."""
  lhs, rhs = ins
  if not (isinstance(lhs, Ex) and isinstance(rhs, Ex)) or deps[0] == deps[1]:
    return True
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  for left, right in ((lb, rb), (lc, rc)):
    if lhs.dim in left and rhs.dim in right and (
        list(left).index(lhs.dim) == list(right).index(rhs.dim)):
      return True
  return False


def _check_data_rows(eqn, ins, deps, param_rows, ctx) -> None:
  """Under ``strict``: raises where data rows meet the parameters' rows
  other than each example's with its own (data rows meeting them in the
  same order, both in the batch's or both reordered alike: ``out[::-1]``
  with ``y[::-1]``, pair each example's outputs with its own data)."""
  for s, d in zip(ins, deps):
    if d:
      continue
    if s in (MIXED, SUM) or (isinstance(s, Ex) and s.tag is None and (
        any((p.dim, p.inner, p.outer, p.order) !=
            (s.dim, s.inner, s.outer, s.order) for p in param_rows))):
      raise ValueError(errors.DATA_COUPLED.format(
          state="rows of other examples, or in another order",
          where=_site(eqn, ctx)))
  if eqn.primitive.name == "dot_general" and not _rows_paired(
      eqn, ins, deps):
    raise ValueError(errors.DATA_COUPLED.format(
        state="a product of every example's outputs with every "
        "example's data", where=_site(eqn, ctx)))


def _picks_rows(eqn, operand: State) -> bool:
  """Whether a ``gather`` picks rows of ``operand`` along its examples' axis
  by its index alone (``out[idx]``, ``x[rows, labels]``'s row column), not
  per row along another axis (``take_along_axis``: the index is then each
  row's data)."""
  if not (isinstance(operand, Ex) and operand.tag is None):
    return False
  dn = eqn.params["dimension_numbers"]
  return (operand.dim in dn.start_index_map and
          operand.dim not in getattr(dn, "operand_batching_dims", ()))


@dataclasses.dataclass(frozen=True)
class FlowRecord:
  """What one run of the example-flow analysis found, read by :func:`check`
  (:meth:`FlowLog.read`).

  Attributes:
    findings: per Gram op application, in program order (every round of a
      loop body), ``(op, state of its input)``; a candidate's tag is its
      index here.
    verdicts: candidate tag -> whether every meeting with the examples put
      them along its axis (absent: never met).
    combined: candidates whose rows were combined before meeting them.
    reordered: candidates whose rows were reordered before meeting them.
    looped_over_examples: a ``scan`` ran over the examples (``hk.scan``,
      ``hk.map`` over the batch).
    unknown: primitives without a rule that the examples met.
    paired_with_others: the first equation where reordered rows of the
      parameters' values met data rows in another order: ``(primitive,
      operand shapes, user line)``.
    split_examples: the first reshape that split the examples' rows in two
      ``(n, b, k, where)``.
    closed_shapes: the shapes of closed-over arrays with an axis of ``B``.
  """
  findings: tuple
  verdicts: Mapping[int, bool]
  combined: frozenset
  reordered: frozenset
  looped_over_examples: bool
  unknown: frozenset
  paired_with_others: Optional[tuple[str, str, str]]
  split_examples: Optional[tuple[int, int, int, str]]
  closed_shapes: tuple


class FlowLog:
  """The findings of one run, appended by the interpreter and its rules
  through typed methods (nothing is overwritten or removed); :meth:`read`
  gives the :class:`FlowRecord` that :func:`check` turns into errors."""

  def __init__(self):
    self._findings: list = []
    self._verdicts: list[tuple[int, bool]] = []
    self._combined: list[int] = []
    self._reordered: list[int] = []
    self._looped = False
    self._unknown: list[str] = []
    self._paired: list[tuple[str, str, str]] = []
    self._splits: list[tuple[int, int, int, str]] = []
    self._closed_shapes: list[tuple[int, ...]] = []

  def finding(self, op, state: State) -> None:
    """A Gram op application, with its input's state."""
    self._findings.append((op, state))

  def next_tag(self) -> int:
    """The tag of a candidate recorded by the next :meth:`finding`."""
    return len(self._findings)

  def verdict(self, tag: int, right: bool) -> None:
    """Candidate ``tag`` met the examples, along its axis or not."""
    self._verdicts.append((tag, bool(right)))

  def right_so_far(self, tag: int, default: bool = True) -> bool:
    """Whether every verdict on ``tag`` so far was right (``default`` if
    none)."""
    answers = [right for t, right in self._verdicts if t == tag]
    return all(answers) if answers else default

  def combined(self, tag: int) -> None:
    """Candidate ``tag``'s rows were combined before meeting the examples
    (settled as wrong)."""
    self.verdict(tag, False)
    self._combined.append(tag)

  def reordered(self, tag: int) -> None:
    self._reordered.append(tag)

  def looped_over_examples(self) -> None:
    self._looped = True

  @property
  def looped(self) -> bool:
    """Whether a ``scan`` ran over the examples so far."""
    return self._looped

  def unknown(self, primitive: str) -> None:
    self._unknown.append(primitive)

  def paired_with_others(self, site: tuple[str, str, str]) -> None:
    self._paired.append(site)

  def split(self, split: tuple[int, int, int, str]) -> None:
    self._splits.append(split)

  @property
  def split_examples(self) -> Optional[tuple[int, int, int, str]]:
    return self._splits[0] if self._splits else None

  def closed_shape(self, shape: tuple[int, ...]) -> None:
    if shape not in self._closed_shapes:
      self._closed_shapes.append(shape)

  def closed_shapes(self) -> tuple:
    return tuple(self._closed_shapes)

  def read(self) -> FlowRecord:
    verdicts: dict[int, bool] = {}
    for tag, right in self._verdicts:
      verdicts[tag] = verdicts.get(tag, True) and right
    return FlowRecord(
        findings=tuple(self._findings), verdicts=verdicts,
        combined=frozenset(self._combined),
        reordered=frozenset(self._reordered),
        looped_over_examples=self._looped, unknown=frozenset(self._unknown),
        paired_with_others=self._paired[0] if self._paired else None,
        split_examples=self.split_examples,
        closed_shapes=self.closed_shapes())


class _Verdicts:
  """``flow_states.join``'s ``verdicts`` mapping, written to a log."""

  def __init__(self, log: FlowLog):
    self._log = log

  def get(self, tag: int, default: bool = True) -> bool:
    return self._log.right_so_far(tag, default)

  def __setitem__(self, tag: int, right: bool) -> None:
    self._log.verdict(tag, right)


class _Val(NamedTuple):
  """What the interpreter holds per variable in this domain: its
  :data:`State`, whether it depends on the parameters (``dep``), and where
  a ``MIXED`` value's examples were first combined with the parameters'
  values (``site``: primitive, operand shapes, user line), for messages."""
  state: State
  dep: bool = False
  site: Optional[tuple] = None


class _Flow(interpreter.Interpreter):
  """The example-flow domain's context on the program interpreter (one per
  check): the batch size, ``strict``, the log of findings and the facts
  kept per variable and call site (constants' origins, notes, index
  pieces). The rules per primitive are :data:`flow_rules.RULES`, each given
  this object as its context; :func:`_equation` is the domain's step."""

  def __init__(self, batch: int, gram_op_type, strict: bool = False,
               consts: Optional[dict] = None, model_state=frozenset(),
               observed: Optional[dict] = None):
    domain = EXAMPLES
    if observed is not None:
      domain = dataclasses.replace(EXAMPLES, output=_observer(observed))
    super().__init__(domain, gram_op_type)
    self.observed = observed
    self.batch = batch
    self.model_state = model_state  # constants that are apply's own state
    self.strict = strict
    self.log = FlowLog()  # what the run finds (see FlowRecord)
    self.last_sites: Optional[list] = None  # of the last run's outputs
    # A constant's origin (see origin()), so that two gathers by equal
    # index arrays are known to pick the same rows.
    # Keyed by (run, id(variable)): a sub-program called twice (a jitted
    # helper) holds the same variable objects in both runs, which must not
    # share a key unless their values are equal by construction.
    self._origin: dict[tuple[Any, int], Any] = {}
    self.last_deps: list[bool] = []  # of the last run's outputs
    self.last_origins: list = []  # of the last run's outputs
    self.consts: dict[Any, Any] = dict(consts or {})
    self._in_rule = 0  # inside a custom JVP rule's program (_custom_jvp)
    self._deps: list[bool] = []  # the current equation's input dependences
    # Index arrays concatenated along their last axis (x[rows, cols]): per
    # (run, id(variable)), (state, variable, width) of each piece.
    self._pieces: dict[tuple[Any, int], list] = {}
    # Why a value may hold several examples' data, for messages (and, for
    # CLOSED, which integer constants are closed-over batch data): per
    # (run, id(variable)), a set of CLOSED and ("loop", site) notes,
    # carried forward to everything computed from the value.
    self._notes: dict[tuple[Any, int], frozenset] = {}

  def join(self, a: State, b: State) -> State:
    return join(a, b, _Verdicts(self.log))

  def origin(self, v, site: Any = None) -> Any:
    """A key equal for two variables that hold the same values by
    construction: a small constant by its contents, a constant computed
    from such by its computation (:meth:`_constant_origin`); else ``v``'s
    own."""
    if isinstance(v, hx.Literal):
      return _value_key(np.asarray(v.val, v.aval.dtype))
    key = (self.site if site is None else site, id(v))
    if key not in self._origin and v in self.consts:
      value = self.consts[v]
      # (A constant of this trace may be a value of an enclosing one.)
      if (not isinstance(value, jax.core.Tracer) and
          np.size(value) <= _CONTENT_KEY_MAX):
        try:
          self._origin[key] = _value_key(np.asarray(value))
        except TypeError:  # (a PRNG key array: told apart by identity)
          pass
    return self._origin.get(key, key)

  def _value_of(self, v) -> Optional[np.ndarray]:
    """``v``'s value where its origin holds it (a small constant, or one
    computed from such by :mod:`const_eval`); else None."""
    origin = self.origin(v)
    if not (isinstance(origin, tuple) and origin and origin[0] == "value"):
      return None
    _, dtype, shape, data = origin
    try:
      dtype = np.dtype(dtype)
    except TypeError:  # (a dtype NumPy does not name: not an index)
      return None
    if dtype.kind not in "iub":
      return None
    return np.frombuffer(data, dtype=dtype).reshape(shape)

  def eqn_key(self, eqn) -> tuple[Any, int]:
    """A key of one equation in this run (see ``_origin``): the
    interpreter's per-call-site key."""
    return self.key(eqn)

  def _constant_origin(self, eqn) -> Any:
    """The origin of a constant equation's one output: the primitive, its
    parameters and its inputs' origins (a literal by its value). Equal
    origins hold equal values: the same computation of equal inputs. None
    (the output's own) for a call of a sub-program."""
    if len(eqn.outvars) != 1 or hx.jaxprs_of(eqn):
      return None
    values = [self._value_of(v) for v in eqn.invars]
    if all(v is not None for v in values):
      # Equal values however they were computed (a NumPy index array is
      # normalised when traced, a jnp one in the program).
      out = const_eval.evaluate(eqn.primitive.name, eqn.params, values,
                                eqn.outvars[0].aval.dtype)
      if out is not None:
        return _value_key(out)
    ins = tuple(self.origin(v) for v in eqn.invars)
    params = tuple(sorted((k, repr(p)) for k, p in eqn.params.items()))
    return ("eqn", eqn.primitive.name, params, ins)

  def follow(self, jaxpr, ins: Sequence[State],
             deps: Optional[Sequence[bool]] = None,
             origins: Optional[Sequence[int]] = None,
             site: Any = None) -> list[State]:
    """Abstract states of ``jaxpr``'s outputs (the interpreter runs it;
    :func:`_equation` is each equation's step).

    ``deps``: per input, whether it depends on the parameters. A sum over,
    or a mix of, the examples that does not (a statistic of the input data:
    centring by the batch mean) is input data for every example's gradient
    and is treated as a constant; one that does couples the examples.
    ``origins``: the inputs' origins (:meth:`origin`). ``site``: the calling
    equation's key (:meth:`eqn_key`), so that a helper called from two
    places runs under two keys, and a loop body's rounds (one call site)
    under one; None for a program of its own (a fresh key).
    """
    if site is None:
      self._runs += 1
      site = ("run", self._runs)
    deps = list(deps) if deps is not None else [True] * len(ins)
    for v, o in zip(jaxpr.invars, origins or ()):
      self._origin[(site, id(v))] = o
    if self.observed is not None:  # (a loop body's: its last round's)
      path = self.call_path(site)
      for v, s in zip(jaxpr.invars, ins):
        if (path, v) in self.observed:
          self.observed[(path, v)] = s
    outs = self.run(jaxpr, [_Val(s, d) for s, d in zip(ins, deps)], site)
    self.last_deps = [o.dep for o in outs]
    self.last_origins = [self.origin(v, site) for v in jaxpr.outvars]
    self.last_sites = [o.site for o in outs]
    return [o.state for o in outs]

  def _inputs(self, eqn, vals: list) -> tuple[list, list, list]:
    """``(states, deps, notes)`` of an equation's operands, as its rules
    see them: closed-over integers used as data are ``MIXED``; data of
    several examples are constants (outside ``strict``).

    Raises:
      ValueError: under ``strict``, data of several examples met by the
        parameters' values or a Gram op.
    """
    in_deps = [v.dep for v in vals]
    notes = [self.notes_of(v) for v in eqn.invars] if self._notes else []
    ins = [v.state for v in vals]
    if any(CLOSED in n for n in notes):
      ins = self._closed_as_data(eqn, ins, in_deps, notes)
    for k, (s, d) in enumerate(zip(ins, in_deps)):
      if s in (SUM, MIXED) and not d:
        if not self.strict:
          s = CONST  # Data of several examples: input data (see above).
        elif any(in_deps) or hx.gram_op_of(eqn, self.gram_op_type):
          raise ValueError(self._data_coupled_message(
              eqn, notes[k] if notes else frozenset()))
      ins[k] = s
    return ins, in_deps, notes

  def _with_notes(self, eqn, ins, outs, notes) -> list[State]:
    """``outs`` with the operands' notes carried to the outputs; closed-over
    integers turned into values (a cast to float, a one-hot, a mean) are
    data of unknown examples."""
    if not any(notes):
      return outs
    carried = frozenset().union(*notes)
    for v in eqn.outvars:
      self._add_notes(v, carried)
    if any(CLOSED in n for n in notes) and all(s == CONST for s in ins):
      outs = [MIXED if s == CONST and hx.may_carry_gradient(v) else s
              for v, s in zip(eqn.outvars, outs)]
    return outs

  def _note_unknown(self, eqn, ins, outs) -> None:
    if (UNKNOWN in outs and UNKNOWN not in ins and
        (not hx.jaxprs_of(eqn) or
         hx.rule_of(flow_rules.RULES, eqn) is not None)):
      self.log.unknown(eqn.primitive.name)

  # -- closed-over arrays (see the module docstring) ---------------------------

  def user_line(self, eqn) -> str:
    """``" (at file:line)"`` for ``eqn`` (see :func:`_user_line`)."""
    return _user_line(eqn, self)

  def notes_of(self, v) -> frozenset:
    """The notes (``_notes``) of variable ``v`` in the current run."""
    if isinstance(v, hx.Literal):
      return frozenset()
    return self._notes.get((self.site, id(v)), frozenset())

  def _add_notes(self, v, notes: frozenset, run: Any = None) -> None:
    if notes:
      key = (self.site if run is None else run, id(v))
      self._notes[key] = self._notes.get(key, frozenset()) | notes

  def notes_into(self, sub_invars, invars, site) -> None:
    """The notes of a call's operands ``invars``, given to the called
    program's inputs ``sub_invars`` (run under ``site``)."""
    if self._notes:
      for sv, v in zip(sub_invars, invars):
        self._add_notes(sv, self.notes_of(v), run=site)

  def _closed_over(self, v) -> State:
    """The state of a program constant ``v`` (a closed-over array).

    Outside ``strict``, a constant (data are constants for the Gram). Under
    ``strict`` (a privacy guarantee), one with an axis of the batch's size
    holds rows of examples the program does not name: a float array (or
    one whose value is not known here, a tracer of an enclosing ``jit``) is
    data of unknown examples (``MIXED``); an integer or boolean array whose
    value is known stays a constant (an index array: rows picked by it are
    followed by value), noted ``CLOSED``, and becomes data of unknown
    examples where it is used as anything but an index picking rows
    (:meth:`_closed_as_data`)."""
    shape = _shape(v)
    if (not self.strict or self.batch <= 1 or self.batch not in shape or
        v in self.model_state):
      return CONST
    self._add_notes(v, frozenset({CLOSED}))
    self.log.closed_shape(shape)
    value = self.consts.get(v)
    dtype = getattr(v.aval, "dtype", None)
    index_like = dtype is not None and (
        jax.numpy.issubdtype(dtype, jax.numpy.integer) or
        jax.numpy.issubdtype(dtype, jax.numpy.bool_))
    if (index_like and value is not None and
        not isinstance(value, jax.core.Tracer)):
      return CONST
    return MIXED

  def _closed_as_data(self, eqn, ins, deps, notes) -> list[State]:
    """``ins`` with the closed-over integer constants (``CLOSED``, still
    ``CONST``) that ``eqn`` uses as data made ``MIXED``: where they meet
    the examples' or the parameters' values (or a Gram op) other than as
    an index that picks rows along the examples' axis (``out[idx]``; the
    rows are then followed by value) or a piece of such an index
    (``x[rows, labels]``), or enter a loop or branch (not followed
    inside). A call's program gets their notes (:meth:`_call`); a
    computation of constants alone keeps them constant."""
    closed = [CLOSED in n and s == CONST for n, s in zip(notes, ins)]
    name = eqn.primitive.name
    subs = hx.jaxprs_of(eqn)
    if subs and name not in ("scan", "while", "cond"):
      return ins  # followed inside (notes_into)
    meets = (any(s != CONST for s in ins) or any(deps) or
             hx.gram_op_of(eqn, self.gram_op_type) is not None)
    if not meets and not subs:
      return ins
    keep = _used_as_index(eqn, ins)
    return [MIXED if c and k not in keep else s
            for k, (s, c) in enumerate(zip(ins, closed))]

  def _data_coupled_message(self, eqn, notes: frozenset) -> str:
    """The strict refusal at ``eqn`` of a data input with ``notes``."""
    if CLOSED in notes:
      message = errors.CLOSED_OVER_BATCH_DATA.format(
          batch=self.batch, shapes=", ".join(map(str, self.log.closed_shapes())),
          where=_site(eqn, self))
    else:
      message = errors.DATA_COUPLED.format(
          state="a value computed from several examples' data",
          where=_site(eqn, self))
    loops = sorted(n[1] for n in notes if isinstance(n, tuple))
    if loops:
      message += errors.LOOP_TRIP_COUPLED.format(where=", ".join(loops))
    if self.log.looped:
      message += errors.LOOPED_OVER_EXAMPLES
    return message

  def _combined_sites(self, eqn, vals, ins, outs) -> list:
    """Where the MIXED outputs of ``eqn`` were combined (None for the
    others): where a MIXED input was, else inside its sub-program
    (``last_sites``), else here."""
    mixed = [(v, val.site) for v, val, s in zip(eqn.invars, vals, ins)
             if s == MIXED and val.site is not None]
    # A float operand's combination first (a median's sort, not its NaN
    # check's reduce_or).
    mixed.sort(key=lambda m: not hx.may_carry_gradient(m[0]))
    inherited = mixed[0][1] if mixed else None
    inner = self.last_sites if hx.jaxprs_of(eqn) else None
    here = None  # (read from the traceback only where it is the answer)
    sites = []
    for k, s in enumerate(outs):
      site = None
      if s == MIXED:
        sub = inner[k] if inner and k < len(inner) else None
        if not (inherited or sub) and here is None:
          here = (eqn.primitive.name, _operand_shapes(eqn),
                  _user_line(eqn, self))
        site = inherited or sub or here
      sites.append(site)
    return sites

  # -- one equation -------------------------------------------------------------

  def transfer(self, eqn, ins: list[State], deps: list[bool]
               ) -> list[State]:
    """The states of one equation's outputs, from its operands' (as
    :meth:`_inputs` gives them): a Gram op's, a rule's, an elementwise
    primitive's, a call's."""
    n_out = len(eqn.outvars)
    op = hx.gram_op_of(eqn, self.gram_op_type)
    if op is not None:
      return [self._gram_op(op, ins[0])] * n_out
    if all(s == CONST for s in ins) and not hx.jaxprs_of(eqn):
      return [CONST] * n_out
    name = eqn.primitive.name
    rule = hx.rule_of(flow_rules.RULES, eqn)
    self._deps = deps
    self.consts.update(hx.closed_consts_of(eqn))
    if name in _ELEMENTWISE:
      ins = self._implicit_broadcasts(eqn, ins)
    if name in _ELEMENTWISE or name in ("dot_general", "concatenate"):
      ins = self._data_as_constant(eqn, ins, deps)
    if rule is not None:
      return rule(self, eqn, ins)
    if name in _ELEMENTWISE:
      return [self._elementwise(name, ins)] * n_out
    subs = hx.jaxprs_of(eqn)
    if subs and name not in ("scan", "while", "cond"):
      return self._through_call(eqn, subs, ins, deps)
    if MIXED in ins:
      return [MIXED] * n_out
    return [UNKNOWN] * n_out

  def _gram_op(self, op, x: State) -> State:
    """A Gram op application with input state ``x``: recorded (a candidate
    where ``x`` does not depend on the examples); its output's state."""
    if x == CONST:  # A candidate: settled where it meets the examples.
      x = Ex(op.example_axis.resolved_position() or 0,
             tag=self.log.next_tag())
    self.log.finding(op, x)
    lead = len(op.lead_shape(op.x_aval.shape))
    return x if not isinstance(x, Ex) or x.dim < lead else UNKNOWN

  def _through_call(self, eqn, subs, ins, deps) -> list[State]:
    """A call's outputs (:meth:`_call`), with a custom derivative's own
    rule followed (``custom_jvp``) or not taken on trust (``custom_vjp``)."""
    name = eqn.primitive.name
    outs = self._call(eqn, subs, ins, deps)
    if name == "custom_jvp_call" and not self._in_rule:
      outs = self._custom_jvp(eqn, ins, deps, outs)
    elif (name in _CUSTOM_VJP and not self._in_rule and any(deps) and
          any(isinstance(a, Ex) for a in ins)):
      # Its backward rule is a Python function, not a program here: what
      # it does with the examples' cotangents is not known.
      self.log.unknown(name)
      outs = [UNKNOWN if isinstance(o, Ex) else o for o in outs]
    return outs

  def _call(self, eqn, subs, ins, deps) -> list[State]:
    """A call of sub-programs on the equation's own operands (``jit``,
    ``remat``, a custom derivative's forward program): their outputs'
    states, joined over the sub-programs."""
    n_out = len(eqn.outvars)
    outs = None
    for sub in subs:
      if len(sub.invars) != len(ins):
        self.log.unknown(eqn.primitive.name)  # Operands not its body's.
        return [UNKNOWN] * n_out
      self.notes_into(sub.invars, eqn.invars, self.eqn_key(eqn))
      res = self.follow(sub, ins, deps, [self.origin(v) for v in eqn.invars],
                        site=self.eqn_key(eqn))
      if len(subs) == 1:  # (a jit call: its known values are the caller's)
        for v, o in zip(eqn.outvars, self.last_origins):
          if isinstance(o, tuple) and o and o[0] == "value":
            self._origin[(self.site, id(v))] = o
      if len(res) != n_out:
        self.log.unknown(eqn.primitive.name)
        return [UNKNOWN] * n_out
      outs = (res if outs is None else
              [self.join(a, b) for a, b in zip(outs, res)])
    return outs

  def _custom_jvp(self, eqn, ins, deps, outs) -> list[State]:
    """``outs`` (the forward program's) joined with the tangents of the
    function's own JVP rule, which is what differentiation runs: a rule
    that mixes the examples' tangents (a neighbour's row added) mixes their
    gradients, whatever the forward program does. Where the rule cannot
    be read, the outputs that carry examples are unknown."""
    rule = hx.custom_jvp_rule(eqn)
    if rule is None:
      if any(isinstance(s, Ex) for s in ins):
        self.log.unknown(eqn.primitive.name)
        return [UNKNOWN if isinstance(s, Ex) else s for s in outs]
      return outs
    jaxpr, consts, out_zeros = rule
    self.consts.update(zip(jaxpr.constvars, consts))
    k = eqn.params.get("num_consts", 0)
    primals, primal_deps = list(ins[k:]), list(deps[k:])
    # Inside a JVP rule a custom-derivative call computes values only (its
    # own rule is a second derivative's): its forward program is followed.
    n_primals = len(eqn.invars) - k
    self.notes_into(jaxpr.invars[:n_primals], eqn.invars[k:],
                    self.eqn_key(eqn))
    self.notes_into(jaxpr.invars[n_primals:], eqn.invars[k:],
                    self.eqn_key(eqn))
    self._in_rule += 1
    try:
      res = self.follow(jaxpr, primals + primals, primal_deps + primal_deps,
                     [self.origin(v) for v in eqn.invars[k:]] * 2,
                     site=self.eqn_key(eqn))
    finally:
      self._in_rule -= 1
    tangents = iter(res[len(out_zeros):])
    return [out if zero else self.join(out, next(tangents, UNKNOWN))
            for out, zero in zip(outs, out_zeros)]

  def _reorder(self, s: Ex, key) -> State:
    """``s`` with its rows reordered or subset (``key``). For a candidate
    (``s.tag``) that settles it as wrong: its layer's row ``i`` would then
    meet another example than ``i``."""
    if s.tag is not None:
      self.log.reordered(s.tag)
      return self._combined(s, CONST)
    return _reordered(s, key)

  def _pick(self, s: Ex, positions, size: int) -> State:
    """``s`` with the rows at ``positions`` of its ``size`` kept, in that
    order (:func:`~gram_haiku._src.analysis.flow_states.pick_rows`); a candidate is
    settled as wrong, as by :meth:`_reorder`."""
    if s.tag is not None:
      self.log.reordered(s.tag)
      return self._combined(s, CONST)
    return _pick_rows(s, positions, size, self.batch)

  def _implicit_broadcasts(self, eqn, ins):
    """Elementwise operands whose length-1 axes are broadcast to the
    output's (``lax.mul`` of ``[B, F]`` and ``[1, F]``): along the examples'
    axis that is :meth:`_broadcast_in_dim`'s repeat of one row."""
    out_shape = _shape(eqn.outvars[0])
    fixed = []
    for v, s in zip(eqn.invars, ins):
      shape = _shape(v)
      if (isinstance(s, Ex) and len(shape) == len(out_shape) and
          shape[s.dim] != out_shape[s.dim]):
        s = self._reorder(s, ("broadcast", self.eqn_key(eqn)))
      fixed.append(s)
    return fixed

  def _data_as_constant(self, eqn, ins, deps):
    """Input data met by values of the parameters: constant for them.

    In ``(out - y) ** 2`` the labels ``y`` do not couple the examples'
    gradients, whatever their rows: only values that depend on the
    parameters do. (A candidate, ``Ex.tag``, still needs to meet the data
    to be settled.) Under ``strict`` (a privacy guarantee: each example's
    gradient may depend on its own data only) data that mixes the examples,
    or meets the parameters' rows in another order, is an error here.

    Rows of the parameters' values taken out of the batch's order (a
    reversal, rows picked by index) that meet data rows in another order
    pair one example's outputs with another example's data
    (``(out[::-1] - y) ** 2``): which example such a term belongs to is not
    defined, so that is refused too.
    """
    param_rows = [s for s, d in zip(ins, deps)
                  if isinstance(s, Ex) and s.tag is None and d]
    if not param_rows:
      return ins
    for s, d in zip(ins, deps):
      if d or not isinstance(s, Ex) or s.tag is not None:
        continue
      for p in param_rows:
        if (p.dim, p.inner, p.outer) == (s.dim, s.inner, s.outer):
          self.check_pairing(eqn, p.order, s.order, strict=False)
    if self.strict:
      _check_data_rows(eqn, ins, deps, param_rows, self)
    return [CONST if isinstance(s, Ex) and not d else s
            for s, d in zip(ins, deps)]

  def check_pairing(self, eqn, param_order, data_order, strict=True):
    """Rows of the parameters' values (in ``param_order``) meeting data rows
    (in ``data_order``) in one equation: reordered outputs met by data in
    another order pair one example's outputs with another example's data,
    which is recorded (``paired_with_others``, refused after the pass);
    under ``strict`` (and ``strict=True`` here) any other order than the
    outputs' own is an error at once."""
    if param_order is not None and param_order != data_order:
      self.log.paired_with_others((eqn.primitive.name, _operand_shapes(eqn),
                                   _user_line(eqn, self)))
    if strict and self.strict and param_order != data_order:
      raise ValueError(errors.DATA_COUPLED.format(
          state="rows of other examples, or in another order",
          where=_site(eqn, self)))

  def index_columns(self, v, n: int):
    """Per column of the index array ``v`` (its last axis, ``n`` wide): its
    state and, where known on the host, its value (without that axis).
    None where the columns cannot be told apart (not one column, and not
    a concatenation along the last axis, as ``x[rows, cols]`` makes)."""
    value = self._value_of(v)
    if value is not None:
      return [(CONST, value[..., j]) for j in range(n)]
    pieces = self._pieces.get((self.site, id(v)))
    if pieces is None:
      return None
    cols = []
    for state, var, width in pieces:
      piece = self._value_of(var)
      for j in range(width):
        cols.append((state, None if piece is None else piece[..., j]))
    return cols if len(cols) == n else None

  def _elementwise(self, name, ins):
    states = [s for s in ins if s != CONST]
    if not states:
      return CONST
    if SUM not in states:
      out = states[0]
      for s in states[1:]:
        out = self.join(out, s)
      return out
    others = [s for s in states if s != SUM]
    if MIXED in others:
      return MIXED
    if UNKNOWN in others:
      return UNKNOWN
    if others:  # A sum over the examples meets one example's values.
      return MIXED
    if name in _LINEAR:  # sums and constants, added: still a sum
      return SUM
    if len(states) == 1 and (name == "mul" or (name == "div" and
                                               ins[0] == SUM)):
      return SUM  # a sum scaled by a constant
    return MIXED  # a nonlinear function of a sum over the examples

  def _combined(self, s: Ex, state: State) -> State:
    """``state``, for rows of ``s`` combined with each other (a sum, a
    maximum, a contraction over the axis). For a candidate (``s.tag``) that
    settles it as wrong: the rows its layer took for examples were merged
    before meeting any, so its parameters' per-example gradients flow
    through a value every example shares, which no row of that layer
    holds. What is left does not depend on the examples."""
    if s.tag is None:
      return state
    self.log.combined(s.tag)
    return CONST


def _equation(flow: _Flow, eqn, vals: list) -> list:
  """The example-flow domain's step (:attr:`interpreter.Domain.equation`):
  one equation's output values from its operands'."""
  ins, in_deps, notes = flow._inputs(eqn, vals)  # pylint: disable=protected-access
  for v in eqn.outvars:  # (what an earlier round of a loop left)
    flow._origin.pop((flow.site, id(v)), None)  # pylint: disable=protected-access
  flow.last_sites = None  # (set by a sub-program's run)
  outs = flow.transfer(eqn, ins, in_deps)
  outs = flow._with_notes(eqn, ins, outs, notes)  # pylint: disable=protected-access
  sites = [None] * len(outs)
  if MIXED in outs and any(in_deps):
    sites = flow._combined_sites(eqn, vals, ins, outs)  # pylint: disable=protected-access
  if all(s == CONST for s in ins):
    origin = flow._constant_origin(eqn)  # pylint: disable=protected-access
    if origin is not None:
      flow._origin[(flow.site, id(eqn.outvars[0]))] = origin  # pylint: disable=protected-access
  flow._note_unknown(eqn, ins, outs)  # pylint: disable=protected-access
  # What the user stops the gradient of is a constant for differentiation,
  # like input data (an explicit opt-in: a comparison or count of the
  # parameters' values still couples the examples).
  out_dep = eqn.primitive.name != "stop_gradient" and (
      any(in_deps) or hx.gram_op_of(eqn, flow.gram_op_type) is not None)
  return [_Val(s, out_dep, site) for s, site in zip(outs, sites)]


def _join_vals(a: _Val, b: _Val) -> _Val:
  """Two values' join (candidates are settled by :meth:`_Flow.join`, which
  the rules use; the interpreter joins none in this domain)."""
  return _Val(join(a.state, b.state), a.dep or b.dep, a.site or b.site)


def _observer(observed: dict):
  """A domain ``output`` hook that records the states of the equations'
  output variables ``v`` whose ``(call path, v)`` (the ids of the calls
  they are inside, :meth:`Interpreter.call_path`) are keys of
  ``observed``."""
  def output(ctx, v, val):
    key = (ctx.call_path(), v)
    if key in observed:
      observed[key] = val.state
    return val
  return output


#: Where the examples flow: states per value (:mod:`flow_states`), rules
#: per primitive (:data:`flow_rules.RULES`), each equation through
#: :func:`_equation`.
EXAMPLES = interpreter.Domain(
    name="examples", rules=flow_rules.RULES, default=None, join=_join_vals,
    bottom=_Val(CONST),
    constant=lambda flow, v: _Val(flow._closed_over(v)),  # pylint: disable=protected-access
    equation=_equation)


def _views_hint(record: FlowRecord) -> str:
  """VIEWS_SPLIT_BY_RESHAPE where a reshape split the examples' rows."""
  if record.split_examples is None:
    return ""
  n, b, k, where = record.split_examples
  return errors.VIEWS_SPLIT_BY_RESHAPE.format(n=n, b=b, k=k, where=where)


def _candidate_found(record: FlowRecord, op, tag: int, batch: int) -> str:
  """How a candidate (a layer input that does not depend on the examples)
  was settled as wrong, for EXAMPLE_AXIS_NOT_EXAMPLES."""
  if record.looped_over_examples and op.example_size() == 1:
    return (f"holds {op.example_size()} row(s) of a loop over the "
            f"examples (hk.scan or hk.map over the batch, one "
            f"example per step), not the batch's {batch} examples")
  if tag in record.reordered:
    return ("does not depend on the examples, and its output's rows "
            "along that axis are reordered, repeated or subset (a "
            "reversal, a roll, rows picked by index, one row "
            "broadcast to the batch) before they "
            "meet them, so no row can be told to be one example's "
            "(where a later step puts the rows back in order, the "
            "layer between sees them in another order: reorder the "
            "data instead)")
  if tag in record.combined:
    return ("does not depend on the examples, and its output is "
            "summed, reduced or contracted over that axis before it "
            "meets them")
  return ("does not depend on the examples, and its output meets "
          "them along another axis")


def _check_candidate(record: FlowRecord, op, state: Ex, module: str,
                     batch: int) -> tuple[bool, bool, bool]:
  """A candidate's finding: ``(verified, unfollowed, done)``; ``done`` when
  nothing else is to be checked (a shared input broadcast along the
  examples, or one they never met).

  Raises:
    ValueError: a candidate settled as wrong (EXAMPLE_AXIS_NOT_EXAMPLES).
  """
  position = op.example_axis.resolved_position()
  if not record.verdicts.get(state.tag, True):
    raise ValueError(errors.EXAMPLE_AXIS_NOT_EXAMPLES.format(
        module=module, shape=tuple(op.x_aval.shape), position=position,
        found=_candidate_found(record, op, state.tag, batch)))
  met = state.tag in record.verdicts
  # (Met the examples only past the unknown: not followed.)
  unfollowed = not met and bool(record.unknown)
  done = (state.dim, state.order, state.inner, state.outer) == (
      position, None, 1, 1)
  # Otherwise computed from another layer's candidate (a closed-over input
  # whose rows were taken as the examples) but moved off this op's example
  # axis on the way (time-major with T == B): the caller's checks say how.
  return met, unfollowed, done


def _check_axis(op, state: Ex, module: str, batch: int, single: bool) -> None:
  """Raises unless ``state`` holds the examples alone, in order, along the
  op's example axis, all ``batch`` of them."""
  position = op.example_axis.resolved_position()
  shape = tuple(op.x_aval.shape)
  if state.order is not None and not single:
    raise ValueError(errors.EXAMPLES_REORDERED.format(module=module,
                                                      shape=shape))
  if state.dim != position:
    raise ValueError(errors.EXAMPLE_AXIS_NOT_EXAMPLES.format(
        module=module, shape=shape, position=position,
        found=f"holds the examples along axis {state.dim}"))
  if state.inner != 1 or state.outer != 1:
    raise ValueError(errors.EXAMPLES_MERGED.format(
        module=module, shape=shape, position=position, inner=state.inner,
        outer=state.outer))
  if state.tag is None and op.example_size() != batch:
    raise ValueError(errors.EXAMPLES_SUBSET.format(
        module=module, shape=shape, size=op.example_size(), batch=batch))


def _check_finding(record: FlowRecord, op, state: State, module: str,
                   batch: int) -> tuple[bool, bool]:
  """One Gram op's input: ``(verified, unfollowed)``.

  Raises:
    ValueError: see :func:`check`.
  """
  if state == UNKNOWN:
    return False, True
  verified, unfollowed = True, False
  if isinstance(state, Ex) and state.tag is not None:
    verified, unfollowed, done = _check_candidate(record, op, state, module,
                                                  batch)
    if done:
      return verified, unfollowed
  if state in (MIXED, SUM):
    if batch == 1 and op.example_size() == 1:
      return False, unfollowed  # Exact all the same; its axis not followed.
    raise ValueError(errors.EXAMPLES_COUPLED.format(
        module=module, shape=tuple(op.x_aval.shape)) + _views_hint(record))
  _check_axis(op, state, module, batch, batch == 1)
  return verified, unfollowed


def _check_loss(flow: "_Flow", outs: list, record: FlowRecord,
                single: bool) -> None:
  """Raises where the loss is not a sum of per-example terms, or pairs
  reordered outputs with other examples' data."""
  if outs and outs[0] == MIXED and flow.last_deps[0] and not single:
    primitive, shapes, line = flow.last_sites[0] or ("(not recorded)", "",
                                                     "")
    raise ValueError(errors.LOSS_COUPLED.format(
        primitive=primitive, shapes=shapes, line=line) + (
            _views_hint(record) if primitive == "reshape" else "") + (
                errors.LOOPED_OVER_EXAMPLES if record.looped_over_examples
                else ""))
  if record.paired_with_others is not None and not single:
    primitive, shapes, line = record.paired_with_others
    raise ValueError(errors.REORDERED_ROWS_MEET_DATA.format(
        primitive=primitive, shapes=shapes, line=line))


def _not_followed(record: FlowRecord, unfollowed: list, strict: bool):
  """Warns (raises under ``strict``) that the examples could not be
  followed to the ``unfollowed`` modules (or the loss)."""
  message = errors.EXAMPLES_NOT_FOLLOWED.format(
      primitives=", ".join(sorted(record.unknown)) or "(none recorded)",
      where=", ".join(dict.fromkeys(unfollowed)))
  if strict:
    raise ValueError(message + errors.EXAMPLES_NOT_FOLLOWED_PRIVACY)
  warnings.warn(message, ExampleFlowWarning,
                stacklevel=warning_site.user_stacklevel())


def check(jaxpr, in_states: Sequence[State], batch: int,
          gram_op_type, strict: bool = False, consts: Optional[dict] = None,
          model_state=frozenset(), observed: Optional[dict] = None) -> bool:
  """Raises a teaching error where the examples do not flow as a Gram needs.

  Args:
    jaxpr: the traced loss (its live part).
    in_states: one state per input of the jaxpr (``Ex(0)`` for the batch's
      arrays, ``CONST`` for parameters, probes and state).
    batch: ``B``.
    gram_op_type: the base class of Gram ops.
    strict: also refuse data of other examples meeting an example's
      parameter-dependent values (a privacy guarantee needs each example's
      gradient to depend on its own data only; a Gram does not).
    consts: the program's constants, by constant variable (rows picked by
      equal index arrays are then known to be the same rows).
    model_state: the constant variables that hold the model's Haiku state
      (given to ``apply``, closed over by the traced loss): not data the
      user closed over (see :meth:`_Flow._closed_over`).
    observed: ``{(call path, variable): None}``: the variables (the
      inputs or the equations' outputs of the program, path ``()``, or of
      the programs of the call, branch or loop equations with those ids;
      a loop body's as its carries' fixed point has them) whose states
      are written into it
      (the sites of program-level rules,
      :mod:`gram_haiku._src.analysis.program_rules`).

  Returns:
    True when the examples were followed to every Gram op's example axis
    (nothing unknown on the way), False when some could not be.

  Raises:
    ValueError: a tracked layer whose input does not carry the examples
      along its example axis (``EXAMPLE_AXIS_NOT_EXAMPLES``), merges them
      with other positions (``EXAMPLES_MERGED``) or mixes them
      (``EXAMPLES_COUPLED``); or a loss that is not a sum of per-example
      terms (``LOSS_COUPLED``).
  """
  if batch == 0:
    return False  # No examples: every Gram is empty.
  # One example: nothing can couple, reorder or pair it with another, so
  # only the axes are checked (a batch of one is what JAX emits size-1
  # special cases for: take_along_axis then gathers without batching
  # dimensions, which would read as mixing the examples).
  single = batch == 1
  flow = _Flow(batch, gram_op_type, strict, consts, model_state, observed)
  for v, s in zip(jaxpr.invars, in_states):  # (the program's inputs too)
    if observed is not None and ((), v) in observed:
      observed[((), v)] = s
  deps = [s == CONST for s in in_states]  # parameters, probes: not data
  outs = flow.follow(jaxpr, list(in_states), deps)
  record = flow.log.read()
  verified = True
  unfollowed = []  # modules the examples could not be followed to
  for op, state in record.findings:
    module = op.name
    ok, lost = _check_finding(record, op, state, module, batch)
    verified = verified and ok
    if lost:
      unfollowed.append(module)
  _check_loss(flow, outs, record, single)
  if outs and outs[0] == UNKNOWN and flow.last_deps[0]:
    unfollowed.append("the loss")
  if unfollowed:
    _not_followed(record, unfollowed, strict)
  return verified and bool(record.findings)
