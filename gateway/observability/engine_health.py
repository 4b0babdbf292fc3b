"""The engine as the runtime's supervisor sees it: up or not, restarts, and how long it has
been down (what /health/live, the metrics and the engine-down alert read)."""

from __future__ import annotations

from dataclasses import dataclass

# How often the supervisor checks that the engine runs.
ENGINE_CHECK_INTERVAL_S = 0.5
# Waits between failed restarts: doubling from the first to the last.
RESTART_BACKOFF_S = (1.0, 30.0)
# A replica whose engine has been down this long is not alive: /health/live answers 503, so
# the orchestrator replaces the whole process (and the accelerator it holds).
ENGINE_DOWN_LIVENESS_S = 120.0


@dataclass(frozen=True)
class EngineHealth:
    is_up: bool = False  # an engine is loaded and its loop takes requests
    # Engines loaded since start: 1 after the first load, +1 each restart (counters of the
    # engine's statistics start again from 0 with each).
    generation: int = 0
    num_restarts: int = 0  # restarts that gave a running engine
    num_failed_restarts: int = 0  # restarts whose load raised
    down_for_s: float | None = None  # since the loaded engine stopped; None while up

    @property
    def is_alive(self) -> bool:
        """False once the engine has been down longer than ENGINE_DOWN_LIVENESS_S."""
        return self.down_for_s is None or self.down_for_s < ENGINE_DOWN_LIVENESS_S
