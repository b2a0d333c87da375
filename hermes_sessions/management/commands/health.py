"""``manage.py health``: the readiness checks of ``GET /readyz`` (``hermes_sessions/health.py``) for hosts
without an API — a worker host, systemd (``hermes-worker@.service`` runs it as ``ExecStartPost``), cron.

One line per check on stdout, ``<name> ok|failed: <reason>`` (``--json``: the ``/readyz`` body); exit 0
when every check passed, 1 otherwise. ``--node NAME``: the ``workers`` and ``sandbox`` checks look at
that worker only (its Celery node name, ``hermes-1@host``). ``--wait SECONDS``: repeat the checks
every second until they pass or the time is up (a worker that has just started needs a moment for its
first heartbeat and its sandbox check).
"""
from __future__ import annotations

import json
import time
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from hermes_sessions.health import readiness, readiness_json, readiness_lines


class Command(BaseCommand):
    help = "Run the readiness checks (database, migrations, broker, workers, codex sandbox); exit 1 if one fails."
    requires_system_checks: list[str] = []  # the probe itself says what is wrong, fast

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", dest="as_json", action="store_true", help="print the /readyz JSON body instead of lines")
        parser.add_argument("--node", default="", help="check this worker only (its Celery node name, e.g. hermes-1@host)")
        parser.add_argument("--wait", type=float, default=0.0,
                            help="seconds to keep trying (every second) until every check passes")

    def handle(self, *args: Any, as_json: bool = False, node: str = "", wait: float = 0.0, **options: Any) -> None:
        if wait < 0:
            raise CommandError("--wait must be 0 or more seconds")
        until = time.monotonic() + wait
        while True:
            started = time.monotonic()
            checks = readiness(node=node)
            if all(c.ok for c in checks) or time.monotonic() >= until:
                break
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        if as_json:
            self.stdout.write(json.dumps(readiness_json(checks), ensure_ascii=False))
        else:
            for line in readiness_lines(checks):
                self.stdout.write(line)
        if not all(c.ok for c in checks):
            raise SystemExit(1)
