"""I5 — our transcript is the source of truth: whatever codex hands back on resume (or on a re-run
that adopts a turn codex completed) never rewrites or deletes our rows; new rows are appended."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from hermes_sessions import services, worker
from hermes_sessions.codex.client import AppServerClient
from hermes_sessions.codex.launch import session_home
from hermes_sessions.codex.rollout_files import find_rollout
from hermes_sessions.models import Message, Turn
from hermes_sessions.services.rollouts import rollout_forget, rollout_import
from tests.support.dispatch import hold_dispatches

from .conftest import deliver, expire_lease, queue_turn

SCRIPTED = Path(__file__).resolve().parents[1] / "codex" / "scripted_app_server.py"

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(30)]


def stored(session):
    return list(Message.objects.filter(session=session).order_by("seq")
                .values_list("id", "seq", "role", "content", "turn_id", "codex_item_id", "created_at"))


def rewrite_codex_history(session, thread_id):
    """Make codex's record of the thread disagree with ours: every item says something else — in the
    rollout on disk and in the copy PostgreSQL keeps (which each turn's CODEX_HOME is made from)."""
    home = session_home(session.id).home
    path = find_rollout(home, thread_id)
    turns = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for turn in turns:
        for item in turn["items"]:
            if item.get("type") == "agentMessage":
                item["text"] = "codex remembers it differently"
            for part in item.get("content") or []:
                part["text"] = "codex remembers it differently"
    path.write_text("".join(json.dumps(t) + "\n" for t in turns))
    rollout_forget(thread_id=thread_id)
    assert rollout_import(session_id=session.id, thread_id=thread_id, home=home) is not None


def codex_runs_turn(scripted_codex, session, thread_id, text, *, client_turn_id):
    """A worker's app-server runs one turn to turn/completed in the session's home (and the worker then dies)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SCRIPTED_STATE_DIR": str(scripted_codex.state),
           "CODEX_HOME": str(session_home(session.id).home)}
    with AppServerClient([sys.executable, str(SCRIPTED)], env=env, cwd=str(scripted_codex.state)) as client:
        client.start()
        client.request("thread/resume", {"threadId": thread_id, "excludeTurns": True})
        client.request("turn/start", {"threadId": thread_id, "clientUserMessageId": client_turn_id,
                                      "input": [{"type": "text", "text": text, "text_elements": []}]})
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            note = client.next_notification(timeout=0.5)
            if note and note["method"] == "turn/completed":
                return
    raise AssertionError("the scripted app-server did not complete the turn")


def test_resume_and_adoption_never_rewrite_earlier_rows(user, scripted_codex, run_turn_now, settings, monkeypatch):
    settings.HERMES_HEARTBEAT_SECONDS = 0.1
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    before = stored(session)
    assert [r[3] for r in before] == ["hello one", "echo: hello one"]
    rewrite_codex_history(session, t1.codex_thread_id)

    t2 = run_turn_now(session=session, text="hello two", user=user)  # a plain resume
    assert (t2.status, t2.thread_action) == (Turn.Status.SUCCEEDED, "resumed"), t2.error
    after_resume = stored(session)
    assert after_resume[:2] == before  # same ids, seqs, contents, turns: untouched
    assert [r[1:4] for r in after_resume[2:]] == [(3, "user", "hello two"), (4, "assistant", "echo: hello two")]

    # Worker A claims turn 3 and codex completes it, then A dies before committing; the re-run
    # adopts codex's turn (thread/turns/list hands back the whole, rewritten, history).
    with monkeypatch.context() as patched:
        sent = hold_dispatches(patched)
        t3 = queue_turn(session=session, text="hello three", user=user)
        claim = services.turn_claim(turn_id=t3.id)
        codex_runs_turn(scripted_codex, session, t1.codex_thread_id, "hello three", client_turn_id=str(claim.turn_id))
        rewrite_codex_history(session, t1.codex_thread_id)
        expire_lease(t3)
        worker.turns_sweep()
        assert sent == [str(t3.id), str(t3.id)]  # accepted, then taken back from the dead worker
    assert deliver(t3.id)["turn_status"] == Turn.Status.SUCCEEDED
    t3.refresh_from_db()
    assert t3.status == Turn.Status.SUCCEEDED and t3.attempt == 2, t3.error
    assert scripted_codex.turn_inputs().count("hello three") == 1  # adopted, not run again

    final = stored(session)
    assert final[:4] == after_resume
    assert [r[1:3] for r in final[4:]] == [(5, "user"), (6, "assistant")]
    assert final[4][3] == "hello three"
    assert [r[1] for r in final] == [1, 2, 3, 4, 5, 6]
