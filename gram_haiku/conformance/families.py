"""The check families, in one registry that every runner iterates.

A :class:`Check` is one check function and the cases it runs on; its
``family`` is the row of the summary table it reports to (a family may hold
several checks: ``vmap`` is the ``vmap`` depth invariance and the example
axis selection). The pytest plugin's test module
(:mod:`gram_haiku.conformance.test_conformance`) makes one test per check,
parametrised over its cases, and the ``absltest`` mixin
(:class:`gram_haiku.conformance.testing.GramOpTestMixin`) one test method
per check, a ``subTest`` per case: a family added here runs under both,
and gets its row in the table.

Your own family: register a check at the top level of a module that is
imported before the suite collects (the ``conftest.py`` that registers your
ops, or a module named by ``--conformance-modules``)::

    from gram_haiku import conformance

    def check_output_is_finite(spec, scale):
      ...  # raise AssertionError on failure (NotApplicable to skip)

    conformance.register_check(conformance.Check(
        name="output_is_finite", family="finite", run=check_output_is_finite,
        params=("scale",), cases=[conformance.Case("small", (1e-3,)),
                                  conformance.Case("large", (1e3,))]))

Then every selected op runs it (``test_output_is_finite[<op>-cpu-small]``),
the mixin gets ``test_output_is_finite``, and the table a ``finite`` row.

This module imports no JAX: the built-in checks register when the registry
is first read (:func:`checks`), as the built-in ops do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union


class NotApplicable(Exception):
  """The check does not apply to this op (e.g. integer inputs for a layer
  that takes floats); the test is skipped with this message."""


@dataclasses.dataclass(frozen=True)
class Case:
  """One case of a check: its id (in test ids, e.g. ``"float32"`` or
  ``"depth1-in0-out0-jit_none"``) and the arguments the check takes after
  the op's spec, one per name in :attr:`Check.params`."""
  id: str
  args: tuple = ()


Cases = Union[Sequence[Case], Callable[[bool], Sequence[Case]]]


@dataclasses.dataclass(frozen=True)
class Check:
  """A check of every selected op, and the cases it runs on.

  Attributes:
    name: the test's name without ``test_`` (pytest: ``test_<name>``; the
      mixin: the method ``test_<name>``).
    family: the table row it reports to (several checks may share one).
    run: ``run(spec, *case.args)``: raises ``AssertionError`` (or the op's
      own error) on failure, :class:`NotApplicable` where the case does not
      apply to the op (a skip), returns None on success.
    params: the names of ``case.args`` (pytest's parameter names, shown
      with their values by ``pytest -v``); empty for a check without cases.
    cases: the cases, or ``cases(thorough) -> cases``: those of the
      default budget (``thorough=False``) and of ``--conformance-thorough``.
      Without params: one case of no arguments.
    mixin_cases: the cases the ``absltest`` mixin runs (default: the
      thorough ones).
    applies: ``applies(spec, case) -> str``: why the case does not apply to
      the op (``""`` when it does). Cases that do not apply are left out
      of the default budget's sample (and are skipped where they run).
    if_none_apply: what the mixin does when no case applies: ``"fail"`` (a
      check that checked nothing must not pass) or ``"skip"``.
    runner: for a family whose tests are not made from this record (their
      own runner: ``sharded``, ``properties``), the module that defines
      them; None for every other check.
  """
  name: str
  family: str
  run: Optional[Callable[..., Any]] = None
  params: tuple[str, ...] = ()
  cases: Cases = ()
  mixin_cases: Optional[Sequence[Case]] = None
  applies: Optional[Callable[[Any, Case], str]] = None
  if_none_apply: str = "fail"
  runner: Optional[str] = None

  def __post_init__(self):
    if not self.name.isidentifier():
      raise ValueError(f"conformance.Check: name must be an identifier "
                       f"(the test is test_<name>), got {self.name!r}.")
    if self.runner is None and not callable(self.run):
      raise TypeError(f"conformance.Check {self.name!r}: run must be a "
                      f"function run(spec, *case.args), got {self.run!r}.")
    if self.if_none_apply not in ("fail", "skip"):
      raise ValueError(f"conformance.Check {self.name!r}: if_none_apply "
                       f"must be 'fail' or 'skip', got "
                       f"{self.if_none_apply!r}.")

  @property
  def test_name(self) -> str:
    return f"test_{self.name}"

  def cases_for(self, thorough: bool) -> list[Case]:
    """The cases of the default budget, or of the thorough one."""
    cases = self.cases(thorough) if callable(self.cases) else self.cases
    cases = list(cases)
    if not self.params and not cases:
      return [Case("", ())]
    for case in cases:
      if len(case.args) != len(self.params):
        raise ValueError(
            f"conformance.Check {self.name!r}: case {case.id!r} has "
            f"{len(case.args)} arguments for params {self.params}.")
    return cases

  def cases_for_mixin(self) -> list[Case]:
    if self.mixin_cases is not None:
      return list(self.mixin_cases)
    return self.cases_for(thorough=True)

  def why_not(self, spec, case: Case) -> str:
    """Why ``case`` does not apply to the op ``spec`` (``""``: it does)."""
    return self.applies(spec, case) if self.applies is not None else ""


_REGISTRY: dict[str, Check] = {}
_BUILTIN: list[str] = []


def register_check(check: Check) -> Check:
  """Adds ``check`` to the suite (a new ``family`` adds a table row);
  re-registering a name replaces it. Register at the top level of a module
  imported before the suite collects (your ``conftest.py``)."""
  if not isinstance(check, Check):
    raise TypeError(f"conformance.register_check takes a conformance.Check, "
                    f"got {type(check).__name__}.")
  _REGISTRY[check.name] = check
  return check


def _register_builtin(check: Check) -> Check:
  register_check(check)
  if check.name not in _BUILTIN:
    _BUILTIN.append(check.name)
  return check


def checks() -> list[Check]:
  """Every registered check: the built-in ones first, in the order of the
  families' table (parity, reference, vmap, transforms, frozen, bounds,
  sharded, properties), then the others in the order they registered."""
  from gram_haiku.conformance import checks as builtin  # pylint: disable=g-import-not-at-top
  del builtin  # Registers the built-in checks on import.
  first = [_REGISTRY[n] for n in _BUILTIN if n in _REGISTRY]
  rest = [c for n, c in _REGISTRY.items() if n not in _BUILTIN]
  return first + rest


def op_checks() -> list[Check]:
  """The checks whose tests are made from the registry (every check but
  those with a runner of their own)."""
  return [c for c in checks() if c.runner is None]


def check_named(test_name: str) -> Optional[Check]:
  """The check whose test is ``test_name`` (``test_<name>``), or None."""
  if not test_name.startswith("test_"):
    return None
  check = _REGISTRY.get(test_name[len("test_"):])
  return check if check is not None and check.runner is None else None


def families() -> list[str]:
  """The family names, each once, in :func:`checks` order."""
  return list(dict.fromkeys(c.family for c in checks()))
