"""``manage.py forget_rollout <session id>``: make codex lose the session's thread, as a lost rollout
would — delete the bound thread's stored rollout (``CodexRollout`` and its chunks) from PostgreSQL.

Every turn's ``CODEX_HOME`` is made from PostgreSQL, so codex then answers ``thread/resume`` with
``no rollout found`` and the next turn **rotates** (``thread_action = rotated``, a fresh thread seeded with
the transcript, the old binding ended, one notice; ``docs/contract.md`` §3). For trying rotation on the
production shape (README "Seeing a rotation"); the transcript is not touched. Not undoable.
"""
from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from hermes_sessions.models import Session, Turn
from hermes_sessions.selectors import active_thread_id
from hermes_sessions.services.rollouts import rollout_forget


class Command(BaseCommand):
    help = "Delete the stored rollout of a session's bound codex thread, so its next turn rotates."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("session_id", help="the session whose bound thread codex is to lose")

    def handle(self, *args: Any, session_id: str, **options: Any) -> None:
        session = Session.objects.filter(pk=session_id).first()
        if session is None:
            raise CommandError(f"no session {session_id!r}")
        with transaction.atomic():
            # Under the session's row lock, which a claim takes too: no turn starts running meanwhile.
            Session.objects.select_for_update(no_key=True).filter(pk=session_id).first()
            if Turn.objects.filter(session=session, status=Turn.Status.RUNNING).exists():
                # A running turn's finalize would be fenced (its rollout gone) and commit nothing: the turn
                # would wait for its lease and run again. Refuse instead.
                raise CommandError(f"session {session_id!r} has a running turn; try again when it has ended")
            thread_id = active_thread_id(session=session)
            if thread_id is None:
                raise CommandError(f"session {session_id!r} has no bound thread (no turn has run, or its binding ended)")
            if rollout_forget(thread_id=thread_id) != 1:
                raise CommandError(f"thread {thread_id} has no stored rollout (already forgotten?)")
        self.stdout.write(f"forgot the rollout of thread {thread_id}; the next turn of {session_id} rotates")
