"""Data races of Triton kernels, found in Triton's interpreter.

The interpreter runs a launch's programs one after another, in grid order, and a store's lanes
as one numpy assignment: a kernel whose result depends on which program runs first, or on
which of two lanes storing to one address wins, passes there and may fail on a GPU, where
programs run concurrently and in no set order. This module watches the interpreter instead:

- `RaceWatch` records, per launch, every address a program loads, stores or updates
  atomically (masked-off lanes excluded), and after the launch reports each address that
  one program stores to and another program reads, stores to or updates (a plain store of
  the same value by every program that stores there, with no reader and no atomic, is
  allowed: the order cannot show), and each address that one program updates atomically
  and another reads or stores plainly. Atomic updates by several programs are the sanctioned
  way to combine across programs and are not reported. It also reports a store whose active
  lanes write two different values to one address (which lane wins is unspecified on a GPU).
- Inside one program, the threads of a GPU program run a load and a store of one global
  address in no set order unless a `tl.debug_barrier()` lies between them (Triton orders
  shared memory for you, not global memory: triton-lang/triton#1097, #10924): `RaceWatch`
  also reports a load of an address the same program stored to earlier with no barrier in
  between (read-back), and a store to an address the same program loaded earlier with no
  barrier in between, except where the load and the store have the same address in every
  lane (an elementwise read-modify-write, a scalar's included: the thread that stores a lane
  loaded it, or the layouts differ and the value crosses threads through shared memory, behind
  a barrier). That is safe only while no other thread uses the loaded value (a scalar is
  loaded by every thread, a small block's lanes may be held by several): which kernels do it
  is kept in `rmw_kernels`, for reading.
- `RaceWatch` also reports an active lane whose address lies outside every tensor argument's
  storage (the interpreter reads and writes host memory, where a neighbouring allocation
  answers quietly; a GPU faults or corrupts), and gives the masked-off lanes of a load
  without `other=` garbage (`GARBAGE_BITS`, NaN, True) rather than the interpreter's zeros:
  Triton leaves them undefined, so a kernel that uses them (a sum over a masked load, a
  value picked from a masked-off lane) fails a test here rather than on a GPU.
- `program_order`: "grid" (the interpreter's own), "reverse" or "shuffle" (seeded) runs each
  launch's programs, and each atomic's lanes, in that order: a kernel correct by construction
  gives the same result in any order.

`RaceWatch.watching()` and `program_order` are context managers over patches of
`triton.runtime.interpreter` (`supported()` says whether this Triton has what they patch);
they only make sense with TRITON_INTERPRET=1 (the kernels decorated as interpreted). Not
thread-safe. `tests/conftest.py` runs every test under both (`GPU_SCHED_RACE_CHECK=0`
turns that off, `GPU_SCHED_PROGRAM_ORDER` / `GPU_SCHED_PROGRAM_SEED` choose the orders);
`tests/test_kernels_races.py` tests the watch itself on kernels written to race.
"""

from __future__ import annotations

import contextlib
import random
import sys
from dataclasses import dataclass, field
from typing import Iterator, List, Optional, Tuple

import numpy as np

READ, WRITE, ATOMIC = 0, 1, 2
_KIND = {READ: "load", WRITE: "store", ATOMIC: "atomic"}


_LOOP_CODE = []  # the interpreter's own launch (GridExecutor.__call__), before any patch


def _interp():
    from triton.runtime import interpreter

    if not _LOOP_CODE:
        _LOOP_CODE.append(interpreter.GridExecutor.__call__.__code__)
    return interpreter


def supported() -> bool:
    """Whether this Triton's interpreter has the internals the watch patches (checked with
    Triton 3.9): the launch loop, the builder's memory ops and barrier, TensorHandle."""
    try:
        it = _interp()
    except Exception:
        return False
    B = getattr(it, "InterpreterBuilder", None)
    return (B is not None and hasattr(it, "GridExecutor") and hasattr(it, "interpreter_builder")
            and hasattr(it, "TensorHandle") and hasattr(it, "_get_np_dtype")
            and all(hasattr(B, n) for n in ("create_masked_load", "create_masked_store", "create_atomic_rmw",
                                            "create_atomic_cas", "create_barrier"))
            and "range" in _LOOP_CODE[0].co_names)  # the launch loop looks `range` up by name


@dataclass
class Race:
    """One racy address of one launch: the kernel, the address (bytes) and what each program
    (grid index) did there, e.g. {(0, 0, 0): "store", (1, 0, 0): "load"}."""

    kernel: str
    what: str
    address: int
    programs: dict = field(default_factory=dict)

    def __str__(self) -> str:
        acts = ", ".join(f"program {p}: {a}" for p, a in sorted(self.programs.items())[:4])
        return f"{self.kernel}: {self.what} at address {self.address:#x} ({acts})"


def first_conflict(dest: np.ndarray, vals: Optional[np.ndarray]) -> Optional[int]:
    """The first destination (in sorted order) that `dest` (int [n]) names twice with two
    different values `vals` ([n], compared by bits: NaN equals NaN), or twice at all when vals
    is None; None when there is none. A one-value `vals` ([1] or a scalar) never conflicts."""
    dest = np.asarray(dest).reshape(-1)
    if dest.size < 2:
        return None
    o = np.argsort(dest, kind="stable")
    d = dest[o]
    rep = d[1:] == d[:-1]
    if vals is not None:
        vals = np.asarray(vals)
        if vals.size < 2:
            return None
        v = _values_as_int64(vals.reshape(-1) if vals.size == dest.size else np.broadcast_to(vals, dest.shape))[o]
        rep &= v[1:] != v[:-1]
    i = np.flatnonzero(rep)
    return int(d[i[0]]) if i.size else None


def _values_as_int64(v: np.ndarray) -> np.ndarray:
    """Stored values as int64 for equality: integers and bools widened, floats by their bits."""
    if v.dtype.kind == "f":
        return v.astype(np.float64).view(np.int64)
    return v.astype(np.int64)


#: what a masked load without `other` gives its masked-off lanes under `RaceWatch` (Triton leaves
#: them undefined; the interpreter gives zeros): NaN, True, or these bits in an integer's width
GARBAGE_BITS = 0xDEADBEEFDEADBEEF


def _garbage(ptrs):
    """A TensorHandle of garbage shaped like the load `ptrs` would give (module doc)."""
    it = _interp()
    tt = ptrs.get_element_ty()
    dt = it._get_np_dtype(tt)
    shape = np.shape(ptrs.data)
    return it.TensorHandle(np.full(shape, garbage(dt), dtype=dt), tt)


def garbage(dt: np.dtype):
    """The garbage value of numpy dtype dt: NaN, True, or `GARBAGE_BITS`' low bits (also what
    `tests/conftest.py` fills new uninitialized arrays with)."""
    if dt.kind in "fc":
        return np.nan
    if dt.kind == "b":
        return True
    return np.uint64(GARBAGE_BITS).astype(dt)


class RaceWatch:
    """Record the interpreter's memory accesses per launch and report races (module doc).

    `races` collects every `Race` found; `launches` counts the launches watched. With
    `raise_on_race`, a launch with a race raises AssertionError naming it."""

    def __init__(self, raise_on_race: bool = False):
        self.raise_on_race = raise_on_race
        self.races: List[Race] = []
        self.launches = 0
        self.rmw_kernels: set = set()
        self._acc: Optional[list] = None  # this launch's (addresses, program, kind, values, epoch, size)
        self._kernel = ""
        self._epoch = 0  # barriers seen: accesses of one program in one epoch are unordered
        self._ranges = None  # this launch's tensor arguments' storages: (starts, ends) [bytes], by start

    # ---- recording ---------------------------------------------------------------------
    def _program(self) -> int:
        b = _interp().interpreter_builder
        x, y, z = b.grid_idx
        nx, ny, _ = b.grid_dim
        return (z * ny + y) * nx + x

    def _record(self, ptrs, mask, kind: int, values=None) -> None:
        if self._acc is None:
            return
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape) if mask is not None else None
        a = addr[m] if m is not None else addr.reshape(-1)
        if not a.size:
            return
        self._check_bounds(a, _interp()._get_np_dtype(ptrs.get_element_ty()).itemsize, kind)
        v = None
        if values is not None:
            vv = np.broadcast_to(np.asarray(values.data), addr.shape)
            v = _values_as_int64(vv[m] if m is not None else vv.reshape(-1))
            self._check_lanes(a, v)
        self._acc.append((a, self._program(), kind, v, self._epoch, addr.size, addr))

    def _check_bounds(self, a: np.ndarray, size: int, kind: int) -> None:
        """Active lanes whose `size`-byte element is not inside one tensor argument's storage."""
        if self._ranges is None:
            return
        starts, ends = self._ranges
        i = np.searchsorted(starts, a, side="right") - 1
        ok = (i >= 0) & (a + np.uint64(size) <= ends[np.maximum(i, 0)])
        if not ok.all():
            bad = int(a[np.flatnonzero(~ok)[0]])
            self._report(Race(self._kernel, f"an out-of-bounds {_KIND[kind]}", bad,
                              {self._grid_idx(self._program()): _KIND[kind]}))

    def _set_ranges(self, args, kwargs) -> None:
        import torch

        spans = []
        for t in list(args) + list(kwargs.values()):
            for x in (t if isinstance(t, tuple) else (t,)):
                if isinstance(x, torch.Tensor):
                    st = x.untyped_storage()
                    spans.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        spans.sort()
        self._ranges = (np.array([a for a, _ in spans], dtype=np.uint64).reshape(-1),
                        np.array([b for _, b in spans], dtype=np.uint64).reshape(-1))

    def _check_lanes(self, a: np.ndarray, v: np.ndarray) -> None:
        """One store's active lanes writing two different values to one address."""
        bad = first_conflict(a, v)
        if bad is not None:
            self._report(Race(self._kernel, "one store's lanes write different values", bad,
                              {self._grid_idx(self._program()): "store"}))

    # ---- analysis ----------------------------------------------------------------------
    def _report(self, race: Race) -> None:
        self.races.append(race)
        if self.raise_on_race:
            raise AssertionError(f"data race: {race}")

    def _analyze(self) -> None:
        acc, self._acc = self._acc, None
        if not acc:
            return
        self._within_programs(acc)
        addr = np.concatenate([x[0] for x in acc])
        prog = np.concatenate([np.full(x[0].size, x[1], dtype=np.int64) for x in acc])
        kind = np.concatenate([np.full(x[0].size, x[2], dtype=np.int8) for x in acc])
        val = np.concatenate([x[3] if x[3] is not None else np.zeros(x[0].size, dtype=np.int64) for x in acc])
        o = np.lexsort((kind, prog, addr))
        addr, prog, kind, val = addr[o], prog[o], kind[o], val[o]
        starts = np.flatnonzero(np.r_[True, addr[1:] != addr[:-1]])
        # addresses touched by one program only cannot race across programs
        many = np.flatnonzero(np.maximum.reduceat(prog, starts) != np.minimum.reduceat(prog, starts))
        wrote = np.maximum.reduceat((kind != READ).astype(np.int8), starts).astype(bool)
        ends = np.r_[starts[1:], addr.size]
        for g in many[wrote[many]]:
            s, e = starts[g], ends[g]
            ks, ps, vs = kind[s:e], prog[s:e], val[s:e]
            # two or more programs touch this address and one stores or updates it: a race
            # unless they all store one value, or all update it atomically
            race = None
            if (ks == WRITE).any():
                if (ks != WRITE).any() or np.unique(vs[ks == WRITE]).size > 1:
                    race = "a store and another program's access"
            elif (ks == READ).any():
                race = "an atomic update and another program's load"
            if race is not None:
                progs = {}
                for p, k in zip(ps.tolist(), ks.tolist()):
                    progs.setdefault(self._grid_idx(p), _KIND[k])
                self._report(Race(self._kernel, race, int(addr[s]), progs))

    def _within_programs(self, acc: list) -> None:
        """Read-back and write-after-read hazards inside each program (module doc): the first
        of each program is reported."""
        by_prog: dict = {}
        for i, x in enumerate(acc):
            by_prog.setdefault(x[1], []).append((i, x))
        for p, ops in by_prog.items():
            what = self._program_hazard(ops)
            if what is not None:
                self._report(Race(self._kernel, what[0], what[1], {self._grid_idx(p): "store, load"}))

    def _program_hazard(self, ops: list) -> Optional[Tuple[str, int]]:
        """(what, address) of one program's first load/store pair on one address with no
        barrier between, an elementwise read-modify-write excepted (noted in `rmw_kernels`)."""
        stores = [(i, x) for i, x in ops if x[2] == WRITE]
        for li, lx in ops:
            if lx[2] != READ:
                continue
            for si, sx in stores:
                if sx[4] != lx[4]:  # a barrier between them
                    continue
                common = np.intersect1d(lx[0], sx[0])
                if not common.size:
                    continue
                if si < li:
                    return "a load reads back the same program's store with no barrier between", int(common[0])
                if lx[6].shape == sx[6].shape and np.array_equal(lx[6], sx[6]):
                    self.rmw_kernels.add(self._kernel)  # lane i loads and stores one address
                    continue
                return "a store overwrites what the same program loaded, no barrier between", int(common[0])
        return None

    def _grid_idx(self, p: int):
        nx, ny, _ = _interp().interpreter_builder.grid_dim
        return (p % nx, (p // nx) % ny, p // (nx * ny))

    # ---- patches -----------------------------------------------------------------------
    @contextlib.contextmanager
    def watching(self) -> Iterator["RaceWatch"]:
        it = _interp()
        B, G = it.InterpreterBuilder, it.GridExecutor
        saved = {n: getattr(B, n) for n in ("create_masked_load", "create_masked_store", "create_atomic_rmw",
                                            "create_atomic_cas", "create_barrier")}
        call = G.__call__
        watch = self

        def load(b, ptrs, mask, other, cache_policy, is_volatile):
            watch._record(ptrs, mask, READ)
            if other is None and mask is not None:  # masked-off lanes are undefined on a GPU, zeros here
                other = _garbage(ptrs)
            return saved["create_masked_load"](b, ptrs, mask, other, cache_policy, is_volatile)

        def store(b, ptrs, value, mask, cache_policy):
            watch._record(ptrs, mask, WRITE, value)
            return saved["create_masked_store"](b, ptrs, value, mask, cache_policy)

        def rmw(b, op, ptr, val, mask, sem, scope):
            watch._record(ptr, mask, ATOMIC)
            return saved["create_atomic_rmw"](b, op, ptr, val, mask, sem, scope)

        def cas(b, ptr, cmp, val, sem, scope):
            watch._record(ptr, None, ATOMIC)
            return saved["create_atomic_cas"](b, ptr, cmp, val, sem, scope)

        def barrier(b):
            watch._epoch += 1
            return saved["create_barrier"](b)

        def launch(g, *args, **kwargs):
            watch._acc, watch._kernel = [], getattr(g.fn, "__name__", "kernel")
            watch._set_ranges(args, kwargs)
            watch.launches += 1
            try:
                out = call(g, *args, **kwargs)
            except BaseException:
                watch._acc = watch._ranges = None
                raise
            watch._analyze()
            watch._ranges = None
            return out

        B.create_masked_load, B.create_masked_store = load, store
        B.create_atomic_rmw, B.create_atomic_cas, B.create_barrier = rmw, cas, barrier
        G.__call__ = launch
        try:
            yield self
        finally:
            for n, f in saved.items():
                setattr(B, n, f)
            G.__call__ = call
            self._acc = None


@contextlib.contextmanager
def program_order(order: str = "grid", seed: int = 0) -> Iterator[None]:
    """Run each interpreted launch's programs in `order`: "grid" (unchanged), "reverse", or
    "shuffle" (each grid axis permuted, seeded by `seed`). The lanes of each atomic update
    (`tl.atomic_*`, several lanes on one address included) are applied in the same kind of
    order, their returned old values put back in lane order: a kernel that takes "the first
    lane wins" from an atomic must not depend on which lane the interpreter happens to apply
    first. ValueError for another name."""
    if order not in ("grid", "reverse", "shuffle"):
        raise ValueError(f"program order must be grid, reverse or shuffle, got {order!r}")
    it = _interp()
    if order == "grid":
        yield
        return
    code = _LOOP_CODE[0]
    rng = random.Random(seed)
    had = "range" in it.__dict__
    old = it.__dict__.get("range")
    B = it.InterpreterBuilder
    rmw0, cas0 = B.create_atomic_rmw, B.create_atomic_cas

    def grid_range(*args):
        r = range(*args)
        if sys._getframe(1).f_code is not code:  # only the launch loop's ranges
            return r
        items = list(r)
        if order == "reverse":
            items.reverse()
        else:
            rng.shuffle(items)
        return items

    def lanes(h, shape, perm):
        d = np.broadcast_to(np.asarray(h.data), shape).reshape(-1)[perm].reshape(shape)
        return it.TensorHandle(np.ascontiguousarray(d), h.dtype)

    def permuted(apply, ptr, *hs):
        shape = np.shape(ptr.data)
        n = int(np.prod(shape))
        if n < 2:
            return apply(ptr, *hs)
        perm = np.arange(n)[::-1].copy() if order == "reverse" else np.array(rng.sample(range(n), n))
        out = apply(*(lanes(h, shape, perm) for h in (ptr, *hs)))
        back = np.empty_like(out.data.reshape(-1))
        back[perm] = out.data.reshape(-1)
        return it.TensorHandle(back.reshape(out.data.shape), out.dtype)

    def rmw(b, op, ptr, val, mask, sem, scope):
        return permuted(lambda p, v, m: rmw0(b, op, p, v, m, sem, scope), ptr, val, mask)

    def cas(b, ptr, cmp, val, sem, scope):
        return permuted(lambda p, c, v: cas0(b, p, c, v, sem, scope), ptr, cmp, val)

    it.range = grid_range
    B.create_atomic_rmw, B.create_atomic_cas = rmw, cas
    try:
        yield
    finally:
        B.create_atomic_rmw, B.create_atomic_cas = rmw0, cas0
        if had:
            it.range = old
        else:
            del it.range
