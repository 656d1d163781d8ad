"""Step ③ on the engine's side: fetched KV into the pool one layer at a time, under compute.

A forward needs layer *l*'s cached K/V only when layer *l* attends, after its
norm and QKV projection, and the layers before it need none of it. So the
copy of layer *l* of every fetched block runs on a worker thread while
earlier layers compute, and the forward waits (:meth:`LayerwiseLoad.wait`)
right before each layer's attention reads the pool: the same contract as
vLLM's ``start_load_kv`` / ``wait_for_layer_load``.

On the CPU, one layer of every block is one call of the native
``copy_regions`` (a ``memcpy`` per block with the GIL released), from the
pinned host slots straight into the pool's layer slice: a block payload and a
pool block have the same per-layer byte layout. On a GPU the copies are
issued on the pool's own CUDA stream (one for its life) and layer *l* is done when an event
recorded after its copies has fired; the compute stream waits on that event
(device-side, no host sync) before reading the layer. There the bytes cross
the host link whole (:func:`staged_layers`): one copy per run of host slots
that follow each other in the slab, into a staging buffer in device memory,
then one indexed copy per layer into the pool. A copy per block and layer
would be thousands of small transfers for one prompt, each paying the
link's per-transfer cost; the link is the slow part, device memory is not.

Handles stay pinned until :meth:`LayerwiseLoad.finish`, after the forward:
eviction cannot reuse a host slot that is still being read.

A model with sliding-window layers (Gemma 3) needs, in those layers, only the
positions inside the window before the point where the request resumes: a
new token there never looks further back, and neither does any token after
it. So a part may leave its first blocks out of those layers
(:attr:`LoadPart.sliding_from`): those pool blocks then hold stale KV in the
sliding layers, which the request never reads, and which
:class:`~kvtier.engine.resident.ResidentBlocks` remembers as partial so no
other request reads them either. The CUDA path copies every layer (the bytes
cross the link whole either way).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.cache import Loaded
from kvtier.engine.pool import KVPool
from kvtier.model.config import ModelConfig
from kvtier.tiers import native


@dataclass(frozen=True)
class SlidingWindow:
    """A model's sliding-window layers and how many positions each of their tokens sees (itself included)."""

    size: int
    layers: frozenset[int]

    @classmethod
    def of(cls, config: ModelConfig) -> SlidingWindow | None:
        if config.sliding_window is None or not any(config.sliding_layers):
            return None
        return cls(config.sliding_window, frozenset(i for i, s in enumerate(config.sliding_layers) if s))

    def first_block(self, resume: int, block_size: int) -> int:
        """The first block a sliding layer reads for tokens from position ``resume`` on."""
        return max(0, resume - self.size + 1) // block_size


@dataclass(frozen=True)
class LoadPart:
    """A pinned handle's blocks and the pool blocks they go to; sliding layers take blocks from ``sliding_from`` on."""

    handle: Loaded
    block_ids: Sequence[int]
    sliding_from: int = 0


class LayerwiseLoad:
    """The copies of every fetched block of one forward, layer by layer.

    With an ``executor`` the copies run there (layer 0 first); without one
    they all run before the constructor returns (no overlap). ``sliding``:
    the layers whose parts may leave blocks out (:attr:`LoadPart.sliding_from`).
    """

    def __init__(
        self,
        pool: KVPool,
        parts: Sequence[LoadPart],
        executor: ThreadPoolExecutor | None = None,
        sliding: frozenset[int] = frozenset(),
    ) -> None:
        self.pool = pool
        self.parts = list(parts)
        self.sliding = sliding
        self.num_blocks = sum(len(p.block_ids) for p in self.parts)
        lay = pool.layout
        self.full_nbytes = self.num_blocks * lay.block_bytes  # what a load of every layer moves
        left_out = sum(p.sliding_from for p in self.parts) if pool.device.type != "cuda" else 0
        self.nbytes = self.full_nbytes - left_out * len(sliding) * lay.layer_bytes  # what this one moves
        # CPU time the copies took on their thread: wall time would also count the
        # moments the thread waited for a core the forward was using, and teach the
        # cost model that a host fetch is slow when it was only descheduled.
        self.seconds = 0.0
        layers = pool.layout.num_layers
        self._ready = [threading.Event() for _ in range(layers)]
        self._cuda = pool.device.type == "cuda"
        self._events: list[torch.cuda.Event] = []
        self._error: BaseException | None = None
        self._future: Future[None] | None = None
        if executor is None:
            self._run()
        else:
            self._future = executor.submit(self._run)

    def _run(self) -> None:
        started = time.thread_time()
        try:
            if self._cuda:
                self._copy_cuda()
            else:
                self._copy_host()
        except BaseException as err:
            self._error = err
            raise
        finally:
            for ready in self._ready:
                ready.set()  # on error too: a waiting forward wakes up and raises
            self.seconds = time.thread_time() - started

    def _copy_host(self) -> None:
        lay = self.pool.layout
        src = np.array([b.data_ptr() for p in self.parts for b in p.handle.blocks], dtype=np.int64)
        ids = np.array([i for p in self.parts for i in p.block_ids], dtype=np.int64)
        windowed = np.array([k >= p.sliding_from for p in self.parts for k in range(len(p.block_ids))], dtype=bool)
        base = self.pool.kv.data_ptr()
        for layer in range(lay.num_layers):
            take = windowed if layer in self.sliding else slice(None)
            # pool.kv is [layers, blocks, *layer_shape], contiguous: block b of layer l starts at (l*NB + b) slices
            dst = base + (layer * self.pool.num_blocks + ids[take]) * lay.layer_bytes
            native.copy_regions(dst, src[take] + lay.layer_offset(layer), lay.layer_bytes)
            self._ready[layer].set()

    def _copy_cuda(self) -> None:
        stream = self.pool.copy_stream
        blocks = [b for p in self.parts for b in p.handle.blocks]
        ids = [i for p in self.parts for i in p.block_ids]
        with torch.cuda.stream(stream):
            for layer in staged_layers(self.pool, blocks, ids):
                event = torch.cuda.Event()
                event.record(stream)
                self._events.append(event)
                self._ready[layer].set()

    def wait(self, layer: int) -> None:
        """Block until layer ``layer`` of every fetched block is in the pool (on a GPU: for the compute stream)."""
        self._ready[layer].wait()
        if self._error is not None:
            raise RuntimeError("copying fetched KV into the pool failed") from self._error
        if self._cuda:
            torch.cuda.current_stream(self.pool.device).wait_event(self._events[layer])

    def finish(self) -> None:
        """Wait for the last copy, then unpin every handle (after the forward, or when it failed)."""
        try:
            if self._future is not None:
                self._future.exception()  # the error, if any, was raised through wait()
            if self._events:
                self._events[-1].synchronize()
        finally:
            for part in self.parts:
                part.handle.release()


def contiguous_runs(blocks: Sequence[torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first index, one flat view)`` per run of consecutive payloads whose bytes follow each other in memory.

    Payloads are uint8 views of host slots; blocks stored together usually
    sit in consecutive slots of the slab, so a prefix is often a few runs.
    """
    i = 0
    while i < len(blocks):
        first = blocks[i].reshape(-1)
        storage = first.untyped_storage().data_ptr()
        j, end = i + 1, first.data_ptr() + first.numel()
        while (
            j < len(blocks)
            and blocks[j].is_contiguous()
            and blocks[j].data_ptr() == end
            and blocks[j].untyped_storage().data_ptr() == storage  # adjacent by chance is not one allocation
        ):
            end += blocks[j].numel()
            j += 1
        yield i, first if j == i + 1 else first.as_strided((end - first.data_ptr(),), (1,))
        i = j


def staged_layers(pool: KVPool, blocks: Sequence[torch.Tensor], ids: Sequence[int]) -> Iterator[int]:
    """Payloads into pool blocks ``ids`` through a staging buffer on the pool's device; yields each layer as issued.

    Every run of adjacent payloads crosses to the device in one copy
    (asynchronous from pinned memory, on the current stream), then each
    layer of every block goes into the pool in one ``index_copy_``. The
    caller records an event per yielded layer. The staging buffer and the
    row ids are allocated on the current stream and used only there, so the
    caching allocator hands their memory out again only after these copies.

    The row ids cross first (:meth:`KVPool.ids_on_device`): behind the
    payloads, a copy that held the host would keep every layer's
    ``index_copy_`` from being queued while the link is busy, and their
    launches would add up after it.
    """
    lay = pool.layout
    n = len(blocks)
    device = pool.device
    rows = pool.ids_on_device(ids)
    staging = torch.empty((n, lay.block_bytes), dtype=torch.uint8, device=device)
    flat = staging.view(-1)
    for first, run in contiguous_runs(blocks):
        flat[first * lay.block_bytes : first * lay.block_bytes + run.numel()].copy_(run, non_blocking=True)
    typed = staging.view(lay.dtype).view(n, lay.num_layers, *pool.layers[0].shape[1:])
    for layer, view in enumerate(pool.layers):
        view.index_copy_(0, rows, typed[:, layer])
        yield layer


__all__ = ["LayerwiseLoad", "LoadPart", "SlidingWindow", "contiguous_runs", "staged_layers"]
