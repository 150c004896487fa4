"""Reference ordering of the waiting queue (SPEC.md section 3, R-ORD-1..11).

Every sort is Python's stable `list.sort` over the current queue order (R-ORD-11).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from ..config import SchedulerConfig
from .radix_cache import RadixCache, TreeNode
from .state import ReqState


@dataclass
class OrderResult:
    """What ordering decided: the policy applied, and for cache-aware policies the capped
    match length of each request (in the new order) and the deprioritized rids."""

    active_policy: str
    queue: List[ReqState]
    num_matched: Optional[List[int]] = None
    deprioritized: List[str] = field(default_factory=list)


def checked_shuffle(shuffle: Callable[[int], Sequence[int]], n: int) -> List[int]:
    """R-ORD-6: `shuffle(n)` as a list of Python ints, checked before anything is reordered.

    Raises: TypeError when an item is not an integer (a float, an array row; numpy ints and
    0-d tensors are taken); ValueError when the result is not a permutation of range(n)."""
    perm = list(shuffle(n))
    for k, i in enumerate(perm):
        try:
            perm[k] = operator.index(i)
        except TypeError:
            raise TypeError(f"shuffle({n}) returned {i!r} ({type(i).__name__}) at {k}, not an integer "
                            f"index") from None
    if sorted(perm) != list(range(n)):
        shown = perm if len(perm) <= 8 else perm[:8] + ["..."]
        raise ValueError(f"shuffle({n}) returned {shown!r} ({len(perm)} items), not a permutation of range({n})")
    return perm


def active_policy(config: SchedulerConfig, queue_len: int) -> str:
    """R-ORD-1 (cache disabled -> fcfs) and R-ORD-2 (lpm fallback above the queue limit)."""
    policy = config.effective_policy
    if policy == "lpm" and config.lpm_fallback_queue_len is not None and queue_len > config.lpm_fallback_queue_len:
        return "fcfs"
    return policy


def match_for_ordering(cache: RadixCache, queue: Sequence[ReqState]) -> None:
    """R-ORD-8: match each fill at full length in queue order; cap for the sort key."""
    for r in queue:
        r.prefix_len, r.last_node = cache.match_prefix(r.fill(), r.req.extra_key)
        r.num_matched = min(r.prefix_len, r.max_prefix_len())


def in_batch_deprioritized(queue: Sequence[ReqState], check_threshold: int, threshold: int) -> List[bool]:
    """R-ORD-9 in closed form: among checked requests, the first of each (namespace, first T
    tokens) group is kept and inserted; later members are deprioritized. A fill shorter than
    T can never share T tokens, so it is never deprioritized. T == 0 deprioritizes every
    checked request (a zero-length match already reaches the threshold)."""
    out = [False] * len(queue)
    if check_threshold == -1:
        return out
    seen = set()
    for i, r in enumerate(queue):
        if r.prefix_len > check_threshold:
            continue
        if threshold == 0:
            out[i] = True
            continue
        if r.fill_len < threshold:
            continue
        key = (r.req.extra_key, r.fill()[:threshold].tobytes())
        if key in seen:
            out[i] = True
        else:
            seen.add(key)
    return out


def dfs_weight_order(root: TreeNode, queue: Sequence[ReqState]) -> List[ReqState]:
    """R-ORD-10 without recursion: weights bottom-up over the nodes that carry requests and
    their ancestors; then a depth-first walk, heavier children first (ties: child order),
    emitting each node's own requests (queue order) after its descendants."""
    own: Dict[int, List[ReqState]] = {}
    node_of: Dict[int, TreeNode] = {}
    for r in queue:
        node = r.last_node if r.last_node is not None else root
        own.setdefault(id(node), []).append(r)
        node_of[id(node)] = node
    # relevant subtree: every node with requests and its ancestors
    relevant = {id(root)}
    for node in list(node_of.values()):
        while id(node) not in relevant:
            relevant.add(id(node))
            node = node.parent
    kids = lambda n: [c for c in n.children.values() if id(c) in relevant]  # noqa: E731
    # post-order of the relevant subtree (iterative), then weights child -> parent
    post: List[TreeNode] = []
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            post.append(node)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in kids(node))
    weight = {id(n): len(own.get(id(n), ())) for n in post}
    for node in post:
        if node is not root:
            weight[id(node.parent)] += weight[id(node)]
    # emit: visit children by descending weight, stable over child order
    out: List[ReqState] = []
    stack = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(own.get(id(node), ()))
            continue
        stack.append((node, True))
        children = sorted(kids(node), key=lambda c: -weight[id(c)])
        stack.extend((c, False) for c in reversed(children))
    return out


def order_queue(
    queue: List[ReqState],
    config: SchedulerConfig,
    cache: RadixCache,
    running: Sequence[ReqState],
    shuffle: Callable[[int], Sequence[int]],
) -> OrderResult:
    """Order the waiting queue for one step (R-ORD-1..11). Returns a new list."""
    policy = active_policy(config, len(queue))
    sign = config.priority_sign
    q = list(queue)
    if config.effective_policy == "fcfs":
        # R-ORD-4; the priority branch tests the configured policy, so under the lpm fallback
        # (R-ORD-2) it is skipped
        if config.enable_priority_scheduling:
            q.sort(key=lambda r: (r.priority * sign, r.enqueue_time))
        return OrderResult("fcfs", q)
    if policy in ("lpm", "dfs-weight"):
        match_for_ordering(cache, q)
        deprio = in_batch_deprioritized(
            q,
            config.in_batch_prefix_caching_check_threshold,
            config.in_batch_prefix_caching_deprioritize_threshold,
        )
        dep_rids = [r.rid for r, d in zip(q, deprio) if d]
        if policy == "lpm":
            flag = {id(r): d for r, d in zip(q, deprio)}
            q.sort(key=lambda r: float("inf") if flag[id(r)] else -r.num_matched)
        else:
            q = dfs_weight_order(cache.root, q)
        dep_set = set(dep_rids)
        return OrderResult(policy, q, [r.num_matched for r in q], [r.rid for r in q if r.rid in dep_set])
    if policy == "lof":
        if config.enable_priority_scheduling:
            q.sort(key=lambda r: (r.priority * sign, -r.max_new))
        else:
            q.sort(key=lambda r: -r.max_new)
    elif policy == "random":
        q = [q[i] for i in checked_shuffle(shuffle, len(q))]
    elif policy == "routing-key":
        counts = Counter(r.req.routing_key for r in running if r.req.routing_key)
        if counts:
            def key(r: ReqState):
                k = r.req.routing_key
                if k and k in counts:
                    return (0, -counts[k], k)
                return (1, 0, k or "")

            q.sort(key=key)
    return OrderResult(policy, q)
