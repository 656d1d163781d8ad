from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import DIGEST_BYTES, KEY_BYTES, KeyHasher, Secret

TOKENS = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=96)


def hasher(secret: Secret, *, fingerprint: str = "m", layout: str = "L", block_size: int = 4) -> KeyHasher:
    return KeyHasher(secret, model_fingerprint=fingerprint, layout_descriptor=layout, block_size=block_size)


@pytest.fixture(scope="module")
def secret(tmp_path_factory: pytest.TempPathFactory) -> Secret:
    return Secret.load_or_create(tmp_path_factory.mktemp("data"))


def test_secret_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    first = Secret.load_or_create(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "secret").st_mode) == 0o600
    assert Secret.load_or_create(tmp_path) == first
    assert len(first.raw) == 32


def test_keys_identical_across_processes(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path; from kvtier.keys import KeyHasher, Secret\n"
        "h = KeyHasher(Secret.load_or_create(Path(sys.argv[1])), model_fingerprint='m', layout_descriptor='L',"
        " block_size=4)\n"
        "print(','.join(k.hex() for k in h.keys(list(range(1000, 1042)), 'tenant')))\n"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
        ).stdout.strip()
        for seed in (1, 2)
    ]
    assert runs[0] == runs[1]
    here = hasher(Secret.load_or_create(tmp_path)).keys(list(range(1000, 1042)), "tenant")
    assert runs[0] == ",".join(k.hex() for k in here)
    assert len(here) == 10  # 42 tokens, block 4: the 2-token tail gets no key


def test_key_bytes_follow_the_written_spec(secret: Secret) -> None:
    h = hasher(secret)
    tokens = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int32)
    root = h.root("ns")
    k0 = xxhash.xxh3_128_digest(root + tokens[:4].astype("<i4").tobytes(), secret.seed)
    k1 = xxhash.xxh3_128_digest(k0 + tokens[4:].astype("<i4").tobytes(), secret.seed)
    assert h.keys(tokens, "ns") == [k0, k1]
    assert all(len(k) == KEY_BYTES for k in (root, k0, k1))


@given(tokens=TOKENS)
def test_partial_tail_gets_no_key(secret: Secret, tokens: list[int]) -> None:
    h = hasher(secret)
    keys = h.keys(tokens, "ns")
    assert len(keys) == len(tokens) // 4
    assert h.keys(tokens[: len(keys) * 4], "ns") == keys


@settings(max_examples=60)
@given(tokens=TOKENS.filter(lambda t: len(t) >= 4), data=st.data())
def test_changing_one_token_changes_its_block_and_every_later_one(
    secret: Secret, tokens: list[int], data: st.DataObject
) -> None:
    h = hasher(secret)
    n_full = len(tokens) // 4 * 4
    pos = data.draw(st.integers(0, n_full - 1))
    changed = list(tokens)
    changed[pos] = data.draw(st.integers(0, 2**31 - 1).filter(lambda v: v != tokens[pos]))
    before, after = h.keys(tokens, "ns"), h.keys(changed, "ns")
    block = pos // 4
    assert before[:block] == after[:block]
    assert all(a != b for a, b in zip(before[block:], after[block:], strict=True))


@settings(max_examples=30)
@given(tokens=TOKENS.filter(lambda t: len(t) >= 8), which=st.sampled_from(["namespace", "fingerprint", "layout"]))
def test_root_fields_change_every_key(secret: Secret, tokens: list[int], which: str) -> None:
    base = hasher(secret).keys(tokens, "ns")
    if which == "namespace":
        other = hasher(secret).keys(tokens, "ns2")
    elif which == "fingerprint":
        other = hasher(secret, fingerprint="m2").keys(tokens, "ns")
    else:
        other = hasher(secret, layout="L2").keys(tokens, "ns")
    assert all(a != b for a, b in zip(base, other, strict=True))


@settings(max_examples=30)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=64))
def test_block_size_changes_every_key(secret: Secret, tokens: list[int]) -> None:
    k4 = hasher(secret, block_size=4).keys(tokens, "ns")
    k8 = hasher(secret, block_size=8).keys(tokens, "ns")
    assert not set(k4) & set(k8)


def test_secret_changes_every_key(tmp_path: Path, secret: Secret) -> None:
    other = Secret.load_or_create(tmp_path)
    tokens = list(range(64))
    assert not set(hasher(secret).keys(tokens, "ns")) & set(hasher(other).keys(tokens, "ns"))


def test_no_key_for_short_input(secret: Secret) -> None:
    assert hasher(secret).keys([1, 2, 3], "ns") == []
    assert hasher(secret).keys([], "ns") == []


def test_the_native_key_chain_is_the_one_in_use() -> None:
    from kvtier import _native_kernels, keys

    assert keys._CHAIN is _native_kernels.xxh3_128_chain


@settings(max_examples=40)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=200), block_size=st.sampled_from([1, 4, 16, 33]))
def test_native_chain_equals_the_python_chain(secret: Secret, tokens: list[int], block_size: int) -> None:
    from kvtier.keys import xxh3_128

    native = hasher(secret, block_size=block_size)
    python = KeyHasher(
        secret,
        model_fingerprint="m",
        layout_descriptor="L",
        block_size=block_size,
        hash128=lambda data, seed: xxh3_128(data, seed),  # not the default function: forces the Python loop
    )
    assert native.keys(tokens, "ns") == python.keys(tokens, "ns")


def test_digest_bytes_follow_the_written_spec(secret: Secret) -> None:
    import hashlib

    h = hasher(secret)
    tokens = np.array([7, 70000, 2**31 - 1, 0], dtype=np.int32)
    (key,) = h.keys(tokens, "tenant")
    subkey = hashlib.blake2b(b"kvtier-token-digest-key", key=secret.raw, digest_size=32).digest()
    want = hashlib.blake2b(key + tokens.astype("<i4").tobytes(), key=subkey, digest_size=32).digest()
    assert secret.digest_key == subkey and h.digest(key, tokens) == want and len(want) == DIGEST_BYTES


def test_digests_differ_by_secret_key_and_tokens(tmp_path: Path, secret: Secret) -> None:
    tokens = np.arange(8, dtype=np.int32)
    h = hasher(secret)
    keys = h.keys(tokens, "tenant")
    base = h.digest(keys[0], tokens[:4])
    assert h.digest(keys[0], tokens[:4].copy()) == base  # a function of the bytes, not the object
    assert h.digest(keys[1], tokens[:4]) != base  # equal tokens under another key: unlinkable
    assert h.digest(keys[0], tokens[4:]) != base
    assert hasher(Secret.load_or_create(tmp_path)).digest(keys[0], tokens[:4]) != base


def test_request_digests_are_computed_once_and_only_when_asked(secret: Secret) -> None:
    h = hasher(secret)
    tokens = np.arange(12, dtype=np.int32)
    keys = h.keys(tokens, "tenant")
    digests = h.digests(keys, tokens)
    assert len(digests) == 3 and digests._done == [None] * 3  # nothing computed before it is needed
    assert digests[1] == h.digest(keys[1], tokens[4:8]) and digests[1] is digests[1]
    assert digests._done[0] is None and digests._done[2] is None


def test_a_secret_that_cannot_be_created_is_process_local_and_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from kvtier import errors
    from tests.helpers import read_only

    monkeypatch.setattr(errors, "_seen", set())
    with read_only(tmp_path), caplog.at_level(logging.WARNING, logger="kvtier"):
        first = Secret.load_or_ephemeral(tmp_path / "data")  # cannot even be made
        second = Secret.load_or_ephemeral(tmp_path)  # exists, holds no secret, cannot take one
    assert not first.persistent and not second.persistent and first.raw != second.raw
    assert sum("process-local" in r.getMessage() for r in caplog.records) == 1
    made = Secret.load_or_ephemeral(tmp_path)
    assert made.persistent and Secret.load_or_create(tmp_path) == made


def test_a_secret_that_exists_but_cannot_be_read_is_a_one_line_error(tmp_path: Path) -> None:
    from kvtier.errors import KVTierError

    (tmp_path / "secret").mkdir()  # unreadable as a file, whoever runs the test
    with pytest.raises(KVTierError, match="cannot read the key secret") as refused:
        Secret.load_or_ephemeral(tmp_path)
    assert "\n" not in str(refused.value)


def test_named_key_and_digest_bytes_follow_the_written_spec(secret: Secret) -> None:
    import hashlib
    import struct

    h = hasher(secret)
    name = b"llama-state\x00chunk-3"
    key = h.named(name, "tenant")
    want = xxhash.xxh3_128_digest(
        b"kvtier-named" + bytes([1]) + h.root("tenant") + struct.pack("<I", len(name)) + name, secret.seed
    )
    assert key == want and len(key) == KEY_BYTES
    subkey = hashlib.blake2b(b"kvtier-named-digest-key", key=secret.raw, digest_size=32).digest()
    assert h.named_digest(key, name) == hashlib.blake2b(key + name, key=subkey, digest_size=32).digest()


def test_named_keys_are_bound_like_token_keys_and_apart_from_them(tmp_path: Path, secret: Secret) -> None:
    h = hasher(secret)
    key = h.named(b"n", "ns")
    assert h.named(b"n", "ns") == key  # a function of the name, not the call
    others = [h.named(b"m", "ns"), h.named(b"n", "other"), hasher(secret, fingerprint="x").named(b"n", "ns")]
    assert key not in others and hasher(secret, layout="L2").named(b"n", "ns") != key
    assert hasher(Secret.load_or_create(tmp_path)).named(b"n", "ns") != key
    # A name spelling a block's own chain input (previous key, then its tokens) still gets another key...
    tokens = np.arange(4, dtype=np.int32)
    (token_key,) = h.keys(tokens, "ns")
    spelled = h.root("ns") + tokens.astype("<i4").tobytes()
    assert h.named(spelled, "ns") != token_key
    # ... and the same key and bytes digest differently as a name and as tokens.
    assert h.named_digest(token_key, tokens.astype("<i4").tobytes()) != h.digest(token_key, tokens)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=40), st.lists(st.integers(0, 2**31 - 1), max_size=40))
def test_an_extended_chain_has_the_keys_of_the_whole(secret: Secret, head: list[int], tail: list[int]) -> None:
    h = hasher(secret)
    first = h.keyed(head, "ns")
    whole = first.extend(head + tail)
    assert whole.keys == h.keys(head + tail, "ns")
    assert [whole.digests[i] for i in range(whole.num_blocks)] == [
        h.digest(k, b) for k, b in zip(whole.keys, whole.blocks, strict=True)
    ]
    assert whole.namespace == "ns" and whole.tokens.tolist() == head + tail


def test_extend_hashes_only_the_new_blocks_and_keeps_the_digests_done(secret: Secret) -> None:
    h = hasher(secret)
    first = h.keyed(list(range(10)), "ns")  # two full blocks and a tail of two
    _ = first.digests[1]
    calls: list[tuple[int, object]] = []
    keys = h.keys
    h.keys = lambda tokens, ns, *, parent=None: calls.append((len(tokens), parent)) or keys(tokens, ns, parent=parent)  # type: ignore[method-assign]
    whole = first.extend(list(range(17)))
    assert calls == [(9, first.keys[-1])]  # tokens 8..16: the tail and the rest, chained from block 1
    assert whole.digests._done[1] == first.digests[1] and whole.digests._done[2] is None
    with pytest.raises(ValueError, match="followed by more"):
        first.extend([99, *range(1, 17)])
    assert first.tokens.flags.writeable is False  # shared by threads (a store job reads it): never changed


def test_a_prefix_is_the_chain_cut_with_nothing_hashed_again(secret: Secret) -> None:
    """A cache_control breakpoint's prefix: the request's own first blocks, keys and digests."""
    h = hasher(secret)
    whole = h.keyed(list(range(40)), "ns")  # ten blocks of four
    _ = whole.digests[1]
    keys = h.keys
    h.keys = lambda *a, **k: pytest.fail("a prefix hashed again")  # type: ignore[method-assign]
    head = whole.prefix(19)
    h.keys = keys  # type: ignore[method-assign]
    assert head.tokens.tolist() == list(range(19)) and head.keys == whole.keys[:4] == h.keys(list(range(19)), "ns")
    assert head.digests._done[1] == whole.digests[1] and len(head.digests) == 4
    assert head.digests[0] == h.digest(head.keys[0], head.blocks[0])
    assert whole.prefix(0).keys == [] and whole.prefix(40).keys == whole.keys
    with pytest.raises(ValueError, match="prefix of 41"):
        whole.prefix(41)
