from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.tiers import native
from kvtier.tiers.native import PYTHON, IOBackend, address_of, probe_direct

REPO = Path(__file__).resolve().parents[2]

BACKENDS = [pytest.param(native.NATIVE_BACKEND, id="native"), pytest.param(PYTHON, id="python")]

# RFC 3720 (iSCSI) B.4 and the usual check value.
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
]


def random_bytes(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_both_extensions_are_built_and_in_use() -> None:
    """The build requires them (setup.py): a checkout whose build did not compile them fails here first."""
    assert native.BACKEND is native.NATIVE_BACKEND and native.BACKEND.native
    from kvtier import _native_io, _native_kernels
    from kvtier.engine import kernels, quant

    assert Path(_native_io.__file__).suffix == Path(_native_kernels.__file__).suffix == ".so"  # from native/*.c
    assert native.crc32c is _native_io.crc32c and native.preadv_batch is _native_io.preadv_batch
    assert native.copy_regions is _native_kernels.copy_regions
    assert kernels.IMPLS and kernels.PREFILL_IMPLS and quant.IMPL in ("avx2", "base")
    assert not hasattr(_native_io, "paged_decode_attention") and not hasattr(_native_kernels, "preadv_batch")


def test_the_hardware_crc_is_used_where_the_cpu_has_it() -> None:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " sse4_2" not in flags:
        pytest.skip("no SSE4.2 on this CPU")
    assert native.BACKEND.crc32c_impl == "sse4.2"


# -- CRC-32C -------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("data", "want"), VECTORS)
def test_crc32c_vectors(backend: IOBackend, data: bytes, want: int) -> None:
    assert backend.crc32c(data) == want


def test_portable_c_path_matches_the_vectors_and_the_hardware() -> None:
    from kvtier import _native_io as _native

    for data, want in VECTORS:
        assert _native._crc32c_portable(data) == want
    for n in (1, 7, 767, 768, 769, 3 * 8192 - 1, 3 * 8192 + 9, 100_003):
        data = random_bytes(n, n)
        assert _native._crc32c_portable(data) == _native.crc32c(data)


@pytest.mark.parametrize("backend", BACKENDS)
def test_crc32c_seed_continues_a_previous_result(backend: IOBackend) -> None:
    a, b = random_bytes(1000, 1), random_bytes(333, 2)
    assert backend.crc32c(b, backend.crc32c(a)) == backend.crc32c(a + b)
    with pytest.raises(ValueError, match="32 bits"):
        backend.crc32c(a, 1 << 32)


def test_native_crc32c_equals_the_fallback_on_random_buffers() -> None:
    nb = native.NATIVE_BACKEND
    # lengths around the 8-byte, 3x256 and 3x8192 stream boundaries, at every start misalignment
    for n in (0, 1, 5, 8, 63, 255, 767, 768, 769, 4096, 24575, 24576, 24577, 50_000):
        data = memoryview(random_bytes(n + 8, n))
        for start in (0, 1, 3, 7):
            chunk = data[start : start + n]
            assert nb.crc32c(chunk) == PYTHON.crc32c(chunk), (n, start)


def test_native_crc32c_over_the_gil_free_size() -> None:
    data = random_bytes(3 * 1024**2 + 5, 9)  # above the size where the GIL is released
    from kvtier import _native_io as _native

    assert _native.crc32c(data) == _native._crc32c_portable(data)
    assert native.NATIVE_BACKEND.crc32c_layers(data[:-5], 1024**2) == [
        _native._crc32c_portable(data[i : i + 1024**2]) for i in range(0, 3 * 1024**2, 1024**2)
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_crc32c_layers_is_crc32c_per_layer(backend: IOBackend) -> None:
    data = random_bytes(5 * 768, 4)
    assert backend.crc32c_layers(data, 768) == [backend.crc32c(data[i : i + 768]) for i in range(0, 5 * 768, 768)]
    typed = torch.arange(5 * 192, dtype=torch.float32).numpy()  # any C-contiguous buffer, read as bytes
    assert backend.crc32c_layers(typed, 768) == [
        backend.crc32c(typed.tobytes()[i : i + 768]) for i in range(0, 3840, 768)
    ]
    with pytest.raises(ValueError, match="whole number"):
        backend.crc32c_layers(data, 1000)
    with pytest.raises(ValueError, match="whole number"):
        backend.crc32c_layers(data, 0)


# -- aligned memory ------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("alignment", [64, 4096, 65536])
def test_alloc_aligned_is_aligned_zeroed_and_wrappable(backend: IOBackend, alignment: int) -> None:
    buf = backend.alloc_aligned(3 * 4096 + 100, alignment)
    assert address_of(buf) % alignment == 0
    assert memoryview(buf).nbytes == 3 * 4096 + 100 and not memoryview(buf).readonly
    arr = np.frombuffer(buf, dtype=np.uint8)
    assert not arr.any()
    t = torch.frombuffer(buf, dtype=torch.uint8)
    t[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert t.data_ptr() % alignment == 0 and arr[:4].tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_alloc_aligned_rejects_bad_arguments(backend: IOBackend) -> None:
    with pytest.raises(ValueError, match="power of two"):
        backend.alloc_aligned(4096, 3000)
    with pytest.raises(ValueError, match="positive"):
        backend.alloc_aligned(0)


def test_native_aligned_buffer_outlives_its_views() -> None:
    buf = native.NATIVE_BACKEND.alloc_aligned(8192)
    view = memoryview(buf)
    del buf  # the view keeps the memory alive
    view[:] = b"\x07" * 8192
    assert view[8191] == 7 and len(view) == 8192


# -- batched positional I/O ----------------------------------------------------
@pytest.fixture
def fd(tmp_path: Path):
    fd = os.open(tmp_path / "data.bin", os.O_RDWR | os.O_CREAT, 0o600)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_writes_then_reads_round_trip(backend: IOBackend, fd: int) -> None:
    sizes = [4096, 1, 5000, 3 * 1024**2 + 17, 0, 12288]  # one is over a piece, one is empty
    offsets = [0, 4096, 8192, 20480, 4097, 20480 + 3 * 1024**2 + 17]
    data = [np.frombuffer(random_bytes(n, i), dtype=np.uint8) for i, n in enumerate(sizes)]
    assert backend.pwritev_batch(fd, data, offsets) == sum(sizes)
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    assert backend.preadv_batch(fd, outs, offsets) == sizes
    for want, got in zip(data, outs, strict=True):
        assert np.array_equal(want, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_small_buffers_and_one_fd_per_buffer(backend: IOBackend, tmp_path: Path) -> None:
    fds = [os.open(tmp_path / f"f{i}", os.O_RDWR | os.O_CREAT, 0o600) for i in range(3)]
    try:
        n = 200
        data = [random_bytes(4096, i) for i in range(n)]
        where = [fds[i % 3] for i in range(n)]
        offsets = [(i // 3) * 4096 for i in range(n)]
        assert backend.pwritev_batch(where, data, offsets) == n * 4096
        outs = [bytearray(4096) for _ in range(n)]
        assert backend.preadv_batch(where, outs, offsets) == [4096] * n
        assert [bytes(o) for o in outs] == data
    finally:
        for f in fds:
            os.close(f)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reads_past_end_of_file_are_short_not_errors(backend: IOBackend, fd: int) -> None:
    backend.pwritev_batch(fd, [b"x" * 6000], [0])
    outs = [bytearray(4096), bytearray(4096), bytearray(10)]
    assert backend.preadv_batch(fd, outs, [0, 4096, 9000]) == [4096, 6000 - 4096, 0]
    assert bytes(outs[1][: 6000 - 4096]) == b"x" * (6000 - 4096)


@pytest.mark.parametrize("backend", BACKENDS)
def test_io_errors_raise_oserror_with_errno(backend: IOBackend, tmp_path: Path) -> None:
    ro = os.open(tmp_path / "ro.bin", os.O_RDONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError) as info:
            backend.pwritev_batch(ro, [b"a" * 10, b"b" * 10], [0, 10])
        assert info.value.errno == errno.EBADF
    finally:
        os.close(ro)
    with pytest.raises(OSError) as info:
        backend.preadv_batch(ro, [bytearray(10)], [0])  # closed
    assert info.value.errno == errno.EBADF


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_arguments_are_clear_errors(backend: IOBackend, fd: int) -> None:
    with pytest.raises(ValueError, match="offsets"):
        backend.preadv_batch(fd, [bytearray(4)], [0, 4])
    with pytest.raises(ValueError, match="file descriptors"):
        backend.preadv_batch([fd, fd], [bytearray(4)], [0])
    with pytest.raises(ValueError, match="negative"):
        backend.pwritev_batch(fd, [b"abcd"], [-4])
    with pytest.raises(BufferError):
        backend.preadv_batch(fd, [b"read-only"], [0])
    with pytest.raises(TypeError):
        backend.preadv_batch(fd, [object()], [0])
    with pytest.raises(ValueError, match="power of two"):
        backend.preadv_batch(fd, [bytearray(4)], [0], None, 1000)
    with pytest.raises(ValueError, match="bounce"):
        backend.preadv_batch(fd, [bytearray(4)], [0], bytearray(100))


def unaligned(n: int, skew: int, seed: int) -> np.ndarray:
    """``n`` random bytes at an address ``skew`` bytes past a 4096 boundary."""
    base = np.frombuffer(native.alloc_aligned(n + 8192), dtype=np.uint8)
    arr = base[skew : skew + n]
    arr[:] = np.frombuffer(random_bytes(n, seed), dtype=np.uint8)
    return arr


def bounce_cases() -> list[tuple[int, int, int]]:
    """(length, file offset, memory skew): aligned, unaligned memory, unaligned length, offset, several slices."""
    return [(8192, 0, 0), (8192, 4096, 64), (1536, 8192, 0), (5000, 12288 + 100, 7), (3 * 1024**2 + 3, 4095, 1)]


def check_bounced_round_trip(backend: IOBackend, fd: int, bounce: object) -> None:
    size = 24 * 1024**2  # every case below lies inside it
    backbone = random_bytes(size, 99)
    backend.pwritev_batch(fd, [backbone], [0], bounce)
    cases = bounce_cases()
    data = [unaligned(n, skew, i) for i, (n, _, skew) in enumerate(cases)]
    offsets = [off + 4 * 1024**2 * i for i, (_, off, _) in enumerate(cases)]
    assert backend.pwritev_batch(fd, data, offsets, bounce) == sum(n for n, _, _ in cases)
    outs = [unaligned(n, (skew * 3) % 4096, 1000 + i) for i, (n, _, skew) in enumerate(cases)]
    assert backend.preadv_batch(fd, outs, offsets, bounce) == [n for n, _, _ in cases]
    for want, got in zip(data, outs, strict=True):
        assert np.array_equal(want, got)
    expect = bytearray(backbone)  # bytes around each write are kept (read-modify-write of edge blocks)
    for arr, off in zip(data, offsets, strict=True):
        expect[off : off + arr.nbytes] = arr.tobytes()
    whole = native.alloc_aligned(size)
    assert backend.preadv_batch(fd, [whole], [0], bounce) == [size]
    assert bytes(whole) == bytes(expect)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounced_io_on_a_buffered_fd(backend: IOBackend, fd: int) -> None:
    check_bounced_round_trip(backend, fd, backend.alloc_aligned(1024**2))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bounced_io_with_o_direct(backend: IOBackend, tmp_path: Path) -> None:
    why = probe_direct(tmp_path)
    if why is not None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT: {why}")
    fd = os.open(tmp_path / "direct.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    try:
        backend.pwritev_batch(fd, [backend.alloc_aligned(4096)], [0])
        with pytest.raises(OSError) as info:  # unaligned memory without a bounce buffer: the kernel says no
            backend.preadv_batch(fd, [unaligned(4096, 8, 0)], [0])
        assert info.value.errno == errno.EINVAL
        check_bounced_round_trip(backend, fd, backend.alloc_aligned(4 * 4096))
    finally:
        os.close(fd)


def test_backends_read_each_others_files(fd: int) -> None:
    data = [random_bytes(3000, i) for i in range(5)]
    offsets = [i * 4096 for i in range(5)]
    native.NATIVE_BACKEND.pwritev_batch(fd, data, offsets)
    outs = [bytearray(3000) for _ in data]
    PYTHON.preadv_batch(fd, outs, offsets)
    assert [bytes(o) for o in outs] == data


def test_concurrent_batches_from_many_threads(tmp_path: Path) -> None:
    nb = native.NATIVE_BACKEND
    fd = os.open(tmp_path / "shared.bin", os.O_RDWR | os.O_CREAT, 0o600)
    blocks = [random_bytes(65536, i) for i in range(64)]
    nb.pwritev_batch(fd, blocks, [i * 65536 for i in range(64)])
    failures: list[int] = []

    def reader(t: int) -> None:
        for rep in range(20):
            idx = [(t * 7 + rep + k) % 64 for k in range(8)]
            outs = [bytearray(65536) for _ in idx]
            nb.preadv_batch(fd, outs, [i * 65536 for i in idx])
            if [bytes(o) for o in outs] != [blocks[i] for i in idx]:
                failures.append(t)

    threads = [threading.Thread(target=reader, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    os.close(fd)
    assert failures == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_the_thread_pool_works_in_a_forked_child(fd: int) -> None:
    nb = native.NATIVE_BACKEND
    data = [random_bytes(8192, i) for i in range(16)]
    nb.pwritev_batch(fd, data, [i * 8192 for i in range(16)])  # the parent's pool is running now
    pid = os.fork()
    if pid == 0:  # the child has none of the parent's worker threads
        outs = [bytearray(8192) for _ in range(16)]
        try:
            ok = nb.preadv_batch(fd, outs, [i * 8192 for i in range(16)]) == [8192] * 16
            os._exit(0 if ok and [bytes(o) for o in outs] == data else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_probe_direct_accepts_this_filesystem_or_says_why(tmp_path: Path) -> None:
    why = probe_direct(tmp_path)
    assert why is None or "errno" in why or "O_DIRECT" in why
    assert not list(tmp_path.iterdir())  # the scratch file is gone


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bounced", [False, True], ids=["plain", "bounced"])
def test_crc32c_batches_checksum_what_they_moved(backend: IOBackend, fd: int, bounced: bool) -> None:
    layer = 12288
    sizes = [layer, 30 * layer, 0, 300 * layer]  # one buffer spans several pieces (and bounce slices)
    offsets = [0, 4 * 4096, 100 * 4096, 128 * 4096]  # in pages: 0-2, 4-93, -, 128-1027
    data = [
        unaligned(n, 64, i) if bounced else np.frombuffer(random_bytes(n, i), np.uint8) for i, n in enumerate(sizes)
    ]
    bounce = backend.alloc_aligned(1024**2) if bounced else None
    want = [backend.crc32c_layers(d, layer) for d in data]
    assert backend.pwritev_crc32c_batch(fd, data, offsets, layer, bounce) == want
    outs = [unaligned(n, 128, 50 + i) for i, n in enumerate(sizes)]
    counts, crcs = backend.preadv_crc32c_batch(fd, outs, offsets, layer, bounce)
    assert counts == sizes and crcs == want
    with pytest.raises(ValueError, match="layers"):
        backend.preadv_crc32c_batch(fd, [bytearray(layer + 1)], [0], layer)
    with pytest.raises(ValueError, match="positive"):
        backend.pwritev_crc32c_batch(fd, [b""], [0], 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_back_to_back_bounced_buffers_in_any_order(backend: IOBackend, fd: int) -> None:
    """Adjacent requests are gathered into larger ones (C version); results stay in the caller's order."""
    n, size = 96, 8192
    order = np.random.default_rng(3).permutation(n).tolist()
    data = [unaligned(size, 16, i) for i in range(n)]
    bounce = backend.alloc_aligned(256 * 1024)  # slices of 64 KiB: eight buffers a request
    assert backend.pwritev_batch(fd, [data[i] for i in order], [i * size for i in order], bounce) == n * size
    outs = [unaligned(3000, 8, 500 + i) for i in range(n)]  # reads may share blocks, and start mid-block
    counts, crcs = backend.preadv_crc32c_batch(
        fd, [outs[i] for i in order], [i * size + 100 for i in order], 1000, bounce
    )
    assert counts == [3000] * n
    for k, i in enumerate(order):
        assert outs[i].tobytes() == data[i][100:3100].tobytes()
        assert crcs[k] == backend.crc32c_layers(data[i][100:3100], 1000)


def test_a_missing_extension_stops_kvtier_at_import_in_one_line() -> None:
    """No silent pure-Python fallback: the message names the module and how to build it."""
    code = (
        "import sys; sys.modules['kvtier._native_io'] = None\n"
        "try:\n    import kvtier.extension\nexcept ImportError as err:\n    print(type(err).__name__, err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.stdout.startswith("ExtensionMissing kvtier._native_io is not built"), done.stdout + done.stderr
    assert "make setup" in done.stdout and len(done.stdout.strip().splitlines()) == 1
