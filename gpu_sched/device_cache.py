"""The FlatRadixTree behind the reference cache's interface (node handles are int ids).

The scheduler's host-side bookkeeping (KV slots of running requests, the pool) talks to the
cache through this small interface, so the reference scheduler's decode/finish code runs
unchanged on the device tree.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from .radix import ROOT, FlatRadixTree
from .reference.radix_cache import KVPool


class DeviceRadixCache:
    """RadixCache interface over a `FlatRadixTree` (SPEC section 2).

    Args:
        pool: KV pool the evicted slots go back to.
        page_size, disable: as RadixCache (R-RC-3, R-RC-8).
        device: torch device of the tree.
        max_nodes, token_capacity: tree capacities; default sized from the pool (every cached
            token holds a KV slot, so the pool size bounds both).
        backend: "torch" or "triton" (the tree's kernels, `FlatRadixTree`'s backend).
        hash_seed: draws the tree's prefix-hash bases (`FlatRadixTree`'s seed; default 0).
            Matching trusts the hashes, so bases an outsider can know let prompts be crafted
            to collide: `GpuScheduler` passes a secret one.
    """

    def __init__(self, pool: KVPool, page_size: int = 1, disable: bool = False, device="cpu",
                 max_nodes: Optional[int] = None, token_capacity: Optional[int] = None, backend: str = "torch",
                 hash_seed: int = 0):
        self.pool = pool
        self.page_size = page_size
        self.disable = disable
        self.device = torch.device(device)
        cap = max(pool.size, 1)
        kwargs = {}
        if backend != "torch":
            kwargs["backend"] = backend
        self.tree = FlatRadixTree(page_size, max_nodes=max_nodes or cap // page_size + 2,
                                  token_capacity=token_capacity or 2 * cap, device=self.device, seed=hash_seed,
                                  **kwargs)
        self.root = ROOT
        self._ns: Dict[Optional[str], int] = {None: 0}

    def ns_id(self, ns: Optional[str]) -> int:
        if ns not in self._ns:
            self._ns[ns] = len(self._ns)
        return self._ns[ns]

    @property
    def evictable_size(self) -> int:
        return 0 if self.disable else self.tree.host_int("evictable_size")

    @property
    def protected_size(self) -> int:
        return 0 if self.disable else self.tree.host_int("protected_size")

    def sizes(self) -> Tuple[int, int]:
        """(evictable_size, protected_size) [tokens] in one read: off the CPU one
        device-to-host copy of both (each property alone is a device sync)."""
        if self.disable:
            return 0, 0
        return tuple(self.tree.host_ints("evictable_size", "protected_size"))

    def _tokens(self, key) -> torch.Tensor:
        return torch.as_tensor(np.array(key, dtype=np.int32), device=self.device)

    def _slots(self, value, n: int) -> torch.Tensor:
        """The first n KV slots of `value` as an int64 tensor on the tree's device."""
        return torch.as_tensor(np.asarray(value[:n], dtype=np.int64), device=self.device)

    def match_prefix(self, key, ns=None):
        """R-RC-4 for one key: (matched length, node id)."""
        if self.disable:
            return 0, ROOT
        t = self._tokens(key)
        m, last = self.tree.match(t[None], torch.tensor([t.numel()], device=self.device),
                                  torch.tensor([self.ns_id(ns)], device=self.device))
        return int(m[0]), int(last[0])

    def present_len(self, key, ns=None) -> int:
        """Length of `key` already cached (no stamps, no splits, no new namespace id: a
        namespace never seen holds nothing)."""
        if self.disable or ns not in self._ns:
            return 0
        if self.tree._host_form():
            # a CPU tree: a walk down the tree on the key's tokens (a lookup and a token
            # comparison per node on the matched path), not a hash of the whole key and a search
            t = np.asarray(key, dtype=np.int32)
            return self.tree._walk_scalar(t, t.size, self._ns[ns])[0]
        t = self._tokens(key)
        m, _ = self.tree._find(t[None], torch.tensor([t.numel()], device=self.device),
                               torch.tensor([self._ns[ns]], device=self.device))
        return int(m[0])

    def insert(self, key, value, ns=None, known: int = 0, known_node=None) -> int:
        """R-RC-5; `value` is an int64 slot array or a callable `alloc(n)` for the new tail.
        `known`, `known_node`: the first `known` tokens are cached as the path to
        `known_node` (`FlatRadixTree.insert`'s hint). Only floorP(len(key)) tokens are
        inserted (R-RC-3). Returns the length already present [tokens] (the caller frees
        that duplicate KV; 0 with the cache disabled)."""
        if self.disable:
            return 0
        n = len(key) // self.page_size * self.page_size
        if callable(value):
            m = self.present_len(key[:n], ns)
            value = np.concatenate([np.zeros(m, np.int64), np.asarray(value(n - m), np.int64)])
        return self.tree.insert(self._tokens(key[:n]), self._slots(value, n), self.ns_id(ns),
                                known=known, known_node=known_node)

    def insert_and_match(self, key, value, ns=None, known: int = 0, known_node=None) -> Tuple[int, int, int]:
        """`insert(key, value, ns)` then `match_prefix(key, ns)` in one tree call
        (`FlatRadixTree.insert_and_match`, which takes the `known` cached prefix ending at
        `known_node` as its hint), `value` an int64 slot array (not a callable):
        (present length, matched length, node id)."""
        if self.disable:
            return 0, 0, ROOT
        n = len(key) // self.page_size * self.page_size
        return self.tree.insert_and_match(self._tokens(key), self._slots(value, n), self.ns_id(ns),
                                          known=known, known_node=known_node)

    def inc_lock_ref(self, node) -> None:
        if not self.disable and node is not None and node != ROOT:
            self.tree.lock([node])  # a list: the host walk on a CPU tree, no tensor

    def dec_lock_ref(self, node) -> None:
        if not self.disable and node is not None and node != ROOT:
            self.tree.unlock([node])

    def evict(self, num_tokens: int) -> List[int]:
        """R-RC-7; frees the evicted slots into the pool; returns evicted node ids in order."""
        if self.disable or num_tokens <= 0:
            return []
        res = self.tree.evict(num_tokens)
        self.pool.free(res.values.cpu().numpy())
        return res.nodes.tolist()

    def evict_tokens(self, num_tokens: int) -> int:
        if self.disable or num_tokens <= 0:
            return 0
        res = self.tree.evict(num_tokens)
        self.pool.free(res.values.cpu().numpy())
        return res.num_tokens

    def path_values(self, node) -> np.ndarray:
        """KV slots of the path root..node (host array)."""
        t = self.tree
        parts = []
        if t._on_cpu:  # the node columns' memoryviews and the pool's numpy view: no tensor op per node
            key_off, key_len, parent, val = t._mv("key_off"), t._mv("key_len"), t._mv("parent"), t._np("val")
            node = -1 if node is None else int(node)
            while node > ROOT:
                off = key_off[node]
                parts.append(val[off : off + key_len[node]])
                node = parent[node]
        else:
            while node is not None and node > ROOT:
                off, ln = int(t.key_off[node]), int(t.key_len[node])
                parts.append(t.val[off : off + ln].cpu().numpy())
                node = int(t.parent[node])
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int64)

    def cached_slots(self) -> np.ndarray:
        t = self.tree
        if t._on_cpu:  # numpy on the tree's views: the slots of every live node's key, in node order
            ids = np.flatnonzero(t._np("alive")[: t.node_bound()])
            ids = ids[ids != ROOT]
            off, ln = t._np("key_off")[ids], t._np("key_len")[ids]
            pos = np.repeat(off - (np.cumsum(ln) - ln), ln) + np.arange(int(ln.sum()))
            return t._np("val")[pos]
        ids = torch.nonzero(t.alive[: t.node_bound()]).flatten()
        ids = ids[ids != ROOT]
        if ids.numel() == 0:
            return np.zeros(0, np.int64)
        lens = t.key_len[ids]
        rng = torch.repeat_interleave(t.key_off[ids], lens) + (
            torch.arange(int(lens.sum()), device=self.device) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens))
        return t.val[rng].cpu().numpy()

    def check_integrity(self, lock_holders=None) -> None:
        """Tree invariants plus lock_ref == number of holders whose path crosses each node."""
        if self.disable:
            return
        self.tree.check_integrity()
        if lock_holders is not None:
            nodes = torch.tensor([h for h in lock_holders if h is not None], dtype=torch.int64, device=self.device)
            b = self.tree.node_bound()  # every live node id is below it
            u, c = self.tree._path_nodes(nodes)
            want = torch.zeros(b, dtype=torch.int64, device=self.device)
            want[u] = c
            alive = self.tree.alive[:b].clone()
            alive[ROOT] = False
            if not torch.equal(want[alive], self.tree.lock_ref[:b][alive]):
                raise AssertionError("lock_ref differs from the number of lock holders below each node")
