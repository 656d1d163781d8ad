"""A request as the router reads it: the session it names is the one the server will count it under."""

from __future__ import annotations

import pytest

from kvtier.config import load_config
from kvtier.route.prompt import Endpoint, Prompts

CHAT = {"messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 2}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Prompts:
    return Prompts(load_config(environ={"KVTIER_DATA_DIR": str(tmp_path_factory.mktemp("route-data"))}))


@pytest.mark.parametrize(
    ("body", "header", "session"),
    [
        ({"prompt_cache_key": "repo-42", "user": "ann"}, None, "repo-42"),  # OpenAI's key, before user
        ({"user": "ann"}, None, "ann"),
        ({"prompt_cache_key": "repo-42"}, "agent-7", "agent-7"),  # the header wins, as in the server
        ({}, None, None),
    ],
)
def test_the_session_is_read_as_the_server_reads_it(
    prompts: Prompts, body: dict[str, str], header: str | None, session: str | None
) -> None:
    routed = prompts.read(Endpoint.CHAT, {**CHAT, **body}, None, header)
    assert routed.session == session and len(routed.keys) == routed.tokens // 16 > 0
