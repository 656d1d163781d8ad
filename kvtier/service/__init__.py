"""The node-local cache service (:mod:`.server`), its wire protocol (:mod:`.protocol`) and client (:mod:`.client`)."""

from kvtier.service.client import CacheClient, ClientLoad, ServiceUnavailable
from kvtier.service.server import CacheService

__all__ = ["CacheClient", "CacheService", "ClientLoad", "ServiceUnavailable"]
