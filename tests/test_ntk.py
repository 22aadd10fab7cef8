"""``gram_haiku.empirical_ntk`` against ``jax.jacrev`` of the untracked
model, float64, with neural-tangents' ``trace_axes`` / ``diagonal_axes``
layout: ``zip(f(x1).shape, f(x2).shape)``, traced pairs absent, diagonal
pairs once."""

import contextlib

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from tests import problems


def _mlp(x):
  return hk.Linear(3)(jnp.tanh(hk.Linear(5)(x)))


def _cnn(x):
  h = jax.nn.gelu(hk.Conv2D(3, 3, padding="VALID")(x))
  return hk.Linear(3)(h.reshape(h.shape[0], -1))


def _attention(x):
  """Per-token outputs ``[N, T, 2]``: two output axes."""
  a = hk.LayerNorm(-1, True, True)(x)
  h = x + hk.MultiHeadAttention(2, 2, w_init=hk.initializers.VarianceScaling(
      1.0))(a, a, a)
  return hk.Linear(2)(h)


def _lstm(x):
  core = hk.LSTM(4)
  out, _ = hk.dynamic_unroll(core, jnp.swapaxes(x, 0, 1),
                             core.initial_state(x.shape[0]))
  return hk.Linear(2)(out[-1])


def _shared(x):
  """One layer applied twice: the kernel's cross terms between the uses."""
  layer = hk.Linear(4)
  return hk.Linear(2)(jnp.tanh(layer(jnp.tanh(layer(x)))))


def _bare(x):
  """Bare parameters broadcast over the examples (a scale, an offset):
  covered by program rules, not modules."""
  h = jnp.tanh(hk.Linear(4)(x))
  return (h * hk.get_parameter("scale", [4], x.dtype, init=jnp.ones) +
          hk.get_parameter("offset", [4], x.dtype, init=jnp.zeros))


# name -> (model, example shape)
MODELS = {
    "mlp": (_mlp, (6,)),
    "cnn": (_cnn, (5, 5, 2)),
    "attention": (_attention, (3, 4)),
    "lstm": (_lstm, (3, 2)),
    "shared": (_shared, (4,)),
    "bare": (_bare, (5,)),
}


def _transformed(model, tracked: bool):
  def f(x):
    with gram_haiku.track() if tracked else contextlib.nullcontext():
      return model(x)
  return hk.transform_with_state(f)


def _problem(name, n1=3, n2=2, dtype=jnp.float64):
  model, shape = MODELS[name]
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(len(name)), 3)
  x1 = jax.random.normal(k1, (n1,) + shape, dtype)
  x2 = jax.random.normal(k2, (n2,) + shape, dtype)
  tracked = _transformed(model, True)
  params, state = jax.jit(tracked.init)(k3, x1)
  plain = _transformed(model, False)
  return tracked, plain, params, state, x1, x2


def _jacobian(plain, params, x):
  """``[N, *O, P]``: every output entry's flattened parameter gradient."""
  def out(p):
    return plain.apply(p, {}, None, x)[0]
  @jax.jit
  def flat(p):
    y, jac = out(p), jax.jacrev(out)(p)
    return jnp.concatenate([j.reshape(y.shape + (-1,))
                            for j in jax.tree.leaves(jac)], axis=-1)
  return flat(params)


def _assert_kernel(got, want):
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_allclose(got, want, rtol=1e-10,
                             atol=1e-12 * np.abs(want).max())


@pytest.mark.parametrize("name", ["cnn", "lstm", "shared", "bare"])
def test_the_full_kernel_matches_jacrev(name):
  """(The MLP's layouts, the attention model's two output axes: below.)"""
  with jax.enable_x64(True):
    tracked, plain, params, state, x1, x2 = _problem(name)
    j1, j2 = _jacobian(plain, params, x1), _jacobian(plain, params, x2)
    ntk = jax.jit(gram_haiku.empirical_ntk(tracked.apply, trace_axes=()))
    _assert_kernel(np.asarray(ntk(params, state, x1, x2)),
                   np.einsum("iap,jbp->ijab", np.asarray(j1), np.asarray(j2)))


def test_one_output_axis_in_each_layout():
  """Output ``[N, K]``: the default traces the logits (``[N1, N2]``);
  ``trace_axes=1`` is the same axis; a diagonal pair stays once."""
  with jax.enable_x64(True):
    tracked, plain, params, state, x1, x2 = _problem("mlp")
    full = np.einsum("iap,jbp->ijab",
                     np.asarray(_jacobian(plain, params, x1)),
                     np.asarray(_jacobian(plain, params, x2)))
    for trace, diagonal, spec in [((-1,), (), "ijaa->ij"),
                                  ((1,), (), "ijaa->ij"),
                                  ((), (-1,), "ijaa->ija")]:
      ntk = gram_haiku.empirical_ntk(tracked.apply, trace_axes=trace,
                                     diagonal_axes=diagonal)
      _assert_kernel(np.asarray(ntk(params, state, x1, x2)),
                     np.einsum(spec, full))


def test_one_number_per_example_is_the_pair_kernel_by_default():
  """Output ``[N]`` (a regression head): the default traces no axis (the
  last is the examples'), so the kernel is ``[N1, N2]``, not the trace
  over the batch that ``trace_axes=(-1,)`` asks for."""
  with jax.enable_x64(True):
    MODELS["scalar"] = (lambda x: _mlp(x)[:, 0], (6,))
    try:
      tracked, plain, params, state, x1, x2 = _problem("scalar")
    finally:
      del MODELS["scalar"]
    want = np.einsum("ip,jp->ij", np.asarray(_jacobian(plain, params, x1)),
                     np.asarray(_jacobian(plain, params, x2)))
    ntk = gram_haiku.empirical_ntk(tracked.apply)
    _assert_kernel(np.asarray(ntk(params, state, x1, x2)), want)


def test_two_output_axes_and_the_batch_diagonal():
  with jax.enable_x64(True):
    tracked, plain, params, state, x1, x2 = _problem("attention")
    j1, j2 = _jacobian(plain, params, x1), _jacobian(plain, params, x2)
    # j: [N, T, K, P]; the full kernel in zip layout [N1, N2, T1, T2, K1, K2].
    full = np.einsum("itap,jubp->ijtuab", np.asarray(j1), np.asarray(j2))
    self_full = np.einsum("itap,jubp->ijtuab", np.asarray(j1), np.asarray(j1))
    # (Every layout is one einsum of the same kernel: two cover a traced
    # pair of axes, a kept diagonal pair and the batch diagonal.)
    cases = [
        ((-1, 1), (), None, full, "ijttaa->ij"),
        ((-1,), (0, -2), x1, self_full, "iittaa->it"),
    ]
    for trace, diagonal, same, ref, spec in cases:
      ntk = jax.jit(gram_haiku.empirical_ntk(
          tracked.apply, trace_axes=trace, diagonal_axes=diagonal))
      got = np.asarray(ntk(params, state, x1, None if same is not None
                           else x2))
      _assert_kernel(got, np.einsum(spec, ref))


def test_x2_none_is_x1_with_itself_and_symmetric():
  with jax.enable_x64(True):
    tracked, plain, params, state, x1, _ = _problem("mlp", n1=4)
    j = np.asarray(_jacobian(plain, params, x1))
    got = np.asarray(gram_haiku.empirical_ntk(tracked.apply, trace_axes=())(
        params, state, x1))
    np.testing.assert_allclose(got, np.einsum("iap,jbp->ijab", j, j),
                               rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(got, got.transpose(1, 0, 3, 2), rtol=1e-12)


def test_bad_axes_and_batches_are_refused():
  tracked, _, params, state, x1, x2 = _problem("mlp", dtype=jnp.float32)
  for kwargs in ({"trace_axes": (2,)}, {"trace_axes": (-1, 1)},
                 {"trace_axes": (-1,), "diagonal_axes": (1,)}):
    with pytest.raises(ValueError, match="do not name distinct axes"):
      gram_haiku.empirical_ntk(tracked.apply, **kwargs)(params, state, x1)
  with pytest.raises(ValueError, match="x1 has 3 examples and x2 2"):
    gram_haiku.empirical_ntk(tracked.apply, diagonal_axes=(0,))(
        params, state, x1, x2)
  with pytest.raises(ValueError, match="examples on axis 0"):
    gram_haiku.empirical_ntk(tracked.apply)(params, state, x1, (x2, x2[:1]))


def test_a_parameter_outside_every_tracked_layer_is_refused():
  """(A bare parameter broadcast over the examples, e.g. a learned scale,
  or in a matmul, is covered by a program rule; see
  tests/test_program_rules.py.)"""
  def f(x):
    with gram_haiku.track():
      h = hk.Linear(3)(x)
    # A bare weight in a matmul with a custom derivative: no module rule
    # and no program rule.
    return problems.uncovered_matmul(
        h, hk.get_parameter("mix", [3, 3], init=jnp.ones))
  t = hk.transform_with_state(f)
  x = jnp.ones((2, 4))
  params, state = t.init(jax.random.PRNGKey(0), x)
  with pytest.raises(ValueError, match=r"parameters ~/mix are read outside"):
    gram_haiku.empirical_ntk(t.apply)(params, state, x)


def test_an_int_axis_is_that_one_axis():
  """``trace_axes=0`` (an int, as neural-tangents takes it) traces the
  batch pair: not the untraced kernel (0 is falsy), not a TypeError; and
  ``trace_axes=-1``, ``diagonal_axes=-1`` (a numpy integer too) are the
  one-axis tuples."""
  with jax.enable_x64(True):
    tracked, plain, params, state, x1, _ = _problem("mlp")
    j = np.asarray(_jacobian(plain, params, x1))
    full = np.einsum("iap,jbp->ijab", j, j)
    for trace, diagonal, spec in [(0, (), "iiab->ab"), (-1, (), "ijaa->ij"),
                                  ((), -1, "ijaa->ija"), ((), 0, "iiab->iab"),
                                  (np.int64(-1), (), "ijaa->ij")]:
      ntk = gram_haiku.empirical_ntk(tracked.apply, trace_axes=trace,
                                     diagonal_axes=diagonal)
      _assert_kernel(np.asarray(ntk(params, state, x1, x1)),
                     np.einsum(spec, full))


def test_a_traced_batch_axis_needs_as_many_examples_in_x2():
  tracked, _, params, state, x1, x2 = _problem("mlp", dtype=jnp.float32)
  with pytest.raises(ValueError, match="trace_axes includes the example "
                     "axis 0.*x1 has 3 examples and x2 2"):
    gram_haiku.empirical_ntk(tracked.apply, trace_axes=(0, -1))(
        params, state, x1, x2)


def test_an_x2_of_another_dtype_is_refused():
  """``x2`` is appended to ``x1``: a bfloat16 ``x2`` next to a float32
  ``x1`` (or the other way) would promote one of them, a kernel of another
  model; it is refused, naming both dtypes."""
  tracked, _, params, state, x1, x2 = _problem("mlp", dtype=jnp.float32)
  ntk = gram_haiku.empirical_ntk(tracked.apply)
  with pytest.raises(ValueError, match=r"x2 must have x1's structure and "
                     r"dtypes.*float32.*bfloat16"):
    ntk(params, state, x1, x2.astype(jnp.bfloat16))
