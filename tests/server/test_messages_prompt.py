"""The Messages API's request as the chat template sees it: the prompt's order and where each cache mark falls."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvtier.web.messages import CacheTTL, MessagesRequest, rendered

MARK = {"type": "ephemeral"}


def request(**body: object) -> MessagesRequest:
    return MessagesRequest.model_validate({"max_tokens": 8, **body})


def test_tools_then_system_then_messages_with_blocks_in_tags() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "ls", "input": {"b": 1, "a": 2}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "a.py", "is_error": True}
    body = request(
        tools=[{"name": "ls", "description": "List.", "input_schema": {"type": "object"}}],
        system="Be brief.",
        messages=[
            {"role": "user", "content": "Files?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Looking. "}, call]},
            {"role": "user", "content": [result]},
        ],
    )  # fmt: skip
    conversation, marks = rendered(body)
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user"] and marks == []
    system = conversation[0]["content"]
    assert system.index('"name": "ls"') < system.index("Be brief.")  # the API's order: tools, then system
    assert conversation[2]["content"] == 'Looking. <tool_use id="t1" name="ls">{"a": 2, "b": 1}</tool_use>'
    assert conversation[3]["content"] == '<tool_result tool_use_id="t1" is_error="true">a.py</tool_result>'


def test_each_mark_cuts_the_conversation_just_after_its_block() -> None:
    body = request(
        tools=[{"name": "ls", "input_schema": {}, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        system=[{"type": "text", "text": "Rules.", "cache_control": MARK}, {"type": "text", "text": " More."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Q1", "cache_control": MARK},
                                               {"type": "text", "text": " Q2"}]}],
    )  # fmt: skip
    conversation, marks = rendered(body)
    assert [m.ttl for m in marks] == [CacheTTL.ONE_HOUR, CacheTTL.FIVE_MINUTES, CacheTTL.FIVE_MINUTES]
    assert marks[0].upto[0]["content"].endswith('"name": "ls"}\n') and "Rules." not in marks[0].upto[0]["content"]
    assert marks[1].upto == [{"role": "system", "content": conversation[0]["content"].removesuffix(" More.")}]
    assert marks[2].upto == [conversation[0], {"role": "user", "content": "Q1"}]
    assert conversation[1]["content"] == "Q1 Q2"
    assert CacheTTL.ONE_HOUR.seconds == 3600 and CacheTTL.FIVE_MINUTES.seconds == 300


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}],
        [{"type": "text", "text": "x", "cache_control": {"type": "persistent"}}],
        [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "24h"}}],
    ],
    ids=["image", "mark type", "ttl"],
)
def test_what_cannot_be_rendered_or_promised_is_refused(content: list[dict[str, object]]) -> None:
    with pytest.raises(ValidationError):
        request(messages=[{"role": "user", "content": content}])
