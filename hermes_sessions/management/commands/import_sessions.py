"""``manage.py import_sessions FILE``: import the JSON Lines ``export_sessions`` wrote, one transaction
per line (``services/portability.py``), with a progress bar on stderr. A bad line is reported with
its line number and changes nothing; the others are imported. Exits 1 when any line was refused.
A line is read at most ``portability.MAX_LINE_BYTES`` (64 MiB) + 1 bytes at a time: a longer one is
skipped to its end and refused unparsed, so one huge line cannot exhaust memory."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from django.core.management.base import BaseCommand, CommandError, CommandParser
from rich.console import Console
from rich.progress import Progress

from hermes_sessions.services import portability
from hermes_sessions.services.portability import ON_EXISTING, ImportRefused, sessions_import_lines


class Command(BaseCommand):
    help = "Import sessions from the JSON Lines written by export_sessions (one transaction per session)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("file", help="the export to read ('-' for standard input)")
        parser.add_argument("--on-existing", choices=ON_EXISTING, default="refuse",
                            help="a session id that exists already: refuse the line (default, exit 1) or skip it")

    def handle(self, *args: Any, **options: Any) -> None:
        console = Console(stderr=True)
        path = options["file"]
        total = None if path == "-" else _count_lines(Path(path))
        counts = {"imported": 0, "skipped": 0, "refused": 0}
        with _open(path) as source, Progress(console=console) as progress:
            task = progress.add_task("importing sessions", total=total)
            for number, outcome in sessions_import_lines(lines=_lines(source, progress, task),
                                                         on_existing=options["on_existing"]):
                if isinstance(outcome, ImportRefused):
                    counts["refused"] += 1
                    console.print(f"line {number}: refused: {outcome}", markup=False, highlight=False, soft_wrap=True)
                elif outcome.imported:
                    counts["imported"] += 1
                else:
                    counts["skipped"] += 1
                    console.print(f"line {number}: skipped: session {outcome.session_id} exists already",
                                  markup=False, highlight=False, soft_wrap=True)
        summary = ", ".join(f"{n} {what}" for what, n in counts.items())
        if counts["refused"]:
            raise CommandError(f"{summary} (refused lines changed nothing; fix them and import again)")
        self.stdout.write(summary)


def _count_lines(path: Path) -> int:
    if not path.is_file():
        raise CommandError(f"{path}: no such file")
    lines, last = 0, b"\n"
    with path.open("rb") as f:  # by blocks: a line may be larger than memory
        for block in iter(lambda: f.read(1 << 20), b""):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _open(path: str) -> contextlib.AbstractContextManager[BinaryIO]:
    # Bytes: each line is decoded on its own, so one line that is not UTF-8 is refused, not the file.
    return contextlib.nullcontext(sys.stdin.buffer) if path == "-" else Path(path).open("rb")


def _lines(source: BinaryIO, progress: Progress, task: Any) -> Iterator[bytes]:
    limit = portability.MAX_LINE_BYTES
    while line := source.readline(limit + 1):
        if len(line) > limit and not line.endswith(b"\n"):
            while (rest := source.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass  # the rest of an oversized line: dropped; its first limit + 1 bytes are refused by size
        yield line
        progress.advance(task)
