"""SimulatedClock: virtual time that only moves when told to (a runner's modelled step time)."""

from __future__ import annotations

__all__ = ["SimulatedClock"]


class SimulatedClock:
    """A clock for LLMEngine(clock=...): reads `now`, moved by advance() (e.g. the fake
    runner's advance_clock), so tests and simulations never sleep."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
