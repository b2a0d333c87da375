"""In a real browser (Debian's Chromium, headless), as an operator: log in to the admin, find the
session that went through a rotation in the sessions list by its unacknowledged notice, open it, see
the rotation notice at the top and the binding history (the ended thread with codex's reason, the new
active one), and acknowledge the notice with the Notices list's action — after which the banner is
gone and the notice records who acknowledged it. Also: a non-staff user is refused at the login form,
and a turn posted to the live server runs and is seen finished in the admin."""
from __future__ import annotations

import pytest
from rest_framework.authtoken.models import Token

from hermes_sessions import services
from hermes_sessions.models import Notice, Turn
from hermes_sessions.services import NOTICE_THREAD_ROTATED
from tests.factories import SessionFactory

from .conftest import OPERATOR_PASSWORD

pytestmark = pytest.mark.django_db(transaction=True)  # the live server reads what the test commits


def test_operator_sees_the_rotation_notice_and_acknowledges_it(admin_ui, operator, rotated):
    quiet = SessionFactory(id="sess-browser-quiet", owner=rotated.session.owner)
    session_id = rotated.session.id

    assert admin_ui.log_in("operator", OPERATOR_PASSWORD) == "Site administration"
    admin_ui.shot("admin-index")

    rows = admin_ui.sessions_list()
    admin_ui.shot("sessions-list")
    assert rows[session_id]["unacknowledged_notices"] == "1"
    assert rows[session_id]["active_thread"] == rotated.new_thread_id
    assert rows[session_id]["turns"] == "3"
    assert rows[quiet.id]["unacknowledged_notices"] == "0"

    page = admin_ui.open_session(session_id)
    admin_ui.shot("rotated-session")
    assert page["notices"] == [NOTICE_THREAD_ROTATED]
    bindings = {b["thread_id"]: b for b in page["bindings"]}
    assert bindings.keys() == {rotated.old_thread_id, rotated.new_thread_id}
    assert bindings[rotated.old_thread_id]["status"] == "Ended"
    assert "no rollout found for thread id" in bindings[rotated.old_thread_id]["ended_reason"]
    assert bindings[rotated.new_thread_id]["status"] == "Active"

    assert admin_ui.follow_notices_link() == [NOTICE_THREAD_ROTATED]
    admin_ui.shot("notices-to-acknowledge")
    assert admin_ui.acknowledge_all_listed_notices() == "Acknowledged 1 notice."
    admin_ui.shot("acknowledged")

    notice = Notice.objects.get(session_id=session_id)
    assert notice.acknowledged_at is not None and notice.acknowledged_by == operator
    assert admin_ui.open_session(session_id, from_list=False)["notices"] == []
    admin_ui.shot("session-after-acknowledge")
    assert admin_ui.sessions_list()[session_id]["unacknowledged_notices"] == "0"


def test_a_user_who_is_not_staff_cannot_log_in_to_the_admin(admin_ui, user):
    # alice (who owns sessions elsewhere) is not staff: the admin refuses her at the login form.
    error = admin_ui.login_error("alice", "pw")
    admin_ui.shot("refused-login")
    assert "Please enter the correct username and password for a staff account." in error


def test_a_turn_posted_to_the_live_server_runs_and_the_admin_shows_it_finished(admin_ui, operator, user, scripted_codex):
    # The path a turn started from the admin will take: through the live server, the same service
    # and queue as the API (eager here, on the scripted app-server), watched finishing in the admin.
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
    assert [(m["role"], m["content_preview"]) for m in transcript] == [
        ("User", "hello from the browser"), ("Assistant", "echo: hello from the browser")]
    turn = Turn.objects.get(pk=body["id"])
    assert (turn.status, turn.final_text) == ("succeeded", "echo: hello from the browser")
    assert scripted_codex.processes() == [["initialize", "thread/start", "turn/start"]]
