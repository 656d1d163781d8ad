"""The server's guards, without a model: tenants, the tokens, the body limit, the bind, the connection cap."""

from __future__ import annotations

import asyncio
import http.client
import resource
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import uvicorn
from pydantic import SecretStr

from kvtier.config import ConfigError, load_config
from kvtier.server.limits import BodyLimit
from kvtier.server.main import FD_HEADROOM, check_bind, is_loopback, uvicorn_config
from kvtier.web.auth import AdminToken, Readers, Tenants
from kvtier.web.listen import listen_sockets

ROOT = Path(__file__).resolve().parents[2]


def test_tenants_come_from_the_key_alone() -> None:
    keyed = Tenants({"sk-alpha-0123456789": "alpha", "sk-beta-0123456789": "beta"}, "default")
    assert not keyed.open
    assert keyed.from_key("sk-alpha-0123456789").namespace == "tenant/alpha"
    assert keyed.from_key("sk-beta-0123456789").name == "beta"
    assert keyed.from_key(None) is None and keyed.from_key("sk-alpha-012345678") is None
    assert keyed.by_name(None) is None and keyed.by_name("alpha").namespace == "tenant/alpha"
    open_ = Tenants({}, "default")
    assert open_.open and open_.from_key(None) == open_.from_key("anything") == open_.by_name(None)
    assert open_.from_key(None).namespace == "default"


def test_admin_token() -> None:
    token = AdminToken(SecretStr("admin-token-0123456789"))
    assert token.allows("admin-token-0123456789")
    assert not token.allows("admin-token-012345678") and not token.allows(None) and not token.allows("")
    assert not AdminToken(None).allows("") and not AdminToken(None).allows("anything")


def test_readers_take_either_token_and_are_open_with_neither() -> None:
    admin, read = SecretStr("admin-token-0123456789"), SecretStr("read-token-0123456789")
    both = Readers(admin, read)
    assert not both.open and both.allows("admin-token-0123456789") and both.allows(None, "read-token-0123456789")
    assert not both.allows(None, None) and not both.allows("read-token-012345678", "") and not both.allows()
    read_only = Readers(None, read)  # no admin token: the figures still need the read token
    assert not read_only.open and read_only.allows("read-token-0123456789")
    assert not read_only.allows("admin-token-0123456789")
    assert Readers(None, None).open  # loopback only (check_bind): local scripts read /stats as they are


def test_config_refuses_weak_secrets_and_bad_tenant_names() -> None:
    with pytest.raises(ConfigError, match=r"server\.admin_token.*16 characters"):
        load_config(environ={"KVTIER_SERVER__ADMIN_TOKEN": "short"})
    assert "short" not in repr(load_config(environ={"KVTIER_SERVER__ADMIN_TOKEN": "x" * 16}).server)
    with pytest.raises(ConfigError, match=r"server\.read_token.*16 characters"):
        load_config(environ={"KVTIER_SERVER__READ_TOKEN": "short"})
    assert "y" * 16 not in repr(load_config(environ={"KVTIER_SERVER__READ_TOKEN": "y" * 16}).server)
    for keys, problem in (({"short": "a"}, "8 characters"), ({"sk-0123456789": "bad name!"}, "must match")):
        cfg = load_config(environ={})
        tree = cfg.model_dump()
        tree["server"]["api_keys"] = keys
        with pytest.raises(ValueError, match=problem):
            type(cfg).model_validate(tree)


async def _send_chunked(limit: int, chunks: list[bytes]) -> tuple[list[dict], list[bytes]]:
    """Drive BodyLimit with a chunked body (no Content-Length); returns what the client got and the app read."""
    app_read: list[bytes] = []

    async def app(scope, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            app_read.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"transfer-encoding", b"chunked")]}
    await BodyLimit(app, max_bytes=limit)(scope, receive, send)
    return sent, app_read


def test_a_chunked_body_over_the_limit_gets_413_and_the_app_stops_reading() -> None:
    sent, read = asyncio.run(_send_chunked(10, [b"12345", b"67890", b"x", b"never read"]))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [413]
    assert read == [b"12345", b"67890"]
    sent, read = asyncio.run(_send_chunked(10, [b"12345", b"67890"]))
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                                 ("127.0.0.2", True), ("0.0.0.0", False), ("::", False),
                                                 ("10.1.2.3", False), ("example.com", False)])  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_non_loopback_bind_needs_an_admin_token(tmp_path: Path) -> None:
    env = {"KVTIER_DATA_DIR": str(tmp_path), "KVTIER_SERVER__HOST": "0.0.0.0"}
    with pytest.raises(ConfigError, match="non-loopback"):
        check_bind(load_config(environ=env))
    check_bind(load_config(environ={**env, "KVTIER_SERVER__ADMIN_TOKEN": "admin-token-0123456789"}))
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli", "serve", "--host", "0.0.0.0", "--port", "1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "KVTIER_DATA_DIR": str(tmp_path)},
        timeout=120,
    )
    assert out.returncode == 2 and "refusing to serve on the non-loopback address 0.0.0.0" in out.stderr


# -- listening: the connection cap, the bind before the model loads, the open-files limit -------------------
async def _ok_app(scope: dict, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _uvicorn_serving(tmp_path: Path, **server: str) -> Iterator[tuple[str, int]]:
    """:func:`uvicorn_config` of a config with ``server`` settings, serving a two-byte app on a thread."""
    env = {"KVTIER_DATA_DIR": str(tmp_path), **{f"KVTIER_SERVER__{k.upper()}": v for k, v in server.items()}}
    (sock,) = listen_sockets("127.0.0.1", 0)
    sock.listen()  # connections queue from here on, so none races the server's start
    uv = uvicorn.Server(uvicorn_config(load_config(environ=env), _ok_app))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]})
    thread.start()
    try:
        yield sock.getsockname()[:2]
    finally:
        uv.should_exit = True
        thread.join(timeout=60)
        sock.close()
    assert not thread.is_alive()


def _status(sock: socket.socket) -> int:
    """Send a whole GET and read the whole answer; the connection stays open."""
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    response = http.client.HTTPResponse(sock)
    response.begin()
    response.read()
    return response.status


def test_max_connections_are_served_and_one_more_gets_503(tmp_path: Path) -> None:
    """Three half-sent requests and a whole one make four open connections, all allowed; a fifth is refused."""
    with _uvicorn_serving(tmp_path, max_connections="4", read_timeout_s="600") as address, ExitStack() as held:

        def connect() -> socket.socket:
            return held.enter_context(socket.create_connection(address, timeout=60))

        for _ in range(3):
            connect().sendall(b"GET / HTTP/1.1\r\n")
        fourth = connect()
        assert _status(fourth) == 200
        fourth.sendall(b"GET / HTTP/1.1\r\n")  # and it stays open, half-sent
        assert _status(connect()) == 503


def test_a_port_in_use_or_a_bad_address_fails_before_the_model_loads(tmp_path: Path) -> None:
    """The model path is not a GGUF: had the model loaded first, that would be the error."""
    not_a_model = tmp_path / "not-a-model.gguf"
    not_a_model.write_text("not a model")
    env = {"PATH": "/usr/bin:/bin", "KVTIER_DATA_DIR": str(tmp_path), "KVTIER_ENGINE__MODEL_PATH": str(not_a_model)}
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for host, error in (("127.0.0.1", f"cannot listen on 127.0.0.1:{port}"), ("[::1", "cannot listen on [::1")):
            out = subprocess.run(
                [sys.executable, "-m", "kvtier.cli", "serve", "--host", host, "--port", str(port)],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=env,
                timeout=120,
            )
            assert out.returncode == 2 and error in out.stderr, out.stderr


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this host")
def test_a_bracketed_ipv6_host_binds_that_address(tmp_path: Path) -> None:
    config = load_config(environ={"KVTIER_DATA_DIR": str(tmp_path), "KVTIER_SERVER__HOST": "[::1]"})
    (sock,) = listen_sockets(config.server.host, 0)
    with sock:
        assert sock.family == socket.AF_INET6 and sock.getsockname()[0] == "::1"


def test_the_open_files_limit_is_raised_to_fit_max_connections() -> None:
    """A soft limit of 256 would stall accept() long before 2,048 connections; it is raised as the hard one allows."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    code = "import resource; from kvtier.server.main import fit_open_files; fit_open_files(2048); "
    code += "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)),
    )
    want = 2048 + FD_HEADROOM
    assert int(out.stdout) == (want if hard == resource.RLIM_INFINITY else min(want, hard)), out.stderr
