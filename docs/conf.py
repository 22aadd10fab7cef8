"""Sphinx configuration for gram_haiku.

The pages are a user's: they render only public names. Two hooks keep them
so (both fail a ``-W`` build rather than let a private path through):

* docstrings of public objects that point at a private module
  (``gram_haiku._src.compute.norm_bounds``) get the public page that explains the
  same thing instead (:data:`PRIVATE_REFERENCES`), and private paths in
  signatures are shortened to the public name;
* every rendered page is searched for ``_src`` and for "see the module
  docstring" (a docstring the pages do not render): each is a warning.
"""

import os
import re
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "gram_haiku"
author = "the gram_haiku developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
autodoc_member_order = "bysource"
autodoc_typehints_format = "short"
python_use_unqualified_type_names = True
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {"page_width": "1100px", "body_max_width": "none"}

#: A private module (or object) a public docstring refers to -> the public
#: place that explains it, as reStructuredText.
PRIVATE_REFERENCES = {
    "compute.norm_bounds": '"Formal guarantees" in :doc:`reweighting`',
    "passes.bookkeeping": '"How each Gram is formed" in :doc:`layers`',
    "ops.factors": '"How each Gram is formed" in :doc:`layers`',
    "ops.modes": '"How each Gram is formed" in :doc:`layers`',
    "compute.cost_model": '"How each Gram is formed" in :doc:`layers`',
    "rules.rule": '"Writing a Gram rule" in :doc:`api`',
    "ops.op.bind": ":func:`gram_haiku.ops.bind`",
    "ops.op": '"Writing a Gram rule" in :doc:`api`',
    "compute.kernels.KernelConfig": ":class:`gram_haiku.KernelConfig`",
    "compute.plan.Plan.precision": ":attr:`gram_haiku.Plan.precision`",
    "compute.plan.Plan": ":class:`gram_haiku.Plan`",
    "core.result.Grams": ":class:`gram_haiku.Grams`",
    "compute.example_axis": '"Example axis" in :doc:`semantics`',
}

_ROLE_REF = re.compile(
    r":(?:mod|func|class|attr|meth|data):`~?gram_haiku\._src\.([\w.]+)`")


def _public_reference(match):
  target = match.group(1)
  for private, public in PRIVATE_REFERENCES.items():
    if target == private or target.startswith(private + "."):
      return public
  return match.group(0)   # left as it is: the page check reports it


def _process_docstring(app, what, name, obj, options, lines):
  del app, what, name, obj, options
  text = "\n".join(lines)
  new = _ROLE_REF.sub(_public_reference, text)
  # Type fields (napoleon's ":type:" lines), not cross-references: a
  # reference to a private object with no public page stays, and is
  # reported.
  new = _PRIVATE_TYPE_TEXT.sub(r"gram_haiku.\1", new)
  new = _JAX_PRIVATE_TYPE.sub(
      lambda m: _JAX_PUBLIC.get(m.group(1), "jax." + m.group(1)), new)
  if new != text:
    lines[:] = new.split("\n")


#: Private paths of types in signatures -> their public spelling.
_PRIVATE_TYPE = re.compile(r"\bgram_haiku\._src\.(?:\w+\.)+(\w+)\b")
_JAX_PRIVATE_TYPE = re.compile(r"\bjax\._src\.[\w.]*?\.(\w+)\b")
_PRIVATE_TYPE_TEXT = re.compile(
    r"(?<![`~.\w])gram_haiku\._src\.(?:\w+\.)+(\w+)\b(?!`)")
_JAX_PUBLIC = {"Mesh": "jax.sharding.Mesh", "Precision": "jax.lax.Precision",
               "Array": "jax.Array"}


def _public_types(text):
  if text is None:
    return None
  text = _PRIVATE_TYPE.sub(r"gram_haiku.\1", text)
  return _JAX_PRIVATE_TYPE.sub(
      lambda m: _JAX_PUBLIC.get(m.group(1), "jax." + m.group(1)), text)


def _process_signature(app, what, name, obj, options, signature,
                       return_annotation):
  del app, what, name, obj, options
  return _public_types(signature), _public_types(return_annotation)


#: What no rendered page may say.
FORBIDDEN = ((re.compile(r"_src\b|_src\."), "a private path (_src)"),
             (re.compile(r"see\s+the\s+module\s+docstring", re.I),
              "a reference to a docstring the pages do not render"))


#: Pages rewritten elsewhere, not checked yet (with the reason).
PENDING: dict = {}


def _check_page(app, doctree, docname):
  if docname in PENDING:
    return
  from sphinx.util import logging  # pylint: disable=g-import-not-at-top
  logger = logging.getLogger("gram_haiku.docs")
  text = doctree.astext()
  for pattern, what in FORBIDDEN:
    for m in pattern.finditer(text):
      context = " ".join(text[max(0, m.start() - 60):m.end() + 40].split())
      logger.warning(f"{docname}: {what}: ...{context}...",
                     location=docname)


def setup(app):
  app.connect("autodoc-process-docstring", _process_docstring)
  app.connect("autodoc-process-signature", _process_signature)
  app.connect("doctree-resolved", _check_page)
