"""Both caches keep the one interface the engine and the server hold (:class:`kvtier.cache.Cache`).

The engine and the server never ask which cache they have, so every name
the protocol declares must exist in both implementations with the same
parameters (name, kind, default): a drift (one ``pin_for`` returning keys,
the other indices) fails here, not in the one deployment that runs the
other implementation.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from kvtier.cache import Cache, Fetching, Loaded, NamedBlocks, NodeService, ServiceConnection, connect_service
from kvtier.fetch import Fetch, LoadHandle
from kvtier.layout import KVLayout
from kvtier.manager import CacheManager
from kvtier.service.cache import ServiceCache, ServiceFetch
from kvtier.service.client import CacheClient, ClientLoad
from kvtier.service.link import ServiceLink

PAIRS = [(Cache, CacheManager), (Cache, ServiceCache), (Fetching, Fetch), (Fetching, ServiceFetch)]
PAIRS += [(Loaded, LoadHandle), (Loaded, ClientLoad)]
# the connectors' face: the service by tokens or names, over the link the service cache runs on
PAIRS += [(NamedBlocks, CacheClient), (NamedBlocks, CacheManager), (NodeService, CacheClient)]
PAIRS += [(ServiceConnection, ServiceLink)]


def members(protocol: type) -> dict[str, object]:
    own = {n: v for n, v in vars(protocol).items() if not n.startswith("_") or n in ("__enter__", "__exit__")}
    return {n: v for n, v in own.items() if callable(v) or isinstance(v, property)}


def fields(protocol: type) -> set[str]:
    return {n for n in protocol.__annotations__ if not n.startswith("_")}


@pytest.mark.parametrize(("protocol", "impl"), PAIRS, ids=lambda t: t.__name__)
def test_every_method_of_the_seam_exists_with_the_same_parameters(protocol: type, impl: type) -> None:
    source = inspect.getsource(impl)
    for name, declared in members(protocol).items():
        if isinstance(declared, property):  # a property, or an attribute the constructor sets
            static = getattr(impl, name, None)
            assert isinstance(static, property) or f"self.{name}: " in source or f"self.{name} =" in source, name
            continue
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        want = list(inspect.signature(declared).parameters.values())[1:]
        got = inspect.signature(getattr(impl, name)).parameters
        for p in want:
            assert p.name in got, f"{impl.__name__}.{name} lacks parameter {p.name}"
            assert (got[p.name].kind, got[p.name].default) == (p.kind, p.default), f"{impl.__name__}.{name}({p.name})"


@pytest.mark.parametrize(("protocol", "impl"), PAIRS, ids=lambda t: t.__name__)
def test_every_field_of_the_seam_is_set_by_the_implementation(protocol: type, impl: type) -> None:
    """A field is an annotation of the dataclass, or assigned in ``__init__``."""
    source = inspect.getsource(impl)
    for name in fields(protocol):
        declared = name in getattr(impl, "__annotations__", {})
        assert declared or f"self.{name} =" in source or f"self.{name}: " in source, f"{impl.__name__}.{name}"


def test_the_seam_names_the_drifts_it_was_made_to_end() -> None:
    """Same return for pin_for (a count), one name for prefetch, no service-only session call."""
    for impl in (CacheManager, ServiceCache):
        assert inspect.signature(impl.pin_for).return_annotation == "int"
        assert not hasattr(impl, "session_prefetch")
    assert inspect.signature(CacheManager.probe).parameters.keys() >= {"prompt"}


def test_the_connectors_link_is_the_one_the_service_cache_runs_on(tmp_path: Path) -> None:
    """One reconnecting link, shared: a fix to reconnection reaches ``kvtier serve`` and every connector alike."""
    failures: list[int] = []
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype=torch.float32)
    link = connect_service(tmp_path / "absent.sock", layout, "fp", count_failures=failures.append)
    assert isinstance(link, ServiceLink)
    assert inspect.signature(ServiceCache.__init__).parameters.keys() >= {"socket_path"}
    assert "ServiceLink(" in inspect.getsource(ServiceCache.__init__)
    assert link.client() is None and failures == [1]  # no service there: a counted miss, never an error
    link.close()
