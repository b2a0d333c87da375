"""``manage.py import_sessions`` trusts a line no more than an API request (``services/portability.py``,
``docs/contract.md`` I8): each input that once got through is kept here. A line whose
``model_config`` the API's policy refuses for its owner, or whose values the API or PostgreSQL would
refuse, is reported ``line N: refused: …`` and writes nothing; the lines after it still import."""
from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from jsonschema import Draft202012Validator

from hermes_sessions.models import Session, Turn
from hermes_sessions.services import portability
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


@pytest.mark.parametrize(("change", "reason"), [
    (set_in("turns.0.input", "x" * 200_001), "turns/0/input: is longer than 200000 characters"),
    (set_in("turns.0.input", "x" * 5_000_000), "turns/0/input: is longer than 200000 characters"),
    (set_in("turns.0.usage", "notadict"), "turns/0/usage: 'notadict' is not of type 'object'"),
    (set_in("turns.0.timings", [1]), "turns/0/timings: [1] is not of type 'object'"),
    (set_in("turns.0.codex_methods", {"a": 1}), "turns/0/codex_methods: {'a': 1} is not of type 'array'"),
    (set_in("messages.1.tool_calls", "call"), "messages/1/tool_calls: 'call' is not valid under any of the given schemas"),
    (set_in("session.model_config", ["sandbox"]), "session/model_config: ['sandbox'] is not of type 'object'"),
    (set_in("session.last_message_seq", 2**40), "session/last_message_seq: 1099511627776 is greater than the maximum"),
    (set_in("session.last_turn_seq", -1), "session/last_turn_seq: -1 is less than the minimum of 0"),
    (set_in("turns.0.attempt", 2**31), "turns/0/attempt: 2147483648 is greater than the maximum"),
    (set_in("messages.0.content", "a\x00b"), "messages/0/content: holds a NUL or an unpaired surrogate"),
    (set_in("turns.0.final_text", "\ud800"), "turns/0/final_text: holds a NUL or an unpaired surrogate"),
    (set_in("session.title", "t" * 201), "session/title: is longer than 200 characters"),
    (set_in("turns.0.usage", {"k": "a\x00"}), "bad value: turn usage holds a NUL or an unpaired surrogate"),
    (set_in("turns.0.timings", {"\udc80": 1}), "bad value: turn timings holds a NUL or an unpaired surrogate"),
])
def test_a_value_the_api_or_postgresql_would_refuse_refuses_its_line_only(tmp_path, line, capsys, change, reason):
    bad = variant(line, "sess-bad-value", change)
    summary, err = run_import(tmp_path, [bad, line], capsys)
    assert summary.startswith("1 imported, 0 skipped, 1 refused"), err
    assert f"line 1: refused: {reason}" in err
    assert list(Session.objects.values_list("id", flat=True)) == ["sess-untrusted"]
    turn = Turn.objects.get(session_id="sess-untrusted")
    assert turn.usage == {"total_tokens": 3}  # the good line's turn reads as the API wrote it


def rollout_line(record: dict, relpath: str) -> dict:
    thread = "019a0000-0000-7000-8000-00000000abcd"
    out = variant(record, f"sess-rollout-{abs(hash(relpath)) % 10**6}", lambda r: None)
    out["rollouts"] = [{"thread_id": thread, "relpath": relpath, "length": 0, "sha256": "e3b0" + "0" * 60,
                        "generation": 0, "codex_version": "", "updated_at": "2026-01-01T00:00:00+00:00", "chunks": []}]
    return out


@pytest.mark.parametrize("relpath", [
    "../../etc/cron.d/rollout-x-019a0000-0000-7000-8000-00000000abcd.jsonl",
    "/etc/passwd",
    "/work/sessions/rollout-x-019a0000-0000-7000-8000-00000000abcd.jsonl",
    "sessions/../../rollout-x-019a0000-0000-7000-8000-00000000abcd.jsonl",
    "sessions/2025/./rollout-x-019a0000-0000-7000-8000-00000000abcd.jsonl",
    "sessions/2025/notes.txt",
])
def test_a_rollout_path_outside_sessions_is_refused(tmp_path, line, capsys, relpath):
    summary, err = run_import(tmp_path, [rollout_line(line, relpath), line], capsys)
    assert summary.startswith("1 imported, 0 skipped, 1 refused"), err
    assert "line 1: refused: rollouts/0/relpath: is not a relative path to a rollout-*.jsonl file under sessions/" in err


def test_a_rollout_path_of_another_thread_is_refused(tmp_path, line, capsys):
    other = rollout_line(line, "sessions/2025/01/01/rollout-x-019a0000-0000-7000-8000-0000000000ff.jsonl")
    summary, err = run_import(tmp_path, [other, line], capsys)
    assert summary.startswith("1 imported, 0 skipped, 1 refused"), err
    assert "line 1: refused: bad value: rollout relpath" in err and "does not name thread" in err


def test_a_database_error_the_schema_missed_refuses_that_line_and_the_next_lines_import(
    tmp_path, line, capsys, monkeypatch
):
    # The backstop: with the shape check switched off, PostgreSQL's own refusal (integer out of range)
    # is reported for that line, which wrote nothing, instead of a traceback that stops the import.
    monkeypatch.setattr(portability, "_VALIDATOR", Draft202012Validator({}))
    too_big = variant(line, "sess-too-big", set_in("session.last_message_seq", 2**40))
    summary, err = run_import(tmp_path, [too_big, line], capsys)
    assert summary.startswith("1 imported, 0 skipped, 1 refused"), err
    assert "line 1: refused: session sess-too-big: " in err and "out of range" in err
    assert list(Session.objects.values_list("id", flat=True)) == ["sess-untrusted"]


def test_a_line_over_the_size_bound_is_refused_unparsed_and_the_next_lines_import(tmp_path, line, capsys, monkeypatch):
    monkeypatch.setattr(portability, "MAX_LINE_BYTES", 4096)
    huge = variant(line, "sess-huge", set_in("messages.0.content", "y" * 100_000))
    not_json_huge = b"{" + b"[" * 50_000  # would not parse either; never parsed
    summary, err = run_import(tmp_path, [huge, not_json_huge, line], capsys)
    assert summary.startswith("1 imported, 0 skipped, 2 refused"), err
    assert "line 1: refused: the line is over 4096 bytes (portability.MAX_LINE_BYTES); not parsed" in err
    assert "line 2: refused: the line is over 4096 bytes" in err
    assert list(Session.objects.values_list("id", flat=True)) == ["sess-untrusted"]


def test_deeply_nested_json_is_refused_not_a_crash(tmp_path, line, capsys):
    summary, err = run_import(tmp_path, [b"[" * 200_000 + b"]" * 200_000, line], capsys)
    assert summary.startswith("1 imported, 0 skipped, 1 refused"), err
    assert "line 1: refused: not JSON" in err


def test_json_nested_just_under_the_parser_limit_is_refused_not_a_crash(tmp_path, line, capsys):
    for depth in (900, 980):
        deep = json.dumps(variant(line, f"sess-deep-{depth}", set_in("turns.0.usage", {}))).replace(
            '"usage": {}', '"usage": {"a": ' + "[" * depth + "]" * depth + "}")
        summary, err = run_import(tmp_path, [deep.encode(), line], capsys)
        assert Session.objects.filter(pk="sess-untrusted").exists()  # no traceback: the next line imported
        Session.objects.filter(pk="sess-untrusted").delete()
        Session.objects.filter(pk=f"sess-deep-{depth}").delete()
