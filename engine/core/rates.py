"""Rates the engine measures for the queue-wait estimate: what its steps drain, how fast
places in the batch free up, and what each tier brings in."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Steps kept for the prefill and decode rates.
_RATE_WINDOW_STEPS = 64
# Steps kept for the rate running requests leave the batch at: fewer requests leave a full
# batch than steps run, so _RATE_WINDOW_STEPS steps would hold too few of them for a steady
# rate.
_FINISH_WINDOW_STEPS = 256
# Seconds of arrivals the per-tier arrival rates are taken over.
_ARRIVAL_WINDOW_S = 5.0


class StepRates:
    """Measured throughput over the last steps, per second of wall time while the engine was
    busy (each step counts for the time since the step before it, when there was no idle time
    between them).

    The prefill rate is taken over steps that had prefill work waiting, including steps that
    ran none (KV full, budget spent on decodes): it is the rate at which the backlog drains.
    It counts the prompt tokens a step took off the backlog, computed or not: the backlog
    counts whole prompts, and a prompt found in the prefix cache leaves it with little
    computed (counting computed tokens only, warm-up rounds of one shared 300-token prompt
    read as a fifth to a third of their drain rate on a loaded CPU host, and the test of
    shedding saw its own warm-up shed).
    The finish rate counts running requests that left the batch (finished or aborted) per
    second: the rate at which places free up for waiting requests.
    """

    def __init__(
        self,
        window_steps: int = _RATE_WINDOW_STEPS,
        finish_window_steps: int = _FINISH_WINDOW_STEPS,
    ) -> None:
        # (prompt tokens drained, decode tokens, seconds, had a prefill backlog)
        self._steps: deque[tuple[int, int, float, bool]] = deque(maxlen=window_steps)
        # (requests that left the batch, seconds)
        self._finishes: deque[tuple[int, float]] = deque(maxlen=finish_window_steps)

    def record(
        self,
        num_drained_tokens: int,
        num_decode_tokens: int,
        seconds: float,
        had_backlog: bool = True,
        num_finished: int = 0,
    ) -> None:
        """num_drained_tokens: prompt tokens the step computed or found in the prefix cache."""
        self._steps.append((num_drained_tokens, num_decode_tokens, seconds, had_backlog))
        self._finishes.append((num_finished, seconds))

    @property
    def prefill_tokens_per_s(self) -> float | None:
        steps = [s for s in self._steps if s[3]]
        seconds = sum(s[2] for s in steps)
        return sum(s[0] for s in steps) / seconds if seconds > 0 else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        steps = [s for s in self._steps if s[1] > 0]
        seconds = sum(s[2] for s in steps)
        return sum(s[1] for s in steps) / seconds if seconds > 0 else None

    @property
    def finished_requests_per_s(self) -> float | None:
        """None until some request has left the batch."""
        num_finished = sum(n for n, _ in self._finishes)
        seconds = sum(t for _, t in self._finishes)
        return num_finished / seconds if num_finished and seconds > 0 else None

    @property
    def mean_step_time_s(self) -> float | None:
        return sum(s[2] for s in self._steps) / len(self._steps) if self._steps else None


@dataclass(frozen=True)
class Arrivals:
    """What one tier brought in per second, lately."""

    requests_per_s: float
    prompt_tokens_per_s: float


class ArrivalRates:
    """Requests and prompt tokens arriving per second, per priority, over the last seconds.

    Under priorities a queued request is served only with what the more important tiers leave,
    and they keep arriving while it waits: a standard request behind a backlog B, with
    premium prompts arriving at a rate a, waits B / (rate - a), not B / rate (measured
    cases: ops/bench/journal.md, runs 5-6 and 12-15).
    """

    def __init__(self, window_s: float = _ARRIVAL_WINDOW_S) -> None:
        self._window_s = window_s
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (seconds, priority, tokens)
        self._requests: dict[int, int] = {}  # priority -> requests in _arrivals
        self._tokens: dict[int, int] = {}  # priority -> prompt tokens in _arrivals
        self._first_s: float | None = None  # the first arrival ever seen

    def record(self, priority: int, num_tokens: int, now_s: float) -> None:
        if self._first_s is None:
            self._first_s = now_s
        self._arrivals.append((now_s, priority, num_tokens))
        self._requests[priority] = self._requests.get(priority, 0) + 1
        self._tokens[priority] = self._tokens.get(priority, 0) + num_tokens
        self._forget_before(now_s - self._window_s)

    def rates(self, now_s: float) -> dict[int, Arrivals]:
        """By priority, over the window (over the time since the first arrival while that is
        shorter, but at least a second)."""
        self._forget_before(now_s - self._window_s)
        if self._first_s is None:
            return {}
        span_s = max(1.0, min(self._window_s, now_s - self._first_s))
        return {
            p: Arrivals(self._requests[p] / span_s, self._tokens[p] / span_s)
            for p in self._requests
        }

    def _forget_before(self, cutoff_s: float) -> None:
        while self._arrivals and self._arrivals[0][0] < cutoff_s:
            _, priority, num_tokens = self._arrivals.popleft()
            self._tokens[priority] -= num_tokens
            self._requests[priority] -= 1
            if not self._requests[priority]:
                del self._requests[priority]
                del self._tokens[priority]
