"""Django's ASGI handler with one thread hop per ordinary request."""
from __future__ import annotations

from asgiref.sync import iscoroutinefunction, sync_to_async
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.base import BaseHandler
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
    (``ASGIHandler.handle``); each request still runs in its own ``ThreadSensitiveContext``."""

    def __init__(self) -> None:
        super().__init__()
        self._sync_handler = BaseHandler()
        self._sync_handler.load_middleware(is_async=False)

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
