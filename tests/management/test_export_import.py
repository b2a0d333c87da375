"""``manage.py export_sessions`` / ``import_sessions`` (``services/portability.py``): a round trip
through JSON Lines gives back identical rows — transcript, turns, bindings, notices and the stored
codex rollouts byte for byte — and the imported session resumes its codex thread; bad lines are
reported by number and change nothing; a second import skips or refuses."""
from __future__ import annotations

import hashlib
import io
import json
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from hermes_sessions.codex.rollout_files import RolloutBase
from hermes_sessions.models import CodexBinding, CodexRollout, Message, Notice, RolloutChunk, Session, Turn
from hermes_sessions.services.rollouts import rollout_load
from tests.factories import MessageFactory, NoticeFactory, SessionFactory, TurnFactory, UserFactory
from tests.support.rotation import make_rotated_session

pytestmark = pytest.mark.django_db(transaction=True)  # the turns' worker heartbeat uses its own connection


def snapshot(session_ids: list[str]) -> dict:
    """Every row the sessions own, without auto ids, in a stable order; rollouts with the sha256 of
    their whole file (``rollout_load``) and their chunks' stored bytes."""
    def rows(model, order, **filters):
        # Auto ids (and the chunk's link to one) are new after an import; session and turn ids are kept.
        fields = [f.attname for f in model._meta.concrete_fields
                  if f.name not in ("id", "rollout") or model in (Session, Turn)]
        return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
                for row in model.objects.filter(**filters).order_by(*order).values_list(*fields)]

    out = {}
    for sid in session_ids:
        rollouts = []
        for r in CodexRollout.objects.filter(session_id=sid).order_by("thread_id"):
            base = RolloutBase(thread_id=r.thread_id, relpath=r.relpath, length=r.length, sha256=r.sha256,
                               generation=r.generation)
            rollouts.append(hashlib.sha256(rollout_load(base=base)).hexdigest())
        out[sid] = {
            "session": rows(Session, ["id"], pk=sid),
            "turns": rows(Turn, ["seq"], session_id=sid),
            "messages": rows(Message, ["seq"], session_id=sid),
            "bindings": rows(CodexBinding, ["created_at", "thread_id"], session_id=sid),
            "notices": rows(Notice, ["created_at", "text"], session_id=sid),
            "rollouts": rows(CodexRollout, ["thread_id"], session_id=sid),
            "chunks": rows(RolloutChunk, ["rollout__thread_id", "seq"], rollout__session_id=sid),
            "rollout_sha256": rollouts,
        }
    return out


def export(tmp_path: Path, *args: str, name: str = "sessions.jsonl") -> Path:
    target = tmp_path / name
    call_command("export_sessions", "--output", str(target), *args)
    return target


def wipe(session_ids: list[str]) -> None:
    Session.objects.filter(pk__in=session_ids).delete()
    assert not Message.objects.filter(session_id__in=session_ids).exists()
    assert not RolloutChunk.objects.filter(rollout__session_id__in=session_ids).exists()


@pytest.fixture
def rotated(user, scripted_codex, run_turn_now):
    return make_rotated_session(owner=user, run_turn_now=run_turn_now, scripted_codex=scripted_codex,
                                session_id="sess-export-rotated", title="Rotated ✓ ünïcode")


@pytest.fixture
def handmade(user):
    """A session with rows the scripted codex does not make: a tool call, an acknowledged notice, a
    failed turn, NUL-free but awkward text."""
    session = SessionFactory(id="sess-export-handmade", owner=user, model_config={"model": "m", "sandbox": "read-only"})
    turn = TurnFactory(session=session, seq=1, status="failed", error="codex exited\nwith 137", created_by=user,
                       usage={"total_tokens": 7}, timings={"run_ms": 1.5}, finished_at=timezone.now())
    MessageFactory(session=session, seq=1, turn=turn, role="user", content="line one\n\"quoted\" \u2603")
    MessageFactory(session=session, seq=2, turn=turn, role="assistant", content="",
                   tool_calls=[{"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}],
                   codex_item_id="item-1")
    NoticeFactory(session=session, turn=turn, text="read me", acknowledged_at=timezone.now(), acknowledged_by=user)
    Session.objects.filter(pk=session.pk).update(last_message_seq=2, last_turn_seq=1)
    return session


def test_round_trip_gives_identical_rows_and_the_imported_session_resumes_its_thread(
    tmp_path, user, rotated, handmade, scripted_codex, run_turn_now, capsys
):
    ids = [rotated.session.id, handmade.id]
    before = snapshot(ids)
    assert len(before[rotated.session.id]["rollout_sha256"]) == 1  # the new thread's; the old one was lost
    assert len(before[rotated.session.id]["chunks"]) >= 1
    assert len(before[rotated.session.id]["bindings"]) == 2

    path = export(tmp_path)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["session"]["id"] for line in lines] == sorted(ids)
    assert "exported 2 session(s)" in capsys.readouterr().err

    wipe(ids)
    out = io.StringIO()
    call_command("import_sessions", str(path), stdout=out)
    assert out.getvalue().strip() == "2 imported, 0 skipped, 0 refused"
    assert snapshot(ids) == before

    # The imported rollout is what codex resumes: the next turn resumes the new thread, no rotation.
    t4 = run_turn_now(session=Session.objects.get(pk=rotated.session.id), text="hello four", user=user)
    assert (t4.status, t4.thread_action, t4.codex_thread_id) == ("succeeded", "resumed", rotated.new_thread_id), t4.error
    assert scripted_codex.processes()[-1] == ["initialize", "thread/resume", "turn/start"]
    assert Notice.objects.filter(session_id=rotated.session.id).count() == 1


def test_export_filters_by_owner_session_and_since(tmp_path, user):
    other = UserFactory(username="bob")
    mine_old = SessionFactory(id="sess-mine-old", owner=user)
    SessionFactory(id="sess-mine-new", owner=user)
    SessionFactory(id="sess-bob", owner=other)
    Session.objects.filter(pk=mine_old.pk).update(updated_at=timezone.now() - timedelta(days=40))

    def ids(*args: str) -> list[str]:
        path = export(tmp_path, *args, name="f.jsonl")
        return [json.loads(line)["session"]["id"] for line in path.read_text().splitlines()]

    assert ids() == ["sess-bob", "sess-mine-new", "sess-mine-old"]
    assert ids("--owner", "alice") == ["sess-mine-new", "sess-mine-old"]
    assert ids("--session", "sess-bob", "--session", "sess-mine-old") == ["sess-bob", "sess-mine-old"]
    since = (timezone.now() - timedelta(days=10)).date().isoformat()
    assert ids("--owner", "alice", "--since", since) == ["sess-mine-new"]
    out = io.StringIO()
    call_command("export_sessions", "--session", "sess-bob", stdout=out)  # standard output by default
    assert json.loads(out.getvalue())["session"]["owner"] == "bob"


def test_bad_lines_are_reported_by_number_and_change_nothing(tmp_path, rotated, handmade, capsys):
    by_id = {json.loads(line)["session"]["id"]: line for line in export(tmp_path).read_text(encoding="utf-8").splitlines()}
    good, other = by_id[rotated.session.id], by_id[handmade.id]
    wipe([rotated.session.id, handmade.id])

    tampered = json.loads(good)  # passes the shape check, fails only once its rows are being written
    tampered["rollouts"][0]["sha256"] = "0" * 64
    no_owner = json.loads(other)
    no_owner["session"]["owner"] = "nobody"
    bad_role = json.loads(other)
    bad_role["messages"][0]["role"] = "wizard"
    behind = json.loads(other)
    behind["session"]["last_message_seq"] = 1
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        "{not json", json.dumps(tampered), json.dumps(no_owner), json.dumps(bad_role), json.dumps(behind), other,
    ]) + "\n", encoding="utf-8")

    with pytest.raises(CommandError, match="1 imported, 0 skipped, 5 refused"):
        call_command("import_sessions", str(path))
    err = capsys.readouterr().err
    assert "line 1: refused: not JSON" in err
    assert f"line 2: refused: session {rotated.session.id}: rollout of thread {rotated.new_thread_id}" in err
    assert "line 3: refused: owner 'nobody' does not exist here" in err
    assert "line 4: refused: messages/0/role: 'wizard' is not one of" in err
    assert "line 5: refused: session counters (last_message_seq 1, last_turn_seq 1) are behind its rows" in err
    # The tampered session left nothing behind: its session, turns and transcript rows rolled back too.
    assert not Session.objects.filter(pk=rotated.session.id).exists()
    assert not Turn.objects.filter(session_id=rotated.session.id).exists()
    assert not Message.objects.filter(session_id=rotated.session.id).exists()
    assert list(Session.objects.values_list("id", flat=True)) == [handmade.id]


@pytest.mark.parametrize("status", ["queued", "running"])
def test_export_skips_a_session_with_an_unfinished_turn_names_it_and_exits_1(tmp_path, user, status, capsys):
    busy = SessionFactory(id="sess-busy", owner=user)
    turn = TurnFactory(session=busy, seq=1, status=status)
    SessionFactory(id="sess-idle", owner=user)
    with pytest.raises(CommandError, match=r"1 session\(s\) skipped"):
        export(tmp_path)
    err = capsys.readouterr().err
    assert f"skipped: session sess-busy: turn {turn.pk} is {status}" in err
    assert "exported 1 session(s)" in err
    lines = (tmp_path / "sessions.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["session"]["id"] for line in lines] == ["sess-idle"]


def test_a_queued_turn_is_refused_on_import(tmp_path, user):
    session = SessionFactory(id="sess-queued", owner=user)
    TurnFactory(session=session, seq=1, status="succeeded")
    record = json.loads(export(tmp_path).read_text())
    record["turns"][0]["status"] = "queued"  # as a hand-edited line, or one from an older export
    wipe([session.id])
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(CommandError, match="1 refused"):
        call_command("import_sessions", str(path))
    assert not Session.objects.filter(pk=session.id).exists()


def test_importing_twice_refuses_or_skips_and_changes_nothing(tmp_path, rotated, capsys):
    path = export(tmp_path)
    before = snapshot([rotated.session.id])

    with pytest.raises(CommandError, match="0 imported, 0 skipped, 1 refused"):
        call_command("import_sessions", str(path))
    assert f"line 1: refused: session {rotated.session.id} already exists" in capsys.readouterr().err
    assert snapshot([rotated.session.id]) == before

    out = io.StringIO()
    call_command("import_sessions", str(path), "--on-existing", "skip", stdout=out)
    assert out.getvalue().strip() == "0 imported, 1 skipped, 0 refused"
    assert f"line 1: skipped: session {rotated.session.id} exists already" in capsys.readouterr().err
    assert snapshot([rotated.session.id]) == before


def test_export_to_standard_output_and_import_from_standard_input(tmp_path, handmade, monkeypatch):
    before = snapshot([handmade.id])
    out = io.StringIO()
    call_command("export_sessions", stdout=out)
    wipe([handmade.id])
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(out.getvalue().encode("utf-8"))))
    result = io.StringIO()
    call_command("import_sessions", "-", stdout=result)
    assert result.getvalue().strip() == "1 imported, 0 skipped, 0 refused"
    assert snapshot([handmade.id]) == before


def test_a_line_without_a_column_added_later_gets_its_default_and_an_unknown_key_is_refused(tmp_path, handmade, capsys):
    line = json.loads(export(tmp_path).read_text(encoding="utf-8"))
    wipe([handmade.id])
    older = json.loads(json.dumps(line))  # as an export made before these columns existed
    for message in older["messages"]:
        del message["reasoning"]
    del older["turns"][0]["timings"]
    del older["notices"][0]["created_at"]
    newer = json.loads(json.dumps(line))
    newer["turns"][0]["colour"] = "blue"
    no_id = json.loads(json.dumps(line))
    del no_id["session"]["id"]
    path = tmp_path / "versions.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (newer, no_id, older)) + "\n", encoding="utf-8")

    with pytest.raises(CommandError, match="1 imported, 0 skipped, 2 refused"):
        call_command("import_sessions", str(path))
    err = capsys.readouterr().err
    assert "line 1: refused: turns/0: Additional properties are not allowed ('colour' was unexpected)" in err
    assert "line 2: refused: session: 'id' is a required property" in err
    turn = Turn.objects.get(session_id=handmade.id)
    assert turn.timings == {} and turn.usage == {"total_tokens": 7}
    notice = Notice.objects.get(session_id=handmade.id)
    assert notice.created_at > timezone.now() - timedelta(minutes=5)
    assert notice.acknowledged_by is not None


def test_import_keeps_notice_ids_and_later_notices_get_new_ones(tmp_path, handmade, user):
    """docs/operating.md: import keeps every value, ids included — a notice ``id: 1`` comes back as ``id: 1``."""
    notice = Notice.objects.get(session_id=handmade.id)
    path = export(tmp_path)
    assert json.loads(path.read_text(encoding="utf-8"))["notices"][0]["id"] == notice.pk
    wipe([handmade.id])
    NoticeFactory(session=SessionFactory(owner=user), text="made meanwhile")  # the sequence moved on
    call_command("import_sessions", str(path), stdout=io.StringIO())
    assert Notice.objects.get(session_id=handmade.id).pk == notice.pk
    later = NoticeFactory(session=SessionFactory(owner=user), text="after the import")
    assert later.pk > max(Notice.objects.exclude(pk=later.pk).values_list("pk", flat=True))


def test_an_export_without_notice_ids_still_imports(tmp_path, handmade):
    path = export(tmp_path)
    record = json.loads(path.read_text(encoding="utf-8"))
    for notice in record["notices"]:
        del notice["id"]
    path.write_text(json.dumps(record) + "\n", encoding="utf-8")
    wipe([handmade.id])
    out = io.StringIO()
    call_command("import_sessions", str(path), stdout=out)
    assert out.getvalue().strip() == "1 imported, 0 skipped, 0 refused"
    assert Notice.objects.filter(session_id=handmade.id, text="read me").count() == 1
