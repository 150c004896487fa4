"""gpu_sched: SGLang's request-scheduling policy with the queue, prefix tree and admission on the GPU."""

from typing import TYPE_CHECKING

from .config import SchedulerConfig
from .plan import PrefillPlan
from .ratio import NewTokenRatio
from .request import Request

if TYPE_CHECKING:  # what type checkers and IDEs see of the lazy names below
    from .reference import ReferenceScheduler
    from .scheduler import GpuScheduler

__version__ = "0.1.0"
__all__ = ["SchedulerConfig", "PrefillPlan", "NewTokenRatio", "Request", "GpuScheduler", "ReferenceScheduler",
           "__version__"]

# the schedulers on first use (PEP 562): `import gpu_sched` stays light (no torch import)
_LAZY = {"GpuScheduler": ".scheduler", "ReferenceScheduler": ".reference"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
