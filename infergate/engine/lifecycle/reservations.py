"""The devices a version's instances hold: every instance placed, or none of them, and
each reservation released only by the version that holds it (placement/placer.py)."""

from __future__ import annotations

from infergate.engine.admission.tenants import DEFAULT_TENANT, Tenant, Tenants
from infergate.engine.lifecycle.instance import Instance
from infergate.engine.placement.placer import PlacementRefused, Placer, Reservation
from infergate.engine.repository.spec import ModelConfig


def model_tenant(model: str, config: ModelConfig, tenants: Tenants) -> Tenant:
    """The tenant whose devices and memory quota the model's instances use. Whoever
    writes a model's folder names it, so the profile must let that tenant use the model
    (its `models`): a model of one tenant's naming another reserved all of the other's
    quota, and the other's serving model was killed until it failed."""
    try:
        tenant = tenants.get(config.tenant).tenant
    except KeyError:
        if config.tenant == DEFAULT_TENANT:  # a profile with named tenants only
            return Tenant(DEFAULT_TENANT)
        raise PlacementRefused(
            f"model.toml names tenant {config.tenant!r}, which the profile does not define. "
            "Hint: add it under [tenants] in the profile, or remove tenant from model.toml"
        ) from None
    if tenant.name != DEFAULT_TENANT and not tenant.may_use(model):  # (named by the file)
        raise PlacementRefused(
            f"model.toml names tenant {tenant.name!r}, whose models in the profile "
            f"({', '.join(tenant.models) or 'none'}) do not include {model!r}. Hint: add it "
            f"to them (infergate tenant set {tenant.name} models=...), or name the tenant "
            "the model is for"
        )
    return tenant


class Reservations:
    def __init__(self, model: str, config: ModelConfig, placer: Placer, tenants: Tenants) -> None:
        self._model = model
        self._config = config
        self._placer = placer
        self._tenants = tenants
        self._held: list[Reservation] = []

    def place(self, instances: list[Instance]) -> None:
        """Reserve a device for every instance, or none (PlacementRefused says why)."""
        tenant = model_tenant(self._model, self._config, self._tenants)
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
