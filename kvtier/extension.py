"""kvtier's C extensions, loaded in one place: ``kvtier._native_kernels`` and ``kvtier._native_io``.

The install builds both (``setup.py`` compiles ``native/``; a missing
compiler fails the install), so they are not optional here either: a
checkout whose build is missing, or was made for another Python, fails at
import in one line that says how to build it, instead of running on at a
fraction of the speed with a warning nobody reads. What stays in Python
beside them is an implementation in its own right, not a fallback: the
disk tier's pure-Python I/O (:data:`kvtier.tiers.native.PYTHON`) is the
reference the C one is tested against, and the torch attention path is
what a GPU (or a pool layout the C kernel does not take) runs.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import xxhash._xxhash

from kvtier.errors import KVTierError


class ExtensionMissing(KVTierError, ImportError):
    """A C extension the install should have built is not importable."""


def _load(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise ExtensionMissing(f"{name} is not built ({err}): build it with `make setup` (pip install -e .)") from err


kernels = _load("kvtier._native_kernels")
"""Block keys (the xxh3-128 chain), region copies, attention, row and quantized-matvec kernels."""
io = _load("kvtier._native_io")
"""The disk tier's batched, aligned reads and writes and their CRC-32C; the tiers' slot index (``SlotIndex``)."""

kernels.bind_xxh3(xxhash._xxhash.__file__)  # the key chain calls the xxhash library's own XXH3_128bits_withSeed
