"""A one-line progress bar on stderr: requests finished, shed and failed, elapsed time."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ProgressBar"]

_WIDTH = 30  # characters of the bar itself
_MIN_REDRAW_S = 0.25  # redraw at most this often (the bar must not cost the client CPU)


class ProgressBar:
    def __init__(
        self, num_total: int, label: str = "", *, enabled: bool = True, stream: TextIO | None = None
    ) -> None:
        self.num_total = num_total
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.num_done = 0
        self.num_shed = 0
        self.num_failed = 0
        self._started = time.monotonic()
        self._drawn_at = 0.0
        self._draw(force=True)

    def advance(self, *, is_shed: bool = False, is_failed: bool = False) -> None:
        self.num_done += 1
        self.num_shed += is_shed
        self.num_failed += is_failed
        self._draw(force=self.num_done == self.num_total)

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, *, force: bool) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._drawn_at < _MIN_REDRAW_S):
            return
        self._drawn_at = now
        filled = _WIDTH * self.num_done // max(1, self.num_total)
        bar = "#" * filled + "." * (_WIDTH - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {self.num_done}/{self.num_total} done, "
            f"{self.num_shed} shed, {self.num_failed} failed, {now - self._started:.0f} s"
        )
        self.stream.flush()
