"""Serialization of gram_haiku's result types in ``jax.export`` programs.

An exported function's calling convention records the pytree of its
outputs; ``Exported.serialize()`` can write only registered node types.
:class:`~gram_haiku._src.core.result.Grams` (the Gram of
``value_grad_and_gram``) and :class:`~gram_haiku._src.api.clipping.ClippedGradAux`
(``clipped_grad``'s auxiliary output) are registered here, so that a step
exported with them serializes and deserializes (``jax.export.deserialize``)
to the same pytree.
"""

from __future__ import annotations

import json

import jax

from gram_haiku._src.api.clipping import ClippedGradAux
from gram_haiku._src.core.result import Grams
from gram_haiku._src.frontend.coverage import ParamCoverage


def _grams_auxdata(aux) -> bytes:
  full, diag, coverage, mesh_axes = aux
  return json.dumps({
      "by_layer": list(full), "sq_norms_by_layer": list(diag),
      "coverage": [[name, c.tracked, c.rule, c.module_type]
                   for name, c in coverage],
      "mesh_axes": list(mesh_axes)}).encode()


def _grams_from_auxdata(data: bytes):
  d = json.loads(data.decode())
  coverage = tuple((name, ParamCoverage(tracked, rule, module_type))
                   for name, tracked, rule, module_type in d["coverage"])
  return (tuple(d["by_layer"]), tuple(d["sq_norms_by_layer"]), coverage,
          tuple(d["mesh_axes"]))


jax.export.register_pytree_node_serialization(
    Grams, serialized_name="gram_haiku.Grams",
    serialize_auxdata=_grams_auxdata,
    deserialize_auxdata=_grams_from_auxdata)
jax.export.register_namedtuple_serialization(
    ClippedGradAux, serialized_name="gram_haiku.ClippedGradAux")
