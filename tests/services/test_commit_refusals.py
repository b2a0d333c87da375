"""Writes the database refuses, and services called with what they cannot take: a clear failure,
never a turn left running, a second notice or a 500."""
import pytest
from django.db import transaction
from django.test import Client
from rest_framework.authtoken.models import Token

from hermes_sessions import services
from hermes_sessions.codex.runner import TurnOutcome
from hermes_sessions.models import CodexBinding, Message, Notice, Session, Turn
from hermes_sessions.services import bindings, dispatch, turns


@pytest.mark.django_db
def test_an_idempotent_replay_after_the_session_was_deleted_creates_it_again(user):
    token = Token.objects.create(user=user)
    client = Client(raise_request_exception=False)
    headers = {"HTTP_AUTHORIZATION": f"Token {token.key}", "HTTP_IDEMPOTENCY_KEY": "k-1"}
    first = client.post("/api/sessions/", {"title": "t"}, content_type="application/json", **headers)
    assert first.status_code == 201
    Session.objects.filter(pk=first.json()["id"]).delete()  # e.g. the admin's "delete selected"
    again = client.post("/api/sessions/", {"title": "t"}, content_type="application/json", **headers)
    assert again.status_code == 201, again.content
    assert Session.objects.filter(pk=again.json()["id"]).exists()
    replay = client.post("/api/sessions/", {"title": "t"}, content_type="application/json", **headers)
    assert replay.status_code == 200 and replay.json()["id"] == again.json()["id"]


@pytest.mark.django_db(transaction=True)
def test_a_rotation_after_an_operator_ended_the_binding_writes_no_second_notice(user, monkeypatch):
    monkeypatch.setattr(dispatch, "turn_dispatch_on_commit", lambda turn_id, **_: None)  # play the worker by hand
    session = services.session_create(owner=user)
    with transaction.atomic():
        CodexBinding.objects.create(session=session, thread_id="thread-x")
    turn = turns.turn_enqueue(session=session, input_text="hi", user=user)
    claim = turns.turn_claim(turn_id=turn.pk)
    assert claim is not None and claim.thread_id == "thread-x"
    # The worker's thread/resume got "no rollout found"; meanwhile an operator ends the binding.
    assert bindings.binding_end(session=session, reason="operator")
    outcome = TurnOutcome(thread_action="rotated", thread_id="thread-y", codex_turn_id="t1", status="completed",
                          rotated_from="thread-x", rotation_reason="no rollout found for thread id thread-x",
                          messages=[{"role": "assistant", "content": "ok", "codex_item_id": "m1"}])
    turns.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=outcome)
    assert list(Notice.objects.filter(session=session).values_list("text", flat=True)) == [bindings.NOTICE_BINDING_ENDED]
    assert CodexBinding.objects.get(session=session, status=CodexBinding.Status.ACTIVE).thread_id == "thread-y"


@pytest.mark.django_db(transaction=True)
def test_two_identical_id_less_items_are_two_rows_and_the_turn_succeeds(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    item = {"type": "agentMessage", "text": "same words"}  # codex always sends ids; this one does not
    scripted_codex.script({"turn/start": [{"turn_items": [item, dict(item)]}]})
    turn = run_turn_now(session=session, text="hello", user=user)
    turn.refresh_from_db()
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert Message.objects.filter(turn=turn, role="assistant", content="same words").count() == 2


@pytest.mark.django_db(transaction=True)
def test_results_the_database_refuses_fail_the_turn_with_the_reason(user, scripted_codex, run_turn_now, monkeypatch):
    session = services.session_create(owner=user)
    scripted_codex.script({"turn/start": [{"turn_items": [{"type": "agentMessage", "id": "m1", "text": "hi"}]}]})
    real_append = turns._append_messages

    def refuse_assistant_rows(session, turn, rows, **kwargs):  # a constraint PostgreSQL enforces, forced here
        rows = list(rows)
        if any(r["role"] == "assistant" for r in rows):
            Message.objects.create(session=session, seq=session.last_message_seq, turn=turn, role="assistant")
        real_append(session, turn, rows, **kwargs)

    monkeypatch.setattr(turns, "_append_messages", refuse_assistant_rows)
    turn = run_turn_now(session=session, text="hello", user=user)
    turn.refresh_from_db()
    assert turn.status == Turn.Status.FAILED
    assert "the database refused this turn's results" in turn.error and "IntegrityError" in turn.error
    assert not Message.objects.filter(turn=turn, role="assistant").exists()
    assert Message.objects.filter(turn=turn, role="user").count() == 1


@pytest.mark.django_db
def test_session_create_without_an_owner_is_a_service_error_not_id_taken():
    with pytest.raises(services.ServiceError) as info:
        services.session_create(owner=None)
    assert not isinstance(info.value, services.SessionIdTaken)


@pytest.mark.django_db
def test_a_cancel_racing_the_turns_end_answers_409(user, monkeypatch):
    """The view reads the turn unlocked; when it finishes before the service locks it, the answer is
    the finished turn's 409, not a 202."""
    token = Token.objects.create(user=user)
    session = services.session_create(owner=user)
    turn = Turn.objects.create(session=session, seq=1, input="hi", created_by=user, status=Turn.Status.RUNNING)
    real_cancel = services.turn_cancel

    def finish_first(*, turn):
        Turn.objects.filter(pk=turn.pk).update(status=Turn.Status.SUCCEEDED)
        return real_cancel(turn=turn)

    monkeypatch.setattr(services, "turn_cancel", finish_first)
    response = Client().post(f"/api/turns/{turn.pk}/cancel/", HTTP_AUTHORIZATION=f"Token {token.key}")
    assert response.status_code == 409
    assert response.json()["turn"]["status"] == "succeeded"
