"""Acceptance (issue 8): a real codex turn's agent-message deltas arrive in order over server-sent
events from a real ASGI server process (gunicorn + uvicorn worker) and a real Celery worker process
(the pinned codex binary, the model stand-in as its model); a client that disconnects mid-turn and
reconnects with Last-Event-ID receives the remaining events exactly once."""
import pytest
from rest_framework.authtoken.models import Token

from tests.support.sse import ApiServer, open_stream

from .test_seed_e2e import celery_worker  # noqa: F401 — the real worker fixture

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


def test_real_codex_deltas_stream_in_order_and_a_reconnect_gets_the_rest_exactly_once(
        user, celery_worker, stand_in, tmp_path):  # noqa: F811
    stand_in.slow_seconds = 4  # "SLOW": the reply comes in ≥ 20 deltas over 4 s — time to leave mid-turn
    token = Token.objects.create(user=user).key
    server = ApiServer(tmp_path / "api.log").start()
    try:
        assert server.post("/api/sessions/", token, {"id": "sess-sse"})[0] == 201
        text = "SLOW stream this reply to me in many small pieces please"
        status, turn = server.post("/api/sessions/sess-sse/turns/", token, {"input": text})
        assert status == 202, turn
        path = f"/api/turns/{turn['id']}/events/"

        stream = open_stream(server.port, path, token)
        first = stream.read_until(lambda e: sum(x.event == "delta" for x in stream.events) >= 3, timeout=60)
        stream.close()  # mid-turn: codex is still streaming
        rest = open_stream(server.port, path, token, last_event_id=stream.last_event_id).read_to_end(timeout=90)
        status, _, body = server.get(f"/api/turns/{turn['id']}/", token)
    finally:
        server.stop()

    events = first + rest
    ids = [e.id for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids), ids  # in order, none twice
    kinds = [e.event for e in events]
    assert kinds[:2] == ["queued", "running"], kinds
    assert kinds[-4:] == ["item", "thread", "usage", "completed"], kinds
    assert set(kinds[2:-4]) == {"delta"}, kinds
    assert any(e.event == "delta" for e in rest), "the reconnect came after the last delta: not mid-turn"
    deltas = "".join(e.data["text"] for e in events if e.event == "delta")
    final = events[-1].data["final_text"]
    assert deltas == final == f"echo: {text}"
    assert events[-1].data["status"] == "succeeded" and events[-4].data["messages"][0]["content"] == final
    assert status == 200 and f'"final_text":"{final}"'.encode() in body
