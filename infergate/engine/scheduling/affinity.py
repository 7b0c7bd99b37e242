"""Session affinity: which instance a session's requests go to."""

from __future__ import annotations

import hashlib

from infergate.engine.lifecycle.instance import Instance


def pinned_instance(session: str | None, instances: list[Instance]) -> int | None:
    """Rendezvous hashing: a session keeps its instance while that instance is ready, and
    moves to the next in its own order when it is not. None: any instance will do."""
    if session is None or len(instances) < 2:
        return None

    def weight(instance: Instance) -> bytes:
        return hashlib.blake2b(f"{session}/{instance.index}".encode(), digest_size=8).digest()

    ranked = sorted(instances, key=weight, reverse=True)
    ready = [i for i in ranked if i.ready]
    return (ready or ranked)[0].index
