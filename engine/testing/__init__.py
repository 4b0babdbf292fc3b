"""Test and benchmark tools for the engine, never a serving default: FakeModelRunner (a
deterministic stand-in for the model with a cost model), NoWorkRunner (the host side of a step
without the model) and SimulatedClock (virtual time driven by a runner's modelled steps)."""

from engine.testing.clock import SimulatedClock
from engine.testing.fake_runner import CostModel, FakeModelRunner, fake_next_token
from engine.testing.no_work_runner import NoWorkRunner

__all__ = ["CostModel", "FakeModelRunner", "NoWorkRunner", "SimulatedClock", "fake_next_token"]
