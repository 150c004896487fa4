"""The new-token ratio an engine passes to `step()` (SPEC R-DEC-1).

The schedulers do not track the ratio themselves: it depends on what the engine did since the
last step (decode steps, retractions, idle iterations), so it is `step(new_token_ratio=...)`'s
argument, as SGLang's scheduler loop owns `new_token_ratio`. `NewTokenRatio` is that
bookkeeping, ready to use: the engine calls `decay()` after each decode step that fitted,
`after_retraction(...)` after `retract_decode()`, and `reset()` on an iteration that runs no
batch; `value` is the ratio for the next `step()`. `gpu-sched replay` drives it this way.
"""

from __future__ import annotations

import numpy as np

from .config import RETRACT_DECODE_STEPS, _check_int
from .request import check_real

RATIO_DECAY_STEPS = 600  # R-DEC-1: decode steps from init down to the floor

__all__ = ["NewTokenRatio", "RATIO_DECAY_STEPS", "RETRACT_DECODE_STEPS"]


class NewTokenRatio:
    """R-DEC-1's new-token ratio: the share of a request's remaining `max_new_tokens` that
    admission reserves KV for (in (0, 1]).

    Starts at `init = min(0.7 * conservativeness, 1)`; each decode step without retraction
    lowers it by `(init - min_ratio) / 600` down to `min_ratio = 0.14 * init`; a retraction
    sets it (up or down) to `min(1, (sum out + 20 * n) / (sum max_new + 1))` over the n requests still
    running; an idle iteration puts it back to `init`.

    Args:
        conservativeness: `SchedulerConfig.schedule_conservativeness` (> 0; above 1/0.7 the
            initial ratio is capped at 1).

    Attributes:
        value: the ratio (float) to pass to `step(new_token_ratio=...)`.

    Raises:
        TypeError: a conservativeness that is not a real number (bools and strings too).
        ValueError: one that is not finite and > 0.
    """

    def __init__(self, conservativeness: float = 1.0):
        c = check_real("conservativeness", conservativeness, "a finite number > 0")
        if not c > 0 or c == float("inf"):
            raise ValueError(f"conservativeness must be a finite number > 0, got {conservativeness!r}")
        self.init = min(0.7 * c, 1.0)
        self.min_ratio = 0.14 * self.init
        self.decay_step = (self.init - self.min_ratio) / RATIO_DECAY_STEPS
        self.value = self.init

    @classmethod
    def from_config(cls, config) -> "NewTokenRatio":
        """The ratio for a `SchedulerConfig` (its `schedule_conservativeness`)."""
        return cls(config.schedule_conservativeness)

    def decay(self) -> None:
        """After a decode step in which every running request got its KV slot."""
        self.value = max(self.value - self.decay_step, self.min_ratio)

    def after_retraction(self, out_tokens: int, n_running: int, max_new_tokens: int) -> None:
        """After `retract_decode()`: `out_tokens` [tokens] and `max_new_tokens` [tokens] are
        sums over the `n_running` requests still running (output so far, and their caps).

        Raises (nothing changed) TypeError for a count that is not an int, ValueError for a
        negative sum or `n_running` < 1 (R-DEC-2 always keeps one request running; after an
        iteration with none, call `reset()`), or a sum past 2^126 (the sums of int64 counts over
        any number of requests fit; n_running past int64's largest)."""
        counts = [v.item() if isinstance(v, np.integer) else v for v in (out_tokens, n_running, max_new_tokens)]
        for name, v, lo in zip(("out_tokens", "n_running", "max_new_tokens"), counts, (0, 1, 0)):
            wide = name != "n_running"  # a sum over requests whose max_new_tokens each reach int64's largest
            _check_int(f"after_retraction: {name}", v, lo=lo, **(dict(hi=2**126, hi_is="2^126") if wide else {}))
        out_tokens, n_running, max_new_tokens = counts
        self.value = min(1.0, (out_tokens + RETRACT_DECODE_STEPS * n_running) / (max_new_tokens + 1))

    def reset(self) -> None:
        """After an iteration that ran no batch (nothing running and nothing admitted)."""
        self.value = self.init
