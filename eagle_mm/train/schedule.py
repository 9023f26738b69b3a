"""The learning-rate schedule of a training run, and the pace keeper that fits it into a time limit."""
from __future__ import annotations

import math
import time

__all__ = ["Schedule", "Pace"]


class Schedule:
    """The learning-rate factor: linear warm-up over ``warmup_ratio`` of ``total`` steps to 1, then cosine down to
    ``floor`` at ``total``. A time-limited run re-sets ``total`` as it learns its pace (``Pace``); LambdaLR keeps
    this object's attributes in its state, so a resumed run continues the same curve."""

    def __init__(self, total: int, warmup_ratio: float, floor: float):
        self.total, self.warmup_ratio, self.floor = total, warmup_ratio, floor

    def __call__(self, step: int) -> float:
        warmup = round(self.warmup_ratio * self.total)
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, self.total - warmup)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


_clock = time.perf_counter


class Pace:
    """A run limited to ``seconds``: after every step, the schedule's length becomes the steps done plus those that
    the seconds left hold at the pace measured since step ``start + SKIP`` (the first steps pay for allocation and
    kernel selection, and would make the estimate too slow), at most ``cap``. Out of time, the length is the steps
    done: the run ends there, with the learning rate at its floor."""

    SKIP = 3

    def __init__(self, seconds: float, schedule: Schedule, start: int, cap: int):
        self.seconds, self.schedule, self.cap = seconds, schedule, cap
        self.t0, self.mark = _clock(), None
        self.first = start + self.SKIP

    def after(self, done: int) -> None:
        now = _clock()
        left = self.seconds - (now - self.t0)
        if left <= 0:
            self.schedule.total = done
        elif done == self.first:
            self.mark = now
        elif self.mark is not None:
            per_step = (now - self.mark) / (done - self.first)
            self.schedule.total = min(self.cap, done + int(left / max(per_step, 1e-9)))
