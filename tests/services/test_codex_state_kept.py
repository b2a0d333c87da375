"""Codex's sqlite projection of a rollout on a host that holds the rollout (``launch.prepare_session_home``'s
``keep``, ``execution._restore``): kept with the rollout while the restore extends that very file — so codex
projects only the appended bytes at start and at ``thread/resume`` — and dropped whenever the file in place
is not the one it was built from (a full restore, a forgotten rollout).

Real PostgreSQL, the pinned codex binary and the model stand-in, in this process; two "hosts" are two homes
roots (``CODEX_HOMES_ROOT``) switched between turns. A marker table written into codex's
``thread_history_*.sqlite`` between turns tells whether the file survived the wipe.
"""
from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from devtools.model_stand_in import ModelStandIn
from hermes_sessions import services
from hermes_sessions.codex.launch import session_home
from hermes_sessions.codex.rollout_files import find_rollout, read_delta
from hermes_sessions.models import Notice, Turn
from hermes_sessions.services import rollouts

from ..support.real_codex import use_real_codex

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture
def stand_in():
    with ModelStandIn() as server:
        yield server


@pytest.fixture
def real(settings, codex_dirs, real_codex_bin, stand_in):
    use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
    settings.HERMES_WARM_IDLE_SECONDS, settings.HERMES_WARM_POOL = 0, 0
    return codex_dirs


def _on_host(settings, root: Path, name: str) -> None:
    settings.CODEX_HOMES_ROOT = root / name / "homes"


def _turn(run_turn_now, session, user, text: str) -> Turn:
    turn = run_turn_now(session=session, text=text, user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    return turn


def _history_db(session) -> Path:
    found = sorted(session_home(session.pk).home.glob("thread_history_*.sqlite"))
    assert len(found) == 1, found
    return found[0]


def _mark(session) -> None:
    with sqlite3.connect(_history_db(session)) as db:
        db.execute("CREATE TABLE hermes_test_marker (x INTEGER)")


def _marked(session) -> bool:
    with sqlite3.connect(_history_db(session)) as db:
        return db.execute("SELECT count(*) FROM sqlite_master WHERE name = 'hermes_test_marker'").fetchone()[0] == 1


def _projected_to(session, thread_id: str) -> int:
    with sqlite3.connect(_history_db(session)) as db:
        (offset,) = db.execute("SELECT next_rollout_byte_offset FROM thread_history_projection_state WHERE thread_id = ?",
                               (thread_id,)).fetchone()
    return offset


def _carried(stand_in: ModelStandIn, text: str) -> bool:
    """Whether the last model request carried ``text`` as a user message (the thread's history)."""
    return any(t == text for role, t in stand_in.user_texts(stand_in.requests()[-1]) if role == "user")


def test_a_seen_host_keeps_codex_state_and_resumes_what_another_host_appended(real, settings, user, run_turn_now,
                                                                                stand_in):
    session = services.session_create(owner=user, session_id="state-kept")
    _on_host(settings, real, "a")
    t1 = _turn(run_turn_now, session, user, "one on a")
    _mark(session)
    _turn(run_turn_now, session, user, "two on a")
    assert _marked(session), "host a's codex state was wiped although the host held the rollout"

    _on_host(settings, real, "b")
    _turn(run_turn_now, session, user, "three on b")
    assert not _marked(session)  # host b started from PostgreSQL alone
    _on_host(settings, real, "a")
    _turn(run_turn_now, session, user, "four on a")
    # The kept projection was extended by codex with host b's turn: its cursor is at the file's end, and the
    # model saw the turn host b ran.
    assert _marked(session)
    assert _carried(stand_in, "three on b")
    rollout = find_rollout(session_home(session.pk).home, t1.codex_thread_id)
    assert rollout is not None
    assert _projected_to(session, t1.codex_thread_id) == rollout.stat().st_size
    assert rollouts.rollout_state(thread_id=t1.codex_thread_id).length == rollout.stat().st_size


def test_a_held_copy_the_restore_replaces_takes_codex_state_with_it(real, settings, user, run_turn_now, stand_in):
    """A held file longer than what PostgreSQL stores (a turn whose finalize was fenced out captured it) is
    restored in full — a new file — so the projection built from the old one goes."""
    session = services.session_create(owner=user, session_id="state-dropped")
    _on_host(settings, real, "a")
    t1 = _turn(run_turn_now, session, user, "one")
    home = session_home(session.pk).home
    rollout = find_rollout(home, t1.codex_thread_id)
    assert rollout is not None
    _mark(session)
    base = rollouts.rollout_state(thread_id=t1.codex_thread_id)
    with open(rollout, "ab") as fh:
        fh.write(b'{"timestamp":"2026-12-06T00:00:00.000Z","type":"event_msg","payload":{"type":"never_stored"}}\n')
    assert read_delta(home, t1.codex_thread_id, base) is not None  # this process now knows the longer file
    _turn(run_turn_now, session, user, "two")
    assert not _marked(session)
    assert _carried(stand_in, "one")
    assert b"never_stored" not in find_rollout(home, t1.codex_thread_id).read_bytes()


def test_a_forgotten_rollout_takes_codex_state_with_it_and_the_thread_rotates(real, settings, user, run_turn_now):
    """Codex's thread index must not outlive the rollout it indexes: the rotation still happens, once."""
    session = services.session_create(owner=user, session_id="state-forgotten")
    _on_host(settings, real, "a")
    t1 = _turn(run_turn_now, session, user, "one")
    _mark(session)
    rollouts.rollout_forget(thread_id=t1.codex_thread_id)
    t2 = _turn(run_turn_now, session, user, "two")
    assert t2.thread_action == "rotated" and t2.codex_thread_id != t1.codex_thread_id
    assert Notice.objects.filter(session=session).count() == 1
    assert not _marked(session)
