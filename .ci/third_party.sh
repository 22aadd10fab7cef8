#!/usr/bin/env bash
# The conformance suite as a third party runs it: the built wheel in a fresh
# venv, outside the source tree, on an op defined there (not in the repo).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
. "$work/venv/bin/activate"
python -m pip install -q --upgrade pip
python -m pip wheel -q --no-deps -w "$work/dist" "$root"
wheel="$(ls "$work"/dist/gram_haiku-*.whl)"
python -m pip install -q "${wheel}[conformance]"
mkdir "$work/project"
cd "$work/project"
cat > my_ops.py <<'PY'
"""A third party's op: y = x @ w + c (c a learned scalar), with its Gram."""
import jax
import jax.numpy as jnp

import conformance
import gram_haiku


class ShiftedLinearOp(gram_haiku.GramOp):
  param_names = ("w", "c")
  feature_ndim = 1

  def forward(self, x, w, c):
    return jnp.dot(x, w) + c

  def gram(self, x, g, params, example_dim, cfg):
    del cfg
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


def shifted_linear(x, w, c, probe, **kwargs):
  kwargs.setdefault("name", "shifted_linear")
  return ShiftedLinearOp.apply(x, (w, c), probe, **kwargs)


conformance.register(conformance.OpSpec(
    name="mine",
    make_params=lambda key, dtype: {
        "w": jax.random.normal(key, (4, 3)).astype(dtype),
        "c": jnp.asarray(0.5, dtype)},
    make_example=lambda key, lead, dtype: jax.random.normal(
        key, lead + (4,)).astype(dtype),
    apply=lambda p, probe, x, **kw: shifted_linear(x, p["w"], p["c"], probe,
                                                   **kw),
    plain=lambda p, x: jnp.dot(x, p["w"]) + p["c"]))
PY
cat > conftest.py <<'PY'
import my_ops  # registers the op "mine"
PY
python -m pytest --pyargs conformance --conformance-ops mine -n 2 -q \
  -p no:cacheprovider -rs
