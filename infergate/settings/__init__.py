"""Every profile and model.toml setting, declared once (type, default, bounds, help) in
profile_sections.py and model_sections.py; declare.py checks a table against a declaration
and words the errors; table.py reads TOML; reference.py writes the README's reference.

Declarations are pydantic v2 models: pydantic is well kept and widely installed, its strict
mode matches TOML's types (no "8000" for a port, no `true` for a number), and its field
metadata (bounds, descriptions) is what the error wording and the reference are built
from. msgspec would validate as well but adds a dependency for no gain: settings are
parsed at start and on profile edits only, never on a request's path.

A default that an engine record already holds (BreakerPolicy, QueuePolicy, Tenant,
ClusterSettings, ModelConfig, RemoteConfig...) is taken from that record, so it is written
once; the records themselves import nothing from here, which keeps pydantic out of a
worker process's start-up. Nothing here imports infergate/profile.py: the engine's
model.toml reader (engine/repository/modelconfig.py) and the profile both use it."""
