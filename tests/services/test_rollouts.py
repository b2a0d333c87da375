"""Rollouts in PostgreSQL (issue 7): stored with the turn, restored into a fresh home per turn,
fenced by generation, imported from the legacy shared home, and the bounded history seed."""
from __future__ import annotations

import hashlib
import shutil
import uuid
import zlib

import pytest
from django.core.management import call_command
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from hermes_sessions import services
from hermes_sessions.codex.launch import session_home
from hermes_sessions.codex.rollout_files import (
    RolloutBase,
    RolloutDelta,
    RolloutDiverged,
    find_rollout,
    read_delta,
    write_rollout,
)
from hermes_sessions.models import CodexBinding, CodexRollout, Message, Notice, RolloutChunk, Turn
from hermes_sessions.services import rollouts
from hermes_sessions.services.turns import history_seed
from hermes_sessions.worker import execution

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(60)]


def stored_bytes(thread_id: str) -> bytes:
    row = CodexRollout.objects.get(thread_id=thread_id)
    return rollouts.rollout_load(base=rollouts.rollout_state(thread_id=row.thread_id))


def test_each_turn_stores_what_codex_appended(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t1.status, t2.status, t2.thread_action) == (Turn.Status.SUCCEEDED,) * 2 + ("resumed",), t2.error
    row = CodexRollout.objects.get(thread_id=t1.codex_thread_id)
    on_disk = find_rollout(session_home(session.id).home, t1.codex_thread_id).read_bytes()
    assert (row.generation, row.length, row.sha256) == (2, len(on_disk), hashlib.sha256(on_disk).hexdigest())
    assert row.relpath.startswith("sessions/") and row.session_id == session.id
    chunks = list(RolloutChunk.objects.filter(rollout=row).order_by("seq").values_list("seq", "offset", "size"))
    assert chunks[0][:2] == (1, 0) and chunks[1][:2] == (2, chunks[0][2])  # turn 2 appended after turn 1
    assert stored_bytes(t1.codex_thread_id) == on_disk


def test_a_wiped_disk_loses_nothing(user, scripted_codex, run_turn_now, settings):
    """Every turn's home is made from PostgreSQL: wiping all homes (a new host) still resumes."""
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    shutil.rmtree(settings.CODEX_HOMES_ROOT)
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.thread_action, t2.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", t1.codex_thread_id)
    assert not Notice.objects.exists()
    # and the home holds only this session's thread
    files = sorted(p.name for p in (session_home(session.id).home / "sessions").rglob("*.jsonl"))
    assert files == [find_rollout(session_home(session.id).home, t1.codex_thread_id).name]


def _queued(session, text, user, monkeypatch):
    """A queued turn whose Celery task is held back, for the test to play the worker by hand."""
    from hermes_sessions import tasks

    monkeypatch.setattr(tasks.run_turn, "apply_async", lambda *a, **k: None)
    return services.turn_enqueue(session=session, input_text=text, user=user)


def test_a_stale_generation_commits_nothing(user, scripted_codex, run_turn_now, monkeypatch):
    """Two writers raced on one thread: the one whose generation moved on commits nothing."""
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    t2 = _queued(session, "hello two", user, monkeypatch)
    claim = services.turn_claim(turn_id=t2.id)
    assert claim.rollout_generation == 1
    outcome = execution._run_once(claim, execution.TurnControl())
    assert outcome.rollout is not None and outcome.rollout.base.generation == 1
    # The other writer (read the same generation 1) commits first.
    other = read_delta(session_home(session.id).home, t1.codex_thread_id, outcome.rollout.base)
    with transaction.atomic():
        rollouts.rollout_store(session=session, delta=other)
    rows_before, chunks_before = Message.objects.count(), RolloutChunk.objects.count()

    assert services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=outcome) is None
    t2.refresh_from_db()
    assert t2.status == Turn.Status.RUNNING  # nothing committed: the lease and the sweep take it from here
    assert (Message.objects.count(), RolloutChunk.objects.count()) == (rows_before, chunks_before)
    assert CodexRollout.objects.get(thread_id=t1.codex_thread_id).generation == 2


def test_a_stale_generation_commits_nothing_when_the_other_writer_appended_nothing(
        user, scripted_codex, run_turn_now, monkeypatch):
    """The fence is the generation, not only the bytes: a writer that committed a turn appending nothing
    (a plain resume writes no line) moved the generation on and left length and sha256 as they were;
    the finalize that restored the older generation still commits nothing."""
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    t2 = _queued(session, "hello two", user, monkeypatch)
    claim = services.turn_claim(turn_id=t2.id)
    outcome = execution._run_once(claim, execution.TurnControl())
    base = outcome.rollout.base
    assert base is not None and base.generation == 1 and outcome.rollout.data  # this writer appended bytes
    # The other writer (read the same generation 1) commits first, with nothing appended.
    nothing = RolloutDelta(thread_id=base.thread_id, relpath=base.relpath, offset=base.length, data=b"",
                           length=base.length, sha256=base.sha256, base=base)
    with transaction.atomic():
        rollouts.rollout_store(session=session, delta=nothing)
    row = CodexRollout.objects.get(thread_id=t1.codex_thread_id)
    assert (row.generation, row.length, row.sha256) == (2, base.length, base.sha256)
    rows_before, chunks_before = Message.objects.count(), RolloutChunk.objects.count()

    assert services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=outcome) is None
    t2.refresh_from_db()
    assert t2.status == Turn.Status.RUNNING
    assert (Message.objects.count(), RolloutChunk.objects.count()) == (rows_before, chunks_before)
    row.refresh_from_db()
    assert (row.generation, row.length, row.sha256) == (2, base.length, base.sha256)


def test_a_generation_moved_on_since_the_claim_runs_nothing(user, scripted_codex, run_turn_now, monkeypatch):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    t2 = _queued(session, "hello two", user, monkeypatch)
    claim = services.turn_claim(turn_id=t2.id)
    CodexRollout.objects.filter(thread_id=t1.codex_thread_id).update(generation=5)
    with pytest.raises(execution.TurnRunError) as info:
        execution._run_once(claim, execution.TurnControl())
    assert isinstance(info.value.cause, execution.TurnAbandoned)
    assert len(scripted_codex.processes()) == 1  # no app-server was spawned for the stale claim


def test_a_delta_names_the_whole_files_length_and_sha256_read_in_one_pass(tmp_path):
    stored, appended = b'{"a":1}\n' * 1000, b'{"b":2}\n' * 7
    base = RolloutBase(thread_id="t1", relpath="sessions/rollout-x-t1.jsonl", length=len(stored),
                       sha256=hashlib.sha256(stored).hexdigest(), generation=4)
    home = tmp_path / "home"
    write_rollout(home, base, stored)
    with open(home / base.relpath, "ab") as fh:
        fh.write(appended)
    delta = read_delta(home, "t1", base)
    assert (delta.offset, delta.data, delta.length) == (len(stored), appended, len(stored) + len(appended))
    assert delta.sha256 == hashlib.sha256(stored + appended).hexdigest()
    fresh = read_delta(home, "t1", None)  # nothing stored yet: all of it is the delta
    assert (fresh.offset, fresh.data, fresh.sha256) == (0, stored + appended, delta.sha256)


def test_a_diverged_file_is_refused(tmp_path):
    base = RolloutBase(thread_id="t1", relpath="sessions/rollout-x-t1.jsonl", length=3,
                       sha256=hashlib.sha256(b"abc").hexdigest(), generation=1)
    home = tmp_path / "home"
    write_rollout(home, base, b"abc")
    (home / base.relpath).write_bytes(b"abXdef")  # not an extension of the stored bytes
    with pytest.raises(RolloutDiverged, match="no longer starts with"):
        read_delta(home, "t1", base)
    with pytest.raises(RolloutDiverged, match="does not match"):
        write_rollout(home, base, b"abd")
    with pytest.raises(RolloutDiverged, match="not a rollout"):
        write_rollout(home, RolloutBase("t1", "../escape-t1.jsonl", 3, base.sha256, 1), b"abc")


def test_damaged_stored_chunks_fail_the_turn_and_keep_the_binding(user, scripted_codex, run_turn_now):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    RolloutChunk.objects.filter(rollout__thread_id=t1.codex_thread_id).update(data=zlib.compress(b"garbage"))
    # A host that holds no copy reads every chunk (one that holds it reads none of these: test_rollout_restore).
    shutil.rmtree(session_home(session.id).home.parent)
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert t2.status == Turn.Status.FAILED and "damaged" in t2.error
    assert CodexBinding.objects.get(session=session, status="active").thread_id == t1.codex_thread_id
    assert scripted_codex.processes()[-1] != ["initialize", "thread/resume"]  # codex never saw the bad copy


def test_a_database_blip_during_restore_is_retried_not_a_failed_turn(user, scripted_codex, run_turn_now, monkeypatch, settings):
    """make faults' db-down-during-restore: a connection lost while the rollout is read is retried by
    the retry policy (on a fresh connection); the turn resumes its thread and succeeds."""
    from django.db import OperationalError

    settings.HERMES_RETRY_DELAYS = (0.05, 0.05)
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    real_restore, calls = execution.rollout_restore, []

    def blip(**kwargs):
        calls.append(kwargs["thread_id"])
        if len(calls) == 1:
            raise OperationalError("server closed the connection unexpectedly")
        return real_restore(**kwargs)

    monkeypatch.setattr(execution, "rollout_restore", blip)
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.thread_action, t2.codex_thread_id) == (Turn.Status.SUCCEEDED, "resumed", t1.codex_thread_id)
    assert calls == [t1.codex_thread_id, t1.codex_thread_id]
    assert not Notice.objects.filter(session=session).exists()


def _move_to_legacy_home(session, thread_id, settings):
    """Make the thread look like one bound before this change: its rollout only in the shared home."""
    src = find_rollout(session_home(session.id).home, thread_id)
    rel = src.relative_to(session_home(session.id).home)
    (settings.CODEX_HOME / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.move(src, settings.CODEX_HOME / rel)
    rollouts.rollout_forget(thread_id=thread_id)


def test_a_legacy_rollout_is_imported_on_first_use(user, scripted_codex, run_turn_now, settings):
    session = services.session_create(owner=user)
    t1 = run_turn_now(session=session, text="hello one", user=user)
    _move_to_legacy_home(session, t1.codex_thread_id, settings)
    t2 = run_turn_now(session=session, text="hello two", user=user)
    assert (t2.status, t2.thread_action) == (Turn.Status.SUCCEEDED, "resumed"), t2.error
    assert CodexRollout.objects.get(thread_id=t1.codex_thread_id).generation == 2  # imported (1), then turn 2
    assert not Notice.objects.exists()


def test_import_rollouts_command_imports_every_bound_thread(user, scripted_codex, run_turn_now, settings):
    threads = []
    for i in range(3):
        session = services.session_create(owner=user, session_id=f"legacy-{i}")
        thread_id = run_turn_now(session=session, text=f"hello {i}", user=user).codex_thread_id
        _move_to_legacy_home(session, thread_id, settings)
        threads.append(thread_id)
    call_command("import_rollouts")
    assert sorted(CodexRollout.objects.values_list("thread_id", flat=True)) == sorted(threads)
    call_command("import_rollouts")  # again: nothing to do
    assert CodexRollout.objects.count() == 3


def test_the_history_seed_reads_a_bounded_tail_of_a_long_transcript(user, settings):
    session = services.session_create(owner=user)
    Message.objects.bulk_create(
        [Message(session=session, seq=i, role="user" if i % 2 else "assistant", content=f"message {i}")
         for i in range(1, 10_001)]
    )
    with CaptureQueriesContext(connection) as queries:
        seed = history_seed(session_id=session.id, exclude_turn_id=uuid.uuid4())
    # Pages of 64, 128, 256 … rows newest first, each query with a LIMIT: a handful of queries, never
    # one per row nor one reading the whole history.
    assert 1 <= len(queries) <= 7, len(queries)
    for query in queries:  # the pages (ORDER BY seq DESC), then one EXISTS for "older rows left?"
        sql = query["sql"]
        assert "LIMIT" in sql and (("ORDER BY" in sql and "DESC" in sql) or sql.startswith("SELECT 1 AS"))
    assert seed.endswith("message 10000") and "[… earlier turns omitted …]" in seed
    assert len(seed) <= settings.HERMES_HISTORY_SEED_MAX_CHARS


def test_the_history_seed_reads_about_the_rows_that_fit_when_rows_are_chat_sized(user, settings, monkeypatch):
    """With ~400-character rows only ~80 fit in 32,000 characters: the seed reads a small multiple of
    that, not the ~3,500 rows a cap of tiny rows would need (the bench's long-history first turn)."""
    from hermes_sessions.services import turns as turn_services

    session = services.session_create(owner=user)
    Message.objects.bulk_create(
        [Message(session=session, seq=i, role="user" if i % 2 else "assistant", content=f"{i:05d} " + "x" * 394)
         for i in range(1, 5_001)]
    )
    read: list[int] = []
    real = turn_services._seed_chars_at_least
    monkeypatch.setattr(turn_services, "_seed_chars_at_least", lambda row: read.append(row.seq) or real(row))
    seed = history_seed(session_id=session.id, exclude_turn_id=uuid.uuid4())
    fit = settings.HERMES_HISTORY_SEED_MAX_CHARS // 400
    assert fit < len(read) <= 3 * fit + 64, len(read)
    assert "05000 " in seed and "[… earlier turns omitted …]" in seed
    assert len(seed) <= settings.HERMES_HISTORY_SEED_MAX_CHARS


def test_nothing_that_lists_sessions_or_turns_loads_rollout_bytes(user, scripted_codex, run_turn_now, admin_client):
    from django.contrib import admin

    assert RolloutChunk not in admin.site._registry and CodexRollout not in admin.site._registry
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="hello one", user=user)
    with CaptureQueriesContext(connection) as queries:
        assert admin_client.get("/admin/hermes_sessions/session/").status_code == 200
        assert admin_client.get(f"/admin/hermes_sessions/session/{session.pk}/change/").status_code == 200
        assert admin_client.get("/admin/hermes_sessions/turn/").status_code == 200
    assert not [q["sql"] for q in queries if "rolloutchunk" in q["sql"]]
