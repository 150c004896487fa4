"""Reference KV pool and radix prefix cache (SPEC.md section 2, R-RC-1..8).

Plain Python, one operation at a time: the oracle that the device tree (`gpu_sched.radix`)
is tested against. Keys are int32 numpy arrays (edge compares are vectorised); values are
the KV slot ids (int64 numpy arrays) that the `KVPool` handed out.
"""

from __future__ import annotations

import heapq
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..config import TOKEN_KNOB_MAX


class KVPool:
    """Token-granular KV slot allocator of `size` slots.

    `alloc(n)` returns n free slot ids (int64 [n]); `free(slots)` gives them back. Raises
    `MemoryError` (naming the request and availability) when fewer than n slots are free.
    """

    def __init__(self, size: int):
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise TypeError(f"kv_pool_size must be an int >= 0, got {type(size).__name__} {size!r}")
        if size < 0:
            raise ValueError(f"kv_pool_size must be an int >= 0, got {size!r}")
        if size > TOKEN_KNOB_MAX:  # the token knobs' bound (2^40 tokens), before numpy's own size errors
            raise ValueError(f"kv_pool_size must be <= 2^40 tokens, got {size!r}")
        self.size = int(size)
        # free slots form a stack; the top is at the end
        try:
            self._free = np.arange(self.size - 1, -1, -1, dtype=np.int64)
        except MemoryError:  # 8 bytes a slot on the host
            raise MemoryError(f"kv_pool_size {size} slots: no memory for its free list "
                              f"({8 * self.size / 2**30:.1f} GiB)") from None
        self._n_free = self.size

    @property
    def available(self) -> int:
        """Free slots [tokens]."""
        return self._n_free

    def alloc(self, n: int) -> np.ndarray:
        if n < 0:
            raise ValueError(f"alloc size must be >= 0, got {n}")
        if n > self._n_free:
            raise MemoryError(f"KV pool exhausted: asked for {n} slots, {self._n_free} available")
        self._n_free -= n
        return self._free[self._n_free : self._n_free + n][::-1].copy()

    def free(self, slots: np.ndarray) -> None:
        n = len(slots)
        if n == 0:
            return
        if self._n_free + n > self.size:
            raise RuntimeError(f"KV pool double free: {n} slots freed with {self._n_free}/{self.size} free")
        if self._n_free + n > len(self._free):  # pragma: no cover - buffer is sized to the pool
            raise RuntimeError("KV pool free list overflow")
        self._free[self._n_free : self._n_free + n] = slots
        self._n_free += n

    def free_slots(self) -> np.ndarray:
        return self._free[: self._n_free]


class TreeNode:
    """One radix-tree node (R-RC-1). `key` int32 [k], `value` int64 [k] (KV slots)."""

    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "node_id", "ns")

    def __init__(self, key, value, parent, stamp: int, node_id: int, ns=None):
        self.key = key
        self.value = value
        self.parent: Optional[TreeNode] = parent
        self.children: Dict[object, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = stamp
        self.node_id = node_id
        self.ns = ns  # namespace of the subtree (set on every node, read at the root level)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"TreeNode(id={self.node_id}, len={len(self.key)}, lock={self.lock_ref}, t={self.last_access})"


def lcp_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class RadixCache:
    """The reference radix prefix cache.

    Args:
        pool: the KV pool that cached values come from and go back to on eviction.
        page_size: P [tokens] (R-RC-3).
        disable: R-RC-8; match returns (0, root) and insert keeps nothing.

    Counters `evictable_size` and `protected_size` [tokens] follow R-RC-6. Stamps come from a
    logical clock, one tick per match or insert call (R-RC-4); node ids grow with creation (D4).
    """

    def __init__(self, pool: KVPool, page_size: int = 1, disable: bool = False):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.pool = pool
        self.page_size = int(page_size)
        self.disable = bool(disable)
        self.clock = 0
        self._next_id = 0
        self.root = self._new_node(np.zeros(0, np.int32), np.zeros(0, np.int64), None, 0)
        self.root.lock_ref = 1
        self.evictable_size = 0
        self.protected_size = 0

    # ---- helpers ---------------------------------------------------------------------------
    def _new_node(self, key, value, parent, stamp, ns=None) -> TreeNode:
        node = TreeNode(key, value, parent, stamp, self._next_id, ns)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def child_key(self, key: np.ndarray, ns, at_root: bool):
        """R-RC-2: first token (P == 1) or first page; the namespace joins at the root."""
        ck = int(key[0]) if self.page_size == 1 else key[: self.page_size].tobytes()
        return (ns, ck) if at_root else ck

    def _page_floor(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def _split(self, child: TreeNode, split_len: int, stamp: int) -> TreeNode:
        """R-RC-4 split: a new head node takes key[:split_len] and the child's place."""
        parent = child.parent
        head = self._new_node(child.key[:split_len], child.value[:split_len], parent, stamp, child.ns)
        head.lock_ref = child.lock_ref
        # the head takes the child's slot in the parent's child order (dicts keep insertion order)
        for k, v in parent.children.items():
            if v is child:
                parent.children[k] = head
                break
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = head
        head.children[self.child_key(child.key, child.ns, False)] = child
        return head

    # ---- R-RC-4 ----------------------------------------------------------------------------
    def match_prefix(self, key: np.ndarray, ns=None) -> Tuple[int, TreeNode]:
        """Longest cached prefix of `key` in namespace `ns` (R-RC-4).

        Returns (matched length [tokens, multiple of P], last node). Stamps the visited path and
        splits a partly matched node.
        """
        if self.disable:
            return 0, self.root
        key = key[: self._page_floor(len(key))]
        stamp = self._tick()
        node = self.root
        node.last_access = stamp
        matched = 0
        at_root = True
        while len(key) > 0:
            child = node.children.get(self.child_key(key, ns, at_root))
            if child is None:
                break
            child.last_access = stamp
            n = self._page_floor(lcp_len(child.key, key))
            matched += n
            if n < len(child.key):
                node = self._split(child, n, stamp)
                break
            node = child
            key = key[n:]
            at_root = False
        return matched, node

    def present_len(self, key: np.ndarray, ns=None) -> int:
        """`match_prefix(key, ns)`'s length [tokens, multiple of P] without its stamps and
        splits: a read, for callers that check before they change anything. The same walk as
        match_prefix's, written twice on purpose: match_prefix is the reference's hot path (the
        benchmarks' baseline), which a shared generator or flag would slow."""
        if self.disable:
            return 0
        key = key[: self._page_floor(len(key))]
        node, matched, at_root = self.root, 0, True
        while len(key) > 0:
            child = node.children.get(self.child_key(key, ns, at_root))
            if child is None:
                break
            n = self._page_floor(lcp_len(child.key, key))
            matched += n
            if n < len(child.key):
                break
            node, key, at_root = child, key[n:], False
        return matched

    # ---- R-RC-5 ----------------------------------------------------------------------------
    def insert_and_match(self, key: np.ndarray, value, ns=None, known: int = 0,
                         known_node=None) -> Tuple[int, int, TreeNode]:
        """`insert(key, value, ns)`, then `match_prefix(key, ns)` (a chunked request's prefilled
        part cached and matched again, R-DEC-3): (present length, matched length, last node).
        Device caches do both in one tree call and read the caller's hint that the first
        `known` tokens are cached as the path to `known_node` (unused here)."""
        present = self.insert(key, value, ns, known, known_node)
        m, node = self.match_prefix(key, ns)
        return present, m, node

    def insert(self, key: np.ndarray, value, ns=None, known: int = 0, known_node=None) -> int:
        """Insert `key` -> `value` (KV slots) in namespace `ns` (R-RC-5).

        Only floorP(len(key)) tokens are inserted. Returns the length already present
        [tokens]; the caller frees `value[:that]` slots that it does not own elsewhere.
        `value` may instead be a callable `value(n) -> slots` asked only for the new tail.
        `known`, `known_node`: a device cache's hint that the first `known` tokens are cached
        as the path to `known_node` (unused here).
        """
        if self.disable:
            return 0
        n_keep = self._page_floor(len(key))
        alloc_fn = value if callable(value) else None
        key = key[:n_keep]
        value = np.zeros(n_keep, np.int64) if alloc_fn else value[:n_keep]
        stamp = self._tick()
        node = self.root
        node.last_access = stamp
        present = 0
        at_root = True
        while len(key) > 0:
            ck = self.child_key(key, ns, at_root)
            child = node.children.get(ck)
            if child is None:
                break
            child.last_access = stamp
            n = self._page_floor(lcp_len(child.key, key))
            present += n
            key, value = key[n:], value[n:]
            node = self._split(child, n, stamp) if n < len(child.key) else child
            at_root = False
        if len(key) > 0:
            value = np.asarray(alloc_fn(len(key)), np.int64) if alloc_fn else value.copy()
            leaf = self._new_node(key.copy(), value, node, stamp, ns)
            node.children[self.child_key(key, ns, at_root)] = leaf
            self.evictable_size += len(key)
        return present

    # ---- R-RC-6 ----------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        if self.disable:
            return
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        if self.disable:
            return
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of node {node.node_id} with lock_ref {node.lock_ref}")
            if node.lock_ref == 1:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    # ---- R-RC-7 ----------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> List[TreeNode]:
        """Evict unlocked leaves, oldest stamp first (ties: smaller node id, D4), until at
        least `num_tokens` tokens are freed or no unlocked leaf is left. Returns the evicted
        nodes in eviction order."""
        if self.disable or num_tokens <= 0:
            return []
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if not n.children and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        evicted: List[TreeNode] = []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.pool.free(node.value)
            freed += len(node.key)
            self.evictable_size -= len(node.key)
            parent = node.parent
            for k, v in parent.children.items():
                if v is node:
                    del parent.children[k]
                    break
            node.parent = None
            evicted.append(node)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        return evicted

    def sizes(self) -> Tuple[int, int]:
        """(evictable_size, protected_size) [tokens] (R-RC-6)."""
        return self.evictable_size, self.protected_size

    def evict_tokens(self, num_tokens: int) -> int:
        """`evict` returning the evicted token count."""
        return sum(len(n.key) for n in self.evict(num_tokens))

    def path_values(self, node: Optional[TreeNode]) -> np.ndarray:
        """KV slots of the path root..node, int64 [depth of node in tokens]."""
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.value)
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int64)

    # ---- inspection ------------------------------------------------------------------------
    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def total_size(self) -> int:
        return sum(len(n.key) for n in self._nodes())

    def node_prefix(self, node: TreeNode) -> Tuple[object, Tuple[int, ...]]:
        """(namespace, full token prefix) of `node`: an id-free name for comparisons."""
        parts = []
        ns = node.ns
        while node is not None and node is not self.root:
            parts.append(node.key)
            node = node.parent
        toks = np.concatenate(parts[::-1]) if parts else np.zeros(0, np.int32)
        return ns, tuple(int(t) for t in toks)

    def cached_slots(self) -> np.ndarray:
        vals = [n.value for n in self._nodes() if n is not self.root]
        return np.concatenate(vals) if vals else np.zeros(0, np.int64)

    def check_integrity(self, lock_holders: Optional[List[TreeNode]] = None) -> None:
        """Verify the tree (STYLE practice 5). Raises AssertionError naming the first problem.

        Checks parent/child links and child keys, page alignment of keys, non-empty keys,
        key/value lengths, `evictable + protected == tree tokens` with each counter recomputed
        from `lock_ref`, `lock_ref >= 0`, and, given `lock_holders` (the last node of every
        lock currently held), that each node's lock_ref equals the number of holders below it.
        """
        P = self.page_size
        evictable = protected = 0
        expected_locks: Dict[int, int] = {}
        if lock_holders is not None:
            for h in lock_holders:
                n = h
                while n is not None and n is not self.root:
                    expected_locks[id(n)] = expected_locks.get(id(n), 0) + 1
                    n = n.parent
                if n is None:
                    raise AssertionError("a lock holder's node is no longer attached to the tree")
        ids = set()
        for node in self._nodes():
            if node.node_id in ids:
                raise AssertionError(f"node id {node.node_id} appears twice")
            ids.add(node.node_id)
            for ck, child in node.children.items():
                if child.parent is not node:
                    raise AssertionError(f"node {child.node_id}: parent link does not point to {node.node_id}")
                if ck != self.child_key(child.key, child.ns, node is self.root):
                    raise AssertionError(f"node {child.node_id}: child key does not match its key")
            if node is self.root:
                if node.lock_ref != 1 or len(node.key):
                    raise AssertionError("root must have lock_ref 1 and an empty key")
                continue
            if len(node.key) == 0 or len(node.key) % P:
                raise AssertionError(f"node {node.node_id}: key length {len(node.key)} not a positive multiple of {P}")
            if len(node.key) != len(node.value):
                raise AssertionError(f"node {node.node_id}: key and value lengths differ")
            if node.lock_ref < 0:
                raise AssertionError(f"node {node.node_id}: lock_ref {node.lock_ref} < 0")
            if node.parent is not None and node.parent is not self.root and node.parent.lock_ref < node.lock_ref:
                raise AssertionError(f"node {node.node_id}: lock_ref exceeds its parent's")
            if lock_holders is not None and node.lock_ref != expected_locks.get(id(node), 0):
                raise AssertionError(
                    f"node {node.node_id}: lock_ref {node.lock_ref} != {expected_locks.get(id(node), 0)} holders"
                )
            if node.lock_ref == 0:
                evictable += len(node.key)
            else:
                protected += len(node.key)
        if (evictable, protected) != (self.evictable_size, self.protected_size):
            raise AssertionError(
                f"evictable/protected counters {self.evictable_size}/{self.protected_size} "
                f"!= recomputed {evictable}/{protected}"
            )
