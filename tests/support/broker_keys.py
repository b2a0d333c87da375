"""What a Redis broker still holds of one queue (the worker-queue cleanup tests)."""
from __future__ import annotations

from typing import Any


def keys_naming(client: Any, queue: str) -> dict[str, list[bytes]]:
    """Every Redis key that is ``queue`` (``[b"list"]``) or a ``_kombu.binding*`` set with members naming it
    (those members); ``{}`` when the broker holds nothing of the queue."""
    found: dict[str, list[bytes]] = {}
    for key in client.scan_iter(match="*"):
        name = key.decode()
        if name == queue:
            found[name] = [b"list"]
        elif name.startswith("_kombu.binding") and client.type(key) == b"set":
            members = [m for m in client.smembers(key) if queue.encode() in m]
            if members:
                found[name] = members
    return found
