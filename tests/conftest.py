"""Shared test setup: deterministic seeds (STYLE practice 8) and the hypothesis profile."""

import os
import random
import warnings
import zlib

import numpy as np
import pytest
import torch
from hypothesis import settings

from interp_races import garbage

# Without CUDA the Triton kernels can only run in Triton's interpreter, and a kernel module is
# decorated (interpreted or compiled) once, when first imported: choose before any test module
# imports one, so the order in which files run cannot matter.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tensors in tests are small: one intra-op thread avoids thread start-up and contention
# costs that dominate tiny CPU ops (and keeps timings stable on shared 2-core machines).
torch.set_num_threads(1)

# No per-example deadline: CI machines are shared and timing is not what the properties test.
settings.register_profile("gpu_sched", deadline=None)
settings.load_profile("gpu_sched")


@pytest.fixture(autouse=True)
def _seed_everything():
    """Seed `random` and numpy's legacy global generator before every test."""
    random.seed(1234)
    np.random.seed(1234)
    yield


#: program orders the race watch rotates through, one per test (`_interpreter_races`)
_PROGRAM_ORDERS = ("grid", "reverse", "shuffle")


@pytest.fixture(autouse=True)
def _interpreter_races(request):
    """In Triton's interpreter (TRITON_INTERPRET=1, i.e. no CUDA), every launch of a test is
    watched for data races, which fail the test, and its programs run in grid, reverse or
    shuffled order, one order per test chosen from its id (`tests/interp_races.py`): a kernel
    that passes only in the interpreter's grid order, or that combines results across
    programs or threads without atomics or a barrier, fails here rather than on a GPU.
    GPU_SCHED_RACE_CHECK=0 turns it off; GPU_SCHED_PROGRAM_ORDER=grid|reverse|shuffle runs
    every test in that order; GPU_SCHED_PROGRAM_SEED=k draws other orders (and shuffles).
    Tests marked `no_race_watch` (the watch's own) run without."""
    if (os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("GPU_SCHED_RACE_CHECK") == "0"
            or request.node.get_closest_marker("no_race_watch")):
        yield
        return
    from interp_races import RaceWatch, program_order, supported

    if not supported():  # another Triton's interpreter: run the test as it is (test_kernels_races skips)
        warnings.warn("tests/interp_races.py: this Triton's interpreter lacks what the race watch patches; "
                      "tests run without it")
        yield
        return
    key = zlib.crc32(request.node.nodeid.encode()) ^ int(os.environ.get("GPU_SCHED_PROGRAM_SEED", "0"))
    order = os.environ.get("GPU_SCHED_PROGRAM_ORDER") or _PROGRAM_ORDERS[key % 3]
    with RaceWatch(raise_on_race=True).watching(), program_order(order, seed=key):
        yield


def _poison(t: torch.Tensor) -> torch.Tensor:
    """Fill t with `interp_races.garbage` of its dtype (a Python number: a fill that a CUDA
    graph being recorded can take)."""
    if t.device.type == "meta" or not t.numel():
        return t
    if t.dtype.is_floating_point or t.dtype.is_complex:  # NaN (also for dtypes numpy lacks, bfloat16)
        return t.fill_(float("nan"))
    return t.fill_(np.asarray(garbage(torch.zeros(0, dtype=t.dtype).numpy().dtype)).item())


def _poison_np(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind in "fcbiu":
        a.fill(garbage(a.dtype))
    return a


@pytest.fixture(autouse=True)
def _poisoned_empty(monkeypatch, request):
    """`torch.empty`, `torch.empty_like`, `Tensor.new_empty` and `np.empty` return arrays
    filled with garbage (NaN, True, 0xDEADBEEF...): a read of an element nothing wrote gives a
    wrong answer in every test rather than whatever the allocator left there (often zeros on
    a CPU, anything on a GPU). GPU_SCHED_POISON_EMPTY=0 turns it off; tests marked
    `no_poison` (those that count torch ops) run without."""
    if os.environ.get("GPU_SCHED_POISON_EMPTY") == "0" or request.node.get_closest_marker("no_poison"):
        yield
        return
    empty, empty_like, new_empty, np_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty, np.empty
    monkeypatch.setattr(np, "empty", lambda *a, **k: _poison_np(np_empty(*a, **k)))

    def live():
        return not torch.compiler.is_compiling()

    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(empty(*a, **k)) if live() else empty(*a, **k))
    monkeypatch.setattr(torch, "empty_like",
                        lambda *a, **k: _poison(empty_like(*a, **k)) if live() else empty_like(*a, **k))
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *a, **k: _poison(new_empty(self, *a, **k)) if live() else new_empty(self, *a, **k))
    yield


@pytest.fixture
def cuda_default_device():
    """Tests written with host tensors (torch.tensor(...) without a device) run their tensors
    on CUDA when it is there: compiled Triton kernels need CUDA tensors."""
    if not torch.cuda.is_available():
        yield
        return
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(None)


@pytest.fixture
def cpu_default_device(cuda_default_device):
    """For tests of host forms and host-side checks (numpy, values read on the CPU) in modules
    that use `cuda_default_device`: their tensors stay on the CPU (set after that fixture's
    CUDA default, whatever the order of the marks)."""
    prev = torch.get_default_device()
    torch.set_default_device("cpu")
    yield
    # None, not "cpu", where nothing was set before: no default-device hook left behind
    torch.set_default_device(None if prev.type == "cpu" else prev)


class _NoMemoryNumpy:
    """numpy, except that `arange` fails as an allocation past the host's memory does."""

    def __getattr__(self, name):
        return getattr(np, name)

    @staticmethod
    def arange(*args, **kwargs):
        raise MemoryError("Unable to allocate")


@pytest.fixture
def kv_pool_out_of_memory(monkeypatch):
    """The KV pool's free list cannot be allocated: a stand-in for a host out of memory (a real
    allocation of 2^40 slots could be granted lazily where the kernel overcommits, then fill
    RAM)."""
    from gpu_sched.reference import radix_cache

    monkeypatch.setattr(radix_cache, "np", _NoMemoryNumpy())
