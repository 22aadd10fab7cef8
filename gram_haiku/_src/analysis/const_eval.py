"""Small constant computations evaluated on the host, to compare by value.

The example-flow analysis (:mod:`gram_haiku._src.analysis.example_flow`) tells two
index arrays apart by what they hold: ``out[perm]`` with ``y[perm]`` pairs
each example with its own labels, ``out[perm]`` with ``y[other]`` does not.
JAX writes the same index array in different programs (a NumPy array is
normalised for negative indices when traced, a ``jnp`` array in the
program), so the integer and boolean equations that build index arrays
from constants are evaluated here with NumPy, and their results compared.
Anything else is left to the program's own key.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

#: Results up to this many entries are evaluated and compared by value.
MAX_ENTRIES = 1 << 16


def _broadcast_in_dim(x, shape, broadcast_dimensions, **_):
  expanded = np.reshape(x, [x.shape[broadcast_dimensions.index(d)]
                            if d in broadcast_dimensions else 1
                            for d in range(len(shape))])
  return np.broadcast_to(expanded, shape)


def _iota(dtype, shape, dimension, **_):
  ramp = np.arange(shape[dimension], dtype=dtype)
  return np.broadcast_to(
      np.reshape(ramp, [-1 if d == dimension else 1
                        for d in range(len(shape))]), shape)


def _rem(a, b):  # C's remainder: the sign of the dividend (lax.rem)
  if np.any(b == 0):
    raise ValueError("division by zero")
  return np.fmod(a, b)


def _div(a, b):  # rounded toward zero (lax.div of integers)
  if np.any(b == 0):
    raise ValueError("division by zero")
  return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))


def _select_n(which, *cases):
  return np.choose(np.asarray(which, np.int64), cases)


_ELEMENTWISE: dict[str, Callable[..., Any]] = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply,
    "neg": np.negative, "max": np.maximum, "min": np.minimum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater,
    "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
    "rem": _rem, "div": _div,
    # Bit by bit on integers (lax.and_ of ints), logical on booleans.
    "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "not": np.invert,
}


def _elementwise(f):
  return lambda values, params, dtype: f(*values)


def _reshape(values, params, dtype):
  # ``dimensions``: the operand's axes read in that order first
  # (x.reshape(..., order="F")).
  del dtype
  dims = params.get("dimensions")
  v = values[0] if dims is None else np.transpose(values[0], dims)
  return np.reshape(v, tuple(params["new_sizes"]))


#: Primitive name -> ``rule(values, params, out_dtype) -> value``: one grep
#: shows what is evaluated.
RULES: dict[str, Callable[..., Any]] = {
    **{name: _elementwise(f) for name, f in _ELEMENTWISE.items()},
    "select_n": _elementwise(_select_n),
    "convert_element_type": lambda values, params, dtype: values[0],
    "broadcast_in_dim": lambda values, params, dtype: _broadcast_in_dim(
        values[0], tuple(params["shape"]),
        tuple(params["broadcast_dimensions"])),
    "iota": lambda values, params, dtype: _iota(
        dtype, tuple(params["shape"]), params["dimension"]),
    "reshape": _reshape,
    "squeeze": lambda values, params, dtype: np.squeeze(
        values[0], tuple(params["dimensions"])),
    "concatenate": lambda values, params, dtype: np.concatenate(
        values, axis=params["dimension"]),
    "stack": lambda values, params, dtype: np.stack(values,
                                                    axis=params["axis"]),
    "rev": lambda values, params, dtype: np.flip(
        values[0], tuple(params["dimensions"])),
    "tile": lambda values, params, dtype: np.tile(values[0],
                                                  tuple(params["reps"])),
    "transpose": lambda values, params, dtype: np.transpose(
        values[0], tuple(params["permutation"])),
}


def _integer_kinds(values, out_dtype) -> Optional[np.dtype]:
  """``out_dtype`` where it and every operand are integer or boolean;
  else None (a float, a PRNG key or other extended dtype: not modelled)."""
  try:
    out_dtype = np.dtype(out_dtype)
    kinds = [np.dtype(v.dtype).kind for v in values]
  except TypeError:
    return None
  if out_dtype.kind not in "iub" or any(k not in "iub" for k in kinds):
    return None
  return out_dtype


def evaluate(name: str, params: dict, values: Sequence[np.ndarray],
             out_dtype: Any) -> Optional[np.ndarray]:
  """The value of equation ``name(*values, **params)``, or None where it is
  not one of the integer or boolean equations modelled here.

  Args:
    name: the primitive's name.
    params: its parameters.
    values: its operands' values (NumPy arrays).
    out_dtype: the output's dtype; only integer and boolean ones are
      evaluated (exact on the host as on a device).
  """
  out_dtype = _integer_kinds(values, out_dtype)
  rule = RULES.get(name)
  if out_dtype is None or rule is None:
    return None
  try:
    out = rule(values, params, out_dtype)
  except (ValueError, TypeError, KeyError, IndexError):
    return None
  out = np.asarray(out)
  if out.size > MAX_ENTRIES:
    return None
  if out_dtype.kind in "iu" and out.size and (
      out.min() < np.iinfo(out_dtype).min or
      out.max() > np.iinfo(out_dtype).max):
    return None  # (it would wrap on the device)
  return out.astype(out_dtype)
