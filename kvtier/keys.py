"""Step ① of the data path: cut tokens into blocks and name each block.

A block key is the only identity a block of KV has anywhere in kvtier (every
tier, every process, every restart), so this module is the one place that
hashes. The exact bytes are spelled out in :meth:`KeyHasher.root` and
:meth:`KeyHasher.keys`; change them only together with ``KEY_SPEC_VERSION``.
"""

from __future__ import annotations

import os
import secrets
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

import numpy as np
import xxhash

BlockKey = NewType("BlockKey", bytes)
"""16 bytes: the xxh3-128 digest (big-endian, as ``xxhash`` returns it)."""

KEY_BYTES = 16
KEY_SPEC_VERSION = 1
SECRET_BYTES = 32
SECRET_FILE = "secret"

Hash128 = Callable[[bytes, int], bytes]
"""``(data, seed) -> 16-byte digest``. Only tests replace the default (to force collisions)."""


def xxh3_128(data: bytes | memoryview, seed: int) -> bytes:
    return xxhash.xxh3_128_digest(data, seed)


def _native_chain() -> Callable[[bytes, memoryview, int, int], list[bytes]] | None:
    """The C loop over blocks (``kvtier._native``), calling the xxhash library's own xxh3-128.

    None where the extension was not built or the xxhash build exports no
    symbol; :meth:`KeyHasher.keys` then runs the same chain in Python.
    """
    try:
        import xxhash._xxhash as lib

        from kvtier import _native

        _native.bind_xxh3(lib.__file__)
    except (ImportError, OSError, AttributeError):
        return None
    return _native.xxh3_128_chain


_CHAIN = _native_chain()


@dataclass(frozen=True)
class Secret:
    """The per-deployment secret that keys every block hash.

    Without it, anyone who can guess a prompt could compute its block keys and
    probe a shared tier for it; with it, keys are unguessable outside the
    deployment yet identical across its processes and restarts.
    """

    raw: bytes

    @property
    def seed(self) -> int:
        """The 64-bit xxh3 seed: the first 8 secret bytes, little-endian."""
        return int.from_bytes(self.raw[:8], "little")

    @classmethod
    def load_or_create(cls, data_dir: Path) -> Secret:
        """Read ``data_dir/secret``, creating it (mode 0600) on first use.

        Creation uses ``O_EXCL`` on a temporary name and a hard link, so two
        processes starting at once agree on one secret and nobody ever reads a
        half-written file.
        """
        data_dir.mkdir(parents=True, exist_ok=True)
        path = data_dir / SECRET_FILE
        if not path.exists():
            tmp = data_dir / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secrets.token_bytes(SECRET_BYTES))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process won the race; use its secret
            finally:
                tmp.unlink()
        raw = path.read_bytes()
        if len(raw) != SECRET_BYTES:
            raise ValueError(f"{path}: expected {SECRET_BYTES} bytes, found {len(raw)}")
        return cls(raw)


def _field(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


class KeyHasher:
    """Computes the chained keys of a token sequence's full blocks.

    One hasher is bound to one model fingerprint, KV layout and block size;
    the namespace (tenant) varies per request and enters through the root.
    Roots are memoised per namespace because every request needs one.
    """

    def __init__(
        self,
        secret: Secret,
        *,
        model_fingerprint: str,
        layout_descriptor: str,
        block_size: int,
        hash128: Hash128 = xxh3_128,
    ) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.model_fingerprint = model_fingerprint
        self.layout_descriptor = layout_descriptor
        self._secret = secret
        self._seed = secret.seed
        self._hash = hash128
        self._roots: dict[str, bytes] = {}

    def root(self, namespace: str) -> BlockKey:
        """The chain's origin for ``namespace``.

        Bytes hashed (xxh3-128, seed = :attr:`Secret.seed`), each ``field`` being
        a little-endian uint32 length followed by the bytes::

            b"kvtier-root" || uint8 KEY_SPEC_VERSION
            || field(secret, 32 bytes)
            || field(model fingerprint, UTF-8)
            || field(KV layout descriptor, UTF-8: order, shape, dtype)
            || uint32 LE block_size
            || field(namespace, UTF-8)

        Length prefixes make the encoding injective: no two distinct tuples of
        fields produce the same bytes.
        """
        root = self._roots.get(namespace)
        if root is None:
            data = b"".join(
                (
                    b"kvtier-root",
                    bytes([KEY_SPEC_VERSION]),
                    _field(self._secret.raw),
                    _field(self.model_fingerprint.encode()),
                    _field(self.layout_descriptor.encode()),
                    struct.pack("<I", self.block_size),
                    _field(namespace.encode()),
                )
            )
            root = self._hash(data, self._seed)
            self._roots[namespace] = root
        return BlockKey(root)

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size

    def keys(self, tokens: Sequence[int] | np.ndarray, namespace: str) -> list[BlockKey]:
        """Keys of every full block of ``tokens``; a partial tail gets none.

        Key of block *i* = xxh3-128 (seed = :attr:`Secret.seed`) over::

            key(i-1) (16 bytes; key(-1) is :meth:`root`)
            || tokens[i*B:(i+1)*B] as little-endian int32 (4*B bytes)

        The tokens are converted to one little-endian int32 buffer up front;
        the chain then runs in C (``kvtier._native``, with the xxhash library's
        own xxh3-128) or, without the extension, as a Python loop per block,
        never per token. Both give the same bytes.
        """
        n = self.num_full_blocks(len(tokens))
        if n == 0:
            return []
        body = np.ascontiguousarray(np.asarray(tokens)[: n * self.block_size], dtype="<i4")
        view = memoryview(body).cast("B")
        stride = 4 * self.block_size
        prev = self.root(namespace)
        if _CHAIN is not None and self._hash is xxh3_128:
            return _CHAIN(prev, view, stride, self._seed)  # type: ignore[return-value]
        buf = bytearray(KEY_BYTES + stride)
        hash128, seed = self._hash, self._seed
        out: list[BlockKey] = []
        for i in range(n):
            buf[:KEY_BYTES] = prev
            buf[KEY_BYTES:] = view[i * stride : (i + 1) * stride]
            prev = hash128(buf, seed)
            out.append(BlockKey(prev))
        return out


def block_tokens(tokens: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """The full blocks of ``tokens`` as an int32 array of shape ``[n, block_size]``."""
    n = len(tokens) // block_size
    arr = np.asarray(tokens[: n * block_size], dtype=np.int32)
    return arr.reshape(n, block_size)
