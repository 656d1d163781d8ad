"""Step ③ of the data path: cached blocks on their way up to host memory, pinned as they land.

A :class:`Fetch` is started the moment a request's lookup is known (see
:meth:`kvtier.manager.CacheManager.fetch`): host-resident blocks are pinned at
once, lower-tier blocks are promoted in batches on a transfer thread while
the request still waits for its turn. When the engine admits the request it
calls :meth:`Fetch.take`, which waits at most until the fetch's deadline and
then hands over the contiguous prefix that has landed as a
:class:`LoadHandle`. Whatever has not landed by then is recomputed: a fetch
never stalls a request past the point where recomputing would have won, and
a late batch is unpinned by its producer, never used.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvtier.keys import BlockKey
from kvtier.tiers.base import TierKind


@dataclass
class LoadHandle:
    """Pinned host copies of a request's leading cached blocks; release when copied.

    ``blocks[i]`` is block ``first_block + i``'s payload (uint8,
    ``layout.block_bytes``), a view of its host slot: zero-copy, valid until
    :meth:`release` (or the ``with`` block's end). ``served_from[i]`` is the
    tier the block was found in before the load.
    """

    namespace: str
    block_size: int
    keys: list[BlockKey]
    blocks: list[torch.Tensor]
    served_from: list[TierKind]
    _release: Callable[[LoadHandle], None] = field(repr=False)
    released: bool = False
    first_block: int = 0

    def __enter__(self) -> LoadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        self._release(self)

    @property
    def num_tokens(self) -> int:
        return len(self.keys) * self.block_size


class Fetch:
    """Blocks ``first_block ..`` of one request, landing in host memory in order.

    The producer (the manager, on a transfer thread) calls :meth:`land` with
    each batch it pinned and :meth:`finish` at the end; the consumer (the
    engine) calls :meth:`take` once. Both sides may run at the same time.
    """

    def __init__(
        self,
        namespace: str,
        block_size: int,
        first_block: int,
        wanted: int,
        deadline: float | None,
        release: Callable[[LoadHandle], None],
    ) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.first_block = first_block
        self.wanted = wanted
        self.deadline = deadline  # time.monotonic() after which take() stops waiting; None: wait for all
        self.started = time.monotonic()
        self._release = release
        self._keys: list[BlockKey] = []
        self._blocks: list[torch.Tensor] = []
        self._kinds: list[TierKind] = []
        self._cond = threading.Condition()
        self._done = False
        self._taken = False
        self.missed_deadline = False

    # -- producer ----------------------------------------------------------------
    def land(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor], kinds: Sequence[TierKind]) -> bool:
        """Publish the next pinned blocks; False once taken (the caller must then unpin them itself)."""
        with self._cond:
            if self._taken:
                return False
            self._keys.extend(keys)
            self._blocks.extend(blocks)
            self._kinds.extend(kinds)
            self._cond.notify_all()
            return True

    def finish(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        """True once nobody will use more blocks (taken). The deadline is the consumer's to judge: it may extend it."""
        with self._cond:
            return self._taken

    # -- consumer ----------------------------------------------------------------
    @property
    def landed(self) -> int:
        with self._cond:
            return len(self._keys)

    @property
    def done(self) -> bool:
        with self._cond:
            return self._done

    def take(self, extend: Callable[[int, float], float] | None = None) -> LoadHandle:
        """Wait until every block landed or the deadline passed; the landed prefix, pinned, as a handle.

        At the deadline, ``extend(landed, elapsed_s)`` may grant more time
        (seconds; 0 or less: stop now): the deadline was a prediction, and a
        fetch that is visibly about to finish can still beat recomputing what
        it has left. The engine passes the break-even test on the fetch's own
        progress rate.
        """
        with self._cond:
            if self._taken:
                raise RuntimeError("a fetch is taken once")
            while not self._done:
                left = None if self.deadline is None else self.deadline - time.monotonic()
                if left is not None and left <= 0:
                    more = 0.0 if extend is None else extend(len(self._keys), time.monotonic() - self.started)
                    if more <= 0:
                        self.missed_deadline = True
                        break
                    self.deadline = time.monotonic() + more
                    continue
                self._cond.wait(left)
            self._taken = True
            return LoadHandle(
                self.namespace,
                self.block_size,
                self._keys,
                self._blocks,
                self._kinds,
                self._release,
                first_block=self.first_block,
            )

    def cancel(self) -> None:
        """Give up on the fetch: unpin whatever landed (a late batch is unpinned by its producer)."""
        self.take().release()


__all__ = ["Fetch", "LoadHandle"]
