"""``project/asgi.py``: the served application is Django's own ``ASGIHandler``; DRF views, the middleware's
refusals and the event streams answer through it as they do under WSGI.

Driven through the ASGI application itself (``asgiref.testing.ApplicationCommunicator``), as uvicorn
calls it. The event-stream tests (``tests/api/test_event_streams.py``) run the same application under
gunicorn + uvicorn."""
from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from django.core.handlers.asgi import ASGIHandler
from rest_framework.authtoken.models import Token

from tests.support.asgi import asgi_call, asgi_get, asgi_scope

pytestmark = pytest.mark.django_db(transaction=True)  # the request runs in another thread, on its own connection


def test_the_served_application_is_djangos_asgi_handler():
    from project.asgi import application

    assert type(application) is ASGIHandler


def test_a_drf_view_answers_under_asgi(django_user_model):
    token = Token.objects.create(user=django_user_model.objects.create_user("asgi")).key
    status, body = asgi_get(ASGIHandler(), asgi_scope("/api/", token))
    assert status == 200 and "sessions" in json.loads(body)


def test_errors_and_middleware_refusals_keep_their_answers_under_asgi():
    app = ASGIHandler()
    status, body = asgi_get(app, asgi_scope("/api/sessions/"))  # no credentials
    assert status == 401 and json.loads(body)["code"] == "not_authenticated"
    status, body = asgi_get(app, asgi_scope("/api/", query=b"x=%00"))  # RejectNulMiddleware
    assert status == 400 and json.loads(body)["code"] == "bad_request"
    status, _ = asgi_get(app, asgi_scope("/api/no-such-route/"))
    assert status == 404


def test_an_event_stream_view_runs_on_the_event_loop_not_in_a_thread(monkeypatch):
    """The stream views are coroutines: Django awaits them on the event loop, so an open stream holds no
    thread (only the sync middleware steps and the view's own database reads go through ``sync_to_async``)."""
    import asyncio

    from hermes_sessions.api import streams

    loops: list[object] = []
    real_open = streams._open

    async def recording(*args, **kwargs):
        loops.append(asyncio.get_running_loop())  # raises RuntimeError in a sync_to_async thread
        return await real_open(*args, **kwargs)

    async def serve():
        loops.append(asyncio.get_running_loop())  # the server's loop
        return await asgi_call(ASGIHandler(), asgi_scope("/api/sessions/s1/events/"))

    monkeypatch.setattr(streams, "_open", recording)
    status, _headers, body = async_to_sync(serve)()  # no credentials: its JSON 401
    assert status == 401 and json.loads(body)["code"] == "not_authenticated"
    server_loop, view_loop = loops
    assert view_loop is server_loop  # awaited on the server's loop, not run by async_to_sync in a thread


def test_a_static_file_is_served_under_asgi_without_djangos_sync_iterator_warning():
    """WhiteNoise's file iterator is synchronous: Django's ASGI handler warned once per process on the
    first static file (a newcomer found it in ``make run``'s log); ``project/asgi.py`` filters it. In a
    process of its own: pytest resets the warning filters around each test."""
    import os
    import subprocess
    import sys

    from django.conf import settings

    code = "\n".join([
        "import warnings",
        "warnings.simplefilter('default')",
        "import project.asgi",
        "from asgiref.sync import async_to_sync",
        "from asgiref.testing import ApplicationCommunicator",
        "scope = " + repr(asgi_scope("/static/admin/css/base.css")),
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
                         env={**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings_test"})
    assert out.returncode == 0, out.stderr[-2000:]
    status, size, caught = out.stdout.strip().split(" ", 2)
    assert status == "200" and int(size) > 1000
    assert caught == "[]", caught
