"""Shared test setup: deterministic seeds (STYLE practice 8) and the hypothesis profile."""

import random

import numpy as np
import pytest
import torch
from hypothesis import settings

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
