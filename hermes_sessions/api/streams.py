"""Live streams of turns as server-sent events (``docs/contract.md`` §8): async Django views, so an
open stream holds no sync worker under ASGI (``project/asgi.py``, ``make run``).

    GET /api/turns/{turn_id}/events/        the turn's events from the start; ends after its terminal event
    GET /api/sessions/{session_id}/events/  every turn's events from now on (or from Last-Event-ID); ends only
                                            when the session is deleted

Both also answer ``HEAD`` (GET's status and headers, no body: no stream is opened) and ``OPTIONS``
(200, ``Allow: GET, HEAD, OPTIONS`` and a description, as DRF's views answer it), each after the same
checks as GET: 401 without valid credentials, 404 for a turn or session that is not the caller's
(not a 405; ``tests/api/test_event_streams.py``). Any other method is a JSON 405 with that ``Allow``.

A stream whose turn or session is deleted (``manage.py prune_sessions``, the admin) ends with ``event: gone``
(no ``id:``; data: the 404 a reconnect would get), found by the read on the next heartbeat tick.

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
import contextlib
import functools
import inspect
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.utils.functional import SimpleLazyObject
from django.views.decorators.csrf import csrf_exempt
from rest_framework import exceptions
from rest_framework.request import Request
from rest_framework.views import APIView

from .. import selectors
from ..latency_marks import mark
from ..metrics.process import stream_closed, stream_opened
from ..models import Session, Turn
from ..services.events import TERMINAL_KINDS, event_terminal_ensure
from .errors import RETRY_AFTER_SECONDS, DatabaseUnavailable, error_json_response
from .event_hub import DATABASE_ERRORS, READ_PAGE, ROW_FIELDS, EventHub, hub, in_thread

logger = logging.getLogger(__name__)

#: Client reconnection delay sent once at the start (``retry:``), milliseconds.
RETRY_MS = 1000
#: The methods of both stream URLs, in DRF's order (its ``Allow`` header: ``GET, HEAD, OPTIONS``).
STREAM_METHODS = ("GET", "HEAD", "OPTIONS")
ALLOW = ", ".join(STREAM_METHODS)
#: ``json.dumps`` settings of the API's bodies (compact, UTF-8 kept: as DRF renders).
_JSON = {"separators": (",", ":"), "ensure_ascii": False}


def _error(status: int, detail: str, code: str, **headers: str) -> JsonResponse:
    """The API's error body (compact, as DRF renders it) with extra response headers."""
    response = error_json_response(status, detail, code)
    for name, value in headers.items():
        response[name] = value
    return response


def _authenticate(request: HttpRequest) -> Any:
    """The user by the API's own authenticators (Token, session); raises DRF's
    ``AuthenticationFailed`` / ``NotAuthenticated``."""
    drf_request = Request(request, authenticators=APIView().get_authenticators())  # REST_FRAMEWORK's classes
    user = drf_request.user
    if user is None or not user.is_authenticated:
        raise exceptions.NotAuthenticated()
    return user


def _denied(request: HttpRequest, user_pk: Any) -> tuple[str, str] | None:
    """``None`` while ``request``'s credentials still authenticate the user ``user_pk`` they did when its stream
    opened, else the 401's ``(detail, code)``. Run on every read of the stream's own — its first and one per
    heartbeat tick (``HERMES_SSE_HEARTBEAT_SECONDS``) — so a token deleted or a user deactivated while the
    stream is open ends it within a heartbeat: otherwise a session stream opened with a token deleted since would go on
    sending the session's new turns, their input included, while only new requests got 401.
    One token read (DRF's ``TokenAuthentication``) per stream per tick; a cookie session (the admin's browser) is
    read afresh too — Django caches the session and its user on the request."""
    if hasattr(request, "session"):
        request.session = import_module(settings.SESSION_ENGINE).SessionStore(request.session.session_key)
        request.__dict__.pop("_cached_user", None)
        request.user = SimpleLazyObject(lambda: get_user(request))  # type: ignore[assignment]
    try:
        user = _authenticate(request)
    except (exceptions.AuthenticationFailed, exceptions.NotAuthenticated) as exc:
        return str(exc.detail), str(exc.get_codes())
    if user.pk != user_pk:
        return "The stream's credentials now name another user.", "authentication_failed"
    return None


def _last_event_id(request: HttpRequest) -> int | None:
    """``Last-Event-ID`` (header) or ``?last_event_id=``; raises ``ValueError`` when not a
    non-negative integer written as ASCII digits only — ``int()`` alone also took ``3_0`` (30), ``+3``
    and non-ASCII digits; an event id the server sent is never spelt so."""
    raw = request.headers.get("Last-Event-ID") or request.GET.get("last_event_id")
    if raw is None or raw.strip() == "":
        return None
    text = raw.strip()
    if not (text.isascii() and text.isdigit()):
        raise ValueError(raw)
    value = int(text)
    if value > 2**63 - 1:
        raise ValueError(raw)
    return value


@dataclass
class _Read:
    """What one read of a stream's scope found."""

    rows: list[dict[str, Any]]
    ended: bool = False  # the turn (turn streams only) has ended
    gone: bool = False  # the turn or session is no longer there (deleted: prune_sessions, the admin)
    # The stream's credentials no longer authenticate its user (token deleted, user deactivated):
    # ``(detail, code)`` of the 401 a reconnect gets.
    denied: tuple[str, str] | None = None


@dataclass
class _Scope:
    """What one stream shows: a turn's events (``turn_id`` set) or a session's."""

    session_id: str
    turn_id: Any = None
    terminal_seen: bool = False  # event_terminal_ensure already ran for this stream
    # Checks again that the stream's request still authenticates its user: ``(detail, code)`` of the 401
    # when it does not (``_Scope.read`` runs it first, on every read of the stream's own).
    denied: Callable[[], tuple[str, str] | None] = lambda: None

    def read(self, after: int) -> _Read:
        """Rows after ``after``, whether the turn (turn streams only) has ended, and whether the turn
        or session is gone — or, first, whether the stream's credentials still hold (``denied``). The turn's
        state is read first: its terminal event commits with it, so it is among the rows read after; a
        deleted session takes its turns and events with it."""
        denied = self.denied()
        if denied is not None:
            return _Read(rows=[], gone=True, denied=denied)
        ended = False
        if self.turn_id is not None:
            status = Turn.objects.filter(pk=self.turn_id).values_list("status", flat=True).first()
            if status is None:
                return _Read(rows=[], gone=True)
            ended = status in Turn.TERMINAL
            if ended and not self.terminal_seen:
                # An imported or pre-0003 turn may lack its terminal event: write it before reading.
                event_terminal_ensure(turn_id=self.turn_id)
                self.terminal_seen = True
        elif not Session.objects.filter(pk=self.session_id).exists():
            return _Read(rows=[], gone=True)
        found = selectors.turn_events_after(after_id=after, limit=READ_PAGE, turn_id=self.turn_id,
                                            session_id=self.session_id)
        return _Read(rows=[dict(row) for row in found.values(*ROW_FIELDS)], ended=ended)

    def wants(self, row: dict[str, Any]) -> bool:
        """Whether a row of the session (as the hub reads them) belongs on this stream."""
        return self.turn_id is None or row["turn_id"] == self.turn_id


def _frame(row: dict[str, Any]) -> bytes:
    """One event: ``id:``, ``event:``, one ``data:`` line of JSON (json.dumps never emits a newline)."""
    data = {"turn": str(row["turn_id"]), "attempt": row["attempt"], **(row["data"] or {})}
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"id: {row['id']}\nevent: {row['kind']}\ndata: {body}\n\n".encode()


def _gone_frame(scope: _Scope, denied: tuple[str, str] | None = None) -> bytes:
    """The last event of a stream whose turn or session was deleted, or whose credentials no longer hold
    (``denied``): ``event: gone`` without ``id:`` (not a durable event: the client's Last-Event-ID stays its
    last real one), with the JSON error a reconnect would get (404 ``not_found``; 401 with DRF's detail and
    code)."""
    what, ident = ("turn", str(scope.turn_id)) if scope.turn_id is not None else ("session", scope.session_id)
    if denied is not None:
        data = {"detail": f"{denied[0]} This stream has ended.", "code": denied[1], what: ident}
    else:
        data = {"detail": f"The {what} was deleted; this stream has ended.", "code": "not_found", what: ident}
    return f"event: gone\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def _frames(scope: _Scope, found: _Read, after: int) -> tuple[list[bytes], int, bool]:
    """The frames of one read's rows after ``after``, the new ``after``, and whether the stream is over
    (a turn stream's terminal event, or the turn or session gone)."""
    if found.gone:
        return [_gone_frame(scope, found.denied)], after, True
    frames = []
    for row in found.rows:
        if row["id"] <= after or not scope.wants(row):
            continue
        frames.append(_frame(row))
        after = row["id"]
        if row["kind"] in TERMINAL_KINDS:
            mark("stream.terminal_frame", row["turn_id"])
            if scope.turn_id is not None:
                return frames, after, True
    return frames, after, False


async def _own_read(scope: _Scope, after: int, events_hub: EventHub) -> _Read | None:
    """The stream's own read of its scope after ``after`` — or, when the database cannot serve it (a
    restart, an exhausted pool), ``None`` after waiting one heartbeat interval: the stream stays open and
    reads again: a read failing after a PostgreSQL restart must not cut the stream with an ASGI error,
    which a client that does not reconnect would never recover from."""
    try:
        found = await in_thread(scope.read, after)
    except DATABASE_ERRORS as exc:
        logger.warning("event stream of session %s: read failed (%s); again in %s s", scope.session_id, exc,
                       settings.HERMES_SSE_HEARTBEAT_SECONDS)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(events_hub.stopping.wait(), settings.HERMES_SSE_HEARTBEAT_SECONDS)
        return None
    events_hub.reads_from(scope.session_id, after)
    return found


async def _events(scope: _Scope, after: int) -> AsyncIterator[bytes]:
    """The stream body: its own read of the backlog, then the rows the hub hands over (one shared read
    per notification), heartbeats in between with a read of its own on each tick; a turn stream ends
    after the terminal event (or at once when the turn ended with nothing after ``after``); any stream
    ends with ``event: gone`` when a read finds its turn or session deleted (``_gone_frame``).

    No gap: within a session ids are in commit order (``services/events.py``), the hub's rows start at
    or before the first row this stream's own read could not see, and rows up to ``after`` are skipped."""
    events_hub = hub()
    sub = await events_hub.subscribe(scope.session_id)  # before the first read: nothing committed later is missed
    kind = "turn" if scope.turn_id is not None else "session"
    stream_opened(kind)  # hermes_event_stream_clients
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        own_read = True
        while not events_hub.stopping.is_set():
            found = await _own_read(scope, after, events_hub) if own_read else _Read(rows=sub.take())
            if found is None:  # the database could not serve the read: heartbeat, then read again
                yield b": heartbeat\n\n"
                continue
            frames, after, over = _frames(scope, found, after)
            for frame in frames:
                yield frame
            if over:
                return
            if own_read and len(found.rows) == READ_PAGE:
                continue  # more backlog: read it before deciding the turn's stream is over
            if found.ended:
                return
            own_read = False
            if sub.rows or sub.reread:  # handed over, or the hub's read failed, while this stream read
                own_read, sub.reread = sub.reread, False  # (clearing ``wake`` now would lose that wake-up)
                continue
            sub.wake.clear()
            try:
                await asyncio.wait_for(sub.wake.wait(), settings.HERMES_SSE_HEARTBEAT_SECONDS)
            except asyncio.TimeoutError:
                yield b": heartbeat\n\n"
                await events_hub.ensure_listening()  # the hub's listener task, should it have ended
                own_read = True  # the slow safety re-read
            else:
                own_read, sub.reread = sub.reread, False
    finally:
        events_hub.unsubscribe(sub)
        stream_closed(kind)


async def _no_events() -> AsyncIterator[bytes]:
    """The body of a ``HEAD``: nothing, at once (an async iterator, as GET's, so the headers match)."""
    for _ in ():
        yield b""


def _stream_response(body: AsyncIterator[bytes]) -> StreamingHttpResponse:
    """A stream's 200: ``text/event-stream``, not cached, not buffered by a proxy; no ``Content-Length``."""
    response = StreamingHttpResponse(body, content_type="text/event-stream; charset=utf-8")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # a proxy (nginx) must not buffer the stream
    return response


def _options_response(view: Callable[..., Any]) -> JsonResponse:
    """``OPTIONS``: 200 with ``Allow`` and the body DRF's ``SimpleMetadata`` gives its views (``name``,
    ``description``, ``renders``, ``parses``), so a client sees the same shape on every route."""
    body = {
        "name": view.__name__.replace("_", " ").title(),  # as DRF names a view from its class: "Turn Events"
        "description": inspect.getdoc(view) or "",
        "renders": ["text/event-stream"],
        "parses": [],  # no request body
    }
    response = JsonResponse(body, json_dumps_params=_JSON)
    response["Allow"] = ALLOW
    return response


def _refusal(request: HttpRequest) -> tuple[JsonResponse | None, int | None]:
    """The checks before the database, for a stream URL: ``(refusal, None)`` — 405 (a method other than
    GET, HEAD, OPTIONS), 501 (GET or HEAD under WSGI), 400 (a bad resume point) — or ``(None, the
    resume point)``. OPTIONS skips the two that concern only a stream: it answers under WSGI too and
    ignores ``Last-Event-ID``."""
    method = request.method or ""
    if method not in STREAM_METHODS:
        return _error(405, f'Method "{method}" not allowed.', "method_not_allowed", Allow=ALLOW), None
    if method == "OPTIONS":
        return None, None
    if not isinstance(request, ASGIRequest):
        # Under WSGI (runserver, gunicorn project.wsgi) Django would buffer an endless stream in memory.
        return _error(501, "Event streams need the ASGI server: make run, or uvicorn project.asgi:application.",
                      "asgi_required"), None
    try:
        return None, _last_event_id(request)
    except ValueError:
        return _error(400, "Last-Event-ID / last_event_id must be a non-negative integer event id.",
                      "invalid_event_id"), None


async def _open(request: HttpRequest, view: Callable[..., Any], resolve: Callable[[Any], tuple[_Scope, int] | None],
                missing: str) -> HttpResponse | StreamingHttpResponse:
    """Answer a stream URL: ``_refusal``'s checks, then the user (401) and the scope (404) — for GET,
    HEAD and OPTIONS alike — then GET streams, HEAD answers GET's headers with an empty body (no stream
    is opened, nothing is held) and OPTIONS describes the route (``_options_response``)."""
    refusal, after = _refusal(request)
    if refusal is not None:
        return refusal

    def lookup() -> tuple[_Scope, int] | None:
        user = _authenticate(request)
        found = resolve((user, after))
        if found is not None:
            found[0].denied = functools.partial(_denied, request, user.pk)
        return found

    try:
        found = await in_thread(lookup)
    except DATABASE_ERRORS as exc:
        logger.warning("event stream refused with 503: the database could not serve it: %s", exc)
        return _error(503, DatabaseUnavailable.default_detail, DatabaseUnavailable.default_code,
                      **{"Retry-After": str(RETRY_AFTER_SECONDS)})
    except (exceptions.AuthenticationFailed, exceptions.NotAuthenticated) as exc:
        return _error(401, str(exc.detail), str(exc.get_codes()), **{"WWW-Authenticate": "Token"})
    if found is None:
        return _error(404, missing, "not_found")
    if request.method == "OPTIONS":
        return _options_response(view)
    if request.method == "HEAD":
        return _stream_response(_no_events())
    return _stream_response(_events(*found))


# csrf_exempt: these views only read (GET, HEAD, OPTIONS; any other method is a JSON 405), and without it
# Django's CSRF check answered a POST with its HTML 403 page before the view could say so.
@csrf_exempt
async def turn_events(request: HttpRequest, turn_id: str) -> HttpResponse | StreamingHttpResponse:
    """A turn's events, live, as server-sent events.

    ``GET /api/turns/{turn_id}/events/``: the turn's events, from the first (or after
    ``Last-Event-ID``); the stream ends after ``completed`` / ``failed`` / ``cancelled``. ``HEAD``:
    the same checks and headers, no body. ``OPTIONS``: the allowed methods."""

    def resolve(args: tuple[Any, int | None]) -> tuple[_Scope, int] | None:
        user, after = args
        try:
            turn = selectors.turn_get(user=user, turn_id=turn_id)
        except Turn.DoesNotExist:
            return None
        return _Scope(session_id=turn.session_id, turn_id=turn.pk), after or 0

    return await _open(request, turn_events, resolve, "No such turn.")


# csrf_exempt: these views only read (GET, HEAD, OPTIONS; any other method is a JSON 405), and without it
# Django's CSRF check answered a POST with its HTML 403 page before the view could say so.
@csrf_exempt
async def session_events(request: HttpRequest, session_id: str) -> HttpResponse | StreamingHttpResponse:
    """A session's events, live, as server-sent events.

    ``GET /api/sessions/{session_id}/events/``: the events of every turn of the session from now
    on (``Last-Event-ID`` / ``?last_event_id=``: after that id; ``0`` replays all); ends only with
    ``event: gone`` when the session is deleted. ``HEAD``: the same checks and headers, no body.
    ``OPTIONS``: the allowed methods."""

    def resolve(args: tuple[Any, int | None]) -> tuple[_Scope, int] | None:
        user, after = args
        if not selectors.session_is_owned(user=user, session_id=session_id):
            return None
        start = after if after is not None else selectors.session_last_event_id(session_id=session_id)
        return _Scope(session_id=session_id), start

    return await _open(request, session_events, resolve, "No such session.")
