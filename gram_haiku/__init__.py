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
  handler applies the op through a :class:`LayerCall`);
  :class:`KernelConfig`, the ``cfg`` a rule's functions receive.
"""

# Importing gram_haiku alone is light (no JAX, Haiku or NumPy): the public
# names below are imported on first use (PEP 562), all at once. The pytest
# plugin of gram_haiku.conformance loads in every pytest run of an
# environment that has the package installed, and the command line's --help
# needs no JAX either. Importing any module of gram_haiku._src registers the
# built-in layer handlers (gram_haiku/_src/__init__.py), as before.
_SOURCES = {
    "clipped_grad": "gram_haiku._src.clipping",
    "ClippedGradAux": "gram_haiku._src.clipping",
    "ParamCoverage": "gram_haiku._src.coverage",
    "UntrackedParameterWarning": "gram_haiku._src.coverage",
    "ExampleAxis": "gram_haiku._src.example_axis",
    "ExampleFlowWarning": "gram_haiku._src.example_flow",
    "MeanLossWarning": "gram_haiku._src.loss_scale",
    "GramOp": "gram_haiku._src.ops.base",
    "GramFunction": "gram_haiku._src.ops.function",
    "KernelConfig": "gram_haiku._src.kernels",
    "gram_affine": "gram_haiku._src.ops.affine",
    "gram_conv": "gram_haiku._src.ops.conv",
    "gram_conv_transpose": "gram_haiku._src.ops.conv",
    "gram_embed": "gram_haiku._src.ops.embed",
    "gram_linear": "gram_haiku._src.ops.linear",
    "Grams": "gram_haiku._src.result",
    "Plan": "gram_haiku._src.plan",
    "PROBE_NAME": "gram_haiku._src.probes",
    "register_layer": "gram_haiku._src.registry",
    "Rule": "gram_haiku._src.rule",
    "reweighted_grad": "gram_haiku._src.reweight",
    "unembed": "gram_haiku._src.tied",
    "LayerCall": "gram_haiku._src.tracking",
    "track": "gram_haiku._src.tracking",
    "resize_probes": "gram_haiku._src.value_grad_and_gram",
    "value_grad_and_gram": "gram_haiku._src.value_grad_and_gram",
    "verify": "gram_haiku._src.verify",
    "VerifyReport": "gram_haiku._src.verify",
}

__version__ = "0.1.0"

__all__ = (
    "ClippedGradAux",
    "ExampleAxis",
    "ExampleFlowWarning",
    "GramFunction",
    "GramOp",
    "Grams",
    "KernelConfig",
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


def _load_public_api() -> None:
  import importlib  # pylint: disable=g-import-not-at-top
  g = globals()
  for name, module in _SOURCES.items():
    g[name] = getattr(importlib.import_module(module), name)


def __getattr__(name: str):
  if name in _SOURCES:
    _load_public_api()
    return globals()[name]
  raise AttributeError(f"module 'gram_haiku' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_SOURCES))
