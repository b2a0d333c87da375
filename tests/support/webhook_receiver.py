"""A real HTTP receiver of webhooks on 127.0.0.1 (``http.server`` on a thread) for the webhook tests: it
records each request's headers and body and answers with the next status of ``answers`` (then 204);
a 3xx answer carries ``Location: <redirect_to>``."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class WebhookReceiver:
    answers: list[int] = field(default_factory=list)
    redirect_to: str = ""
    received: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 — http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.received.append(Received(self.path, dict(self.headers.items()), body))
                code = receiver.answers.pop(0) if receiver.answers else 204
                self.send_response(code)
                if 300 <= code < 400:
                    self.send_header("Location", receiver.redirect_to)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="webhook-receiver", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def __enter__(self) -> WebhookReceiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, count: int, timeout: float = 30.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        while len(self.received) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return list(self.received)
