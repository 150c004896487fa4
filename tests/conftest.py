"""Shared test setup: deterministic seeds (STYLE practice 8) and the hypothesis profile."""

import random

import numpy as np
import pytest
from hypothesis import settings

# No per-example deadline: CI machines are shared and timing is not what the properties test.
settings.register_profile("gpu_sched", deadline=None)
settings.load_profile("gpu_sched")


@pytest.fixture(autouse=True)
def _seed_everything():
    """Seed `random` and numpy's legacy global generator before every test."""
    random.seed(1234)
    np.random.seed(1234)
    yield
