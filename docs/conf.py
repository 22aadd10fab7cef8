"""Sphinx configuration for gram_haiku."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "gram_haiku"
author = "the gram_haiku developers"
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
autodoc_member_order = "bysource"
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_theme_options = {"page_width": "1100px", "body_max_width": "none"}
