"""A third-party layer with its own Gram rule, registered and checked."""
import jax
import jax.numpy as jnp

import conformance
import gram_haiku

HI = jax.lax.Precision.HIGHEST


class ScaledLinear(gram_haiku.GramOp):
  """``y = s * (x @ w)``: a linear layer with a learned scalar gain ``s``."""
  param_names = ("w", "s")
  feature_ndim = 1  # x: [..., N]; every leading axis is example/within

  def forward(self, x, w, s):
    return s * jnp.dot(x, w)

  def gram(self, x, g, params, example_dim):
    w, s = (p.astype(jnp.float32) for p in params)
    x = jnp.moveaxis(x, example_dim, 0).astype(jnp.float32)
    g = jnp.moveaxis(g, example_dim, 0).astype(jnp.float32)
    x, g = x.reshape(x.shape[0], -1, x.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])
    # dL_i/dw = s * sum_t x_it^T g_it  ->  ghost form of its Gram.
    kx = jnp.einsum("itn,jsn->ijts", x, x, precision=HI)
    kg = jnp.einsum("itm,jsm->ijts", g, g, precision=HI)
    gram_w = s ** 2 * jnp.sum(kx * kg, axis=(2, 3))
    # dL_i/ds = sum_t <x_it @ w, g_it>.
    a = jnp.einsum("itn,nm,itm->i", x, w, g, precision=HI)
    return gram_w + jnp.outer(a, a)


def scaled_linear(x, w, s, probe, **kwargs):
  return ScaledLinear.apply(x, (w, s), probe, name="scaled_linear", **kwargs)


SPEC = conformance.OpSpec(
    name="example_scaled_linear",
    make_params=lambda key, dtype: {
        "w": jax.random.normal(key, (5, 3)).astype(dtype),
        "s": jnp.asarray(1.5, dtype)},
    make_example=lambda key, lead, dtype: jax.random.normal(
        key, lead + (5,)).astype(dtype),
    apply=lambda p, probe, x, **kw: scaled_linear(x, p["w"], p["s"], probe,
                                                  **kw),
    plain=lambda p, x: p["s"] * jnp.dot(x, p["w"]))
# conformance.register(SPEC) adds it to `pytest conformance` runs.
