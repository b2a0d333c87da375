"""Calling an ASGI application in-process, as uvicorn would (asgiref's ``ApplicationCommunicator``)."""
from __future__ import annotations

from typing import Any

from asgiref.testing import ApplicationCommunicator


async def asgi_call(app: Any, scope: dict[str, Any], *, timeout: float = 10) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send ``scope`` with an empty body to ``app``; ``(status, headers, whole body)``. Each message within
    ``timeout`` seconds or asgiref's ``TimeoutError`` (a response left open: a stream)."""
    comm = ApplicationCommunicator(app, scope)
    await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await comm.receive_output(timeout=timeout)
    body = b""
    while True:
        message = await comm.receive_output(timeout=timeout)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await comm.wait(timeout=5)
    return start["status"], dict(start["headers"]), body
