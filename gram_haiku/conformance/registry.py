"""Registry of Gram ops under test (Haiku's module-descriptor pattern)."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Optional

# JAX and NumPy are imported where they are used: the pytest plugin
# imports this package in every pytest run of an environment that has it
# installed, and JAX would add about a second to each.


@dataclasses.dataclass(frozen=True)
class OpSpec:
  """How to exercise one Gram op (for a :class:`gram_haiku.Rule`:
  :meth:`from_rule`).

  Attributes:
    name: a short id, used in test ids.
    make_params: ``(key, dtype) -> params``, a dict of arrays of ``dtype``.
    make_example: ``(key, lead_shape, dtype) -> x`` with leading axes
      ``lead_shape`` (example axis first, then within-example axes) followed
      by the shape one application of the op consumes. For an op with
      ``integer_input``, ``dtype`` is ignored and ``x`` holds integers.
    apply: ``(params, probe, x, **op_kwargs) -> y`` calling the Gram op.
      ``op_kwargs`` may hold ``example_axis`` (an
      :class:`gram_haiku.ExampleAxis`), ``mode`` (``"gram"``,
      ``"norms"``, ``"per_example"``) or ``plan`` (a
      :class:`gram_haiku.Plan`, for the frozen family); pass them on to the
      op. ``probe`` is the zero probe: ``(B, B)`` for ``"gram"``, ``(B,)``
      for ``"norms"``, ``(B, P)`` for ``"per_example"``.
    plain: ``(params, x) -> y``, the same computation untracked; must
      accept ``x`` with any number of leading axes.
    integer_input: ``x`` is integer (ids): its cotangent must be ``float0``
      and its dtype is not varied.
  """
  name: str
  make_params: Callable[[jax.Array, Any], Any]
  make_example: Callable[[jax.Array, tuple[int, ...], Any], jax.Array]
  apply: Callable[..., jax.Array]
  plain: Callable[[Any, jax.Array], jax.Array]
  integer_input: bool = False

  @classmethod
  def from_rule(cls, rule, make_params, make_example, *,
                name: Optional[str] = None, plain=None,
                integer_input: bool = False) -> "OpSpec":
    """The spec of a :class:`gram_haiku.Rule`: its op is the rule bound by
    :func:`gram_haiku.ops.bind`, its untracked computation the rule's own
    ``forward``.

    Args:
      rule: the layer's :class:`gram_haiku.Rule`.
      make_params: ``(key, dtype) -> {name: array}``, one entry per name in
        ``rule.param_names`` (a name left out is an absent parameter: None).
      make_example: as :attr:`make_example`.
      name: the id in test ids (default: the rule's short name, its
        ``forward``'s without ``_forward``).
      plain: ``(params, x) -> y`` (default: ``rule.forward`` on the
        parameters in ``rule.param_names`` order); give an independent
        computation to check ``forward`` itself as well.
      integer_input: as :attr:`integer_input`.

    Returns:
      The :class:`OpSpec`; register it with :func:`register`.
    """
    from gram_haiku.ops import rule_name  # pylint: disable=g-import-not-at-top
    names = rule.param_names

    def operands(p):
      return tuple(p.get(n) for n in names)

    def apply(p, probe, x, **kwargs):
      from gram_haiku.ops import bind  # pylint: disable=g-import-not-at-top
      kwargs.setdefault("name", spec_name)
      return bind(rule, x, operands(p), probe, **kwargs)

    def forward(p, x):
      return rule.forward(x, *operands(p))

    spec_name = name if name is not None else rule_name(rule)
    return cls(name=spec_name, make_params=make_params,
               make_example=make_example, apply=apply,
               plain=forward if plain is None else plain,
               integer_input=integer_input)


_REGISTRY: dict[str, OpSpec] = {}


#: Op name -> the module that registered it (the sharded runner, a process
#: of its own, imports these to see the same ops).
_MODULES: dict[str, str] = {}


def register(spec: OpSpec) -> OpSpec:
  """Adds ``spec`` to the suite; re-registering a name replaces it.

  The calling module is recorded: the sharded family's runner subprocess
  imports it to register the same op (so register at a module's top level,
  in a module importable from the directory pytest runs in, such as your
  ``conftest.py``, or name it with ``--conformance-modules``).
  """
  _REGISTRY[spec.name] = spec
  caller = sys._getframe(1).f_globals.get("__name__", "")  # pylint: disable=protected-access
  if caller and caller != "__main__":
    _MODULES[spec.name] = caller
  return spec


def registering_modules(names) -> list[str]:
  """The modules that registered the ops ``names`` (built-ins excluded)."""
  return sorted({_MODULES[n] for n in names if n in _MODULES
                 and not _MODULES[n].startswith("gram_haiku.conformance.ops")})


def is_builtin(spec: OpSpec) -> bool:
  """Whether ``spec`` ships with gram_haiku (its functions are defined in
  gram_haiku's own modules, as the built-in ops and the documented example
  are). The default budget (CI's) samples the cases of these alone: the
  nightly run (``tox -e conformance-thorough``) checks every case of them,
  and a third party's op runs every case of every family."""
  return all(
      (getattr(fn, "__module__", None) or "").startswith("gram_haiku.")
      for fn in (spec.make_params, spec.make_example, spec.apply, spec.plain))


def unknown_ops_message(unknown, known) -> str:
  """What ``--conformance-ops`` (``--ops``) says of op names that no module
  registered: the ops there are, and how to register one."""
  names = ", ".join(repr(n) for n in sorted(unknown))
  return (
      f"--conformance-ops: no op is registered as {names}. "
      f"Registered ops: {', '.join(sorted(known))}.\n"
      "To add yours, register it at the top level of a module that is "
      "imported before the suite collects, e.g. a conftest.py in the "
      "directory you run from:\n"
      "    from gram_haiku import conformance\n"
      "    conformance.register(conformance.OpSpec(name=..., ...))\n"
      "or name that module: --conformance-modules my_ops (python -m "
      "gram_haiku.conformance passes it on; env CONFORMANCE_MODULES).")


def registered_ops() -> list[OpSpec]:
  """All registered specs, the built-in gram_haiku ops included."""
  from gram_haiku.conformance import ops  # pylint: disable=g-import-not-at-top
  ops.load_all()
  return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def numpy_rng(key) -> np.random.Generator:
  """A numpy generator seeded by the JAX PRNG ``key`` (its key data)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  return np.random.default_rng(
      np.asarray(jax.random.key_data(key)).ravel().tolist())


def normal(key, shape, dtype):
  """Standard normal draws of ``shape`` (float32, then cast to ``dtype``),
  seeded by the JAX PRNG ``key``.

  Drawn by numpy: ``jax.random.normal`` outside jit compiles a program per
  shape and dtype, which is most of a small check's time.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  values = numpy_rng(key).standard_normal(shape, np.float32)
  # device_put: jnp.asarray of a numpy array compiles a program per shape.
  return jax.device_put(values.astype(jax.numpy.dtype(dtype)))
