"""Bound sockets for an HTTP app, the way uvicorn binds them: ``kvtier serve`` and ``kvtier route`` alike.

Binding before the app starts turns a taken port or an unknown host into
one line at start (:class:`~kvtier.errors.BindError`), not a traceback from
inside the event loop.
"""

from __future__ import annotations

import socket

from kvtier.errors import BindError


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Bound (not yet listening) sockets for every address ``host`` resolves to, as uvicorn would bind."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise BindError(f"cannot listen on {host}:{port}: {err}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            socks.append(sock := socket.socket(family, kind, proto))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # one family per socket, as asyncio binds them
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError as err:
        for sock in socks:
            sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return socks
