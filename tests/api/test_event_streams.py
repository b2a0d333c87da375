"""The event streams over a real ASGI server process (gunicorn + uvicorn worker, as ``make run``) on
the test database: errors, resuming, NOTIFY wake-ups and the SSE pitfalls of ``../shared/pitfalls.md``
(each test names its row)."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from asgiref.sync import async_to_sync
from django.db import connection
from django.test import AsyncClient
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from devtools.bench_streams import open_streams
from hermes_sessions import services
from hermes_sessions.api.event_hub import READ_PAGE
from hermes_sessions.codex.runner import TurnOutcome
from hermes_sessions.models import Session
from hermes_sessions.services import events
from hermes_sessions.services.events import TurnEventWriter
from hermes_sessions.services.turns import TurnClaim
from project.asgi_handler import HermesASGIHandler
from tests.factories import UserFactory
from tests.support.asgi import asgi_call
from tests.support.dispatch import hold_dispatches
from tests.support.sse import ApiServer, close_open_streams, open_stream
from tests.test_asgi_handler import _scope

pytestmark = pytest.mark.django_db(transaction=True)  # the server process reads what the test commits

HEARTBEAT = 3.0  # seconds; long enough that an event arriving sooner was woken by NOTIFY, not the tick
# A heartbeat is this comment frame, byte for byte (docs/contract.md §8): no ``id:``, so a client that
# reconnects right after one asks for what follows its last real event. Written out here, not imported.
HEARTBEAT_FRAME = b": heartbeat\n\n"


@pytest.fixture(scope="module")
def server(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[ApiServer]:
    with django_db_blocker.unblock():
        api = ApiServer(tmp_path_factory.mktemp("sse") / "server.log", heartbeat=HEARTBEAT).start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture(autouse=True)
def _streams_closed() -> Iterator[None]:
    """A test's streams end with it, failed or not: the module's server is shared."""
    yield
    close_open_streams()


@pytest.fixture
def token(user) -> str:
    return Token.objects.create(user=user).key


@pytest.fixture
def claimed(user, monkeypatch) -> TurnClaim:
    """A running turn of a fresh session, claimed by this test playing the worker."""
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="hello", user=user)
    claim = services.turn_claim(turn_id=turn.id)
    assert claim is not None
    return claim


def writer_for(claim: TurnClaim) -> TurnEventWriter:
    return TurnEventWriter(turn_id=claim.turn_id, session_id=claim.session_id, token=claim.token, attempt=claim.attempt)


def finish(claim: TurnClaim, text: str) -> None:
    services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=TurnOutcome(status="completed", final_text=text))


def test_errors_are_the_apis_json(server, user, token, claimed):
    path = f"/api/turns/{claimed.turn_id}/events/"
    status, headers, body = server.get(path, None)
    assert (status, headers.get("www-authenticate")) == (401, "Token")
    assert body.startswith(b"{") and b'"code":"not_authenticated"' in body
    status, _, body = server.get(path, "0" * 40)
    assert status == 401 and b'"code":"authentication_failed"' in body
    other = Token.objects.create(user=UserFactory()).key
    assert server.get(path, other)[:1] == (404,)  # someone else's turn
    assert server.get(f"/api/sessions/{claimed.session_id}/events/", other)[0] == 404
    status, _, body = server.get("/api/turns/not-a-uuid/events/", token)
    assert status == 404 and b'"code":"not_found"' in body
    # Only ASCII digits: int() alone would take "3_0" as 30, and "+3".
    for bad in ("-3", "3_0", "%2B3", "%D9%A3", "1e5", "3.0"):
        status, _, body = server.get(path + f"?last_event_id={bad}", token)
        assert status == 400 and b'"code":"invalid_event_id"' in body, bad


def test_under_wsgi_a_stream_is_refused_not_buffered_forever(claimed, token):
    response = APIClient().get(f"/api/sessions/{claimed.session_id}/events/", HTTP_AUTHORIZATION=f"Token {token}")
    assert (response.status_code, response.json()["code"]) == (501, "asgi_required")


def test_schema_documents_both_streams():
    api = APIClient()
    api.force_authenticate(UserFactory())
    paths = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    for path in ("/api/turns/{turn_id}/events/", "/api/sessions/{session_id}/events/"):
        responses = paths[path]["get"]["responses"]
        assert list(responses["200"]["content"]) == ["text/event-stream"]
        assert list(responses["401"]["content"]) == list(responses["404"]["content"]) == ["application/json"]


def test_events_committed_while_no_stream_is_open_are_replayed_intact(server, token, claimed):
    """Pitfalls: 'pub/sub drops messages nobody is listening for' and 'NOTIFY's 8,000-byte payload
    limit broke on multibyte text': ~8 KB multibyte deltas, written with nobody listening."""
    chunk = "é漢🙂ж" * 2048  # 8,192 characters, 20,480 UTF-8 bytes
    writer = writer_for(claimed)
    texts = [f"{i}:{chunk}" for i in range(3)]
    for text in texts:
        writer.add(events.DELTA, {"item_id": "m1", "text": text})
    writer.flush()
    finish(claimed, "".join(texts))

    stream = open_stream(server.port, f"/api/turns/{claimed.turn_id}/events/", token)
    got = stream.read_to_end()
    assert [e.event for e in got] == ["queued", "running", "delta", "delta", "delta", "completed"]
    assert "".join(e.data["text"] for e in got if e.event == "delta") == got[-1].data["final_text"] == "".join(texts)
    assert all(e.data["turn"] == str(claimed.turn_id) for e in got)

    # Resume after the first delta (query parameter form): the rest, exactly once.
    first_delta = got[2].id
    again = open_stream(server.port, f"/api/turns/{claimed.turn_id}/events/?last_event_id={first_delta}", token)
    assert [e.id for e in again.read_to_end()] == [e.id for e in got[3:]]
    # The session stream replays every turn's events from 0.
    session = open_stream(server.port, f"/api/sessions/{claimed.session_id}/events/", token, last_event_id=0)
    assert [e.id for e in session.read_until(lambda e: e.event == "completed")] == [e.id for e in got]
    session.close()


def test_an_ended_turn_with_more_than_a_page_of_events_streams_them_all(server, token, claimed):
    """A 1,200-word reply makes 907 events; a turn stream of the ended turn that read one page (500) would
    stop there with no terminal event. Every page is read before the end."""
    writer = writer_for(claimed)
    words = [f"w{i} " for i in range(READ_PAGE + 20)]
    for word in words:
        writer.add(events.DELTA, {"item_id": "m1", "text": word})
        writer.flush()  # one row each: more than a page
    finish(claimed, "".join(words))

    got = open_stream(server.port, f"/api/turns/{claimed.turn_id}/events/", token).read_to_end()
    assert got[-1].event == "completed"
    assert "".join(e.data["text"] for e in got if e.event == "delta") == "".join(words)
    assert len({e.id for e in got}) == len(got) == len(words) + 3  # queued, running, deltas, completed


def test_live_events_are_woken_by_notify_not_by_polling(server, token, claimed):
    stream = open_stream(server.port, f"/api/sessions/{claimed.session_id}/events/", token)
    assert stream.read() is None  # a heartbeat: the stream re-reads right after it, then waits HEARTBEAT s
    time.sleep(0.5)  # past that re-read
    writer = writer_for(claimed)
    started = time.monotonic()
    writer.add(events.DELTA, {"item_id": "m1", "text": "live"})
    writer.flush()  # the runner's tick writes it within DELTA_FLUSH_SECONDS
    event = stream.read()
    elapsed = time.monotonic() - started
    assert event is not None and event.data["text"] == "live"
    assert elapsed < 1.0, f"{elapsed:.2f} s: woken by the heartbeat's re-read, not by NOTIFY"
    stream.close()


def test_the_hubs_one_statement_read_returns_the_rows_the_orm_read_returns(claimed):
    import psycopg
    from psycopg.rows import dict_row

    from hermes_sessions.api.event_hub import _session_rows
    from hermes_sessions.listener import connection_params
    from hermes_sessions.sql import query

    writer = writer_for(claimed)
    writer.add(events.DELTA, {"item_id": "m1", "text": "caf\u00e9 \u2603"})
    writer.flush()
    finish(claimed, "done")
    orm = _session_rows(claimed.session_id, 0)
    with psycopg.connect(**connection_params("test"), row_factory=dict_row) as conn:
        raw = conn.execute(query("turn_events_after"), (claimed.session_id, 0, 500)).fetchall()
        after_first = conn.execute(query("turn_events_after"), (claimed.session_id, orm[0]["id"], 2)).fetchall()
    assert [e["kind"] for e in orm] == ["queued", "running", "delta", "completed"]
    assert raw == orm  # same keys, values and types (uuid.UUID turn ids, dict data)
    assert after_first == orm[1:3]  # after the id, oldest first, at most the limit


def test_a_lost_hub_reader_loses_no_event_and_is_opened_again(server, token, claimed):
    """The hub's reader connection terminated under an open stream: the next event still arrives at
    once (the failed read sends the stream to read for itself) and the one after on a new reader."""
    dbname = connection.settings_dict["NAME"]
    stream = open_stream(server.port, f"/api/sessions/{claimed.session_id}/events/", token)
    assert stream.read() is None  # the heartbeat (the stream's own read found nothing new)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s "
                       "AND application_name = 'hermes-sse-reader'", [dbname])
        assert cursor.rowcount == 1
    writer = writer_for(claimed)
    for text in ("after the loss", "on a new reader"):
        started = time.monotonic()
        writer.add(events.DELTA, {"item_id": "m1", "text": text})
        writer.flush()
        event = stream.read()
        assert event is not None and event.data["text"] == text
        assert time.monotonic() - started < 1.0, "woken by NOTIFY and read at once, not at the heartbeat"

    def one_reader() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                           "AND application_name = 'hermes-sse-reader'", [dbname])
            return cursor.fetchone()[0] == 1

    _wait_for(one_reader, timeout=5)  # the second event may have come by the stream's own read, the reopen after
    stream.close()


@pytest.fixture(scope="module")
def slow_heartbeat_server(django_db_setup, django_db_blocker, tmp_path_factory) -> Iterator[ApiServer]:
    """A server whose heartbeat (30 s) is far beyond the 2 s an event may take after a lost LISTEN."""
    with django_db_blocker.unblock():
        api = ApiServer(tmp_path_factory.mktemp("sse-slow") / "server.log", heartbeat=30.0).start()
    try:
        yield api
    finally:
        api.stop()


def _hub_listeners() -> set[int]:
    """The pids of the API process's LISTEN backends."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s "
                       "AND application_name = 'hermes-sse-listener'", [connection.settings_dict["NAME"]])
        return {pid for (pid,) in cursor.fetchall()}


def _kill_hub_listener() -> int:
    """``pg_terminate_backend`` on the API process's LISTEN backend, as an operator would (once the
    stream's subscription has it open); its pid."""
    _wait_for(lambda: len(_hub_listeners()) == 1, timeout=5)
    (pid,) = _hub_listeners()
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    return pid


def test_after_the_listen_backend_is_killed_the_next_event_reaches_an_open_stream_within_two_seconds(
        slow_heartbeat_server, token, claimed):
    """Operators' finding: after ``pg_terminate_backend`` on ``hermes-sse-listener`` the hub listened
    again only on the next heartbeat tick, so a turn's events posted 3 s later waited for it (10-13.5 s
    late). The listener reconnects within a second (``hermes_sessions/listener.py``): an event written
    1.5 s after the kill reaches the open stream in under 2 s, with the heartbeat 30 s away."""
    stream = open_stream(slow_heartbeat_server.port, f"/api/sessions/{claimed.session_id}/events/", token)
    killed = _kill_hub_listener()
    time.sleep(1.5)
    assert len(_hub_listeners() - {killed}) == 1, "listening again within 1.5 s of the kill"
    writer = writer_for(claimed)
    for text in ("after the kill", "and the next"):
        started = time.monotonic()
        writer.add(events.DELTA, {"item_id": "m1", "text": text})
        writer.flush()
        event = stream.read()
        elapsed = time.monotonic() - started
        assert event is not None and event.data["text"] == text
        assert elapsed < 2.0, f"{elapsed:.2f} s after the event was written"
    stream.close()


def test_an_event_committed_while_the_listen_connection_was_down_is_read_at_the_reconnect(
        slow_heartbeat_server, token, claimed):
    """Its NOTIFY went to nobody: the listener connected for this stream well under a second before the
    kill, so its next attempt waits for the rest of ``RECONNECT_SECONDS`` and the event commits before it.
    The hub's re-read after every (re)connect hands it to the open stream, heartbeat 30 s away."""
    stream = open_stream(slow_heartbeat_server.port, f"/api/sessions/{claimed.session_id}/events/", token)
    writer = writer_for(claimed)
    writer.add(events.DELTA, {"item_id": "m1", "text": "while down"})
    started = time.monotonic()
    killed = _kill_hub_listener()
    writer.flush()
    assert not _hub_listeners() - {killed}, "committed while no LISTEN was in place"
    event = stream.read()
    elapsed = time.monotonic() - started
    assert event is not None and event.data["text"] == "while down"
    assert elapsed < 2.0, f"{elapsed:.2f} s after the kill"
    stream.close()


def test_a_client_that_leaves_right_after_a_heartbeat_resumes_without_a_gap(server, token, claimed):
    """Pitfall: 'heartbeats carried an id:, so a reconnect skipped real events'."""
    path = f"/api/turns/{claimed.turn_id}/events/"
    stream = open_stream(server.port, path, token)
    writer = writer_for(claimed)
    writer.add(events.DELTA, {"item_id": "m1", "text": "one "})
    writer.flush()
    seen = stream.read_until(lambda e: e.event == "delta")
    assert stream.read() is None  # the heartbeat
    assert sum(line.startswith("id:") for line in stream.raw) == len(stream.events)  # none on heartbeats
    assert stream.heartbeat_frames == [HEARTBEAT_FRAME]
    stream.close()  # gone right after the heartbeat
    writer.add(events.DELTA, {"item_id": "m1", "text": "two "})
    time.sleep(events.DELTA_FLUSH_SECONDS)
    writer.add(events.DELTA, {"item_id": "m1", "text": "three"})
    writer.flush()
    finish(claimed, "one two three")
    # A client reconnects with the last id it kept, whatever block carried it (a heartbeat's too).
    rest = open_stream(server.port, path, token, last_event_id=stream.last_event_id).read_to_end()
    assert [e.event for e in rest] == ["delta", "delta", "completed"]
    assert "".join(e.data["text"] for e in seen + rest if e.event == "delta") == "one two three"


def test_heartbeats_are_comment_frames_byte_for_byte_and_move_no_id(server, token, claimed):
    """Pitfall: 'heartbeats carried an id:, so a reconnect skipped real events'. Each tick's heartbeat is
    exactly ``HEARTBEAT_FRAME``, and the id a client keeps across heartbeats is its last event's."""
    stream = open_stream(server.port, f"/api/sessions/{claimed.session_id}/events/", token, last_event_id=0)
    seen = stream.read_until(lambda e: e.event == "running")
    assert stream.last_event_id == str(seen[-1].id)
    for _ in range(2):  # two ticks with nothing new
        assert stream.read() is None
    assert stream.heartbeat_frames == [HEARTBEAT_FRAME, HEARTBEAT_FRAME]
    retry, *event_frames, first, second = stream.frames  # every byte the stream sent, block by block
    assert (retry, first, second) == (b"retry: 1000\n\n", HEARTBEAT_FRAME, HEARTBEAT_FRAME)
    assert [f.split(b"\ndata: ")[0] for f in event_frames] == [f"id: {e.id}\nevent: {e.event}".encode() for e in seen]
    assert stream.last_event_id == str(seen[-1].id)
    stream.close()


def _stat_connections(dbname: str) -> tuple[int, int]:
    """(connections to the test database other than this one, of which the event hub's: its LISTEN
    connection and its reader)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*), count(*) FILTER (WHERE application_name IN ('hermes-sse-listener', 'hermes-sse-reader')) "
            "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", [dbname])
        total, listeners = cursor.fetchone()
    return total, listeners


def _wait_for(check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_fifty_killed_streams_leave_no_database_connection_behind(server, token, claimed):
    """Pitfall: 'under ASGI, cleanup in streaming generators ran late or never; persistent database
    connections leaked'. A first round warms the pool (it keeps up to DATABASE_POOL_MAX_SIZE idle
    connections on purpose); after it, 50 more streams killed mid-wait leave the count where it was,
    and the one shared LISTEN connection is closed with the last stream."""
    dbname = connection.settings_dict["NAME"]
    path = f"/api/sessions/{claimed.session_id}/events/"
    for sock in open_streams(server.port, path, token, 50):
        sock.close()
    _wait_for(lambda: _stat_connections(dbname)[1] == 0, timeout=15)
    baseline = _stat_connections(dbname)[0]

    socks = open_streams(server.port, path, token, 50)
    total, listeners = _stat_connections(dbname)
    assert listeners == 2, "one LISTEN connection and one reader per process, shared by all streams"
    assert total <= baseline + 2, "an open stream holds no database connection while it waits"
    for sock in socks:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        sock.close()
    _wait_for(lambda: _stat_connections(dbname) == (baseline, 0), timeout=15)


def test_sigterm_with_a_stream_open_then_resume_with_no_gap_or_duplicate(tmp_path, token, claimed):
    """Pitfall: 'with max-requests, open streams never drained; workers were killed by the timeout'.
    The server ends open streams at SIGTERM (well inside gunicorn's --graceful-timeout 10), comes back,
    and the client resumes from its last id."""
    path = f"/api/turns/{claimed.turn_id}/events/"
    writer = writer_for(claimed)
    first = ApiServer(tmp_path / "first.log", heartbeat=HEARTBEAT).start()
    try:
        stream = open_stream(first.port, path, token)
        writer.add(events.DELTA, {"item_id": "m1", "text": "before "})
        writer.flush()
        seen = stream.read_until(lambda e: e.event == "delta")
        took = first.terminate()
        assert took < 5, f"shutdown waited {took:.1f} s on the open stream"
        assert [e.event for e in stream.read_to_end(timeout=5)] == [] and stream.ended
    finally:
        first.stop()
    time.sleep(events.DELTA_FLUSH_SECONDS)
    writer.add(events.DELTA, {"item_id": "m1", "text": "while down "})
    writer.flush()
    second = ApiServer(tmp_path / "second.log", heartbeat=HEARTBEAT).start()
    try:
        resumed = open_stream(second.port, path, token, last_event_id=stream.last_event_id)
        writer.add(events.DELTA, {"item_id": "m1", "text": "after"})
        writer.flush()
        finish(claimed, "before while down after")
        rest = resumed.read_to_end()
    finally:
        second.stop()
    ids = [e.id for e in seen + rest]
    assert ids == sorted(set(ids))
    assert "".join(e.data["text"] for e in seen + rest if e.event == "delta") == "before while down after"
    assert rest[-1].event == "completed"


def test_an_imported_finished_turn_streams_its_terminal_event(server, token, claimed):
    """Export/import does not carry turn events; import writes each finished turn's terminal event."""
    from hermes_sessions.models import Session, TurnEvent
    from hermes_sessions.services.portability import session_export_line, session_import_line

    finish(claimed, "all done")
    line = session_export_line(session_id=claimed.session_id)
    Session.objects.filter(pk=claimed.session_id).delete()
    assert not TurnEvent.objects.filter(turn_id=claimed.turn_id).exists()
    assert session_import_line(line=line).imported
    assert list(TurnEvent.objects.filter(turn_id=claimed.turn_id).values_list("kind", flat=True)) == ["completed"]

    stream = open_stream(server.port, f"/api/turns/{claimed.turn_id}/events/", token)
    got = stream.read_to_end()
    assert [(e.event, e.data["final_text"], e.data["status"]) for e in got] == [("completed", "all done", "succeeded")]
    assert stream.last_event_id == str(got[0].id)
    assert open_stream(server.port, f"/api/turns/{claimed.turn_id}/events/", token,
                       last_event_id=stream.last_event_id).read_to_end() == []


def test_a_finished_turn_without_event_rows_streams_its_terminal_event_once(server, token, claimed):
    """A turn that ended before the 0003_turn_events migration has no rows: the stream writes the
    terminal event durably (a real id), a resume after it gets nothing, a second stream the same row."""
    from hermes_sessions.models import TurnEvent

    finish(claimed, "old turn")
    TurnEvent.objects.filter(turn_id=claimed.turn_id).delete()

    stream = open_stream(server.port, f"/api/turns/{claimed.turn_id}/events/", token)
    got = stream.read_to_end()
    assert [(e.event, e.data["final_text"]) for e in got] == [("completed", "old turn")]
    assert got[0].id == TurnEvent.objects.get(turn_id=claimed.turn_id).pk
    assert stream.last_event_id == str(got[0].id)
    assert open_stream(server.port, f"/api/turns/{claimed.turn_id}/events/", token,
                       last_event_id=stream.last_event_id).read_to_end() == []
    again = open_stream(server.port, f"/api/turns/{claimed.turn_id}/events/", token).read_to_end()
    assert [e.id for e in again] == [got[0].id]
    assert TurnEvent.objects.filter(turn_id=claimed.turn_id).count() == 1


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete"])
def test_another_method_on_a_stream_is_a_json_405_not_the_csrf_page(claimed, token, method):
    """POST with a token on /events/ is a JSON 405, not Django's HTML CSRF 403."""
    client = APIClient(enforce_csrf_checks=True)
    for path in (f"/api/turns/{claimed.turn_id}/events/", f"/api/sessions/{claimed.session_id}/events/"):
        response = getattr(client, method)(path, HTTP_AUTHORIZATION=f"Token {token}")
        assert response.status_code == 405, (method, path)
        assert response["Content-Type"].startswith("application/json")
        assert response.json()["code"] == "method_not_allowed" and response["Allow"] == "GET, HEAD, OPTIONS"


def test_a_chunked_body_is_a_json_411_not_an_empty_request(server, token):
    """On the real ASGI server: a chunked ``POST /api/sessions/`` would otherwise be created with none of
    its fields (DRF sizes bodies by Content-Length) and escape the 413 check."""
    body = b'{"id":"chunky","title":"t"}'
    request = (b"POST /api/sessions/ HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Token " + token.encode()
               + b"\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
               + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split()[1] == b"411", head
    assert b'"code":"length_required"' in payload
    assert not Session.objects.filter(title="t").exists() and not Session.objects.filter(pk="chunky").exists()


def test_prune_sessions_ends_an_open_session_stream_with_gone(server, token, claimed):
    """The failing input: a session stream stayed open (heartbeats) after ``prune_sessions`` deleted its
    session; only a reconnect got 404. Now the heartbeat tick's read finds it gone and the stream ends
    with ``event: gone`` (no id) carrying the 404 a reconnect gets."""
    from django.core.management import call_command

    path = f"/api/sessions/{claimed.session_id}/events/"
    stream = open_stream(server.port, path, token, last_event_id=0)
    finish(claimed, "done")  # a session with a running turn is not pruned
    seen = stream.read_until(lambda e: e.event == "completed")
    call_command("prune_sessions", "--before", "2999-01-01")
    assert not Session.objects.filter(pk=claimed.session_id).exists()
    started = time.monotonic()
    rest = stream.read_to_end(timeout=3 * HEARTBEAT)
    assert time.monotonic() - started < HEARTBEAT + 2, "ended on the first heartbeat tick after the deletion"
    assert [(e.event, e.id) for e in rest] == [("gone", None)]
    assert rest[0].data == {"detail": "The session was deleted; this stream has ended.", "code": "not_found",
                            "session": claimed.session_id}
    assert stream.ended and seen[-1].id is not None
    assert stream.last_event_id == str(seen[-1].id)  # heartbeats and ``gone`` carry none: the last real one is kept
    status, _, body = server.get(path, token)
    assert status == 404 and b'"code":"not_found"' in body


@pytest.mark.parametrize("revoke", ["token deleted", "user deactivated"])
def test_a_stream_whose_credentials_were_revoked_ends_with_gone_within_a_heartbeat(server, user, token, claimed, revoke):
    """A session stream opened with a token that was deleted since (or whose user was deactivated) must not
    go on sending the session's new turns, their input included, while only new requests get 401.
    Every read of the stream's own — one per heartbeat tick — authenticates its request again: the stream
    ends with ``event: gone`` carrying the 401 a reconnect gets, and a later turn's events never reach it."""
    path = f"/api/sessions/{claimed.session_id}/events/"
    stream = open_stream(server.port, path, token, last_event_id=0)
    assert [e.event for e in stream.read_until(lambda e: e.event == "running")] == ["queued", "running"]
    if revoke == "token deleted":
        Token.objects.filter(key=token).delete()
        detail, code = "Invalid token.", "authentication_failed"
    else:
        type(user).objects.filter(pk=user.pk).update(is_active=False)
        detail, code = "User inactive or deleted.", "authentication_failed"
    started = time.monotonic()
    rest = stream.read_to_end(timeout=3 * HEARTBEAT)
    assert time.monotonic() - started < HEARTBEAT + 2, "ended on the first heartbeat tick after the revocation"
    assert [(e.event, e.id) for e in rest] == [("gone", None)]
    assert rest[0].data == {"detail": f"{detail} This stream has ended.", "code": code, "session": claimed.session_id}
    assert stream.ended
    status, _, body = server.get(path, token)
    assert status == 401 and f'"detail":"{detail}"'.encode() in body


def test_a_cookie_session_logged_out_elsewhere_ends_its_stream_too(server, user, claimed):
    """The admin's browser authenticates by its session cookie: Django caches the session and its user on the
    request, so the stream reads both afresh on each tick — a session deleted (logged out elsewhere, expired)
    ends the stream with the 401 a reconnect gets."""
    import http.client

    from django.contrib.sessions.models import Session as DjangoSession
    from django.test import Client

    from tests.support.sse import Stream

    browser = Client()
    browser.force_login(user)
    cookie = browser.cookies["sessionid"].value
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", f"/api/sessions/{claimed.session_id}/events/",
                 headers={"Cookie": f"sessionid={cookie}", "Last-Event-ID": "0", "Accept": "text/event-stream"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    stream = Stream(conn, resp)
    assert [e.event for e in stream.read_until(lambda e: e.event == "running")] == ["queued", "running"]
    DjangoSession.objects.filter(session_key=cookie).delete()
    rest = stream.read_to_end(timeout=3 * HEARTBEAT)
    assert [(e.event, e.id) for e in rest] == [("gone", None)]
    assert rest[0].data["code"] == "not_authenticated" and stream.ended


def test_a_stream_whose_credentials_still_hold_stays_open_across_heartbeats(server, token, claimed):
    path = f"/api/sessions/{claimed.session_id}/events/"
    stream = open_stream(server.port, path, token, last_event_id=0)
    assert [e.event for e in stream.read_until(lambda e: e.event == "running")] == ["queued", "running"]
    time.sleep(2 * HEARTBEAT + 0.5)  # two ticks, each re-authenticating
    finish(claimed, "done")
    assert stream.read_until(lambda e: e.event == "completed")[-1].event == "completed"
    assert not stream.ended


def test_deleting_the_session_of_a_running_turn_ends_its_turn_stream_with_gone(server, token, claimed):
    """A turn stream ends after its terminal event; a turn deleted before it had one (the admin deletes
    a session whatever its turns' state) ends the stream with ``event: gone`` instead."""
    path = f"/api/turns/{claimed.turn_id}/events/"
    stream = open_stream(server.port, path, token)
    assert [e.event for e in stream.read_until(lambda e: e.event == "running")] == ["queued", "running"]
    Session.objects.filter(pk=claimed.session_id).delete()
    rest = stream.read_to_end(timeout=3 * HEARTBEAT)
    assert [(e.event, e.id) for e in rest] == [("gone", None)]
    assert rest[0].data == {"detail": "The turn was deleted; this stream has ended.", "code": "not_found",
                            "turn": str(claimed.turn_id)}
    assert server.get(path, token)[0] == 404


async def _first_frames(session_id: str, n: int) -> list[bytes]:
    """The first ``n`` frames of a session stream's body, run in this process (``streams._events``)."""
    from hermes_sessions.api import streams

    frames = []
    body = streams._events(streams._Scope(session_id=session_id), 0)
    async for frame in body:
        frames.append(frame)
        if len(frames) == n:
            break
    await body.aclose()
    return frames


def test_a_stream_whose_own_read_fails_stays_open_and_reads_again(claimed, settings, monkeypatch):
    """PostgreSQL restarted under 12 open streams: a stream whose own read gets psycopg_pool's PoolTimeout
    is not cut with an ASGI error. It stays open: a heartbeat, then the same read again, which finds the
    events."""
    from asgiref.sync import async_to_sync
    from psycopg_pool import PoolTimeout

    from hermes_sessions.api import event_hub, streams

    settings.HERMES_SSE_HEARTBEAT_SECONDS = 0.2

    async def no_listen(self):
        return None

    monkeypatch.setattr(event_hub.EventHub, "ensure_listening", no_listen)  # in-process: the reads alone
    real, calls = streams._Scope.read, []

    def flaky(self, after):
        calls.append(after)
        if len(calls) == 1:
            raise PoolTimeout("couldn't get a connection after 10.00 sec")
        return real(self, after)

    monkeypatch.setattr(streams._Scope, "read", flaky)

    frames = async_to_sync(_first_frames)(claimed.session_id, 4)
    assert frames[0].startswith(b"retry:") and frames[1] == b": heartbeat\n\n"
    assert [f.split(b"\n")[1] for f in frames[2:]] == [b"event: queued", b"event: running"]
    assert calls == [0, 0]  # the failed read was repeated from the same point


def test_a_hub_read_that_fails_during_the_streams_own_read_is_not_lost(claimed, settings, monkeypatch):
    """The hub's read fails (its reader connection lost) while the stream is in its own read, which
    started before the event committed: the stream reads again at once, not at the next heartbeat —
    the wake-up the failed read gave must survive the stream's clearing of its wake event."""
    from asgiref.sync import async_to_sync

    from hermes_sessions.api import event_hub, streams

    settings.HERMES_SSE_HEARTBEAT_SECONDS = 5.0

    async def no_listen(self):
        return None

    monkeypatch.setattr(event_hub.EventHub, "ensure_listening", no_listen)  # in-process: the reads alone
    real, calls = streams._Scope.read, []

    def read_then_the_hub_fails(self, after):
        found = real(self, after)
        calls.append(after)
        if len(calls) == 1:  # the event commits after this read's snapshot; the hub's read of it fails
            writer = writer_for(claimed)
            writer.add(events.DELTA, {"item_id": "m1", "text": "while the stream read"})
            writer.flush()
            (hub,) = [h for h in event_hub._hubs.values() if claimed.session_id in h._subscribers]
            (sub,) = hub._subscribers[claimed.session_id]

            def failed_read() -> None:
                sub.reread = True
                sub.wake.set()
            hub.loop.call_soon_threadsafe(failed_read)
        return found

    monkeypatch.setattr(streams._Scope, "read", read_then_the_hub_fails)

    started = time.monotonic()
    frames = async_to_sync(_first_frames)(claimed.session_id, 4)
    assert [f.split(b"\n")[1] for f in frames[1:]] == [b"event: queued", b"event: running", b"event: delta"]
    assert time.monotonic() - started < 2.5, "read again at once, not at the heartbeat"


def test_a_stream_that_cannot_be_opened_for_the_database_is_503_not_500(monkeypatch):
    from psycopg_pool import PoolTimeout

    from hermes_sessions.api import streams
    from project.asgi_handler import HermesASGIHandler
    from tests.test_asgi_handler import _run, _scope

    def unavailable(request):
        raise PoolTimeout("couldn't get a connection after 10.00 sec")

    monkeypatch.setattr(streams, "_authenticate", unavailable)
    status, body = _run(HermesASGIHandler(), _scope("/api/sessions/s1/events/"))
    assert status == 503 and b'"code":"database_unavailable"' in body


# HEAD and OPTIONS on the stream URLs are not 405. A client expects what
# DRF's views answer: HEAD is GET without a body — and here without a stream held open —, OPTIONS is 200
# with Allow; both refuse as GET does (401, 404).

STREAM_ALLOW = "GET, HEAD, OPTIONS"


def _raw(port: int, method: str, path: str, token: str | None) -> tuple[int, dict[str, str], bytes, float]:
    """One request with ``Connection: close``, read until the server closes: status, headers (lower-case
    names), body and the seconds it took. A response the server does not end (a stream) times out."""
    auth = f"Authorization: Token {token}\r\n" if token else ""
    request = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n".encode()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=HEARTBEAT * 2) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body, time.monotonic() - started


def _stream_paths(claim: TurnClaim) -> list[str]:
    return [f"/api/turns/{claim.turn_id}/events/", f"/api/sessions/{claim.session_id}/events/"]


def test_head_on_a_stream_answers_gets_headers_with_no_body_and_no_open_stream(server, token, claimed):
    """Under gunicorn + uvicorn (``make run``): the running turn's stream and the session's stream never
    end by themselves, so a HEAD that opened one would not be closed within a heartbeat."""
    for path in _stream_paths(claimed):
        stream = open_stream(server.port, path, token)
        get_headers = {name.lower(): value for name, value in stream.resp.getheaders()}
        stream.close()
        status, headers, body, seconds = _raw(server.port, "HEAD", path, token)
        assert (status, body) == (200, b""), (path, status, body)
        assert seconds < HEARTBEAT, f"{path}: HEAD held the connection {seconds:.1f} s"
        for name in ("content-type", "cache-control", "x-accel-buffering"):
            assert headers.get(name) == get_headers.get(name), (path, name, headers)


def test_head_and_options_on_a_stream_refuse_as_get_does(server, token, claimed):
    other = Token.objects.create(user=UserFactory()).key
    for path in _stream_paths(claimed):
        for method in ("HEAD", "OPTIONS"):
            status, headers, body, _ = _raw(server.port, method, path, None)
            assert (status, headers.get("www-authenticate")) == (401, "Token"), (method, path)
            assert _raw(server.port, method, path, "0" * 40)[0] == 401, (method, path)
            assert _raw(server.port, method, path, other)[0] == 404, (method, path)  # someone else's
        status, headers, body, _ = _raw(server.port, "OPTIONS", path, None)
        assert headers["content-type"] == "application/json" and b'"code":"not_authenticated"' in body
        assert _raw(server.port, "HEAD", path + "?last_event_id=-3", token)[0] == 400
    for method in ("HEAD", "OPTIONS"):
        assert _raw(server.port, method, "/api/turns/not-a-uuid/events/", token)[0] == 404
        assert _raw(server.port, method, "/api/sessions/no-such-session/events/", token)[0] == 404


def test_options_on_a_stream_answers_like_drfs_views(server, token, claimed):
    for path in _stream_paths(claimed):
        status, headers, body, _ = _raw(server.port, "OPTIONS", path, token)
        assert (status, headers["allow"], headers["content-type"]) == (200, STREAM_ALLOW, "application/json")
        described = json.loads(body)
        assert set(described) == {"name", "description", "renders", "parses"}  # DRF's SimpleMetadata keys
        assert described["renders"] == ["text/event-stream"] and described["parses"] == []
        assert described["name"] in ("Turn Events", "Session Events") and described["description"]
    drf = APIClient()
    drf.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    assert set(drf.options(f"/api/sessions/{claimed.session_id}/").json()) == set(described)


def _asgi(method: str, path: str, token: str) -> tuple[int, dict[bytes, bytes], bytes]:
    """``method path`` through the ASGI application in this process (as uvicorn calls it); the whole
    response within 5 s or ``TimeoutError`` (a stream left open)."""
    return async_to_sync(asgi_call)(HermesASGIHandler(), _scope(path, token, method=method), timeout=5)


def test_head_and_options_through_the_asgi_application_end_at_once(token, claimed):
    for path in _stream_paths(claimed):
        status, headers, body = _asgi("HEAD", path, token)
        assert (status, headers[b"Content-Type"], body) == (200, b"text/event-stream; charset=utf-8", b"")
        status, headers, body = _asgi("OPTIONS", path, token)
        assert (status, headers[b"Allow"], json.loads(body)["renders"]) == (200, STREAM_ALLOW.encode(),
                                                                            ["text/event-stream"])
        assert _asgi("HEAD", path, "")[0] == _asgi("OPTIONS", path, "")[0] == 401


def test_head_and_options_under_the_test_clients(token, claimed):
    """Django's async test client makes ASGI requests (HEAD as under uvicorn); the sync test client
    (and runserver) WSGI ones, where GET is a 501 and so is HEAD; OPTIONS needs no stream and answers."""
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}
    for path in _stream_paths(claimed):
        response = async_to_sync(AsyncClient().head)(path, headers={"Authorization": f"Token {token}"})
        assert (response.status_code, response["Content-Type"]) == (200, "text/event-stream; charset=utf-8")
        sync = APIClient()
        assert sync.head(path, **auth).status_code == sync.get(path, **auth).status_code == 501
        response = sync.options(path, **auth)
        assert (response.status_code, response["Allow"]) == (200, STREAM_ALLOW)
        assert sync.options(path).status_code == 401


def test_a_doubled_slash_api_path_is_a_json_404_on_the_real_server(server, token):
    """``tests/api/test_api_paths.py``'s failing input, ``GET //api/sessions/``, as uvicorn passes it on
    (it does not collapse slashes): the API's JSON 404, not Django's HTML page."""
    for path in ("//api/sessions/", "/api//sessions/", "//api"):
        status, headers, body, _ = _raw(server.port, "GET", path, token)
        assert (status, headers["content-type"]) == (404, "application/json"), (path, body[:200])
        assert json.loads(body) == {"detail": f"No API endpoint at {path}; GET /api/ lists them.", "code": "not_found"}
