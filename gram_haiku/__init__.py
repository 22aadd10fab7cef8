"""gram_haiku: per-example gradient Gram matrices for Haiku, in one backward pass.

Public API (everything else lives in ``gram_haiku._src`` and is private):

* :class:`track`: context manager that routes tracked Haiku layers to
  Gram-emitting primitives.
* :func:`value_grad_and_gram`: loss, parameter gradients and :class:`Grams`.
* :func:`resize_probes`: size the probes for the raw ``jax.grad`` path.
* :func:`reweighted_grad`: ``sum_i c_i g_i`` with ``c`` chosen from the
  Grams of the same backward pass, and :func:`clipped_grad`: DP-SGD's
  clipped sum (all-layer or per-layer), both in one backward pass.
* :func:`gram_linear`: the linear-layer primitive itself.
* :class:`Rule`: a Gram rule for your own layer as pure functions
  (``forward``, optionally a Gram function), bound by :class:`GramFunction`
  or, in a ``track()`` handler, by :meth:`LayerCall.apply`;
  :class:`GramOp`, the base class of every Gram op (the lower-level way to
  write one), the :class:`Plan` it is bound with, and
  :func:`register_layer` to route a Haiku module to it in ``track()`` (its
  handler applies the op through a :class:`LayerCall`).
"""

# Registers the built-in layer handlers (hk.Linear, hk.Conv*, hk.Embed, ...).
from gram_haiku._src import layers as _layers  # noqa: F401
# Registers Grams and ClippedGradAux for Exported.serialize().
from gram_haiku._src import export_serialization as _export  # noqa: F401
from gram_haiku._src.clipping import clipped_grad
from gram_haiku._src.clipping import ClippedGradAux
from gram_haiku._src.coverage import ParamCoverage
from gram_haiku._src.coverage import UntrackedParameterWarning
from gram_haiku._src.example_axis import ExampleAxis
from gram_haiku._src.example_flow import ExampleFlowWarning
from gram_haiku._src.loss_scale import MeanLossWarning
from gram_haiku._src.ops.base import GramOp
from gram_haiku._src.ops.function import GramFunction
from gram_haiku._src.ops.affine import gram_affine
from gram_haiku._src.ops.conv import gram_conv
from gram_haiku._src.ops.conv import gram_conv_transpose
from gram_haiku._src.ops.embed import gram_embed
from gram_haiku._src.ops.linear import gram_linear
from gram_haiku._src.result import Grams
from gram_haiku._src.plan import Plan
from gram_haiku._src.probes import PROBE_NAME
from gram_haiku._src.registry import register_layer
from gram_haiku._src.rule import Rule
from gram_haiku._src.reweight import reweighted_grad
from gram_haiku._src.tied import unembed
from gram_haiku._src.tracking import LayerCall
from gram_haiku._src.tracking import track
from gram_haiku._src.value_grad_and_gram import resize_probes
from gram_haiku._src.value_grad_and_gram import value_grad_and_gram
from gram_haiku._src.verify import verify
from gram_haiku._src.verify import VerifyReport

__version__ = "0.1.0"

__all__ = (
    "ClippedGradAux",
    "ExampleAxis",
    "ExampleFlowWarning",
    "GramFunction",
    "GramOp",
    "Grams",
    "LayerCall",
    "MeanLossWarning",
    "PROBE_NAME",
    "ParamCoverage",
    "Plan",
    "Rule",
    "UntrackedParameterWarning",
    "clipped_grad",
    "gram_affine",
    "gram_conv",
    "gram_conv_transpose",
    "gram_embed",
    "gram_linear",
    "register_layer",
    "resize_probes",
    "reweighted_grad",
    "track",
    "unembed",
    "value_grad_and_gram",
    "verify",
    "VerifyReport",
)
