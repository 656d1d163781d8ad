"""Who is calling: the tenant behind an API key, whether a caller holds the admin token, and who may read figures.

The cache namespace of a request (bound into the root of its block keys, so
two namespaces never share a block) is the tenant's, and the tenant comes
from the API key alone, never from a field the client sends: a client cannot
name another tenant's namespace and probe or reuse its cached prompts.

Secrets are compared with :func:`hmac.compare_digest`, and every configured
key is compared on every request (no early exit), so the time taken does
not tell which key, or which prefix of one, was close.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import SecretStr

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class Tenant:
    name: str
    namespace: str  # what the block keys are salted with


class Tenants:
    """API key -> tenant. With no keys configured there is one tenant and inference needs no key.

    Keyed tenants get the namespace ``tenant/<name>``, apart from the keyless
    default tenant's ``cache.namespace``: turning keys on later never hands a
    tenant the blocks cached while the server was open.
    """

    def __init__(self, api_keys: Mapping[str, str], default_namespace: str) -> None:
        self._keys = [(key.encode(), Tenant(name, f"tenant/{name}")) for key, name in api_keys.items()]
        self._by_name = {t.name: t for _, t in self._keys}
        self._default = None if self._keys else Tenant(DEFAULT_TENANT, default_namespace)
        if self._default is not None:
            self._by_name[DEFAULT_TENANT] = self._default

    @property
    def open(self) -> bool:
        """True when no API keys are configured (every caller is the default tenant)."""
        return self._default is not None

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def from_key(self, key: str | None) -> Tenant | None:
        """The tenant of a bearer token; None when keys are configured and this is none of them."""
        if self._default is not None:
            return self._default
        if key is None:
            return None
        given = key.encode()
        found = None
        for known, tenant in self._keys:
            if hmac.compare_digest(known, given):
                found = tenant
        return found

    def by_name(self, name: str | None) -> Tenant | None:
        """For admin routes, which act on a tenant's cache on purpose: None means the default tenant."""
        return self._default if name is None else self._by_name.get(name)


def _secret(token: SecretStr | None) -> bytes | None:
    value = None if token is None else token.get_secret_value()
    return value.encode() if value else None


class AdminToken:
    """The admin bearer token; without one configured, nobody is admin."""

    def __init__(self, token: SecretStr | None) -> None:
        self._token = _secret(token)

    @property
    def configured(self) -> bool:
        return self._token is not None

    def allows(self, key: str | None) -> bool:
        if self._token is None or key is None:
            return False
        return hmac.compare_digest(self._token, key.encode())


class Readers:
    """Who may read the figures, the dashboard and the schema: the admin token, or the read-only one.

    The read token is for a metrics scraper or a dashboard viewer that must
    not be able to clear, pin or probe the cache. With neither configured,
    reading is open: the server then listens on loopback only (see
    :func:`kvtier.server.main.check_bind`), and local scripts read ``/stats``
    as they always did.
    """

    def __init__(self, admin: SecretStr | None, read: SecretStr | None) -> None:
        self._tokens = [t for t in (_secret(admin), _secret(read)) if t is not None]

    @property
    def open(self) -> bool:
        return not self._tokens

    def allows(self, *keys: str | None) -> bool:
        """True when one of ``keys`` (a bearer header, a cookie) is a token; every pair is compared, no early exit."""
        found = False
        for key in (k.encode() for k in keys if k is not None):
            for known in self._tokens:
                found |= hmac.compare_digest(known, key)
        return found
