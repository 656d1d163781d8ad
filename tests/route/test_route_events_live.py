"""``kvtier route`` following a real ``kvtier serve``'s KV events in vLLM's format over ZMQ, across a restart.

The backend publishes (``kv_events``), the router follows (``route.kv_events``). When the backend is stopped
(SIGTERM: its host tier is flushed to disk) and started again on the same ports, the router empties its index of
it when the connection drops, asks the new incarnation for a snapshot when it comes back, and then holds exactly
what the restarted backend holds: its disk tier, nothing of the memory it lost. The next turn of a conversation
goes back there and reads its prefix from disk.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.bench import fleet as processes
from tests.route.live import Fleet
from tests.route.test_route_live import BACKEND, chat, conversation
from tests.server.live import ADMIN, ADMIN_AUTH, SIZES

pytestmark = pytest.mark.slow  # two processes, one loading the model twice


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, processes.Backends]]:
    tmp = tmp_path_factory.mktemp("route-events")
    route = {"policy": "kvtier", "health_interval_s": 0.5}
    with (
        processes.backends(tmp, 1, SIZES, ADMIN, events=True) as backends,
        processes.router(tmp / "router", backends, SIZES["engine"], route) as router,
    ):
        yield Fleet(router, backends.procs), backends


def backend_stats(fleet: Fleet) -> dict:
    (only,) = fleet.stats()["backends"]
    return only


def test_the_router_holds_a_restarted_backends_new_state_from_its_snapshot(
    one: tuple[Fleet, processes.Backends],
) -> None:
    fleet, backends = one
    messages = conversation(7)
    answer = chat(fleet.router, messages)
    messages += [
        {"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And one more?"},
    ]
    backends.procs[0].post("/admin/settle", headers=ADMIN_AUTH).raise_for_status()
    before = fleet.agree(backends.procs[0])
    assert before.get("host", 0) > 0 and backend_stats(fleet)["event_resyncs"] >= 1

    published = backends.procs[0].get("/stats", headers=ADMIN_AUTH).json()["kv_events"]
    restarted = backends.restart(0)
    after = fleet.agree(restarted)  # the index equals what the new incarnation holds
    assert after.get("disk", 0) >= before["host"] and "host" not in after and "device" not in after
    republished = restarted.get("/stats", headers=ADMIN_AUTH).json()["kv_events"]
    assert republished["incarnation"] != published["incarnation"] and republished["snapshots"] >= 1
    assert republished["endpoint"] == published["endpoint"]
    seen = backend_stats(fleet)
    assert seen["events_live"] and seen["event_resyncs"] >= 2 and seen["event_resync_s"] > 0

    processes.wait_until(fleet.router, processes.all_live(1))  # its health checks have it back in too
    again = chat(fleet.router, messages)
    assert again.headers[BACKEND] == restarted.url
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # read back from disk
