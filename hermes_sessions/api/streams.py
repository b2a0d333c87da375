"""Live streams of turns as server-sent events (``docs/contract.md`` §8): async Django views, so an
open stream holds no sync worker under ASGI (``project/asgi.py``, ``make run``).

    GET /api/turns/{turn_id}/events/        the turn's events from the start; ends after its terminal event
    GET /api/sessions/{session_id}/events/  every turn's events from now on (or from Last-Event-ID); never ends

Same authentication as the rest of the API (DRF's Token and session authentication) and the same
JSON error bodies (``{"detail", "code"}``) for 400/401/404. Resuming: ``Last-Event-ID`` (header) or
``?last_event_id=`` (for clients that cannot set headers) gives the events after that id, exactly once
and in order. Only durable events carry ``id:``; heartbeats (every ``HERMES_SSE_HEARTBEAT_SECONDS``)
are ``:`` comment lines, so a reconnect right after one skips nothing (``../shared/pitfalls.md``).

Each stream reads rows from the table — before waiting, when the process's LISTEN connection
(``event_hub.py``) wakes it, and on every heartbeat tick (a slow safety re-read, not a poll). Reads
run in a thread of their own and close their database connection at once (back to the pool under
``DATABASE_POOL``): an open stream holds no database connection while it waits.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.views import APIView

from .. import selectors
from ..models import Turn
from ..services.events import TERMINAL_KINDS
from .event_hub import hub

#: Rows read per query; a longer backlog is read in several.
READ_PAGE = 500
#: Client reconnection delay sent once at the start (``retry:``), milliseconds.
RETRY_MS = 1000
T = TypeVar("T")


def _error(status: int, detail: str, code: str, **headers: str) -> JsonResponse:
    response = JsonResponse({"detail": detail, "code": code}, status=status)
    for name, value in headers.items():
        response[name] = value
    return response


def _close_after(read: Callable[..., T]) -> Callable[..., T]:
    """``read``, closing this thread's database connection afterwards (returned to the pool, or
    closed): a stream never keeps a connection while it waits."""
    def wrapped(*args: Any, **kwargs: Any) -> T:
        try:
            return read(*args, **kwargs)
        finally:
            connection.close()
    return wrapped


async def _in_thread(read: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await sync_to_async(_close_after(read), thread_sensitive=False)(*args, **kwargs)


def _authenticate(request: HttpRequest) -> Any:
    """The user by the API's own authenticators (Token, session); raises DRF's
    ``AuthenticationFailed`` / ``NotAuthenticated``."""
    drf_request = Request(request, authenticators=APIView().get_authenticators())  # REST_FRAMEWORK's classes
    user = drf_request.user
    if user is None or not user.is_authenticated:
        raise exceptions.NotAuthenticated()
    return user


def _last_event_id(request: HttpRequest) -> int | None:
    """``Last-Event-ID`` (header) or ``?last_event_id=``; raises ``ValueError`` when not a
    non-negative integer."""
    raw = request.headers.get("Last-Event-ID") or request.GET.get("last_event_id")
    if raw is None or raw.strip() == "":
        return None
    value = int(raw.strip())
    if value < 0 or value > 2**63 - 1:
        raise ValueError(raw)
    return value


@dataclass
class _Scope:
    """What one stream shows: a turn's events (``turn_id`` set) or a session's."""

    session_id: str
    turn_id: Any = None

    def read(self, after: int) -> tuple[list[dict[str, Any]], bool]:
        """Rows after ``after`` and whether the turn (turn streams only) has ended. The turn's state
        is read first: its terminal event commits with it, so it is among the rows read after."""
        ended = False
        if self.turn_id is not None:
            ended = Turn.objects.filter(pk=self.turn_id, status__in=Turn.TERMINAL).exists()
        found = selectors.turn_events_after(after_id=after, limit=READ_PAGE, turn_id=self.turn_id,
                                            session_id=self.session_id)
        rows = [dict(row) for row in found.values("id", "turn_id", "attempt", "kind", "data")]
        return rows, ended


def _frame(row: dict[str, Any]) -> bytes:
    """One event: ``id:``, ``event:``, one ``data:`` line of JSON (json.dumps never emits a newline)."""
    data = {"turn": str(row["turn_id"]), "attempt": row["attempt"], **(row["data"] or {})}
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"id: {row['id']}\nevent: {row['kind']}\ndata: {body}\n\n".encode()


async def _events(scope: _Scope, after: int) -> AsyncIterator[bytes]:
    """The stream body: backlog, then live events, heartbeats in between; a turn stream ends after
    the terminal event (or at once when the turn ended with nothing after ``after``)."""
    events_hub = hub()
    wake = await events_hub.subscribe(scope.session_id)  # before the first read: no wake-up is missed
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        while not events_hub.stopping.is_set():
            wake.clear()
            rows, ended = await _in_thread(scope.read, after)
            for row in rows:
                yield _frame(row)
                after = row["id"]
                if scope.turn_id is not None and row["kind"] in TERMINAL_KINDS:
                    return
            if len(rows) == READ_PAGE:
                continue  # more backlog
            if ended:
                return
            try:
                await asyncio.wait_for(wake.wait(), settings.HERMES_SSE_HEARTBEAT_SECONDS)
            except asyncio.TimeoutError:
                yield b": heartbeat\n\n"
                await events_hub.ensure_listening()  # a lost LISTEN connection is re-opened here
    finally:
        events_hub.unsubscribe(scope.session_id, wake)


def _stream_response(scope: _Scope, after: int) -> StreamingHttpResponse:
    response = StreamingHttpResponse(_events(scope, after), content_type="text/event-stream; charset=utf-8")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy (nginx) must not buffer the stream
    return response


async def _open(request: HttpRequest, resolve: Callable[[Any], tuple[_Scope, int] | None],
                missing: str) -> HttpResponse | StreamingHttpResponse:
    """Authenticate, parse the resume point, resolve the scope (404), then stream."""
    try:
        after = _last_event_id(request)
    except ValueError:
        return _error(400, "Last-Event-ID / last_event_id must be a non-negative integer event id.", "invalid_event_id")

    def lookup() -> tuple[_Scope, int] | None:
        user = _authenticate(request)
        return resolve((user, after))

    try:
        found = await _in_thread(lookup)
    except exceptions.AuthenticationFailed as exc:
        return _error(401, str(exc.detail), str(exc.get_codes()), **{"WWW-Authenticate": "Token"})
    except exceptions.NotAuthenticated as exc:
        return _error(401, str(exc.detail), str(exc.get_codes()), **{"WWW-Authenticate": "Token"})
    if found is None:
        return _error(404, missing, "not_found")
    return _stream_response(*found)


async def turn_events(request: HttpRequest, turn_id: str) -> HttpResponse | StreamingHttpResponse:
    """``GET /api/turns/{turn_id}/events/``: the turn's events, from the first (or after
    ``Last-Event-ID``); the stream ends after ``completed`` / ``failed`` / ``cancelled``."""
    if request.method != "GET":
        return _error(405, f'Method "{request.method}" not allowed.', "method_not_allowed", Allow="GET")

    def resolve(args: tuple[Any, int | None]) -> tuple[_Scope, int] | None:
        user, after = args
        try:
            turn = selectors.turn_get(user=user, turn_id=turn_id)
        except Turn.DoesNotExist:
            return None
        return _Scope(session_id=turn.session_id, turn_id=turn.pk), after or 0

    return await _open(request, resolve, "No such turn.")


async def session_events(request: HttpRequest, session_id: str) -> HttpResponse | StreamingHttpResponse:
    """``GET /api/sessions/{session_id}/events/``: the events of every turn of the session from now
    on (``Last-Event-ID`` / ``?last_event_id=``: after that id; ``0`` replays all); never ends."""
    if request.method != "GET":
        return _error(405, f'Method "{request.method}" not allowed.', "method_not_allowed", Allow="GET")

    def resolve(args: tuple[Any, int | None]) -> tuple[_Scope, int] | None:
        user, after = args
        if not selectors.is_valid_session_id(session_id) or not selectors.session_list(user=user).filter(
                pk=session_id).exists():
            return None
        start = after if after is not None else selectors.session_last_event_id(session_id=session_id)
        return _Scope(session_id=session_id), start

    return await _open(request, resolve, "No such session.")
