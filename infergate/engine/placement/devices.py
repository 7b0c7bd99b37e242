"""The DeviceBackend seam: list devices and read their use, per process.

- HostBackend: the machine's CPUs and RAM, through psutil (no GPU).
- NvmlBackend: NVIDIA GPUs through nvidia-ml-py; chosen when a GPU answers.
- SimulatedGpuBackend: N GPUs of given sizes, for tests and demos on a machine without
  one; a worker's use of "its GPU" is its resident memory, which is what the worker really
  allocates, so kills and placement behave as on real hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import psutil


@dataclass(frozen=True)
class DeviceUsage:
    name: str  # "cpu", "cuda:0", "sim:1"
    kind: str  # "cpu" or "gpu"
    utilization: float  # percent
    memory_total_mb: float
    memory_used_mb: float
    index: int | None = None  # the GPU's index, for CUDA_VISIBLE_DEVICES
    temperature_c: float | None = None
    power_w: float | None = None


@dataclass(frozen=True)
class ProcessUsage:
    pid: int
    memory_mb: float  # on the device the process runs on
    cpu_percent: float


class DeviceBackend(Protocol):
    name: str

    def devices(self) -> list[DeviceUsage]: ...

    def process(self, pid: int) -> ProcessUsage | None: ...

    def assign(self, pid: int, device: str) -> None:
        """A worker now runs on `device` (only the simulated backend needs telling)."""
        ...


class _Processes:
    """psutil handles kept per pid, so cpu_percent measures between two calls."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def rss(self, pid: int) -> tuple[float, float] | None:
        try:
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
                proc.cpu_percent(None)
            return proc.memory_info().rss / 2**20, proc.cpu_percent(None)
        except psutil.Error:
            self._procs.pop(pid, None)
            return None


def _host_cpu() -> DeviceUsage:
    memory = psutil.virtual_memory()
    return DeviceUsage(
        "cpu",
        "cpu",
        psutil.cpu_percent(None),
        memory.total / 2**20,
        (memory.total - memory.available) / 2**20,
    )


class HostBackend:
    name = "host"

    def __init__(self) -> None:
        self._procs = _Processes()
        psutil.cpu_percent(None)  # the first reading primes the counter

    def devices(self) -> list[DeviceUsage]:
        return [_host_cpu()]

    def process(self, pid: int) -> ProcessUsage | None:
        rss = self._procs.rss(pid)
        return ProcessUsage(pid, rss[0], rss[1]) if rss else None

    def assign(self, pid: int, device: str) -> None:
        pass


class SimulatedGpuBackend:
    name = "simulated"

    def __init__(self, sizes_mb: list[float]) -> None:
        self._sizes = sizes_mb
        self._procs = _Processes()
        self.placed: dict[int, int] = {}  # pid -> simulated GPU index (set by placement)

    def devices(self) -> list[DeviceUsage]:
        used = [0.0] * len(self._sizes)
        for pid, index in list(self.placed.items()):
            rss = self._procs.rss(pid)
            if rss is None:
                self.placed.pop(pid, None)
            elif index < len(used):
                used[index] += rss[0]
        gpus = [
            DeviceUsage(f"sim:{i}", "gpu", 0.0, size, used[i], index=i)
            for i, size in enumerate(self._sizes)
        ]
        return [*gpus, _host_cpu()]

    def process(self, pid: int) -> ProcessUsage | None:
        rss = self._procs.rss(pid)
        return ProcessUsage(pid, rss[0], rss[1]) if rss else None

    def assign(self, pid: int, device: str) -> None:
        if device.startswith("sim:"):
            self.placed[pid] = int(device.split(":")[1])


class NvmlBackend:
    name = "nvml"

    def __init__(self) -> None:
        import pynvml

        self._nvml: Any = pynvml
        pynvml.nvmlInit()
        self._handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]
        self._procs = _Processes()

    def devices(self) -> list[DeviceUsage]:
        nvml = self._nvml
        out = []
        for i, handle in enumerate(self._handles):
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            try:
                temperature = float(
                    nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
                )
                power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
            except nvml.NVMLError:
                temperature, power = None, None
            out.append(
                DeviceUsage(
                    f"cuda:{i}",
                    "gpu",
                    float(util.gpu),
                    memory.total / 2**20,
                    memory.used / 2**20,
                    index=i,
                    temperature_c=temperature,
                    power_w=power,
                )
            )
        return [*out, _host_cpu()]

    def process(self, pid: int) -> ProcessUsage | None:
        """GPU memory the process holds (summed over GPUs); None when it holds none."""
        nvml = self._nvml
        used = 0.0
        for handle in self._handles:
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    used += proc.usedGpuMemory / 2**20
        rss = self._procs.rss(pid)
        if rss is None:
            return None
        return ProcessUsage(pid, used if used else rss[0], rss[1])

    def assign(self, pid: int, device: str) -> None:
        pass


def choose_backend(setting: str, simulated_mb: list[float]) -> DeviceBackend:
    """ "auto": NVML when a GPU answers, else the host; or "host", "nvml", "simulated"."""
    if setting == "simulated":
        return SimulatedGpuBackend(simulated_mb)
    if setting == "host":
        return HostBackend()
    try:
        return NvmlBackend()
    except Exception:  # no library, no driver, no GPU: all mean "not here"
        if setting == "nvml":
            raise
        return HostBackend()
