"""Real-world cases from shared/cases/CASES.md that concern linear layers.

C09 (reuse), C04 (RNN weight reuse) and C16 (inner hk.vmap) have tests in
test_track.py; C10 (mean vs sum) and C12 (explicit operands) too.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import gram_haiku
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import jacobian_gram
from gram_haiku._src.core.reference import reference_gram
from gram_haiku._src.ops import linear as linear_op
from gram_haiku._src.ops import op as op_lib
from gram_haiku.ops import gram_linear
from tests import problems


def _mlp_problem(seed, b=6):
  def net(x):
    return hk.Linear(4)(jnp.tanh(hk.Linear(16)(x)))
  k = jax.random.split(jax.random.PRNGKey(seed), 2)
  x = problems.normal(k[0], (b, 10))
  y = problems.normal(k[1], (b, 4))
  return net, x, y


def test_c02_transform_order_invariance_and_custom_path_runs(monkeypatch):
  net, x, y = _mlp_problem(0)
  def tracked(x, y):
    with gram_haiku.track():
      return 0.5 * jnp.sum((net(x) - y) ** 2)
  f = hk.transform_with_state(tracked)
  g = hk.without_apply_rng(hk.transform(
      lambda x, y: 0.5 * jnp.sum((net(x) - y) ** 2)))
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  ref = reference_gram(g.apply, params, x, y)
  # Second, independent reference: jacrev of the per-example loss vector.
  def losses(p):
    return jax.vmap(lambda xi, yi: g.apply(p, xi[None], yi[None]))(x, y)
  jac_ref = jacobian_gram(losses, params)
  np.testing.assert_allclose(ref, jac_ref, rtol=1e-4, atol=1e-6)
  # The Gram rule must actually run: count backward-rule calls.
  calls = []
  orig = op_lib.RuleOp.vjp_bwd
  def counting(self, *a):
    if self.rule.forward.func is linear_op.linear_forward:
      calls.append(self.name)
    return orig(self, *a)
  monkeypatch.setattr(op_lib.RuleOp, "vjp_bwd", counting)
  # Order 1: grad(sum o vmap): the whole batch in one backward pass.
  def batched(x, y):
    with gram_haiku.track():
      out = hk.vmap(net, split_rng=False)(x)
    return 0.5 * jnp.sum((out - y) ** 2)
  fb = hk.transform_with_state(batched)
  _, _, grams = gram_haiku.value_grad_and_gram(fb.apply)(params, state, None,
                                                          x, y)
  assert_gram_close(grams.total, ref)
  assert_gram_close(grams.total, jac_ref)
  assert len(calls) >= 2
  # Order 2: vmap(grad): each backward pass sees one example, 1x1 Grams.
  calls.clear()
  one = gram_haiku.resize_probes(state, 1)
  def per_example(xi, yi):
    return gram_haiku.value_grad_and_gram(f.apply)(params, one, None,
                                                   xi[None], yi[None])[2].total
  per = jax.vmap(per_example)(x, y)
  np.testing.assert_allclose(per[:, 0, 0], np.diag(ref), rtol=1e-4)
  assert len(calls) >= 2


def test_c02_nan_example_only_poisons_its_row_and_column():
  net, x, y = _mlp_problem(1)
  bad = 2
  def tracked(x, y):
    with gram_haiku.track():
      out = net(x)
    per_ex = 0.5 * jnp.sum((out - y) ** 2, axis=-1)
    # Example `bad` gets log(1 + exp(50 z)) with z ~ 2 in float32: overflows.
    is_bad = jnp.arange(x.shape[0]) == bad
    z = jnp.where(is_bad, 2.0 + 1e-3 * out[:, 0], 0.0)  # exp(100) overflows
    extra = jnp.where(is_bad, jnp.log(1 + jnp.exp(50 * z)), 0.0)
    return jnp.sum(per_ex + extra)
  f = hk.transform_with_state(tracked)
  params, state = jax.jit(f.init)(jax.random.PRNGKey(0), x, y)
  _, _, grams = gram_haiku.value_grad_and_gram(f.apply)(params, state, None,
                                                         x, y)
  total = np.asarray(grams.total)
  keep = np.array([i for i in range(6) if i != bad])
  assert not np.isfinite(total[bad]).all()
  assert not np.isfinite(total[:, bad]).all()
  assert np.isfinite(total[np.ix_(keep, keep)]).all()
  g = hk.without_apply_rng(hk.transform(
      lambda x, y: 0.5 * jnp.sum((net(x) - y) ** 2)))
  ref = reference_gram(g.apply, params, x[keep], y[keep])
  assert_gram_close(total[np.ix_(keep, keep)], ref)


def test_c03_all_orders_run():
  k = jax.random.split(jax.random.PRNGKey(3), 4)
  x = problems.normal(k[0], (4, 3))
  w = problems.normal(k[1], (3, 2))
  b = problems.normal(k[2], (2,))
  ct = problems.normal(k[3], (4, 2))
  probe = jnp.zeros((4, 4))
  lin = lambda xi, w, b, p: gram_linear(xi, w, b, p)
  f = jax.vmap(lin, in_axes=(0, None, None, None))
  # vjp(vmap(f))
  _, pull = jax.vjp(f, x, w, b, probe)
  dx, dw, db, gram = pull(ct)
  np.testing.assert_allclose(dw, x.T @ ct, rtol=1e-5)
  np.testing.assert_allclose(db, ct.sum(0), rtol=1e-5)
  np.testing.assert_allclose(dx, ct @ w.T, rtol=1e-5)
  per = jnp.concatenate([jnp.einsum("in,im->inm", x, ct).reshape(4, -1), ct],
                        axis=1)
  assert_gram_close(gram, per @ per.T)
  # vmap(vjp(f)): per example, a 1x1 Gram each.
  def one(xi, cti):
    _, pull = jax.vjp(lambda xi_, w_, b_, p_: lin(xi_[None], w_, b_, p_)[0],
                      xi, w, b, jnp.zeros((1, 1)))
    return pull(cti)
  dxs, dws, dbs, grams1 = jax.vmap(one)(x, ct)
  np.testing.assert_allclose(dws.sum(0), x.T @ ct, rtol=1e-5)
  np.testing.assert_allclose(grams1[:, 0, 0], np.diag(per @ per.T), rtol=1e-5)
  # grad(sum o vmap(f))
  gram2 = jax.grad(lambda p: jnp.sum(f(x, w, b, p) * ct))(probe)
  assert_gram_close(gram2, per @ per.T)
