"""A third-party layer with its own Gram rule: the rule (pure functions, so
``scaled_linear_gram`` can be tested on plain arrays), the ``track()``
handler that applies it for the Haiku module, and its conformance spec.
A layer is a :class:`gram_haiku.Rule`, a handler and, for the suite,
``OpSpec.from_rule``; the op that binds the rule is gram_haiku's own."""
import haiku as hk
import jax
import jax.numpy as jnp

import gram_haiku
from gram_haiku import conformance

HI = jax.lax.Precision.HIGHEST


def scaled_linear_forward(x, w, s):
  """``y = s * (x @ w)``: a linear layer with a learned scalar gain ``s``.

  ``x: [..., N]``: every leading axis is the example axis or a
  within-example axis."""
  return s * jnp.dot(x, w)


def scaled_linear_gram(x, g, params, example_dim, cfg):
  """``[B, B]`` Gram of the per-example gradients of ``w`` and ``s``, from
  the input ``x`` and the output cotangent ``g`` (example axis at
  ``example_dim``): a pure function of arrays."""
  del cfg  # Not sharding-aware: this rule always sees one device's batch.
  # Accumulate in float32, or float64 for float64 inputs.
  acc = jnp.promote_types(x.dtype, jnp.float32)
  w, s = (p.astype(acc) for p in params)
  x = jnp.moveaxis(x, example_dim, 0).astype(acc)
  g = jnp.moveaxis(g, example_dim, 0).astype(acc)
  x = x.reshape(x.shape[0], -1, x.shape[-1])
  g = g.reshape(g.shape[0], -1, g.shape[-1])
  # dL_i/dw = s * sum_t x_it^T g_it  ->  ghost form of its Gram.
  kx = jnp.einsum("itn,jsn->ijts", x, x, precision=HI)
  kg = jnp.einsum("itm,jsm->ijts", g, g, precision=HI)
  gram_w = s ** 2 * jnp.sum(kx * kg, axis=(2, 3))
  # dL_i/ds = sum_t <x_it @ w, g_it>.
  a = jnp.einsum("itn,nm,itm->i", x, w, g, precision=HI)
  return gram_w + jnp.outer(a, a)


#: The layer's rule: ``forward`` plus its Gram (norms and per-example
#: gradients come from the rule's defaults). On arrays,
#: ``gram_haiku.ops.bind(RULE, x, (w, s), probe, name=...)`` binds it.
RULE = gram_haiku.Rule(forward=scaled_linear_forward, param_names=("w", "s"),
                       feature_ndim=1, gram=scaled_linear_gram)


class ScaledLinear(hk.Module):
  """The Haiku module: ``params`` creates the parameters, so that the plain
  ``__call__`` and the tracked handler below share them."""

  def __init__(self, output_size: int, name=None):
    super().__init__(name=name)
    self.output_size = output_size

  def params(self, x):
    w = hk.get_parameter("w", [x.shape[-1], self.output_size], x.dtype,
                         init=hk.initializers.TruncatedNormal(
                             1.0 / x.shape[-1] ** 0.5))
    s = hk.get_parameter("s", [], x.dtype, init=jnp.ones)
    return w, s

  def __call__(self, x):
    return scaled_linear_forward(x, *self.params(x))


@gram_haiku.register_layer(ScaledLinear)
def scaled_linear_handler(call, module, x):
  """Inside ``gram_haiku.track()``, ``ScaledLinear.__call__`` becomes this:
  the same parameters, with the rule applied through ``call`` (a
  :class:`gram_haiku.LayerCall`, which binds it with the module's plan and
  probe)."""
  return call.apply(RULE, x, module.params(x))


SPEC = conformance.OpSpec.from_rule(
    RULE, name="example_scaled_linear",
    make_params=lambda key, dtype: {
        "w": jax.random.normal(key, (5, 3)).astype(dtype),
        "s": jnp.asarray(1.5, dtype)},
    make_example=lambda key, lead, dtype: jax.random.normal(
        key, lead + (5,)).astype(dtype))
# conformance.register(SPEC) adds it to `pytest conformance` runs.
