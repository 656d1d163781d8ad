"""Declares the C extension only; every other piece of metadata is in pyproject.toml.

``kvtier._native`` (native/*.c, one file per job: see native/README.md) is
compiled from source by the package's own build (``pip install -e .`` or a
wheel build). It is optional: where it cannot be compiled (no C compiler) the
install still succeeds, with a warning, and kvtier.tiers.native falls back to
pure Python. The test suite asserts that the extension is the one in use
wherever it runs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._native",
            [
                "native/module.c",
                "native/iopool.c",
                "native/aligned.c",
                "native/crc32c.c",
                "native/keychain.c",
                "native/copy.c",
                "native/team.c",
                "native/decode_attention.c",
                "native/decode_attention_avx512.c",
                "native/decode_attention_avx2.c",
                "native/kvtier_prefill.c",
                "native/kvtier_quant.c",
            ],
            depends=[
                "native/kvtier_native.h",
                "native/aligned.h",
                "native/crc32c.h",
                "native/iopool.h",
                "native/team.h",
                "native/decode_attention.h",
                "native/kvtier_float.h",
            ],
            extra_compile_args=["-O3", "-std=gnu11", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra"],
            extra_link_args=["-pthread"],
            libraries=["dl"],
            optional=True,
        )
    ],
)
