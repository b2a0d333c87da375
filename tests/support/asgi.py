"""Calling an ASGI application in-process, as uvicorn would (asgiref's ``ApplicationCommunicator``)."""
from __future__ import annotations

from typing import Any

from asgiref.sync import async_to_sync
from asgiref.testing import ApplicationCommunicator


def asgi_scope(path: str, token: str = "", method: str = "GET", query: bytes = b"") -> dict[str, Any]:
    """An HTTP scope for ``path`` as uvicorn builds it, with ``Authorization: Token <token>`` when given."""
    headers = [(b"host", b"testserver")]
    if token:
        headers.append((b"authorization", f"Token {token}".encode()))
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}


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


def asgi_get(app: Any, scope: dict[str, Any]) -> tuple[int, bytes]:
    """``asgi_call`` from synchronous code; ``(status, whole body)``."""
    status, _headers, body = async_to_sync(asgi_call)(app, scope)
    return status, body
