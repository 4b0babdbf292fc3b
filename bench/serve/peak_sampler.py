"""The peak of a sampled figure over a span: a thread reads it every interval between start()
and stop(), and stop() returns each field's largest value (the benchmarks' memory peaks while
an attack runs)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["PeakSampler"]

# A dataclass of numbers (ServerRss, say): its peak is the largest value of each field.
SampleT = TypeVar("SampleT", bound="DataclassInstance")


class PeakSampler(Generic[SampleT]):
    """Calls read every every_s seconds in a thread between start() and stop(); sample()
    reads once, outside that thread."""

    def __init__(self, read: Callable[[], SampleT], every_s: float) -> None:
        self._read = read
        self._every_s = every_s
        self._peak: SampleT | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> SampleT:
        return self._read()

    def start(self) -> None:
        self._peak = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def stop(self) -> SampleT:
        """Each field's largest value since start()."""
        assert self._thread is not None
        self._stop.set()
        self._thread.join()
        assert self._peak is not None
        return self._peak

    def _run(self) -> None:
        while True:  # one sample at least, so that stop() has a peak to return
            sample = self._read()
            peak = self._peak
            self._peak = sample if peak is None else dataclasses.replace(peak, **{
                field.name: max(getattr(peak, field.name), getattr(sample, field.name))
                for field in dataclasses.fields(peak)
            })
            if self._stop.wait(self._every_s):
                return
