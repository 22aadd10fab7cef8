"""``track(gram_precision=...)``: the precision of the Gram kernels' products.

On a CPU every precision computes the same float32 products, so the values
are checked against the reference for every layer of the zoo, and the
option's effect is checked where it acts: in the lowered program, whose
products the Gram kernels add are at ``HIGHEST`` by default and at the
requested precision otherwise (a kernel that ignored the option would keep
its ``HIGHEST``).
"""

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
from jax import lax

import gram_haiku
from gram_haiku._src.compute import plan as plan_lib
from gram_haiku._src.core.reference import assert_gram_close
from gram_haiku._src.core.reference import reference_gram
from tests import layer_zoo

# Entries whose plain model has no Gram kernel of its own to check (their
# Gram comes from JAX's VJP under vmap, at the layer's own precision).
_NAMES = [e.name for e in layer_zoo.ENTRIES
          if not layer_zoo.is_low_precision(e)]


def _highest_products(text: str) -> int:
  """Products (dots and convolutions) at ``HIGHEST`` in a lowered program."""
  return sum(line.count("HIGHEST") for line in text.splitlines()
             if "dot_general" in line or "convolution" in line)


def _lowered(entry, **track_kw):
  """``(tracked, plain)`` HIGHEST product counts of one zoo model (explicit
  batch), tracked with ``track_kw`` and untracked."""
  # pylint: disable=protected-access
  fn, lead = layer_zoo._styled(entry, "explicit")
  x = layer_zoo._draw(entry, lead, layer_zoo.seed_of(entry.name))
  tracked = hk.transform_with_state(
      layer_zoo._tracked(fn, entry, **track_kw))
  plain = hk.transform_with_state(lambda x: layer_zoo._tail(fn(x)))
  # Only lowered, never run: the initial values' shapes are enough.
  params, state = jax.eval_shape(tracked.init, jax.random.PRNGKey(1), x)
  _, plain_state = jax.jit(plain.init)(jax.random.PRNGKey(1), x)
  vgg = gram_haiku.value_grad_and_gram(tracked.apply)
  plain_vg = jax.value_and_grad(
      lambda p, x: plain.apply(p, plain_state, None, x)[0])
  return (_highest_products(
      jax.jit(vgg).lower(params, state, None, x).as_text()),
          _highest_products(jax.jit(plain_vg).lower(params, x).as_text()))


@pytest.mark.parametrize("strategy", ["ghost", "materialize"])
@pytest.mark.parametrize("name", _NAMES)
def test_every_kernel_takes_the_requested_precision(name, strategy):
  entry = layer_zoo.BY_NAME[name]
  default, plain = _lowered(entry, strategy=strategy,
                            gram_precision="default")
  highest, _ = _lowered(entry, strategy=strategy)
  # The tracked program's own products are the plain model's (or fewer,
  # where summed per-example gradients replace the weight's VJP), plus the
  # kernels': none of those at HIGHEST when DEFAULT is asked for.
  assert default <= plain, (name, default, plain)
  assert highest > default, (name, highest, default)


# On a CPU every spelling computes alike: one per model, each spelling used.
@pytest.mark.parametrize("name,precision", [
    ("MLP", "default"), ("Conv2D-grouped-dilated", "HIGH"),
    ("Embed-one-hot", lax.Precision.DEFAULT), ("LSTM-dynamic", "default"),
    ("transformer-block", lax.Precision.HIGH), ("tied-LM", "Default")])
def test_grams_at_a_lower_precision_match_the_reference(name, precision):
  entry = layer_zoo.BY_NAME[name]
  grams, ref, value, plain_value, grads, plain_grads = layer_zoo.run(
      entry, "explicit", layer_zoo.seed_of(name), gram_precision=precision)
  assert_gram_close(grams.total, ref)
  np.testing.assert_allclose(value, plain_value, rtol=1e-6)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      grads, plain_grads)


@pytest.mark.parametrize("mode", ["norms", "clip"])
def test_norms_and_clipping_take_the_requested_precision(mode):
  entry = layer_zoo.BY_NAME["Conv1D"]
  # pylint: disable=protected-access
  fn, lead = layer_zoo._styled(entry, "explicit")
  x = layer_zoo._draw(entry, lead, 3)
  texts = []
  for precision in ("highest", "default"):
    kw = dict(gram_precision=precision, strategy="materialize")
    if mode == "norms":
      kw["mode"] = "norms"
    tracked = hk.transform_with_state(layer_zoo._tracked(fn, entry, **kw))
    params, state = tracked.init(jax.random.PRNGKey(1), x)
    if mode == "norms":
      f = gram_haiku.value_grad_and_gram(tracked.apply)
    else:
      f = gram_haiku.clipped_grad(tracked.apply, l2_clip_norm=0.1)
    texts.append(jax.jit(f).lower(params, state, None, x).as_text())
  assert _highest_products(texts[0]) > 0
  assert _highest_products(texts[1]) == 0


def test_the_precision_is_in_the_plan_and_the_jaxpr():
  entry = layer_zoo.BY_NAME["Linear"]
  fn, lead = layer_zoo._styled(entry, "explicit")  # pylint: disable=protected-access
  x = layer_zoo._draw(entry, lead, 4)  # pylint: disable=protected-access
  f = hk.transform_with_state(
      layer_zoo._tracked(fn, entry, gram_precision="default"))  # pylint: disable=protected-access
  params, state = f.init(jax.random.PRNGKey(0), x)
  jaxpr = str(jax.make_jaxpr(f.apply)(params, state, None, x))
  assert f"frozen=None, upper_bound=False, precision={lax.Precision.DEFAULT!r})" in jaxpr, jaxpr
  assert plan_lib.Plan().precision == lax.Precision.HIGHEST


@pytest.mark.parametrize("bad", ["fast", 3, None, "tf32"])
def test_a_bad_precision_is_a_clear_error(bad):
  with pytest.raises(ValueError, match=r"track\(gram_precision=.*highest"):
    gram_haiku.track(gram_precision=bad)


@pytest.mark.parametrize("compute,scale", [("bfloat16", 1.0),
                                           ("float16", 1.0),
                                           ("float16", 40.0)])
def test_a_mixed_precision_policy_keeps_the_gram_in_float32(compute, scale):
  """A jmp policy (float32 parameters, ``compute`` inside ``hk.Linear``)
  casts the module's state as well as its parameters (Haiku's policy
  getter takes ``state=True``), so a probe read through it was
  ``compute``-typed and the Gram rounded to it: 2^-9 relative in bfloat16,
  inf for float16 entries over 65504 (``scale=40``: a diagonal of about
  1e6). With inputs and cotangents representable in ``compute`` and a
  loss linear in the layer's output, the model as run computes exactly the
  float64 model's ``x`` and ``d``, so the Gram is float32-exact against
  the float64 ``F F^T``."""
  dtype = jnp.dtype(compute)
  rng = np.random.RandomState(0)
  x = np.asarray(jnp.asarray(rng.normal(size=(4, 3, 6)) * scale,
                             dtype).astype(jnp.float32))
  v = np.asarray(jnp.asarray(rng.normal(size=(4, 3, 5)) * scale,
                             dtype).astype(jnp.float32))

  def body(x, v):
    return jnp.sum(hk.Linear(5, name="layer")(x) * v)

  def loss_fn(x, v):
    hk.mixed_precision.set_policy(hk.Linear, jmp.Policy(
        jnp.float32, dtype, jnp.float32))
    try:
      with gram_haiku.track():
        return body(x, v)
    finally:
      hk.mixed_precision.clear_policy(hk.Linear)
  f = hk.transform_with_state(loss_fn)
  params, state = f.init(jax.random.PRNGKey(1), x, v)
  # Parameters representable in `compute`: the cast leaves them unchanged.
  params = jax.tree.map(lambda a: a.astype(dtype).astype(jnp.float32),
                        params)
  _, _, grams = jax.jit(gram_haiku.value_grad_and_gram(f.apply))(
      params, state, None, x, v)
  with jax.enable_x64(True):
    plain = hk.transform(body)
    ref = np.asarray(reference_gram(
        lambda p, x, v: plain.apply(p, None, x, v),
        jax.tree.map(lambda a: np.asarray(a, np.float64), params),
        np.asarray(x, np.float64), np.asarray(v, np.float64)), np.float64)
  assert grams.total.dtype == jnp.float32
  assert np.all(np.isfinite(np.asarray(grams.total))), grams.total
  assert_gram_close(grams.total, ref)
