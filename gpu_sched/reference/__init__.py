"""The sequential reference of SPEC.md: radix cache, ordering, admission, one step."""

from .radix_cache import KVPool, RadixCache
from .scheduler import ReferenceScheduler

__all__ = ["KVPool", "RadixCache", "ReferenceScheduler"]
