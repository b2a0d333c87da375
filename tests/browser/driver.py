"""Playwright's sync API on a thread of its own, driving Debian's Chromium.

Why a thread: Playwright's sync API runs an asyncio event loop on the thread that started it, and
while it is started Django sees a running loop there and refuses every ORM call from that thread
(``SynchronousOnlyOperation``). Setting ``DJANGO_ALLOW_ASYNC_UNSAFE`` would only hide that. Here the
browser lives on one dedicated thread (a one-worker executor: Playwright's objects must be used on
the thread that made them) and the test's own thread, which makes and checks rows, never has a loop.
Every browser step is a function run on that thread with ``BrowserThread.call``.

The browser is always ``executable_path`` = Debian's Chromium (``CHROMIUM_PATH``, default
``/usr/bin/chromium``; ``make test`` installs it with ``scripts/ensure_chromium.sh``): Playwright's
own browser download is never used, and a headless launch without the path would look for it
(``../shared/pitfalls.md``, SSE table, last row).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

from playwright.sync_api import Browser, Playwright, sync_playwright

T = TypeVar("T")

CHROMIUM_PATH = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
STEP_TIMEOUT_S = 60  # a whole step on the browser thread; Playwright's own waits are shorter (below)
ACTION_TIMEOUT_MS = 15_000


class BrowserThread:
    """One headless Chromium, owned by one thread. ``version`` is the browser's (e.g.
    ``156.0.8078.114``); ``describe()`` is the line the suite prints."""

    def __init__(self, executable_path: str = CHROMIUM_PATH):
        if not Path(executable_path).exists():
            raise FileNotFoundError(
                f"Chromium not found at {executable_path}: run `make chromium` (scripts/ensure_chromium.sh) "
                "or set CHROMIUM_PATH")
        self.executable_path = executable_path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="playwright")
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self.version: str = self.call(self._start)

    def _start(self) -> str:
        self._playwright = sync_playwright().start()
        self._browser = self._playwright.chromium.launch(executable_path=self.executable_path, headless=True)
        return self._browser.version

    def describe(self) -> str:
        return (f"browser: Chromium {self.version} at {self.executable_path} (headless, "
                f"Playwright {version('playwright')}, executable_path passed on launch)")

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the browser thread and return its result; its exceptions (a failed
        ``expect``, a Playwright timeout) are raised here, in the test's thread."""
        return self._pool.submit(fn, *args).result(timeout=STEP_TIMEOUT_S)

    @property
    def browser(self) -> Browser:
        """The Playwright ``Browser``: use it only inside functions passed to ``call``."""
        assert self._browser is not None
        return self._browser

    def close(self) -> None:
        def stop() -> None:
            if self._browser is not None:
                self._browser.close()
            if self._playwright is not None:
                self._playwright.stop()

        try:
            self.call(stop)
        finally:
            self._pool.shutdown(wait=True)
