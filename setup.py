"""The native tunnel front (egressd/engine/_tunnels.c) is built on Linux when a C compiler is there;
without it (another OS, no compiler) egressd runs its Python lean path for every connection.
Everything else is in pyproject.toml."""

import sys

from setuptools import Extension, setup

ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "egressd.engine._tunnels",
            ["egressd/engine/_tunnels.c"],
            optional=True,  # no compiler: installed without it (tests/test_native_front.py says so)
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers"],
        )
    )

setup(ext_modules=ext_modules)
