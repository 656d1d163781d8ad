"""Step ① of the data path: cut tokens into blocks and name each block.

A block key is the only identity a block of KV has anywhere in kvtier (every
tier, every process, every restart), so this module is the one place that
hashes. The exact bytes are spelled out in :meth:`KeyHasher.root` and
:meth:`KeyHasher.keys`; change them only together with ``KEY_SPEC_VERSION``.
The digest that confirms a hit (:meth:`KeyHasher.digest`) is defined here too,
and so are the keys and digests of named blocks (:meth:`KeyHasher.named`),
whose payloads a caller addresses by a name of its own instead of a token chain.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

import numpy as np
import xxhash

from kvtier import extension
from kvtier.errors import KVTierError, warn_once
from kvtier.private import make_private, private_dir, sync_dir

BlockKey = NewType("BlockKey", bytes)
"""16 bytes: the xxh3-128 digest (big-endian, as ``xxhash`` returns it)."""

BlockDigest = NewType("BlockDigest", bytes)
"""32 bytes: the keyed BLAKE2b of a block's key and token ids (:meth:`KeyHasher.digest`)."""

KEY_BYTES = 16
DIGEST_BYTES = 32
KEY_SPEC_VERSION = 1
SECRET_BYTES = 32
SECRET_FILE = "secret"
_DIGEST_KEY_LABEL = b"kvtier-token-digest-key"
_NAMED_LABEL = b"kvtier-named"
_NAMED_DIGEST_KEY_LABEL = b"kvtier-named-digest-key"
_REMOTE_MAC_KEY_LABEL = b"kvtier-remote-mac-key"

Hash128 = Callable[[bytes, int], bytes]
"""``(data, seed) -> 16-byte digest``. Only tests replace the default (to force collisions)."""


def xxh3_128(data: bytes | memoryview, seed: int) -> bytes:
    return xxhash.xxh3_128_digest(data, seed)


def truncated_xxh3_128(bits: int) -> Hash128:
    """For tests only, never a default: xxh3-128 with all but its low ``bits`` bits zeroed.

    The forced-collision hook (``KeyHasher(..., hash128=truncated_xxh3_128(4))``):
    with 4 bits every 17 blocks hold two that share a key, so a test can show
    at scale that a key is only a hint and that :mod:`kvtier.index` confirms
    every hit against the tokens. Nothing in kvtier constructs it; config
    cannot reach it.
    """
    if not 0 < bits <= 8 * KEY_BYTES:
        raise ValueError(f"bits must be in 1..{8 * KEY_BYTES}")
    mask = (1 << bits) - 1

    def hash128(data: bytes | memoryview, seed: int) -> bytes:
        full = int.from_bytes(xxhash.xxh3_128_digest(data, seed), "big")
        return (full & mask).to_bytes(KEY_BYTES, "big")

    return hash128


_CHAIN: Callable[[bytes, memoryview, int, int], list[bytes]] = extension.kernels.xxh3_128_chain
"""The C loop over blocks, calling the xxhash library's own xxh3-128 (the Python chain serves other hashes)."""


@dataclass(frozen=True)
class Secret:
    """The per-deployment secret that keys every block hash.

    Without it, anyone who can guess a prompt could compute its block keys and
    probe a shared tier for it; with it, keys are unguessable outside the
    deployment yet identical across its processes and restarts.
    """

    raw: bytes
    persistent: bool = True  # False: process-local (see load_or_ephemeral); keys change at the next start

    @property
    def seed(self) -> int:
        """The 64-bit xxh3 seed: the first 8 secret bytes, little-endian."""
        return int.from_bytes(self.raw[:8], "little")

    @property
    def digest_key(self) -> bytes:
        """The 32-byte key of token digests: BLAKE2b-256, keyed with the secret, of ``b"kvtier-token-digest-key"``.

        A subkey, not the secret itself: the secret already seeds xxh3, and
        one key serves one purpose.
        """
        return hashlib.blake2b(_DIGEST_KEY_LABEL, key=self.raw, digest_size=DIGEST_BYTES).digest()

    @property
    def named_digest_key(self) -> bytes:
        """The key of named blocks' digests: BLAKE2b-256, keyed with the secret, of ``b"kvtier-named-digest-key"``.

        Another subkey than :attr:`digest_key`, so that no named block's
        digest can ever equal a token block's, whatever the bytes hashed.
        """
        return hashlib.blake2b(_NAMED_DIGEST_KEY_LABEL, key=self.raw, digest_size=DIGEST_BYTES).digest()

    @property
    def remote_mac_key(self) -> bytes:
        """The key of remote values' MACs: BLAKE2b-256, keyed with the secret, of ``b"kvtier-remote-mac-key"``.

        Every node of a deployment derives the same key from the shared
        secret file (``cache.secret_file``); nobody without it can write a
        value the remote tier accepts (:mod:`kvtier.tiers.remote.frame`).
        """
        return hashlib.blake2b(_REMOTE_MAC_KEY_LABEL, key=self.raw, digest_size=DIGEST_BYTES).digest()

    @classmethod
    def load_or_create(cls, data_dir: Path, path: Path | None = None) -> Secret:
        """Read ``path`` (default ``data_dir/secret``), creating it (mode 0600) on first use.

        A ``path`` of its own is how several nodes share one secret (and so
        one key space and one remote MAC key): copy the file to each, or
        point them all at one. The default location's directory is made
        private (0700), as is a missing one this makes, and the default
        file is tightened back to 0600 if it was loosened since; an existing
        directory or file chosen by the operator is left as it is.
        Creation uses ``O_EXCL`` on a temporary name and a hard link, so two
        processes starting at once agree on one secret and nobody ever reads a
        half-written file.
        """
        default = path is None
        if default:
            private_dir(data_dir)
            path = data_dir / SECRET_FILE
        elif not path.parent.exists():
            private_dir(path.parent)
        if not path.exists():
            tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
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
            sync_dir(path.parent)  # the name too: blocks keyed by a secret lost to a power cut are all lost
        elif default:
            make_private(path)  # loosened since it was made; an operator's own secret_file is theirs to set
        raw = path.read_bytes()
        if len(raw) != SECRET_BYTES:
            raise ValueError(f"{path}: expected {SECRET_BYTES} bytes, found {len(raw)}")
        return cls(raw)

    @classmethod
    def load_or_ephemeral(cls, data_dir: Path, path: Path | None = None) -> Secret:
        """:meth:`load_or_create`, or a process-local secret where ``data_dir`` has none and can hold none.

        A read-only or unwritable data directory must not stop the service:
        keys made with a process-local secret do not survive a restart, but
        neither does anything else then (the disk tier cannot open there
        either), so the cost is one warning. A secret file that exists but
        cannot be read is another matter (blocks on disk are keyed by it): a
        one-line error.
        """
        where = path if path is not None else data_dir / SECRET_FILE
        try:
            return cls.load_or_create(data_dir, path)
        except OSError as err:
            if where.exists():
                raise KVTierError(f"cannot read the key secret {where}: {err.strerror or err}") from err
            warn_once(
                "secret-ephemeral",
                "cannot create the key secret %s (%s); using a process-local one: block keys will not "
                "survive a restart",
                where,
                err.strerror or err,
            )
            return cls(secrets.token_bytes(SECRET_BYTES), persistent=False)


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
        self._digest = hashlib.blake2b(key=secret.digest_key, digest_size=DIGEST_BYTES)  # copied per block
        self._named_digest = hashlib.blake2b(key=secret.named_digest_key, digest_size=DIGEST_BYTES)

    @classmethod
    def process_local(cls, layout_descriptor: str, block_size: int) -> KeyHasher:
        """Keys that never leave this process (an engine's resident pool): a fresh secret, no model named."""
        secret = Secret(secrets.token_bytes(SECRET_BYTES), persistent=False)
        return cls(
            secret, model_fingerprint="process-local", layout_descriptor=layout_descriptor, block_size=block_size
        )

    @property
    def secret(self) -> Secret:
        """The deployment secret these keys are made with (the remote tier derives its MAC key from it)."""
        return self._secret

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

    def keys(
        self, tokens: Sequence[int] | np.ndarray, namespace: str, *, parent: BlockKey | None = None
    ) -> list[BlockKey]:
        """Keys of every full block of ``tokens``; a partial tail gets none.

        Key of block *i* = xxh3-128 (seed = :attr:`Secret.seed`) over::

            key(i-1) (16 bytes; key(-1) is :meth:`root`, or ``parent`` when given)
            || tokens[i*B:(i+1)*B] as little-endian int32 (4*B bytes)

        ``parent`` continues a chain whose earlier tokens the caller no longer
        has: a router translating another engine's block events, which name
        each block's parent and carry only the block's own tokens.

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
        prev = self.root(namespace) if parent is None else parent
        if self._hash is xxh3_128:
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

    def digest(self, key: BlockKey, tokens: np.ndarray) -> BlockDigest:
        """What a tier keeps beside block ``key`` to confirm a hit: a digest of the block's ``tokens``.

        BLAKE2b-256, keyed with :attr:`Secret.digest_key`, over::

            key (16 bytes) || tokens as little-endian int32 (4*B bytes)

        It replaces the token ids themselves, so an index on disk or a dump
        of host memory shows no prompt. Keyed, so that whoever reads the
        index but not the secret cannot test a guessed prompt against it;
        the key in the data makes two records of equal tokens (another
        namespace, another position) differ, so not even equality shows.
        Confirmation stays exact: equal digests for unequal tokens would be
        a 256-bit hash collision.
        """
        h = self._digest.copy()
        h.update(key)
        h.update(np.ascontiguousarray(tokens, dtype="<i4"))
        return BlockDigest(h.digest())

    def digests(self, keys: Sequence[BlockKey], tokens: Sequence[int] | np.ndarray) -> BlockDigests:
        """The digests of ``tokens``' full blocks under ``keys``, computed as they are first asked for."""
        return BlockDigests(self, keys, block_tokens(tokens, self.block_size))

    def keyed(self, tokens: Sequence[int] | np.ndarray, namespace: str) -> KeyedTokens:
        """``tokens`` with their block keys, hashed now, once, for every step of one request's way."""
        ids = np.array(tokens, dtype=np.int32)  # a copy: the caller may reuse its list
        ids.flags.writeable = False
        keys = self.keys(ids, namespace)
        return KeyedTokens(self, namespace, ids, keys, self.digests(keys, ids))

    def named(self, name: bytes, namespace: str) -> BlockKey:
        """The key of the block a caller calls ``name`` (any bytes it chooses) in ``namespace``.

        xxh3-128 (seed = :attr:`Secret.seed`) over::

            b"kvtier-named" || uint8 KEY_SPEC_VERSION || root(namespace) (16 bytes) || field(name)

        Why this shape: an engine that keeps its own artefacts in kvtier (a
        llama.cpp state, an SGLang page named by its own hash) has no token
        chain to key them by. The root binds a name, like a token chain, to
        the secret, the model, the KV layout and the tenant; the label puts
        named keys in a domain of their own, so a name that happened to be
        the bytes of some token block still hashes other input than any
        chain step (16 bytes of key then token ids). Hits are confirmed by
        :meth:`named_digest` anyway, whose key differs from token digests'.
        """
        data = b"".join((_NAMED_LABEL, bytes([KEY_SPEC_VERSION]), self.root(namespace), _field(bytes(name))))
        return BlockKey(self._hash(data, self._seed))

    def named_digest(self, key: BlockKey, name: bytes) -> BlockDigest:
        """What a tier keeps beside named block ``key`` to confirm a hit, as :meth:`digest` does for tokens.

        BLAKE2b-256, keyed with :attr:`Secret.named_digest_key`, over::

            key (16 bytes) || name

        The disk tier checks each block's bytes by CRC-32C on every read; this
        digest checks that the block under a key is the one of that name.
        """
        h = self._named_digest.copy()
        h.update(key)
        h.update(name)
        return BlockDigest(h.digest())

    def named_digests(self, keys: Sequence[BlockKey], names: Sequence[bytes]) -> NamedDigests:
        return NamedDigests(self, keys, names)


class BlockDigests:
    """One request's block digests, each computed the first time it is asked for, then kept.

    Made once per request beside its keys and passed on, so no block is
    digested twice; lazy, because confirmation needs a digest only where a
    tier holds the block's key: a prompt seen for the first time costs none.
    """

    def __init__(self, hasher: KeyHasher, keys: Sequence[BlockKey], blocks: np.ndarray) -> None:
        self._hasher = hasher
        self._keys = keys
        self._blocks = blocks
        self._done: list[BlockDigest | None] = [None] * len(keys)

    def __len__(self) -> int:
        return len(self._done)

    def __getitem__(self, i: int) -> BlockDigest:
        digest = self._done[i]
        if digest is None:
            digest = self._done[i] = self._hasher.digest(self._keys[i], self._blocks[i])
        return digest

    def extended(self, keys: Sequence[BlockKey], blocks: np.ndarray) -> BlockDigests:
        """The digests of a longer chain that starts with this one's blocks, keeping those already computed."""
        more = BlockDigests(self._hasher, keys, blocks)
        more._done[: len(self._done)] = self._done
        return more

    def prefix(self, n: int) -> BlockDigests:
        """The first ``n`` blocks' digests, those computed so far kept (computed ones stay shared in value)."""
        head = BlockDigests(self._hasher, self._keys[:n], self._blocks[:n])
        head._done[:] = self._done[:n]
        return head


@dataclass(frozen=True, eq=False)
class KeyedTokens:
    """A token sequence with the keys (and lazy digests) of its full blocks: one request, hashed once.

    Lookup, fetch, store, the engine's resident pool and a session's
    protection all need the same keys of the same tokens. Each computing
    them again hashed one prompt four or five times on its way; this object
    is made once per request (:meth:`KeyHasher.keyed`) and passed instead.
    It remembers the hasher that made it, so a cache can refuse keys made
    under another secret (they would only ever miss), and it grows as a
    reply adds full blocks (:meth:`extend` hashes only the new ones).
    """

    hasher: KeyHasher
    namespace: str
    tokens: np.ndarray  # int32, read-only
    keys: list[BlockKey]
    digests: BlockDigests

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    @property
    def root(self) -> BlockKey:
        """The chain's origin: block 0's parent, the namespace's root (:meth:`KeyHasher.root`)."""
        return self.hasher.root(self.namespace)

    @property
    def blocks(self) -> np.ndarray:
        """The full blocks' token ids, ``[num_blocks, block_size]`` (a view, no copy)."""
        return block_tokens(self.tokens, self.hasher.block_size)

    def prefix(self, n: int) -> KeyedTokens:
        """The first ``n`` tokens with their full blocks' keys: a slice of this chain, nothing hashed again.

        A prompt-caching breakpoint names a prefix of the request (``cache_control``
        on a message block); its blocks are this request's first ones.
        """
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"a prefix of {n} tokens of a {len(self.tokens)}-token sequence")
        full = n // self.hasher.block_size
        return KeyedTokens(self.hasher, self.namespace, self.tokens[:n], self.keys[:full], self.digests.prefix(full))

    def extend(self, tokens: Sequence[int] | np.ndarray) -> KeyedTokens:
        """``tokens`` (this sequence, then more) keyed: only the new blocks are hashed, chained from the last key.

        A request's reply is keyed this way when it ends, so its next turn
        (prompt + reply) finds the reply's blocks under the keys a prompt of
        the same tokens would get.
        """
        have = len(self.keys) * self.hasher.block_size
        ids = np.array(tokens, dtype=np.int32)
        if len(ids) < len(self.tokens) or not np.array_equal(ids[: len(self.tokens)], self.tokens):
            raise ValueError("extend() takes this sequence's tokens followed by more")
        ids.flags.writeable = False
        parent = self.keys[-1] if self.keys else None
        keys = self.keys + self.hasher.keys(ids[have:], self.namespace, parent=parent)
        blocks = block_tokens(ids, self.hasher.block_size)
        return KeyedTokens(self.hasher, self.namespace, ids, keys, self.digests.extended(keys, blocks))


class NamedDigests:
    """Named blocks' digests, each computed the first time it is asked for (see :class:`BlockDigests`)."""

    def __init__(self, hasher: KeyHasher, keys: Sequence[BlockKey], names: Sequence[bytes]) -> None:
        self._hasher = hasher
        self._keys = keys
        self._names = names
        self._done: list[BlockDigest | None] = [None] * len(keys)

    def __len__(self) -> int:
        return len(self._done)

    def __getitem__(self, i: int) -> BlockDigest:
        digest = self._done[i]
        if digest is None:
            digest = self._done[i] = self._hasher.named_digest(self._keys[i], self._names[i])
        return digest


Digests = BlockDigests | NamedDigests
"""What confirmation reads: ``digests[i]`` is the digest block ``i`` must carry."""


def block_tokens(tokens: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """The full blocks of ``tokens`` as an int32 array of shape ``[n, block_size]``."""
    n = len(tokens) // block_size
    arr = np.asarray(tokens[: n * block_size], dtype=np.int32)
    return arr.reshape(n, block_size)
