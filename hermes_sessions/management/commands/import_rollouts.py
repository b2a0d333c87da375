"""``manage.py import_rollouts``: import every bound thread's rollout still in the legacy shared
``CODEX_HOME`` into PostgreSQL, with a progress bar. Safe to run again (and while workers run: a turn
imports the rollout it needs on first use anyway, and the first import of a thread wins)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandParser
from rich.progress import Progress

from hermes_sessions.models import CodexBinding, CodexRollout
from hermes_sessions.services.rollouts import rollout_import


class Command(BaseCommand):
    help = "Import rollouts of bound codex threads from the legacy shared CODEX_HOME into PostgreSQL."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--codex-home", default="", help="the legacy home to read (default: settings.CODEX_HOME)")
        parser.add_argument("--all-bindings", action="store_true", help="also threads of ended bindings")

    def handle(self, *args: Any, **options: Any) -> None:
        home = Path(options["codex_home"] or settings.CODEX_HOME)
        bindings = CodexBinding.objects.exclude(thread_id__in=CodexRollout.objects.values("thread_id"))
        if not options["all_bindings"]:
            bindings = bindings.filter(status=CodexBinding.Status.ACTIVE)
        todo = list(bindings.order_by("id").values_list("session_id", "thread_id"))
        imported = missing = 0
        with Progress(disable=not todo) as progress:
            task = progress.add_task("importing rollouts", total=len(todo))
            for session_id, thread_id in todo:
                if rollout_import(session_id=session_id, thread_id=thread_id, home=home) is None:
                    missing += 1
                else:
                    imported += 1
                progress.advance(task)
        self.stdout.write(f"imported {imported} rollouts from {home}; {missing} bound threads had none there")
