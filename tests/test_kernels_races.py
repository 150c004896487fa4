"""The interpreter's race watch (`tests/interp_races.py`) finds the races it claims to find.

`tests/conftest.py` runs every test under it (Triton's interpreter, i.e. no CUDA): each
interpreted launch is watched, and its programs run in grid, reverse or shuffled order, chosen
per test. These tests hold the watch itself to account on small kernels written to race (or
not), so that a clean run of the suite means something."""

import os

import pytest
import torch

pytestmark = [pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="the race watch patches Triton's interpreter"),
              pytest.mark.no_race_watch]

triton = pytest.importorskip("triton")
tl = triton.language

from interp_races import RaceWatch, program_order, supported  # noqa: E402

if not supported():
    pytest.skip("this Triton's interpreter lacks what the race watch patches", allow_module_level=True)


@triton.jit
def _next_block_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Each program reads what the next program stores: a cross-program race."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)
    nxt = offs + BLOCK
    tl.store(x_ptr + offs, tl.load(out_ptr + nxt, mask=nxt < n, other=0), mask=m)


@triton.jit
def _halves_kernel(out_ptr, BLOCK: tl.constexpr):
    """Lanes 2i and 2i+1 store different values to out[i]: which one wins is unspecified."""
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs // 2, offs)


@triton.jit
def _same_value_kernel(flag_ptr, out_ptr, BLOCK: tl.constexpr):
    """Every program sets one flag to 1 (order cannot show) and counts itself atomically."""
    tl.store(flag_ptr, 1)
    tl.atomic_add(out_ptr + tl.arange(0, BLOCK) * 0, 1)


@triton.jit
def _peek_counter_kernel(cnt_ptr, out_ptr):
    """Every program counts itself atomically and reads the counter plainly: what it reads
    depends on how many programs got there first."""
    tl.atomic_add(cnt_ptr, 1)
    tl.store(out_ptr + tl.program_id(0), tl.load(cnt_ptr))


@triton.jit
def _read_back_kernel(x_ptr, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    """One program stores a block and reads it back reversed: other threads' values."""
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, offs)
    if BARRIER:
        tl.debug_barrier()
    tl.store(x_ptr + BLOCK + offs, tl.load(x_ptr + BLOCK - 1 - offs))


@triton.jit
def _overwrite_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    """One program loads a block, then stores over it shifted by one lane."""
    offs = tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs)
    if BARRIER:
        tl.debug_barrier()
    tl.store(x_ptr + (offs + 1) % BLOCK, v * 2)
    tl.store(out_ptr + offs, v)


@triton.jit
def _rmw_kernel(x_ptr, n, BLOCK: tl.constexpr):
    """Each lane adds one to its own element: an elementwise read-modify-write."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1, mask=m)


@triton.jit
def _arrival_kernel(counter_ptr, out_ptr):
    """Program p takes the next ticket and writes p there: out lists the programs as run."""
    slot = tl.atomic_add(counter_ptr, 1)
    tl.store(out_ptr + slot, tl.program_id(0))


@triton.jit
def _tickets_kernel(counter_ptr, out_ptr, BLOCK: tl.constexpr):
    """Every lane takes a ticket from one counter: the tickets show the lanes' atomic order."""
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.atomic_add(counter_ptr + offs * 0, 1))


@triton.jit
def _claim_min_kernel(claim_ptr, won_ptr, BLOCK: tl.constexpr):
    """Lanes claim slot offs % 4 by atomic_min of their index: the smallest wins in any order."""
    offs = tl.arange(0, BLOCK)
    tl.atomic_min(claim_ptr + offs % 4, offs)


@triton.jit
def _shift_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """out[i] = x[i + 1]: reads one element past x unless the mask stops it."""
    offs = tl.arange(0, BLOCK)
    m = offs < n
    if MASKED:
        v = tl.load(x_ptr + offs + 1, mask=(offs + 1) < n, other=0)
    else:
        v = tl.load(x_ptr + offs + 1, mask=m)
    tl.store(out_ptr + offs, v, mask=m)


@triton.jit
def _masked_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, OTHER: tl.constexpr):
    """The sum of x[:n] over a block of BLOCK lanes: right only if the masked-off lanes are 0."""
    offs = tl.arange(0, BLOCK)
    if OTHER:
        v = tl.load(x_ptr + offs, mask=offs < n, other=0)
    else:
        v = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr, tl.sum(v, axis=0))


def _watch(fn):
    w = RaceWatch()
    with w.watching():
        fn()
    return w


def test_a_program_reading_another_programs_store_is_a_race():
    x, out = torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
    w = _watch(lambda: _next_block_kernel[(4,)](x, out, 64, BLOCK=16))
    assert w.launches == 1
    assert w.races and all(r.kernel == "_next_block_kernel" for r in w.races)
    assert "another program" in w.races[0].what and len(w.races[0].programs) == 2


def test_two_lanes_of_one_store_writing_different_values_is_a_race():
    w = _watch(lambda: _halves_kernel[(1,)](torch.zeros(8, dtype=torch.int64), BLOCK=16))
    assert [r.what for r in w.races] == ["one store's lanes write different values"]


def test_same_value_stores_and_atomics_across_programs_are_not_races():
    flag, cnt = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    w = _watch(lambda: _same_value_kernel[(5,)](flag, cnt, BLOCK=4))
    assert w.races == [] and int(cnt) == 20 and int(flag) == 1


def test_a_plain_load_of_what_other_programs_update_atomically_is_a_race():
    cnt, out = torch.zeros(1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    w = _watch(lambda: _peek_counter_kernel[(3,)](cnt, out))
    assert [r.what for r in w.races] == ["an atomic update and another program's load"]
    assert len(w.races[0].programs) == 3


@pytest.mark.parametrize("barrier", [False, True])
def test_a_read_back_within_one_program_needs_a_barrier(barrier):
    x = torch.zeros(32, dtype=torch.int64)
    w = _watch(lambda: _read_back_kernel[(1,)](x, BLOCK=16, BARRIER=barrier))
    assert x[16:].tolist() == list(range(15, -1, -1))  # the interpreter runs it in order either way
    assert [r.what for r in w.races] == ([] if barrier else
                                         ["a load reads back the same program's store with no barrier between"])


@pytest.mark.parametrize("barrier", [False, True])
def test_a_store_over_another_lanes_load_within_one_program_needs_a_barrier(barrier):
    x, out = torch.arange(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    w = _watch(lambda: _overwrite_kernel[(1,)](x, out, BLOCK=16, BARRIER=barrier))
    assert [r.what for r in w.races] == ([] if barrier else
                                         ["a store overwrites what the same program loaded, no barrier between"])


def test_an_elementwise_read_modify_write_is_no_race_and_is_listed():
    x = torch.zeros(40, dtype=torch.int64)
    w = _watch(lambda: _rmw_kernel[(3,)](x, 40, BLOCK=16))
    assert w.races == [] and x.tolist() == [1] * 40
    assert w.rmw_kernels == {"_rmw_kernel"}


@pytest.mark.parametrize("masked", [False, True])
def test_an_access_outside_every_tensor_argument_is_reported(masked):
    x, out = torch.arange(16, dtype=torch.int64), torch.zeros(16, dtype=torch.int64)
    w = _watch(lambda: _shift_kernel[(1,)](x, out, 16, BLOCK=16, MASKED=masked))
    assert [r.what for r in w.races] == ([] if masked else ["an out-of-bounds load"])
    if not masked:
        assert w.races[0].address == x.data_ptr() + 16 * 8


@pytest.mark.parametrize("other", [False, True])
def test_masked_off_lanes_without_other_hold_garbage_under_the_watch(other):
    x, out = torch.arange(1, 11, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    _masked_sum_kernel[(1,)](x, out, 10, BLOCK=16, OTHER=other)
    assert int(out) == 55  # the interpreter's zeros, outside the watch
    w = _watch(lambda: _masked_sum_kernel[(1,)](x, out, 10, BLOCK=16, OTHER=other))
    assert w.races == [] and (int(out) == 55) == other


def test_raise_on_race_names_the_kernel_and_the_watch_comes_off():
    x, out = torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
    with pytest.raises(AssertionError, match="data race: _next_block_kernel"):
        with RaceWatch(raise_on_race=True).watching():
            _next_block_kernel[(4,)](x, out, 64, BLOCK=16)
    w = RaceWatch()
    _next_block_kernel[(4,)](x, out, 64, BLOCK=16)  # outside any watch: nothing recorded
    assert w.launches == 0 and w.races == []


@pytest.mark.parametrize("order", ["grid", "reverse", "shuffle"])
def test_program_order_runs_the_programs_in_that_order(order):
    n = 12
    cnt, out = torch.zeros(1, dtype=torch.int32), torch.full((n,), -1, dtype=torch.int32)
    with program_order(order, seed=3):
        _arrival_kernel[(n,)](cnt, out)
    ran = out.tolist()
    assert sorted(ran) == list(range(n))
    if order == "grid":
        assert ran == list(range(n))
    elif order == "reverse":
        assert ran == list(range(n))[::-1]
    else:
        assert ran != list(range(n)) and ran != list(range(n))[::-1]
    with program_order("grid"):  # the patch is gone after each
        cnt.zero_()
        _arrival_kernel[(n,)](cnt, out)
    assert out.tolist() == list(range(n))


@pytest.mark.parametrize("order", ["grid", "reverse", "shuffle"])
def test_program_order_applies_an_atomics_lanes_in_that_order(order):
    cnt, out = torch.zeros(1, dtype=torch.int32), torch.full((8,), -1, dtype=torch.int32)
    with program_order(order, seed=5):
        _tickets_kernel[(1,)](cnt, out, BLOCK=8)
    tickets = out.tolist()
    assert sorted(tickets) == list(range(8)) and int(cnt) == 8
    assert (tickets == list(range(8))) == (order == "grid")
    assert (tickets == list(range(8))[::-1]) == (order == "reverse")
    claim = torch.full((4,), 99, dtype=torch.int32)
    with program_order(order, seed=5):
        _claim_min_kernel[(1,)](claim, claim, BLOCK=16)
    assert claim.tolist() == [0, 1, 2, 3]  # "first wins" by value does not depend on the order


def test_program_order_changes_a_racy_kernels_result():
    def run(order):
        x, out = torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64)
        with program_order(order, seed=0):
            _next_block_kernel[(4,)](x, out, 64, BLOCK=16)
        return x.tolist()

    assert run("grid") != run("reverse")


def test_program_order_rejects_an_unknown_order():
    with pytest.raises(ValueError, match="program order must be grid, reverse or shuffle, got 'random'"):
        with program_order("random"):
            pass
