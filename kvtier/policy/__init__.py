"""Eviction policies behind a registry; import this package to register them all."""

from kvtier.policy import lfu, lru, prefix, s3fifo  # noqa: F401  (registration side effect)
from kvtier.policy.base import EvictionPolicy, PolicyName, make_policy, register, registered

__all__ = ["EvictionPolicy", "PolicyName", "make_policy", "register", "registered"]
