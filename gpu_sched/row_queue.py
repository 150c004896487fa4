"""Sequences over GpuScheduler's row table: the waiting queue and the plan's per-request lists,
held as row numbers (numpy int64) instead of Python lists.

Why: a Python list of n requests costs O(n) interpreter work every time it is built, permuted or
turned into rids; at 10^5 waiting requests that is tens of milliseconds per step, more than the
device work. `RowQueue` keeps the queue as the rows of its requests (ordering permutes a numpy
array, R-STEP-4 cuts a slice) and only looks requests up where the step reads them (the
admission windows). `LazyList` is a read-only list whose values are made on first use (the
plan's queue_order, num_matched and deprioritized).

Both read like lists: len, indexing, slices (as lists), iteration, `==` with any sequence;
pickling or copying a LazyList gives a plain list; `list(x)` is what `json.dumps` needs
(`PrefillPlan.to_dict()` does it for a whole plan).
Rows are freed and reused for other requests only when their request is no longer held (a
sweep before the row table grows, or a rebuild of its pools); before that the scheduler calls
`pin()` on every live view that holds a freed row, which copies its values out (weakly tracked:
views nobody holds cost nothing).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Callable, List, Optional

import numpy as np

_RID = operator.attrgetter("rid")
_EMPTY = np.zeros(0, dtype=np.int64)


def pick(items, idx: List[int]) -> list:
    """[items[i] for i in idx] in one C call (faster on long permutations)."""
    if len(idx) < 2:
        return [items[i] for i in idx]
    return list(operator.itemgetter(*idx)(items))


class _ListLike(Sequence):
    """`==`, `repr` and iteration of a read-only sequence, from the subclass's `_values()`
    (its full list)."""

    __slots__ = ()

    def __iter__(self):
        return iter(self._values())

    def __eq__(self, other):
        if isinstance(other, (str, bytes)) or not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and self._values() == list(other)

    __hash__ = None  # mutable-looking, as a list

    def __repr__(self) -> str:
        return repr(self._values())


class RowQueue(_ListLike):
    """The requests at rows `rows` of `sched`'s row table (`sched._rt_owner[row]`), in order,
    then `tail`: requests appended since (submit, requeue) whose rows are looked up when a step
    needs them (`GpuScheduler._queue_rows`).

    Args:
        sched: the owning GpuScheduler (its `_rt_owner` and `_views`).
        rows: int64 [k] row numbers (not copied; never modified in place).
        tail: requests after them.
        in_time: whether `rows` are in enqueue-time order (non-decreasing), where the maker
            knows it (the scheduler's consolidation of the tail, and slices, masks and copies
            of a queue that was); None: unknown (an ordering's result), read when needed.
        ordered: (key, k) when the first k rows are known to be in the order of ordering key
            `key` (e.g. ("fcfs", sign): R-ORD-4's), set on an ordering's result and kept by
            R-STEP-4's slice, copies, aborts (recounted) and the tail's consolidation
            (arrivals join behind the k rows), so the next step's ordering merges the
            arrivals in instead of checking or sorting the queue; None: unknown.
        epoch: the scheduler's row epoch (`GpuScheduler._row_epoch`) when these flags were
            known (default: now; a slice or copy takes its source's): a row held by the
            queue whose values are rewritten later (a requeued request's new enqueue time)
            moves the epoch, and the scheduler drops the flags of a queue from an older
            epoch before reading them (`GpuScheduler._queue_rows`), e.g. of a copy kept
            across steps and assigned back.
    """

    __slots__ = ("_s", "rows", "tail", "in_time", "ordered", "epoch", "__weakref__")

    def __init__(self, sched, rows: np.ndarray = _EMPTY, tail: Optional[list] = None,
                 in_time: Optional[bool] = None, ordered: Optional[tuple] = None, epoch: Optional[int] = None):
        self._s = sched
        self.rows = rows
        self.tail = [] if tail is None else tail
        self.in_time = in_time
        self.ordered = ordered
        self.epoch = getattr(sched, "_row_epoch", 0) if epoch is None else epoch
        if len(rows):
            sched._views.add(self)

    def __len__(self) -> int:
        return len(self.rows) + len(self.tail)

    def _values(self) -> list:
        return pick(self._s._rt_owner, self.rows.tolist()) + self.tail

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                return self._values()[i]
            return self.window(a, b)[0]
        n, k = len(self), len(self.rows)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("queue index out of range")
        return self._s._rt_owner[int(self.rows[i])] if i < k else self.tail[i - k]

    def window(self, a: int, b: int):
        """(requests a..b-1 as a list, their rows int64 [b-a] or None when some are in the
        tail)."""
        k = len(self.rows)
        a, b = max(a, 0), min(b, len(self))
        if b <= a:
            return [], _EMPTY
        if b <= k:
            rows = self.rows[a:b]
            return pick(self._s._rt_owner, rows.tolist()), rows
        head = pick(self._s._rt_owner, self.rows[a:k].tolist()) if a < k else []
        return head + self.tail[max(a - k, 0) : b - k], None

    def window_rows(self, a: int, b: int) -> Optional[np.ndarray]:
        """The rows of requests a..b-1 (int64 [b-a], a view), or None when some are in the tail."""
        a, b = max(a, 0), min(b, len(self))
        if b <= a:
            return _EMPTY
        return self.rows[a:b] if b <= len(self.rows) else None

    def after(self, k: int) -> "RowQueue":
        """The queue without its first k requests (R-STEP-4's rest as a slice)."""
        r = len(self.rows)  # a suffix of rows in time order (or in an ordering's order) stays so
        o = self.ordered
        return RowQueue(self._s, self.rows[k:], list(self.tail[max(k - r, 0) :]), self.in_time,
                        None if o is None else (o[0], max(o[1] - k, 0)), self.epoch)

    def subset(self, keep: np.ndarray) -> "RowQueue":
        """The queue without the rows where `keep` (bool [len(rows)]) is False, its tail
        kept: a subsequence keeps the time order, and an ordering's order over the known
        leading rows that stay (recounted)."""
        o = self.ordered
        return RowQueue(self._s, self.rows[keep], list(self.tail), self.in_time,
                        None if o is None else (o[0], int(keep[: o[1]].sum())), self.epoch)

    def append(self, r) -> None:
        self.tail.append(r)

    def extend(self, rs) -> None:
        self.tail.extend(rs)

    def copy(self) -> "RowQueue":
        return RowQueue(self._s, self.rows, list(self.tail), self.in_time, self.ordered, self.epoch)

    __copy__ = copy  # a copy is a live view too (deepcopy copies its scheduler with it)

    def pin(self) -> None:
        """Hold the requests themselves instead of rows (before the rows are reused)."""
        self.tail = self._values()
        self.rows = _EMPTY
        self.in_time = self.ordered = None


class LazyList(_ListLike):
    """A read-only list of n values made by `make()` on first use; `item(i)` (optional) reads
    one value without making the rest (e.g. `plan.queue_order[0]`). `pin()` makes them now."""

    __slots__ = ("_n", "_make", "_item", "_vals", "rows", "__weakref__")

    def __init__(self, n: int, make: Callable[[], list], item: Optional[Callable[[int], object]] = None,
                 rows: Optional[np.ndarray] = None):
        self._n, self._make, self._item, self._vals = n, make, item, None
        self.rows = rows  # the table rows its values come from (pinned before they are reused)

    def __len__(self) -> int:
        return self._n

    def _values(self) -> list:
        if self._vals is None:
            self._vals = self._make()
            self._make = self._item = self.rows = None
        return self._vals

    def __getitem__(self, i):
        if isinstance(i, slice) or self._vals is not None or self._item is None:
            return self._values()[i]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("list index out of range")
        return self._item(i)

    def pin(self) -> None:
        self._values()

    def __reduce__(self):
        # pickle / copy / deepcopy give a plain list: a copy must not depend on rows that
        # the scheduler may reuse (only live views are pinned)
        return (list, (self._values(),))


def rid_list(sched, rows: np.ndarray) -> LazyList:
    """The rids of the requests at `rows` as a LazyList, kept valid across row reuse
    (`sched._views`)."""
    owner = sched._rt_owner

    def make():
        return list(map(_RID, pick(owner, rows.tolist())))

    def item(i):
        return owner[int(rows[i])].rid

    out = LazyList(len(rows), make, item, rows)
    if len(rows):
        sched._views.add(out)
    return out
