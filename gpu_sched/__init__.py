"""gpu_sched: SGLang's request-scheduling policy with the queue, prefix tree and admission on the GPU."""

from .config import SchedulerConfig
from .plan import PrefillPlan
from .ratio import NewTokenRatio
from .request import Request

__version__ = "0.1.0"
__all__ = ["SchedulerConfig", "PrefillPlan", "NewTokenRatio", "Request", "__version__"]
