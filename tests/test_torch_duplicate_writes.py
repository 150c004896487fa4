"""`tests/torch_duplicate_writes.py` flags the indexed writes whose result a GPU may not
reproduce (repeated destinations with different values, float sums into one place) and
passes the ones any order gives alike."""

import contextlib
import io

import pytest
import torch

from gpu_sched import cli, policy
from torch_duplicate_writes import DuplicateWriteWatch


def _ops(fn):
    w = DuplicateWriteWatch(raise_on_duplicate=False)
    with w:
        fn()
    return sorted({op for op, _ in w.found}), w


def test_scatter_with_a_repeated_index_and_different_values_is_flagged():
    x = torch.zeros(4, dtype=torch.int64)
    idx = torch.tensor([1, 2, 1])
    assert _ops(lambda: x.scatter_(0, idx, torch.tensor([5, 6, 7])))[0] == ["scatter_"]
    assert _ops(lambda: x.scatter_(0, idx, torch.tensor([5, 6, 5])))[0] == []  # the same value twice
    assert _ops(lambda: x.scatter_(0, idx, 9))[0] == []  # one scalar value
    assert _ops(lambda: torch.scatter(x, 0, torch.tensor([0, 3]), torch.tensor([1, 2])))[0] == []


def test_two_dimensional_scatter_compares_destinations_not_index_values():
    x = torch.zeros((2, 3), dtype=torch.int64)
    idx = torch.tensor([[0, 1, 2], [0, 1, 2]])  # row 0 and row 1 each a permutation: no repeat
    assert _ops(lambda: x.scatter_(1, idx, torch.arange(6).view(2, 3)))[0] == []
    idx = torch.tensor([[0, 0, 2], [0, 1, 2]])
    assert _ops(lambda: x.scatter_(1, idx, torch.arange(6).view(2, 3)))[0] == ["scatter_"]


def test_integer_reductions_pass_and_float_sums_into_one_place_are_flagged():
    idx = torch.tensor([0, 0, 1])
    ints = torch.zeros(2, dtype=torch.int64)
    floats = torch.zeros(2, dtype=torch.float64)
    assert _ops(lambda: ints.scatter_reduce_(0, idx, torch.tensor([3, 4, 5]), "amax"))[0] == []
    assert _ops(lambda: ints.index_add_(0, idx, torch.tensor([3, 4, 5])))[0] == []
    assert _ops(lambda: floats.index_add_(0, idx, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)))[0] == ["index_add_"]
    assert _ops(lambda: floats.scatter_add_(0, idx, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)))[0] == ["scatter_add_"]
    assert _ops(lambda: floats.scatter_reduce_(0, idx, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), "amax"))[0] == []


def test_index_put_setitem_index_copy_and_put_with_repeats_are_flagged():
    x = torch.zeros(5, dtype=torch.int64)
    idx = torch.tensor([4, 0, 4])

    def setitem():
        x[idx] = torch.tensor([1, 2, 3])

    assert _ops(setitem)[0] == ["__setitem__"]
    assert _ops(lambda: x.index_put_((idx,), torch.tensor([1, 2, 3])))[0] == ["index_put_"]
    assert _ops(lambda: x.index_put_((idx,), torch.tensor([1, 2, 3]), accumulate=True))[0] == []  # integer sum
    assert _ops(lambda: x.put_(idx, torch.tensor([1, 2, 3])))[0] == ["put_"]
    assert _ops(lambda: x.index_copy_(0, idx, torch.tensor([1, 2, 3])))[0] == ["index_copy_"]
    assert _ops(lambda: x.index_copy_(0, idx, torch.tensor([1, 2, 1])))[0] == []

    def mask():
        x[x > 0] = torch.tensor(7)

    assert _ops(mask)[0] == []


def test_a_flag_raises_by_default_naming_the_op():
    x = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(AssertionError, match=r"order-dependent indexed write on a GPU: scatter_ .* \(flat index 1\)"):
        with DuplicateWriteWatch():
            x.scatter_(0, torch.tensor([1, 1]), torch.tensor([2, 3]))


@pytest.mark.parametrize("args", [
    ["--policy", "lpm"],
    ["--policy", "dfs-weight", "--page-size", "4"],
    ["--policy", "fcfs", "--enable-priority-scheduling", "--priority-levels", "3", "--enable-priority-preemption",
     "--page-size", "4"],
    ["--policy", "lof", "--chunked-prefill-size", "256"],
    ["--policy", "routing-key", "--routing-keys", "8", "--capture", "64"],
])
def test_the_torch_forms_of_a_replay_write_no_order_dependent_repeats(args):
    """The torch backend's torch forms (what runs on CUDA and what a CUDA graph records) over
    a replay with queues: thousands of indexed writes, none that a GPU could resolve another
    way (on the CPU the host paths would stand in for most of them: forced off here)."""
    w = DuplicateWriteWatch(raise_on_duplicate=False)
    with policy.torch_forms(), w, contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["replay", "--backend", "torch", "--no-progress", "--limit", "120", "--rate-scale", "40"]
                        + args) == 0
    assert w.checked > 1000 and w.found == [] and w.unread == []
