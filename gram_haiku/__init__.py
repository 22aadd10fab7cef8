"""gram_haiku: per-example gradient Gram matrices for Haiku, in one backward pass.

Public API (everything else lives in ``gram_haiku._src`` and is private):

* :class:`track`: context manager that routes tracked Haiku layers to
  Gram-emitting primitives.
* :func:`value_grad_and_gram`: loss, parameter gradients and :class:`Grams`.
* :func:`resize_probes`: size the probes for the raw ``jax.grad`` path.
* :func:`reweighted_grad`: ``sum_i c_i g_i`` with ``c`` chosen from the
  Grams of the same backward pass, and :func:`clipped_grad`: DP-SGD's
  clipped sum (all-layer or per-layer), both in one backward pass.
* :func:`cross_gram`: the Gram block ``<g_i, h_q>`` between a training
  step's examples and a set of queries (:class:`CrossGrams`), in the
  step's one backward pass, the queries kept out of the update.
* :func:`standardise_weight`: weight standardisation the pass reads in
  closed form (a custom getter's, without ``B x P`` per-example gradients).
* :func:`empirical_ntk`: the empirical neural tangent kernel per output
  (neural-tangents' ``trace_axes`` / ``diagonal_axes``), from one Gram pass.
* :class:`Rule`: a layer's Gram rule as pure functions (``forward``,
  optionally a Gram function), the one way to write a Gram op: a
  ``track()`` handler (:func:`register_layer`) gives it to
  :meth:`LayerCall.apply`; :class:`KernelConfig`, the ``cfg`` a rule's
  functions receive; the :class:`Plan` an op is bound with.

The ops themselves, as functions on arrays (:func:`gram_haiku.ops.bind`,
which binds any rule, and ``gram_linear``, ``gram_conv``...), are in the
submodule :mod:`gram_haiku.ops`. ``GramOp``, ``GramFunction`` and the
top-level ``gram_linear``, ``gram_conv``, ``gram_conv_transpose``,
``gram_embed`` and ``gram_affine`` are deprecated aliases (they warn,
naming the replacement) and leave in the next release.
"""

# Importing gram_haiku alone is light (no JAX, Haiku or NumPy): the public
# names below are imported on first use (PEP 562), all at once. The pytest
# plugin of gram_haiku.conformance loads in every pytest run of an
# environment that has the package installed, and the command line's --help
# needs no JAX either. Importing any module of gram_haiku._src registers the
# built-in layer handlers (gram_haiku/_src/__init__.py), as before.
_SOURCES = {
    "clipped_grad": "gram_haiku._src.api.clipping",
    "ClippedGradAux": "gram_haiku._src.api.clipping",
    "cross_gram": "gram_haiku._src.api.cross_gram",
    "CrossGrams": "gram_haiku._src.core.result",
    "ParamCoverage": "gram_haiku._src.frontend.coverage",
    "UntrackedParameterWarning": "gram_haiku._src.frontend.coverage",
    "empirical_ntk": "gram_haiku._src.api.ntk",
    "ExampleAxis": "gram_haiku._src.compute.example_axis",
    "ExampleFlowWarning": "gram_haiku._src.analysis.example_flow",
    "MeanLossWarning": "gram_haiku._src.analysis.loss_scale",
    "RecompileWarning": "gram_haiku._src.core.one_program",
    "KernelConfig": "gram_haiku._src.compute.kernels",
    "Grams": "gram_haiku._src.core.result",
    "Plan": "gram_haiku._src.compute.plan",
    "PROBE_NAME": "gram_haiku._src.frontend.probes",
    "register_layer": "gram_haiku._src.frontend.registry",
    "Rule": "gram_haiku._src.rules.rule",
    "reweighted_grad": "gram_haiku._src.api.reweight",
    "unembed": "gram_haiku._src.layers.tied",
    "LayerCall": "gram_haiku._src.frontend.tracking",
    "track": "gram_haiku._src.frontend.tracking",
    "resize_probes": "gram_haiku._src.api.value_grad_and_gram",
    "standardise_weight": "gram_haiku._src.frontend.standardise",
    "value_grad_and_gram": "gram_haiku._src.api.value_grad_and_gram",
    "verify": "gram_haiku._src.api.verify",
    "VerifyReport": "gram_haiku._src.api.verify",
}

#: Public submodules, imported on first use as attributes
#: (``gram_haiku.ops.gram_linear`` after ``import gram_haiku``).
_SUBMODULES = ("ops", "functional")

#: Deprecated names (one release): name -> (module, attribute, replacement).
#: Each access warns with a DeprecationWarning naming the replacement.
_DEPRECATED = {
    "GramOp": ("gram_haiku._src.ops.deprecated", "GramOp",
               "a gram_haiku.Rule, bound by gram_haiku.ops.bind (in a "
               "track() handler: LayerCall.apply(rule, x, params))"),
    "GramFunction": ("gram_haiku._src.ops.deprecated", "GramFunction",
                     "gram_haiku.ops.bind(rule, x, params, probe, name=...)"),
    "gram_affine": ("gram_haiku._src.ops.affine", "gram_affine",
                    "gram_haiku.ops.gram_affine"),
    "gram_conv": ("gram_haiku._src.ops.conv", "gram_conv",
                  "gram_haiku.ops.gram_conv"),
    "gram_conv_transpose": ("gram_haiku._src.ops.conv", "gram_conv_transpose",
                            "gram_haiku.ops.gram_conv_transpose"),
    "gram_embed": ("gram_haiku._src.ops.embed", "gram_embed",
                   "gram_haiku.ops.gram_embed"),
    "gram_linear": ("gram_haiku._src.ops.linear", "gram_linear",
                    "gram_haiku.ops.gram_linear"),
}

__version__ = "0.1.0"

__all__ = (
    "ClippedGradAux",
    "CrossGrams",
    "ExampleAxis",
    "ExampleFlowWarning",
    "Grams",
    "KernelConfig",
    "LayerCall",
    "MeanLossWarning",
    "PROBE_NAME",
    "ParamCoverage",
    "Plan",
    "RecompileWarning",
    "Rule",
    "UntrackedParameterWarning",
    "clipped_grad",
    "cross_gram",
    "empirical_ntk",
    "register_layer",
    "resize_probes",
    "reweighted_grad",
    "standardise_weight",
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
  if name in _SUBMODULES:
    import importlib  # pylint: disable=g-import-not-at-top
    return importlib.import_module(f"gram_haiku.{name}")
  if name in _DEPRECATED:
    import importlib  # pylint: disable=g-import-not-at-top
    import warnings  # pylint: disable=g-import-not-at-top
    module, attr, replacement = _DEPRECATED[name]
    warnings.warn(f"gram_haiku.{name} is deprecated and will be removed in "
                  f"the next release: use {replacement}.",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), attr)
  raise AttributeError(f"module 'gram_haiku' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_SOURCES) | set(_SUBMODULES))
