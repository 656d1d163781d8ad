"""The disk tier's I/O primitives: the C extension ``kvtier._native_io``, and the same functions in pure Python.

The extension (``native/iopool.c``, ``native/crc32c.c`` and
``native/aligned.c``, compiled by the package's own build) runs batched
positional reads and writes over a small thread pool with the GIL released,
and CRC-32C with the SSE4.2 instruction; ``copy_regions`` comes from
``kvtier._native_kernels`` (``native/copy.c``). The build requires both.
:data:`PYTHON` does the same things with ``os.preadv``/``os.pwritev`` loops
and a table-driven CRC-32C: identical results, one request at a time, and a
checksum taken a byte at a time in Python. It is the reference the tests
compare the extension with; :data:`BACKEND` is always the extension
(loaded by :mod:`kvtier.extension`, which refuses to run without it).

The functions, in both backends:

``preadv_batch(fd, buffers, offsets, bounce=None, align=4096) -> list[int]``
    Fill each writable buffer from its offset (``fd`` is one descriptor or one
    per buffer); returns the bytes read per buffer, short only at end of file.
``pwritev_batch(fd, buffers, offsets, bounce=None, align=4096) -> int``
    Write each buffer whole at its offset; returns the bytes written.
    With a ``bounce`` buffer (aligned, from ``alloc_aligned``), requests whose
    address, length or offset is not a multiple of ``align`` go through it,
    which is what O_DIRECT needs (the C version also gathers back-to-back
    requests into larger ones); a bounced write reads the partial blocks at
    its edges first and writes them back whole, so the buffers of one call
    must not share such a block. Errors raise ``OSError`` with the errno.
``preadv_crc32c_batch(fd, buffers, offsets, layer_bytes, ...) -> (counts, crcs)``
``pwritev_crc32c_batch(fd, buffers, offsets, layer_bytes, ...) -> crcs``
    The same, plus each buffer's CRC-32C per ``layer_bytes`` run (a list per
    buffer). The C version computes them in the I/O threads right after a
    buffer's bytes moved, while they are still in cache: a separate pass over
    a large batch afterwards costs a fifth of the read time again, in memory
    bandwidth alone.
``alloc_aligned(nbytes, alignment=4096)``
    Zero-filled writable memory at an aligned address (a buffer object:
    wrap it with ``memoryview``, ``numpy.frombuffer`` or ``torch.frombuffer``).
``crc32c(buffer, seed=0) -> int`` and ``crc32c_layers(buffer, layer_bytes) -> list[int]``
    CRC-32C (Castagnoli; ``crc32c(b"123456789") == 0xE3069283``); ``seed``
    continues a previous result: ``crc32c(b, crc32c(a)) == crc32c(a + b)``.
``fsync(fd)``
    ``os.fsync`` in both backends; the disk tier syncs through it, so a test can hand the tier a backend
    whose fsync fails and show that nothing is acknowledged after a failed sync.
``copy_regions(dst_addrs, src_addrs, nbytes) -> int``
    ``memcpy`` of ``nbytes`` from each ``src_addrs[i]`` to ``dst_addrs[i]``
    (two int64 numpy arrays of addresses), without the GIL: the engine copies
    one layer of every loaded block into its pool with a single call while
    the model computes the layer before. Addresses are trusted, so only code
    that owns both sides (and keeps them alive) may call it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier import extension

Buffer = Any  # any object with the buffer protocol (bytes, memoryview, numpy arrays, AlignedBuffer)
FdArg = int | Sequence[int]

PROBE_BYTES = 4096


@dataclass(frozen=True)
class IOBackend:
    name: str  # "native" or "python"
    preadv_batch: Callable[..., list[int]]
    pwritev_batch: Callable[..., int]
    preadv_crc32c_batch: Callable[..., tuple[list[int], list[list[int]]]]
    pwritev_crc32c_batch: Callable[..., list[list[int]]]
    alloc_aligned: Callable[..., Buffer]
    crc32c: Callable[..., int]
    crc32c_layers: Callable[[Buffer, int], list[int]]
    copy_regions: Callable[[Buffer, Buffer, int], int]
    crc32c_impl: str  # "sse4.2", "table" (C) or "python"
    fsync: Callable[[int], None] = os.fsync  # a field, so a reliability fault can make a sync fail (EIO)

    @property
    def native(self) -> bool:
        return self.name == "native"


# -- pure-Python fallback ------------------------------------------------------
def _crc_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC_TABLE = _crc_table()


def _bytes_view(buffer: Buffer, *, writable: bool) -> memoryview:
    view = memoryview(buffer)
    if writable and view.readonly:
        raise BufferError("buffer is not writable")
    if not view.c_contiguous:
        raise BufferError("buffer is not C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _py_crc32c(buffer: Buffer, seed: int = 0) -> int:
    if not 0 <= seed <= 0xFFFFFFFF:
        raise ValueError(f"crc32c: seed must fit in 32 bits, got {seed}")
    table, crc = _CRC_TABLE, seed ^ 0xFFFFFFFF
    for byte in bytes(_bytes_view(buffer, writable=False)):
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _py_crc32c_layers(buffer: Buffer, layer_bytes: int) -> list[int]:
    view = _bytes_view(buffer, writable=False)
    if layer_bytes <= 0 or view.nbytes % layer_bytes:
        raise ValueError(f"crc32c_layers: {view.nbytes} bytes are not a whole number of {layer_bytes}-byte layers")
    return [_py_crc32c(view[i : i + layer_bytes]) for i in range(0, view.nbytes, layer_bytes)]


def _py_alloc_aligned(nbytes: int, alignment: int = 4096) -> memoryview:
    """An anonymous mapping (page-aligned, zero-filled), cut to ``alignment`` when that exceeds a page."""
    if nbytes <= 0:
        raise ValueError(f"alloc_aligned: nbytes must be positive, got {nbytes}")
    _check_pow2("alloc_aligned: alignment", alignment)
    extra = 0 if alignment <= mmap.PAGESIZE else alignment
    region = mmap.mmap(-1, nbytes + extra)
    skip = -address_of(region) % alignment
    return memoryview(region)[skip : skip + nbytes]


def _py_copy_regions(dst_addrs: Buffer, src_addrs: Buffer, nbytes: int) -> int:
    dst = np.frombuffer(dst_addrs, dtype=np.int64)
    src = np.frombuffer(src_addrs, dtype=np.int64)
    if len(dst) != len(src) or nbytes < 0:
        raise ValueError("copy_regions: two int64 address arrays of one length, nbytes >= 0")
    for d, s in zip(dst.tolist(), src.tolist(), strict=True):
        ctypes.memmove(d, s, nbytes)
    return len(dst)


def _check_pow2(what: str, n: int) -> None:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")


def _full_read(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break  # end of file
        done += got
    return done


def _full_write(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < view.nbytes:
        done += os.pwritev(fd, [view[done:]], offset + done)
    return done


def _read_edge(fd: int, view: memoryview, offset: int) -> None:
    got = _full_read(fd, view, offset)
    view[got:] = bytes(view.nbytes - got)


def _bounced(write: bool, fd: int, data: memoryview, offset: int, bounce: memoryview, align: int) -> int:
    """One request through ``bounce``, in pieces cut at aligned file offsets (as the C version does)."""
    slice_bytes = bounce.nbytes // align * align
    pos, moved = 0, 0
    while pos < data.nbytes:
        at = offset + pos
        start = at // align * align
        step = min(start + slice_bytes - at, data.nbytes - pos)
        end = -(-(at + step) // align) * align
        cover, head = bounce[: end - start], at - start
        if write:
            if head:
                _read_edge(fd, cover[:align], start)
            if head + step != cover.nbytes and (cover.nbytes > align or not head):
                _read_edge(fd, cover[-align:], end - align)
            cover[head : head + step] = data[pos : pos + step]
            _full_write(fd, cover, start)
            moved += step
        else:
            avail = min(max(_full_read(fd, cover, start) - head, 0), step)
            data[pos : pos + avail] = cover[head : head + avail]
            moved += avail
            if avail < step:
                break  # end of file
        pos += step
    return moved


def _py_batch(
    write: bool, fd: FdArg, buffers: Sequence[Buffer], offsets: Sequence[int], bounce: Buffer | None, align: int
) -> list[int]:
    name = "pwritev_batch" if write else "preadv_batch"
    _check_pow2(f"{name}: align", align)
    fds = [fd] * len(buffers) if isinstance(fd, int) else list(fd)
    if not len(fds) == len(buffers) == len(offsets):
        raise ValueError(f"{name}: {len(buffers)} buffers, {len(offsets)} offsets, {len(fds)} file descriptors")
    if any(off < 0 for off in offsets):
        raise ValueError(f"{name}: offsets must not be negative")
    bview = None
    if bounce is not None:
        bview = _bytes_view(bounce, writable=True)
        if address_of(bview) % align or bview.nbytes < align:
            raise ValueError(f"{name}: the bounce buffer must be at least {align} B at a {align}-aligned address")
    views = [_bytes_view(b, writable=not write) for b in buffers]
    counts = []
    for f, view, off in zip(fds, views, offsets, strict=True):
        aligned = view.nbytes == 0 or not (address_of(view) | view.nbytes | off) % align
        if bview is not None and not aligned:
            counts.append(_bounced(write, f, view, off, bview, align))
        else:
            counts.append((_full_write if write else _full_read)(f, view, off))
    return counts


def _py_preadv_batch(
    fd: FdArg, buffers: Sequence[Buffer], offsets: Sequence[int], bounce: Buffer | None = None, align: int = 4096
) -> list[int]:
    return _py_batch(False, fd, buffers, offsets, bounce, align)


def _py_pwritev_batch(
    fd: FdArg, buffers: Sequence[Buffer], offsets: Sequence[int], bounce: Buffer | None = None, align: int = 4096
) -> int:
    return sum(_py_batch(True, fd, buffers, offsets, bounce, align))


def _whole_layers(name: str, buffers: Sequence[Buffer], layer_bytes: int) -> None:
    if layer_bytes <= 0:
        raise ValueError(f"{name}: layer_bytes must be positive, got {layer_bytes}")
    for k, buf in enumerate(buffers):
        if memoryview(buf).nbytes % layer_bytes:
            raise ValueError(f"{name}: buffer {k} is not a whole number of {layer_bytes}-byte layers")


def _py_preadv_crc32c_batch(
    fd: FdArg,
    buffers: Sequence[Buffer],
    offsets: Sequence[int],
    layer_bytes: int,
    bounce: Buffer | None = None,
    align: int = 4096,
) -> tuple[list[int], list[list[int]]]:
    _whole_layers("preadv_crc32c_batch", buffers, layer_bytes)
    counts = _py_batch(False, fd, buffers, offsets, bounce, align)
    return counts, [_py_crc32c_layers(b, layer_bytes) for b in buffers]


def _py_pwritev_crc32c_batch(
    fd: FdArg,
    buffers: Sequence[Buffer],
    offsets: Sequence[int],
    layer_bytes: int,
    bounce: Buffer | None = None,
    align: int = 4096,
) -> list[list[int]]:
    _whole_layers("pwritev_crc32c_batch", buffers, layer_bytes)
    _py_batch(True, fd, buffers, offsets, bounce, align)
    return [_py_crc32c_layers(b, layer_bytes) for b in buffers]


PYTHON = IOBackend(
    name="python",
    preadv_batch=_py_preadv_batch,
    pwritev_batch=_py_pwritev_batch,
    preadv_crc32c_batch=_py_preadv_crc32c_batch,
    pwritev_crc32c_batch=_py_pwritev_crc32c_batch,
    alloc_aligned=_py_alloc_aligned,
    crc32c=_py_crc32c,
    crc32c_layers=_py_crc32c_layers,
    copy_regions=_py_copy_regions,
    crc32c_impl="python",
)


def address_of(buffer: Buffer) -> int:
    """The address of a buffer's first byte (to check alignment)."""
    view = _bytes_view(buffer, writable=False)
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


# -- the extension -------------------------------------------------------------
def _native_backend() -> IOBackend:
    io, kernels = extension.io, extension.kernels  # copy_regions is the kernels': a copy, not I/O
    return IOBackend(
        name="native",
        preadv_batch=io.preadv_batch,
        pwritev_batch=io.pwritev_batch,
        preadv_crc32c_batch=io.preadv_crc32c_batch,
        pwritev_crc32c_batch=io.pwritev_crc32c_batch,
        alloc_aligned=io.alloc_aligned,
        crc32c=io.crc32c,
        crc32c_layers=io.crc32c_layers,
        copy_regions=kernels.copy_regions,
        crc32c_impl=io.CRC32C_IMPL,
    )


NATIVE_BACKEND: IOBackend = _native_backend()
BACKEND: IOBackend = NATIVE_BACKEND

preadv_batch = BACKEND.preadv_batch
pwritev_batch = BACKEND.pwritev_batch
preadv_crc32c_batch = BACKEND.preadv_crc32c_batch
pwritev_crc32c_batch = BACKEND.pwritev_crc32c_batch
alloc_aligned = BACKEND.alloc_aligned
crc32c = BACKEND.crc32c
crc32c_layers = BACKEND.crc32c_layers
copy_regions = BACKEND.copy_regions


def probe_direct(directory: Path, backend: IOBackend = BACKEND) -> str | None:
    """Why O_DIRECT cannot be used for files in ``directory``, or None when it can.

    Opening with O_DIRECT is not enough to know: some filesystems (older
    tmpfs, some overlays and FUSE mounts) accept the flag and refuse the
    first I/O with EINVAL. So the probe writes and reads back one aligned
    4096-byte block in a scratch file, then removes it.
    """
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return "this platform has no O_DIRECT"
    path = Path(directory) / f".odirect-probe-{os.getpid()}"
    block = backend.alloc_aligned(PROBE_BYTES)
    memoryview(block)[:8] = b"kvtier\0\1"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        try:
            backend.pwritev_batch(fd, [block], [0])
            back = backend.alloc_aligned(PROBE_BYTES)
            if backend.preadv_batch(fd, [back], [0]) != [PROBE_BYTES] or bytes(memoryview(back)[:8]) != b"kvtier\0\1":
                return "an O_DIRECT read did not return what was written"
        finally:
            os.close(fd)
    except OSError as err:
        return f"{err.strerror or err} (errno {err.errno})"
    finally:
        path.unlink(missing_ok=True)
    return None


def return_freed_heap() -> bool:
    """Hand the C heap's freed pages back to the kernel (glibc's ``malloc_trim``); False where the libc has none.

    Opening a disk tier reads its index through buffers as large as the
    index (the sealed mirror, the cursor's joined records, their sorted
    copies), then frees them. glibc keeps freed heap memory for reuse, so
    without this a tier of a hundred thousand blocks stays resident at twice
    its index's size for the life of the process.
    """
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


__all__ = [
    "BACKEND",
    "NATIVE_BACKEND",
    "PYTHON",
    "IOBackend",
    "address_of",
    "alloc_aligned",
    "crc32c",
    "crc32c_layers",
    "preadv_batch",
    "preadv_crc32c_batch",
    "probe_direct",
    "pwritev_batch",
    "pwritev_crc32c_batch",
    "return_freed_heap",
]
