"""In a real browser (Debian's Chromium, headless), as an operator does it:

* log in, see the number of unacknowledged notices on the admin index, filter the sessions list to
  the sessions with notices and open the rotated one; see its banner, its binding history and its
  timeline with the rotation marked; acknowledge the notice from the session page (the banner goes,
  the index's count drops, the notice records who acknowledged it); search its transcript for a word
  it holds and for one it does not; run a turn from the page's *Run a turn* form and reload until it
  shows succeeded (it ran through the worker code, eagerly, on the scripted app-server, resuming the
  new thread);
* with the worker away (dispatches held), run a turn from the admin, see it queued, cancel it, and
  see that the worker, when the task reaches it, leaves it cancelled without calling codex;
* a non-staff user is refused at the login form; a turn posted to the live server's REST API runs and
  is seen finished in the admin.
"""
from __future__ import annotations

import pytest
from rest_framework.authtoken.models import Token

from hermes_sessions import services, tasks
from hermes_sessions.models import Notice, Turn
from hermes_sessions.services import NOTICE_THREAD_ROTATED
from tests.factories import SessionFactory
from tests.support.dispatch import hold_dispatches

from .conftest import OPERATOR_PASSWORD

pytestmark = pytest.mark.django_db(transaction=True)  # the live server reads what the test commits


def by_seq(rows: list[dict[str, str]]) -> dict[int, dict[str, str]]:
    return {int(row["seq"]): row for row in rows}


def test_operator_handles_a_rotated_session_from_the_admin(admin_ui, operator, rotated, scripted_codex):
    quiet = SessionFactory(id="sess-browser-quiet", owner=rotated.session.owner)
    session_id = rotated.session.id

    # Log in; the index says one notice waits.
    assert admin_ui.log_in("operator", OPERATOR_PASSWORD) == "Site administration"
    assert admin_ui.index()["notice_count"] == 1
    admin_ui.shot("index-one-notice")

    # The sessions list has a notices column; its filter keeps only the rotated session.
    everything = admin_ui.sessions_list()
    admin_ui.shot("sessions-list")
    assert everything[session_id]["unacknowledged_notices"] == "1"
    assert everything[quiet.id]["unacknowledged_notices"] == "0"
    waiting = admin_ui.sessions_list(filter_label="Has unacknowledged notices")
    admin_ui.shot("sessions-with-notices")
    assert list(waiting) == [session_id]
    assert waiting[session_id]["active_thread"] == rotated.new_thread_id
    assert waiting[session_id]["turns"] == "3"

    # Its page: the banner, the binding history, the timeline with the rotation marked.
    page = admin_ui.open_session(session_id)
    admin_ui.shot("rotated-session")
    assert page["notices"] == [NOTICE_THREAD_ROTATED]
    bindings = {b["thread_id"]: b for b in page["bindings"]}
    assert bindings.keys() == {rotated.old_thread_id, rotated.new_thread_id}
    assert bindings[rotated.old_thread_id]["status"] == "Ended"
    assert "no rollout found for thread id" in bindings[rotated.old_thread_id]["ended_reason"]
    assert bindings[rotated.new_thread_id]["status"] == "Active"
    # Three green turn bars, two thread bars; the rotation marked on turn 3 and where the old thread ended.
    assert page["timeline"] == {"turns": ["succeeded"] * 3, "rotations": 2, "threads": 2}
    turns = by_seq(page["turns"])
    assert [(turns[s]["status"], turns[s]["thread"]) for s in (1, 2, 3)] == [
        ("succeeded", "started"), ("succeeded", "resumed"), ("succeeded", "rotated")]

    # Acknowledge from the session page: the banner goes, the database records who did it.
    page = admin_ui.acknowledge_notice(NOTICE_THREAD_ROTATED)
    admin_ui.shot("notice-acknowledged")
    assert page["messages"] == ["Acknowledged 1 notice."]
    assert page["notices"] == []
    assert page["timeline"]["rotations"] == 2  # the rotation stays in the picture
    notice = Notice.objects.get(session_id=session_id)
    assert notice.acknowledged_at is not None and notice.acknowledged_by == operator
    assert admin_ui.index()["notice_count"] == 0
    admin_ui.shot("index-no-notice")
    assert admin_ui.sessions_list()[session_id]["unacknowledged_notices"] == "0"

    # Search the transcript: a word it holds (newest first), then one it does not.
    page = admin_ui.open_session(session_id, from_list=False)
    assert [int(m["seq"]) for m in page["transcript"]] == [6, 5, 4, 3, 2, 1]
    # "three" is in turn 3's input and in its reply (the scripted app-server echoes the whole input the
    # fresh thread got: the replayed history, then the current turn).
    found = admin_ui.search_transcript("three")
    admin_ui.shot("search-three")
    assert [(m["seq"], m["role"]) for m in found["transcript"]] == [("6", "assistant"), ("5", "user")]
    assert found["transcript"][1]["content"] == "hello three"
    assert found["transcript"][0]["content"].startswith("echo: Prior conversation from this session")
    assert found["transcript"][0]["content"].endswith("[CURRENT USER TURN]\nhello three")
    missing = admin_ui.search_transcript("zebra")
    admin_ui.shot("search-zebra")
    assert missing["transcript"] == [] and missing["transcript_empty"] == "No message matches."

    # Run a turn from the page's form; reload until it shows succeeded.
    page = admin_ui.submit_turn("hello four")
    admin_ui.shot("turn-run")
    turn = Turn.objects.get(session_id=session_id, seq=4)
    assert page["messages"] == [f"Turn 4 queued ({turn.id})."]
    page = admin_ui.wait_for_turn_on_page(4, status="succeeded")
    admin_ui.shot("turn-succeeded")
    row = by_seq(page["turns"])[4]
    assert (row["thread"], row["input"], row["cancel"]) == ("resumed", "hello four", "no")
    assert page["turns_in_progress"] == ""
    assert page["timeline"]["turns"] == ["succeeded"] * 4
    assert [(m["role"], m["content"]) for m in page["transcript"][:2]] == [
        ("assistant", "echo: hello four"), ("user", "hello four")]
    # It ran through the worker code: the new thread resumed on the scripted app-server, as the operator.
    turn.refresh_from_db()
    assert (turn.status, turn.thread_action, turn.final_text) == ("succeeded", "resumed", "echo: hello four")
    assert turn.codex_thread_id == rotated.new_thread_id and turn.created_by == operator
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume", "turn/start"]
    assert scripted_codex.turn_inputs()[-1] == "hello four"


def test_operator_cancels_a_queued_turn_from_the_admin(admin_ui, operator, user, scripted_codex, monkeypatch):
    # The worker is away: the turn's task is held, so the turn stays queued until the operator acts.
    sent = hold_dispatches(monkeypatch)
    session = services.session_create(owner=user, session_id="sess-browser-cancel", title="Cancelled in the browser")
    admin_ui.log_in("operator", OPERATOR_PASSWORD)
    admin_ui.open_session(session.id, from_list=False)

    page = admin_ui.submit_turn("this one waits")
    admin_ui.shot("turn-queued")
    turn = Turn.objects.get(session=session)
    assert sent == [str(turn.id)]
    assert page["messages"] == [f"Turn 1 queued ({turn.id})."]
    assert [(t["seq"], t["status"], t["cancel"]) for t in page["turns"]] == [("1", "queued", "yes")]
    assert page["turns_in_progress"].startswith("1 turn queued or running")
    assert page["timeline"]["turns"] == ["queued"]

    page = admin_ui.cancel_turn(1)
    admin_ui.shot("turn-cancelled")
    assert page["messages"] == ["Turn 1 cancelled."]
    assert [(t["seq"], t["status"], t["error"], t["cancel"]) for t in page["turns"]] == [
        ("1", "cancelled", "cancelled before it ran", "no")]
    assert page["turns_in_progress"] == ""
    assert page["timeline"]["turns"] == ["cancelled"]
    turn.refresh_from_db()
    assert (turn.status, turn.error) == ("cancelled", "cancelled before it ran")

    # The held task reaches the worker late: the worker code leaves the cancelled turn alone.
    result = tasks.run_turn.apply(args=(sent[0],)).get()
    assert result["turn"] == str(turn.id) and result["turn_status"] == "skipped", result
    turn.refresh_from_db()
    assert turn.status == "cancelled"
    assert scripted_codex.calls() == []


def test_a_user_who_is_not_staff_cannot_log_in_to_the_admin(admin_ui, user):
    # alice (who owns sessions elsewhere) is not staff: the admin refuses her at the login form.
    error = admin_ui.login_error("alice", "pw")
    admin_ui.shot("refused-login")
    assert "Please enter the correct username and password for a staff account." in error


def test_a_turn_posted_to_the_live_server_runs_and_the_admin_shows_it_finished(admin_ui, operator, user, scripted_codex):
    # A client's turn: through the live server's REST API (the same service and queue as the admin's
    # form; eager here, on the scripted app-server), watched finishing in the admin's turns list.
    session = services.session_create(owner=user, session_id="sess-browser-turn", title="Turn from the browser")
    token = Token.objects.create(user=user)
    admin_ui.log_in("operator", OPERATOR_PASSWORD)

    status, body = admin_ui.api_post(f"/api/sessions/{session.id}/turns/", {"input": "hello from the browser"},
                                     token=token.key)
    assert status == 202, body
    row = admin_ui.wait_for_turn(session.id, 1, status="Succeeded")
    admin_ui.shot("turn-succeeded")
    assert row["thread_action"] == "Started"
    transcript = admin_ui.transcript(session.id)
    admin_ui.shot("session-transcript")
    assert [(m["role"], m["content"]) for m in transcript] == [
        ("assistant", "echo: hello from the browser"), ("user", "hello from the browser")]
    turn = Turn.objects.get(pk=body["id"])
    assert (turn.status, turn.final_text) == ("succeeded", "echo: hello from the browser")
    assert scripted_codex.processes() == [["initialize", "thread/start", "turn/start"]]
