"""A speed-up measured over several timed runs: its median, its range, and whether the runs can tell at all.

One timed run on a shared machine can say anything (0.40x and 12.21x for the same command on one loaded 2-core
CPU), so `eagle-mm bench` and `eagle-mm demo` time several and report the median with the range, and say so in
words when the range is too wide to tell.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Spread", "NOISE_RATIO"]

# Runs whose fastest and slowest speed-ups differ by more than this factor tell too little to quote: on a quiet
# machine repeated runs of one command agree far better than this.
NOISE_RATIO = 1.5


@dataclass(frozen=True)
class Spread:
    """Speed-ups (speculative over plain, > 1 is faster) of ``runs`` timed runs."""

    median: float
    low: float
    high: float
    runs: int

    def __post_init__(self):
        if self.runs < 1 or not 0 < self.low <= self.median <= self.high:
            raise ValueError(f"expected runs >= 1 and 0 < low <= median <= high, got {self}")

    @classmethod
    def of(cls, speedups: Sequence[float]) -> "Spread":
        values = [float(v) for v in speedups]
        if not values:
            raise ValueError("no timed runs to summarise")
        return cls(statistics.median(values), min(values), max(values), len(values))

    @property
    def noisy(self) -> bool:
        """True when the runs spread too widely to tell the speed-up (a tight range around 1x says "the same
        speed", which is an answer)."""
        return self.high > NOISE_RATIO * self.low

    def describe(self) -> str:
        """``1.23x (median of 3 runs, 1.10x to 1.31x)``."""
        if self.runs == 1:
            return f"{self.median:.2f}x (one timed run)"
        return f"{self.median:.2f}x (median of {self.runs} runs, {self.low:.2f}x to {self.high:.2f}x)"

    def warning(self, more: str) -> str | None:
        """A plain sentence when the runs cannot tell the speed-up, else None. ``more``: how to time more."""
        if self.runs == 1:
            return f"one timed run says little on a shared machine; {more}"
        if not self.noisy:
            return None
        return (f"too noisy to tell: the {self.runs} runs ranged from {self.low:.2f}x to {self.high:.2f}x (more than "
                f"{NOISE_RATIO:g}x apart); the machine is too busy (or the runs too short) to measure a speed-up: "
                f"rerun on a quiet machine, or {more}")
