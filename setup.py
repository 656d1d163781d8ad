"""Declares the C extension only; every other piece of metadata is in pyproject.toml.

``kvtier._native`` (native/kvtier_native.c) is compiled from source by the
package's own build (``pip install -e .`` or a wheel build). It is optional:
where it cannot be compiled (no C compiler) the install still succeeds, with
a warning, and kvtier.tiers.native falls back to pure Python. The test suite
asserts that the extension is the one in use wherever it runs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._native",
            ["native/kvtier_native.c", "native/kvtier_quant.c", "native/kvtier_prefill.c"],
            depends=["native/kvtier_native.h", "native/kvtier_float.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra"],
            extra_link_args=["-pthread"],
            libraries=["dl"],
            optional=True,
        )
    ],
)
