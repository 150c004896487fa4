"""`tests/conftest.py` fills every new uninitialized tensor with garbage (`_poisoned_empty`), so
that a read of an element nothing wrote fails a test instead of finding the zeros a fresh CPU
page often holds (a GPU's memory holds anything). These tests hold the fixture to it."""

import math
import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("GPU_SCHED_POISON_EMPTY") == "0",
                                reason="poisoning turned off by GPU_SCHED_POISON_EMPTY=0")


@pytest.mark.parametrize("dtype, want", [(torch.int64, -0x2152411021524111), (torch.int32, -0x21524111),
                                         (torch.int16, -0x4111),
                                         (torch.int8, -0x11), (torch.uint8, 0xEF), (torch.bool, True)])
def test_new_integer_and_bool_tensors_hold_the_poison(dtype, want):
    for t in (torch.empty(5, dtype=dtype), torch.empty_like(torch.zeros(5, dtype=dtype)),
              torch.zeros(1, dtype=dtype).new_empty(5)):
        assert t.tolist() == [want] * 5


def test_new_float_tensors_hold_nan_and_meta_tensors_pass_through():
    assert all(math.isnan(x) for x in torch.empty(4, dtype=torch.float64).tolist())
    assert torch.empty(3, device="meta").device.type == "meta"
    assert torch.empty(0, dtype=torch.int64).numel() == 0


def test_numpy_empty_holds_the_poison_too():
    assert np.empty(3, dtype=np.int64).tolist() == [-0x2152411021524111] * 3
    assert np.isnan(np.empty((2, 2))).all()
