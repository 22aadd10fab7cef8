"""Check families: each ``check_*(spec, ...)`` raises ``AssertionError`` (or
the op's own error) on failure and returns None on success.

Families (see ``docs/conformance.rst``):

* **parity**: :func:`check_backward_parity`: cotangent shape, dtype and
  weak type equal the primal's, by value and by ``jax.eval_shape``.
* **vmap**: :func:`check_vmap_depth_invariance` (depth 0 to 3, permuted
  ``in_axes``/``out_axes``, ``jit`` inside or outside) and
  :func:`check_example_axis_selection`; both compare with the reference.
* **bounds**: :func:`check_norm_bounds`: a clipping pass's norms are never
  below the truth.
* **properties**: :mod:`gram_haiku.conformance.properties` (random models).
* **transforms**: checkpoint policies, ``lax.scan`` over stacked and over
  shared parameters, ``jax.vjp(...).with_refs``, ``has_aux``, grad of a
  jitted function, ``vmap(grad)``, norms-only mode.
* **frozen**: :func:`check_frozen`: a parameter in ``Plan.frozen`` has no
  term in the Gram or the norms, and zero per-example columns.
* **sharded**: :mod:`gram_haiku.conformance.sharded` (its own process).

Every Gram is compared with the reference ``F @ F.T`` of the plain op
(:func:`reference_gram`) within :data:`TOLERANCES`, written once here. The
transforms a check runs under (``jit`` placement, ``vmap`` layout,
batching, ``jax.checkpoint`` policy) are the named values of
:mod:`gram_haiku.conformance.variants`; which check runs on which cases is
:mod:`gram_haiku.conformance.families`' registry.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Iterator

import chex
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku import ExampleAxis
from gram_haiku import testing
from gram_haiku.conformance import families
from gram_haiku.conformance import variants
from gram_haiku.conformance.registry import normal
from gram_haiku.conformance.registry import OpSpec
from gram_haiku.conformance.variants import layout_order  # noqa: F401

#: dtype case -> ``(rtol, atol)``, ``atol`` a fraction of the reference's
#: largest entry: gram_haiku's one tolerance table. float32: reordered
#: float32 sums; bfloat16 and float16: the op computes in that dtype while
#: the reference runs in float32; "mixed": bfloat16 parameters with float32
#: activations.
TOLERANCES = testing.TOLERANCES

#: Parity dtype cases: name -> (parameter dtype, activation dtype).
DTYPE_CASES = {
    "float32": ("float32", "float32"),
    "bfloat16": ("bfloat16", "bfloat16"),
    "float16": ("float16", "float16"),
    "float64": ("float64", "float64"),
    "mixed": ("bfloat16", "float32"),
    "int": ("float32", "int32"),
}

#: Example-axis size and within-example axes used by the checks.
B = variants.B
WITHIN = variants.WITHIN


NotApplicable = families.NotApplicable


@contextlib.contextmanager
def x64_if(flag: bool):
  """Turns on ``jax_enable_x64`` inside the block when ``flag``."""
  if not flag:
    yield
    return
  with jax.enable_x64(True):
    yield


def _loss(out):
  return 0.5 * jnp.sum(jnp.tanh(out.astype(jnp.float32)) ** 2)


def _probe(shape, x64=False):
  # device_put of NumPy zeros: jnp.zeros outside jit compiles a program per
  # shape.
  return jax.device_put(np.zeros(shape, np.float64 if x64 else np.float32))


#: How many problems and references :func:`_memoized` keeps (the oldest
#: goes first): a check's inputs and reference are those of the other
#: checks of the same op, dtypes and shape.
MEMO_SIZE = 128
_MEMO: collections.OrderedDict = collections.OrderedDict()


def _memoized(kind: str, spec: OpSpec, args: tuple, make):
  """``make()``, computed once per ``(kind, spec, args)`` and the JAX
  settings it depends on (x64, the default device) among the last
  :data:`MEMO_SIZE` ones.

  The checks of one op share its random problem and its reference
  per-example gradients: each is one program traced, lowered and
  compiled, as many times as checks used them before. A spec that cannot
  be hashed (a third party's callable object) is computed every time.
  """
  key = (kind, spec, args, bool(jax.config.jax_enable_x64),
         str(jax.config.jax_default_device))
  try:
    hash(key)
  except TypeError:
    return make()
  if key in _MEMO:
    _MEMO.move_to_end(key)
    return _MEMO[key]
  value = _MEMO[key] = make()
  while len(_MEMO) > MEMO_SIZE:
    _MEMO.popitem(last=False)
  return value


def make_problem(spec: OpSpec, lead, param_dtype="float32",
                 x_dtype="float32", seed=0):
  """Random parameters and input ``x: lead + feature shape``.

  Drawn once per op, shape, dtypes and seed (:func:`_memoized`); each call
  gets its own parameter containers holding the same (immutable) arrays.
  """
  def make():
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = spec.make_params(k1, jnp.dtype(param_dtype))
    x = spec.make_example(k2, tuple(lead), jnp.dtype(x_dtype))
    return params, x
  params, x = _memoized(
      "problem", spec, (tuple(lead), jnp.dtype(param_dtype).name,
                        jnp.dtype(x_dtype).name, seed), make)
  return jax.tree.map(lambda a: a, params), x


def per_example_grads(spec: OpSpec, params, x) -> np.ndarray:
  """``F``: ``[B, P]`` from ``vmap(grad)`` of the plain op, in float64.

  Each example is evaluated alone, as a batch of one, at float32 or wider
  (:func:`gram_haiku.testing.per_example_grads`).
  """
  f = testing.per_example_grads(lambda p, xi: _loss(spec.plain(p, xi)),
                                  params, x, upcast=True)
  return np.asarray(f, np.float64)


def reference_gram(spec: OpSpec, params, x) -> np.ndarray:
  """The truth: ``F @ F.T`` with ``F`` from :func:`per_example_grads`."""
  f = per_example_grads(spec, params, x)
  return f @ f.T


def problem_and_reference(spec: OpSpec, lead, param_dtype="float32",
                          x_dtype="float32", seed=0):
  """``(params, x, F)``: :func:`make_problem` and its reference
  :func:`per_example_grads` (read-only), each computed once per op, shape,
  dtypes and seed (:func:`_memoized`)."""
  params, x = make_problem(spec, lead, param_dtype, x_dtype, seed)

  def make():
    f = per_example_grads(spec, params, x)
    f.setflags(write=False)
    return f
  f = _memoized("reference", spec, (tuple(lead), jnp.dtype(param_dtype).name,
                                    jnp.dtype(x_dtype).name, seed), make)
  return params, x, f


def _gram(f):
  return f @ f.T


def assert_close(got, ref, case="float32", what="Gram"):
  """``got`` equals ``ref`` within the tolerance of dtype ``case``."""
  chex.assert_shape(np.asarray(got), np.shape(ref))
  testing.assert_gram_close(got, ref, case, what=what)


# -- parity ------------------------------------------------------------------


def _assert_parity(cts, primals, label):
  for ct, primal in zip(jax.tree.leaves(cts), jax.tree.leaves(primals)):
    chex.assert_equal_shape([ct, primal])
    primal_dtype = jnp.result_type(primal)
    if jnp.issubdtype(primal_dtype, jnp.inexact):
      want = primal_dtype
    else:
      want = jax.dtypes.float0
    assert ct.dtype == want, (
        f"{label}: cotangent dtype {ct.dtype} for a primal of dtype "
        f"{primal_dtype} (expected {want})")
    primal_weak = getattr(jax.typeof(primal), "weak_type", False)
    ct_weak = getattr(ct, "weak_type", False)
    assert bool(ct_weak) == bool(primal_weak), (
        f"{label}: cotangent weak_type {ct_weak} for a primal with "
        f"weak_type {primal_weak}")


def parity_not_applicable(spec: OpSpec, case: str) -> str:
  """Why the parity ``case`` does not apply to ``spec`` ("" if it does)."""
  if case == "int" and not spec.integer_input:
    return f"op {spec.name!r} takes float inputs"
  if spec.integer_input and case == "mixed":
    return f"op {spec.name!r} takes integer inputs"
  return ""


def check_backward_parity(spec: OpSpec, case: str = "float32", seed=0):
  """Every cotangent has its primal's shape, dtype and weak type.

  ``case`` is a key of :data:`DTYPE_CASES`. Checked twice: on values, and
  abstractly with ``jax.eval_shape`` (no FLOPs). The probe's cotangent has
  the probe's dtype; an integer input's cotangent is ``float0``. The
  forward output equals the plain op's.
  """
  param_dtype, x_dtype = DTYPE_CASES[case]
  why = parity_not_applicable(spec, case)
  if why:
    raise NotApplicable(why)
  x64 = case == "float64"
  with x64_if(x64):
    params, x = make_problem(spec, (B,) + WITHIN[:1], param_dtype, x_dtype,
                             seed)
    probe = _probe((B, B), x64)

    def loss(params, probe, x):
      return _loss(spec.apply(params, probe, x))
    grad = jax.grad(loss, argnums=(0, 1, 2), allow_int=True)
    primals = (params, probe, x)
    # Under jit, the cotangents and both forward outputs in one program
    # (one compilation; the eager path is the vmap-depth family's
    # ``jit_none`` layouts): jit keeps dtypes and weak types as they are.
    # ``jax.eval_shape`` of the same function reuses its trace.
    def run(p, probe, x):
      return grad(p, probe, x), spec.apply(p, probe, x), spec.plain(p, x)
    cts, out, plain = jax.jit(run)(params, probe, x)
    _assert_parity(cts, primals, f"{spec.name}/{case}")
    _assert_parity(jax.eval_shape(run, params, probe, x)[0], primals,
                   f"{spec.name}/{case} (eval_shape)")
    assert out.dtype == plain.dtype and out.shape == plain.shape, (
        f"{spec.name}/{case}: output {out.dtype}{out.shape} but the plain op "
        f"gives {plain.dtype}{plain.shape}")
    np.testing.assert_allclose(np.asarray(out, np.float64),
                               np.asarray(plain, np.float64), rtol=1e-6,
                               atol=1e-6 * float(np.abs(plain).max() + 1e-30))


# -- reference equality ------------------------------------------------------

REFERENCE_CASES = ("float32", "bfloat16", "float16", "float64", "mixed")


def check_reference_equality(spec: OpSpec, case: str, vmapped, seed=0):
  """The Gram equals ``F @ F.T`` within the tolerance of ``case``.

  ``case`` is a float key of :data:`DTYPE_CASES`; the reference runs in
  float32 (float64 under x64) on the same low-precision inputs. The op is
  called explicitly batched, or under one ``vmap`` over examples
  (``vmapped``: a bool or a :class:`~variants.Batching`).
  """
  batching = (vmapped if isinstance(vmapped, variants.Batching)
              else variants.batching(vmapped))
  param_dtype, x_dtype = DTYPE_CASES[case]
  if spec.integer_input:
    x_dtype = "int32"
  x64 = case == "float64"
  with x64_if(x64):
    params, x, f = problem_and_reference(spec, (B,) + WITHIN[:1],
                                         param_dtype, x_dtype, seed)
    ref = _gram(f)

    def loss(probe, x):
      return _loss(batching(lambda xi: spec.apply(params, probe, xi))(x))
    probe = _probe((B, B), x64)
    gram = jax.jit(jax.grad(loss))(probe, x)
    assert gram.dtype == probe.dtype, (gram.dtype, probe.dtype)
    assert_close(gram, ref, case, what=f"Gram ({case}, {batching})")


# -- vmap depth --------------------------------------------------------------


#: ``{depth: [VmapLayout, ...]}`` (:data:`variants.VMAP_LAYOUTS`); a
#: layout unpacks as ``in_axes, out_axes``.
VMAP_LAYOUTS = variants.VMAP_LAYOUTS
_nest = variants.nest


def check_vmap_depth_invariance(spec: OpSpec, in_axes=(), out_axes=(),
                                jit="none", seed=0):
  """Explicit batching and nested vmaps all give the reference Gram.

  The canonical input is ``x: (B, T1, T2, *features)``. ``len(in_axes)``
  vmap levels map ``B``, then ``T1``, then ``T2``; level ``k`` takes its
  axis at ``in_axes[k]`` and puts it at ``out_axes[k]``. The outermost vmap
  is the example axis (the default rule). ``jit``: ``"none"``,
  ``"inside"`` (around the op, inside the vmaps) or ``"outside"`` (around
  the gradient): a name or a :class:`~variants.Jit` of
  :data:`variants.JIT`.
  """
  layout = variants.VmapLayout(tuple(in_axes), tuple(out_axes))
  jit = variants.JIT[jit] if isinstance(jit, str) else jit
  params, x, f = problem_and_reference(spec, (B,) + WITHIN, seed=seed)
  ref = _gram(f)
  nlead = 1 + len(WITHIN)
  xs = jnp.transpose(x, layout.order(nlead) + list(range(nlead, x.ndim)))

  def loss(params, probe, xs):
    f = jit.around_op(lambda xi: spec.apply(params, probe, xi))
    return _loss(layout(f)(xs))
  gram = jit.around_grad(jax.grad(loss, argnums=1))(params, _probe((B, B)),
                                                       xs)
  assert_close(gram, ref, what=f"Gram (vmap in_axes={in_axes}, "
               f"out_axes={out_axes}, jit={jit})")


EXAMPLE_AXIS_CASES = ("named_outer", "named_inner", "leading",
                      "default_heads_raises")


def check_example_axis_selection(spec: OpSpec, case: str, seed=0):
  """The example axis chosen by name or by ``example_axis=0``.

  * ``named_outer``: ``vmap(axis_name="batch")`` over examples, an inner
    vmap over ``T1``; ``example_axis="batch"``.
  * ``named_inner``: the outer vmap maps ``T1``, the inner one (named
    ``"batch"``) the examples: the default rule would pick ``T1``.
  * ``leading``: an explicitly batched op under an inner vmap over "heads"
    (``T1``); ``example_axis=0`` makes the vmap within-example.
  * ``default_heads_raises``: the same without the override, with
    ``T1 != B``: the default picks the heads axis and must raise, never
    return a number.
  """
  if case not in EXAMPLE_AXIS_CASES:
    raise ValueError(f"unknown case {case!r}")
  params, x, f = problem_and_reference(spec, (B,) + WITHIN[:1], seed=seed)
  ref = _gram(f)
  axis = {"named_outer": ExampleAxis.from_spec("batch"),
          "named_inner": ExampleAxis.from_spec("batch"),
          "leading": ExampleAxis.from_spec(0),
          "default_heads_raises": None}[case]
  xs = jnp.swapaxes(x, 0, 1) if case == "named_inner" else x

  def loss(probe, xs):
    f = lambda xi: spec.apply(params, probe, xi, example_axis=axis)
    if case == "named_outer":
      y = _nest(f, (0, 0), (0, 0), ("batch", "t"))(xs)
    elif case == "named_inner":
      y = _nest(f, (0, 0), (0, 0), ("t", "batch"))(xs)
    else:
      y = jax.vmap(f, in_axes=1, out_axes=1, axis_name="heads")(xs)
    return _loss(y)
  probe = _probe((B, B))
  if case == "default_heads_raises":
    assert WITHIN[0] != B
    try:
      jax.jit(jax.grad(loss))(probe, xs)
    except ValueError as e:
      assert "example_axis" in str(e), str(e)
      return
    raise AssertionError(
        f"{spec.name}: the default example axis under an inner vmap over "
        "heads returned a Gram instead of raising")
  assert_close(jax.jit(jax.grad(loss))(probe, xs), ref, what=f"Gram ({case})")


# -- transforms --------------------------------------------------------------

#: name -> ``jax.checkpoint`` policy (:data:`variants.CHECKPOINTS`).
CHECKPOINT_POLICIES = {name: v.policy
                       for name, v in variants.CHECKPOINTS.items()}


def _explicit_problem(spec, seed):
  params, x, f = problem_and_reference(spec, (B,) + WITHIN[:1], seed=seed)
  return params, x, _gram(f)


def check_checkpoint(spec: OpSpec, policy, vmapped, seed=0):
  """``jax.checkpoint`` with ``policy`` (a name or a
  :class:`~variants.Checkpoint` of :data:`variants.CHECKPOINTS`), around
  the op explicitly batched or vmapped (a bool or a
  :class:`~variants.Batching`)."""
  checkpoint = (variants.CHECKPOINTS[policy] if isinstance(policy, str)
                else policy)
  batching = (vmapped if isinstance(vmapped, variants.Batching)
              else variants.batching(vmapped))
  params, x, ref = _explicit_problem(spec, seed)

  def loss(probe, x):
    f = batching(lambda xi: spec.apply(params, probe, xi))
    return _loss(checkpoint(f)(x))
  assert_close(jax.jit(jax.grad(loss))(_probe((B, B)), x), ref,
               what=f"Gram under jax.checkpoint(policy={checkpoint})")


def check_scan_stacked(spec: OpSpec, seed=0):
  """``lax.scan`` over a stack of ``L`` parameter sets (as ``hk.layer_stack``):

  one probe per step, stacked ``(L, B, B)``; their sum is the Gram of all
  the stacked parameters.
  """
  L = 3
  keys = jax.random.split(jax.random.PRNGKey(seed), L + 1)
  stack = [spec.make_params(k, jnp.float32) for k in keys[:L]]
  params = jax.tree.map(lambda *a: jnp.stack(a), *stack)
  x = spec.make_example(keys[L], (B,) + WITHIN[:1], jnp.float32)

  def plain_all(p, xi):
    return jax.lax.scan(lambda c, pl: (c + _loss(spec.plain(pl, xi)), None),
                        0.0, p)[0]
  ref = testing.reference_gram(plain_all, params, x)

  def loss(probes, x):
    def body(c, pl_probe):
      pl, probe = pl_probe
      return c + _loss(spec.apply(pl, probe, x)), None
    return jax.lax.scan(body, 0.0, (params, probes))[0]
  grams = jax.jit(jax.grad(loss))(_probe((L, B, B)), x)
  assert_close(grams.sum(0), ref, what="Gram of lax.scan over layers")


def _num_params(params):
  return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))


def check_scan_shared(spec: OpSpec, seed=0):
  """Shared parameters inside ``lax.scan`` (an RNN-style reuse).

  With ``mode="per_example"`` every step adds its per-example gradients to
  the one ``(B, P)`` probe; ``F F^T`` of the sum must be the reference Gram
  over the whole sequence, cross terms between steps included.
  """
  params, x, ref = _explicit_problem(spec, seed)
  P = _num_params(params)

  def loss(probe, x):
    xs = jnp.swapaxes(x, 0, 1)  # scan over the within-example axis
    def body(c, xt):
      return c + _loss(spec.apply(params, probe, xt, mode="per_example")), None
    return jax.lax.scan(body, 0.0, xs)[0]
  f = jax.jit(jax.grad(loss))(_probe((B, P)), x)
  chex.assert_shape(f, (B, P))
  f = np.asarray(f, np.float64)
  assert_close(f @ f.T, ref, what="Gram of per-example gradients "
               "accumulated over lax.scan steps")


def check_shared_twice(spec: OpSpec, seed=0):
  """The op applied twice with the same parameters (a module called twice).

  Both applications write per-example gradients into one ``(B, P)`` probe;
  the Gram of the sum has the cross terms a sum of per-call Grams lacks.
  """
  params, x = make_problem(spec, (B,) + WITHIN[:1], seed=seed)
  x2 = spec.make_example(jax.random.PRNGKey(seed + 99), (B,) + WITHIN[:1],
                         jnp.float32)
  P = _num_params(params)

  def plain(p, xi, x2i):
    return _loss(spec.plain(p, xi)) + _loss(spec.plain(p, x2i))
  ref = testing.reference_gram(plain, params, x, x2, upcast=True)

  def loss(probe):
    return (_loss(spec.apply(params, probe, x, mode="per_example")) +
            _loss(spec.apply(params, probe, x2, mode="per_example")))
  g = np.asarray(jax.jit(jax.grad(loss))(_probe((B, P))), np.float64)
  assert_close(g @ g.T, ref, what="Gram of a twice-applied op")


def check_norms_mode(spec: OpSpec, seed=0):
  """``mode="norms"``: the probe ``(B,)`` gets ``diag`` of the reference."""
  params, x, ref = _explicit_problem(spec, seed)

  def loss(probe, x):
    return _loss(jax.vmap(lambda xi: spec.apply(params, probe, xi,
                                                mode="norms"))(x))
  sq = jax.jit(jax.grad(loss))(_probe((B,)), x)
  assert_close(sq, np.diag(ref), what="squared norms (mode='norms')")


def check_with_refs(spec: OpSpec, seed=0):
  """``jax.vjp(...).with_refs`` accumulates the Gram into a ``jax.new_ref``.

  The ref starts at a random matrix ``R``; afterwards it holds ``R + G``.
  """
  params, x, ref = _explicit_problem(spec, seed)

  def f(params, probe):
    return _loss(spec.apply(params, probe, x))
  probe = _probe((B, B))
  _, vjp = jax.vjp(f, params, probe)
  start = normal(jax.random.PRNGKey(seed + 7), (B, B), jnp.float32)
  probe_ref = jax.new_ref(start)
  param_refs = jax.tree.map(lambda p: jax.new_ref(jnp.zeros_like(p)), params)
  vjp.with_refs(param_refs, probe_ref)(jnp.ones((), jnp.float32))
  assert_close(probe_ref[...] - start, ref,
               what="Gram accumulated with with_refs")
  plain_grads = jax.jit(jax.grad(lambda p, x: _loss(spec.plain(p, x))))(
      params, x)
  for got, want in zip(jax.tree.leaves(param_refs),
                       jax.tree.leaves(plain_grads)):
    np.testing.assert_allclose(got[...], want, rtol=1e-4, atol=1e-5)


def check_with_refs_wrong_type(spec: OpSpec, seed=0):
  """A wrongly typed ref for the probe: a clear error naming both types."""
  params, x = make_problem(spec, (B,) + WITHIN[:1], seed=seed)
  def f(probe):
    return _loss(spec.apply(params, probe, x))
  _, vjp = jax.vjp(f, _probe((B, B)))
  for bad in (jnp.zeros((B, B), jnp.bfloat16), jnp.zeros((B + 1, B))):
    try:
      vjp.with_refs(jax.new_ref(bad))(jnp.ones((), jnp.float32))
    except ValueError as e:
      # The rule's own error names the probe; from JAX 0.11 on, JAX checks
      # the ref's type before any rule runs and names with_refs instead.
      msg = str(e).replace(" ", "")
      name = jnp.dtype(bad.dtype).name
      want = f"{name}{list(bad.shape)}".replace(" ", "")
      where = "probe" in msg or "with_refs" in msg
      assert where and want in msg and "float32" in msg, str(e)
      continue
    raise AssertionError(f"{spec.name}: a {bad.dtype}{bad.shape} ref for a "
                         "float32 probe was accepted")


def check_has_aux(spec: OpSpec, seed=0):
  """``jax.value_and_grad(..., has_aux=True)`` and grad of a jitted loss."""
  params, x, ref = _explicit_problem(spec, seed)

  def loss(probe, x):
    y = spec.apply(params, probe, x)
    return _loss(y), y
  (value, aux), gram = jax.value_and_grad(loss, has_aux=True)(
      _probe((B, B)), x)
  assert_close(gram, ref, what="Gram with has_aux")
  plain, plain_loss = jax.jit(lambda params, x: (
      spec.plain(params, x), _loss(spec.plain(params, x))))(params, x)
  np.testing.assert_allclose(value, plain_loss, rtol=1e-5)
  chex.assert_trees_all_close(aux, plain, rtol=1e-5, atol=1e-6)
  jitted = jax.jit(lambda probe, x: loss(probe, x)[0])
  assert_close(jax.grad(jitted)(_probe((B, B)), x), ref,
               what="Gram of grad(jit(loss))")


def check_vmap_of_grad(spec: OpSpec, seed=0):
  """``vmap(grad(...))`` over examples: stacked 1x1 Grams = ``diag(G)``."""
  params, x, ref = _explicit_problem(spec, seed)

  def loss(probe, xi):  # one example, as a batch of one
    return _loss(spec.apply(params, probe, xi[None]))
  diag = jax.vmap(jax.grad(loss), in_axes=(None, 0))(_probe((1, 1)), x)
  chex.assert_shape(diag, (B, 1, 1))
  assert_close(diag[:, 0, 0], np.diag(ref), what="vmap(grad) 1x1 Grams")


# -- frozen parameters -------------------------------------------------------


def op_param_indices(spec: OpSpec, params, x) -> dict:
  """Parameter key (its ``jax.tree_util.keystr``) -> index of the op
  parameter it is bound to, read from the one Gram-op equation of
  ``jax.make_jaxpr`` of ``spec.apply``. A parameter that ``apply`` passes
  through another computation first (a broadcast, a reshape) is left out.

  Raises:
    NotApplicable: when ``spec.apply`` binds no Gram op or several, or
      passes no parameter to it as it is.
  """
  paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = [jax.tree_util.keystr(k) for k, _ in paths]
  probe = _probe((B, B))
  jaxpr = jax.make_jaxpr(lambda *leaves: spec.apply(
      jax.tree.unflatten(treedef, leaves), probe, x))(
          *[v for _, v in paths]).jaxpr
  ops = testing.gram_ops_in(jaxpr)
  if len(ops) != 1:
    raise NotApplicable(f"{spec.name}: apply binds {len(ops)} Gram ops, not "
                        f"one (the frozen family reads one op's parameters)")
  eqn, op = ops[0]
  present = iter(eqn.invars[1:-1])
  bound = {id(next(present)): i for i, a in enumerate(op.param_avals)
           if a is not None}
  found = {key: bound[id(var)] for key, var in zip(keys, jaxpr.invars)
           if id(var) in bound}
  if not found:
    raise NotApplicable(f"{spec.name}: no parameter is passed to the op as "
                        f"it is")
  return found


def check_frozen(spec: OpSpec, seed=0):
  """``Plan(frozen=(i,))``: parameter ``i`` has no gradient, so its terms
  leave the Gram and the norms (``F_rest F_rest^T`` over the other
  parameters' columns) and its columns of the per-example gradients are
  zero; freezing every parameter gives zeros.

  This is what :func:`gram_haiku.value_grad_and_gram` binds for a frozen
  weight (closed over, read through ``stop_gradient``, or ``frozen=``);
  an op that keeps a frozen parameter's term returns a wrong Gram. The
  plan reaches the op through ``spec.apply(..., plan=...)``.

  Raises:
    NotApplicable: for an ``apply`` that does not accept ``plan=``, or as
      :func:`op_param_indices`.
  """
  from gram_haiku import Plan  # pylint: disable=g-import-not-at-top
  params, x, f = problem_and_reference(spec, (B,) + WITHIN[:1], seed=seed)
  index = op_param_indices(spec, params, x)
  paths = jax.tree_util.tree_flatten_with_path(params)[0]
  keys = [jax.tree_util.keystr(k) for k, _ in paths]
  sizes = [int(np.size(v)) for _, v in paths]
  starts = np.cumsum([0] + sizes)
  columns = {k: slice(starts[j], starts[j + 1]) for j, k in enumerate(keys)}
  # The op's per-example columns follow its parameter order.
  if len(index) < len(keys):  # Their order is not known then.
    op_order = None
  else:
    op_order = sorted(keys, key=index.get)
  op_columns = {}
  if op_order is not None:
    op_starts = np.cumsum([0] + [sizes[keys.index(k)] for k in op_order])
    op_columns = {k: slice(op_starts[j], op_starts[j + 1])
                  for j, k in enumerate(op_order)}
  cases = [(k,) for k in keys if k in index]
  if len(index) == len(keys) > 1:
    cases.append(tuple(keys))

  # Every (frozen set, mode) pass in one program: one trace, lowering and
  # compilation for the check, not one per pass.
  modes = {"gram": (B, B), "norms": (B,), "per_example": (B, f.shape[1])}
  runs = [(frozen, mode, Plan(mode=mode,
                              frozen=tuple(sorted(index[k] for k in frozen))))
          for frozen in cases for mode in modes]

  def all_passes(probes, x):
    def grad(plan, probe):
      return jax.grad(lambda probe: _loss(spec.apply(params, probe, x,
                                                     plan=plan)))(probe)
    return [grad(plan, probe) for (_, _, plan), probe in zip(runs, probes)]
  try:
    got = jax.jit(all_passes)([_probe(modes[mode]) for _, mode, _ in runs], x)
  except TypeError as e:
    if "unexpected keyword argument 'plan'" in str(e):
      raise NotApplicable(f"{spec.name}: apply does not take plan= ({e})")
    raise
  got = {(frozen, mode): np.asarray(g, np.float64)
         for (frozen, mode, _), g in zip(runs, got)}

  for frozen in cases:
    live = [columns[k] for k in keys if k not in frozen]
    f_rest = (np.concatenate([f[:, c] for c in live], axis=1) if live
              else np.zeros((B, 0)))
    ref = f_rest @ f_rest.T
    label = f"frozen {', '.join(frozen)}"
    assert_close(got[frozen, "gram"], ref, what=f"Gram ({label})")
    assert_close(got[frozen, "norms"], np.diag(ref),
                 what=f"squared norms ({label})")
    per = got[frozen, "per_example"]
    for k in frozen if op_columns else ():
      np.testing.assert_array_equal(
          per[:, op_columns[k]], 0.,
          err_msg=f"{spec.name}: per-example columns of frozen {k} not zero")
    assert_close(per @ per.T, ref,
                 what=f"Gram of the per-example gradients ({label})")


#: Inputs of the bounds family: as drawn, and with example 0's first two
#: positions riding on a large offset of opposite signs (``x + a``,
#: ``x - a``, ``|a| = 1e3 |x|``), whose gradient terms nearly cancel.
BOUND_CASES = ("ordinary", "cancelling")


def check_norm_bounds(spec: OpSpec, case: str, mode: str, seed=0):
  """In a clipping pass (``Plan.upper_bound``, ``cfg.upper_bound`` for the
  rule) the op's squared norms (``mode="norms"``), or its per-example rows
  with their rounding bound (``mode="per_example"``: the store's last
  column), are never below the float64 truth: a clip factor taken from a
  smaller norm lets the example in unclipped. The loss is linear in the
  op's output (``sum(out * v)``, ``v`` drawn, equal at example 0's first
  two positions), so the reference gradient is the exact one of the
  cotangents the op sees. With ``case="cancelling"``, under the default
  strategy and ``strategy="ghost"`` (whose norms cancel), the other
  examples' bounds must also equal those of the same batch without
  example 0's offset: a fallback (a tighter bound where one is loose)
  chosen for the whole batch let one example change every other
  example's clip factor."""
  params, x = make_problem(spec, (B,) + WITHIN[:1], seed=seed)
  if case == "cancelling" and not jnp.issubdtype(x.dtype, jnp.floating):
    raise NotApplicable("the op's input is not floating-point")
  out = jax.eval_shape(lambda: spec.plain(params, x[0]))
  strategies = ("auto", "ghost") if case == "cancelling" else ("auto",)
  plans = [gram_haiku.Plan.make(mode=mode, strategy=s, example_axis=0
                                ).replace(upper_bound=True)
           for s in strategies]
  width = _num_params(params) + 1
  probe = _probe((B,) if mode == "norms" else (B, width))

  def run(probe, x):
    """The inputs, the reference rows ``F`` and the op's squared norm
    bounds, in one program; and the bounds without the offset."""
    v = jax.random.normal(jax.random.PRNGKey(seed + 1), (B,) + out.shape,
                          jnp.float32)
    v = v.at[0, 1].set(v[0, 0])

    def bounds(x, plan):
      def loss(probe):
        out = spec.apply(params, probe, x, plan=plan)
        return jnp.sum(out.astype(jnp.float32) * v)
      got = jax.grad(loss)(probe)
      if mode == "norms":
        return got
      return testing.squared_norm_bounds(got[:, :-1], got[:, -1])
    plain = [None] * len(plans)  # (ordinary inputs: nothing to compare)
    if case == "cancelling":
      plain = [bounds(x, plan) for plan in plans]
      a = 1e3 * jnp.max(jnp.abs(x)) * jax.random.normal(
          jax.random.PRNGKey(seed + 7), x.shape[2:], x.dtype)
      x = x.at[0, 0].add(a).at[0, 1].add(-a)
    f = testing.per_example_grads(
        lambda p, xi, vi: jnp.sum(spec.plain(p, xi).astype(jnp.float32) * vi),
        params, x, v, upcast=True)
    return f, [bounds(x, plan) for plan in plans], plain
  f, sqs, plains = jax.jit(run)(probe, x)
  true = np.sqrt(np.sum(np.asarray(f, np.float64) ** 2, axis=1))
  for strategy, sq, plain in zip(strategies, sqs, plains):
    _check_bounds(spec, f"{case} inputs, mode={mode!r}, strategy="
                  f"{strategy!r}", np.asarray(sq, np.float64), true,
                  None if plain is None else np.asarray(plain, np.float64))


def _check_bounds(spec: OpSpec, what: str, sq, true, plain):
  """:func:`check_norm_bounds`' assertions: the squared norm bounds ``sq``
  never below ``true ** 2``, and the other examples' equal to ``plain``,
  those of the batch without example 0's offset (None: not compared)."""
  low = np.flatnonzero(np.sqrt(np.maximum(sq, 0)) < true * (1 - 1e-9))
  if low.size:
    raise AssertionError(
        f"{spec.name} ({what}): in a clipping pass "
        f"(cfg.upper_bound) the norm bounds of examples {low.tolist()} are "
        f"below the float64 truth: {np.sqrt(sq[low])} < {true[low]}. A clip "
        "factor from such a norm lets the example in unclipped.\nWhat to "
        "do: where cfg.upper_bound, make the rule's sq_norms return an "
        "upper bound (the value plus a bound of its rounding error, "
        "e.g. gamma_n sum_{t,s} |x_t . x_s| |d_t . d_s| for a ghost "
        "norm), and give Rule.per_example_error; or leave sq_norms out: "
        "the norms are then formed from the per-example gradients with "
        "their rounding bound.")
  if plain is None:
    return
  moved = np.flatnonzero(sq[1:] != plain[1:]) + 1
  if moved.size:
    raise AssertionError(
        f"{spec.name} ({what}): in a clipping pass "
        f"the norm bounds of other examples {moved.tolist()} changed with "
        f"example 0's inputs: {np.sqrt(sq[moved])} against "
        f"{np.sqrt(plain[moved])} without its offset. Each example's clip "
        "factor must depend on that example alone: a switch made for the "
        "whole batch (where any example's bound is loose, every example "
        "takes a tighter one) lets one example change every other's clip "
        "factor, and the clipped sum moves by more than C.\nWhat to do: "
        "choose per example (jnp.where on the example's own flag, as "
        "gram_haiku._src.compute.kernels.loose_fallback does), never by "
        "lax.cond or jnp.any over the batch.")


TRANSFORM_CHECKS = {
    "scan_stacked": check_scan_stacked,
    "scan_shared": check_scan_shared,
    "shared_twice": check_shared_twice,
    "norms_mode": check_norms_mode,
    "with_refs": check_with_refs,
    "with_refs_wrong_type": check_with_refs_wrong_type,
    "has_aux_and_grad_of_jit": check_has_aux,
    "vmap_of_grad": check_vmap_of_grad,
}


# -- the built-in checks, in the registry every runner iterates --------------
# (gram_haiku.conformance.families: the pytest plugin's tests and the absltest
# mixin's methods are made from these records.)

Case = families.Case


def _both_batchings(values, default_keeps):
  """``(value, vmapped)`` for each value explicitly batched and under vmap
  (ids ``<value>-explicit``, ``<value>-vmap``, :data:`variants.BATCHING`);
  in the default budget only the pairs ``default_keeps(index, value,
  vmapped)`` keeps."""
  def cases(thorough):
    return [Case(f"{v}-{b}", (v, b.vmapped))
            for i, v in enumerate(values)
            for b in (variants.EXPLICIT, variants.VMAPPED)
            if thorough or default_keeps(i, v, b.vmapped)]
  return cases


#: ``vmap`` layouts per depth in the default budget (all when thorough).
DEFAULT_LAYOUTS_PER_DEPTH = 3


def _vmap_cases(thorough):
  """Up to three layouts per depth without jit, spread over the listed
  ones; jit inside/outside on the first layout of each depth. Every layout
  and jit placement when thorough."""
  layouts = [l for ls in VMAP_LAYOUTS.values() for l in ls]
  chosen = set()
  for ls in VMAP_LAYOUTS.values():
    step = max(1, len(ls) // DEFAULT_LAYOUTS_PER_DEPTH)
    chosen.update(ls[::step][:DEFAULT_LAYOUTS_PER_DEPTH])
  cases, firsts = [], {}
  for layout in layouts:
    if not thorough and layout not in chosen:
      continue
    firsts.setdefault(layout.depth, layout)
    for jit in variants.JIT.values():
      if jit is variants.JIT_INSIDE and layout.depth == 0:
        continue  # depth 0 has no vmap to jit inside of
      if (jit is not variants.JIT_NONE and not thorough and
          firsts[layout.depth] != layout):
        continue
      cases.append(Case(f"{layout}-jit_{jit}",
                        (layout.in_axes, layout.out_axes, jit.name)))
  return cases


def _run_transform(spec: OpSpec, name: str):
  TRANSFORM_CHECKS[name](spec)


def _parity_applies(spec: OpSpec, case: Case) -> str:
  return parity_not_applicable(spec, case.args[0])


_register = families._register_builtin  # pylint: disable=protected-access

_register(families.Check(
    name="backward_parity", family="parity", run=check_backward_parity,
    params=("case",), cases=[Case(c, (c,)) for c in DTYPE_CASES],
    applies=_parity_applies))
_register(families.Check(
    name="reference_equality", family="reference",
    run=check_reference_equality, params=("case", "vmapped"),
    # The low-precision dtypes only explicitly batched in the default budget.
    cases=_both_batchings(REFERENCE_CASES, lambda i, case, vmapped: (
        not vmapped or case == "float32"))))
_register(families.Check(
    name="vmap_depth_invariance", family="vmap",
    run=check_vmap_depth_invariance, params=("in_axes", "out_axes", "jit"),
    cases=_vmap_cases,
    mixin_cases=[Case(f"{l}-jit_outside", (l.in_axes, l.out_axes, "outside"))
                 for ls in VMAP_LAYOUTS.values() for l in ls]))
_register(families.Check(
    name="example_axis_selection", family="vmap",
    run=check_example_axis_selection, params=("case",),
    cases=[Case(c, (c,)) for c in EXAMPLE_AXIS_CASES]))
_register(families.Check(
    name="checkpoint", family="transforms", run=check_checkpoint,
    params=("policy", "vmapped"),
    # Every policy once in the default budget, alternating the batching.
    cases=_both_batchings(list(variants.CHECKPOINTS),
                          lambda i, policy, vmapped: vmapped == bool(i % 2)),
    mixin_cases=[Case(f"{p}-vmap", (p, True)) for p in variants.CHECKPOINTS]))
_register(families.Check(
    name="transforms", family="transforms", run=_run_transform,
    params=("name",), cases=[Case(n, (n,)) for n in TRANSFORM_CHECKS]))
_register(families.Check(
    name="frozen", family="frozen", run=check_frozen,
    # Skipped (with the reason), not failed, when the family cannot apply:
    # an ``apply`` without ``plan=``, or parameters reshaped before the op.
    if_none_apply="skip"))
_register(families.Check(
    name="norm_bounds", family="bounds", run=check_norm_bounds,
    params=("case", "mode"),
    cases=[Case(f"{c}-{m}", (c, m)) for c in BOUND_CASES
           for m in ("norms", "per_example")]))
_register(families.Check(
    name="sharded_equals_single_device", family="sharded",
    runner="gram_haiku.conformance.test_sharded"))
_register(families.Check(
    name="random_models_match_reference", family="properties",
    runner="gram_haiku.conformance.test_properties"))


def platforms_present() -> list[str]:
  """Platforms of ``jax.devices()`` (default backend first), deduplicated."""
  seen = []
  for backend in ("cpu", "gpu", "tpu"):
    try:
      if jax.devices(backend):
        seen.append(backend)
    except RuntimeError:
      pass
  return seen


@contextlib.contextmanager
def on_platform(platform: str) -> Iterator[None]:
  """Context placing computations on ``platform``'s first device, with
  float32 matrix products at full float32 precision.

  The families check a rule's math against the reference. JAX's default
  precision lets a GPU round float32 matmul inputs to TF32 (a TPU, to
  bfloat16 passes), about 1e-3 relative, in the reference and in the
  model's own backward alike but not always in the same order; under
  ``"highest"`` both are float32 products, so a difference is the rule's.
  A no-op on CPU.
  """
  with jax.default_device(jax.devices(platform)[0]), (
      jax.default_matmul_precision("highest")):
    yield
