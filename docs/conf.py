"""Sphinx configuration: MyST pages, executed notebooks, and the API from the docstrings."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "dlgs_jax"
author = "The dlgs_jax authors"
copyright = "The dlgs_jax authors"  # noqa: A001  (Sphinx's name)

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    # MathJax served with the site, so its equations render offline too.
    "sphinx-mathjax-offline",
]

autosummary_generate = True
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
default_role = "py:obj"

# Pages written as MyST notebooks run when the docs build, on CPU: a broken
# example fails the build.
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "colon_fence"]

exclude_patterns = ["_build", "jupyter_execute"]
html_theme = "sphinx_book_theme"
html_title = "dlgs_jax"
html_theme_options = {"show_toc_level": 2}
