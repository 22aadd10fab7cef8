"""gram_haiku.functional: the Gram, reweighted and clipped gradients of a
plain-JAX loss ``loss(params, *batch)`` over any pytree of parameters (a
dict of arrays, a Flax ``params`` collection, an NNX ``State``).

* :func:`value_grad_and_gram`: loss, gradients and the per-example Gram;
* :func:`reweighted_grad`: ``sum_i c_i g_i`` with ``c`` from the Grams of
  the same pass;
* :func:`clipped_grad`: DP-SGD's clipped sum, with jax-privacy's
  arguments.

The same semantics as the Haiku functions of the same names; every
parameter is covered by a Gram rule read from the traced program (see the
"Plain JAX and Flax" docs page for the primitives with a rule).
"""

from gram_haiku._src.api.functional import clipped_grad
from gram_haiku._src.api.functional import reweighted_grad
from gram_haiku._src.api.functional import value_grad_and_gram

__all__ = ("value_grad_and_gram", "reweighted_grad", "clipped_grad")
