"""The native tunnel front (egressd/engine/_tunnels.c) is built on Linux; elsewhere egressd runs
without it (the Python lean path serves every connection). Everything else is in pyproject.toml."""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "egressd.engine._tunnels",
            ["egressd/engine/_tunnels.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
        )
    )

setup(ext_modules=ext_modules)
