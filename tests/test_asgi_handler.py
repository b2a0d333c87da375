"""``project.asgi_handler.HermesASGIHandler``: ordinary (sync) views run their whole middleware chain
and the view in one thread hop; coroutine views (the event streams) keep Django's async chain.

Driven through the ASGI application itself (``asgiref.testing.ApplicationCommunicator``), as uvicorn
calls it. The event-stream tests (``tests/api/test_event_streams.py``) run the same application under
gunicorn + uvicorn."""
from __future__ import annotations

import json
from typing import Any

import pytest
from asgiref import sync as asgiref_sync
from django.core.handlers.asgi import ASGIHandler
from rest_framework.authtoken.models import Token

from project.asgi_handler import HermesASGIHandler, _async_view
from tests.support.asgi import asgi_call

pytestmark = pytest.mark.django_db(transaction=True)  # the request runs in another thread, on its own connection


def _scope(path: str, token: str = "", method: str = "GET", query: bytes = b"") -> dict[str, Any]:
    headers = [(b"host", b"testserver")]
    if token:
        headers.append((b"authorization", f"Token {token}".encode()))
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 50000), "server": ("testserver", 80)}


async def _call(app: Any, scope: dict[str, Any]) -> tuple[int, bytes]:
    status, _headers, body = await asgi_call(app, scope)
    return status, body


def _run(app: Any, scope: dict[str, Any]) -> tuple[int, bytes]:
    return asgiref_sync.async_to_sync(_call)(app, scope)


def _hops(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``sync_to_async`` wrapper created from now on, by the name of what it runs."""
    made: list[str] = []
    original = asgiref_sync.SyncToAsync.__init__

    def counting(self: Any, func: Any, *args: Any, **kwargs: Any) -> None:
        made.append(getattr(func, "__qualname__", repr(func)))
        original(self, func, *args, **kwargs)

    monkeypatch.setattr(asgiref_sync.SyncToAsync, "__init__", counting)
    return made


@pytest.mark.parametrize(("path", "is_async"), [
    ("/api/sessions/s1/events/", True),
    ("/api/sessions/s1/events", True),  # ApiOptionalSlashMiddleware appends the slash later
    ("/api/turns/0190f0c4-0000-7000-8000-000000000000/events/", True),
    ("/api/", False),
    ("/api/sessions/s1/turns/", False),
    ("/admin/", False),
    ("/no/such/path", False),
])
def test_async_views_are_told_from_sync_ones_by_their_route(path: str, is_async: bool) -> None:
    assert _async_view(path) is is_async


def test_a_drf_view_answers_through_one_thread_hop_not_one_per_middleware(monkeypatch, django_user_model):
    token = Token.objects.create(user=django_user_model.objects.create_user("asgi")).key
    app = HermesASGIHandler()
    hops = _hops(monkeypatch)
    status, body = _run(app, _scope("/api/", token))
    assert status == 200 and "sessions" in json.loads(body)
    ours = [h for h in hops if "get_response" in h or "process_" in h or "inner" in h]
    assert ours == ["BaseHandler.get_response"], hops
    # Django's own handler, for the record: a hop per middleware step (this is what the class removes).
    monkeypatch.undo()
    hops = _hops(monkeypatch)
    status, _ = _run(ASGIHandler(), _scope("/api/", token))
    assert status == 200 and sum("process_" in h for h in hops) >= 8, hops


def test_errors_and_middleware_refusals_keep_their_answers_on_the_one_hop_path():
    app = HermesASGIHandler()
    status, body = _run(app, _scope("/api/sessions/"))  # no credentials
    assert status == 401 and json.loads(body)["code"] == "not_authenticated"
    status, body = _run(app, _scope("/api/", query=b"x=%00"))  # RejectNulMiddleware
    assert status == 400 and json.loads(body)["code"] == "bad_request"
    status, _ = _run(app, _scope("/api/no-such-route/"))
    assert status == 404


def test_an_event_stream_still_takes_the_async_chain(monkeypatch):
    app = HermesASGIHandler()
    hops = _hops(monkeypatch)
    status, body = _run(app, _scope("/api/sessions/s1/events/"))  # no credentials: its JSON 401
    assert status == 401 and json.loads(body)["code"] == "not_authenticated"
    assert "BaseHandler.get_response" not in hops, hops


def test_the_served_application_is_this_handler():
    from project.asgi import application

    assert isinstance(application, HermesASGIHandler)


def test_a_static_file_is_served_under_asgi_without_djangos_sync_iterator_warning():
    """WhiteNoise's file iterator is synchronous: Django's ASGI handler warned once per process on the
    first static file (``make run``'s log); ``project/asgi.py`` filters it. In a
    process of its own: pytest resets the warning filters around each test."""
    import subprocess
    import sys

    from django.conf import settings

    code = "\n".join([
        "import warnings",
        "warnings.simplefilter('default')",
        "import project.asgi",
        "from asgiref.sync import async_to_sync",
        "from asgiref.testing import ApplicationCommunicator",
        "scope = " + repr(_scope("/static/admin/css/base.css")),
        "async def get():",
        "    comm = ApplicationCommunicator(project.asgi.application, scope)",
        "    await comm.send_input({'type': 'http.request', 'body': b'', 'more_body': False})",
        "    start = await comm.receive_output(timeout=10)",
        "    body = b''",
        "    while True:",
        "        msg = await comm.receive_output(timeout=10)",
        "        body += msg.get('body', b'')",
        "        if not msg.get('more_body'):",
        # Let the application end (Django closes the response's file and the request body there): otherwise a
        # garbage collection inside the block reports them as unclosed, by chance of allocation counts.
        "            await comm.wait(timeout=10)",
        "            return start['status'], body",
        "with warnings.catch_warnings(record=True) as caught:",
        "    status, body = async_to_sync(get)()",
        "print(status, len(body), [str(w.message)[:60] for w in caught])",
    ])
    out = subprocess.run([sys.executable, "-c", code], cwd=settings.BASE_DIR, capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "DJANGO_SETTINGS_MODULE": "project.settings_test"})
    assert out.returncode == 0, out.stderr[-2000:]
    status, size, caught = out.stdout.strip().split(" ", 2)
    assert status == "200" and int(size) > 1000
    assert caught == "[]", caught


def _wait_until(predicate: Any, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_consecutive_requests_run_on_one_kept_thread_not_a_new_one_each(monkeypatch, django_user_model):
    """Django's handler starts a thread per request for its executor and another to join it; this one
    hands the next request the thread the last one used (``RequestThreads``)."""
    import threading

    token = Token.objects.create(user=django_user_model.objects.create_user("kept")).key
    app = HermesASGIHandler()
    seen: list[int] = []
    original = app._sync_handler.get_response

    def recording(request: Any) -> Any:
        seen.append(threading.get_ident())
        return original(request)

    monkeypatch.setattr(app._sync_handler, "get_response", recording)
    started: list[str] = []
    monkeypatch.setattr(threading.Thread, "start", _counting_start(started, threading.Thread.start))
    baseline = _backends()
    for _ in range(3):
        status, body = _run(app, _scope("/api/", token))
        assert status == 200 and "sessions" in json.loads(body)
        _wait_until(lambda: app.threads.idle_count() == 1)
    assert len(seen) == 3 and len(set(seen)) == 1, seen
    assert _backends() == baseline  # the idle kept thread holds no database connection
    # one thread for the first request's executor (asgiref's async_to_sync of the test may start its own)
    assert sum(name.startswith("hermes-request") for name in started) == 1, started


def _backends() -> int:
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


def _counting_start(started: list[str], original: Any) -> Any:
    def start(self: Any) -> None:
        started.append(self.name)
        original(self)
    return start


def test_a_request_thread_still_busy_after_its_request_is_not_handed_out_until_it_is_idle():
    """A view whose client went away goes on running after ``handle`` returns: its executor is given back
    then, but handed out again only once what ran on it has ended."""
    import threading

    from project.asgi_handler import RequestThreads

    threads = RequestThreads()
    busy = threads.take()
    release = threading.Event()
    running = busy.submit(release.wait, 10)
    threads.give_back(busy)
    assert threads.idle_count() == 0
    other = threads.take()
    assert other is not busy  # a new executor, not one whose thread is still in the abandoned view
    release.set()
    assert running.result(timeout=5) is True
    _wait_until(lambda: threads.idle_count() == 1)
    assert threads.take() is busy
    for each in (busy, other):
        each.shutdown()


def test_request_threads_keep_at_most_keep_idle_and_forget_a_parents_after_a_fork():
    from project.asgi_handler import RequestThreads

    threads = RequestThreads(keep=1)
    first, second = threads.take(), threads.take()
    threads.give_back(first)
    _wait_until(lambda: threads.idle_count() == 1)
    threads.give_back(second)
    _wait_until(lambda: second._shutdown)  # over the bound: shut down from its own thread
    assert threads.idle_count() == 1
    threads._pid = -1  # as in a forked child: the parent's idle executors have no thread there
    fresh = threads.take()
    assert fresh is not first and threads.idle_count() == 0
    for each in (first, fresh):
        each.shutdown()
