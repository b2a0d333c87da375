"""``python manage.py demo`` — the seed scenario, end to end, with the real codex binary.

Through the REST API and the real task code (eager Celery when no broker is configured):
turn 1 starts a thread; turn 2 runs on a new app-server process, resumes the thread, and its model
request carries turn 1's exchange; the thread's rollout is then lost — its rows deleted from
PostgreSQL and the file from the session's CODEX_HOME (an operator-lost rollout; each turn's home is
made from PostgreSQL) — and turn 3 rotates to a fresh thread with exactly one notice. Exits non-zero unless all of that held.
"""
from __future__ import annotations

import time
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from devtools.model_stand_in import ModelStandIn
from hermes_sessions.codex.launch import session_home
from hermes_sessions.models import Session
from hermes_sessions.services import NOTICE_THREAD_ROTATED
from hermes_sessions.services.rollouts import rollout_forget

SESSION_ID = "sess-codex-restart"
TERMINAL = {"succeeded", "failed", "cancelled"}


class Command(BaseCommand):
    help = "Run the seed scenario (start, resume after restart, rotate after the rollout is removed) against the real codex app-server."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each turn")

    def handle(self, *args: Any, timeout: float, **options: Any) -> None:
        self.timeout = timeout
        failures: list[str] = []
        with ModelStandIn() as stand_in:
            stand_in.start()
            settings.CODEX_STAND_IN_URL = stand_in.base_url  # config.toml is written from this at the first turn
            settings.CODEX_MODEL_PROVIDER = "stand-in"
            self.stdout.write(f"model stand-in: {stand_in.base_url}")
            client = self._client()

            self.stdout.write(self.style.MIGRATE_HEADING(f"Session {SESSION_ID}"))
            resp = client.post("/api/sessions/", {"id": SESSION_ID, "title": "codex restart demo"}, format="json")
            if resp.status_code != 201:
                raise CommandError(f"POST /api/sessions/ answered {resp.status_code}: {resp.content[:500]!r}")

            t1 = self._turn(client, "hello one")
            thread1 = t1["codex_thread_id"]
            self._check(failures, t1["thread_action"] == "started", "turn 1 started a thread")

            before = len(stand_in.requests())
            t2 = self._turn(client, "hello two")
            self._check(failures, t2["thread_action"] == "resumed" and t2["codex_thread_id"] == thread1,
                        "turn 2 (a new app-server process) resumed the same thread")
            texts = [t for r in stand_in.requests()[before:] for _, t in stand_in.user_texts(r)]
            self._check(failures, "hello one" in texts and "echo: hello one" in texts,
                        "turn 2's model request carried turn 1's exchange")

            removed = self._remove_rollout(thread1)
            self.stdout.write(f"lost the rollout (its database rows and the file): {removed}")
            t3 = self._turn(client, "hello three")
            self._check(failures, t3["thread_action"] == "rotated" and t3["codex_thread_id"] != thread1,
                        "turn 3 rotated to a new thread")
            notices = client.get(f"/api/sessions/{SESSION_ID}/notices/").json()
            notices = notices.get("results", notices) if isinstance(notices, dict) else notices
            texts = [n["text"] for n in notices]
            self.stdout.write(f"notices: {texts}")
            self._check(failures, texts == [NOTICE_THREAD_ROTATED], "exactly one notice with the rotation text")
            session = client.get(f"/api/sessions/{SESSION_ID}/").json()
            self._check(failures, session.get("codex_thread_id") == t3["codex_thread_id"],
                        "the session is bound to the new thread")

        self.stdout.write("")
        # `make demo-admin` serves the demo's own database even when DATABASE_URL is exported.
        self.stdout.write("Open the admin: make demo-admin (HTTP_BIND=host:port to move it from 127.0.0.1:8000), then "
                          "the address it prints (user demo, password demo) → Sessions → " + SESSION_ID)
        if failures:
            raise CommandError("demo FAILED: " + "; ".join(failures))
        self.stdout.write(self.style.SUCCESS("demo OK"))

    # -- helpers ------------------------------------------------------------------------------------

    def _client(self) -> APIClient:
        user_model = get_user_model()
        user, created = user_model.objects.get_or_create(username="demo", defaults={"is_staff": True, "is_superuser": True})
        if created:
            user.set_password("demo")
            user.save()
        Session.objects.filter(pk=SESSION_ID).delete()  # the demo starts over each run
        token, _ = Token.objects.get_or_create(user=user)
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
        return client

    def _turn(self, client: APIClient, text: str) -> dict:
        resp = client.post(f"/api/sessions/{SESSION_ID}/turns/", {"input": text}, format="json")
        if resp.status_code != 202:
            raise CommandError(f"POST turns answered {resp.status_code}: {resp.content[:500]!r}")
        turn_id = resp.json()["id"]
        deadline = time.monotonic() + self.timeout
        while True:
            turn = client.get(f"/api/turns/{turn_id}/").json()
            if turn["status"] in TERMINAL or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.stdout.write(
            f"turn {turn['seq']}: {turn['status']:<9} thread_action={turn['thread_action'] or '-':<8} "
            f"thread={turn['codex_thread_id']} final_text={turn['final_text']!r}"
            + (f" error={turn['error']!r}" if turn["error"] else "")
        )
        if turn["status"] != "succeeded":
            raise CommandError(f"turn {turn['seq']} ended {turn['status']}: {turn['error']}")
        return turn

    def _remove_rollout(self, thread_id: str) -> str:
        """Lose the thread's rollout as an operator could: the copy in PostgreSQL (the source of truth)
        and the file left in the session's home by turn 2 (each turn's home is wiped anyway)."""
        home = session_home(SESSION_ID).home
        files = list(home.glob(f"sessions/**/rollout-*-{thread_id}.jsonl"))
        if not files or rollout_forget(thread_id=thread_id) != 1:
            raise CommandError(f"no stored rollout for thread {thread_id} (PostgreSQL and {home})")
        for f in files:
            f.unlink()
        return ", ".join(["1 CodexRollout row with its chunks"] + [str(f) for f in files])

    def _check(self, failures: list[str], ok: bool, what: str) -> None:
        self.stdout.write(("  ok   " if ok else "  FAIL ") + what)
        if not ok:
            failures.append(what)
