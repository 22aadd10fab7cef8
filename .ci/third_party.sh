#!/usr/bin/env bash
# The conformance suite as a third party runs it: the built wheel in a fresh
# venv, outside the source tree, on ops defined there (not in the repo) and
# registered by the conftest.py of the directory the commands run from:
#  1. a correct op, "mine", under python -m gram_haiku.conformance, the
#     deprecated python -m conformance and pytest --pyargs: every family
#     passes, the table has a row per family (the sharded one included) and
#     nothing of a third party's op is sampled;
#  2. an unknown op name: one message saying how to register an op;
#  3. three planted bugs next to "mine" in one run: each bug's row fails;
#  4. a check family of the third party's own (conformance.register_check):
#     its row in the table, for its op and a built-in one;
#  5. a one-line unrelated pytest run imports no JAX (the pytest11 plugin).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
python -m pip install -q --upgrade pip
# The wheel of the tree's files (tracked, or untracked and not ignored): a
# stale build/ folder of an earlier build would add modules that are gone.
python - "$root" "$work/src" <<'PY'
import os, shutil, subprocess, sys
root, dst = sys.argv[1:]
files = subprocess.run(
    ["git", "-C", root, "ls-files", "-z", "--cached", "--others",
     "--exclude-standard"], capture_output=True, check=True).stdout
for name in filter(None, files.decode().split("\0")):
  if os.path.isfile(os.path.join(root, name)):
    os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
    shutil.copy2(os.path.join(root, name), os.path.join(dst, name))
PY
python -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel="$(ls "$work"/dist/gram_haiku-*.whl)"
python -m pip install -q "${wheel}[conformance]"
mkdir "$work/project" "$work/unrelated"
cd "$work/project"
cat > my_ops.py <<'PY'
"""A third party's layer: y = x @ w + c (c a learned scalar), as a rule
with its Gram, and its spec."""
import jax
import jax.numpy as jnp

import gram_haiku
from gram_haiku import conformance


def shifted_linear(x, w, c):
  return jnp.dot(x, w) + c


def shifted_linear_gram(x, g, params, example_dim, cfg):
  del params, cfg
  acc = jnp.promote_types(x.dtype, jnp.float32)
  x = jnp.moveaxis(x, example_dim, 0).astype(acc)
  g = jnp.moveaxis(g, example_dim, 0).astype(acc)
  x = x.reshape(x.shape[0], -1, x.shape[-1])
  g = g.reshape(g.shape[0], -1, g.shape[-1])
  hi = jax.lax.Precision.HIGHEST
  kx = jnp.einsum("itn,jsn->ijts", x, x, precision=hi)
  kg = jnp.einsum("itm,jsm->ijts", g, g, precision=hi)
  gc = g.sum(axis=(1, 2))  # dL_i/dc
  return jnp.sum(kx * kg, axis=(2, 3)) + jnp.outer(gc, gc)


RULE = gram_haiku.Rule(forward=shifted_linear, param_names=("w", "c"),
                       gram=shifted_linear_gram)

conformance.register(conformance.OpSpec.from_rule(
    RULE, name="mine",
    make_params=lambda key, dtype: {
        "w": jax.random.normal(key, (4, 3)).astype(dtype),
        "c": jnp.asarray(0.5, dtype)},
    make_example=lambda key, lead, dtype: jax.random.normal(
        key, lead + (4,)).astype(dtype)))
PY
cat > buggy_ops.py <<'PY'
"""Three planted bugs, each in a third party's linear rule y = x @ w + b
written with the public API (gram_haiku.Rule), registered in one run."""
import jax
import jax.numpy as jnp

import gram_haiku
from gram_haiku import conformance

HI = jax.lax.Precision.HIGHEST


def forward(x, w, b):
  return jnp.dot(x, w) + b


def _rows(x, g, example_dim):
  """x, g as [B, T, features] in float32 (T: the within-example positions)."""
  x = jnp.moveaxis(x, example_dim, 0).astype(jnp.float32)
  g = jnp.moveaxis(g, example_dim, 0).astype(jnp.float32)
  return (x.reshape(x.shape[0], -1, x.shape[-1]),
          g.reshape(g.shape[0], -1, g.shape[-1]))


def gram(x, g, params, example_dim, cfg):
  del params, cfg
  x, g = _rows(x, g, example_dim)
  kx = jnp.einsum("itn,jsn->ijts", x, x, precision=HI)
  kg = jnp.einsum("itm,jsm->ijts", g, g, precision=HI)
  gb = g.sum(axis=1)
  return jnp.sum(kx * kg, axis=(2, 3)) + jnp.dot(gb, gb.T, precision=HI)


def per_example(x, g, params, example_dim):
  """[B, P] per-example gradients of (w, b), float32."""
  x, g = _rows(x, g, example_dim)
  dw = jnp.einsum("itn,itm->inm", x, g, precision=HI)
  return jnp.concatenate([dw.reshape(dw.shape[0], -1), g.sum(axis=1)], 1)


def fused_float32_grads(x, g, params, example_dim, mode, wanted, cfg):
  """BUG: the parameters' gradients it provides are float32 whatever the
  parameters' dtype (they must be in params[i]'s dtype)."""
  del cfg
  f = per_example(x, g, params, example_dim)
  value = {"gram": lambda: jnp.dot(f, f.T, precision=HI),
           "norms": lambda: jnp.sum(f * f, axis=1),
           "per_example": lambda: f}[mode]()
  n = params[0].size
  sums = {0: f[:, :n].sum(0).reshape(params[0].shape), 1: f[:, n:].sum(0)}
  return value, {i: sums[i] for i in wanted}


def norms_as_trace(x, g, params, example_dim, cfg):
  """BUG: every example's squared norm is the Gram's trace."""
  gm = gram(x, g, params, example_dim, cfg)
  return jnp.full(gm.shape[:1], jnp.trace(gm))


def gram_without_cross_terms(x, g, params, example_dim, cfg):
  """BUG: sums the Grams of each position (drops the cross terms)."""
  del params, cfg
  x, g = _rows(x, g, example_dim)
  kx = jnp.einsum("itn,jtn->ijt", x, x, precision=HI)
  kg = jnp.einsum("itm,jtm->ijt", g, g, precision=HI)
  return jnp.sum(kx * kg + kg, axis=2)


BUGS = {
    "bug_dtype": dict(probe_cotangent_and_grads=fused_float32_grads),
    "bug_trace": dict(gram=gram, sq_norms=norms_as_trace),
    "bug_cross": dict(gram=gram_without_cross_terms),
}


def _register(name, functions):
  rule = gram_haiku.Rule(forward=forward, param_names=("w", "b"),
                         feature_ndim=1, **functions)
  conformance.register(conformance.OpSpec.from_rule(
      rule, name=name,
      make_params=lambda key, dtype: {
          "w": jax.random.normal(key, (4, 3)).astype(dtype),
          "b": jnp.linspace(-1, 1, 3).astype(dtype)},
      make_example=lambda key, lead, dtype: jax.random.normal(
          key, lead + (4,)).astype(dtype)))


for _name, _functions in BUGS.items():
  _register(_name, _functions)
PY
cat > conftest.py <<'PY'
import my_ops  # registers the op "mine"
PY
# Families every op has a row for in the table.
families="frozen parity properties reference sharded transforms vmap"

# row LOG OP FAMILY: the status of the table's row (cpu), e.g. "pass".
row() {
  python - "$@" <<'PY'
import sys
log, op, family = sys.argv[1:]
text = open(log).read()
assert "Conformance summary" in text, f"{log}: no summary table"
for line in text.split("Conformance summary")[1].splitlines()[3:]:
  cells = line.split()
  if cells[:3] == [op, family, "cpu"]:
    print(" ".join(cells[8:]))
    break
else:
  sys.exit(f"{log}: no row for {op} {family}:\n{text[-4000:]}")
PY
}

expect_row() {  # LOG OP FAMILY STATUS
  local got
  got="$(row "$1" "$2" "$3")"
  if [ "$got" != "$4" ]; then
    echo "third_party.sh: $1: row $2 $3 is '$got', expected '$4'" >&2
    tail -n 60 "$1" >&2
    exit 1
  fi
  echo "  $2 $3: $got"
}

echo "== 1. python -m gram_haiku.conformance --ops mine"
python -m gram_haiku.conformance --ops mine -n 2 -rs > new_cli.log 2>&1 || {
  tail -n 80 new_cli.log; exit 1; }
for family in $families; do expect_row new_cli.log mine "$family" pass; done
grep -q "^0 cases deselected" new_cli.log

echo "== 1. python -m conformance --ops mine (deprecated spelling)"
python -m conformance --ops mine -n 2 > old_cli.log 2>&1 || {
  tail -n 80 old_cli.log; exit 1; }
grep -q "DeprecationWarning: python -m conformance is deprecated" old_cli.log
expect_row old_cli.log mine sharded pass

echo "== 1. pytest --pyargs gram_haiku.conformance --conformance-ops mine"
python -m pytest --pyargs gram_haiku.conformance --conformance-ops mine \
  -n 2 -v -p no:cacheprovider -rs > pyargs.log 2>&1 || {
  tail -n 80 pyargs.log; exit 1; }
sharded="$(grep -c "PASSED.*test_sharded_equals_single_device\[mine-" \
  pyargs.log || true)"
[ "$sharded" = 3 ] || { echo "pyargs: $sharded sharded cases passed" >&2;
  tail -n 80 pyargs.log; exit 1; }
python -m pytest --pyargs conformance --conformance-ops mine --collect-only \
  -q -p no:cacheprovider > old_pyargs.log 2>&1 || {
  tail -n 40 old_pyargs.log; exit 1; }
grep -q "test_sharded_equals_single_device\[mine-cpu-shard_map\]" \
  old_pyargs.log

echo "== 2. an unknown op"
status=0
python -m gram_haiku.conformance --ops nope -n 2 > unknown.log 2>&1 || \
  status=$?
[ "$status" = 4 ] || { echo "unknown op: exit $status" >&2; cat unknown.log;
  exit 1; }
grep -q "no op is registered as 'nope'" unknown.log
grep -q "conformance.register(conformance.OpSpec(" unknown.log
if grep -q "Traceback\|length-zero" unknown.log; then
  cat unknown.log; exit 1
fi

echo "== 3. planted bugs, in one run with the correct op"
cat > conftest.py <<'PY'
import buggy_ops  # registers bug_dtype, bug_trace, bug_cross
import my_ops  # registers the op "mine"
PY
status=0
python -m gram_haiku.conformance --ops mine,bug_dtype,bug_trace,bug_cross \
  -n 2 > bugs.log 2>&1 || status=$?
[ "$status" = 1 ] || { echo "planted bugs: exit $status" >&2;
  tail -n 80 bugs.log; exit 1; }
for family in $families; do expect_row bugs.log mine "$family" pass; done
expect_row bugs.log bug_dtype parity FAIL   # float32 gradients of bf16 weights
expect_row bugs.log bug_trace transforms FAIL   # norms mode
expect_row bugs.log bug_cross reference FAIL
expect_row bugs.log bug_cross vmap FAIL
grep -q "^0 cases deselected" bugs.log

echo "== 4. a third party's own check family"
cat > my_family.py <<'PY'
"""A family of the third party's own: the Gram is finite, jit or not."""
import jax
import jax.numpy as jnp

from gram_haiku import conformance
from gram_haiku.conformance import variants


def check_finite_gram(spec, jit):
  params = spec.make_params(jax.random.PRNGKey(0), jnp.float32)
  x = spec.make_example(jax.random.PRNGKey(1), (4, 2), jnp.float32)
  loss = lambda probe: jnp.sum(spec.apply(params, probe, x) ** 2)
  gram = variants.JIT[jit].around_grad(jax.grad(loss))(jnp.zeros((4, 4)))
  assert bool(jnp.all(jnp.isfinite(gram))), spec.name


conformance.register_check(conformance.Check(
    name="finite_gram", family="finite", run=check_finite_gram,
    params=("jit",),
    cases=[conformance.Case(f"jit_{j}", (j,)) for j in ("none", "outside")]))
PY
cat > conftest.py <<'PY'
import my_family  # registers the family "finite"
import my_ops  # registers the op "mine"
PY
python -m gram_haiku.conformance --ops mine,linear -k finite_gram -n 2 \
  > family.log 2>&1 || { tail -n 80 family.log; exit 1; }
expect_row family.log mine finite pass
expect_row family.log linear finite pass

echo "== 5. a one-line unrelated test imports no JAX"
cd "$work/unrelated"
cat > test_one.py <<'PY'
import sys


def test_one():
  heavy = {"jax", "numpy", "haiku", "gram_haiku._src"} & set(sys.modules)
  assert not heavy, heavy
PY
python -m pytest -q -p no:cacheprovider -p no:xdist test_one.py
python - <<'PY'
import sys
import pytest
assert pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                    "test_one.py"]) == 0
assert "gram_haiku.conformance.plugin" in sys.modules  # the entry point
heavy = {"jax", "numpy", "haiku", "gram_haiku._src"} & set(sys.modules)
assert not heavy, heavy  # also after the run's summary hooks
PY
echo "third_party.sh: all passed"
