"""Packaging is declared in pyproject.toml; this file adds the compiled build.

With TIERGATE_MYPYC=1 the engine's hot modules (engine/compiled_core.py, MODULES) are
compiled to C extensions with mypyc; it needs mypy and a C compiler where the build runs, so
build without isolation: `TIERGATE_MYPYC=1 pip install --no-build-isolation .` (or `make
compiled`). Without it the build is pure Python, as the editable development install is: a
compiled module beside its source would shadow every later edit of it.
"""

import os
import runpy
import sys

from setuptools import setup

ext_modules = []
compiling = os.environ.get("TIERGATE_MYPYC") == "1"
if compiling and {"editable_wheel", "develop"} & set(sys.argv):
    sys.exit("TIERGATE_MYPYC=1 builds no editable install: a compiled module beside its source "
             "would shadow every later edit of it")
# Only a wheel or an extension build compiles (pip asks for the metadata first, in a run of
# its own, and an sdist carries the source alone).
if compiling and {"bdist_wheel", "build_ext"} & set(sys.argv):
    from mypyc.build import mypycify

    modules = runpy.run_path(os.path.join("engine", "compiled_core.py"))["MODULES"]
    ext_modules = mypycify(list(modules), opt_level="3")

setup(ext_modules=ext_modules)
