"""The engine's paged KV cache: kvtier's device tier.

One tensor holds every layer's KV, shaped
``[num_layers, num_blocks, 2 (K, V), num_kv_heads, block_size, head_dim]``;
``pool.layers[l]`` is layer *l*'s view ``[num_blocks, 2, kv_heads, block_size, head_dim]``.
Block *b* of layer *l* (``pool.layers[l][b]``) therefore has exactly the byte
layout of layer *l*'s slice of a kvtier block payload (:class:`~kvtier.layout.KVLayout`),
so moving a block between the pool and a host slot is ``num_layers``
contiguous copies issued as one strided ``copy_``, with no reshuffling.

An 8-bit pool (``layout.quantized``) is one ``uint8`` tensor ``[num_layers,
num_blocks, layer_bytes]``: ``pool.layers[l]`` views its quants (int8, the
same shape as above, a block's stride its whole range) and
``pool.scales[l]`` its scales ``[num_blocks, 2, kv_heads, block_size]``
float32. The attention kernels read both where they lie; a token's K/V are
quantized once, when written (:meth:`KVPool.write`).

Blocks are reference-counted: a cached prefix's blocks can be shared by
several sequences' :class:`BlockTable`\\ s and return to the free list only
when the last one frees them. A shared block must be full and is never
written again; the forward pass writes only at positions ``>= num_tokens`` of
the sequence that owns the block table.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.layout import KVLayout, quantize_rows


@dataclass
class BlockTable:
    """A sequence's pages: ``block_ids[i]`` holds its positions ``[i*B, (i+1)*B)``.

    ``num_tokens`` counts the positions whose K/V are already in the pool; the
    next forward for this sequence starts there.
    """

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def capacity(self, block_size: int) -> int:
        return len(self.block_ids) * block_size


@dataclass(frozen=True)
class Slots:
    """Where each new token's K/V goes: pool block id and offset inside the block, one row per token."""

    blocks: torch.Tensor  # int64 [N]
    offsets: torch.Tensor  # int64 [N]


@dataclass(frozen=True)
class Gather:
    """A precomputed index that gathers several sequences' K/V in one ``index_select`` per layer.

    It is built once per forward and reused by every layer, since all layers
    share the same block tables. So is ``buffer``, the destination: every
    layer gathers into the same memory (a layer's K/V are dead once it has
    attended), which spares a fresh multi-megabyte allocation, and its page
    faults, per layer: a cost that grows with the context as the copy does.
    """

    rows: torch.Tensor  # int64 [2 * num_seqs * kv_heads * num_blocks], rows of a layer viewed [-1, B*D]
    num_seqs: int
    num_blocks: int  # per sequence, padded to the longest
    buffer: torch.Tensor  # [len(rows), block_size * head_dim], overwritten by every gather


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVPool:
    """Fixed-size paged KV storage plus its block allocator.

    Allocated once (``torch.zeros``) so the engine never calls the allocator
    while serving and occupancy is bounded by construction.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks <= 0:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.scales: list[torch.Tensor] = []
        if layout.quantized:
            shape = (layout.num_layers, num_blocks, layout.layer_bytes)
            self.kv = torch.zeros(shape, dtype=torch.uint8, device=self.device)
            quants = self.kv[:, :, : layout.scales_offset].view(layout.dtype)
            scales = self.kv[:, :, layout.scales_offset :].view(torch.float32)
            self.layers = list(quants.view(layout.num_layers, num_blocks, *layout.layer_shape).unbind(0))
            self.scales = list(scales.view(layout.num_layers, num_blocks, *layout.layer_shape[:-1]).unbind(0))
        else:
            shape = (layout.num_layers, num_blocks, *layout.layer_shape)
            self.kv = torch.zeros(shape, dtype=layout.dtype, device=self.device)
            self.layers = list(self.kv.unbind(0))
        self._refs = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @functools.cached_property
    def copy_stream(self) -> torch.cuda.Stream:
        """The CUDA stream every load into this pool copies on (:class:`~kvtier.engine.onboard.LayerwiseLoad`).

        One for the pool's life, not one per load: the caching allocator
        keeps freed memory per stream, so each load's staging buffer reuses
        the previous load's memory instead of asking the driver again; and
        loads into one pool run in order.
        """
        if self.device.type != "cuda":
            raise ValueError(f"a pool on {self.device} copies without streams")
        return torch.cuda.Stream(self.device)

    def ids_on_device(self, ids: Sequence[int]) -> torch.Tensor:
        """Block ids as int64 on the pool's device, queued on the current stream without holding the host.

        A copy from pageable memory may hold the host until the stream has
        drained; from pinned memory it is queued like any other work.
        """
        rows = torch.tensor(list(ids), dtype=torch.long)
        if self.device.type == "cuda":
            rows = rows.pin_memory()
        return rows.to(self.device, non_blocking=True)

    # -- allocator -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each); all or nothing, so a failure leaves no leak."""
        if not self.can_allocate(n):
            raise MemoryError(f"KV pool has {len(self._free)} free blocks, {n} requested")
        ids = [self._free.pop() for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def share(self, ids: Sequence[int]) -> None:
        """Add a reference to blocks another table already holds (prefix reuse without a copy)."""
        for b in ids:
            if self._refs[b] == 0:
                raise ValueError(f"block {b} is free; only held blocks can be shared")
        for b in ids:
            self._refs[b] += 1

    def free(self, ids: Sequence[int]) -> None:
        """Drop one reference per id; a block returns to the free list at zero."""
        for b in ids:
            if self._refs[b] == 0:
                raise ValueError(f"block {b} freed twice")
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """How many more blocks ``table`` needs to hold ``num_tokens`` positions."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(table.block_ids))

    def grow(self, table: BlockTable, num_tokens: int) -> None:
        """Allocate the blocks ``table`` lacks to hold ``num_tokens`` positions (ask with :meth:`blocks_needed`)."""
        table.block_ids.extend(self.allocate(self.blocks_needed(table, num_tokens)))

    def release(self, table: BlockTable) -> None:
        self.free(table.block_ids)
        table.block_ids = []
        table.num_tokens = 0

    # -- payloads (the bytes kvtier's other tiers hold) -----------------------
    def write_block_from_payload(self, block_id: int, payload: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Fill pool block ``block_id`` from a ``uint8`` payload of ``layout.block_bytes`` (any device)."""
        self.kv[:, block_id].copy_(self._typed(payload), non_blocking=non_blocking)

    def read_block_to_payload(self, block_id: int, out: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Copy pool block ``block_id`` into a ``uint8`` buffer of ``layout.block_bytes`` (any device)."""
        self._typed(out).copy_(self.kv[:, block_id], non_blocking=non_blocking)

    def gather_payloads(self, ids: Sequence[int]) -> torch.Tensor:
        """Blocks ``ids`` as payloads, ``[len(ids), block_bytes]`` uint8 on the pool's device, in one gather."""
        lay = self.layout
        by_block = self.kv.view(lay.num_layers, self.num_blocks, -1).transpose(0, 1)
        return by_block[self.ids_on_device(ids)].view(torch.uint8).reshape(len(ids), lay.block_bytes)

    def payload_reader(self, ids: Sequence[int]) -> Callable[[int, torch.Tensor], None]:
        """``read(j, out)`` copies pool block ``ids[j]`` into payload ``out``, from a store job's thread.

        On the CPU that is :meth:`read_block_to_payload`, one strided copy
        with nothing to stage. On a GPU a block is ``num_layers`` pieces far
        apart in device memory; copied out alone, each costs a gather kernel
        and a host sync on the stream the forward runs on. So the blocks are
        gathered here, on the calling (compute) stream, ordered after the
        forward that wrote them, in one kernel. A read waits for that gather
        on its own thread's stream (a transfer worker's, :mod:`kvtier.transfer`)
        and is one contiguous device → host copy, synchronous, so its sync
        waits for that stream alone and the buffer is not freed under a copy.
        """
        if self.device.type != "cuda":
            return lambda j, out: self.read_block_to_payload(ids[j], out)
        staged = self.gather_payloads(ids)
        gathered = torch.cuda.Event()
        gathered.record()

        def read(j: int, out: torch.Tensor) -> None:
            torch.cuda.current_stream(self.device).wait_event(gathered)
            out.reshape(-1).copy_(staged[j])

        return read

    def _typed(self, payload: torch.Tensor) -> torch.Tensor:
        """A payload as one block of :attr:`kv` (``kv[:, b]``'s shape and dtype)."""
        lay = self.layout
        if payload.dtype != torch.uint8 or payload.numel() != lay.block_bytes:
            raise ValueError(
                f"payload must be uint8 with {lay.block_bytes} elements, got {payload.dtype} with {payload.numel()}"
            )
        if lay.quantized:
            return payload.reshape(lay.num_layers, lay.layer_bytes)
        return lay.as_blocks(payload.reshape(-1))

    # -- the forward pass's view ------------------------------------------------
    def slots(self, table: BlockTable, start: int, count: int) -> Slots:
        """Slots of positions ``[start, start+count)`` of a sequence; its table must already hold them.

        Refuses a block another table also holds: writing there would change
        a shared prefix under the other sequence's feet.
        """
        end = start + count
        if end > table.capacity(self.block_size):
            raise ValueError(f"block table holds {table.capacity(self.block_size)} positions, {end} needed")
        touched = table.block_ids[start // self.block_size : blocks_for(end, self.block_size)]
        shared = [b for b in touched if self._refs[b] > 1]
        if shared:
            raise ValueError(f"positions {start}..{end - 1} fall in shared blocks {shared}, which are read-only")
        pos = torch.arange(start, end)
        ids = torch.tensor(table.block_ids, dtype=torch.long)
        return Slots(ids[pos // self.block_size].to(self.device), (pos % self.block_size).to(self.device))

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter new keys and values (each ``[N, kv_heads, head_dim]``) into their slots, one ``index_put_`` each.

        An 8-bit pool takes each token's quants and scale (:func:`~kvtier.layout.quantize_rows`).
        """
        pool = self.layers[layer]
        if self.layout.quantized:
            scales, raw = self.scales[layer], pool.view(torch.uint8)  # torch has no index_put for float8: bytes
            for half, x in enumerate((k, v)):
                quants, scale = quantize_rows(x, self.layout.dtype)
                raw[slots.blocks, half, :, slots.offsets] = quants.view(torch.uint8)
                scales[slots.blocks, half, :, slots.offsets] = scale
            return
        pool[slots.blocks, 0, :, slots.offsets] = k.to(pool.dtype)  # a float16 pool under a float32 model rounds here
        pool[slots.blocks, 1, :, slots.offsets] = v.to(pool.dtype)

    def plan_gather(self, tables: Sequence[BlockTable], num_tokens: Sequence[int]) -> Gather:
        """Index rows so that one ``index_select`` lands K/V already in attention order.

        A layer viewed as ``[num_blocks * 2 * kv_heads, block_size * head_dim]``
        has one row per (block, K|V, head). Picking rows in (K|V, seq, head,
        block) order gives ``[2, S, kv_heads, blocks * block_size, head_dim]``
        directly, a single copy with no permute. Sequences shorter than the
        longest are padded with block 0; the caller masks those positions.
        """
        lay = self.layout
        if lay.quantized:
            raise ValueError("an 8-bit pool is read by the C attention kernels only, never gathered")
        heads = lay.num_kv_heads
        width = max(blocks_for(n, self.block_size) for n in num_tokens)
        ids = torch.zeros(len(tables), width, dtype=torch.long)
        for i, (table, n) in enumerate(zip(tables, num_tokens, strict=True)):
            need = blocks_for(n, self.block_size)
            ids[i, :need] = torch.tensor(table.block_ids[:need], dtype=torch.long)
        kv = torch.arange(2).view(2, 1, 1, 1)
        head = torch.arange(heads).view(1, 1, heads, 1)
        rows = (ids.view(1, len(tables), 1, width) * 2 + kv) * heads + head
        rows = rows.reshape(-1).to(self.device)
        buffer = torch.empty(len(rows), lay.block_size * lay.head_dim, dtype=lay.dtype, device=self.device)
        return Gather(rows, len(tables), width, buffer)

    def gather(self, layer: int, plan: Gather) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the planned sequences, each ``[S, kv_heads, blocks * block_size, head_dim]``.

        Both are views of ``plan.buffer``: valid until the next gather with the same plan.
        """
        lay = self.layout
        flat = self.layers[layer].view(-1, lay.block_size * lay.head_dim)
        torch.index_select(flat, 0, plan.rows, out=plan.buffer)
        kv = plan.buffer.view(2, plan.num_seqs, lay.num_kv_heads, plan.num_blocks * lay.block_size, lay.head_dim)
        return kv[0], kv[1]
