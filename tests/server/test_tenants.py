"""Tenancy on a real server: the cache namespace comes from the API key, and two tenants never share a hit."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.server.live import LiveServer, running

ALPHA, BETA = "sk-alpha-0123456789", "sk-beta-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with running(tmp_path_factory.mktemp("tenants"), api_keys={ALPHA: "alpha", BETA: "beta"}) as live:
        yield live


def ask(client: openai.OpenAI, messages: list[dict[str, str]], **kw):
    done = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1", messages=messages, max_tokens=4, temperature=0, **kw
    )
    return done.usage.prompt_tokens_details.cached_tokens, done.choices[0].message.content


def test_inference_needs_a_valid_key(server: LiveServer) -> None:
    body = {"prompt": "hi", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer sk-wrong-0123456789"}, {"Authorization": f"Bearer {ALPHA}x"}):
        response = server.post("/v1/completions", json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-wrong-0123456789").models.list()
    assert server.client(ALPHA).models.list().data
    assert server.get("/health").status_code == 200  # health stays open


def test_two_tenants_never_share_cache_hits(server: LiveServer) -> None:
    alpha, beta = server.client(ALPHA), server.client(BETA)
    messages = [{"role": "system", "content": "Tn4 tenancy test."}, {"role": "user", "content": "Say a word."}]
    a1, a2 = ask(alpha, messages), ask(alpha, messages)
    assert a1[0] == 0 and a2[0] > 0
    # A client naming the other tenant's namespace (in any field) changes nothing: only the key decides.
    spoof = {"namespace": "tenant/alpha", "cache_salt": "alpha", "user": "alpha", "tenant": "alpha"}
    b1 = ask(beta, messages, extra_body=spoof)
    assert b1[0] == 0, "beta was served alpha's cached blocks"
    assert b1[1] == a1[1]
    b2 = ask(beta, messages)
    assert b2[0] == a2[0]


def test_admin_lookup_names_the_tenant(server: LiveServer) -> None:
    messages = [{"role": "system", "content": "Tn5 alpha only."}, {"role": "user", "content": "Hello."}]
    ask(server.client(ALPHA), messages)
    for _ in range(200):  # stores land asynchronously
        alpha = server.admin_post("/lookup", {"messages": messages, "tenant": "alpha"}).json()
        if alpha["cached_tokens"]:
            break
    assert alpha["tenant"] == "alpha" and alpha["cached_tokens"] > 0
    assert server.admin_post("/lookup", {"messages": messages, "tenant": "beta"}).json()["cached_tokens"] == 0
    unknown = server.admin_post("/lookup", {"messages": messages, "tenant": "gamma"})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_tenant"
    assert server.admin_post("/lookup", {"messages": messages}).status_code == 400  # keys on: no default tenant


def test_a_tenants_clear_drops_its_blocks_in_every_tier_and_no_one_elses(server: LiveServer) -> None:
    """Both tenants cache one conversation; alpha's clear leaves alpha nothing (pool, host, disk) and beta all."""
    alpha, beta = server.client(ALPHA), server.client(BETA)
    messages = [{"role": "system", "content": "Tn6 clear one tenant. " * 4}, {"role": "user", "content": "Go on."}]
    first = ask(alpha, messages)
    ask(beta, messages)
    assert server.admin_post("/admin/settle").status_code == 200

    def cached(tenant: str) -> int:
        return server.admin_post("/lookup", {"messages": messages, "tenant": tenant}).json()["cached_tokens"]

    held = cached("beta")
    assert cached("alpha") == held > 0
    unknown = server.admin_post("/admin/clear", {"tenant": "gamma"})
    assert unknown.status_code == 400 and unknown.json()["error"]["code"] == "unknown_tenant"
    dropped = server.admin_post("/admin/clear", {"tenant": "alpha"}).json()["dropped_blocks"]
    assert dropped["device"] > 0 and dropped["host"] > 0
    assert cached("alpha") == 0 and cached("beta") == held
    again = ask(alpha, messages)
    assert again == (0, first[1])  # recomputed, the same answer
    assert ask(beta, messages)[0] >= held
