"""An eager call of a returned callable runs as one compiled program
(gram_haiku/_src/core/one_program.py)."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gram_haiku
from gram_haiku import testing
from gram_haiku._src.core import one_program
from tests import problems


def _model():
  traces = []

  def loss(x, y, is_training):
    traces.append(is_training)
    with gram_haiku.track():
      h = hk.Linear(5)(x)
    h = jax.nn.relu(h) if is_training else jnp.tanh(h)  # A Python branch.
    with gram_haiku.track():
      out = hk.Linear(2)(h)
    return problems.sq(out, y)

  f = hk.transform_with_state(loss)
  x, y = problems.data(3, (6, 4), 2)
  params, state = f.init(jax.random.PRNGKey(0), x, y, True)
  traces.clear()  # (init's)
  return f, params, state, x, y, traces


def _reference(f, params, x, y, is_training):
  def one(p, x1, y1):
    return f.apply(p, {}, None, x1, y1, is_training)[0]
  return testing.reference_gram(one, params, x, y)


@pytest.mark.parametrize("is_training", [True, False])
def test_an_eager_call_is_one_program_with_python_values_static(is_training):
  """The Gram of an eager call is the reference's, a Python bool argument
  reaches the model as a bool (its branch taken as eagerly), and a second
  call with the same shapes traces nothing."""
  f, params, state, x, y, traces = _model()
  fn = gram_haiku.value_grad_and_gram(f.apply)
  _, _, grams = fn(params, state, None, x, y, is_training)
  testing.assert_gram_close(grams.total,
                            _reference(f, params, x, y, is_training))
  assert traces and all(t is is_training for t in traces)
  n = len(traces)
  _, _, again = fn(params, state, None, x + 1.0, y, is_training)
  assert len(traces) == n  # Compiled once: the new values only ran.
  testing.assert_gram_close(again.total,
                            _reference(f, params, x + 1.0, y, is_training))


def test_inside_a_trace_it_is_the_function_itself():
  """Under jit the wrapper adds no inner jit (the arguments are tracers),
  and an unhashable static leaf runs the call eagerly, op by op."""
  seen = []

  def fn(a, scale):
    seen.append(isinstance(a, jax.core.Tracer))
    return a * scale[0] if isinstance(scale, list) else a * scale

  wrapped = one_program.compiled_when_eager(fn)
  a = jnp.arange(3.0)
  np.testing.assert_array_equal(wrapped(a, 2.0), a * 2.0)
  assert seen == [True]  # Traced once by the wrapper's jit.
  np.testing.assert_array_equal(jax.jit(wrapped)(a, 3.0), a * 3.0)
  assert seen == [True, True]  # The outer jit's trace only.

  class Unhashable:
    __hash__ = None

    def __init__(self, v):
      self.v = v

    def __mul__(self, other):
      return other * self.v

    __rmul__ = __mul__

  np.testing.assert_array_equal(wrapped(a, Unhashable(4.0)), a * 4.0)
  assert seen[-1] is False  # Eager: concrete arrays.


def test_a_python_int_and_float_are_not_one_static_value():
  """1, 1.0 and True hash alike: each is its own compiled program."""
  fn = one_program.compiled_when_eager(
      lambda a, s: a * s if not isinstance(s, bool) else a + 100)
  a = jnp.ones((2,), jnp.float32)
  np.testing.assert_array_equal(fn(a, 1), a)
  np.testing.assert_array_equal(fn(a, True), a + 100)
  np.testing.assert_array_equal(fn(a, 1.0), a)


def test_a_python_number_that_keeps_changing_warns_once_naming_it(
    recwarn):
  """An eager caller passing a new step counter each call compiles a
  program per value: from the RECOMPILES-th value on one
  RecompileWarning names the argument (a keyword here) and says to pass an
  array, which then reuses one program. Other static values (a changing
  bool, an op object) and calls of other shapes do not count."""
  traces = []

  def fn(a, scale, *, step, flag):
    traces.append(step)
    return a * scale + step if flag else a

  wrapped = one_program.compiled_when_eager(fn)
  a = jnp.ones((3,), jnp.float32)
  for k in range(one_program.RECOMPILES - 1):
    np.testing.assert_array_equal(wrapped(a, 2.0, step=k, flag=True),
                                  a * 2.0 + k)
    np.testing.assert_array_equal(wrapped(a, 2.0, step=k, flag=False), a)
    wrapped(jnp.ones((k + 1,)), 2.0, step=0, flag=True)  # Other shapes.
  assert not [w for w in recwarn if issubclass(
      w.category, gram_haiku.RecompileWarning)]
  for k in range(3):  # The eighth value warns; later ones do not again.
    wrapped(a, 2.0, step=100 + k, flag=True)
  caught = [w for w in recwarn
            if issubclass(w.category, gram_haiku.RecompileWarning)]
  assert len(caught) == 1, [str(w.message) for w in caught]
  message = str(caught[0].message)
  assert "kwargs['step']" in message and "jnp.asarray" in message, message
  assert "scale" not in message and "flag" not in message, message
  assert caught[0].filename == __file__  # The caller's line.
  n = len(traces)
  for k in range(5):  # As an array: one program for every value.
    np.testing.assert_array_equal(
        wrapped(a, 2.0, step=jnp.asarray(k), flag=True), a * 2.0 + k)
  assert len(traces) == n + 1


def test_a_call_that_needs_values_runs_eagerly_as_before():
  """A ``weight_fn`` that reads the Grams with NumPy cannot be traced; the
  eager call runs it op by op as before (its weights those of the same
  function in jax.numpy, under jit), and later calls skip the trace."""
  f, params, state, x, y, traces = _model()
  np_weights = lambda g: np.asarray(1 / (1 + np.asarray(g.norms)), np.float32)
  fn = gram_haiku.reweighted_grad(f.apply, np_weights)
  _, grads, _, c = fn(params, state, None, x, y, True)
  first = len(traces)
  _, want_grads, _, want_c = jax.jit(gram_haiku.reweighted_grad(
      f.apply, lambda g: 1 / (1 + g.norms)), static_argnums=5)(
          params, state, None, x, y, True)
  np.testing.assert_allclose(c, want_c, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5),
               grads, want_grads)
  traces.clear()
  fn(params, state, None, x, y, True)
  assert 0 < len(traces) < first  # Eager at once: no failed trace first.


def _recording_products(monkeypatch):
  """Records, for each call of ``modes.backward_products``, whether it ran
  inside a trace (its input a tracer)."""
  from gram_haiku._src.ops import adapter  # pylint: disable=g-import-not-at-top
  from gram_haiku._src.ops import modes  # pylint: disable=g-import-not-at-top
  calls, products = [], modes.backward_products

  def recording(op, x, *args, **kwargs):
    calls.append(isinstance(x, jax.core.Tracer))
    return products(op, x, *args, **kwargs)
  # (Wrapped afresh: a cache of its own.)
  monkeypatch.setattr(adapter, "_backward_products",
                      one_program.compiled_when_eager(recording))
  return calls


def test_an_eager_backward_of_a_bound_op_forms_its_products_in_one_program(
    monkeypatch):
  """``jax.grad`` outside ``jit`` through a Gram op: the probe's cotangent
  is formed by one traced program (compiled once for two calls with the
  same shapes), and equals the reference."""
  calls = _recording_products(monkeypatch)
  x = problems.normal(jax.random.PRNGKey(5), (5, 3, 4))
  w = problems.normal(jax.random.PRNGKey(6), (4, 2))

  def loss(probe, x):
    return jnp.sum(jnp.tanh(gram_haiku.ops.gram_linear(x, w, None, probe)))
  grams = [jax.grad(loss)(jnp.zeros((5, 5)), x) for _ in range(2)]
  assert calls == [True], calls
  ref = testing.reference_gram(
      lambda w, xi: jnp.sum(jnp.tanh(xi @ w)), w, x)
  for gram in grams:
    testing.assert_gram_close(gram, ref)


def test_an_eager_backward_whose_rule_reads_values_runs_op_by_op(
    monkeypatch):
  """A rule that reads its arrays' values in Python cannot be traced: its
  eager backward falls back to running op by op, with the same Gram."""
  calls = _recording_products(monkeypatch)

  def reads_values(x, g, params, example_dim, cfg):
    del params, cfg
    assert float(jnp.abs(x).max()) >= 0.  # A concrete value, in Python.
    x = jnp.moveaxis(x, example_dim, 0)
    g = jnp.moveaxis(g, example_dim, 0)
    per = jnp.einsum("btn,btm->bnm", x, g).reshape(x.shape[0], -1)
    return per @ per.T
  rule = gram_haiku.Rule(forward=lambda x, w: x @ w, param_names=("w",),
                         gram=reads_values)
  x = problems.normal(jax.random.PRNGKey(7), (3, 2, 4))
  w = problems.normal(jax.random.PRNGKey(8), (4, 2))

  def loss(probe):
    return jnp.sum(jnp.tanh(gram_haiku.ops.bind(rule, x, (w,), probe,
                                                name="reads")))
  gram = jax.grad(loss)(jnp.zeros((3, 3)))
  assert calls == [True, False], calls  # Tried traced, then op by op.
  testing.assert_gram_close(gram, testing.reference_gram(
      lambda w, xi: jnp.sum(jnp.tanh(xi @ w)), w, x))


def test_non_array_outputs_come_back_as_they_are():
  """An aux with a string and a Python number (what an eager call returned
  before) comes back as it is, not refused as an output of jit nor turned
  into an array; a typed PRNG key is an array input like any other."""
  def loss(x):
    with gram_haiku.track():
      out = hk.Linear(2)(jax.random.normal(hk.next_rng_key(), x.shape) + x)
    return jnp.sum(out ** 2), {"tag": "run1", "step": 3, "n": out.shape[0]}
  f = hk.transform_with_state(loss)
  x = jnp.ones((4, 3))
  key = jax.random.key(0)
  params, state = f.init(key, x)
  fn = gram_haiku.value_grad_and_gram(f.apply, has_aux=True)
  for _ in range(2):  # (traced, then from the compiled program)
    (value, aux), _, grams = fn(params, state, key, x)
    assert aux == {"tag": "run1", "step": 3, "n": 4}
    assert all(type(aux[k]) is int for k in ("step", "n"))
    assert grams.total.shape == (4, 4) and np.isfinite(float(value))
