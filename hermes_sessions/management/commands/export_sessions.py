"""``manage.py export_sessions``: sessions as JSON Lines (``services/portability.py``), one line per
session with its transcript, turns, bindings, notices and stored codex rollouts, with a progress bar
on stderr. ``import_sessions`` reads the file back. A session with a queued or running turn is
skipped with a warning on stderr naming it (import would refuse its line), the others are written,
and the command exits 1 (``CommandError``)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.console import Console
from rich.progress import Progress, TaskID

from hermes_sessions import selectors
from hermes_sessions.management.options import moment
from hermes_sessions.services.portability import ExportRefused, session_export_line


class Command(BaseCommand):
    help = "Export sessions (transcript, turns, bindings, notices, codex rollouts) as JSON Lines."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--owner", help="only sessions of this username")
        parser.add_argument("--session", action="append", dest="sessions", default=[], metavar="ID",
                            help="only this session (repeatable)")
        parser.add_argument("--since", type=moment, help="only sessions active at or after YYYY-MM-DD (or an ISO date-time)")
        parser.add_argument("--output", "-o", default="-", help="file to write (default: standard output)")

    def handle(self, *args: Any, **options: Any) -> None:
        session_ids = list(selectors.session_export_list(
            owner=options["owner"], session_ids=options["sessions"], since=options["since"]
        ).values_list("id", flat=True))
        target = options["output"]
        console = Console(stderr=True)
        total = len(session_ids)
        skipped: list[str] = []
        with Progress(console=console, disable=not total) as progress:
            task = progress.add_task("exporting sessions", total=total)
            if target == "-":
                count = self._write(session_ids, self.stdout.write, progress, task, skipped)
            else:
                # Written beside the target and renamed at the end: a failed export leaves no half file.
                partial = Path(f"{target}.partial")
                with partial.open("w", encoding="utf-8") as out:
                    count = self._write(session_ids, lambda line: out.write(line + "\n"), progress, task, skipped)
                os.replace(partial, target)
        for reason in skipped:
            console.print(f"skipped: {reason}", markup=False, highlight=False, soft_wrap=True)
        console.print(f"exported {count} session(s) to {'standard output' if target == '-' else target}",
                      markup=False, highlight=False, soft_wrap=True)
        if skipped:
            raise CommandError(f"{len(skipped)} session(s) skipped: a queued or running turn (import would refuse them)")

    @staticmethod
    def _write(session_ids: list[str], write: Callable[[str], object], progress: Progress, task: TaskID,
               skipped: list[str]) -> int:
        count = 0
        for session_id in session_ids:
            try:
                line = session_export_line(session_id=session_id)
            except ExportRefused as exc:
                skipped.append(str(exc))
                line = None
            if line is not None:  # None: deleted since the list was read
                write(line)
                count += 1
            progress.advance(task)
        return count
