"""FlatRadixTree: the radix prefix cache (SPEC.md section 2) as flat tensors on a device.

Layout
  Nodes live in arrays of a fixed capacity: `parent`, `key_off`/`key_len` (a range of the tree's
  token pool), `start` (depth of the node's first token), `lock_ref`, `last_access` (logical clock),
  `cid` (creation id, D4 tie-break), `order` (child order among siblings), `ns` (namespace id),
  `nchild`, `alive`. Node 0 is the root. Token pool arrays, indexed by pool position: `tok`
  (int32 token), `val` (int64 KV slot), `hsh` (prefix hash up to and including that token) and
  `owner` (node holding the position). A split never moves tokens: head and tail just take two
  parts of the same pool range.

Matching by prefix hashes (why matching cost does not grow with the prompt)
  Every page end of every path in the tree is entered in an open-addressing table
  `prefix hash -> pool position of the page's last token`. A query's hashes at every chunk
  boundary (chunk C = a multiple of the page size) are computed once, e.g. at submit; a match is
  then a search over chunk boundaries (presence is monotone in depth) and a search over the
  C/P - 1 page ends inside the next chunk, whose hashes come from the boundary hash and one
  window of C - P tokens. The torch searches probe several points per row and round (`_search`:
  up to 63 for small batches, whose cost is the rounds; two-way for large batches, whose cost
  is the probes). No child table is needed: the pool position found gives the node (`owner`)
  and the offset inside it.

Hash and collision bound
  h(d) = (s1(d) << 31) | s2(d), with s_k(d) = s_k(d-1) * B_k + tok + 1 mod p_k for the primes
  p1 = 2^31 - 1, p2 = 2147483629 and bases B_k drawn from the seed; s_k(0) comes from the
  namespace id, so namespaces never share entries (R-RC-2). For random bases, two different
  token strings of length <= L collide with probability <= (L / p1) * (L / p2) ~ L^2 / 2^62;
  over M table entries and Q query prefixes the chance of any wrong match is <= Q * M * L^2 / 2^62
  (1e-5 for 1e5 queries against 1e6 entries with L = 32k). One exception: ids 0 and 2^31 - 1
  are equal mod p1 (and ids t, t + p2 for t < 19 mod p2), so strings that differ only by such
  swaps are told apart by one component, with probability <= L / p2 of colliding. Hashes are
  not verified against tokens, so the bases must be unknown to whoever writes the prompts:
  with known bases a birthday search over such swaps finds colliding prompts in a second, and
  a collision matches (and reuses the KV of) a prefix the request does not have. The seed
  defaults to 0 here (tests, reproducible layouts); `GpuScheduler` draws a secret one.

Sequential equivalence of a batched match (SPEC section 8)
  Splits never change which prefixes the tree holds, so every matched length is computed against
  the tree as it was before the batch. The splits are then applied in rounds: round r applies,
  for every original node, the r-th request (in batch order) that ends strictly inside it at a
  position no earlier request of the batch ends at (a repeat finds that cut made: a no-op);
  splits in different nodes commute, so the result equals matching one by one. Request i carries stamp
  `clock + 1 + i`; every node on its final root path is stamped with the maximum stamp that
  touches it (scatter-max), and a split tail gets the splitting request's stamp, as in R-RC-4.

Hash table
  Open addressing with linear probing; a key's home slot is bits 32.. of `key * HASH_MIX`
  (so siblings whose last tokens are close do not pile up in one run). A batched insert runs in
  rounds: every pending key claims its current slot if free (EMPTY or a tombstone), the largest
  batch index wins a contested slot, the others move one slot on. Deletion leaves tombstones,
  except that a deleted slot followed by an EMPTY one becomes EMPTY, and with it the run of
  tombstones right before it (no probe passes them: `_clear_tombs`); a rebuild drops the rest
  when the table passes 3/4. A CPU tree also keeps the slot of each page end's entry at its
  pool position (`hslot`), so its deletions find their slots without probing.

Deferred entries (CPU trees, host forms)
  A host insert enters only the new leaf's first page end (its head) and keeps the other
  page ends pending (`hslot` = PENDING at their pool positions, listed in `_pend`); a split
  enters its tail's head at once. Every node's head is then in the table, which is all the
  token walks (`_walk_scalar`: one lookup per node, then a token comparison) and the position
  checks of kept matches need (the prefix hash at the kept position, the next page end in its
  node or a child's head by lookup: `check_matches(positions=)`, for lpm's and dfs-weight's
  orderings, and `_holds_at`, row by row for admission), so a serving loop whose
  searches are walks (admission, the inserts themselves, an ordering's few re-searched
  rows) never enters most page ends, and an eviction drops a pending one with one write
  instead of a tombstone. Any other reader of the table (`hkeys`, `hvals`: the hash
  searches of many rows, probes, kernels, the recorded step, `check_integrity`) enters every
  pending entry first (`_flush_pending`), so it sees the whole table. Results are the same with or
  without it (`DEFER_ENTRIES`); only the table's layout differs (and with it where a table
  too full for `max_probe` would raise, which at the default limit and load does not occur).

Queries in CSR form
  `match_csr` takes the queries as one flat token pool with per-request offsets (as the request
  table stores them) and their chunk hashes likewise, so a large queue needs no [B, max L]
  padding; `match` (padded) is the same search with row i starting at i * L.

Backends
  backend="torch" runs everything as vectorised torch ops (any device). backend="triton" routes
  the per-request work to the kernels of `gpu_sched.kernels.radix` (hash probes, the match
  search, table-insert claims, split writes, path stamps and lock counts, eviction ranking);
  the bookkeeping between them (node allocation, round counts) stays here. Both give identical
  results, bit for bit (tests/test_kernels_radix.py).

Host syncs: the operations here are vectorised over the batch but read a few scalars back
(round counts, allocation sizes); the graph-captured step uses bounded variants (DESIGN.md).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .kernels._utils import gather
from .policy import HostViews, _host, host_ok

P1, P2 = 2**31 - 1, 2147483629
EMPTY, TOMB = -1, -2
#: `hslot` at a page end whose entry is deferred (not in the table yet: `_flush_pending`)
PENDING = -2
ROOT = 0
BACKENDS = ("torch", "triton")
#: 2^64 / golden ratio as a signed int64: a key's home slot is bits 32.. of key * MIX (wrapping),
#: so keys that differ only in low bits (siblings whose last tokens are close) spread out
HASH_MIX = -7046029254386353131
#: slots read per probe step of the torch backend (8 int64 = one 64-byte cache line)
PROBE_WINDOW = 8
PROBE_SCALAR_MAX = 32  # host probes of up to this many keys run as Python loops (`_probe_scalar`)
#: a host table insert's rounds for this many pending keys or fewer, and a deletion's tombstone
#: runs before this many cleared slots or fewer, run in Python
SCALAR_TABLE_ROUNDS = 32
SCALAR_BATCH = 32  # host batches of up to this many (applies, stamps, locks) run as Python walks
INT64_MIN = -(2**63)


_VERSIONS = itertools.count(1)  # FlatRadixTree.version values


def home_slot(h, H: int):
    """First table slot probed for key h (H a power of two <= 2^31): h a torch tensor, a
    numpy array (int64 products wrap) or a Python int (its exact product has the same bits
    32.. as the wrapped one)."""
    return ((h * HASH_MIX) >> 32) & (H - 1)


#: the two moduli as an int64 [2, 1] column: both hashes' values in one array [2, ...]
_PP = np.array([[P1], [P2]], dtype=np.int64)


def _mod(x: np.ndarray, p: int) -> np.ndarray:
    """x % p for an int64 array and a Python int p, in place (x is returned): x - (x // p) * p.
    numpy's int64 floor division by a scalar multiplies and shifts (libdivide), its remainder
    divides (measured with numpy 2.4: ~1.5 against ~3.7 ns an element), and floor division
    makes this `%`'s floor remainder exactly, for every int64 x (the product wraps only for x
    within p of int64's minimum, and the wrap cancels in the subtraction; the callers' values
    are non-negative)."""
    q = x // p
    q *= p
    x -= q
    return x


def _mod_pp(a: np.ndarray) -> np.ndarray:
    """a % _PP in place for int64 [2, ...] of two or more dimensions (row 0 mod P1, row 1 mod
    P2) by `_mod` per row (a view each; a 1-d a's items would be copies: ValueError)."""
    if a.ndim < 2:
        raise ValueError(f"_mod_pp needs an array of two or more dimensions, got shape {a.shape}")
    _mod(a[0], P1)
    _mod(a[1], P2)
    return a


def _cumsum_(a: np.ndarray) -> np.ndarray:
    """Running sums along the last axis of an int64 array, in place (a is returned): torch's
    CPU cumsum on the same memory, the same exact sums (int64 additions) as numpy's, which
    is not vectorized for int64 (~2 against ~0.4 ns an element: a 5.6k-token insert's
    hashes 76 -> 52 us)."""
    t = torch.from_numpy(a)
    t.cumsum_(t.dim() - 1)
    return a


def _cat64(parts: List[np.ndarray]) -> torch.Tensor:
    """int64 numpy parts joined as one CPU tensor (empty for no parts)."""
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


def _pow_table(base: int, p: int, n: int) -> torch.Tensor:
    """base^i mod p for i = 0..n (int64; p < 2^31 so products fit), by doubling on the host."""
    out = np.empty(n + 1, dtype=np.int64)
    out[0] = 1
    k = 1
    while k <= n:
        m = min(k, n + 1 - k)
        out[k : k + m] = out[:m] * pow(base, k, p) % p
        k += m
    return torch.from_numpy(out)


@dataclass
class EvictResult:
    """Nodes removed by `evict`, in eviction order (ids are valid until reused), the KV slots
    they held (int64, to return to the KV pool) and the evicted token count."""

    nodes: torch.Tensor
    values: torch.Tensor
    num_tokens: int


def _entered(raw: str, doc: str) -> property:
    """A table array's property (`hkeys`, `hvals`): the array held at attribute `raw`, every
    deferred entry entered before it is read (`FlatRadixTree._flush_pending`)."""

    def get(self) -> torch.Tensor:
        if self._pend:
            self._flush_pending()
        return getattr(self, raw)

    def put(self, t: torch.Tensor) -> None:
        setattr(self, raw, t)

    return property(get, put, doc=doc)


class FlatRadixTree:
    """The device radix tree.

    Args:
        page_size: P [tokens] (R-RC-3).
        max_nodes: node capacity (root included). Exhaustion raises MemoryError.
        token_capacity: tokens the tree can hold (size it to the KV pool: every cached token
            holds a KV slot). Exhaustion after compaction raises MemoryError.
        device: torch device of all arrays.
        chunk_pages: pages per hash chunk C/P (default: enough pages for 16 tokens).
        seed: draws the hash bases.
        max_probe: longest probe sequence of the hash table.
        backend: "torch" (vectorised torch ops, any device) or "triton" (the kernels of
            `gpu_sched.kernels.radix` for probes, match search, table inserts, split writes, path
            stamps and lock counts, eviction ranking; CUDA tensors, or any device under
            `TRITON_INTERPRET=1`). Results are identical; the public operations also take
            `backend=` per call. The triton table insert keeps one more int64 array of the hash
            table's size (its claim buffer), allocated on first use.
    """

    def __init__(self, page_size: int = 1, max_nodes: int = 1 << 14, token_capacity: int = 1 << 18,
                 device="cpu", *, chunk_pages: Optional[int] = None, seed: int = 0, max_probe: int = 64,
                 backend: str = "torch"):
        self.backend = self._check_backend(backend)
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if max_nodes < 2:
            raise ValueError(f"max_nodes must be >= 2, got {max_nodes}")
        if token_capacity < 1:
            raise ValueError(f"token_capacity must be >= 1, got {token_capacity}")
        self.P = int(page_size)
        self.chunk_pages = int(chunk_pages) if chunk_pages else max(1, 16 // self.P)
        self.C = self.P * self.chunk_pages
        self.device = torch.device(device)
        self._on_cpu = self.device.type == "cpu"
        self.max_probe = int(max_probe)
        rng = np.random.default_rng(seed)
        self.B1 = int(rng.integers(1 << 20, P1 - 1))
        self.B2 = int(rng.integers(1 << 20, P2 - 1))
        self._pow_len = 0
        self._ensure_pow(1024)
        dev, N, T = self.device, int(max_nodes), int(token_capacity)
        z = lambda n, dt=torch.int64: torch.zeros(n, dtype=dt, device=dev)  # noqa: E731
        self.max_nodes, self.token_capacity = N, T
        self.parent = torch.full((N,), -1, dtype=torch.int64, device=dev)
        self.key_off, self.key_len, self.start = z(N), z(N), z(N)
        self.lock_ref, self.last_access, self.cid, self.order = z(N), z(N), z(N), z(N)
        self.ns, self.nchild = z(N), z(N)
        self.alive = z(N, torch.bool)
        self.tok, self.val, self.hsh = z(T, torch.int32), z(T), z(T)
        self.owner = torch.full((T,), -1, dtype=torch.int64, device=dev)
        H = 1
        while H < 2 * max(T // self.P, 16):
            H *= 2
        self._hk = torch.full((H,), EMPTY, dtype=torch.int64, device=dev)  # `hkeys`, `hvals`
        self._hv = torch.full((H,), -1, dtype=torch.int64, device=dev)
        self._pend: List[np.ndarray] = []  # pool positions of deferred entries (stale ones too)
        self._pend_n = 0
        self._since_flush = 1 << 62  # host inserts since deferred entries were last entered
        self._h_used = 0  # live entries + tombstones
        # CPU trees: the table slot of each page end's entry, by pool position (int32: slots <
        # H <= 2^31), so a host deletion writes its tombstones without probing; valid while every
        # insert since the last rehash went through the host form (`_hslot_ok`)
        self.hslot = torch.full((T,), -1, dtype=torch.int32) if self._on_cpu else None
        self._hslot_ok = True
        self._hclaim: Optional[torch.Tensor] = None  # claim buffer of the triton table insert
        self._claim_tag = 0
        self.evictable_size = torch.zeros((), dtype=torch.int64, device=dev)
        self.protected_size = torch.zeros((), dtype=torch.int64, device=dev)
        # root
        self.alive[ROOT] = True
        self.lock_ref[ROOT] = 1
        self.clock = 0
        # what the tree holds changed (insert, removal, compaction) since a match found on
        # version v iff self.version != v: numbers are unique across trees (splits, locks and
        # stamps keep every match's length and pool position, so they keep the version)
        self.version = next(_VERSIONS)
        # page-end hashes entered or removed, by the version that did it (`changed_since`); it
        # reaches back to version `_log_floor` (a compaction moves positions: it starts anew)
        self._log: List[Tuple[int, torch.Tensor]] = []
        self._log_n = 0
        self._log_floor = self.version
        self.next_cid = 1
        self.next_order = 1
        self.top = 0  # bump pointer of the token pool
        self._reuse = 0  # where `_free_run` looks for freed positions below `top` next
        self._free_nodes: List[int] = list(range(N - 1, 0, -1))
        self._hwm = 1  # node_bound()
        self._host_arrays = HostViews()  # `_np`'s views

    hkeys = _entered("_hk", """The hash table's keys (int64 [H]; EMPTY, TOMB or a page end's prefix
        hash), every deferred entry entered first (`_flush_pending`). The table's own operations
        and the token walks read `_hk` as it is.""")
    hvals = _entered("_hv", """The hash table's values (int64 [H]: each entry's pool position), every
        deferred entry entered first, as `hkeys`.""")

    #: defer all but each new leaf's first page-end entry on a CPU tree's host inserts (see
    #: the module doc); False enters every entry at once (the table's layout then equals the
    #: torch and triton forms', which the layout tests compare)
    DEFER_ENTRIES = True
    #: host inserts without a flush before deferring again: a table read between most
    #: inserts (an lpm or dfs-weight ordering at every step) would enter every deferred entry
    #: anyway, later and in one more pass, so deferring pays only where reads are rare
    DEFER_AFTER = 16
    #: entries per table insert of a flush (one insert of a whole seeded cache's 19M entries
    #: took ~450 ns an entry, its temporaries far past the caches; ~120 ns in batches)
    FLUSH_BATCH = 1 << 15

    def _defers(self) -> bool:
        """Whether a host insert defers entries now: `DEFER_ENTRIES`, a CPU tree whose
        deletions trust `hslot`, and no flush in the last `DEFER_AFTER` host inserts."""
        return (self.DEFER_ENTRIES and self.hslot is not None and self._hslot_ok
                and self._since_flush >= self.DEFER_AFTER)

    def _flush_pending(self) -> None:
        """Enter every deferred entry still pending (its pool position's `hslot` is PENDING;
        the list also holds positions evicted or entered since), keyed by the hash at that
        position (`hsh`)."""
        hs, parts = self._np("hslot"), []
        for a in self._pend:  # a position listed twice (evicted, then deferred again) is taken once
            a = a[hs[a] == PENDING]
            hs[a] = -1
            parts.append(a)
        self._pend, self._pend_n, self._since_flush = [], 0, 0
        pos = np.concatenate(parts) if len(parts) > 1 else parts[0]
        for i in range(0, pos.size, self.FLUSH_BATCH):  # batches whose round temporaries stay in cache
            try:
                self._enter_at(pos[i : i + self.FLUSH_BATCH])
            except BaseException:  # (the probe limit) the entries not entered stay deferred
                rest = pos[i:]
                rest = rest[hs[rest] == -1]
                hs[rest] = PENDING
                self._pend, self._pend_n = ([rest] if rest.size else []), rest.size
                raise

    def _defer(self, pe: np.ndarray) -> None:
        """Mark the page ends at pool positions pe (int64 [k], not in the table) pending. The
        list is cut back to the positions still pending when it outgrows the pool's pages."""
        if pe.size == 0:
            return
        self._np("hslot")[pe] = PENDING
        self._pend.append(pe)
        self._pend_n += pe.size
        if self._pend_n > 2 * (self.token_capacity // self.P) + 4096:  # mostly stale: the live ones
            self._relist()

    def entries(self) -> np.ndarray:
        """The table's entries as it stands for lookups, the deferred ones included (nothing is
        entered): int64 [k, 2] (key, value) rows sorted by key. Two trees that hold the same
        entries give equal arrays whatever their layouts (deferred or not, slots apart)."""
        keys, vals = self._hk.cpu().numpy(), self._hv.cpu().numpy()
        live = keys >= 0
        k, v = keys[live], vals[live]
        if self._pend:
            pos = np.flatnonzero(self._np("hslot") == PENDING)
            k, v = np.concatenate([k, self._np("hsh")[pos]]), np.concatenate([v, pos])
        o = np.argsort(k, kind="stable")
        return np.stack([k[o], v[o]], axis=1)

    def _enter_heads(self, nodes: List[int]) -> None:
        """Enter the first page-end entry of each of these nodes (split tails) where it is
        deferred, so that every node's head stays in the table."""
        if not self._pend:
            return
        hs, off, P = self._mv("hslot"), self._mv("key_off"), self.P
        pos = [off[x] + P - 1 for x in nodes]
        pos = [p for p in pos if hs[p] == PENDING]
        if pos:
            for p in pos:
                hs[p] = -1
            self._enter_at(np.array(pos, dtype=np.int64))

    def _enter_at(self, pos: np.ndarray) -> None:
        """Enter the page ends at pool positions pos (int64 [k]) in the table, keyed by their
        prefix hashes (`hsh`), their slots recorded (`hslot`)."""
        self._table_insert(torch.from_numpy(self._np("hsh")[pos]), torch.from_numpy(pos), positions=True)

    def host_int(self, name: str) -> int:
        """The 0-d array `name` (`evictable_size` or `protected_size`) as an int [tokens]: on
        the CPU a read of its memoryview (`_mv`: a Python int, ~0.2 us against ~0.5 us for
        int() of the numpy view; a serving loop reads these several times a call), elsewhere
        `.item()` (a device sync)."""
        return self._mv(name)[()] if self._on_cpu else int(getattr(self, name))

    def host_ints(self, *names: str) -> List[int]:
        """`host_int` of several 0-d arrays: off the CPU one device-to-host copy of all of
        them (each `host_int` there is a device sync)."""
        if self._on_cpu:
            return [self._mv(name)[()] for name in names]
        return torch.stack([getattr(self, name) for name in names]).tolist()

    def _host_form(self, backend: Optional[str] = None) -> bool:
        """Whether a call with this backend takes its host form: the torch backend on a CPU tree
        (`_on_cpu`, kept at construction) with `policy.host_ok()`."""
        return self._be(backend) == "torch" and self._on_cpu and host_ok()

    def _np(self, name: str) -> np.ndarray:
        """A numpy view of this CPU tree's array `name` (a node, token-pool or hash-table array,
        or the 0-d `evictable_size` / `protected_size`), kept by `policy.HostViews` (made anew
        after `_rehash`; not copied with the tree). Raises TypeError for a tree off the CPU, as
        `.numpy()` does."""
        return self._host_arrays.get(self, name)

    def _mv(self, name: str) -> memoryview:
        """`_np(name)` as a memoryview (`policy.HostViews.mv`): Python ints on indexing, for
        the per-node reads and writes of the scalar walks."""
        return self._host_arrays.mv(self, name)

    # ---- backends --------------------------------------------------------------------------
    @staticmethod
    def _check_backend(backend: str) -> str:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return backend

    def _be(self, backend: Optional[str]) -> str:
        """The backend of one call: the constructor's unless the call names one."""
        return self.backend if backend is None else self._check_backend(backend)

    @staticmethod
    def _kernels():
        from gpu_sched.kernels import radix as kernels  # imports triton: only when asked for

        return kernels

    # ---- hashing ---------------------------------------------------------------------------
    def _ensure_pow(self, n: int) -> None:
        if n <= self._pow_len:
            return
        n = max(n, 2 * self._pow_len)
        dev = getattr(self, "device", torch.device("cpu"))
        inv1, inv2 = pow(self.B1, P1 - 2, P1), pow(self.B2, P2 - 2, P2)
        self.pw1 = _pow_table(self.B1, P1, n).to(dev)
        self.pw2 = _pow_table(self.B2, P2, n).to(dev)
        self.ipw1 = _pow_table(inv1, P1, n).to(dev)
        self.ipw2 = _pow_table(inv2, P2, n).to(dev)
        self._pow_len = n
        self._pow_stacks = None  # `_pow_host`'s, made again on first use

    def _pow_host(self) -> Tuple[np.ndarray, np.ndarray]:
        """(B^i, B^-i) mod p for both moduli as int64 [2, n + 1] host arrays (row k: modulus k),
        stacked once per table size, for the host hashes that reduce both moduli in one array
        (`_PP`). CPU trees only."""
        if self._pow_stacks is None:
            self._pow_stacks = (np.stack([self.pw1.numpy(), self.pw2.numpy()]),
                                np.stack([self.ipw1.numpy(), self.ipw2.numpy()]))
        return self._pow_stacks

    @staticmethod
    def _seed(ns, p: int):
        """A namespace's hash seed mod p, for int tensors or numpy arrays (int64 results) or a
        Python int."""
        if not isinstance(ns, int):
            ns = ns.astype(np.int64) if isinstance(ns, np.ndarray) else ns.to(torch.int64)
        return (ns * 1000003 + 12345) % p

    def prefix_hashes(self, tokens: torch.Tensor, lengths: torch.Tensor, ns: torch.Tensor,
                      every: int) -> torch.Tensor:
        """Prefix hashes of padded queries at depths every, 2*every, ... [B, L // every] int64.

        Entries at depths beyond a query's length are garbage (callers mask by length). On CPU
        tensors the same sums run in numpy (every reduction by `_mod_pp`)."""
        B, L = tokens.shape
        K = L // every
        if K == 0:
            return torch.zeros((B, 0), dtype=torch.int64, device=tokens.device)
        self._ensure_pow(L + 1)
        if _host(tokens):
            return torch.from_numpy(self._prefix_hashes_host(tokens.numpy(), ns.numpy(), K, every))
        t = tokens[:, : K * every].to(torch.int64) + 1
        out = []
        for p, pw, ipw in ((P1, self.pw1, self.ipw1), (P2, self.pw2, self.ipw2)):
            w = t * ipw[1 : K * every + 1] % p  # (t+1) * B^-(j+1)
            cs = torch.cumsum(w, dim=1)[:, every - 1 :: every] % p  # sum up to depth d = k*every
            d = torch.arange(1, K + 1, device=tokens.device) * every
            # seed and cs are below p < 2^31: their sum times pw < 2^63 needs no reduction between
            s = (self._seed(ns, p)[:, None] + cs) * pw[d] % p
            out.append(s)
        return (out[0] << 31) | out[1]

    def _prefix_hashes_host(self, tokens: np.ndarray, ns: np.ndarray, K: int, every: int) -> np.ndarray:
        """`prefix_hashes`' formulas on host arrays (K = L // every >= 1): the namespace seeds'
        windows from depth 0 (`_window_hashes_host`). int64 [B, K]."""
        t = tokens[:, : K * every].astype(np.int64) + 1
        d = np.arange(1, K + 1, dtype=np.int64) * every
        return self._window_hashes_host(t, d, [self._seed(ns, P1), self._seed(ns, P2)])

    def _window_hashes_host(self, x: np.ndarray, d: np.ndarray, bases) -> np.ndarray:
        """The packed hashes at depths d (1-based, ascending, <= W) inside token windows x
        (int64 token ids + 1 [B, W]) that continue from per-row bases (bases[k]: int64 [B], the
        hash mod P1 / P2 so far, below p): per modulus (base + sum_{t<d} x_t B^-(t+1)) B^d mod p,
        every reduction by `_mod_pp` (terms below 2^62, sums of under 2^32 terms below 2^63,
        base + sum below 2^32 times a power below 2^31). int64 [B, len(d)].

        Token ids of a real vocabulary make each term x_t B^-(t+1) small enough that the
        running sums of S = 2^32 // max(x) - 1 unreduced terms stay below 2^63 (with a
        reduced carry under 2^31): the sums then run unreduced, segment by segment, and are
        reduced once (1.4x for a 13k-token window); ids up to 2^31 - 1 reduce every term."""
        W = x.shape[1]
        pw, ipw = self._pow_host()
        pp = _PP[:, :, None]  # both moduli at once: [2, B, W] arrays
        terms = x[None] * ipw[:, None, 1 : W + 1]
        S = (1 << 32) // int(x.max(initial=1)) - 1
        if S >= W:
            cs = _cumsum_(terms)
        elif S >= 1024:  # segments whose unreduced sums fit, each continuing from the last one's reduced sum
            cs = terms
            carry = np.zeros((2, x.shape[0], 1), dtype=np.int64)
            for a in range(0, W, S):
                seg = _cumsum_(terms[:, :, a : a + S])
                seg += carry
                carry = seg[:, :, -1:] % pp
        else:
            cs = _cumsum_(_mod_pp(terms))
        if d.size == W:  # d is 1..W: every depth, slices instead of gathers
            pwd = pw[:, None, 1 : W + 1]
        else:
            cs, pwd = cs[:, :, d - 1], pw[:, None, d]
        _mod_pp(cs)
        cs += np.array([bases[0], bases[1]], dtype=np.int64).reshape(2, -1, 1)
        cs *= pwd
        _mod_pp(cs)
        return (cs[0] << 31) | cs[1]

    def chunk_hashes_flat(self, tokens: torch.Tensor, lengths: np.ndarray, ns: np.ndarray,
                          every: int) -> torch.Tensor:
        """The hashes `prefix_hashes` gives at depths every, 2*every, ... of B sequences laid end
        to end (no padding: a batch of long prompts costs its own tokens, not B x the longest).

        Args:
            tokens: int32 [T] on the tree's device, the B sequences concatenated.
            lengths: int64 numpy [B] >= 0 summing to T; ns: int64 numpy [B] namespace ids.
            every: chunk length (> 0).
        Returns: int64 [sum(lengths // every)], each sequence's hashes in order, sequences in
        order (the same values as `prefix_hashes(...)[b, :lengths[b] // every]`).

        Per sequence the hash at depth d is (seed + sum_{j<d} (t_j+1) B^-(j+1)) B^d mod p: the
        terms are reduced mod p (< 2^31) and summed with one cumsum over the whole batch (exact
        in int64 below 2^32 tokens), a sequence's sums being the differences at its bounds."""
        lengths = np.asarray(lengths, dtype=np.int64)
        T, dev = tokens.numel(), tokens.device
        if T >= 2**32:
            raise ValueError(f"chunk_hashes_flat: at most 2^32 - 1 tokens per batch, got {T}")
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValueError(f"chunk_hashes_flat: every must be an int > 0, got {every!r}")
        if (lengths < 0).any() or int(lengths.sum()) != T or np.shape(ns) != lengths.shape:
            raise ValueError(f"chunk_hashes_flat: lengths must be >= 0 and sum to the {T} tokens, with one "
                             f"namespace each; got lengths summing to {int(lengths.sum())} (min "
                             f"{int(lengths.min()) if lengths.size else 0}) and {np.size(ns)} namespaces")
        cnt = lengths // every
        if not T or not cnt.any():
            return torch.zeros(0, dtype=torch.int64, device=dev)
        starts = np.cumsum(lengths) - lengths
        self._ensure_pow(int(lengths.max()) + 1)
        if _host(tokens):
            return torch.from_numpy(self._chunk_hashes_flat_host(tokens.numpy(), lengths, ns, every))
        # per token its power index (position in its sequence + 1); per chunk end its token
        # index, its sequence's start and its depth
        widx = torch.from_numpy(np.arange(1, T + 1, dtype=np.int64) - np.repeat(starts, lengths)).to(dev)
        seq = np.repeat(np.arange(lengths.size), cnt)
        depth = (np.arange(cnt.sum(), dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt) + 1) * every
        end = torch.from_numpy(starts[seq] + depth - 1).to(dev)
        before = torch.from_numpy(starts[seq]).to(dev)  # the cumsum's index just before the start, + 1
        d = torch.from_numpy(depth).to(dev)
        nsq = torch.from_numpy(np.asarray(ns, dtype=np.int64)[seq]).to(dev)
        t = tokens.to(torch.int64) + 1
        out = []
        for p, pw, ipw in ((P1, self.pw1, self.ipw1), (P2, self.pw2, self.ipw2)):
            cs0 = torch.zeros(T + 1, dtype=torch.int64, device=dev)  # cs0[i]: the first i terms
            torch.cumsum(t * ipw.index_select(0, widx) % p, 0, out=cs0[1:])
            run = (cs0.index_select(0, end + 1) - cs0.index_select(0, before)) % p
            out.append((self._seed(nsq, p) + run) * pw.index_select(0, d) % p)  # < 2^63, as above
        return (out[0] << 31) | out[1]

    def _chunk_hashes_flat_host(self, tokens: np.ndarray, lengths: np.ndarray, ns, every: int) -> np.ndarray:
        """`chunk_hashes_flat`'s sums on host arrays (a CPU tree), reduced by `_mod` / `_mod_pp`: the
        same values in numpy calls of a few us instead of torch CPU ops of 10-30 us (one
        2k-token prompt: ~300 us in torch). Unchecked: for callers whose tokens (int [T]),
        lengths (int64 numpy [B], summing to T) and namespaces ([B]) are built consistent
        (the checked entry is `chunk_hashes_flat`). int64 [sum(lengths // every)].

        When every * max(token + 1) < 2^32 (any real vocabulary at the default chunk length),
        a chunk's terms are summed unreduced (each below 2^63 / every: the powers are below
        2^31) and reduced once per chunk, and the prefix sums run over chunks, not tokens:
        the same values (sums mod p do not depend on where they are reduced), 1.25x faster
        for a 2k-token fill and 1.6-1.7x for 13k-60k tokens (no per-token `%`, no per-token
        cumsum). Token ids spanning 31 bits (the replay's synthetic and trace prompts) reduce
        each term before a chunk's sum, and the prefix sums still run over chunks (numpy's
        int64 cumsum costs ~6 ns an element here): 200k tokens in 100 or 10 sequences 6.7 ->
        4.9 ms against a per-token cumsum, one 2k / 20k-token fill 50 -> 44 / 337 -> 290 us;
        16-bit limbs (two products per token) measured no faster."""
        T = tokens.size
        cnt = lengths // every
        starts = np.cumsum(lengths) - lengths
        self._ensure_pow(int(lengths.max(initial=0)) + 1)
        t = tokens.astype(np.int64) + 1
        small = T > 0 and int(t.max()) * every < (1 << 32)
        if lengths.size == 1:  # one sequence (a new request's fill): slices, both moduli in one array
            pw, ipw = self._pow_host()
            K = int(cnt[0])
            depth = np.arange(every, K * every + 1, every)
            terms = t[None, : K * every] * ipw[:, 1 : K * every + 1]
            if not small:  # each term below 2^62: reduced before a chunk's sum
                _mod_pp(terms)
            run = _mod_pp(np.cumsum(_mod_pp(terms.reshape(2, K, every).sum(axis=2)), axis=1))
            run += self._seed(int(ns[0]), _PP)
            run *= pw[:, depth]
            _mod_pp(run)
            return (run[0] << 31) | run[1]
        widx = np.arange(1, T + 1, dtype=np.int64) - np.repeat(starts, lengths)
        first = np.cumsum(cnt) - cnt  # each sequence's first chunk
        seq = np.repeat(np.arange(lengths.size), cnt)
        depth = (np.arange(seq.size, dtype=np.int64) - np.repeat(first, cnt) + 1) * every
        end = starts[seq] + depth  # the index just past the chunk's last token
        nsq = np.asarray(ns, dtype=np.int64)[seq]
        out = []
        # segment sums: each chunk, and each sequence's tail (its tokens past its last chunk)
        tails = (starts + cnt * every)[lengths % every > 0]
        cut = np.concatenate([end - every, tails])
        o = np.argsort(cut, kind="stable")  # distinct starts; chunks stay in their order
        cut, is_chunk = cut[o], o < seq.size
        ahead = first[seq]  # chunks of the sequence before each chunk's, in the running sums
        for p, pw, ipw in ((P1, self.pw1, self.ipw1), (P2, self.pw2, self.ipw2)):
            cs = np.zeros(seq.size + 1, dtype=np.int64)  # cs[k]: the first k chunks' sums
            if seq.size:
                terms = t * ipw.numpy()[widx]
                if not small:  # each term below 2^62: reduced before a chunk's sum
                    _mod(terms, p)
                sums = np.add.reduceat(terms, cut)
                del terms  # freed before the next modulus's product (a large array each)
                np.cumsum(_mod(sums[is_chunk], p), out=cs[1:])
            run = _mod(cs[1:] - cs[ahead], p)
            run += self._seed(nsq, p)
            run *= pw.numpy()[depth]
            out.append(_mod(run, p))
        return (out[0] << 31) | out[1]

    # ---- hash table ------------------------------------------------------------------------
    def _probe(self, h: torch.Tensor, be: str = "torch") -> torch.Tensor:
        """Table slot of each hash, -1 if absent. h: int64 [n]."""
        if be == "triton":
            return self._kernels().probe(h.contiguous(), self.hkeys, self.hvals, self.max_probe)[0]
        if _host(h):
            return torch.from_numpy(self._probe_host(h.numpy()))
        H = self.hkeys.numel()
        slot = torch.full_like(h, -1)
        # Probe the home slot first (most keys stop there), then windows of consecutive slots
        # (PROBE_WINDOW = one cache line, doubling each step): a key stops at its first slot
        # holding it or EMPTY, as in one-slot-at-a-time probing. The keys still probing are
        # compacted each step, so the tail of long probe runs (absent keys among tombstones)
        # costs few steps.
        if h.numel() == 0 or self.max_probe <= 0:
            return slot
        pos = home_slot(h, H)
        k = gather(self.hkeys, pos)
        hit = k == h
        slot = torch.where(hit, pos, slot)
        more = torch.nonzero(~hit & (k != EMPTY)).flatten()
        if more.numel() == 0:
            return slot
        idx, pos, hh = more, (pos[more] + 1) & (H - 1), h[more]
        done, w = 1, PROBE_WINDOW // 2
        while idx.numel() and done < self.max_probe:
            w = min(2 * w, self.max_probe - done)
            cols = (pos[:, None] + torch.arange(w, device=h.device)) & (H - 1)
            k = gather(self.hkeys, cols)
            hit = k == hh[:, None]
            stop = hit | (k == EMPTY)
            first = stop.to(torch.int8).argmax(1)  # first stop in the window (0 if none)
            rows = torch.arange(idx.numel(), device=h.device)
            found = hit[rows, first]  # a stop that is a hit (False where the window has no stop)
            slot[idx[found]] = cols[rows[found], first[found]]
            more = ~stop.any(1)
            idx, pos, hh = idx[more], (pos[more] + w) & (H - 1), hh[more]
            done += w
        return slot

    def _probe_host(self, h: np.ndarray, raw: bool = False) -> np.ndarray:
        """`_probe`'s torch form on host arrays (a CPU table's view), window for window: the
        same home slots, windows and stops, in numpy calls of 1-3 us instead of torch CPU ops
        of 5-15 us. `raw`: the table as it is, deferred entries not entered (for keys that
        are never deferred: nodes' first page ends). Returns int64 [n]."""
        name = "_hk" if raw else "hkeys"
        keys = self._np(name)
        H = keys.size
        if h.size <= PROBE_SCALAR_MAX:
            return np.array(self._probe_scalar(self._mv(name), h.tolist()), dtype=np.int64)
        slot = np.full(h.size, -1, dtype=np.int64)
        if h.size == 0 or self.max_probe <= 0:
            return slot
        pos = home_slot(h, H)  # numpy's int64 products wrap as torch's do
        k = keys[pos]
        hit = k == h
        slot[hit] = pos[hit]
        more = np.flatnonzero(~hit & (k != EMPTY))
        if more.size == 0:
            return slot
        idx, pos, hh = more, (pos[more] + 1) & (H - 1), h[more]
        done, w = 1, PROBE_WINDOW // 2
        while idx.size and done < self.max_probe:
            w = min(2 * w, self.max_probe - done)
            cols = (pos[:, None] + np.arange(w)) & (H - 1)
            k = keys[cols]
            hit = k == hh[:, None]
            stop = hit | (k == EMPTY)
            first = stop.argmax(1)  # first stop in the window (0 if none)
            rows = np.arange(idx.size)
            found = hit[rows, first]
            slot[idx[found]] = cols[rows[found], first[found]]
            more = ~stop.any(1)
            idx, pos, hh = idx[more], (pos[more] + w) & (H - 1), hh[more]
            done += w
        return slot

    def _probe_scalar(self, keys, hs: List[int]) -> List[int]:
        """`_probe_host` for a few keys, one Python loop each: the same home slot (Python's
        exact product agrees with int64's wrapped one in the bits the slot reads) and the same
        max_probe slots in order, stopping at the key or an empty slot (tombstones are passed).
        keys: the table's keys, a memoryview (`_mv("hkeys")`) or a numpy array."""
        mask, more = len(keys) - 1, self.max_probe - 1
        if more < 0:
            return [-1] * len(hs)
        # a Python int: cheaper to compare than a numpy scalar (a memoryview's is cheapest)
        key_at = keys.__getitem__ if isinstance(keys, memoryview) else keys.item
        out = []
        for h in hs:
            pos = ((h * HASH_MIX) >> 32) & mask
            k = key_at(pos)  # the home slot first: at the table's load most probes end there
            if k == h:
                out.append(pos)
                continue
            slot = -1
            if k != EMPTY:
                for _ in range(more):
                    pos = (pos + 1) & mask
                    k = key_at(pos)
                    if k == h:
                        slot = pos
                        break
                    if k == EMPTY:
                        break
            out.append(slot)
        return out

    def _lookup_scalar(self, hs: List[int]) -> List[int]:
        """`lookup` of a few hashes on a CPU table, in Python: their values, -1 if absent."""
        vals = self._mv("hvals")
        return [vals[s] if s >= 0 else -1 for s in self._probe_scalar(self._mv("hkeys"), hs)]

    def lookup(self, h: torch.Tensor, *, backend: Optional[str] = None) -> torch.Tensor:
        """Pool position stored for each prefix hash, -1 if absent."""
        if self._be(backend) == "triton":
            return self._kernels().probe(h.contiguous(), self.hkeys, self.hvals, self.max_probe)[1]
        if _host(h):
            return torch.from_numpy(self._lookup_host(h.numpy()))
        slot = self._probe(h)
        return torch.where(slot >= 0, gather(self.hvals, slot.clamp(min=0)), torch.full_like(h, -1))

    def _lookup_host(self, h: np.ndarray) -> np.ndarray:
        """`lookup` on host arrays (a CPU table's views). Returns int64 [n]."""
        slot = self._probe_host(h)
        return np.where(slot >= 0, self._np("hvals")[np.maximum(slot, 0)], -1)

    def _table_insert(self, h: torch.Tensor, v: torch.Tensor, be: str = "torch", positions: bool = False) -> None:
        """Insert absent keys. Round by round every pending key claims its slot if free; of
        several claimants the largest index wins, the others move one slot on. `positions`:
        the values are pool positions, so a CPU tree's host form records each entry's slot
        at its value (`hslot`); any other insert stops deletions from trusting those."""
        n = h.numel()
        if n == 0:
            return
        record = positions and self.hslot is not None and _host(h) and be != "triton"
        if not record and self._pend:  # deletions will probe: every deferred entry in first
            self._flush_pending()
        H = self._room_for(n, be)
        if not record:
            self._hslot_ok = False
        if be == "triton":
            if self._hclaim is None or self._hclaim.numel() != H:
                self._hclaim = torch.full((H,), -1, dtype=torch.int64, device=self.device)
                self._claim_tag = 0
            ok, self._claim_tag = self._kernels().table_insert(
                h.contiguous(), v.contiguous(), self.hkeys, self.hvals, self._hclaim, self._claim_tag, self.max_probe)
            if not ok:
                raise RuntimeError("prefix hash table: probe limit reached (table too full)")
            self._h_used += n
            return
        if _host(h):
            self._table_insert_host(h.numpy(), v.numpy(), record)
            self._h_used += n
            return
        # the pending keys: their indices and current slots (compacted each round)
        idx = torch.arange(n, device=h.device)
        pos = home_slot(h, H)
        for _ in range(self.max_probe):
            cand = torch.nonzero(self.hkeys[pos] < 0).flatten()  # pending keys at a free slot
            o = torch.argsort(pos[cand] * n + idx[cand])  # by slot, then index: the last of each slot wins
            cand = cand[o]
            cp = pos[cand]
            last = torch.ones_like(cp, dtype=torch.bool)
            last[:-1] = cp[1:] != cp[:-1]
            win = cand[last]
            self.hkeys[pos[win]] = h[idx[win]]
            self.hvals[pos[win]] = v[idx[win]]
            lose = torch.ones_like(idx, dtype=torch.bool)
            lose[win] = False
            idx, pos = idx[lose], (pos[lose] + 1) & (H - 1)
            if idx.numel() == 0:
                break
        if idx.numel():
            raise RuntimeError("prefix hash table: probe limit reached (table too full)")
        self._h_used += n

    def _table_insert_host(self, h: np.ndarray, v: np.ndarray, record: bool = False) -> None:
        """`_table_insert`'s torch rounds on host arrays (a CPU table's views), round for round:
        the same claims and winners (so the same table), in numpy calls of 1-3 us instead of
        torch CPU ops of 5-15 us. `record`: also write each entry's slot at its value (a pool
        position) in `hslot`. Raises RuntimeError at the probe limit."""
        keys, vals = self._np("_hk"), self._np("_hv")  # as they are: deferred entries stay so
        hs = self._np("hslot") if record else None
        H, n = keys.size, h.size
        idx = np.arange(n, dtype=np.int64)
        pos = home_slot(h, H)
        for r in range(self.max_probe):
            if idx.size <= SCALAR_TABLE_ROUNDS:  # the last few keys' rounds in Python
                self._table_rounds_scalar(h[idx].tolist(), v[idx].tolist(), pos.tolist(), self.max_probe - r, record)
                return
            cand = np.flatnonzero(keys[pos] < 0)  # pending keys at a free slot
            cp, claim = pos[cand], -3 - idx[cand]  # claims below EMPTY and TOMB
            # each claimed slot keeps its smallest claim, the largest index's (a scatter-min with
            # repeated slots: no sort); then every claimed slot gets its winner's key
            np.minimum.at(keys, cp, claim)
            won = keys[cp] == claim
            win = cand[won]
            ws, wv = cp[won], v[idx[win]]
            keys[ws] = h[idx[win]]
            vals[ws] = wv
            if hs is not None:
                hs[wv] = ws
            lose = np.ones(idx.size, dtype=bool)
            lose[win] = False
            idx, pos = idx[lose], (pos[lose] + 1) & (H - 1)
            if idx.size == 0:
                return
        raise RuntimeError("prefix hash table: probe limit reached (table too full)")

    def _room_for(self, n: int, be: str = "torch") -> int:
        """The table rebuilt larger (`_rehash`) if n more entries would take it past 3/4 used
        (live entries and tombstones); returns its size H."""
        if (self._h_used + n) * 4 > self._hk.numel() * 3:
            self._rehash(extra=n, be=be)
        return self._hk.numel()

    def _enter_one_host(self, h: int, pos: int) -> None:
        """`_table_insert` of one absent key h with its value, the pool position pos, on a CPU
        tree's host form, its slot recorded (`hslot`), in Python ints: a lone claimant takes
        the first free slot (EMPTY or TOMB) on its probe path, the slot the rounds give it
        (~25 us less than `_table_insert`'s array glue; a host insert enters one key, its
        leaf's head, when it defers the rest). RuntimeError at the probe limit."""
        self._room_for(1)
        keys, vals, hs = self._mv("_hk"), self._mv("_hv"), self._mv("hslot")
        mask = len(keys) - 1
        p = home_slot(h, len(keys))
        for _ in range(self.max_probe):
            if keys[p] < 0:
                keys[p], vals[p], hs[pos] = h, pos, p
                self._h_used += 1
                return
            p = (p + 1) & mask
        raise RuntimeError("prefix hash table: probe limit reached (table too full)")

    def _table_rounds_scalar(self, h: List[int], v: List[int], pos: List[int], rounds: int, record: bool) -> None:
        """`_table_insert_host`'s rounds for a few pending keys (key h[i], value v[i], now at
        slot pos[i], in index order) in Python on the table's memoryviews, round for round:
        the keys at a free slot (EMPTY or TOMB) claim it, the last (largest index) claimant of
        a slot wins, the others move one slot on. `rounds` rounds at most, then RuntimeError
        at the probe limit. A round of numpy calls costs ~25 calls whatever the count (a
        replay at the table's working load spends most rounds on under 30 keys)."""
        keys, vals = self._mv("_hk"), self._mv("_hv")
        hs = self._mv("hslot") if record else None
        mask = len(keys) - 1
        pend = list(zip(pos, h, v))
        for _ in range(rounds):
            win = {p: k for k, (p, _, _) in enumerate(pend) if keys[p] < 0}  # slot -> its last claimant
            rest = []
            for k, (p, hk, vk) in enumerate(pend):
                if win.get(p) == k:
                    keys[p] = hk
                    vals[p] = vk
                    if hs is not None:
                        hs[vk] = p
                else:
                    rest.append(((p + 1) & mask, hk, vk))
            if not rest:
                return
            pend = rest
        raise RuntimeError("prefix hash table: probe limit reached (table too full)")

    def _table_delete(self, h: torch.Tensor, be: str = "torch", pos: Optional[np.ndarray] = None) -> None:
        """Delete the entries of hashes h (int64 [n]): tombstones, cleared where no probe needs
        them (`_clear_tombs`). `pos`: their pool positions, which a CPU tree's host form reads
        the slots of (`hslot`) instead of probing, when every insert since the last rehash
        recorded them; a deferred entry (PENDING there) only loses its mark. RuntimeError for
        an absent entry."""
        if self._host_form(be):  # the slots and the tombstones on the table's views
            hn = h.numpy()
            if pos is not None and self._hslot_ok:
                hs = self._np("hslot")
                slot = hs[pos].astype(np.int64)
                if self._pend:  # a deferred entry leaves with its pending mark alone
                    pend = slot == PENDING
                    if pend.any():
                        hs[pos[pend]] = -1
                        slot, hn = slot[~pend], hn[~pend]
                self._delete_slots(slot, hn)
                return
            if self._pend:
                self._flush_pending()
            slot = self._probe_host(hn)
            if (slot < 0).any():
                raise RuntimeError("prefix hash table: deleting an absent entry")
            self._h_used -= _tomb_host(self._np("_hk"), slot)
            return
        slot = self._probe(h, be)
        if bool((slot < 0).any()):
            raise RuntimeError("prefix hash table: deleting an absent entry")
        self.hkeys[slot] = TOMB
        self._h_used -= self._clear_tombs(slot)

    def _delete_slots(self, slot: np.ndarray, hn: np.ndarray) -> None:
        """Delete the host table's entries at `slot` (int64 [n], distinct, from `hslot`), which
        must hold the keys hn (int64 [n]; RuntimeError otherwise, the table untouched)."""
        if slot.size <= SCALAR_TABLE_ROUNDS:  # the usual few (a leaf's entered page ends) in Python
            keys = self._mv("_hk")
            sl, mask = slot.tolist(), len(keys) - 1
            if any(keys[x] != k for x, k in zip(sl, hn.tolist())):
                raise RuntimeError("prefix hash table: deleting an absent entry")
            ends = [x for x in sl if keys[(x + 1) & mask] == EMPTY]  # read before the writes, as `_tomb_host`
            for x in sl:
                keys[x] = TOMB
            for x in ends:
                keys[x] = EMPTY
            self._h_used -= len(ends) + _clear_runs_scalar(keys, ends, mask)
            return
        keys = self._np("_hk")
        if not np.array_equal(keys[slot], hn):
            raise RuntimeError("prefix hash table: deleting an absent entry")
        self._h_used -= _tomb_host(keys, slot)

    def _clear_tombs(self, slot: torch.Tensor) -> int:
        """Turn back to EMPTY the tombstones just written at `slot` (int64 [n], distinct) whose
        next slot is EMPTY, and then, a slot back per round, the run of tombstones right
        before each of them: a tombstone followed by an EMPTY slot lies on no key's probe path
        (a key's path from its home slot to its slot holds no EMPTY slot), so no probe needs
        it. The cleared set is fixed by the table: every form clears the same slots
        (`_tomb_host`). Returns how many slots became EMPTY (no longer counted as used)."""
        keys, mask = self.hkeys, self.hkeys.numel() - 1
        c = slot[keys[(slot + 1) & mask] == EMPTY]
        keys[c] = EMPTY
        return len(c) + _clear_runs_before(keys, c, mask)

    def _rehash(self, extra: int = 0, be: str = "torch") -> None:
        live = self._hk >= 0  # deferred entries stay pending (their `hslot` marks are kept)
        keys, vals = self._hk[live], self._hv[live]
        H = self._hk.numel()
        while (keys.numel() + extra) * 2 > H:
            H *= 2
        self._hk = torch.full((H,), EMPTY, dtype=torch.int64, device=self.device)
        self._hv = torch.full((H,), -1, dtype=torch.int64, device=self.device)
        for name in ("hkeys", "hvals", "_hk", "_hv"):  # `_np` would re-make them; this frees the old table now
            self._host_arrays.drop(name)
        self._h_used = 0
        self._hslot_ok = self.hslot is not None  # every live entry is entered again: the host form records all
        T = self.token_capacity
        self._table_insert(keys, vals, be, positions=not vals.numel() or (int(vals.min()) >= 0 and int(vals.max()) < T))

    # ---- change log ------------------------------------------------------------------------
    #: most hashes the change log keeps; older entries are dropped (raising its floor), so a
    #: match verified long ago is checked by lookups instead
    CHANGE_LOG_MAX = 1 << 16

    def _log_change(self, h: torch.Tensor) -> None:
        """Record the page-end hashes the current version entered or removed."""
        self._log.append((self.version, h))
        self._log_n += h.numel()
        while self._log_n > self.CHANGE_LOG_MAX:
            v, x = self._log.pop(0)
            self._log_n -= x.numel()
            self._log_floor = v

    def changed_since(self, v: int, limit: Optional[int] = None) -> Optional[torch.Tensor]:
        """Sorted int64 page-end hashes entered into or removed from the table after version
        `v` (a `version` value this tree had; duplicates possible), or None when the log does
        not reach back that far (`v` older than its floor, or another tree's) or holds more
        than `limit` hashes since `v` (a caller with few queries then looks their hashes up
        instead of sorting the log). A hash not in it is present now iff it was at `v`; pool
        positions have not moved since `v` either."""
        if v < self._log_floor or v > self.version:
            return None
        i, n = len(self._log), 0  # versions never decrease along the log: the entries after v are a suffix
        while i and self._log[i - 1][0] > v:
            i -= 1
            n += self._log[i][1].numel()
            if limit is not None and n > limit:
                return None
        parts = [h for _, h in self._log[i:]]
        if not parts:
            return torch.zeros(0, dtype=torch.int64, device=self.device)
        return torch.sort(torch.cat(parts)).values

    def unchanged(self, since: torch.Tensor, h_guess: torch.Tensor, h_next: torch.Tensor) -> torch.Tensor:
        """bool [B]: rows whose match found at a version of `since`'s log still holds with its
        pool position, because neither of its hashes h_guess, h_next (`check_matches`) was
        entered or removed since (`since` = `changed_since(v)`, sorted)."""
        if since.numel() == 0:
            return torch.ones_like(h_guess, dtype=torch.bool)
        last = since.numel() - 1
        # a bitmap of the changed hashes' low bits (>= 16 slots per hash: few false hits) picks
        # the rows that may have changed; only those are searched exactly
        bits = 1 << max(16, (16 * since.numel()).bit_length())
        seen = torch.zeros(bits, dtype=torch.bool, device=since.device)
        seen[since & (bits - 1)] = True
        maybe = torch.nonzero(seen[h_guess & (bits - 1)] | seen[h_next & (bits - 1)]).flatten()
        out = torch.ones_like(h_guess, dtype=torch.bool)
        if maybe.numel():
            g, x = h_guess[maybe], h_next[maybe]
            hit = (since[torch.searchsorted(since, g).clamp(max=last)] == g) | (
                since[torch.searchsorted(since, x).clamp(max=last)] == x)
            out[maybe] = ~hit
        return out

    # ---- allocation ------------------------------------------------------------------------
    def _alloc_ids(self, n: int) -> List[int]:
        """n free node ids (lowest first), as a list. Raises MemoryError past the capacity."""
        if n > len(self._free_nodes):
            raise MemoryError(f"radix tree node capacity {self.max_nodes} exhausted (need {n} more nodes)")
        ids = [self._free_nodes.pop() for _ in range(n)]
        if ids:
            self._hwm = max(self._hwm, max(ids) + 1)
        return ids

    def _alloc_nodes(self, n: int) -> torch.Tensor:
        return torch.tensor(self._alloc_ids(n), dtype=torch.int64, device=self.device)

    def node_bound(self) -> int:
        """One past the largest node id ever allocated: every live node has a smaller id, so
        whole-tree scans read only this prefix of the node arrays, not the full capacity (ids are
        handed out lowest first and freed ids are reused first)."""
        return self._hwm

    def _alloc_tokens(self, n: int) -> int:
        """Pool offset of n contiguous free positions: past the bump pointer `top` while the pool
        has room there, then the next free run of n positions below `top` from the reuse cursor
        (`_free_run`: evictions free the oldest leaves, which were allocated first, so freed
        ranges come back roughly in pool order), and only when neither exists a compaction. A
        reused range moves no live token, so matches and the change log stay valid."""
        if self.top + n > self.token_capacity:
            c0 = self._reuse
            off = self._free_run(n)
            if off < 0 and c0 > 0:  # ranges freed behind the cursor since it passed: once more from 0
                off = self._free_run(n, end=min(self.top, c0 + n))
            if off >= 0:
                return off
            self.compact()
        if self.top + n > self.token_capacity:
            raise MemoryError(f"radix tree token capacity {self.token_capacity} exhausted (need {n} tokens)")
        off = self.top
        self.top += n
        return off

    def _free_run(self, n: int, end: Optional[int] = None) -> int:
        """The first offset >= the reuse cursor `_reuse` of n free pool positions (owner -1)
        below `end` (default `top`), the cursor moved past them; -1 (cursor back to 0) when
        there is none. Each failed window moves the cursor past its last live position, so one
        sweep of the pool reads every position about once."""
        owner = self._np("owner") if self._on_cpu else self.owner
        c = self._reuse
        end = self.top if end is None else end
        while n > 0 and c + n <= end:
            live = owner[c : c + n] >= 0
            occ = np.flatnonzero(live) if self._on_cpu else torch.nonzero(live).flatten()
            if len(occ) == 0:
                self._reuse = c + n
                return c
            c += int(occ[-1]) + 1  # past the window's last live position
        self._reuse = 0
        return -1

    def compact(self) -> None:
        """Move the live token ranges to the front of the pool (one gather per array)."""
        self.version = next(_VERSIONS)
        self._log, self._log_n, self._log_floor = [], 0, self.version  # every position moved
        if self._on_cpu and host_ok():  # numpy on the views; `torch_forms()` runs the torch form
            self._compact_host()
        else:
            self._compact_torch()

    def _relist(self) -> None:
        """The deferred entries' list anew from their pending marks (a scan of the pool's
        positions in use): after a compaction, which moved the marks with their positions
        (`hslot` is a pool array), or when stale positions outgrow the list (`_defer`)."""
        if self._pend:
            pos = np.flatnonzero(self._np("hslot")[: self.top] == PENDING)
            self._pend, self._pend_n = ([pos] if pos.size else []), pos.size

    def _pool_arrays(self):
        """(name, value of a free position) of every array indexed by pool position."""
        return [("tok", 0), ("val", 0), ("hsh", 0), ("owner", -1)] + ([("hslot", -1)] if self.hslot is not None else [])

    def _compact_torch(self) -> None:
        """`compact`'s moves as torch ops on the tree's device."""
        b = self._hwm
        ids = torch.nonzero(self.alive[:b] & (self.key_len[:b] > 0)).flatten()
        ids = ids[torch.argsort(self.key_off[ids])]
        lens = self.key_len[ids]
        new_off = torch.cumsum(lens, 0) - lens
        total = int(lens.sum())
        src = torch.repeat_interleave(self.key_off[ids] - new_off, lens) + torch.arange(total, device=self.device)
        remap = torch.full((self.token_capacity,), -1, dtype=torch.int64, device=self.device)
        remap[src] = torch.arange(total, device=self.device)
        for name, fill in self._pool_arrays():
            arr = getattr(self, name)
            moved = arr[src].clone()
            arr[:total] = moved
            arr[total:] = fill
        self.key_off[ids] = new_off
        live = self._hk >= 0  # the entries in the table (deferred ones are by position: `compact`)
        self._hv[live] = remap[self._hv[live]]
        self.top = total
        self._reuse = 0
        self._relist()

    def _compact_host(self) -> None:
        """`compact` on a CPU tree's numpy views, the same arrays after it: about half the
        torch form's time (torch's boolean masks over a table sized to the pool; a Mooncake
        replay's compactions ~120 -> ~50 ms each)."""
        v = self._np
        b = self._hwm
        key_off, key_len = v("key_off"), v("key_len")
        ids = np.flatnonzero(v("alive")[:b] & (key_len[:b] > 0))
        ids = ids[np.argsort(key_off[ids], kind="stable")]
        lens = key_len[ids]
        new_off = np.cumsum(lens) - lens
        total = int(lens.sum())
        src = np.repeat(key_off[ids] - new_off, lens) + np.arange(total, dtype=np.int64)
        for name, fill in self._pool_arrays():
            arr = v(name)
            arr[:total] = arr[src]  # the fancy-index gather is a copy: overlapping ranges are safe
            arr[total:] = fill
        key_off[ids] = new_off
        keys, vals = v("_hk"), v("_hv")  # the entries in the table (deferred ones: `compact`)
        live = np.flatnonzero(keys >= 0)
        remap = np.full(self.token_capacity, -1, dtype=np.int64)
        remap[src] = np.arange(total, dtype=np.int64)
        vals[live] = remap[vals[live]]
        self.top = total
        self._reuse = 0
        self._relist()

    # ---- match (R-RC-4) --------------------------------------------------------------------
    def _find(self, tokens, lengths, ns, chunk_hashes=None, be: str = "torch") -> Tuple[torch.Tensor, torch.Tensor]:
        """Matched length (page-aligned) and pool position of its last token (-1 for 0), for
        padded queries: the CSR search below with row i starting at i * L."""
        B, Lpad = tokens.shape
        dev = self.device
        if chunk_hashes is None:
            chunk_hashes = self.prefix_hashes(tokens, lengths, ns, self.C)
        K = chunk_hashes.shape[1]
        rows = torch.arange(B, dtype=torch.int64, device=dev)
        return self._find_csr(tokens.contiguous().reshape(-1), rows * Lpad, torch.full((B,), Lpad, device=dev),
                              lengths, ns, chunk_hashes.contiguous().reshape(-1), rows * K,
                              torch.full((B,), K, device=dev), K, be)

    def _find_csr(self, tok, tok_start, tok_span, lengths, ns, ch, ch_start, ch_count, max_count: int,
                  be: str = "torch", static: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """Matched length and last pool position of B queries in CSR form.

        Row i reads tokens tok[tok_start[i] + c] for c < tok_span[i] (reads past the span only
        feed hashes that are never probed) and its boundary hashes at depths C, 2C, ... from
        ch[ch_start[i] : ch_start[i] + ch_count[i]], ch_count[i] >= floorP(lengths[i]) // C.
        max_count >= every ch_count. The torch search stops when every row's interval is closed
        (a host read per round); with `static` it runs bit_length(max_count) binary rounds over
        every row and probes fixed windows (`_lookup_static`): no host read, static shapes (the
        triton kernel is static either way).
        """
        if be == "triton":
            return self._kernels().find(
                tok.contiguous(), tok_start.contiguous(), tok_span.contiguous(), lengths.contiguous(),
                ns.contiguous(), ch.contiguous(), ch_start.contiguous(), ch_count.contiguous(), self.hkeys,
                self.hvals, page_size=self.P, chunk_pages=self.chunk_pages, B1=self.B1, B2=self.B2,
                max_probe=self.max_probe)
        B = lengths.numel()
        dev = self.device
        Lq = lengths // self.P * self.P
        nch = Lq // self.C
        zero = torch.zeros(B, dtype=torch.int64, device=dev)
        if B == 0:
            return zero, zero.clone()
        # 1. the longest present chunk boundary: a (k+1)-ary search over the row's chunk hashes
        arity = self._arity(B)
        if ch.numel():
            ch_last = ch.numel() - 1
            key1 = lambda rows, k: gather(ch, (gather(ch_start, rows) + k - 1).clamp(0, ch_last))  # noqa: E731
            lo, lo_pos = (self._search_static(nch, key1, max_count) if static else
                          self._search(nch, key1, arity))
        else:
            lo, lo_pos = zero.clone(), torch.full((B,), -1, dtype=torch.int64, device=dev)
        if self.chunk_pages == 1:
            return lo * self.C, lo_pos
        # 2. inside the next chunk: the page-end hashes from the chunk-boundary hash, all at once
        # for every row (one [B, C - P] token window), then the same search over them
        n_in = self.chunk_pages - 1
        d0 = lo * self.C
        hin = self._chunk_page_hashes(tok, tok_start, ns, ch, ch_start, lo)  # [B, n_in]
        hi2 = torch.minimum((Lq - d0) // self.P, torch.full_like(lo, n_in))
        flat = hin.reshape(-1)
        key2 = lambda rows, q: gather(flat, rows * n_in + q - 1)  # noqa: E731
        if static:
            lo2, pos2 = self._search_static(hi2, key2, n_in)
        else:
            lo2, pos2 = self._search(hi2, key2, max(arity, n_in) if B * n_in <= 2048 else arity)
        return d0 + lo2 * self.P, torch.where(lo2 > 0, pos2, lo_pos)

    def _chunk_page_hashes(self, tok, tok_start, ns, ch, ch_start, lo) -> torch.Tensor:
        """Prefix hashes at the chunk_pages - 1 page ends inside chunk lo of each row (depths
        lo*C + P, ..., lo*C + C - P), rolled on from the boundary hash at depth lo*C (the
        namespace seed for lo == 0) over one [B, C - P] token window. int64 [B, chunk_pages - 1];
        entries past a row's length are garbage (callers bound them)."""
        B = lo.numel()
        dev = self.device
        n_in = self.chunk_pages - 1
        W = n_in * self.P
        if n_in == 0:
            return torch.zeros((B, 0), dtype=torch.int64, device=dev)
        self._ensure_pow(W + 1)
        if _host(lo):
            return torch.from_numpy(self._chunk_page_hashes_host(tok.numpy(), tok_start.numpy(), ns.numpy(), ch.numpy(),
                                                                 ch_start.numpy(), lo.numpy()))
        zero = torch.zeros(B, dtype=torch.int64, device=dev)
        seed_h = gather(ch, (ch_start + lo - 1).clamp(0, max(ch.numel() - 1, 0))) if ch.numel() else zero
        d0 = lo * self.C
        if tok.numel():
            cols = (tok_start + d0)[:, None] + torch.arange(W, device=dev)
            x = gather(tok, cols.clamp(0, tok.numel() - 1)).to(torch.int64) + 1  # [B, W]
        else:
            x = torch.ones((B, W), dtype=torch.int64, device=dev)
        ends = torch.arange(1, n_in + 1, device=dev) * self.P  # depths inside the chunk
        hs = []
        for p, pw, ipw, sh in ((P1, self.pw1, self.ipw1, 31), (P2, self.pw2, self.ipw2, 0)):
            base = torch.where(lo > 0, (seed_h >> 31) if sh else (seed_h & (2**31 - 1)), self._seed(ns, p))
            cs = torch.cumsum(x * ipw[1 : W + 1] % p, dim=1)[:, ends - 1] % p
            hs.append((base[:, None] + cs) % p * pw[ends] % p)
        return (hs[0] << 31) | hs[1]

    def _chunk_page_hashes_host(self, tok: np.ndarray, tok_start: np.ndarray, ns: np.ndarray, ch: np.ndarray,
                                ch_start: np.ndarray, lo: np.ndarray) -> np.ndarray:
        """`_chunk_page_hashes` on host arrays (chunk_pages > 1, power tables long enough):
        the same window, continued from the chunk hash before it (or the namespace seed at
        chunk 0) by `_window_hashes_host`. int64 [B, chunk_pages - 1]."""
        B = lo.size
        n_in = self.chunk_pages - 1
        W = n_in * self.P
        seed_h = ch[np.clip(ch_start + lo - 1, 0, ch.size - 1)] if ch.size else np.zeros(B, dtype=np.int64)
        if tok.size:
            cols = (tok_start + lo * self.C)[:, None] + np.arange(W)
            x = tok[np.clip(cols, 0, tok.size - 1)].astype(np.int64) + 1  # [B, W]
        else:
            x = np.ones((B, W), dtype=np.int64)
        ends = np.arange(1, n_in + 1) * self.P  # depths inside the chunk
        return self._window_hashes_host(x, ends, self._bases_host(seed_h, lo > 0, ns))

    def _bases_host(self, h: np.ndarray, cont: np.ndarray, ns: np.ndarray) -> List[np.ndarray]:
        """`_window_hashes_host`'s bases per row: where `cont`, continuing from the packed hash h
        stored so far (its mod-P1 and mod-P2 halves), else the namespace's seeds (depth 0).
        int64 arrays [B]."""
        return [np.where(cont, h >> 31, self._seed(ns, P1)), np.where(cont, h & (2**31 - 1), self._seed(ns, P2))]

    def _find_scalar(self, tok: np.ndarray, ch: np.ndarray, toff: int, coff: int, length: int,
                     ns: int) -> Tuple[int, int, int, int]:
        """`_find_csr` then `depth_hashes` for one query on a CPU tree, as binary searches of
        scalar lookups (`_probe_scalar`): a query's first match costs ~10 lookups of a few us
        instead of the array form's probe rounds (~1 ms of torch and numpy calls for one row).
        Presence is monotone along a query's page ends, so every search of [0, hi] gives the
        same largest present point. tok, ch: the CSR pools (int32 tokens, int64 chunk hashes);
        the query reads tokens from toff and chunk hashes from coff. Returns (matched length,
        pool position of its last token or -1, hash at the length, hash at length + P), the
        last two as `depth_hashes` computes them (garbage where it does)."""
        P, C = self.P, self.C
        Lq = length // P * P
        search = self._search_scalar
        lo, pos = search(ch[coff:], Lq // C) if ch.size else (0, -1)
        last = max(ch.size - 1, 0)
        hin = self._page_hashes_scalar(tok, ch, toff, coff, lo, ns)
        if hin:
            lo2, pos2 = search(hin, min((Lq - lo * C) // P, len(hin)))
            pos = pos2 if lo2 > 0 else pos
        else:
            lo2 = 0
        m = lo * C + lo2 * P

        def at(x):  # depth_hashes' value at depth x in [lo*C, lo*C + C]
            r = x - lo * C
            if r % C == 0 or not hin:
                return int(ch[min(max(coff + x // C - 1, 0), last)]) if ch.size else 0
            return hin[min(max(r // P - 1, 0), len(hin) - 1)]

        return m, pos, at(m), at(m + P)

    def _walk_scalar(self, tok: np.ndarray, length: int, ns: int, start: Optional[Tuple[int, int]] = None
                     ) -> Tuple[int, int, int, int]:
        """`_find_scalar` of one query from its tokens alone, without its chunk hashes: a walk
        down the tree as the reference's match walks it. From depth d (a page end on the
        query's path) the hash one page on is rolled from the hash at d (`hsh` at d's pool
        position, or the namespace seed at 0) over that page's tokens in Python (`_roll`) and
        looked up (`_probe_scalar`); found at position p in node X, the rest of X is compared
        with the query's next tokens (their bytes, numpy for the first difference), and the walk goes on from the last equal page
        end (X's end: the next node by the next lookup; inside X: the match ends there). Equal
        tokens on a path are present prefixes, so this finds the length and position the
        hash search finds; its cost is one lookup and one comparison per node on the matched
        path, not a hash of the query (an admission's first match of a long prompt that
        shares one cached node: ~15 us against ~150 for hashing its leading 2k tokens and
        searching them). tok: the query's tokens (int numpy [>= length]: a capped search's
        whole fill); length [tokens], the depth searched up to. Returns (matched length, pool
        position of its last token or -1, hash at the length, hash at length + P): the hashes
        as the pooled search has them wherever tok reaches (at the length when it is over 0;
        one page on when that is within floorP(len(tok)), past `length` too: a capped match
        kept in the row table is checked later against the full fill, `_full_match`); 0
        elsewhere. `start`: (d, pool position of token d - 1), a page-aligned depth d > 0 of
        the query known present (an insert's locked prefix): the walk starts there, not at
        the root (a chunked prompt's inserts would compare its earlier chunks again)."""
        P = self.P
        Lq = length // P * P
        # the table as it is: every node's first page end is in it (deferred entries are not needed)
        keys, vals, owner, key_off, key_len, hsh = map(self._mv, ("_hk", "_hv", "owner", "key_off", "key_len", "hsh"))
        ptok = self._np("tok")
        M = (1 << 31) - 1

        def roll(a: int, b: int, d: int) -> Tuple[int, int]:  # the hash at d rolled over tok's page at d
            return self._roll(a, b, tok[d : d + P].tolist())

        a, b = self._seed(ns, P1), self._seed(ns, P2)  # the hash at depth d, per modulus
        d, pos, h_next = 0, -1, 0
        rest = start is not None and start[0] > 0  # the rest of pos's node to compare first
        if rest:
            d, pos = start
            hv = hsh[pos]
            a, b = hv >> 31, hv & M
        while True:
            if rest:  # after a page end found at pos: the rest of its node X, within Lq
                X = owner[pos]
                n = min(key_off[X] + key_len[X] - 1 - pos, Lq - d)
                if n > 0:
                    xs, qs = ptok[pos + 1 : pos + 1 + n], tok[d : d + n]
                    if qs.dtype == xs.dtype and xs.tobytes() == qs.tobytes():  # equal tokens: one memcmp
                        r = n
                    else:  # another dtype, or a token differs: the first difference, if any
                        diff = np.flatnonzero(xs != qs)
                        r = n if diff.size == 0 else int(diff[0]) // P * P
                    if r:
                        d, pos = d + r, pos + r
                        hv = hsh[pos]
                        a, b = hv >> 31, hv & M
                    if r < n:  # a page of X differs from the query's: the match ends at d
                        a2, b2 = roll(a, b, d)
                        h_next = (a2 << 31) | b2
                        break
            if d + P > Lq:  # the walk reached Lq: the hash one page on from the query's own tokens, if it has them
                if d + P <= tok.size:
                    a2, b2 = roll(a, b, d)
                    h_next = (a2 << 31) | b2
                break
            a2, b2 = roll(a, b, d)
            h = (a2 << 31) | b2
            slot = self._probe_scalar(keys, [h])[0]
            if slot < 0:  # depth d + P absent: the match ends at d
                h_next = h
                break
            d, pos, a, b = d + P, vals[slot], a2, b2
            rest = True
        return d, pos, ((a << 31) | b) if d > 0 else 0, h_next if d + P <= tok.size // P * P else 0

    def _search_scalar(self, hs, hi: int, lo: int = 0, lo_pos: int = -1) -> Tuple[int, int]:
        """`_search` of one row on a CPU table as a binary search of scalar probes: the largest
        j in [0, hi] whose hash hs[j - 1] is present (presence is monotone in j, so any search
        finds the same point) and its stored value (-1 for 0). hs: a sequence of int hashes.
        A caller that knows j >= lo (value lo_pos there) searches above lo only: hs[:lo] is
        not read."""
        keys, vals = self._mv("hkeys"), self._mv("hvals")
        a, pos = lo, lo_pos
        while a < hi:
            mid = (a + hi + 1) // 2
            slot = self._probe_scalar(keys, [int(hs[mid - 1])])[0]
            if slot >= 0:
                a, pos = mid, vals[slot]
            else:
                hi = mid - 1
        return a, pos

    def _page_hashes_scalar(self, tok: np.ndarray, ch: np.ndarray, toff: int, coff: int, lo: int,
                            ns: int) -> List[int]:
        """`_chunk_page_hashes_host` for one row, in Python: the hash rolls on token by token,
        H(d + 1) = (H(d) * B + t_d + 1) mod p per modulus (the same residues as the power
        sums), from the chunk hash at depth lo*C (the namespace seed at lo == 0), over the
        same tokens (reads clamped to the pool, ones for an empty pool)."""
        n_in = self.chunk_pages - 1
        if n_in == 0:
            return []
        if lo > 0:
            h = int(ch[min(max(coff + lo - 1, 0), ch.size - 1)]) if ch.size else 0
            a, b = h >> 31, h & (2**31 - 1)
        else:
            a, b = self._seed(ns, P1), self._seed(ns, P2)
        start, top = toff + lo * self.C, tok.size - 1
        x = tok[max(min(start, top), 0) : start + n_in * self.P].tolist() if tok.size else []
        x += [x[-1] if tok.size else 0] * (n_in * self.P - len(x))  # past the pool: its last token
        P, out = self.P, []
        for j in range(0, n_in * P, P):
            a, b = self._roll(a, b, x[j : j + P])
            out.append((a << 31) | b)
        return out

    def _roll(self, a: int, b: int, toks) -> Tuple[int, int]:
        """A prefix hash's residues (a mod P1, b mod P2) rolled on over the tokens `toks` (Python
        ints), one token at a time: H(d + 1) = (H(d) * B + t_d + 1) mod p per modulus (the
        residues of `prefix_hashes`' power sums)."""
        B1, B2 = self.B1, self.B2
        for t in toks:
            a, b = (a * B1 + t + 1) % P1, (b * B2 + t + 1) % P2
        return a, b

    def depth_hashes(self, tok, tok_start, ns, ch, ch_start, d) -> Tuple[torch.Tensor, torch.Tensor]:
        """Prefix hashes of queries at depths d and d + P (what `check_matches` probes), from
        the chunk hash at or below d and one chunk's token window. Queries in CSR form as
        `_find_csr`; d int64 [B], multiples of P. Returns two int64 [B]; a depth of 0 or past
        a query's length gives garbage (never probed)."""
        C, P = self.C, self.P
        lo = d // C
        hin = self._chunk_page_hashes(tok, tok_start, ns, ch, ch_start, lo)
        n_in = hin.shape[1]
        last = max(ch.numel() - 1, 0)

        def at(x):  # depth x in [lo*C, lo*C + C]
            bound = gather(ch, (ch_start + x // C - 1).clamp(0, last)) if ch.numel() else torch.zeros_like(x)
            if n_in == 0:
                return bound
            r = x - lo * C
            inner = hin.gather(1, (r // P - 1).clamp(0, n_in - 1)[:, None])[:, 0]
            return torch.where(r % C == 0, bound, inner)

        return at(d), at(d + P)

    def check_matches(self, lengths: torch.Tensor, guess: torch.Tensor, h_guess: torch.Tensor,
                      h_next: torch.Tensor, *, backend: Optional[str] = None,
                      positions: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Which guessed match lengths are still the queries' matches on the current tree, by
        two lookups per query instead of a search: present page-end depths form a prefix of
        each query's page ends (every page end of every tree path is in the table), so g is
        the match iff depth g is present (or g == 0) and depth g + P is absent (or past
        floorP(length)).

        Args:
            lengths: int64 [B] query lengths [tokens].
            guess: int64 [B] guessed matches (e.g. an earlier step's); rows with g < 0,
                g > floorP(length) or g not a multiple of P are not ok.
            h_guess, h_next: int64 [B], the queries' prefix hashes at depths g and g + P
                (`depth_hashes`), kept from when the guess was made: they depend on the
                tokens only, not on the tree.
            positions: optional int64 [B], the pool positions kept with the guesses (of
                token g - 1, from when the guess was made, with h_guess and h_next made for
                the same g: a guess changed without its hashes can pass this check where
                the lookups would not). On a CPU tree with deferred entries the host form
                then checks by positions (`_check_at_positions`: the table's reads would
                enter every deferred entry).
        Returns:
            (ok bool [B], position int64 [B]: pool position of the match's last token where
            ok and g > 0, else -1).
        """
        be = self._be(backend)
        P = self.P
        host = be == "torch" and _host(lengths)  # numpy views on the CPU: the same formulas
        if host and positions is not None and self._pend:
            ok, pos = self._check_at_positions(guess.numpy(), lengths.numpy() // P * P, h_guess.numpy(),
                                               h_next.numpy(), positions.numpy())
            return torch.from_numpy(ok), torch.from_numpy(pos)
        if host:
            g, Lq = guess.numpy(), lengths.numpy() // P * P
            found = self._lookup_host(np.concatenate([h_guess.numpy(), h_next.numpy()]))
        else:
            g, Lq = guess, lengths // P * P
            found = self.lookup(torch.cat([h_guess, h_next]), backend=be)
        B = g.shape[0]
        pos1, pos2 = found[:B], found[B:]
        ok = (g >= 0) & (g <= Lq) & (g % P == 0) & ((g == 0) | (pos1 >= 0)) & ((g + P > Lq) | (pos2 < 0))
        if host:
            return torch.from_numpy(ok), torch.from_numpy(np.where(ok & (g > 0), pos1, -1))
        return ok, torch.where(ok & (g > 0), pos1, torch.full_like(g, -1))

    def _check_at_positions(self, g: np.ndarray, Lq: np.ndarray, h1: np.ndarray, h2: np.ndarray,
                            p: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """`check_matches`' test on a CPU tree by the kept positions p (int64 [B]) instead of
        two lookups, in numpy (`_holds_at`'s test, row-wise): depth g is
        present at p if p is a live position whose prefix hash is h1 (a position a
        compaction moved, or reused by other tokens, fails: not ok, the caller searches);
        depth g + P is then present iff p's node goes on past p and its next page end's hash
        is h2, or, at a node's end or the root, a child's first page end (always in the
        table) has the key h2. The same answers as the lookups wherever this says ok.
        Returns (ok bool [B], position int64 [B])."""
        P = self.P
        owner, hsh, key_off, key_len = (self._np(a) for a in ("owner", "hsh", "key_off", "key_len"))
        has = g > 0
        ok = (g >= 0) & (g <= Lq) & (g % P == 0)
        pc = np.where(has & (p >= 0) & (p < owner.size), p, 0)
        X = owner[pc]
        live = has & (pc == p) & (X >= 0)
        ok &= ~has | (live & (hsh[pc] == h1))
        need = ok & (g + P <= Lq)
        inside = need & live & (pc + P <= key_off[np.maximum(X, 0)] + key_len[np.maximum(X, 0)] - 1)
        nxt = np.zeros(g.size, dtype=bool)
        nxt[inside] = hsh[pc[inside] + P] == h2[inside]
        at_end = need & ~inside
        if at_end.any():
            nxt[at_end] = self._probe_host(h2[at_end], raw=True) >= 0
        ok &= ~nxt
        return ok, np.where(ok & has, p, -1)

    def _holds_at(self, g: int, Lq: int, h1: int, h2: int, p: int, views=None) -> Tuple[bool, int]:
        """`_check_at_positions` for one row in Python ints (the admission's kept matches,
        row by row: `_ScalarMatcher.holds`): (ok, the position p where ok and g > 0, else -1).
        `views`: (owner, hsh, key_off, key_len) memoryviews (`_mv`) a caller holds already
        while the tree does not change (a window's rows, each checked: 4 lookups a row less)."""
        P = self.P
        if g < 0 or g > Lq or g % P:
            return False, -1
        owner, hsh, key_off, key_len = views or (self._mv("owner"), self._mv("hsh"), self._mv("key_off"),
                                                 self._mv("key_len"))
        X = -1
        if g > 0:
            if not 0 <= p < len(owner) or owner[p] < 0 or hsh[p] != h1:
                return False, -1
            X = owner[p]
        if g + P <= Lq:
            if X >= 0 and p + P <= key_off[X] + key_len[X] - 1:
                present = hsh[p + P] == h2  # inside p's node: its next page end
            else:  # at a node's end or the root: a child's first page end, always in the table
                present = self._probe_scalar(self._mv("_hk"), [h2])[0] >= 0
            if present:
                return False, -1
        return True, p if g > 0 else -1

    @staticmethod
    def _arity(n: int) -> int:
        """Points probed per row and search round: many while a round costs its fixed overhead
        (small batches: up to 63, i.e. 2 rounds for 4k chunks), two-way when the probes
        themselves dominate (large batches). About 1k probes per round balance the two on a
        CPU (a probe round costs ~0.5 ms, an absent key ~0.5 us)."""
        return max(1, min(63, 1024 // max(n, 1)))

    def _search(self, hi: torch.Tensor, key, arity: int, be: str = "torch") -> Tuple[torch.Tensor, torch.Tensor]:
        """Per row i, the largest j in [0, hi[i]] whose hash key(i, j) is in the table (j = 0 is
        always present) and the stored position (-1 for 0). Presence is monotone in j (every page
        end of every tree path is entered), so a round probes `arity` points spread over each
        row's open interval and keeps the part between the last hit and the first miss; rows
        drop out once their interval is closed. On CPU tensors the rounds run as numpy calls
        (`_search_host`)."""
        if _host(hi):
            return self._search_host(hi.numpy(), key, arity)
        lo = torch.zeros_like(hi)
        lo_pos = torch.full_like(hi, -1)
        hi = hi.clone()
        act = torch.nonzero(hi > 0).flatten()
        j = torch.arange(1, arity + 1, device=hi.device)
        while act.numel():
            L, span = lo[act], hi[act] - lo[act]
            pts = L[:, None] + (span[:, None] * j + arity) // (arity + 1)  # in [L + 1, hi], ascending
            rows = act[:, None].expand(-1, arity)
            pos = self.lookup(key(rows.reshape(-1), pts.reshape(-1)), backend=be).reshape(-1, arity)
            found = pos >= 0
            cnt = torch.cumprod(found.to(torch.int8), 1).sum(1)  # leading hits
            got = cnt > 0
            r = torch.arange(act.numel(), device=hi.device)
            last = (cnt - 1).clamp(min=0)
            new_lo = torch.where(got, pts[r, last], L)
            lo_pos[act] = torch.where(got, pos[r, last], lo_pos[act])
            new_hi = torch.where(cnt < arity, pts[r, cnt.clamp(max=arity - 1)] - 1, hi[act])
            lo[act], hi[act] = new_lo, new_hi
            act = act[new_lo < new_hi]
        return lo, lo_pos

    def _search_host(self, hi: np.ndarray, key, arity: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """`_search`'s rounds on host arrays, step for step (the same points, hits and
        intervals): each round's ~20 ops are numpy calls of 1-3 us instead of torch CPU ops of
        5-15 us, and the probes go through `_lookup_host`; `key` is still called with CPU
        tensors (one gather). A Mooncake insert (one sequence, ~12k tokens, 2-3 rounds) spent
        about 2 ms here in torch ops. Returns (lo, lo_pos) int64 tensors [B]."""
        B = hi.size
        hi = hi.astype(np.int64, copy=True)
        lo = np.zeros(B, dtype=np.int64)
        lo_pos = np.full(B, -1, dtype=np.int64)
        act = np.flatnonzero(hi > 0)
        j = np.arange(1, arity + 1, dtype=np.int64)
        while act.size:
            L = lo[act]
            span = hi[act] - L
            pts = L[:, None] + (span[:, None] * j + arity) // (arity + 1)  # in [L + 1, hi], ascending
            rows = np.repeat(act, arity)
            h = key(torch.from_numpy(rows), torch.from_numpy(pts.reshape(-1))).numpy()
            pos = self._lookup_host(h).reshape(-1, arity)
            cnt = np.logical_and.accumulate(pos >= 0, axis=1).sum(1)  # leading hits
            got = cnt > 0
            r = np.arange(act.size)
            last = np.maximum(cnt - 1, 0)
            new_lo = np.where(got, pts[r, last], L)
            lo_pos[act] = np.where(got, pos[r, last], lo_pos[act])
            new_hi = np.where(cnt < arity, pts[r, np.minimum(cnt, arity - 1)] - 1, hi[act])
            lo[act], hi[act] = new_lo, new_hi
            act = act[new_lo < new_hi]
        return torch.from_numpy(lo), torch.from_numpy(lo_pos)

    def _search_static(self, hi: torch.Tensor, key, bound: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """`_search` as bit_length(bound) binary rounds over every row (hi <= bound): the same
        answer (presence is monotone) with no host read; closed rows probe a dummy point."""
        lo = torch.zeros_like(hi)
        lo_pos = torch.full_like(hi, -1)
        rows = torch.arange(hi.numel(), device=hi.device)
        for _ in range(max(int(bound), 0).bit_length()):
            open_ = lo < hi
            mid = torch.where(open_, (lo + hi + 1) // 2, 1)
            pos = self._lookup_static(key(rows, mid))
            got = open_ & (pos >= 0)
            lo_pos = torch.where(got, pos, lo_pos)
            lo = torch.where(got, mid, lo)
            hi = torch.where(open_ & ~got, mid - 1, hi)
        return lo, lo_pos

    def _lookup_static(self, h: torch.Tensor) -> torch.Tensor:
        """`lookup` (torch) over fixed probe windows: every key reads max_probe slots from its
        home slot and stops at its first slot holding it or EMPTY (as the probing loop does)."""
        H = self.hkeys.numel()
        out = torch.full_like(h, -1)
        if h.numel() == 0 or self.max_probe <= 0:
            return out
        cols = (home_slot(h, H)[:, None] + torch.arange(self.max_probe, device=h.device)) & (H - 1)
        k = gather(self.hkeys, cols)
        hit = k == h[:, None]
        first = (hit | (k == EMPTY)).to(torch.int8).argmax(1, keepdim=True)
        found = hit.gather(1, first)[:, 0]
        slot = cols.gather(1, first)[:, 0]
        return torch.where(found, gather(self.hvals, slot), out)

    def find_static(self, tok: torch.Tensor, tok_start: torch.Tensor, lengths: torch.Tensor, ns: torch.Tensor,
                    ch: torch.Tensor, ch_start: torch.Tensor, max_len: int, *, cap: Optional[torch.Tensor] = None,
                    valid: Optional[torch.Tensor] = None, out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
                    backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Matched length and last pool position (R-RC-4, no splits or stamps) of B queries in
        CSR form, with static shapes and no host read: a CUDA graph can hold it.

        Args:
            tok: int32 [T] token pool; ch: int64 [K] chunk-hash pool (as `match_csr`).
            tok_start, lengths, ns, ch_start: int64 [B]; each query's length (after `cap` and
                `valid`) <= max_len [tokens].
            max_len: bound on every length (fixes the number of search rounds).
            cap: int64 [B] or None: query i is min(lengths[i], cap[i]) clamped at 0 tokens
                (R-STEP-3.4's max_prefix_len cap).
            valid: bool [B] or None: query i is empty where valid[i] is False (padding).
            out: (matched, position) int64 [B] buffers to write, else new tensors.
        Returns:
            (matched int64 [B] [tokens, multiples of P], position int64 [B], -1 for none).
        On backend "triton" the capping, the padding and the chunk counts are read in the one
        search launch (`kernels.radix.find_static`); the torch form forms them first.
        """
        be = self._be(backend)
        if be == "triton":
            return self._kernels().find_static(
                tok, tok_start, lengths, ns, ch, ch_start, self.hkeys, self.hvals, page_size=self.P,
                chunk_pages=self.chunk_pages, B1=self.B1, B2=self.B2, max_probe=self.max_probe, cap=cap,
                valid=valid, out=out)
        if cap is not None:
            lengths = torch.minimum(lengths, cap).clamp(min=0)
        if valid is not None:
            lengths = torch.where(valid, lengths, 0)
        count = lengths // self.C
        m, pos = self._find_csr(tok, tok_start, lengths, lengths, ns, ch, ch_start, count, int(max_len) // self.C,
                                be, static=True)
        if out is None:
            return m, pos
        out[0].copy_(m)
        out[1].copy_(pos)
        return out

    def path_position(self, m: torch.Tensor, pos: torch.Tensor, d: torch.Tensor,
                      nodes: bool = False):
        """Pool position of the last token at depth d of matched paths: row i's path is the
        match (m[i] tokens, last token at pool position pos[i]) and 0 <= d[i] <= m[i]; -1 where
        d[i] == 0. It is what a match capped at d[i] returns (the position stored for that page
        end), read off the path: within the last node by offset, else a few parent steps
        (a host read per level climbed). int64 [B] each.

        nodes=True also returns the node holding that token and how many of its tokens the
        capped path covers (1..key_len; the node 0 and 0 where d[i] == 0): (pos, node, cover),
        what locking the capped match reads (`gpu_sched.admission.lock_drops`). On CPU tensors
        (`policy._host`) the same steps run as numpy calls, climbing only the rows that need it."""
        if _host(m):
            out = _path_position_host(self._np("owner"), self._np("key_off"), self._np("key_len"),
                                      self._np("parent"), m.numpy(), pos.numpy(), d.numpy())
            out = tuple(torch.from_numpy(x) for x in out)
            return out if nodes else out[0]
        has = m > 0
        X = torch.where(has, gather(self.owner, pos.clamp(min=0)), 0)
        start = torch.where(has, m - (pos - self.key_off[X] + 1), 0)  # depth where node X begins
        need = (d > 0) & (d <= start)
        while bool(need.any()):
            X = torch.where(need, self.parent[X], X)
            start = torch.where(need, start - self.key_len[X], start)
            need = (d > 0) & (d <= start)
        on = d > 0
        p = torch.where(on, self.key_off[X] + (d - start) - 1, torch.full_like(d, -1))
        if not nodes:
            return p
        return p, torch.where(on, X, 0), torch.where(on, d - start, 0)

    def match(self, tokens: torch.Tensor, lengths: torch.Tensor, ns: torch.Tensor,
              chunk_hashes: Optional[torch.Tensor] = None, *,
              backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Batched R-RC-4 match, equal to matching the queries one by one in batch order.

        Args:
            tokens: int32 [B, L] padded queries (values past a query's length are ignored).
            lengths: int64 [B] query lengths [tokens] (floored to P inside).
            ns: int64 [B] namespace ids.
            chunk_hashes: optional int64 [B, L // C] from `prefix_hashes(..., every=C)`,
                precomputed once per request so that matching cost does not grow with length.
            backend: "torch" or "triton" for this call (default: the tree's).
        Returns:
            (matched int64 [B] [tokens, multiples of P], last_node int64 [B]).
        """
        be = self._be(backend)
        if (tokens.shape[0] == 1 and chunk_hashes is None and SCALAR_BATCH >= 1 and self._host_form(be)
                and tokens.is_cpu and lengths.is_cpu and ns.is_cpu):
            # one query on a CPU tree (the engine's match_prefix): its chunk hashes by the host
            # sums and its match by the scalar binary searches (`_find_scalar`), then `_apply`
            # (its walks): no array search
            L, q = int(lengths[0]), int(ns[0])
            t = tokens.numpy()[0, :L]
            if self._pend:  # deferred entries: the walk (the hash search would enter them all)
                m, pos = self._walk_scalar(t, L, q)[:2]
            else:
                ch = self._chunk_hashes_flat_host(t, np.array([L]), np.array([q]), self.C)
                m, pos = self._find_scalar(t, ch, 0, 0, L, q)[:2]
            return self._apply(torch.tensor([m]), torch.tensor([pos]), be)
        m, pos = self._find(tokens, lengths.to(torch.int64), ns.to(torch.int64), chunk_hashes, be)
        return self._apply(m, pos, be)

    def match_csr(self, tokens: torch.Tensor, token_offsets: torch.Tensor, lengths: torch.Tensor,
                  ns: torch.Tensor, chunk_hashes: torch.Tensor, chunk_offsets: torch.Tensor, *,
                  backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """`match` for queries stored as a flat token pool (the request table's CSR form): no
        [B, max L] padding, and rows may share storage.

        Args:
            tokens: int32 [T]; query i is tokens[token_offsets[i] : token_offsets[i] + lengths[i]].
            token_offsets, lengths, ns: int64 [B].
            chunk_hashes: int64 [K]; query i's boundary hashes at depths C, 2C, ... (its
                `prefix_hashes(t[None], len, ns, every=C)[0]`, lengths[i] // C of them) start at
                chunk_offsets[i] (int64 [B]).
        Returns:
            as `match`.
        """
        be = self._be(backend)
        lengths = lengths.to(self.device, torch.int64)
        count = lengths // self.C
        max_count = int(count.max()) if count.numel() else 0
        m, pos = self._find_csr(tokens.to(self.device, torch.int32), token_offsets.to(self.device, torch.int64),
                                lengths, lengths, ns.to(self.device, torch.int64),
                                chunk_hashes.to(self.device, torch.int64),
                                chunk_offsets.to(self.device, torch.int64), count, max_count, be)
        return self._apply(m, pos, be)

    def _apply(self, m: torch.Tensor, pos: torch.Tensor, be: str = "torch", stamp: Optional[torch.Tensor] = None,
               cid: Optional[torch.Tensor] = None, ends=None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Splits and stamps of a batch whose matches (m, pos) were found on the old tree.

        Row i stamps with stamp[i] and a split it makes gets creation id cid[i]; by default the
        next B clock values and creation ids (the caller that passes them advances the counters).
        `ends`: `_match_ends(m, pos)` when the caller has it already (not computed again; a
        small host batch then skips the walks, which its caller tried)."""
        B = m.numel()
        dev = self.device
        host = be == "torch" and _host(m)
        cid0, lazy_cid = self.next_cid, False

        def default_cid() -> torch.Tensor:  # this call's creation ids, made when first read
            return torch.from_numpy(np.arange(cid0, cid0 + B, dtype=np.int64))

        if stamp is None:
            if host:  # numpy's arange and a view: a torch op less; the creation ids made when read
                stamp = torch.from_numpy(np.arange(self.clock + 1, self.clock + 1 + B, dtype=np.int64))
                lazy_cid = True
            else:
                stamp = torch.arange(self.clock + 1, self.clock + 1 + B, device=dev)
                cid = torch.arange(self.next_cid, self.next_cid + B, device=dev)
            self.clock += B
            self.next_cid += B
        if lazy_cid and B <= SCALAR_BATCH:  # the scalar form reads them
            cid = default_cid()
        if B <= SCALAR_BATCH and host and ends is None:  # (`_apply_host` hands ends after trying the walks)
            last = self._apply_scalar(m, pos, stamp, cid)
            if last is not None:
                return m, last
        X, idx = self._match_ends(m, pos) if ends is None else ends
        if idx.numel():
            if lazy_cid and cid is None:  # splits read them
                cid = default_cid()
            has = m > 0
            # A request ending where an earlier one of the batch ends finds that cut made: drop it.
            p = pos[idx]
            o = torch.argsort(p * (B + 1) + idx)  # positions are unique across nodes
            idx, p = idx[o], p[o]
            keep = torch.ones_like(idx, dtype=torch.bool)
            keep[1:] = p[1:] != p[:-1]
            idx = idx[keep]
            # rank of each request among those ending inside the same original node
            idx = idx[torch.argsort(X[idx] * (B + 1) + idx)]
            Xs = X[idx]
            first = torch.ones_like(Xs, dtype=torch.bool)
            first[1:] = Xs[1:] != Xs[:-1]
            ar = torch.arange(idx.numel(), device=dev)
            rank = ar - torch.cummax(torch.where(first, ar, torch.zeros_like(ar)), 0).values
            # round r applies every rank-r split (in node order): one stable sort, then slices
            idx = idx[torch.sort(rank, stable=True).indices]
            start = 0
            for size in torch.bincount(rank).tolist():
                sel = idx[start : start + size]
                start += size
                self._split_round(sel, pos[sel], stamp[sel], cid[sel], be)
            last = torch.where(has, gather(self.owner, pos.clamp(min=0)), torch.zeros_like(m))  # after the cuts
        else:
            last = X
        self._stamp_paths(last, stamp, be)
        return m, last

    def _apply_host(self, m: np.ndarray, pos: np.ndarray, walked: bool = False) -> np.ndarray:
        """`_apply(m, pos)` (this call's own stamps and creation ids) on a CPU tree with numpy in
        and out: the last nodes, int64 [B]. A batch of at most SCALAR_BATCH that splits at most
        one node takes the walks on Python lists (`_apply_walks_next`, as `_apply_scalar`
        would within `_apply`; `walked`: the caller tried them already). A batch whose matches
        all end at their node's end (no split: the usual step) takes no torch op: the same
        clock and creation-id advance and the same stamp walk (`_stamp_paths_host`) as
        `_apply` (a torch call right after other work costs 20-35 us, against 5-9 us for a
        numpy call: `benchmarks/bench_cold.py`); any other batch goes through `_apply`'s
        rounds, handed the match ends found here. m, pos: int64 [B] match lengths and last
        pool positions."""
        B = m.size
        if B <= SCALAR_BATCH and not walked:  # without `_apply`'s tensors (~40 us of torch calls for one row)
            last = self._apply_walks_next(m.tolist(), pos.tolist())
            if last is not None:
                return np.array(last, dtype=np.int64)
        # a small batch here splits two or more nodes (the walks changed nothing)
        X, interior = self._match_ends_host(m, pos)
        if not interior.any():
            stamp = np.arange(self.clock + 1, self.clock + 1 + B, dtype=np.int64)
            self.clock += B
            self.next_cid += B
            b = self.node_bound()  # every live id is below it
            _stamp_paths_host(self._np("parent")[:b], self._np("last_access")[:b], X, stamp)
            return X
        ends = (torch.from_numpy(X), torch.from_numpy(np.flatnonzero(interior)))  # `_apply` skips the walks
        return self._apply(torch.from_numpy(m), torch.from_numpy(pos), "torch", ends=ends)[1].numpy()

    def _apply_walks_next(self, m: List[int], pos: List[int]) -> Optional[List[int]]:
        """`_apply_walks` with the batch's own stamps and creation ids (the next len(m) of
        each), advanced when it applies; None, having changed nothing, as there."""
        B = len(m)
        last = self._apply_walks(m, pos, range(self.clock + 1, self.clock + 1 + B),
                                 range(self.next_cid, self.next_cid + B))
        if last is not None:
            self.clock += B
            self.next_cid += B
        return last

    def _apply_scalar(self, m: torch.Tensor, pos: torch.Tensor, stamp: torch.Tensor,
                      cid: torch.Tensor) -> Optional[torch.Tensor]:
        """`_apply` for a few matches on the CPU that split at most one node: `_apply_walks` on
        the tensors' values. Returns the last nodes (int64 [B]), or None, having changed
        nothing, when the matches would split more than one node."""
        last = self._apply_walks(m.tolist(), pos.tolist(), stamp.tolist(), cid.tolist())
        return None if last is None else torch.tensor(last, dtype=torch.int64)

    def _apply_walks(self, m: List[int], pos: List[int], stamps, cids) -> Optional[List[int]]:
        """`_apply` of a few matches in Python on memoryviews (`_mv`): the nodes holding their last
        tokens (`_match_ends`; 0 where m is 0), at most one split, then the stamp walks
        (`_stamp_walks`). The split is `_apply`'s single round: the first row ending at the one
        interior position cuts its node there (`_split_host`, that row's stamp and creation
        id); later rows ending there find the cut made. None, having changed nothing, when the
        rows end inside nodes at two or more positions (the batched form orders those splits'
        node ids by rounds)."""
        owner, key_off, key_len = self._mv("owner"), self._mv("key_off"), self._mv("key_len")
        last, cut = [], None
        for i, (mi, p) in enumerate(zip(m, pos)):
            if mi <= 0:
                last.append(0)
                continue
            x = owner[p]
            if p - key_off[x] + 1 < key_len[x]:
                if cut is None:
                    cut = (i, p, x)
                elif cut[1] != p:
                    return None
            last.append(x)
        if cut is not None:
            i, p, x = cut
            head = self._split_host(x, p - key_off[x] + 1, stamps[i], cids[i])
            last = [head if (mi > 0 and q == p) else v for mi, q, v in zip(m, pos, last)]
        _stamp_walks(self._mv("parent"), self._mv("last_access"), last, stamps)
        return last

    def _split_host(self, piece: int, cover: int, stamp: int, cid: int) -> int:
        """`_split_writes` of one piece on a CPU tree, on its arrays' views (memoryviews for
        the per-node values, `_mv`; numpy for the owner run): a new head node takes
        the first `cover` tokens of node `piece` (stamp and creation id `cid`). Returns the
        head's id."""
        (head,) = self._alloc_ids(1)
        v = self._mv
        for name in ("parent", "key_off", "start", "lock_ref", "order", "ns"):
            a = v(name)
            a[head] = a[piece]
        v("key_len")[head] = cover
        v("last_access")[head] = stamp
        v("cid")[head] = cid
        v("nchild")[head] = 1
        v("alive")[head] = True
        o = v("key_off")[piece]
        self._np("owner")[o : o + cover] = head
        v("key_off")[piece] = o + cover
        v("key_len")[piece] -= cover
        v("start")[piece] += cover
        v("parent")[piece] = head
        la = v("last_access")
        la[piece] = max(la[piece], stamp)
        self._enter_heads([piece])
        return head

    def _apply_list(self, m: List[int], pos: List[int], backend: Optional[str] = None) -> List[int]:
        """`_apply` (splits and stamps, the next len(m) clock values and creation ids) of a
        batch given as Python lists of matched lengths [tokens] and last pool positions; returns
        the last nodes as a list. On a CPU tree with the torch backend (the call's `backend`,
        else the tree's) a few matches that split at most one node take the walks
        (`_apply_walks_next`: no tensor) and the rest `_apply_host`; on other trees `_apply`."""
        if self._host_form(backend):
            if len(m) <= SCALAR_BATCH:
                last = self._apply_walks_next(m, pos)
                if last is not None:
                    return last
            return self._apply_host(np.array(m, dtype=np.int64), np.array(pos, dtype=np.int64), walked=True).tolist()
        t = torch.tensor([m, pos], dtype=torch.int64).to(self.device)
        return self._apply(t[0], t[1], self._be(backend))[1].tolist()

    def _match_ends(self, m: torch.Tensor, pos: torch.Tensor,
                    host: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(X, idx) of a batch of matches (lengths m, last pool positions pos; int64 [B]): the node
        holding each match's last token (0 = root where m is 0) and the rows whose match ends
        inside its node (a sequential match would split there), int64. `host` (default: CPU
        tensors, `policy._host`): as numpy calls on views of the tree's arrays (several times
        cheaper per call than torch's), else as torch ops."""
        if _host(m) if host is None else host:
            X, interior = self._match_ends_host(m.numpy(), pos.numpy())
            return torch.from_numpy(X), torch.from_numpy(np.flatnonzero(interior))
        has = m > 0
        X = torch.where(has, gather(self.owner, pos.clamp(min=0)), torch.zeros_like(m))
        cover = pos - self.key_off[X] + 1
        return X, torch.nonzero(has & (cover < self.key_len[X])).flatten()

    def _match_ends_host(self, m: np.ndarray, pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """`_match_ends` on numpy (a CPU tree's views): the node holding each match's last token
        (int64 [B], 0 where m is 0) and whether the match ends inside it (bool [B])."""
        has, X = _match_nodes_host(self._np("owner"), m, pos)
        return X, has & (pos - self._np("key_off").take(X, mode="clip") + 1 < self._np("key_len").take(X, mode="clip"))

    def _split_round(self, req: torch.Tensor, pos: torch.Tensor, stamp: torch.Tensor, cid: torch.Tensor,
                     be: str = "torch") -> None:
        piece = self.owner[pos]
        cover = pos - self.key_off[piece] + 1
        cut = cover < self.key_len[piece]  # else an earlier request already cut here
        piece, cover, stamp, cid = piece[cut], cover[cut], stamp[cut], cid[cut]
        n = piece.numel()
        if n == 0:
            return
        head = self._alloc_nodes(n)
        self._split_writes(piece, cover, stamp, cid, head, be)
        if self._pend:  # the tails' first page ends (deferred on a CPU tree) entered
            self._enter_heads(piece.tolist())

    def _node_arrays(self) -> List[torch.Tensor]:
        return [self.parent, self.key_off, self.key_len, self.start, self.lock_ref, self.last_access, self.cid,
                self.order, self.ns, self.nchild]

    def _split_writes(self, piece, cover, stamp, cid, head, be: str = "torch") -> None:
        """Cut each piece (distinct nodes) after `cover` tokens: `head` takes the front."""
        if be == "triton":
            self._kernels().split_apply(piece.contiguous(), cover.contiguous(), stamp.contiguous(),
                                        cid.contiguous(), head.contiguous(), self._node_arrays(), self.alive,
                                        self.owner)
            return
        self.parent[head] = self.parent[piece]
        self.key_off[head] = self.key_off[piece]
        self.key_len[head] = cover
        self.start[head] = self.start[piece]
        self.lock_ref[head] = self.lock_ref[piece]
        self.last_access[head] = stamp
        self.cid[head] = cid
        self.order[head] = self.order[piece]
        self.ns[head] = self.ns[piece]
        self.nchild[head] = 1
        self.alive[head] = True
        total = int(cover.sum())
        if self._on_cpu and total >= 64 * piece.numel():
            # long heads: one slice fill each beats building `total`-long index arrays
            for o, c, hd in zip(self.key_off[piece].tolist(), cover.tolist(), head.tolist()):
                self.owner[o : o + c] = hd
        else:
            rep = lambda x: torch.repeat_interleave(x, cover, output_size=total)  # noqa: E731
            rng = torch.arange(total, device=self.device) + rep(self.key_off[piece] - (torch.cumsum(cover, 0) - cover))
            self.owner[rng] = rep(head)
        self.key_off[piece] += cover
        self.key_len[piece] -= cover
        self.start[piece] += cover
        self.parent[piece] = head
        self.last_access[piece] = torch.maximum(self.last_access[piece], stamp)

    def _stamp_paths(self, nodes: torch.Tensor, stamp: torch.Tensor, be: str = "torch") -> None:
        """last_access = max(last_access, stamp[i]) on the path nodes[i]..root, for every i.

        Start nodes are first merged (per node the largest stamp: the same maxima on every
        path), then a walk stops at a node already holding a larger stamp: that stamp is this batch's (older
        stamps are smaller than every stamp of the batch) and whoever wrote it walks on to the
        root, or wrote it at a split under its own path (the head's creator starts at the head),
        so the nodes above end with the same maxima. Stamps of one batch are distinct. On the
        CPU the walk runs on numpy views of the node arrays (`_stamp_paths_host`), elsewhere as
        torch ops (`_stamp_paths_walk`)."""
        if be == "triton":
            self._kernels().stamp_paths(nodes.contiguous(), stamp.contiguous(), self.parent, self.last_access)
            return
        if _host(nodes):
            if nodes.numel() <= SCALAR_BATCH:
                _stamp_walks(self._mv("parent"), self._mv("last_access"), nodes.tolist(), stamp.tolist())
                return
            b = self.node_bound()  # every live id is below it
            _stamp_paths_host(self._np("parent")[:b], self._np("last_access")[:b], nodes.numpy(), stamp.numpy())
            return
        self._stamp_paths_walk(nodes, stamp)

    def _stamp_paths_walk(self, nodes: torch.Tensor, stamp: torch.Tensor) -> None:
        """`_stamp_paths` as torch ops on the tree's device: one compaction per level."""
        if nodes.numel() > 64:  # many requests, few distinct last nodes: walk each node once
            best = torch.full((self.node_bound(),), INT64_MIN, dtype=stamp.dtype, device=stamp.device)
            best.scatter_reduce_(0, nodes, stamp, reduce="amax")
            nodes = torch.nonzero(best != INT64_MIN).flatten()
            stamp = best[nodes]
        cur = nodes.clone()
        while cur.numel():
            # one compaction per level (a host read on CUDA): stopped walks scatter the
            # smallest int64, which changes no maximum
            go = self.last_access[cur] <= stamp
            self.last_access.scatter_reduce_(0, cur, torch.where(go, stamp, INT64_MIN), reduce="amax")
            nxt = self.parent[cur]
            keep = torch.nonzero(go & (nxt >= 0)).flatten()
            cur, stamp = nxt[keep], stamp[keep]

    # ---- insert (R-RC-5) -------------------------------------------------------------------
    def insert(self, tokens: torch.Tensor, values: torch.Tensor, ns: int = 0, *, known: int = 0,
               known_node: Optional[int] = None, backend: Optional[str] = None) -> int:
        """Insert one sequence (int32 tokens [L], int64 KV slots [L]) in namespace `ns`.

        Returns the length already present [tokens] (R-RC-5); only floorP(L) tokens enter.
        Raises MemoryError when node or token capacity is exhausted (before changing anything).
        `known`, `known_node`: the caller's word that the first `known` tokens are cached as the
        path root..known_node in namespace `ns` (a finished request's locked prefix): on a CPU
        tree only the tokens after it are hashed and searched (other paths ignore it). Only the
        node's end depth is checked (`_known_prefix`): a hint that is not a live node ending at
        depth `known`, a multiple of P within the sequence, is ignored; one naming another path
        that ends at that depth gives wrong results. The result and effects are the same with a
        hint or without.
        """
        be = self._be(backend)
        if self._single_host(tokens, values, be):
            return self._insert_single_host(tokens, values, ns, known, known_node)[0]
        return self.insert_many([tokens], [values], [ns], backend=be)[0]

    def _single_host(self, tokens: torch.Tensor, values: torch.Tensor, be: str) -> bool:
        """Whether one sequence is inserted on the host (`_insert_single_host`): a CPU tree
        with the torch backend outside `torch_forms()`, CPU tensors."""
        L = int(tokens.numel()) // self.P * self.P
        return (SCALAR_BATCH >= 1 and self._host_form(be) and tokens.is_cpu and values.is_cpu
                and values.numel() >= L)

    def _insert_single_host(self, tokens: torch.Tensor, values: torch.Tensor, ns: int, known: int = 0,
                            known_node: Optional[int] = None) -> Tuple[int, int]:
        """One sequence's insert without a tensor op (the padded batch form costs ~15 small
        torch ops): its prefix hashes at every depth after the known cached prefix (continuing
        from the hash stored at its end; from the namespace seed without one), then
        `_insert_one_host`. Returns its (present length, end position)."""
        L = int(tokens.numel()) // self.P * self.P
        t = tokens.numpy()[:L].astype(np.int32, copy=False)
        c, cpos = self._known_prefix(known, known_node, L)
        self._ensure_pow(max(L - c, 1) + 1)
        h = np.zeros(L, dtype=np.int64)  # h[:c] is not read
        if L > c:  # one row's bases (`_bases_host`) as Python ints: no numpy call on one-element arrays
            if c:
                hv = self._mv("hsh")[cpos]
                bases = [hv >> 31, hv & (2**31 - 1)]
            else:
                bases = [self._seed(int(ns), P1), self._seed(int(ns), P2)]
            h[c:] = self._window_hashes_host(t[None, c:].astype(np.int64) + 1, np.arange(1, L - c + 1, dtype=np.int64),
                                             bases)[0]
        return self._insert_one_host(t, values.numpy()[:L], h, int(ns), c, cpos)

    def insert_and_match(self, tokens: torch.Tensor, values: torch.Tensor, ns: int = 0, *,
                         known: int = 0, known_node: Optional[int] = None,
                         backend: Optional[str] = None) -> Tuple[int, int, int]:
        """`insert` of one sequence, then `match` of the same tokens (R-RC-5, then R-RC-4: a
        chunked request's prefilled part cached and its lock moved, R-DEC-3), with the same
        effects and results as the two calls. After the insert every page of the sequence is
        present, so the match is floorP(L) tokens ending at a pool position the insert knows:
        on a CPU tree the match skips its hashes and search and only applies (splits, stamps).
        `known`, `known_node`: `insert`'s hint (a request's locked prefix, which cannot be
        evicted): a long prompt's chunks would otherwise hash their whole prefix again at every
        chunk. Returns (present length before the insert [tokens], matched length [tokens], last
        node id)."""
        be = self._be(backend)
        L = int(tokens.numel()) // self.P * self.P
        if self._single_host(tokens, values, be):
            present, end = self._insert_single_host(tokens, values, ns, known, known_node)
            # one match: the walks, no tensor (~10 against ~40 us a call for `_apply`'s)
            return present, L, self._apply_list([L], [end], be)[0]
        present = self.insert(tokens[:L], values[:L], ns, backend=be)
        m, last = self.match(tokens[None], torch.tensor([int(tokens.numel())], device=self.device),
                             torch.tensor([int(ns)], device=self.device), backend=be)
        return present, int(m[0]), int(last[0])

    def _known_prefix(self, known: int, node: Optional[int], L: int) -> Tuple[int, int]:
        """(c, pool position of token c - 1) for a known cached prefix of c tokens ending at
        node `node` (`insert_and_match`'s hint), or (0, -1) when there is none or the node is
        not a live node ending at depth `known` (a multiple of P, at most L)."""
        if not known or node is None or not ROOT < node < self.max_nodes or known % self.P or known > L:
            return 0, -1
        key_len = self._mv("key_len")[node]
        if not self._mv("alive")[node] or self._mv("start")[node] + key_len != known:
            return 0, -1
        return known, self._mv("key_off")[node] + key_len - 1

    def insert_many(self, tokens: Sequence[torch.Tensor], values: Sequence[torch.Tensor], ns: Sequence[int], *,
                    backend: Optional[str] = None) -> List[int]:
        """Insert several sequences, equal to inserting them one by one in order (R-RC-5).

        Sequences whose first pages differ (or whose namespaces do) touch disjoint subtrees, so
        a run of them is one wave: the present lengths of the whole wave come from one search,
        its splits and stamps from one `_apply` (insert i stamps with the clock value the i-th
        single insert would take, and takes its creation ids and child order in the same
        sequence), its new leaves are written and entered in the hash table together. A sequence
        that shares its first page with an earlier one of the wave starts the next wave.

        Returns the present length of each [tokens]. Raises MemoryError when node or token
        capacity would run out in a wave (before changing anything in that wave; the node check
        counts a possible split for every sequence).
        """
        be = self._be(backend)
        dev, P = self.device, self.P
        B = len(tokens)
        if B == 0:
            return []
        if B == 1 and self._single_host(tokens[0], values[0], be):  # one sequence on a CPU tree
            return [self._insert_single_host(tokens[0], values[0], ns[0])[0]]
        lens = [int(t.numel()) // P * P for t in tokens]
        Lmax = max(lens + [1])
        tok = torch.zeros((B, Lmax), dtype=torch.int32, device=dev)
        val = torch.zeros((B, Lmax), dtype=torch.int64, device=dev)
        for i, (t, v, n) in enumerate(zip(tokens, values, lens)):
            tok[i, :n] = t[:n].to(dev, torch.int32)
            val[i, :n] = v[:n].to(dev, torch.int64)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
        nsv = torch.as_tensor(list(ns), dtype=torch.int64).to(dev)
        full_h = self.prefix_hashes(tok, lens_t, nsv, 1)  # [B, Lmax]
        first = full_h[:, P - 1].tolist() if Lmax >= P else [0] * B
        out: List[int] = []
        i = 0
        while i < B:
            seen, j = set(), i
            while j < B and not (lens[j] >= P and first[j] in seen):
                if lens[j] >= P:
                    seen.add(first[j])
                j += 1
            out.extend(self._insert_wave(tok[i:j], val[i:j], lens_t[i:j], nsv[i:j], full_h[i:j], be))
            i = j
        return out

    def _insert_wave(self, tok, val, lens, nsv, full_h, be: str) -> List[int]:
        """insert_many for W sequences with pairwise different first pages (disjoint subtrees)."""
        dev, P = self.device, self.P
        W, Lmax = tok.shape
        if W == 1 and SCALAR_BATCH >= 1 and self._host_form(be):  # off with the other walks when SCALAR_BATCH < 1
            L = int(lens[0])
            return [self._insert_one_host(tok.numpy()[0, :L], val.numpy()[0, :L], full_h.numpy()[0, :L], int(nsv[0]))[0]]
        self.version = next(_VERSIONS)
        npg = Lmax // P
        pe = full_h[:, P - 1 :: P][:, :npg].reshape(-1)  # page-end hashes, row-major [W * npg]
        arity = 255 if W == 1 else max(self._arity(W), 15)
        k, kpos = self._search(lens // P, lambda rows, q: pe[rows * npg + q - 1], arity, be)
        m = k * P
        new = lens - m
        leaf = new > 0
        n_leaf = int(leaf.sum())
        n_new = int(new.sum())
        if n_leaf:
            if len(self._free_nodes) < W + n_leaf:
                raise MemoryError(f"radix tree node capacity {self.max_nodes} exhausted")
            if self.top + n_new > self.token_capacity and self._live_tokens() + n_new > self.token_capacity:
                raise MemoryError(f"radix tree token capacity {self.token_capacity} exhausted")
        # counters as W single inserts take them: insert r stamps clock + 1 + r; its split (if
        # any) takes one creation id and its leaf (if any) the next one and the next child order
        li = leaf.to(torch.int64)
        before = torch.cumsum(li, 0) - li  # leaves of earlier rows of the wave
        r = torch.arange(W, device=dev)
        stamp = self.clock + 1 + r
        head_cid = self.next_cid + r + before
        self.clock += W
        self.next_cid += W + n_leaf
        order0 = self.next_order
        self.next_order += n_leaf
        _, last = self._apply(m, kpos, be, stamp, head_cid)
        if n_leaf == 0:
            return m.tolist()
        off = self._alloc_tokens(n_new)
        rows = torch.nonzero(leaf).flatten()
        ids = self._alloc_nodes(n_leaf)
        ln = new[rows]
        start = off + torch.cumsum(ln, 0) - ln  # pool offset of each new leaf
        rep = lambda x: torch.repeat_interleave(x, ln, output_size=n_new)  # noqa: E731
        within = torch.arange(n_new, device=dev) - rep(start - off)
        src_r, src_c = rep(rows), rep(m[rows]) + within
        dst = off + torch.arange(n_new, device=dev)
        self.tok[dst] = tok[src_r, src_c]
        self.val[dst] = val[src_r, src_c]
        self.hsh[dst] = full_h[src_r, src_c]
        self.owner[dst] = rep(ids)
        par = last[rows]
        self.parent[ids] = par
        self.key_off[ids] = start
        self.key_len[ids] = ln
        self.start[ids] = m[rows]
        self.lock_ref[ids] = 0
        self.last_access[ids] = stamp[rows]
        self.cid[ids] = head_cid[rows] + 1
        self.order[ids] = order0 + before[rows]
        self.ns[ids] = nsv[rows]
        self.nchild[ids] = 0
        self.nchild.index_add_(0, par, torch.ones_like(par))
        self.alive[ids] = True
        page_ends = dst[(src_c % P) == P - 1]
        self._table_insert(self.hsh[page_ends], page_ends, be, positions=True)
        self._log_change(self.hsh[page_ends])
        self.evictable_size += n_new
        return m.tolist()

    def _insert_one_host(self, tok: np.ndarray, val: np.ndarray, h: np.ndarray, ns: int,
                         known: int = 0, known_pos: int = -1) -> Tuple[int, int]:
        """`_insert_wave` of one sequence on a CPU tree, in numpy and Python on the tree's views:
        the same version, search (~log2(pages) scalar probes; with `DEFER_ENTRIES`, a walk on
        the tokens, `_walk_scalar`, which reads only the nodes' first page ends), counters,
        split and stamps (`_apply_walks`), leaf, table entries (deferred but the leaf's first:
        `_defer`) and change log. tok int32 / val int64 / h int64
        (`prefix_hashes` at every depth) [L], L a multiple of P. `known` (a multiple of P):
        that many leading tokens are present, the last at pool position `known_pos`, so the
        search starts there and h[:known] is not read. Returns (the present length [tokens], the
        pool position of the sequence's last token after the insert, -1 for L = 0); raises
        MemoryError (before changing anything but the version) as the wave does."""
        self.version = next(_VERSIONS)
        P, L = self.P, tok.size
        defer = self._defers()
        self._since_flush += 1
        if defer:  # deferred entries: a walk on the tokens (heads only) instead of the hash search
            m, kpos = self._walk_scalar(tok, L, ns, (known, known_pos) if known else None)[:2]
        else:
            k, kpos = self._search_scalar(h[P - 1 :: P], L // P, known // P, known_pos)
            m = k * P
        n_new = L - m
        if n_new:
            if len(self._free_nodes) < 2:
                raise MemoryError(f"radix tree node capacity {self.max_nodes} exhausted")
            if self.top + n_new > self.token_capacity and self._live_tokens() + n_new > self.token_capacity:
                raise MemoryError(f"radix tree token capacity {self.token_capacity} exhausted")
        stamp, cid = self.clock + 1, self.next_cid
        self.clock += 1
        self.next_cid += 1 + (n_new > 0)
        order = self.next_order
        self.next_order += n_new > 0
        (par,) = self._apply_walks([m], [kpos], [stamp], [cid])
        if n_new == 0:
            return m, kpos
        off = self._alloc_tokens(n_new)
        (node,) = self._alloc_ids(1)
        dst = slice(off, off + n_new)
        self._np("tok")[dst] = tok[m:]
        self._np("val")[dst] = val[m:]
        self._np("hsh")[dst] = h[m:]
        self._np("owner")[dst] = node
        for a, v in (("parent", par), ("key_off", off), ("key_len", n_new), ("start", m), ("lock_ref", 0),
                     ("last_access", stamp), ("cid", cid + 1), ("order", order), ("ns", ns), ("nchild", 0),
                     ("alive", True)):
            self._np(a)[node] = v
        self._np("nchild")[par] += 1
        pe = np.arange(off + P - 1, off + n_new, P, dtype=np.int64)  # m is page-aligned: every P-th new token
        hp = torch.from_numpy(np.ascontiguousarray(h[m + P - 1 :: P]))
        if defer:  # the leaf's head entered, the rest deferred
            self._enter_one_host(int(h[m + P - 1]), off + P - 1)
            self._defer(pe[1:])
        else:
            self._table_insert(hp, torch.from_numpy(pe), positions=True)  # its host form, after the fill check
        self._log_change(hp)
        self._np("evictable_size")[()] += n_new
        return m, off + n_new - 1

    def _live_tokens(self) -> int:
        """Tokens held by live nodes (a host read); numpy views on a CPU tree (a few us, where
        the torch mask and sum cost ~7-35 us)."""
        b = self._hwm
        if self._on_cpu:
            return int(self._np("key_len")[:b][self._np("alive")[:b]].sum())
        return int(self.key_len[:b][self.alive[:b]].sum())

    # ---- locks (R-RC-6) --------------------------------------------------------------------
    def _path_counts(self, nodes: torch.Tensor, be: str = "torch", bound: Optional[int] = None) -> torch.Tensor:
        """How many of the paths nodes[i]..root pass through each node (root excluded), for the
        ids below `bound` (default: the node capacity; `node_bound()` holds every live id)."""
        if be == "triton":
            return self._kernels().path_counts(nodes.contiguous(), self.parent[:bound])
        cnt = torch.zeros_like(self.lock_ref[:bound])
        cur = nodes[nodes > 0]
        while cur.numel():
            cnt.index_add_(0, cur, torch.ones_like(cur))
            cur = self.parent[cur]
            cur = cur[cur > 0]
        return cnt

    def _path_nodes(self, nodes: torch.Tensor, host: Optional[bool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """The distinct nodes on the paths nodes[i]..root (root excluded) and how many paths pass
        through each: `_path_counts` restricted to its nonzero entries. The torch walk visits
        only the path nodes (rounds of parent steps over the nodes still below the root), so it
        costs O(total path length), not O(node capacity). (A triton lock counts the paths
        over the live ids instead: `_lock_dense`.)"""
        if _host(nodes) if host is None else host:  # numpy calls on views of the arrays
            u, c = _path_nodes_host(self._np("parent"), nodes.numpy(), self.node_bound())
            return torch.from_numpy(u), torch.from_numpy(c)
        cur = nodes[nodes > 0]
        single = cur.numel() == 1  # one lock holder (the common call): its path has distinct nodes
        parts = []
        while cur.numel():
            parts.append(cur)
            cur = self.parent[cur]
            cur = cur[cur > 0]
        if not parts:
            e = torch.zeros(0, dtype=torch.int64, device=self.device)
            return e, e.clone()
        u = torch.cat(parts)
        return (u, torch.ones_like(u)) if single else torch.unique(u, return_counts=True)

    def _lock_scalar(self, nodes: List[int], sign: int) -> bool:
        """`lock` (sign 1) or `unlock` (sign -1) of a few nodes on the CPU in Python: the
        path counts by walks, then the same updates. False, with nothing changed, for an
        unlock below zero."""
        parent, lock_ref, key_len = self._mv("parent"), self._mv("lock_ref"), self._mv("key_len")
        cnt = {}
        for v in nodes:
            while v > 0:
                cnt[v] = cnt.get(v, 0) + 1
                v = parent[v]
        if sign < 0 and any(lock_ref[u] < c for u, c in cnt.items()):
            return False
        delta = 0
        for u, c in cnt.items():
            ref = lock_ref[u]
            if ref == (0 if sign > 0 else c):  # the node leaves (lock) or joins (unlock) evictable
                delta += key_len[u]
            lock_ref[u] = ref + sign * c
        if delta:
            self._move_host_sizes(sign * delta)
        return True

    def _lock_host(self, nodes: np.ndarray, sign: int) -> bool:
        """`lock` (sign 1) / `unlock` (sign -1) of many nodes on a CPU tree, on numpy views: the
        paths' distinct nodes and counts (`_path_nodes_host`), then one gather and one write of
        their lock counts; the sizes move by the tokens of the nodes whose count leaves or
        reaches 0. False, having changed nothing, for an unlock below zero."""
        u, c = _path_nodes_host(self._np("parent"), nodes, self.node_bound())
        if u.size == 0:
            return True
        lock_ref = self._np("lock_ref")
        ref = lock_ref[u]
        if sign < 0 and bool((ref < c).any()):
            return False
        delta = int(self._np("key_len")[u][ref == (0 if sign > 0 else c)].sum())
        if delta:
            self._move_host_sizes(sign * delta)
        lock_ref[u] = ref + sign * c
        return True

    def _move_host_sizes(self, d: int) -> None:
        """evictable_size -= d, protected_size += d [tokens] on a CPU tree's 0-d views (a
        torch in-place op on a 0-d tensor costs tens of us on a cold cache)."""
        self._np("evictable_size")[()] -= d
        self._np("protected_size")[()] += d

    def _lock_on_host(self, nodes: Union[torch.Tensor, List[int], np.ndarray], sign: int,
                      backend: Optional[str]) -> Optional[bool]:
        """`lock` / `unlock` (sign 1 / -1) on a CPU tree with the torch backend: Python walks for
        up to `SCALAR_BATCH` nodes (`_lock_scalar`), numpy past it (`_lock_host`); False for an
        unlock below zero (nothing changed). None elsewhere: the caller runs the torch form."""
        if not self._host_form(backend):
            return None
        listed = not isinstance(nodes, torch.Tensor)  # a list or a numpy array
        if (len(nodes) if listed else nodes.numel()) <= SCALAR_BATCH:
            return self._lock_scalar(nodes if isinstance(nodes, list) else nodes.tolist(), sign)
        return self._lock_host(np.asarray(nodes, dtype=np.int64) if listed else nodes.to(torch.int64).numpy(), sign)

    def _lock_dense(self, nodes: torch.Tensor, sign: int) -> None:
        """`lock` (sign 1) / `unlock` (sign -1) of int64 `nodes` on the tree's device with the
        triton backend: the path counts of the live ids (`kernels.radix.path_counts` over the
        first `node_bound()` ids, not the node capacity), then the counters and lock_ref
        updated as ops over those ids, so a lock reads nothing back (the compaction of the
        counted nodes and the mask of the newly locked ones each cost a device sync); an unlock
        reads one flag, its below-zero check, before changing anything. The same updates as
        the compacted form: nodes no path crosses get 0."""
        b = self.node_bound()
        cnt = self._path_counts(nodes, "triton", b)
        ref = self.lock_ref[:b]  # a view: updated in place below
        if sign < 0 and bool((ref < cnt).any()):
            raise RuntimeError("unlock below zero: lock_ref would become negative")
        # the nodes this call locks (their count was 0) or unlocks (it drops to 0), as tokens
        # moved from evictable to protected (sign 1) or back (sign -1)
        turns = (cnt > 0) & (ref == (cnt if sign < 0 else 0))
        delta = torch.where(turns, self.key_len[:b], 0).sum() * sign
        self.evictable_size -= delta
        self.protected_size += delta
        ref += cnt * sign

    def lock(self, nodes: Union[torch.Tensor, List[int], np.ndarray], *, backend: Optional[str] = None) -> None:
        """inc_lock_ref for each node (batched; node 0 = root is a no-op). nodes: int64 [B], or
        a list or numpy array of node ids on a CPU tree (the host paths' forms: no tensor is
        made)."""
        if self._lock_on_host(nodes, 1, backend) is not None:
            return
        if not isinstance(nodes, torch.Tensor):  # a list or numpy array outside the host form
            nodes = torch.as_tensor(np.asarray(nodes, dtype=np.int64))
        nodes, be = nodes.to(self.device, torch.int64), self._be(backend)
        if be == "triton":
            self._lock_dense(nodes, 1)
            return
        u, c = self._path_nodes(nodes)
        if u.numel() == 0:
            return
        ref = self.lock_ref[u]
        delta = self.key_len[u][ref == 0].sum()
        self.evictable_size -= delta
        self.protected_size += delta
        self.lock_ref[u] = ref + c

    def unlock(self, nodes: Union[torch.Tensor, List[int], np.ndarray], *, backend: Optional[str] = None) -> None:
        """dec_lock_ref for each node (batched; nodes as for `lock`). Raises RuntimeError on a
        negative lock_ref (nothing changed)."""
        ok = self._lock_on_host(nodes, -1, backend)
        if ok is not None:
            if not ok:
                raise RuntimeError("unlock below zero: lock_ref would become negative")
            return
        if not isinstance(nodes, torch.Tensor):  # a list or numpy array outside the host form
            nodes = torch.as_tensor(np.asarray(nodes, dtype=np.int64))
        nodes, be = nodes.to(self.device, torch.int64), self._be(backend)
        if be == "triton":
            self._lock_dense(nodes, -1)
            return
        u, c = self._path_nodes(nodes)
        if u.numel() == 0:
            return
        ref = self.lock_ref[u]
        if bool((ref < c).any()):
            raise RuntimeError("unlock below zero: lock_ref would become negative")
        delta = self.key_len[u][ref == c].sum()
        self.evictable_size += delta
        self.protected_size -= delta
        self.lock_ref[u] = ref - c

    # ---- evict (R-RC-7) --------------------------------------------------------------------
    def evict(self, num_tokens: int, *, backend: Optional[str] = None) -> EvictResult:
        """Evict unlocked leaves, oldest stamp first (ties: creation id, D4), parents joining
        when they become unlocked leaves, until >= num_tokens are freed or none is left.

        Parallel rounds: sort the current unlocked leaves; take the prefix up to the node that
        reaches num_tokens or up to the first node whose removal turns its parent into a leaf
        (the parent then joins the next round's sort) — exactly the heap order of the reference."""
        be = self._be(backend)
        dev = self.device
        order_out, vals_out = [], []
        freed = 0
        if num_tokens <= 0:
            e = torch.zeros(0, dtype=torch.int64, device=dev)
            return EvictResult(e, e.clone(), 0)
        if self._host_form(be):
            return self._evict_host(num_tokens)
        # the unlocked leaves, found once; later rounds add the parents that became leaves
        b = self._hwm
        cand = torch.nonzero(self.alive[:b] & (self.nchild[:b] == 0) & (self.lock_ref[:b] == 0)).flatten()
        cand = cand[cand != ROOT]
        while freed < num_tokens and cand.numel():
            cand = cand[torch.argsort(self.cid[cand], stable=True)]
            cand = cand[torch.argsort(self.last_access[cand], stable=True)]
            cum = torch.cumsum(self.key_len[cand], 0)
            reach = torch.nonzero(cum >= num_tokens - freed).flatten()
            k = int(reach[0]) if reach.numel() else cand.numel() - 1
            par, cnt, lastpos = self._evict_rank(self.parent[cand], be)
            becomes = (cnt == self.nchild[par]) & (cnt > 0) & (self.lock_ref[par] == 0) & (par != ROOT)
            if bool(becomes.any()):
                k = min(k, int(lastpos[becomes].min()))
            take = cand[: k + 1]
            order_out.append(take)
            freed += int(cum[k])
            vals_out.append(self._remove(take, be))
            # a parent whose last candidate child was taken is now an unlocked leaf
            cand = torch.cat([cand[k + 1 :], par[becomes & (lastpos <= k)]])
        nodes = torch.cat(order_out) if order_out else torch.zeros(0, dtype=torch.int64, device=dev)
        vals = torch.cat(vals_out) if vals_out else torch.zeros(0, dtype=torch.int64, device=dev)
        return EvictResult(nodes, vals, freed)

    def _evict_host(self, num_tokens: int) -> EvictResult:
        """`evict`'s rounds on a CPU tree, in numpy on its views: the same stable sorts (stamp,
        then creation id), cut, distinct parents (`_evict_rank`'s counts and last positions,
        by a stable sort instead of `unique`) and removals (`_remove_host`)."""
        v = self._np
        alive, nchild, lock_ref = v("alive"), v("nchild"), v("lock_ref")
        cid, stamp, key_len, parent = v("cid"), v("last_access"), v("key_len"), v("parent")
        b = self._hwm
        cand = np.flatnonzero(alive[:b] & (nchild[:b] == 0) & (lock_ref[:b] == 0))
        cand = cand[cand != ROOT]
        if cand.size <= SCALAR_BATCH:  # a replay's usual few unlocked leaves
            return self._evict_scalar(cand.tolist(), num_tokens)
        order_out, vals_out, freed = [], [], 0
        while freed < num_tokens and cand.size:
            cand = cand[np.argsort(cid[cand], kind="stable")]
            cand = cand[np.argsort(stamp[cand], kind="stable")]
            cum = np.cumsum(key_len[cand])
            reach = np.flatnonzero(cum >= num_tokens - freed)
            k = int(reach[0]) if reach.size else cand.size - 1
            o = np.argsort(parent[cand], kind="stable")
            ps = parent[cand][o]
            first = np.ones(ps.size, dtype=bool)
            first[1:] = ps[1:] != ps[:-1]
            par, grp = ps[first], np.cumsum(first) - 1
            cnt = np.bincount(grp, minlength=par.size)
            lastpos = np.full(par.size, -1, dtype=np.int64)
            np.maximum.at(lastpos, grp, o)
            becomes = (cnt == nchild[par]) & (cnt > 0) & (lock_ref[par] == 0) & (par != ROOT)
            if becomes.any():
                k = min(k, int(lastpos[becomes].min()))
            take = cand[: k + 1]
            order_out.append(take)
            freed += int(cum[k])
            vals_out.append(self._remove_host(take))
            # a parent whose last candidate child was taken is now an unlocked leaf
            cand = np.concatenate([cand[k + 1 :], par[becomes & (lastpos <= k)]])
        return EvictResult(_cat64(order_out), _cat64(vals_out), freed)

    def _evict_scalar(self, cand: List[int], num_tokens: int) -> EvictResult:
        """`_evict_host`'s rounds for a few unlocked leaves `cand` (node ids) in Python on the
        tree's views (a round of numpy calls costs ~25 calls whatever the count): sorted by
        (stamp, creation id), a round takes leaves in that order up to the one that reaches
        num_tokens or whose removal leaves its parent an unlocked leaf (all its children
        taken: the rounds' `cnt == nchild` at the parent's last candidate); those are removed
        together (`_remove_host`: the same batches, so the same change log), and that parent
        joins the rest in order (the rounds sort again)."""
        parent, key_len, nchild, lock_ref, stamp, cid = map(
            self._mv, ("parent", "key_len", "nchild", "lock_ref", "last_access", "cid"))

        def key(x: int) -> Tuple[int, int]:
            return stamp[x], cid[x]

        cand.sort(key=key)
        order_out, vals_out, freed = [], [], 0
        while freed < num_tokens and cand:
            taken, got, k, join = {}, 0, len(cand) - 1, None
            for i, x in enumerate(cand):
                p = parent[x]
                taken[p] = t = taken.get(p, 0) + 1
                got += key_len[x]
                if nchild[p] == t and lock_ref[p] == 0 and p != ROOT:
                    k, join = i, p
                    break
                if freed + got >= num_tokens:
                    k = i
                    break
            take = np.array(cand[: k + 1], dtype=np.int64)
            order_out.append(take)
            freed += got
            vals_out.append(self._remove_host(take))
            cand = cand[k + 1 :]
            if join is not None:
                bisect.insort(cand, join, key=key)
        return EvictResult(_cat64(order_out), _cat64(vals_out), freed)

    def _evict_rank(self, par: torch.Tensor, be: str = "torch") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The distinct parents of the sorted candidates (`par` = their parents in order), how
        many candidates each has, and the last such position."""
        if be == "triton":
            cnt, lastpos = self._kernels().evict_rank(par.contiguous(), self.max_nodes)
            u = torch.unique(par)
            return u, cnt[u], lastpos[u]
        u, inv, cnt = torch.unique(par, return_inverse=True, return_counts=True)
        posn = torch.arange(par.numel(), device=self.device)
        lastpos = torch.full_like(u, -1).scatter_reduce_(0, inv, posn, reduce="amax")
        return u, cnt, lastpos

    def _remove(self, nodes: torch.Tensor, be: str = "torch") -> torch.Tensor:
        if self._host_form(be):
            return torch.from_numpy(self._remove_host(nodes.numpy()))
        self.version = next(_VERSIONS)
        lens = self.key_len[nodes]
        total = int(lens.sum())
        rng = torch.repeat_interleave(self.key_off[nodes], lens) + (
            torch.arange(total, device=self.device) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens))
        vals = self.val[rng].clone()
        page_ends = rng[(torch.arange(total, device=self.device) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)) % self.P == self.P - 1]
        self._table_delete(self.hsh[page_ends], be)
        self._log_change(self.hsh[page_ends])
        self.owner[rng] = -1
        self.nchild.index_add_(0, self.parent[nodes], -torch.ones_like(nodes))
        self.alive[nodes] = False
        self.parent[nodes] = -1
        self.evictable_size -= total
        self._free_nodes.extend(nodes.tolist())
        return vals

    def _remove_host(self, nodes: np.ndarray) -> np.ndarray:
        """`_remove` on a CPU tree, in numpy on its views (the same writes, table tombstones and
        change log; some 25 torch ops of 5-15 us each otherwise). nodes int64 [k], leaves
        being evicted. Returns their KV slots int64 [tokens]."""
        self.version = next(_VERSIONS)
        v, P = self._np, self.P
        lens = v("key_len")[nodes]
        total = int(lens.sum())
        if nodes.size <= SCALAR_BATCH and self.hslot is not None and self._hslot_ok:
            vals, h = self._remove_spans(v("key_off")[nodes].tolist(), lens.tolist())
        else:
            within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
            rng = np.repeat(v("key_off")[nodes], lens) + within
            vals = v("val")[rng]
            pe = rng[within % P == P - 1]
            h = torch.from_numpy(v("hsh")[pe])
            self._table_delete(h, pos=pe)
            v("owner")[rng] = -1
        self._log_change(h)
        np.add.at(v("nchild"), v("parent")[nodes], -1)
        v("alive")[nodes] = False
        v("parent")[nodes] = -1
        v("evictable_size")[()] -= total
        self._free_nodes.extend(nodes.tolist())
        return vals

    def _remove_spans(self, offs: List[int], lens: List[int]) -> Tuple[np.ndarray, torch.Tensor]:
        """`_remove_host`'s token and table writes for a few leaves (their pool ranges
        [offs[i], offs[i] + lens[i])), by slices of each range instead of index arrays (an
        evicted leaf of 10k tokens: ~15 against ~200 us): the entered page ends' entries
        deleted by their recorded slots (`hslot`), the deferred ones' marks cleared, the
        owners cleared. Returns (the ranges' KV slots int64 [sum(lens)], their page ends'
        hashes int64 [sum(lens) // P]), in `_remove_host`'s order."""
        P = self.P
        val, hsh, hs, owner = self._np("val"), self._np("hsh"), self._np("hslot"), self._np("owner")
        vals, hp, marks, slots, keys = [], [], [], [], []
        for o, n in zip(offs, lens):
            pe = slice(o + P - 1, o + n, P)
            marks.append(hs[pe])
            vals.append(val[o : o + n])
            hp.append(hsh[pe])
            # a deferred entry leaves with its pending mark alone (most of a leaf's)
            entered = np.flatnonzero(marks[-1] != PENDING) if self._pend else slice(None)
            slots.append(marks[-1][entered].astype(np.int64))
            keys.append(hp[-1][entered])
        cat = (lambda xs: xs[0].copy()) if len(offs) == 1 else np.concatenate  # noqa: E731
        h = cat(hp)
        self._delete_slots(cat(slots), cat(keys))  # checked before it writes: RuntimeError leaves all as it was
        for o, n, m in zip(offs, lens, marks):
            m.fill(-1)  # a removed position holds no entry
            owner[o : o + n] = -1
        return cat(vals), torch.from_numpy(h)

    # ---- inspection ------------------------------------------------------------------------
    def node_prefix(self, node: int) -> Tuple[int, Tuple[int, ...]]:
        """(namespace id, full token prefix) of a node: an id-free name for comparisons."""
        parts = []
        ns = int(self.ns[node])
        while node > 0:
            off, ln = int(self.key_off[node]), int(self.key_len[node])
            parts.append(self.tok[off : off + ln].tolist())
            node = int(self.parent[node])
        return ns, tuple(t for part in reversed(parts) for t in part)

    def triples(self) -> set:
        """The tree as a set of ((ns, prefix), key length, lock_ref) over non-root nodes."""
        out = set()
        for n in torch.nonzero(self.alive[: self._hwm]).flatten().tolist():
            if n != ROOT:
                out.add((self.node_prefix(n), int(self.key_len[n]), int(self.lock_ref[n])))
        return out

    def check_integrity(self) -> None:
        """Structure, counters and hash table against each other (AssertionError on failure).
        On a CPU tree with deferred entries, first checks that every node's first page end is
        in the table, then enters the rest (`_flush_pending`) and checks the whole table."""
        b = self._hwm  # no live id at or above it (ids are handed out lowest first)
        if self.hslot is not None and self._pend:
            # every live node's first page end in the table (the walks rely on it); then the
            # deferred entries entered, and no pending mark left
            ids = np.flatnonzero(self._np("alive")[:b])
            ids = ids[ids != ROOT]
            heads = self._np("key_off")[ids] + self.P - 1
            assert not (self._np("hslot")[heads] == PENDING).any(), "a node's first page-end entry is deferred"
            marked = np.flatnonzero(self._np("hslot") == PENDING)
            assert np.isin(marked, np.concatenate(self._pend)).all(), "a deferred entry missing from the list"
            self._flush_pending()
            assert not (self._np("hslot") == PENDING).any(), "a pending mark after the flush"
        # the passes over the whole node, pool and table arrays: numpy on a CPU (2-3x torch's
        # one-thread passes there; a replay's --check runs this after every step)
        if self._on_cpu:
            assert not self._np("alive")[b:].any(), "a live node at or above node_bound()"
            owned = int(np.count_nonzero(self._np("owner") >= 0))
            slots = torch.from_numpy(np.flatnonzero(self._np("hkeys") >= 0))
        else:
            assert not bool(self.alive[b:].any()), "a live node at or above node_bound()"
            owned = int(torch.count_nonzero(self.owner >= 0))
            slots = torch.nonzero(self.hkeys >= 0).flatten()
        live = self.alive[:b]
        assert bool((self.parent[:b][~live] == -1).all()), "a dead node slot keeps a parent"
        alive = torch.nonzero(live).flatten()
        nodes = alive[alive != ROOT]
        if nodes.numel():
            par = self.parent[nodes]
            assert bool(self.alive[par].all()), "a live node has a dead parent"
            assert bool((self.start[nodes] == self.start[par] + self.key_len[par]).all()), "start != parent end"
            assert bool((self.key_len[nodes] > 0).all()) and bool((self.key_len[nodes] % self.P == 0).all()), "bad key length"
            assert bool((self.lock_ref[nodes] >= 0).all()), "negative lock_ref"
            assert bool((self.lock_ref[nodes] <= torch.where(par == ROOT, self.lock_ref[nodes], self.lock_ref[par])).all()), "lock_ref above parent's"
            assert bool((self.last_access[nodes] <= self.last_access[par]).all()), "stamp above parent's"
            cnt = torch.zeros(b, dtype=self.nchild.dtype, device=self.device).index_add_(0, par, torch.ones_like(par))
            assert torch.equal(cnt[live], self.nchild[:b][live]), "nchild mismatch"
            ev = int(self.key_len[nodes][self.lock_ref[nodes] == 0].sum())
            pr = int(self.key_len[nodes][self.lock_ref[nodes] > 0].sum())
        else:
            ev = pr = 0
        assert (ev, pr) == (int(self.evictable_size), int(self.protected_size)), (
            f"evictable/protected {int(self.evictable_size)}/{int(self.protected_size)} != {ev}/{pr}")
        # every live token's pool position is owned by its node, and no other position is owned
        assert owned == ev + pr, "owned pool positions != live tokens"
        if nodes.numel():
            off, ln = self.key_off[nodes], self.key_len[nodes]
            assert bool((self.owner[off] == nodes).all()) and bool((self.owner[off + ln - 1] == nodes).all()), (
                "a node's first or last pool position is owned by another node")
        live_entries = slots.numel()
        if self.hslot is not None and self._hslot_ok:  # each entry's slot recorded at its pool position
            s_np = slots.numpy()  # hslot exists on a CPU tree only
            assert np.array_equal(self._np("hslot")[self._np("hvals")[s_np]], s_np), "hslot != an entry's slot"
        assert live_entries == (ev + pr) // self.P, f"hash entries {live_entries} != pages {(ev + pr) // self.P}"


def _tomb_host(keys: np.ndarray, slot: np.ndarray) -> int:
    """Tombstones at `slot` (int64 [n], distinct, live entries), then
    `FlatRadixTree._clear_tombs` on a CPU table's view, round for round (the same slots
    become EMPTY). The slots after the deleted ones are read before the writes (a deletion
    turns live slots into tombstones, never into or out of EMPTY: the same answer), so a
    slot that ends its run is written EMPTY at once. Returns the slots that became EMPTY.
    In a Mooncake replay 69% of the deleted entries end their run and 19.5M of 22.2M become
    EMPTY, so the table is rebuilt for tombstones once instead of 9 times."""
    mask = keys.size - 1
    end = keys[(slot + 1) & mask] == EMPTY
    keys[slot] = np.where(end, EMPTY, TOMB)
    c = slot[end]
    return len(c) + _clear_runs_before(keys, c, mask)


def _clear_runs_before(keys, c, mask: int) -> int:
    """The tombstones right before the just-cleared slots `c` (int64 [k], a tensor or a numpy
    array, as `keys`) made EMPTY, a slot back per round, until each run ends: the walk of
    `FlatRadixTree._clear_tombs` and `_tomb_host`. Returns how many slots it cleared."""
    cleared = 0
    while len(c):
        if len(c) <= SCALAR_TABLE_ROUNDS and isinstance(keys, np.ndarray):  # the last few runs in Python
            return cleared + _clear_runs_scalar(memoryview(keys), c.tolist(), mask)
        cur = (c - 1) & mask
        c = cur[keys[cur] == TOMB]
        keys[c] = EMPTY
        cleared += len(c)
    return cleared


def _clear_runs_scalar(keys: memoryview, starts: List[int], mask: int) -> int:
    """`_clear_runs_before` for a few cleared slots in Python, one run after another: the runs
    of tombstones before distinct EMPTY slots are disjoint (each ends at the EMPTY slot after
    it), so walking them one by one clears the slots the rounds clear (a long run costs its
    length in cheap reads, not ~5 numpy calls a slot back; a Mooncake replay's deletions
    walk runs of 10 and more)."""
    cleared = 0
    for c in starts:
        p = (c - 1) & mask
        while keys[p] == TOMB:
            keys[p] = EMPTY
            cleared += 1
            p = (p - 1) & mask
    return cleared


def _stamp_walks(parent, last_access, nodes: List[int], stamps: List[int]) -> None:
    """`FlatRadixTree._stamp_paths` for a few nodes in Python, one walk after another on the
    arrays' views: each walk stops at a node holding a larger stamp, as in the level-by-level form,
    and ends with the same maxima (a larger stamp of the batch covers the path above it,
    whichever walk runs first). parent, last_access: 1-d int64 views (memoryviews from
    `FlatRadixTree._mv` read as Python ints)."""
    for v, st in zip(nodes, stamps):
        while v >= 0 and last_access[v] <= st:
            last_access[v] = st
            v = int(parent[v])


def _stamp_paths_host(parent: np.ndarray, last_access: np.ndarray, nodes: np.ndarray, stamp: np.ndarray) -> None:
    """`FlatRadixTree._stamp_paths` for a tree on the CPU, in place on numpy views of its
    `parent` and `last_access` (int64 [node_bound]; nodes int64 [B] below it, stamps int64 [B]):
    the same walk, each level a few numpy calls (several times cheaper than torch's per call
    on small arrays; a batch walks about as many levels as its paths have nodes)."""
    if nodes.size > 64:  # many requests, few distinct last nodes: walk each node once
        best = np.full(parent.size, INT64_MIN, dtype=np.int64)
        np.maximum.at(best, nodes, stamp)
        cur = np.flatnonzero(best != INT64_MIN)
        stamp = best[cur]
    else:
        cur = nodes
    while cur.size:
        # a walk stops at a node holding a larger stamp (see _stamp_paths)
        go = last_access[cur] <= stamp
        cur, stamp = cur[go], stamp[go]
        np.maximum.at(last_access, cur, stamp)
        nxt = parent[cur]
        keep = nxt >= 0
        cur, stamp = nxt[keep], stamp[keep]


def _match_nodes_host(owner: np.ndarray, m: np.ndarray, pos: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(has, node) of matches (m, pos) int64 [B] on a CPU tree's `owner` view: whether each
    matched anything, and the node holding its last token (0 where not). `take(mode="clip")`
    skips numpy's bounds pass (positions are in range; an empty match's -1 clips to 0 and is
    masked): 1.3-1.5x faster on a large token pool."""
    has = m > 0
    X = owner.take(pos, mode="clip")
    X[~has] = 0
    return has, X


def _path_position_host(owner: np.ndarray, key_off: np.ndarray, key_len: np.ndarray, parent: np.ndarray,
                        m: np.ndarray, pos: np.ndarray, d: np.ndarray):
    """`FlatRadixTree.path_position(..., nodes=True)` on numpy views of the tree's arrays: the
    same climb, on the rows that still need a parent step only. (pos, node, cover) int64 [B]."""
    has, X = _match_nodes_host(owner, m, pos)  # takes with mode="clip": every index is in range
    start = np.where(has, m - (pos - key_off.take(X, mode="clip") + 1), 0)  # depth where node X begins
    on = d > 0
    live = np.flatnonzero(on & (d <= start))
    while live.size:
        x = parent.take(X[live], mode="clip")
        X[live] = x
        s = start[live] - key_len.take(x, mode="clip")
        start[live] = s
        live = live[d[live] <= s]
    cover = np.where(on, d - start, 0)
    return np.where(on, key_off.take(X, mode="clip") + cover - 1, -1), np.where(on, X, 0), cover


def _path_nodes_host(parent: np.ndarray, nodes: np.ndarray, bound: int) -> Tuple[np.ndarray, np.ndarray]:
    """`FlatRadixTree._path_nodes` for a tree on the CPU, on numpy views: the same walk; the
    counts by `np.bincount` over the live ids (below `bound`) when the paths are not much
    shorter than that, else by `np.unique`. int64 [U] nodes ascending (one holder: its path
    from the node up) and int64 [U] counts."""
    cur = nodes[nodes > 0]
    single = cur.size == 1  # one lock holder (the common call): its path has distinct nodes
    parts = []
    while cur.size:
        parts.append(cur)
        cur = parent[cur]
        cur = cur[cur > 0]
    if not parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    u = np.concatenate(parts).astype(np.int64, copy=False)
    if single:
        return u, np.ones_like(u)
    if u.size * 16 < bound:
        v, c = np.unique(u, return_counts=True)
        return v, c.astype(np.int64, copy=False)
    c = np.bincount(u, minlength=bound)
    v = np.flatnonzero(c)
    return v, c[v].astype(np.int64, copy=False)
