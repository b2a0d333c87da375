"""``manage.py export_sessions``: sessions as JSON Lines (``services/portability.py``), one line per
session with its transcript, turns, bindings, notices and stored codex rollouts, with a progress bar
on stderr. ``import_sessions`` reads the file back."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandParser
from rich.console import Console
from rich.progress import Progress, TaskID

from hermes_sessions import selectors
from hermes_sessions.management.options import moment
from hermes_sessions.services.portability import session_export_line


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
        with Progress(console=console, disable=not total) as progress:
            task = progress.add_task("exporting sessions", total=total)
            if target == "-":
                count = self._write(session_ids, self.stdout.write, progress, task)
            else:
                # Written beside the target and renamed at the end: a failed export leaves no half file.
                partial = Path(f"{target}.partial")
                with partial.open("w", encoding="utf-8") as out:
                    count = self._write(session_ids, lambda line: out.write(line + "\n"), progress, task)
                os.replace(partial, target)
        console.print(f"exported {count} session(s) to {'standard output' if target == '-' else target}",
                      markup=False, highlight=False, soft_wrap=True)

    @staticmethod
    def _write(session_ids: list[str], write: Callable[[str], object], progress: Progress, task: TaskID) -> int:
        count = 0
        for session_id in session_ids:
            line = session_export_line(session_id=session_id)
            if line is not None:  # None: deleted since the list was read
                write(line)
                count += 1
            progress.advance(task)
        return count
