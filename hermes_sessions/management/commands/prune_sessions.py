"""``manage.py prune_sessions --before YYYY-MM-DD``: delete sessions last active before that day,
each with all its rows, one transaction per session (``services/retention.py``), with a progress
bar on stderr. ``--dry-run`` lists and counts without deleting. A session with a queued or running
turn is refused (kept, reported; the command then exits 1)."""
from __future__ import annotations

from collections import Counter
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.console import Console
from rich.progress import Progress

from hermes_sessions.management.options import moment
from hermes_sessions.services.retention import PruneOutcome, session_prune, session_prune_candidates


class Command(BaseCommand):
    help = "Delete sessions (with their transcript, turns, bindings, notices, rollouts) last active before a date."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--before", type=moment, required=True,
                            help="YYYY-MM-DD (midnight, TIME_ZONE) or an ISO date-time: sessions last active earlier go")
        parser.add_argument("--dry-run", action="store_true", help="list and count, delete nothing")

    def handle(self, *args: Any, **options: Any) -> None:
        console = Console(stderr=True)
        before, dry_run = options["before"], options["dry_run"]
        candidates = session_prune_candidates(before=before)
        outcomes: list[PruneOutcome] = []
        with Progress(console=console, disable=not candidates) as progress:
            task = progress.add_task("checking sessions" if dry_run else "pruning sessions", total=len(candidates))
            for session_id, _last_activity, _active in candidates:
                outcome = session_prune(session_id=session_id, before=before, dry_run=dry_run)
                if outcome is not None:
                    outcomes.append(outcome)
                progress.advance(task)
        rows: Counter[str] = Counter()
        for outcome in outcomes:
            rows.update(outcome.rows)
            self.stdout.write(self._line(outcome, dry_run))
        kept = [o for o in outcomes if o.refused]
        gone = len(outcomes) - len(kept)
        detail = ", ".join(f"{n} {kind}" for kind, n in sorted(rows.items()))
        verb = "would delete" if dry_run else "deleted"
        self.stdout.write(f"{verb} {gone} session(s) last active before {before.isoformat()}"
                          + (f" ({detail})" if detail else "") + f"; refused {len(kept)}")
        if kept:
            raise CommandError(f"refused {len(kept)} session(s) with a queued or running turn: "
                               + ", ".join(o.session_id for o in kept))

    @staticmethod
    def _line(outcome: PruneOutcome, dry_run: bool) -> str:
        if outcome.refused:
            return f"refused {outcome.session_id}: {outcome.refused}"
        verb = "would delete" if dry_run else "deleted"
        return f"{verb} {outcome.session_id} (last active {outcome.last_activity.isoformat()})"
