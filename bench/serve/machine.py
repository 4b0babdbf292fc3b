"""The machine a benchmark ran on, as the report states it."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["CpuTicks", "MachineInfo", "read_cpu_ticks"]


@dataclass(frozen=True)
class MachineInfo:
    cpu_model: str  # /proc/cpuinfo's model name ("unknown" elsewhere)
    num_cpus: int  # CPUs this process may run on
    memory_gib: float  # physical memory (0 when unknown)
    system: str  # kernel and architecture
    python: str
    torch: str
    started_at: str  # UTC, ISO 8601, to the second
    load_average_1m: float  # at the start: other work on the machine

    @classmethod
    def current(cls) -> MachineInfo:
        import torch

        return cls(
            cpu_model=_cpu_model(),
            num_cpus=len(os.sched_getaffinity(0)),
            memory_gib=_memory_gib(),
            system=f"{platform.system()} {platform.release()} {platform.machine()}",
            python=platform.python_version(),
            torch=torch.__version__,
            started_at=datetime.now(UTC).replace(microsecond=0).isoformat(),
            load_average_1m=os.getloadavg()[0],
        )


@dataclass(frozen=True)
class CpuTicks:
    """The machine's CPU time since boot from /proc/stat, in clock ticks: all of it, and the
    part the hypervisor gave to other guests while this one wanted to run (steal)."""

    total: int
    steal: int

    def steal_share_since(self, earlier: CpuTicks) -> float | None:
        """Steal over all CPU time between two readings (None: no time passed)."""
        total = self.total - earlier.total
        return (self.steal - earlier.steal) / total if total > 0 else None


def read_cpu_ticks() -> CpuTicks | None:
    """None where /proc/stat is not available."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    # user nice system idle iowait irq softirq steal (guest time is already in user)
    ticks = [int(f) for f in fields[1:9]]
    return CpuTicks(total=sum(ticks), steal=ticks[7])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0
