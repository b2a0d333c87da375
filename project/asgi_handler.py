"""Django's ASGI handler with one thread hop per ordinary request, on a request thread kept for the next one."""
from __future__ import annotations

import collections
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext, iscoroutinefunction, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.base import BaseHandler
from django.db import connections
from django.http import HttpRequest, HttpResponseBase
from django.urls import Resolver404, get_resolver


class HermesASGIHandler(ASGIHandler):
    """Django's ``ASGIHandler``, except that a request for a synchronous view (every DRF view, the
    admin) runs the whole middleware chain and the view in one worker thread, as under WSGI.

    Why: Django 5.2 runs its built-in middleware in async mode through ``MiddlewareMixin.__acall__``,
    which hands each ``process_request`` / ``process_response`` to ``sync_to_async`` — a dozen hops
    between the event loop and a thread per request, ~2.5 ms of CPU each request on the 2-core
    development machine (``GET /api/`` 4.4 ms of API CPU on ASGI against 1.6 ms on WSGI). The async
    views (the event streams, ``api/streams.py``) still take Django's async chain, so an open stream
    holds no thread. Request/response signals, streaming and disconnect handling stay Django's
    (``ASGIHandler.handle``); each request still runs in its own ``ThreadSensitiveContext``, whose thread is
    one of ``RequestThreads`` (a thread that served an earlier request) instead of a new one.

    Kept instead of Django's own handler for ``make bench``'s ``ratio_vs_warm`` bar (≤ 1.25), which the warm
    path meets with ~3 ms to spare: on one gunicorn + uvicorn worker each, requests interleaved, Django's
    handler answered a turn ``POST`` 1.9 ms (median 18.9 against 17.0 ms) and a turn ``GET`` 2.1 ms slower
    than this one (500 rounds, 2-core host at load 6–8): the largest of the API's hand-made speed-ups; the
    others (the token read, the serializers' fields, the connection check) bought 0.5–1.3 ms each on the
    ``POST`` there and were replaced by DRF's and Django's own ways."""

    def __init__(self) -> None:
        super().__init__()
        self._sync_handler = BaseHandler()
        self._sync_handler.load_middleware(is_async=False)
        self.threads = RequestThreads()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Django's ``ASGIHandler.__call__``, its ``ThreadSensitiveContext`` given a kept executor."""
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        executor = self.threads.take()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        finally:
            self.threads.give_back(executor)

    async def get_response_async(self, request: HttpRequest) -> HttpResponseBase:
        if _async_view(request.path_info):
            return await super().get_response_async(request)
        return await sync_to_async(self._sync_handler.get_response, thread_sensitive=True)(request)


def _async_view(path: str) -> bool:
    """Whether ``path`` resolves (as it is, or with the ``/`` that ``ApiOptionalSlashMiddleware``
    appends) to a coroutine view."""
    resolver = get_resolver()
    for candidate in (path, f"{path}/"):
        try:
            return iscoroutinefunction(resolver.resolve(candidate).func)
        except Resolver404:
            continue
    return False


class RequestThreads:
    """Single-thread executors for requests' thread-sensitive work, kept for later requests: a request
    takes an idle one (or a new one), and gives it back once everything submitted to it has run — a view
    whose client went away may still run on it — and its thread's database connections are closed; at
    most ``keep`` idle ones are kept, the rest shut down.

    Why: Django's ``ASGIHandler`` enters a bare ``ThreadSensitiveContext`` per request, and asgiref 3.13
    then starts a thread for the request's executor and, at the request's end, another one to join it —
    two thread starts per request, each blocking the event loop until the thread runs (py-spy of ``make
    bench-warm``: ``Thread.start`` under ``ThreadSensitiveContext.__aexit__`` on the API's event loop,
    while the woken worker claimed the turn). asgiref's own answer is an executor the caller owns
    (``ThreadSensitiveContext(executor=…)``: "not shut down on exit, so the executor can be used again";
    one call at a time on one thread). After a fork (a preloaded app), the idle ones of the parent are
    forgotten: their threads do not exist in the child.

    What a kept thread carries from one request to the next: its own ``threading.local`` state, as under
    WSGI's thread pool — request code must not rely on thread-locals starting empty (nothing in this project,
    Django, DRF, drf-spectacular, WhiteNoise or psycopg does, besides Django's connections, closed here). A process keeps up to ``keep`` idle threads after a burst (~36–40 threads in all,
    against 5 with a thread per request)."""

    def __init__(self, keep: int = 32) -> None:
        self.keep = keep
        self._idle: collections.deque[ThreadPoolExecutor] = collections.deque()
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def take(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pid != os.getpid():
                self._idle.clear()
                self._pid = os.getpid()
            if self._idle:
                return self._idle.pop()
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="hermes-request")

    def give_back(self, executor: ThreadPoolExecutor) -> None:
        try:  # runs after whatever the request left on it
            executor.submit(_release_connections).add_done_callback(lambda _: self._idle_again(executor))
        except RuntimeError:  # shut down meanwhile (interpreter exit)
            pass

    def idle_count(self) -> int:
        return len(self._idle)

    def _idle_again(self, executor: ThreadPoolExecutor) -> None:
        with self._lock:
            if len(self._idle) < self.keep and self._pid == os.getpid():
                self._idle.append(executor)
                return
        executor.shutdown(wait=False)  # no join: the thread ends once idle


def _release_connections() -> None:
    """On a request thread going idle: close its database connections (Django's are per thread), as the
    end of its thread did under Django's handler — an idle kept thread holds none (with ``DATABASE_POOL``
    the request's end has already returned it to the pool)."""
    connections.close_all()


