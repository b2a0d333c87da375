"""``manage.py import_sessions`` trusts a line no more than an API request (``services/portability.py``,
``docs/contract.md`` I8): each input an adversarial tester found is kept here. A line whose
``model_config`` the API's policy refuses for its owner, or whose values the API or PostgreSQL would
refuse, is reported ``line N: refused: …`` and writes nothing; the lines after it still import."""
from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from hermes_sessions.models import Session
from tests.factories import MessageFactory, SessionFactory, TurnFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def line(user) -> dict:
    """An exported session of the non-staff ``bob`` (one finished turn, two messages), then wiped."""
    bob = UserFactory(username="bob")
    session = SessionFactory(id="sess-untrusted", owner=bob, model_config={"sandbox": "read-only"})
    turn = TurnFactory(session=session, seq=1, status="succeeded", input="hi", created_by=bob, usage={"total_tokens": 3})
    MessageFactory(session=session, seq=1, turn=turn, role="user", content="hi")
    MessageFactory(session=session, seq=2, turn=turn, role="assistant", content="hello")
    Session.objects.filter(pk=session.pk).update(last_message_seq=2, last_turn_seq=1)
    out = io.StringIO()
    call_command("export_sessions", "--session", session.id, stdout=out)
    Session.objects.filter(pk=session.pk).delete()
    return json.loads(out.getvalue())


def variant(record: dict, session_id: str, change) -> dict:
    """A copy of ``record`` as another session (its own session and turn ids), changed by ``change``."""
    out = copy.deepcopy(record)
    out["session"]["id"] = session_id
    for n, t in enumerate(out["turns"]):
        t["id"] = f"{t['id'][:-4]}{n:02d}{len(session_id) % 100:02d}"
    for m in out["messages"]:
        m["turn"] = out["turns"][0]["id"] if m["turn"] else None
    change(out)
    return out


def run_import(tmp_path: Path, records: list, capsys) -> tuple[str, str]:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records))
    out = io.StringIO()
    try:
        call_command("import_sessions", str(path), stdout=out)
        summary = out.getvalue().strip()
    except CommandError as exc:
        summary = str(exc)
    return summary, capsys.readouterr().err


def set_in(path: str, value):
    def change(record: dict) -> None:
        *parents, last = path.split(".")
        target = record
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[int(last) if isinstance(target, list) else last] = value
    return change


def test_a_staff_only_sandbox_is_refused_for_a_non_staff_owner_and_allowed_for_staff(tmp_path, line, capsys):
    danger = {"sandbox": "danger-full-access", "approval_policy": "never"}
    escalate = variant(line, "sess-escalate", set_in("session.model_config", danger))
    cwd = variant(line, "sess-cwd", set_in("session.model_config", {"cwd": "/"}))
    unknown = variant(line, "sess-unknown-key", set_in("session.model_config", {"sandbox": "read-only", "env": {"X": "1"}}))
    summary, err = run_import(tmp_path, [escalate, cwd, unknown, line], capsys)
    assert summary.startswith("1 imported, 0 skipped, 3 refused")
    assert ("line 1: refused: session/model_config/sandbox: sandbox 'danger-full-access' is reserved to staff. "
            "(owner 'bob', not staff; the API's policy applies)") in err
    assert "line 2: refused: session/model_config/cwd: cwd is assigned by the server" in err
    assert "line 3: refused: session/model_config/env: unknown model_config key 'env'" in err
    assert list(Session.objects.values_list("id", flat=True)) == ["sess-untrusted"]

    UserFactory(username="root-ops", is_staff=True)  # staff may hold it, as through the API
    staff = variant(line, "sess-staff", set_in("session.model_config", danger))
    staff["session"]["owner"] = "root-ops"
    summary, _err = run_import(tmp_path, [staff], capsys)
    assert summary == "1 imported, 0 skipped, 0 refused"
    assert Session.objects.get(pk="sess-staff").model_config == danger
