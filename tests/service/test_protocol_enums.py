"""The wire protocol owns its enumerated values: each one matches its core twin, and none is imported.

A tier kind, miss reason, explain reason or eviction policy added inside
kvtier must not reach the socket unnoticed: an older peer refuses a whole
message holding a value it does not know. So the protocol declares its own
copies (``kvtier/service/protocol.py``, "Enumerated values"), and this test
fails until a change to a core enum is matched there, by the rule stated
in that docstring.
"""

from __future__ import annotations

import enum

import msgspec
import pytest

from kvtier.explain import ExplainReason
from kvtier.index import MissReason
from kvtier.policy.base import PolicyName
from kvtier.service import protocol as p
from kvtier.tiers.base import TierKind

TWINS: list[tuple[type[enum.StrEnum], type[enum.StrEnum]]] = [
    (p.Tier, TierKind),
    (p.Miss, MissReason),
    (p.Why, ExplainReason),
    (p.Policy, PolicyName),
]


@pytest.mark.parametrize(("wire", "core"), TWINS, ids=lambda e: e.__name__)
def test_each_wire_enum_holds_exactly_its_core_twins_values(wire, core) -> None:
    assert [v.value for v in wire] == [v.value for v in core]
    assert all(p.to_wire(core, p.to_wire(wire, v)) is v for v in core)


def test_a_value_the_protocol_does_not_know_fails_the_message_it_is_in() -> None:
    """Why the rule bumps the version: the peer cannot take the rest of the message either."""
    frame = msgspec.msgpack.encode(
        {"type": "LookupReply", "cached_blocks": 2, "tiers": ["nvme"], "miss_reason": "none"}
    )
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(frame, type=p.Reply)
    good = msgspec.msgpack.encode(p.LookupReply(2, [p.Tier.HOST, p.Tier.DISK], p.Miss.NONE))
    assert msgspec.msgpack.decode(good, type=p.Reply) == p.LookupReply(2, [p.Tier.HOST, p.Tier.DISK], p.Miss.NONE)
