"""Declares the C extensions only; every other piece of metadata is in pyproject.toml.

Two extensions, compiled from source by the package's own build (``pip install -e .``
or a wheel build), one file per job (native/README.md has the table):

* ``kvtier._native_io``: the disk tier's batched positional I/O, aligned buffers,
  CRC-32C and its in-memory index by slot;
* ``kvtier._native_kernels``: the block-key chain, the engine's region copies, its
  decode and prefill attention, its quantized decode products and a layer's
  element-wise steps.

They are required: an install needs a C compiler and the Python headers, and fails
without them rather than run the pure-Python references (kept for the tests to
compare against) at a fraction of the speed. The README's set-up says so.
"""

from setuptools import Extension, setup

_FLAGS = ["-O3", "-std=gnu11", "-pthread", "-fvisibility=hidden", "-Wall", "-Wextra"]

setup(
    ext_modules=[
        Extension(
            "kvtier._native_io",
            ["native/io_module.c", "native/iopool.c", "native/aligned.c", "native/crc32c.c", "native/slot_index.c"],
            depends=["native/io.h", "native/aligned.h", "native/crc32c.h", "native/iopool.h"],
            extra_compile_args=_FLAGS,
            extra_link_args=["-pthread"],
        ),
        Extension(
            "kvtier._native_kernels",
            [
                "native/kernels_module.c",
                "native/keychain.c",
                "native/copy.c",
                "native/team.c",
                "native/decode_attention.c",
                "native/decode_attention_avx512.c",
                "native/decode_attention_avx2.c",
                "native/prefill_attention.c",
                "native/quant_matvec.c",
                "native/rowwise.c",
            ],
            depends=["native/kernels.h", "native/team.h", "native/decode_attention.h", "native/float_math.h"],
            extra_compile_args=_FLAGS,
            extra_link_args=["-pthread"],
            libraries=["dl"],
        ),
    ],
)
