"""Where each prefix lives: block key -> the backends holding it and the fastest tier each holds it in.

Keys chain (a block's key hashes its parent's), so one key names a whole
prefix and the longest run of a prompt's leading keys that a backend holds
is how much of the prompt it can skip. Two views answer that question:

* :class:`BlockIndex`, exact, fed by each backend's block events;
* :class:`RoutedPrefixes`, a guess: the keys of the prompts the router sent
  to each backend, least recently routed forgotten first. It is a radix tree
  in effect (each key is a node whose parent is the previous key), and it is
  what the router falls back on for a backend whose event stream is lost,
  and, beyond the exact index, for blocks sent there whose events have not
  come yet; a removal event or a snapshot ends such a guess.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

from kvtier.keys import KEY_BYTES, BlockKey
from kvtier.tiers.base import TierKind

_ORDER = list(TierKind)  # fastest first
_BIT = {tier: 1 << i for i, tier in enumerate(_ORDER)}


def _fastest(mask: int) -> TierKind:
    return _ORDER[(mask & -mask).bit_length() - 1]


def _number(key: BlockKey) -> int | bytes:
    """A 16-byte key as its integer; any other length (a backend's stream is not trusted) stays as it came."""
    return int.from_bytes(key, "big") if len(key) == KEY_BYTES else key


def _key(number: int | bytes) -> BlockKey:
    return BlockKey(number.to_bytes(KEY_BYTES, "big") if isinstance(number, int) else number)


class BlockIndex:
    """backend -> key -> the set of tiers (a bit mask) that backend holds the key in.

    A key is held as the integer of its 16 bytes: 48 bytes of memory where
    a ``bytes`` of 16 takes 64, in an index that holds one entry per block
    per backend (``kvtier bench scale``: ``router_bytes_per_block``).
    """

    def __init__(self) -> None:
        self._held: dict[str, dict[int | bytes, int]] = {}

    def stored(self, backend: str, tier: TierKind, keys: Iterable[BlockKey]) -> None:
        held, bit = self._held.setdefault(backend, {}), _BIT[tier]
        for key in map(_number, keys):
            held[key] = held.get(key, 0) | bit

    def removed(self, backend: str, tier: TierKind, keys: Iterable[BlockKey]) -> list[BlockKey]:
        """Those of ``keys`` the backend now holds in no tier at all."""
        return [_key(n) for n in self._removed(backend, tier, map(_number, keys))]

    def _removed(self, backend: str, tier: TierKind, numbers: Iterable[int | bytes]) -> list[int | bytes]:
        held, keep = self._held.get(backend, {}), ~_BIT[tier]
        gone = []
        for key in numbers:
            mask = held.get(key, 0) & keep
            if mask:
                held[key] = mask
            else:
                held.pop(key, None)
                gone.append(key)
        return gone

    def cleared(self, backend: str, tier: TierKind) -> list[BlockKey]:
        return [_key(n) for n in self._removed(backend, tier, list(self._held.get(backend, {})))]

    def replace(self, backend: str, tiers: Mapping[TierKind, Iterable[BlockKey]]) -> None:
        """A snapshot: forget what was known of ``backend`` and take this instead."""
        self._held[backend] = {}
        for tier, keys in tiers.items():
            self.stored(backend, tier, keys)

    def drop(self, backend: str) -> None:
        self._held.pop(backend, None)

    def blocks(self, backend: str) -> int:
        return len(self._held.get(backend, {}))

    def counts(self, backend: str) -> dict[TierKind, int]:
        """Keys held per tier (a key in two tiers counts in both): what ``/stats`` shows of the index."""
        out = dict.fromkeys(_ORDER, 0)
        for mask in self._held.get(backend, {}).values():
            for tier in _ORDER:
                if mask & _BIT[tier]:
                    out[tier] += 1
        return {tier: n for tier, n in out.items() if n}

    def match(self, backend: str, keys: Sequence[BlockKey]) -> list[TierKind]:
        """The fastest tier of each of ``keys``' leading blocks that ``backend`` holds, up to the first it lacks."""
        held = self._held.get(backend, {})
        out: list[TierKind] = []
        for key in map(_number, keys):
            mask = held.get(key)
            if not mask:
                break
            out.append(_fastest(mask))
        return out


class RoutedPrefixes:
    """What the router sent where: per backend, the keys of routed prompts, least recently routed first.

    A guess, not a fact: the backend may have evicted them since. Capped at
    ``capacity`` keys per backend so it cannot grow with traffic.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: dict[str, OrderedDict[BlockKey, None]] = {}

    def routed(self, backend: str, keys: Sequence[BlockKey]) -> None:
        held = self._keys.setdefault(backend, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def drop(self, backend: str) -> None:
        self._keys.pop(backend, None)

    def forget(self, backend: str, keys: Iterable[BlockKey]) -> None:
        """The backend is known to hold ``keys`` no more (its events said so): no longer a guess."""
        held = self._keys.get(backend, {})
        for key in keys:
            held.pop(key, None)

    def match(self, backend: str, keys: Sequence[BlockKey]) -> int:
        held = self._keys.get(backend, {})
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n
