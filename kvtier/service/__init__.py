"""The node-local cache service (:mod:`.server`), its wire protocol (:mod:`.protocol`) and client (:mod:`.client`).

Loaded on first use: a connector that imports :mod:`.link` or :mod:`.client`
does not load the server, and with it every tier.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.service.client import CacheClient, ClientLoad, ServiceUnavailable
    from kvtier.service.server import CacheService

_HOME = {
    "CacheClient": "kvtier.service.client",
    "CacheService": "kvtier.service.server",
    "ClientLoad": "kvtier.service.client",
    "ServiceUnavailable": "kvtier.service.client",
}
__all__ = [
    "CacheClient",
    "CacheService",
    "ClientLoad",
    "ServiceUnavailable",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'kvtier.service' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)
