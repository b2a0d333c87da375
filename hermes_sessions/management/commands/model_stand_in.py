"""``python manage.py model_stand_in`` — run the offline model stand-in in the foreground."""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from hermes_sessions import model_stand_in


class Command(BaseCommand):
    """Serve :class:`hermes_sessions.model_stand_in.ModelStandIn` until SIGINT/SIGTERM.

    Same code path as ``python -m hermes_sessions.model_stand_in`` (``run_foreground``).
    """

    help = (
        "Run the offline stand-in for the OpenAI Responses API used by the demo and tests "
        "(codex app-server's model provider base_url = http://127.0.0.1:PORT/v1). "
        "Replies 'echo: <user text>'; magic words SLOW, RUNCMD <cmd>, FAIL500. Loopback only."
    )

    def add_arguments(self, parser):
        model_stand_in.build_arg_parser(parser)

    def handle(self, *args, **options):
        try:
            model_stand_in.run_foreground(
                host=options["host"],
                port=options["port"],
                port_file=options["port_file"],
                log_path=options["log"],
                slow_seconds=options["slow_seconds"],
                out=self.stdout,
            )
        except (ValueError, OSError) as exc:
            raise CommandError(str(exc)) from exc
