"""Per-request scheduling state kept by the reference scheduler."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..request import Request
from .radix_cache import TreeNode


#: decode slots `ReqState.reserve_kv` makes room for up front [tokens]
KV_DECODE_HEADROOM = 4096


class ReqState:
    """A request plus what the scheduler knows about it.

    `prefix_len` [tokens] and `last_node` come from the latest prefix match (R-ORD-8,
    R-STEP-3.4). `kv` holds the KV slot of each computed fill position; the first `cached_len`
    of them belong to the radix cache (locked through `lock_node`), the rest up to `kv_len` are
    the request's private slots.
    """

    __slots__ = (
        "req", "rid", "priority", "enqueue_time", "prefix_len", "last_node", "lock_node",
        "kv", "kv_len", "cached_len", "extend_start", "extend_end", "retracted", "num_matched",
        "_fill", "_fill_n", "dev_row", "decode_ready",
    )

    def __init__(self, req: Request, priority: int, enqueue_time: float):
        self.req = req
        self.rid = req.rid
        self.priority = priority
        self.enqueue_time = enqueue_time
        self.prefix_len = 0
        self.last_node: Optional[TreeNode] = None
        self.lock_node: Optional[TreeNode] = None
        self.kv = np.zeros(0, np.int64)
        self.kv_len = 0
        self.cached_len = 0
        self.extend_start = 0
        self.extend_end = 0
        self.retracted = False
        self.num_matched = 0
        self._fill = None
        self._fill_n = -1
        self.dev_row = -1  # a device scheduler's row of this request (-1: none); unused here
        self.decode_ready = False  # holds the KV slot of its last token for the next decode (`prepare_decode`)

    # ---- token views -----------------------------------------------------------------------
    @property
    def out_len(self) -> int:
        return len(self.req.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_ids)

    @property
    def fill_len(self) -> int:
        return self.prompt_len + self.out_len

    def fill(self) -> np.ndarray:
        """`fill(r)` as int32 [fill_len], cached until the output grows."""
        if self._fill_n != self.out_len:
            self._fill = self.req.fill_ids()
            self._fill_n = self.out_len
        return self._fill

    @property
    def max_new(self) -> int:
        return self.req.max_new_tokens

    def max_prefix_len(self) -> int:
        """R-ORD-8: `len(fill) - 1`, capped at logprob_start_len when logprobs are returned."""
        m = self.fill_len - 1
        if self.req.return_logprob and self.req.logprob_start_len >= 0:
            m = min(m, self.req.logprob_start_len)
        return m

    # ---- KV bookkeeping --------------------------------------------------------------------
    def reserve_kv(self, length: int) -> None:
        """Room in `kv` for `length` computed tokens and the decode steps after them: up to
        max_new_tokens of them, at most `KV_DECODE_HEADROOM` (max_new_tokens may be up to
        2^63 - 1; decode grows the array past the headroom, doubling)."""
        self.ensure_kv_capacity(length + min(self.max_new, KV_DECODE_HEADROOM) + 1)

    def ensure_kv_capacity(self, n: int) -> None:
        """Room in `kv` for n slots (grown to at least twice its size: amortized O(1) a decode)."""
        if len(self.kv) < n:
            grown = np.empty(max(n, 2 * len(self.kv), 16), np.int64)
            grown[: self.kv_len] = self.kv[: self.kv_len]
            self.kv = grown

    def private_slots(self) -> np.ndarray:
        return self.kv[self.cached_len : self.kv_len]
