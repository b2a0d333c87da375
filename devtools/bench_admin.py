"""``make bench-admin`` — the admin and the transcript API at a million messages, over real HTTP.

Seeds a scratch PostgreSQL database (``<DATABASE_URL's name>_bench_admin``, created, migrated and
dropped after the run) with ``--sessions`` sessions (10,000) of ``--per-session`` messages (100: a
million rows) spread over ten owners, plus one session (``bench-big``) with ``--big`` messages
(100,000) and 500 turns including a rotation; every session also gets two turns and a binding, every
hundredth (ids ending in 50) an unacknowledged notice. Rows are made by ``INSERT … SELECT generate_series`` (the message
search index is dropped during the load and rebuilt after it, then ``ANALYZE``); the seed time is
printed. Message texts are chat-like (≈ 200 characters for users, ≈ 600 for the assistant) and carry
three words from a 1,000-word vocabulary (``w0`` … ``w999``), so a searched word occurs in ≈ 0.3 % of
the rows: ≈ 3,300 matches across the database, ≈ 300 in the big session.

Then gunicorn serves the project (``project.wsgi``, 2 workers, as ``make run``) and this process times
sequential requests — an admin logged in through ``/admin/login/``, the API with a token — interleaved
round by round after warm-up rounds:

* ``sessions_list``: ``/admin/hermes_sessions/session/`` (target: median ≤ 150 ms);
* ``session_page``: the big session's admin page (≤ 200 ms);
* ``admin_search``, ``session_page_search``, ``api_search``, ``api_session_search``: a word searched in
  the admin's message search, on the big session's page, ``GET /api/messages/?q=`` and
  ``GET /api/sessions/bench-big/messages/?q=`` (≤ 300 ms each);
* ``api_transcript_first`` / ``api_transcript_deep``: the big session's transcript, first page and the
  page after ``seq`` 90,000 (no target given; printed).

Prints median and p95 per page with its target; exits 1 if a median misses its target. Not part of
``make test`` (``tests/devtools/test_bench_admin.py`` runs its pieces with tiny sizes).
Run as ``python -m devtools.bench_admin [--runs N] [--sessions N] [--per-session N] [--big N] [--keep]``.
"""
from __future__ import annotations

import argparse
import base64
import http.cookiejar
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.databases import database_beside, drop_database, recreate_database
from devtools.processes import free_port

BASE = Path(__file__).resolve().parent.parent
BIG_SESSION = "bench-big"
BIG_TURNS = 500
OWNERS = 10
ADMIN_USER, ADMIN_PASSWORD = "bench-admin", "bench-admin-password"
API_USER = "bench-api"
SEARCH_WORD = "w417"
SEARCH_INDEX = "message_content_search"

#: page → median target in ms (issue 8's acceptance); pages without one are only reported.
TARGETS_MS: dict[str, float] = {
    "sessions_list": 150,
    "session_page": 200,
    "admin_search": 300,
    "session_page_search": 300,
    "api_search": 300,
    "api_session_search": 300,
}


# --------------------------------------------------------------------------------------- seeding


#: Filler prose of every message (common words, as chat has; few distinct words, as a real vocabulary).
FILLER = "the agent read the file, ran the tests and wrote a short summary of what changed. "


def _content(n: str) -> str:
    """SQL text of a message numbered by the bigint expression ``n``: three vocabulary words (``w0``…``w999``,
    spread evenly) and filler prose to ≈ 200 (odd n, user) or ≈ 600 characters (even n, assistant)."""
    return (f"'message ' || {n} || ': w' || ({n} * 7919 %% 1000) || ' w' || ({n} * 104729 %% 1000) || ' w' || "
            f"({n} * 1299709 %% 1000) || ' ' || repeat('{FILLER}', CASE WHEN {n} %% 2 = 1 THEN 2 ELSE 7 END)")


MESSAGE_COLUMNS = "session_id, seq, turn_id, role, content, tool_calls, tool_call_id, reasoning, codex_item_id, created_at"
TURN_COLUMNS = ("id, session_id, seq, status, input, thread_action, codex_thread_id, codex_turn_id, codex_methods, "
                "final_text, error, usage, timings, attempt, created_at, started_at, finished_at")


def _turn_select(t: str, at: str, action: str) -> str:
    """SELECT list of a succeeded turn numbered ``t`` of session ``s`` started at ``at`` (SQL expressions)."""
    return (f"gen_random_uuid(), s.id, {t}, 'succeeded', 'input ' || {t} || ' w' || ({t} * 7919 %% 1000), {action}, "
            f"'thread-' || s.id, 'turn-' || {t}, '[]'::jsonb, 'reply ' || {t}, '', "
            f"jsonb_build_object('input_tokens', 1000 + {t}, 'output_tokens', 50, 'total_tokens', 1050 + {t}), "
            f"'{{}}'::jsonb, 1, {at}, {at}, {at} + interval '1.5 seconds'")


@dataclass(frozen=True)
class SeedSizes:
    """How much ``seed`` makes: ``sessions`` × ``per_session`` messages, plus ``big`` in ``bench-big``."""

    sessions: int = 10_000
    per_session: int = 100
    big: int = 100_000


def seed(cursor: Any, *, owner_ids: list[int], sizes: SeedSizes) -> dict[str, float]:
    """Fill an empty, migrated database through ``cursor`` (a DB-API cursor on it; the caller commits).
    ``owner_ids[0]`` owns ``bench-big`` and every tenth session. Returns seconds per step."""
    steps: dict[str, float] = {}

    def step(name: str, sql: str, params: dict[str, Any] | None = None) -> None:
        t0 = time.monotonic()
        cursor.execute(sql, params or {})
        steps[name] = steps.get(name, 0.0) + time.monotonic() - t0

    # Foreign keys are DEFERRABLE INITIALLY DEFERRED: checked per statement instead, so no trigger
    # events are pending when the search index is built inside the same transaction.
    cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
    p = {"owners": owner_ids, "n_owners": len(owner_ids), "sessions": sizes.sessions, "per": sizes.per_session,
         "big": sizes.big, "big_id": BIG_SESSION, "big_turns": BIG_TURNS}
    step("sessions", """
        INSERT INTO hermes_sessions_session (id, owner_id, title, model_config, last_message_seq, last_turn_seq,
                                             created_at, updated_at)
        SELECT 'bench-s-' || lpad(g::text, 6, '0'), (%(owners)s::int[])[1 + g %% %(n_owners)s], 'bench session ' || g,
               '{}'::jsonb, %(per)s, 2, now() - make_interval(secs => g * 60 + 86400), now() - make_interval(secs => g * 60)
        FROM generate_series(1, %(sessions)s) AS g
        UNION ALL
        SELECT %(big_id)s, (%(owners)s::int[])[1], 'the 100,000-message session', '{}'::jsonb, %(big)s, %(big_turns)s,
               now() - interval '30 days', now() - interval '30 seconds'""", p)
    cursor.execute("SELECT pg_get_indexdef(%s::regclass)", [SEARCH_INDEX])
    index_sql = cursor.fetchone()[0]
    cursor.execute(f"DROP INDEX {SEARCH_INDEX}")  # built once after the load: far faster than row by row
    step("messages", f"""
        INSERT INTO hermes_sessions_message ({MESSAGE_COLUMNS})
        SELECT 'bench-s-' || lpad(((n - 1) / %(per)s + 1)::text, 6, '0'), (n - 1) %% %(per)s + 1, NULL,
               CASE WHEN n %% 2 = 1 THEN 'user' ELSE 'assistant' END, {_content('n')}, NULL, '', '', '',
               now() - ((n - 1) / %(per)s + 1) * interval '1 minute' + ((n - 1) %% %(per)s) * interval '100 milliseconds'
        FROM generate_series(1::bigint, %(sessions)s::bigint * %(per)s) AS n""", p)
    step("messages", f"""
        INSERT INTO hermes_sessions_message ({MESSAGE_COLUMNS})
        SELECT %(big_id)s, n, NULL, CASE WHEN n %% 2 = 1 THEN 'user' ELSE 'assistant' END,
               {_content('(n + 10000000)')}, NULL, '', '', '', now() - make_interval(secs => (%(big)s - n) * 20)
        FROM generate_series(1::bigint, %(big)s::bigint) AS n""", p)
    step("turns", f"""
        INSERT INTO hermes_sessions_turn ({TURN_COLUMNS})
        SELECT {_turn_select('t', "s.created_at + make_interval(secs => t * 600)", "CASE WHEN t = 1 THEN 'started' ELSE 'resumed' END")}
        FROM hermes_sessions_session s CROSS JOIN generate_series(1, 2) AS t WHERE s.id <> %(big_id)s""", p)
    step("turns", f"""
        INSERT INTO hermes_sessions_turn ({TURN_COLUMNS})
        SELECT {_turn_select('t', "now() - make_interval(secs => (%(big_turns)s - t) * 3600 + 60)",
                             "CASE WHEN t = 1 THEN 'started' WHEN t = 250 THEN 'rotated' ELSE 'resumed' END")}
        FROM hermes_sessions_session s CROSS JOIN generate_series(1, %(big_turns)s) AS t WHERE s.id = %(big_id)s""", p)
    step("bindings_notices", """
        INSERT INTO hermes_sessions_codexbinding (session_id, thread_id, status, created_at, ended_at, ended_reason)
        SELECT id, 'thread-' || id, 'active', created_at, NULL, '' FROM hermes_sessions_session
        UNION ALL
        SELECT %(big_id)s, 'thread-lost-before-turn-250', 'ended', now() - interval '30 days',
               now() - make_interval(secs => 250 * 3600 + 60), 'codex could not resume the thread: no rollout found'""", p)
    step("bindings_notices", """
        INSERT INTO hermes_sessions_notice (session_id, kind, text, created_at)
        SELECT id, 'lifecycle', 'Codex thread could not be resumed; starting a new one.', updated_at
        FROM hermes_sessions_session
        WHERE id = %(big_id)s OR right(id, 2) = '50'""", p)
    cursor.execute("SET maintenance_work_mem = '256MB'")
    step("search_index", index_sql)
    step("analyze", "ANALYZE")
    return steps


# --------------------------------------------------------------------------------------- figures


def percentile(samples: list[float], fraction: float) -> float:
    """The ``fraction`` (0…1) percentile of ``samples`` by the nearest-rank method; raises ``ValueError`` when empty."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), math.ceil(fraction * len(ordered))))
    return ordered[rank - 1]


def summarize(samples_ms: dict[str, list[float]]) -> list[tuple[str, float, float, float | None, bool]]:
    """One row per page: ``(page, median ms, p95 ms, target ms or None, met)``; ``met`` is True without a target."""
    rows = []
    for page, samples in samples_ms.items():
        median, p95 = statistics.median(samples), percentile(samples, 0.95)
        target = TARGETS_MS.get(page)
        rows.append((page, median, p95, target, target is None or median <= target))
    return rows


def report(rows: list[tuple[str, float, float, float | None, bool]]) -> str:
    """The printed table, one line per page."""
    lines = [f"{'page':24} {'median_ms':>10} {'p95_ms':>9} {'target_ms':>10}  result"]
    for page, median, p95, target, met in rows:
        lines.append(f"{page:24} {median:10.1f} {p95:9.1f} {('≤ %d' % target) if target else '—':>10}  "
                     f"{'ok' if met else 'MISSED'}")
    return "\n".join(lines)


def drf_cursor(position: int) -> str:
    """A DRF ``CursorPagination`` cursor starting after ``position`` (the encoding of
    ``rest_framework.pagination.CursorPagination.encode_cursor``: base64 of ``p=<position>``)."""
    return base64.b64encode(urllib.parse.urlencode({"p": str(position)}).encode("ascii")).decode("ascii")


def pages(big_session: str = BIG_SESSION, word: str = SEARCH_WORD, deep_after: int = 90_000) -> dict[str, tuple[str, str, str]]:
    """page → (``admin`` or ``api``, path, a marker its body must contain) — a login page or an empty
    result must not be timed as if it were the page."""
    admin_page = f"/admin/hermes_sessions/session/{big_session}/change/"
    return {
        "sessions_list": ("admin", "/admin/hermes_sessions/session/", 'class="field-unacknowledged_notices"'),
        "session_page": ("admin", admin_page, 'class="transcript-row'),
        "admin_search": ("admin", f"/admin/hermes_sessions/message/?q={word}", 'class="message-result"'),
        "session_page_search": ("admin", f"{admin_page}?q={word}", 'class="transcript-row'),
        "api_search": ("api", f"/api/messages/?q={word}", '"session":'),
        "api_session_search": ("api", f"/api/sessions/{big_session}/messages/?q={word}", '"seq":'),
        "api_transcript_first": ("api", f"/api/sessions/{big_session}/messages/", '"seq":'),
        "api_transcript_deep": ("api", f"/api/sessions/{big_session}/messages/?cursor="
                                f"{urllib.parse.quote(drf_cursor(deep_after))}", f'"seq":{deep_after + 1},'),
    }


# --------------------------------------------------------------------------------------- HTTP


class Clients:
    """An admin browser (cookies, logged in through the login form) and an API client (token)."""

    def __init__(self, base: str, token: str):
        self.base = base
        self.admin = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
        self.token = token

    def login(self) -> None:
        """Log in as the admin through ``/admin/login/`` (waits up to ~20 s for the server)."""
        for _ in range(200):
            try:
                self.admin.open(f"{self.base}/admin/login/", timeout=10).read()
                break
            except OSError:
                time.sleep(0.1)
        jar = next(h for h in self.admin.handlers if isinstance(h, urllib.request.HTTPCookieProcessor)).cookiejar
        csrf = next(c.value for c in jar if c.name == "csrftoken")
        body = urllib.parse.urlencode({"csrfmiddlewaretoken": csrf, "username": ADMIN_USER, "password": ADMIN_PASSWORD,
                                       "next": "/admin/"}).encode()
        html = self.admin.open(f"{self.base}/admin/login/", data=body, timeout=30).read().decode()
        if 'id="unacknowledged-notice-count"' not in html:
            raise RuntimeError("admin login failed (no admin index after the login form)")

    def get(self, kind: str, path: str, marker: str) -> float:
        """Milliseconds for one GET of ``path`` (status 200, body read, ``marker`` in it)."""
        if kind == "admin":
            opener, req = self.admin, urllib.request.Request(self.base + path)
        else:
            opener = urllib.request.build_opener()
            req = urllib.request.Request(self.base + path, headers={"Authorization": f"Token {self.token}"})
        t0 = time.perf_counter()
        with opener.open(req, timeout=60) as resp:
            body = resp.read().decode()
            status = resp.status
        elapsed = (time.perf_counter() - t0) * 1000
        if status != 200 or marker not in body:
            raise RuntimeError(f"GET {path}: status {status}, {marker!r} not in the body: {body[:300]!r}")
        return elapsed


def measure(clients: Clients, runs: int, warmup: int = 3) -> dict[str, list[float]]:
    """``runs`` timed rounds (after ``warmup`` untimed ones), each GETting every page once in turn."""
    targets = pages()
    samples: dict[str, list[float]] = {name: [] for name in targets}
    for round_no in range(warmup + runs):
        for name, (kind, path, marker) in targets.items():
            ms = clients.get(kind, path, marker)
            if round_no >= warmup:
                samples[name].append(ms)
    return samples


# --------------------------------------------------------------------------------------- the run


def _setup(db_url: str) -> tuple[str, dict[str, float]]:
    """Create, migrate and seed the scratch database in this process; returns the API token and seed steps."""
    os.environ["DATABASE_URL"] = db_url
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection, transaction
    from rest_framework.authtoken.models import Token

    call_command("migrate", verbosity=0)
    users = get_user_model()
    users.objects.create_superuser(ADMIN_USER, "admin@example.com", ADMIN_PASSWORD)
    api_user = users.objects.create_user(API_USER)
    owners = [api_user.pk] + [users.objects.create_user(f"bench-owner-{i}").pk for i in range(1, OWNERS)]
    with transaction.atomic(), connection.cursor() as cursor:
        steps = seed(cursor, owner_ids=owners, sizes=_SIZES)
    connection.close()
    return Token.objects.create(user=api_user).key, steps


_SIZES = SeedSizes()


def _start_server(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([str(BASE / ".venv/bin/gunicorn"), "project.wsgi", "--bind", f"127.0.0.1:{port}",
                             "--workers", "2", "--log-level", "warning"], cwd=BASE, env=env)
    return proc, f"http://127.0.0.1:{port}"


def _counts(db_url: str) -> str:
    import psycopg

    with psycopg.connect(db_url) as conn:
        row = conn.execute("SELECT (SELECT count(*) FROM hermes_sessions_session), (SELECT count(*) FROM hermes_sessions_message), "
                           "(SELECT count(*) FROM hermes_sessions_turn), (SELECT count(*) FROM hermes_sessions_message "
                           "WHERE to_tsvector('simple', coalesce(content, '')) @@ websearch_to_tsquery('simple', %s)), "
                           "pg_size_pretty(pg_relation_size(%s::regclass))", [SEARCH_WORD, SEARCH_INDEX]).fetchone()
    assert row is not None
    return (f"{row[0]:,} sessions, {row[1]:,} messages, {row[2]:,} turns; {SEARCH_WORD!r} in {row[3]:,} messages; "
            f"search index {row[4]}")


def main(argv: list[str] | None = None) -> int:
    """Seed, serve, time; print the table; 1 if a median misses its target."""
    global _SIZES
    parser = argparse.ArgumentParser(prog="python -m devtools.bench_admin", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=SeedSizes.sessions)
    parser.add_argument("--per-session", type=int, default=SeedSizes.per_session)
    parser.add_argument("--big", type=int, default=SeedSizes.big)
    parser.add_argument("--keep", action="store_true", help="keep the scratch database (its URL is printed)")
    args = parser.parse_args(argv)
    db_url = os.environ.get("DATABASE_URL", "")
    if not db_url.startswith("postgres"):
        sys.exit("make bench-admin needs DATABASE_URL=postgres://… (the Makefile sets it)")
    if args.big <= 90_001:
        sys.exit("--big must exceed 90,001 (the deep transcript page starts after seq 90,000)")
    _SIZES = SeedSizes(args.sessions, args.per_session, args.big)
    bench_url = database_beside(db_url, "_bench_admin")
    recreate_database(bench_url)
    server = None
    try:
        t0 = time.monotonic()
        token, steps = _setup(bench_url)
        print(f"seed_s: {time.monotonic() - t0:.1f}  (" + ", ".join(f"{k} {v:.1f}" for k, v in steps.items()) + ")")
        print(f"seeded: {_counts(bench_url)}")
        env = {**os.environ, "DATABASE_URL": bench_url, "HERMES_LOG_LEVEL": "WARNING"}
        env.pop("CELERY_BROKER_URL", None)
        server, base = _start_server(env)
        clients = Clients(base, token)
        clients.login()
        load_before = os.getloadavg()[0]
        rows = summarize(measure(clients, args.runs))
        print(f"runs: {args.runs} per page (sequential, interleaved; gunicorn 2 sync workers); load average "
              f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
        print(report(rows))
        return 0 if all(met for *_, met in rows) else 1
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=15)
        if args.keep:
            print(f"kept: {bench_url}")
        else:
            drop_database(bench_url)


if __name__ == "__main__":
    sys.exit(main())
