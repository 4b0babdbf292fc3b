"""ManualClock: a monotonic clock the test moves by hand, for code that takes `clock=`.

Shared by the policies and gateway tests. engine.testing.clock.SimulatedClock is the engine's
own (it starts at 0 and names its reading `now`); this one starts where the test says.
"""

from __future__ import annotations

__all__ = ["ManualClock"]


class ManualClock:
    """Reads `now_s` when called; moved by advance() or by setting `now_s`."""

    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
