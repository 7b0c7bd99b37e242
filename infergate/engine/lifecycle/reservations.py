"""The devices a version's instances hold: every instance placed, or none of them, and
each reservation released only by the version that holds it (placement/placer.py)."""

from __future__ import annotations

from infergate.engine.admission.tenants import DEFAULT_TENANT, Tenant, Tenants
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.placement.placer import PlacementRefused, Placer, Reservation
from infergate.engine.repository.spec import ModelConfig


def model_tenant(config: ModelConfig, tenants: Tenants) -> Tenant:
    """The tenant whose devices and memory quota the model's instances use."""
    try:
        return tenants.get(config.tenant).tenant
    except KeyError:
        if config.tenant == DEFAULT_TENANT:  # a profile with named tenants only
            return Tenant(DEFAULT_TENANT)
        raise PlacementRefused(
            f"model.toml names tenant {config.tenant!r}, which the profile does not define. "
            "Hint: add it under [tenants] in the profile, or remove tenant from model.toml"
        ) from None


class Reservations:
    def __init__(self, model: str, config: ModelConfig, placer: Placer, tenants: Tenants) -> None:
        self._model = model
        self._config = config
        self._placer = placer
        self._tenants = tenants
        self._held: list[Reservation] = []

    def place(self, instances: list[Instance]) -> None:
        """Reserve a device for every instance, or none (PlacementRefused says why)."""
        tenant = model_tenant(self._config, self._tenants)
        config = self._config
        try:
            for instance in instances:
                reservation = self._placer.place(
                    self._model, tenant, config.device, config.memory_mb, config.threads
                )
                self._held.append(reservation)
                instance.place(reservation.placement)
        except PlacementRefused:
            self.release()
            raise

    def release(self) -> None:
        """Give back what this holder reserved; releasing twice is harmless."""
        for reservation in self._held:
            reservation.release()
        self._held.clear()
