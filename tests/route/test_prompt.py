"""A request as the router reads it: the session it names is the one the server will count it under, and its
keys are the ones the server computes (same rendering, same tenant)."""

from __future__ import annotations

import copy

import pytest

from kvtier.config import load_config
from kvtier.model.chat import chat_ids
from kvtier.route.prompt import Endpoint, Prompts, caller_key
from kvtier.web.auth import Tenants
from kvtier.web.messages import MessagesRequest, rendered

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


# -- the Messages API ----------------------------------------------------------------------------------------------
SYSTEM = "You are a terse assistant who answers in one short sentence. " * 3
MESSAGES = {"max_tokens": 2, "system": SYSTEM, "messages": [{"role": "user", "content": "Hello there."}]}
KEY = "sk-alpha-0123456789"


@pytest.mark.parametrize(
    ("body", "header", "session"),
    [
        ({"metadata": {"user_id": "agent-7"}}, None, "agent-7"),
        ({"metadata": {"user_id": "agent-7"}}, "repo-42", "repo-42"),  # the header wins, as in the server
        ({"user": "ann", "prompt_cache_key": "repo-42"}, None, None),  # OpenAI's fields name nothing here
        ({"metadata": "agent-7"}, None, None),  # refused by the server: no session to stick to
        ({}, None, None),
    ],
)
def test_a_messages_session_is_its_metadata_user_id(
    prompts: Prompts, body: dict[str, object], header: str | None, session: str | None
) -> None:
    assert prompts.read(Endpoint.MESSAGES, {**MESSAGES, **body}, None, header).session == session


def test_a_messages_prompt_is_keyed_as_the_server_renders_it(prompts: Prompts) -> None:
    """Tools, then system, then messages, through :func:`kvtier.web.messages.rendered` and the chat template:
    the ids ``kvtier serve`` prefills, so the keys are the ones its events publish."""
    call = {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "."}}
    body = {
        **MESSAGES,
        "tools": [{"name": "ls", "description": "List files.", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Which files?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Looking. "}, call]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.py"}]},
        ],
        "stream": True,
    }
    conversation, _ = rendered(MessagesRequest.model_validate(body))
    ids = chat_ids(prompts.tokenizer, prompts.chat, conversation)
    routed = prompts.read(Endpoint.MESSAGES, body, None, None)
    assert routed.tokens == len(ids) and routed.stream
    assert routed.keys == prompts.hasher.keys(ids, prompts.namespace) and len(routed.keys) == len(ids) // 16


def test_a_system_and_a_user_message_key_as_the_same_chat(prompts: Prompts) -> None:
    chat = {"messages": [{"role": "system", "content": SYSTEM}, *MESSAGES["messages"]], "max_tokens": 2}
    assert prompts.read(Endpoint.MESSAGES, MESSAGES, None, None) == prompts.read(Endpoint.CHAT, chat, None, None)


MARK = {"cache_control": {"type": "ephemeral"}}
REFUSED = {
    "an image block": {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    "five cache marks": {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", **MARK}] * 5}]},
    "no max_tokens": {"max_tokens": None},
    "not an object": None,
}


@pytest.mark.parametrize("change", REFUSED.values(), ids=REFUSED.keys())
def test_a_messages_body_the_server_refuses_gets_no_keys(prompts: Prompts, change: dict[str, object] | None) -> None:
    body = None if change is None else {k: v for k, v in {**MESSAGES, **change}.items() if v is not None}
    assert prompts.read(Endpoint.MESSAGES, body, None, None).keys == []


def test_the_messages_key_is_x_api_key_first_then_bearer_as_the_server_reads_it() -> None:
    both = {"x-api-key": KEY, "authorization": "Bearer sk-other"}
    assert caller_key(Endpoint.MESSAGES, both) == KEY
    assert caller_key(Endpoint.MESSAGES, {"authorization": f"Bearer {KEY}"}) == KEY
    assert caller_key(Endpoint.MESSAGES, {"x-api-key": "", "authorization": f"bearer {KEY}"}) == KEY
    assert caller_key(Endpoint.MESSAGES, {"authorization": f"Basic {KEY}"}) is None
    assert caller_key(Endpoint.CHAT, both) == "sk-other"  # the OpenAI routes take no x-api-key, in the server either


def test_the_callers_key_names_the_tenant_whose_namespace_salts_the_keys(prompts: Prompts) -> None:
    keyed = copy.copy(prompts)
    keyed.tenants = Tenants({KEY: "alpha"}, "default")
    ids = chat_ids(prompts.tokenizer, prompts.chat, [{"role": "system", "content": SYSTEM}, CHAT["messages"][0]])
    routed = keyed.read(Endpoint.MESSAGES, MESSAGES, KEY, None)
    assert routed.keys == prompts.hasher.keys(ids, "tenant/alpha") != prompts.hasher.keys(ids, prompts.namespace)
    stranger = keyed.read(Endpoint.MESSAGES, MESSAGES, "sk-nobody", None)
    assert (stranger.tokens, stranger.keys) == (len(ids), [])  # the backend refuses it: routed by load alone
