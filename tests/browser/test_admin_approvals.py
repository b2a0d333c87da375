"""In a real browser (Debian's Chromium, headless), an operator decides what codex asks:

* a session under ``approval_policy: untrusted`` runs ``RUNCMD touch approved.txt && echo <mark>`` (the
  model stand-in makes the real codex binary ask ``item/commandExecution/requestApproval``); the operator
  sees the pending count on the admin index, opens the pending list from it, sees the command and its
  cwd and the offered decisions (in the list and on the approval's page), presses *Accept* in the list, and sees the turn finish succeeded with the command's
  output in the transcript;
* the same request declined from the session page's *Waiting for a decision* section: the turn finishes
  and the file is not made.

The operator queues the turn with the session page's *Run a turn* form; its task is held and run by the
test on a thread of its own — the worker code, on the real binary — because the suite's tasks are eager
and a turn run inside the admin's own request would keep that request open until somebody decides.
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from devtools.model_stand_in import ModelStandIn
from hermes_sessions import services, tasks
from hermes_sessions.admin.approvals import decision_label
from hermes_sessions.models import Approval, Message, Turn
from tests.support.dispatch import hold_dispatches
from tests.support.real_codex import use_real_codex

from .conftest import OPERATOR_PASSWORD

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]  # the live server reads what the test commits
UNTRUSTED = {"sandbox": "workspace-write", "approval_policy": "untrusted"}


@pytest.fixture
def real_codex(codex_dirs: Path, settings: Any, real_codex_bin: str) -> Iterator[ModelStandIn]:
    settings.HERMES_HEARTBEAT_SECONDS = 0.2
    with ModelStandIn() as stand_in:
        use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
        yield stand_in


class Worker:
    """The held ``run_turn`` tasks, run one by one on a thread of their own (the worker code, eager)."""

    def __init__(self, sent: list[str]):
        self.sent = sent
        self.results: list[Any] = []
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        assert len(self.sent) == 1, self.sent

        def run() -> None:
            try:
                self.results.append(tasks.run_turn.apply(args=(self.sent[0],)).get())
            except Exception as exc:  # noqa: BLE001 — reported by join(), in the test's thread
                self.results.append(exc)
            finally:
                connection.close()  # this thread's own connection

        self.thread = threading.Thread(target=run, name="worker")
        self.thread.start()

    def join(self, timeout: float = 90.0) -> Any:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the turn's task did not end"
        assert self.results and not isinstance(self.results[0], Exception), self.results
        return self.results[0]


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Worker]:
    held = Worker(hold_dispatches(monkeypatch))
    yield held
    if held.thread is not None:
        held.thread.join(90)


def queue_turn(admin_ui: Any, session_id: str, text: str) -> dict[str, Any]:
    admin_ui.open_session(session_id, from_list=False)
    page = admin_ui.submit_turn(text)
    assert page["messages"][0].startswith("Turn 1 queued"), page["messages"]
    return page


def test_operator_accepts_a_command_from_the_pending_list_and_the_turn_finishes(admin_ui, operator, user, real_codex,
                                                                               worker, settings):
    session = services.session_create(owner=user, session_id="sess-browser-approve", model_config=UNTRUSTED)
    mark = f"ran-{uuid.uuid4().hex[:8]}"
    assert admin_ui.log_in("operator", OPERATOR_PASSWORD) == "Site administration"
    assert admin_ui.index()["approval_count"] == 0

    queue_turn(admin_ui, session.id, f"RUNCMD touch approved.txt && echo {mark}")
    worker.start()

    # codex asks: the index counts it; its link opens the pending list.
    assert admin_ui.wait_for_pending_approvals(1)["approval_count"] == 1
    admin_ui.shot("index-one-pending")
    listed = admin_ui.open_pending_approvals()
    admin_ui.shot("pending-list")
    [row] = listed["rows"]
    assert (row["kind"], row["session"]) == ("Command", session.id)
    assert "touch approved.txt" in row["request_preview"] and f"(in {Path(settings.CODEX_WORK_ROOT) / session.id}" in row["request_preview"]
    # A button per decision codex offered (as recorded), no other.
    asked = Approval.objects.get(session=session)
    assert row["buttons"] == [decision_label(asked, d) for d in asked.available_decisions]
    assert {"Accept", "Decline"} <= set(row["buttons"])

    # Its page shows the command and the cwd, and the same buttons.
    shown = admin_ui.open_approval_from_list("touch approved.txt")
    admin_ui.shot("approval-page")
    assert shown["heading"].startswith("Command — Pending"), shown
    assert "touch approved.txt" in shown["command"][0]
    assert shown["cwd"] == [str(Path(settings.CODEX_WORK_ROOT) / session.id)]
    assert shown["buttons"] == row["buttons"]
    admin_ui.back()

    # Accept from the list: the admin says so and the list is empty.
    after = admin_ui.decide_in_list("touch approved.txt", "Accept")
    admin_ui.shot("accepted")
    assert len(after["messages"]) == 1 and after["messages"][0].startswith("Approval accepted (accept): "), after
    assert after["rows"] == []
    approval = Approval.objects.get(session=session)
    assert (approval.status, approval.decision, approval.decided_by) == ("accepted", "accept", operator)

    # The turn finishes succeeded with the command's output.
    admin_ui.open_session(session.id, from_list=False)
    page = admin_ui.wait_for_turn_on_page(1, status="succeeded", timeout_s=60)
    admin_ui.shot("turn-succeeded")
    assert admin_ui.index()["approval_count"] == 0
    result = worker.join()
    assert result["turn_status"] == "succeeded", result
    turn = Turn.objects.get(session=session)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert mark in "\n".join(Message.objects.filter(turn=turn, role="tool").values_list("content", flat=True))
    assert any(mark in m["content"] for m in page["transcript"]), page["transcript"]
    assert (Path(settings.CODEX_WORK_ROOT) / session.id / "approved.txt").exists()


def test_operator_declines_a_command_from_the_session_page(admin_ui, operator, user, real_codex, worker, settings):
    session = services.session_create(owner=user, session_id="sess-browser-decline", model_config=UNTRUSTED)
    admin_ui.log_in("operator", OPERATOR_PASSWORD)
    queue_turn(admin_ui, session.id, "RUNCMD touch approved.txt")
    worker.start()

    page = admin_ui.wait_for_session_approval(session.id)
    admin_ui.shot("session-waits")
    [waiting] = page["approvals"]
    assert "touch approved.txt" in waiting["command"][0]
    assert waiting["cwd"] == [str(Path(settings.CODEX_WORK_ROOT) / session.id)]
    assert "Decline" in waiting["buttons"]

    page = admin_ui.decide_on_session_page("Decline")
    admin_ui.shot("declined")
    assert page["messages"][0].startswith("Approval declined (decline): "), page["messages"]
    assert page["approvals"] == []
    page = admin_ui.wait_for_turn_on_page(1, status="succeeded", timeout_s=60)
    worker.join()
    assert Approval.objects.get(session=session).status == Approval.Status.DECLINED
    assert not (Path(settings.CODEX_WORK_ROOT) / session.id / "approved.txt").exists()
