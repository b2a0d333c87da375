"""A session that went through a rotation, made by the real services and task code on the scripted
app-server (``tests/codex/scripted_app_server.py``), so its rows are exactly what a real rotation
leaves (``docs/contract.md`` §3): turn 1 ``started``, turn 2 ``resumed``, the thread's stored rollout
lost, turn 3 ``rotated`` — the first binding ended with codex's reason, a new active binding, one
notice, and both threads' rollouts as PostgreSQL stores them (the first one's is gone)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hermes_sessions import services
from hermes_sessions.models import Session, Turn


@dataclass(frozen=True)
class RotatedSession:
    session: Session
    turns: list[Turn]
    old_thread_id: str
    new_thread_id: str


def make_rotated_session(*, owner: Any, run_turn_now: Any, scripted_codex: Any, session_id: str,
                         title: str = "rotated session", texts: tuple[str, str, str] = ("hello one", "hello two", "hello three")
                         ) -> RotatedSession:
    """Run three turns on a new session, losing the thread's rollout before the third; asserts each
    turn ended as the contract says. ``run_turn_now`` and ``scripted_codex`` are the fixtures of
    ``tests/conftest.py`` (a test using this needs ``django_db(transaction=True)``)."""
    session = services.session_create(owner=owner, session_id=session_id, title=title)
    t1 = run_turn_now(session=session, text=texts[0], user=owner)
    t2 = run_turn_now(session=session, text=texts[1], user=owner)
    assert (t1.thread_action, t2.thread_action) == ("started", "resumed"), (t1.error, t2.error)
    scripted_codex.remove_rollout(t1.codex_thread_id)
    t3 = run_turn_now(session=session, text=texts[2], user=owner)
    assert (t3.status, t3.thread_action) == ("succeeded", "rotated"), t3.error
    session.refresh_from_db()
    return RotatedSession(session=session, turns=[t1, t2, t3], old_thread_id=t1.codex_thread_id,
                          new_thread_id=t3.codex_thread_id)
