"""Placement: which device each worker goes on, within its tenant's devices and memory.

Each instance reserves its `memory_mb` on one device and against its tenant's quota. A
worker goes on a device its model's tenant may use, the one with the most memory left
that fits. GPU workers see only their GPU (CUDA_VISIBLE_DEVICES); CPU workers see none.
A load that does not fit is refused with a message naming the tenant, the need and what
is left; nothing crashes.

A reservation is an object its holder owns and releases (`Reservation.release`), never a
key: two holders of the same model, version and file (a reload of an unchanged file)
hold two reservations, and each release frees only its own. A reload therefore counts
both versions until the old one stops, as their workers really both run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from infergate.engine.admission.tenants import Tenant
from infergate.engine.placement.devices import DeviceBackend, DeviceUsage
from infergate.errors import PlacementRefused as PlacementRefused  # raised here


def _usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Placement:
    device: str  # where it is placed: "cpu", "cuda:1", "sim:0"
    runtime_device: str  # what the worker's runtime is asked for: "cpu" or "cuda:0"
    env: tuple[tuple[str, str], ...]
    memory_mb: int | None
    threads: int | None = None  # intra-op threads; None: the runtime's default
    cpus: tuple[int, ...] | None = None  # CPU affinity of a CPU worker


@dataclass(eq=False)  # compared by identity: each holder owns its own
class Reservation:
    """Memory on one device against one tenant's quota, held until its holder releases it."""

    placement: Placement
    tenant: str
    memory_mb: float
    _placer: Placer

    @property
    def device(self) -> str:
        return self.placement.device

    def release(self) -> None:
        """Give the memory back; releasing twice is harmless."""
        self._placer._held.discard(self)


class Placer:
    def __init__(self, backend: DeviceBackend, cores: int | None = None) -> None:
        self.backend = backend
        self._held: set[Reservation] = set()
        self._cores = cores or _usable_cores()
        self._next_core = 0
        # What each tenant held to its quota had its workers without a memory_mb use
        # together at the memory monitor's last look (placement/monitor.py).
        self.unreserved_mb: dict[str, float] = {}

    def reserved(self, tenant: str | None = None, device: str | None = None) -> float:
        return sum(
            r.memory_mb
            for r in self._held
            if (tenant is None or r.tenant == tenant) and (device is None or r.device == device)
        )

    def _candidates(self, want: str, tenant: Tenant) -> list[DeviceUsage]:
        devices = self.backend.devices()
        allowed = [
            d
            for d in devices
            if "auto" in tenant.devices
            or d.name in tenant.devices
            or (d.kind == "cpu" and "cpu" in tenant.devices)
        ]
        if want == "cpu":
            return [d for d in allowed if d.kind == "cpu"]
        if want != "auto":
            return [d for d in allowed if d.name == want]
        gpus = [d for d in allowed if d.kind == "gpu"]
        return gpus or [d for d in allowed if d.kind == "cpu"]

    def _cpu_share(self, threads: int | None) -> tuple[int, tuple[int, ...]]:
        """Threads for a new CPU worker (its share of the cores, unless model.toml sets
        them) and the cores it runs on, handed out round-robin so workers spread."""
        workers = 1 + sum(1 for r in self._held if r.device == "cpu")  # with the new one
        count = min(threads or max(1, self._cores // max(workers, 1)), self._cores)
        first = self._next_core
        self._next_core = (first + count) % self._cores
        return count, tuple(sorted((first + k) % self._cores for k in range(count)))

    def place(
        self,
        model: str,
        tenant: Tenant,
        want: str,
        memory_mb: int | None,
        threads: int | None = None,
    ) -> Reservation:
        """Reserve a device for one worker of `model`; the caller owns the reservation."""
        need = float(memory_mb or 0)
        # Its workers without a memory_mb count too: a reservation that left them less
        # than they use got them killed until their model failed.
        unreserved = self.unreserved_mb.get(tenant.name, 0.0) if need else 0.0
        used = self.reserved(tenant=tenant.name) + unreserved
        if need and used + need > tenant.memory_mb:
            using = f" (its models without a memory_mb use {unreserved:.0f} MB)"
            raise PlacementRefused(
                f"tenant {tenant.name!r} has {tenant.memory_mb - used:.0f} MB of its "
                f"{tenant.memory_mb} MB memory quota left{using if unreserved else ''}, and "
                f"model {model!r} needs {need:.0f} MB per instance. Hint: raise the "
                "tenant's memory_mb, lower the model's memory_mb, or unload another of its "
                "models"
            )
        candidates = self._candidates(want, tenant)
        if not candidates:
            raise PlacementRefused(
                f"model {model!r} asks for device {want!r}, which tenant {tenant.name!r} may "
                f"not use or this machine lacks (the tenant may use "
                f"{', '.join(tenant.devices)}; {self.backend.name} backend)"
            )
        free = {d.name: d.memory_total_mb - self.reserved(device=d.name) for d in candidates}
        fitting = [d for d in candidates if free[d.name] >= need]
        if not fitting:
            left = ", ".join(f"{name} {mb:.0f} MB" for name, mb in free.items())
            raise PlacementRefused(
                f"no device tenant {tenant.name!r} may use has {need:.0f} MB free for model "
                f"{model!r} (free: {left})"
            )
        device = max(fitting, key=lambda d: free[d.name])
        if device.kind == "gpu":
            env = (("CUDA_VISIBLE_DEVICES", str(device.index)),)
            runtime = "cpu" if self.backend.name == "simulated" else "cuda:0"
            placement = Placement(device.name, runtime, env, memory_mb, threads)
        else:
            count, cpus = self._cpu_share(threads)
            placement = Placement(
                device.name, "cpu", (("CUDA_VISIBLE_DEVICES", ""),), memory_mb, count, cpus
            )
        reservation = Reservation(placement, tenant.name, need, self)
        self._held.add(reservation)
        return reservation
