"""``make bench-approvals``' pure parts: reading ``/proc`` and ``pg_stat_activity`` into figures, without the stack."""
from __future__ import annotations

from collections import Counter

from devtools.bench_approvals import (
    Connections,
    Holdings,
    cpu_ticks,
    held_figures,
    pending_reason,
    query_label,
    session_of_home,
)
from hermes_sessions.worker.warm.process_memory import Memory


def test_session_of_home_names_only_a_session_home_under_the_root():
    assert session_of_home("/tmp/b/homes/sess-1/home", "/tmp/b/homes") == "sess-1"
    assert session_of_home("/tmp/b/codex_home", "/tmp/b/homes") is None  # the shared CODEX_HOME
    assert session_of_home("/tmp/b/homes/sess-1/user_home", "/tmp/b/homes") is None
    assert session_of_home("/elsewhere/sess-1/home", "/tmp/b/homes") is None
    assert session_of_home("", "/tmp/b/homes") is None


def test_cpu_ticks_counts_fields_after_a_command_name_with_spaces_and_parentheses():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime …
    stat = "4242 (celery (x) y) S 1 4242 4242 0 -1 4194560 100 0 0 0 37 5 0 0 20 0 3"
    assert cpu_ticks(stat) == 42
    assert cpu_ticks("") == 0


def test_query_label_is_the_verb_and_the_first_table():
    assert query_label('SELECT "hermes_sessions_approval"."id" FROM "hermes_sessions_approval" WHERE id = 1') \
        == "SELECT hermes_sessions_approval"
    assert query_label('UPDATE "hermes_sessions_turn" SET lease_expires_at = now()') == "UPDATE hermes_sessions_turn"
    assert query_label("INSERT INTO hermes_sessions_turnevent (kind) VALUES ('x')") == "INSERT hermes_sessions_turnevent"
    assert query_label('LISTEN "hermes_wake_ab"') == "LISTEN"
    assert query_label("  ") == "none"


def test_connections_are_counted_by_the_process_holding_their_port():
    rows = [(5001, "idle", "SELECT 1 FROM hermes_sessions_approval"), (5002, "idle", "COMMIT"),
            (5003, "active", "UPDATE hermes_sessions_turn SET x = 1"), (None, None, None)]
    c = Connections.of(rows, {5001: "worker_pool", 5002: "worker_pool", 5003: "api"})
    assert c.by_role == Counter({"worker_pool": 2, "api": 1, "other": 1})
    assert c.by_state["worker_pool/idle"] == 2 and c.by_state["other/none"] == 1
    assert c.queries_of("worker_pool") == "SELECT hermes_sessions_approval=1, COMMIT=1"


def test_pending_reason_says_when_the_slots_are_all_held():
    assert pending_reason(pending=20, target=20, running=20, queued=0, slots=32) == "all asked"
    assert "every worker slot (2)" in pending_reason(pending=2, target=20, running=2, queued=18, slots=2)
    assert "had not asked yet" in pending_reason(pending=3, target=20, running=5, queued=0, slots=32)


def test_held_figures_are_the_waiting_sample_against_the_idle_one_per_pending_approval():
    pool = Counter({"worker_pool": 4, "api": 2})
    idle = Holdings(pool_threads=6, pool_private_kb=40_000, connections=Connections(by_role=pool))
    waiting = Holdings(
        pending=2, pool_threads=14, pool_private_kb=46_000,
        app_servers=[("w-1", Memory(22_000, 50_000, 150_000)), ("w-2", Memory(24_000, 52_000, 148_000)),
                     ("other", Memory(30_000, 60_000, 160_000)), (None, Memory(1, 1, 1))],
        connections=Connections(by_role=Counter({"worker_pool": 8, "api": 2})))
    f = held_figures(idle, waiting, {"w-1", "w-2"})
    assert f["app_servers_alive"] == 4 and f["app_servers_of_waiting_turns"] == 2
    assert f["app_server_private_kb_median"] == 23_000 and f["app_servers_private_kb_total"] == 46_000
    assert f["app_server_pss_kb_median"] == 51_000 and f["app_server_rss_kb_median"] == 149_000
    assert f["pool_threads_per_waiting_turn"] == 4.0
    assert f["pool_private_kb_per_waiting_turn"] == 3_000.0
    assert f["pg_connections_idle"] == 6 and f["pg_connections_waiting"] == 10
    assert f["pg_connections_per_waiting_turn"] == 2.0
    assert held_figures(idle, Holdings(), set())["pg_connections_per_waiting_turn"] == 0.0  # nothing waited
