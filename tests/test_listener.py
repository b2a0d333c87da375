"""The one LISTEN implementation (``hermes_sessions/listener.py``), both ways of waiting — its own
thread and an asyncio event loop — on the real PostgreSQL: notifications reach ``on_notify``, a killed
backend is replaced at once and ``on_connect`` follows every connect, a refusing database is tried once
a second, and the connection is closed as the listener stops."""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import psycopg
import pytest
from django.db import connection

from hermes_sessions import listener as listener_module
from hermes_sessions.listener import RECONNECT_SECONDS, Listener, connection_params

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]

CHANNEL = "hermes_test_listener"
NAME = "hermes-test-listener"


def _notify(payload: str) -> None:
    with psycopg.connect(**connection_params("hermes-test-sender"), autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", [CHANNEL, payload])


def _backends() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND application_name = %s", [NAME])
        return cursor.fetchone()[0]


def _kill() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND application_name = %s", [NAME])
        assert cursor.rowcount == 1


def _wait_for(check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class Heard:
    """What a listener handed over: payloads, and a mark per ``on_connect``."""

    def __init__(self) -> None:
        self.payloads: list[str] = []
        self.connects: list[float] = []

    def notify(self, payload: str) -> None:
        self.payloads.append(payload)

    def connected(self) -> None:
        self.connects.append(time.monotonic())


def test_on_its_own_thread_it_reconnects_at_once_and_closes_its_connection_on_stop():
    heard = Heard()
    listening = Listener(CHANNEL, name=NAME, on_notify=heard.notify, on_connect=heard.connected)
    listening.start()
    try:
        _wait_for(lambda: len(heard.connects) == 1, 10)
        assert listening.listening.is_set() and _backends() == 1
        _notify("1 2 3")
        _wait_for(lambda: heard.payloads == ["1 2 3"], 2)
        time.sleep(max(0.0, heard.connects[0] + RECONNECT_SECONDS - time.monotonic()))
        _kill()
        killed = time.monotonic()
        _wait_for(lambda: len(heard.connects) == 2, 5)
        assert heard.connects[1] - killed < 0.5, "a connection older than RECONNECT_SECONDS is replaced at once"
        _notify("after")
        _wait_for(lambda: heard.payloads == ["1 2 3", "after"], 2)
    finally:
        started = time.monotonic()
        listening.stop()
        stopped_in = time.monotonic() - started
    assert not listening.is_alive() and not listening.listening.is_set()
    assert stopped_in < 0.5, "stop wakes the thread at once"
    _wait_for(lambda: _backends() == 0, 2)  # closed by stop (its backend leaves pg_stat_activity a moment later)


def test_on_an_event_loop_it_reconnects_at_once_and_closes_its_connection_when_cancelled():
    heard = Heard()
    reads: list[str] = []

    async def reread() -> None:  # an awaitable on_connect, as the event hub's
        await asyncio.sleep(0)
        reads.append("reread")
        heard.connected()

    async def scenario() -> None:
        listening = Listener(CHANNEL, name=NAME, on_notify=heard.notify, on_connect=reread)
        task = asyncio.get_running_loop().create_task(listening.run())
        try:
            while len(heard.connects) < 1:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(_notify, "on the loop")
            while heard.payloads != ["on the loop"]:
                await asyncio.sleep(0.01)
            await asyncio.to_thread(_kill)  # a connection younger than RECONNECT_SECONDS: the rest of it, then again
            killed = time.monotonic()
            while len(heard.connects) < 2:
                assert time.monotonic() - killed < 5
                await asyncio.sleep(0.01)
            assert heard.connects[1] - heard.connects[0] < RECONNECT_SECONDS + 0.5
            await asyncio.to_thread(_notify, "again")
            while heard.payloads != ["on the loop", "again"]:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert not listening.listening.is_set()

    asyncio.run(scenario())
    assert reads == ["reread", "reread"]
    _wait_for(lambda: _backends() == 0, 2)  # closed when the task was cancelled


def test_a_refusing_database_is_tried_once_a_second_and_listened_to_within_a_second_when_back(monkeypatch):
    real = listener_module.connection_params
    refusing = threading.Event()
    refusing.set()
    attempts: list[float] = []
    downs: list[float] = []

    def params(name: str) -> dict:
        attempts.append(time.monotonic())
        got = real(name)
        return {**got, "dbname": "hermes_no_such_database"} if refusing.is_set() else got

    monkeypatch.setattr(listener_module, "connection_params", params)
    heard = Heard()
    listening = Listener(CHANNEL, name=NAME, on_notify=heard.notify, on_connect=heard.connected,
                         on_down=lambda: downs.append(time.monotonic()))
    listening.start()
    try:
        time.sleep(2.5)
        assert len(attempts) == len(downs) == 3 and not heard.connects  # at 0, 1 and 2 s
        assert all(0.9 < b - a < 1.3 for a, b in zip(attempts, attempts[1:], strict=False))
        refusing.clear()
        back = time.monotonic()
        _wait_for(lambda: heard.connects, 2)
        assert heard.connects[0] - back < 1.0
        _notify("back")
        _wait_for(lambda: heard.payloads == ["back"], 2)
    finally:
        listening.stop()
    _wait_for(lambda: _backends() == 0, 2)


def test_a_failing_callback_is_logged_and_the_listener_goes_on(caplog):
    heard = Heard()

    def notify(payload: str) -> None:
        if payload == "boom":
            raise RuntimeError("the callback failed")
        heard.notify(payload)

    listening = Listener(CHANNEL, name=NAME, on_notify=notify, on_connect=heard.connected)
    listening.start()
    try:
        _wait_for(lambda: heard.connects, 10)
        _notify("boom")
        _notify("next")
        _wait_for(lambda: heard.payloads == ["next"], 2)
        assert "the callback failed" in caplog.text and len(heard.connects) == 1
    finally:
        listening.stop()


def test_listen_connections_use_database_listen_url_when_set(settings):
    """Behind PgBouncer ``DATABASE_URL`` is PgBouncer's; the connections that LISTEN go to
    ``DATABASE_LISTEN_URL`` (PostgreSQL itself), its libpq URL parameters kept."""
    assert connection_params("x")["dbname"] == settings.DATABASES["default"]["NAME"]  # unset: the default database
    settings.DATABASE_LISTEN_URL = "postgres://hermes:pw@db.internal:5433/hermes?sslmode=require"
    assert connection_params("hermes-wake") == {
        "user": "hermes", "password": "pw", "host": "db.internal", "port": "5433", "dbname": "hermes",
        "sslmode": "require", "application_name": "hermes-wake"}
