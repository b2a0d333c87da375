"""Webhooks against real PostgreSQL and a real HTTP receiver on 127.0.0.1: the outbox written in the
event's transaction by every path that writes an event (migration 0013's trigger), the signed
deliveries, retries with one ``webhook-id``, disabling, and the SSRF checks."""
from __future__ import annotations

import json
import socket
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from standardwebhooks import Webhook

from hermes_sessions import selectors, services, worker
from hermes_sessions.codex.server_requests import approval_request
from hermes_sessions.models import Notice, Turn, TurnEvent, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from hermes_sessions.services import events
from hermes_sessions.webhook_targets import TargetRefused, target_check
from tests.support.dispatch import claimed_with_writer, hold_dispatches
from tests.support.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.django_db(transaction=True)

ALL = list(WebhookEndpoint.EVENT_TYPES)


@pytest.fixture
def allow_local(settings):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = True
    settings.HERMES_WEBHOOK_BACKOFF_SECONDS = 0.0
    return settings


def endpoint_for(user, url="http://127.0.0.1:9/hook", event_types=ALL, **kwargs):
    return services.webhook_endpoint_create(owner=user, url=url, event_types=event_types, **kwargs)


def send_due():
    """What a worker does: the sweep round's claim, then the task's attempts (in-process)."""
    token, ids = services.webhook_deliveries_claim(limit=50)
    return worker.webhooks_deliver(delivery_ids=ids, token=token) if ids else {}


def deliveries(**filters):
    return list(WebhookDelivery.objects.filter(**filters).order_by("id"))


# --- the outbox: one row per event and endpoint, in the event's transaction, on every path -----------

def test_a_finished_turn_writes_one_delivery_per_matching_endpoint_in_its_finalize(user, allow_local, scripted_codex,
                                                                                  run_turn_now, django_user_model):
    mine = endpoint_for(user)
    endpoint_for(user, event_types=["turn.failed"])  # not this event
    other = django_user_model.objects.create_user(username="bob", is_staff=True)
    endpoint_for(other)  # another user's, not for all sessions: nothing
    watcher = endpoint_for(other, all_sessions=True)  # staff, every session
    session = services.session_create(owner=user)
    turn = run_turn_now(session=session, text="hello hooks", user=user)  # the pipelined finalize
    rows = deliveries(event_type="turn.succeeded")
    assert {d.endpoint_id for d in rows} == {mine.pk, watcher.pk}
    event = TurnEvent.objects.get(turn=turn, kind="completed")
    d = rows[0]
    assert d.event_id == event.id and d.webhook_id == f"msg_{event.id}_{d.endpoint_id}"
    assert d.payload["type"] == "turn.succeeded"
    assert d.payload["data"] == {"session": session.pk, "turn": str(turn.pk), "attempt": 1, "event": event.id,
                                 "status": "succeeded", "error": "", "final_text": "echo: hello hooks"}
    assert d.payload["timestamp"].endswith("Z")
    assert not deliveries(event_type="thread.rotated")  # a started thread is no rotation


def test_no_endpoint_no_row_and_a_delta_never_fires_the_trigger(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="quiet", user=user)
    assert WebhookDelivery.objects.count() == 0


def test_a_rolled_back_event_leaves_no_delivery(user, allow_local, monkeypatch):
    endpoint_for(user)
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="x", user=user)
    with pytest.raises(RuntimeError), transaction.atomic():
        turn.status = Turn.Status.FAILED
        events.event_terminal(turn=turn)  # services/events.py's one-statement insert
        assert WebhookDelivery.objects.count() == 1  # written with the event …
        raise RuntimeError("the turn's transaction fails")
    assert WebhookDelivery.objects.count() == 0  # … and gone with it


def test_a_cancelled_queued_turn_writes_its_delivery(user, allow_local, monkeypatch):
    endpoint_for(user)
    hold_dispatches(monkeypatch)
    session = services.session_create(owner=user)
    turn = services.turn_enqueue(session=session, input_text="never run", user=user)
    services.turn_cancel(turn=turn)  # event_append inside the cancel's transaction
    (d,) = deliveries()
    assert d.event_type == "turn.cancelled" and d.payload["data"]["status"] == "cancelled"


def test_a_rotation_writes_thread_rotated_with_the_notice(user, allow_local, scripted_codex, run_turn_now):
    endpoint_for(user, event_types=["thread.rotated"])
    session = services.session_create(owner=user)
    first = run_turn_now(session=session, text="one", user=user)
    scripted_codex.remove_rollout(first.codex_thread_id)
    rotated = run_turn_now(session=session, text="two", user=user)
    (d,) = deliveries()
    assert d.event_type == "thread.rotated" and d.turn_id == rotated.pk
    assert d.payload["data"]["notice"] == services.NOTICE_THREAD_ROTATED
    assert d.payload["data"]["thread_id"] == rotated.codex_thread_id
    assert d.payload["data"]["rotated_from"] == first.codex_thread_id


def test_an_approval_request_writes_approval_requested(user, allow_local, monkeypatch):
    endpoint_for(user, event_types=["approval.requested"])
    _, turn, claim, _ = claimed_with_writer(user, monkeypatch)
    request = approval_request("item/commandExecution/requestApproval",
                               {"threadId": "t", "turnId": "u", "itemId": "c", "command": "ls", "cwd": "/tmp"})
    assert request is not None
    approval = services.approval_request(turn_id=turn.id, token=claim.token, request=request, timeout=60)
    (d,) = deliveries()
    data = d.payload["data"]
    assert (d.event_type, data["approval"], data["kind"]) == ("approval.requested", str(approval.pk), "command")
    assert data["request"]["command"] == "ls" and data["available_decisions"] == approval.available_decisions


def test_a_disabled_endpoint_gets_no_new_delivery(user, allow_local, monkeypatch):
    endpoint = endpoint_for(user)
    services.webhook_endpoint_update(endpoint=endpoint, user=user, changes={"active": False})
    hold_dispatches(monkeypatch)
    turn = services.turn_enqueue(session=services.session_create(owner=user), input_text="x", user=user)
    services.turn_cancel(turn=turn)
    assert WebhookDelivery.objects.count() == 0


# --- sending: signed, retried with one webhook-id, disabled past the threshold -------------------------

def test_the_receiver_gets_one_signed_delivery_per_event(user, allow_local, scripted_codex, run_turn_now):
    with WebhookReceiver() as receiver:
        endpoint = endpoint_for(user, url=receiver.url)
        session = services.session_create(owner=user)
        run_turn_now(session=session, text="first", user=user)
        run_turn_now(session=session, text="second", user=user)
        assert send_due() == {"succeeded": 2, "failed": 0, "skipped": 0}
        assert send_due() == {}  # nothing due twice
        got = receiver.received
    assert len(got) == 2 and len({r.headers["webhook-id"] for r in got}) == 2
    for r in got:
        payload = Webhook(endpoint.secret).verify(r.body, r.headers)  # raises on a bad signature
        assert payload["type"] == "turn.succeeded" and r.headers["Content-Type"] == "application/json"
    texts = [json.loads(r.body)["data"]["final_text"] for r in got]
    assert texts == ["echo: first", "echo: second"]
    with pytest.raises(Exception, match="signature"):
        Webhook("whsec_" + "A" * 43 + "=").verify(got[0].body, got[0].headers)
    assert {d.status for d in deliveries()} == {"succeeded"}


def test_three_500s_then_success_is_one_event_with_one_webhook_id(user, allow_local, monkeypatch):
    with WebhookReceiver(answers=[500, 500, 500]) as receiver:
        endpoint = endpoint_for(user, url=receiver.url)
        hold_dispatches(monkeypatch)
        services.turn_cancel(turn=services.turn_enqueue(session=services.session_create(owner=user),
                                                        input_text="x", user=user))
        for _ in range(4):
            send_due()
        got = receiver.received
    assert [r.headers["webhook-id"] for r in got] == [got[0].headers["webhook-id"]] * 4
    assert len({r.body for r in got}) == 1  # the same event; only the timestamp and signature are the attempt's
    for r in got:
        Webhook(endpoint.secret).verify(r.body, r.headers)
    (d,) = deliveries()
    assert (d.status, d.attempts) == ("succeeded", 4)
    assert [a.status_code for a in WebhookAttempt.objects.filter(delivery=d)] == [500, 500, 500, 204]
    endpoint.refresh_from_db()
    assert endpoint.consecutive_failures == 0 and endpoint.active


def test_backoff_doubles_to_its_cap_and_gives_up_after_the_retry_window(user, allow_local, settings, monkeypatch):
    settings.HERMES_WEBHOOK_BACKOFF_SECONDS, settings.HERMES_WEBHOOK_BACKOFF_MAX_SECONDS = 5.0, 30.0
    from hermes_sessions.services.webhooks import backoff_seconds
    assert [backoff_seconds(n) for n in (1, 2, 3, 4, 5)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    settings.HERMES_WEBHOOK_BACKOFF_SECONDS = 0.0
    with WebhookReceiver(answers=[503]) as receiver:
        endpoint_for(user, url=receiver.url)
        hold_dispatches(monkeypatch)
        services.turn_cancel(turn=services.turn_enqueue(session=services.session_create(owner=user),
                                                        input_text="x", user=user))
        WebhookDelivery.objects.update(created_at=timezone.now() - timedelta(days=2))  # past the window
        send_due()
    (d,) = deliveries()
    assert d.status == "gave_up" and d.last_status_code == 503


def test_an_endpoint_failing_past_the_threshold_is_disabled_with_a_notice(user, allow_local, settings, monkeypatch):
    settings.HERMES_WEBHOOK_DISABLE_AFTER = 3
    with WebhookReceiver(answers=[500] * 10) as receiver:
        endpoint = endpoint_for(user, url=receiver.url)
        hold_dispatches(monkeypatch)
        session = services.session_create(owner=user)
        services.turn_cancel(turn=services.turn_enqueue(session=session, input_text="x", user=user))
        for _ in range(5):
            send_due()
        assert len(receiver.received) == 3  # nothing is sent to it once disabled
    endpoint.refresh_from_db()
    assert not endpoint.active and endpoint.consecutive_failures == 3
    assert endpoint.disabled_reason.startswith("3 consecutive failed attempts; the last: HTTP 500")
    (notice,) = Notice.objects.filter(session=session, kind=Notice.Kind.WEBHOOK)
    assert f"Webhook endpoint {endpoint.pk}" in notice.text and "re-enable" in notice.text
    assert deliveries()[0].status == "failed"  # it waits for the endpoint to come back
    services.webhook_endpoint_enable(endpoint_id=endpoint.pk)
    with WebhookReceiver() as receiver:
        WebhookEndpoint.objects.filter(pk=endpoint.pk).update(url=receiver.url)
        send_due()
        assert len(receiver.received) == 1
    assert deliveries()[0].status == "succeeded"


def test_a_redirect_is_not_followed(user, allow_local, monkeypatch):
    with WebhookReceiver() as target, WebhookReceiver(answers=[302], redirect_to="") as receiver:
        receiver.redirect_to = target.url
        endpoint_for(user, url=receiver.url)
        hold_dispatches(monkeypatch)
        services.turn_cancel(turn=services.turn_enqueue(session=services.session_create(owner=user),
                                                        input_text="x", user=user))
        send_due()
        assert len(receiver.received) == 1 and target.received == []
    (d,) = deliveries()
    assert d.status == "failed" and d.last_status_code == 302 and "not followed" in d.last_error


def test_a_claim_lost_to_another_sender_sends_nothing(user, allow_local, monkeypatch):
    with WebhookReceiver() as receiver:
        endpoint_for(user, url=receiver.url)
        hold_dispatches(monkeypatch)
        services.turn_cancel(turn=services.turn_enqueue(session=services.session_create(owner=user),
                                                        input_text="x", user=user))
        old_token, ids = services.webhook_deliveries_claim(limit=10)
        assert ids and services.webhook_deliveries_claim(limit=10)[1] == []  # claimed: not due for another
        WebhookDelivery.objects.update(next_attempt_at=timezone.now())  # the lease ran out
        new_token, again = services.webhook_deliveries_claim(limit=10)
        assert again == ids
        assert worker.webhooks_deliver(delivery_ids=ids, token=old_token)["skipped"] == 1
        assert worker.webhooks_deliver(delivery_ids=ids, token=new_token)["succeeded"] == 1
        assert len(receiver.received) == 1


# --- SSRF ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "http://127.0.0.1/hook", "http://10.0.0.1/", "http://169.254.169.254/latest/meta-data/", "http://[::1]:8080/",
    "http://[::ffff:127.0.0.1]/", "http://[::ffff:10.0.0.1]/", "http://0.0.0.0/", "http://100.64.0.1/",
    "http://192.168.1.1/", "http://[fe80::1]/", "http://224.0.0.1/", "http://localhost:8000/",
    "ftp://example.com/", "http://user:pw@93.184.215.14/", "http:///nohost", "http://no-such-host.invalid/",
])
def test_internal_and_malformed_targets_are_refused(url, settings):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = False
    with pytest.raises(TargetRefused):
        target_check(url)


def test_a_public_address_passes_and_allowances_are_the_operators(settings):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = False
    assert target_check("https://93.184.215.14:8443/x").addresses == ("93.184.215.14",)
    settings.HERMES_WEBHOOK_ALLOWED_NETWORKS = ["10.1.0.0/16"]
    assert target_check("http://10.1.2.3/").addresses == ("10.1.2.3",)
    with pytest.raises(TargetRefused):
        target_check("http://10.2.0.1/")
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = True
    assert target_check("http://127.0.0.1/").addresses == ("127.0.0.1",)


def test_a_hostname_that_resolves_to_an_internal_address_among_public_ones_is_refused(settings, monkeypatch):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = False
    answers = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", 80)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 80))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: answers)
    with pytest.raises(TargetRefused, match="resolves to 127.0.0.1"):
        target_check("http://hooks.example.com/")


def test_a_target_whose_dns_changed_to_loopback_is_refused_at_send(user, settings, monkeypatch):
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = False
    with WebhookReceiver() as receiver:
        port = receiver.server.server_address[1]
        public = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port))]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: public)
        endpoint_for(user, url=f"http://hooks.example.com:{port}/hook")  # registered: public then
        loopback = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: loopback)  # the DNS answer changed
        hold_dispatches(monkeypatch)
        services.turn_cancel(turn=services.turn_enqueue(session=services.session_create(owner=user),
                                                        input_text="x", user=user))
        send_due()
        assert receiver.received == []
    (d,) = deliveries()
    assert d.status == "failed" and d.last_status_code is None
    assert d.last_error.startswith("target refused: the host 'hooks.example.com' resolves to 127.0.0.1")


def test_the_connection_goes_to_the_checked_address_with_the_name_as_host(user, settings, monkeypatch):
    """The resolver is asked once per attempt; the request reaches the address it gave, ``Host`` naming the host."""
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE = True
    calls = []
    with WebhookReceiver() as receiver:
        port = receiver.server.server_address[1]

        def resolver(host, *a, **k):
            calls.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

        monkeypatch.setattr(socket, "getaddrinfo", resolver)
        endpoint_for(user, url=f"http://hooks.example.com:{port}/hook")
        hold_dispatches(monkeypatch)
        services.turn_cancel(turn=services.turn_enqueue(session=services.session_create(owner=user),
                                                        input_text="x", user=user))
        calls.clear()
        send_due()
        (got,) = receiver.received
    # The name is resolved once (the check); the connection asks only about the checked IP literal.
    assert calls[0] == "hooks.example.com" and set(calls[1:]) <= {"127.0.0.1"}
    assert got.headers["Host"] == f"hooks.example.com:{port}" and got.path == "/hook"


def test_a_receiver_that_trickles_its_answer_is_cut_at_the_timeout(allow_local, settings):
    # A receiver that sends its status line and then one header byte every 0.2 s: each read is quick, the
    # exchange never ends. The attempt must end at HERMES_WEBHOOK_TIMEOUT_SECONDS, failed, with a reason.
    import threading
    import time

    from hermes_sessions.worker.webhooks import attempt_send

    settings.HERMES_WEBHOOK_TIMEOUT_SECONDS = 1.0
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
            while not stop.is_set():
                try:
                    conn.sendall(b"a")
                except OSError:
                    return
                time.sleep(0.2)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        t0 = time.monotonic()
        outcome = attempt_send(url=f"http://127.0.0.1:{server.getsockname()[1]}/hook",
                               secret="whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", webhook_id="msg_1_1", payload={})
        took = time.monotonic() - t0
    finally:
        stop.set()
        server.close()
    assert not outcome.succeeded and "HERMES_WEBHOOK_TIMEOUT_SECONDS" in outcome.error, outcome
    assert took < 3.0, took


def test_every_sessions_events_need_an_active_staff_owner_at_the_event_and_at_the_send(
        user, allow_local, scripted_codex, run_turn_now, django_user_model):
    carol = django_user_model.objects.create_user(username="carol", is_staff=True)
    watcher = endpoint_for(carol, all_sessions=True)
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="while staff", user=user)
    assert len(deliveries(endpoint=watcher)) == 1  # written, not sent yet
    django_user_model.objects.filter(pk=carol.pk).update(is_staff=False)
    run_turn_now(session=session, text="after the demotion", user=user)
    assert len(deliveries(endpoint=watcher)) == 1  # no new delivery of another user's session
    token, claimed = services.webhook_deliveries_claim(limit=10)
    assert claimed == []  # nor is the one written before sent now
    watcher.refresh_from_db()
    assert list(selectors.webhook_delivery_list(endpoint=watcher)) == []  # nor shown to her
    django_user_model.objects.filter(pk=carol.pk).update(is_staff=True, is_active=False)
    run_turn_now(session=session, text="deactivated", user=user)
    assert len(deliveries(endpoint=watcher)) == 1
