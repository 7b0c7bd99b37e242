"""The DeviceBackend seam (DESIGN §6): list devices and read their use, per process.

Only the host backend (psutil) is here so far, which the dashboard shows; the NVML and
simulated backends, placement and quotas belong to the device-isolation work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import psutil


@dataclass(frozen=True)
class DeviceUsage:
    name: str
    kind: str  # "cpu" or "gpu"
    utilization: float  # percent
    memory_total_mb: float
    memory_used_mb: float


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    memory_mb: float
    cpu_percent: float


class DeviceBackend(Protocol):
    def devices(self) -> list[DeviceUsage]: ...

    def process(self, pid: int) -> ProcessUsage | None: ...


class HostBackend:
    """The machine's CPUs and RAM, through psutil."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        psutil.cpu_percent(None)  # the first reading primes the counter

    def devices(self) -> list[DeviceUsage]:
        memory = psutil.virtual_memory()
        return [
            DeviceUsage(
                f"cpu ({psutil.cpu_count()} cores)",
                "cpu",
                psutil.cpu_percent(None),
                memory.total / 2**20,
                (memory.total - memory.available) / 2**20,
            )
        ]

    def process(self, pid: int) -> ProcessUsage | None:
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
                proc.cpu_percent(None)
            return ProcessUsage(pid, proc.memory_info().rss / 2**20, proc.cpu_percent(None))
        except psutil.Error:
            self._procs.pop(pid, None)
            return None
