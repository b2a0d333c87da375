#!/usr/bin/env python3
"""Apply each deliberate breakage in ``BREAKAGES`` to a temporary copy of the repository and check
that the fast tests named for it fail. See BREAKAGES.md (beside this file) for how to run it.

Each breakage is a textual ``(path, old, new)`` replacement; ``old`` must occur exactly once in
``path``, and a Python file must still compile after it, or the breakage is reported STALE (the code
moved: update the entry) rather than skipped.
Before the breakages, the named tests run once on an unbroken copy (the baseline) and must pass —
otherwise a "caught" would prove nothing. Each breakage's run records, in every process it starts
(``line_probe.py``), whether the edited lines ran: a row whose edited lines no test executed (code
that runs only on another database, say) is N/A — the breakage changed nothing the tests ran, so a
failure there is not its catch. Exit status 1 if the baseline fails, or any breakage survived, timed
out, is stale or not applicable.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
T = "tests/invariants/"


@dataclass(frozen=True)
class Breakage:
    id: str
    invariant: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


BREAKAGES: list[Breakage] = [
    # --- I1 durable before bound -----------------------------------------------------------------
    Breakage(
        "bind-at-thread-start", "I1", "hermes_sessions/services/turns.py",
        "        Turn.objects.filter(pk=turn_id, claim_token=token, status=Turn.Status.RUNNING).update(\n"
        "            codex_thread_id=clean_text(thread_id, max_chars=64)\n        )\n",
        "        Turn.objects.filter(pk=turn_id, claim_token=token, status=Turn.Status.RUNNING).update(\n"
        "            codex_thread_id=clean_text(thread_id, max_chars=64)\n        )\n"
        "        session, turn = lock_session_and_turn(turn_id)\n"
        "        bindings.binding_publish(session=session, turn=turn, thread_id=thread_id, resumed=False)\n",
        (T + "test_i1_durable_before_bound.py::test_a_first_turn_that_dies_after_thread_start_binds_nothing",),
    ),
    Breakage(
        "bind-thread-without-a-turn", "I1", "hermes_sessions/services/turns.py",
        "    bind = result.status is not None and bool(result.thread_id and result.codex_turn_id)\n",
        "    bind = bool(result.thread_id)\n",
        (T + "test_i1_durable_before_bound.py::test_a_thread_started_then_cancelled_before_turn_start_is_not_bound",),
    ),
    Breakage(
        "fail-binds", "I1", "hermes_sessions/services/turns.py",
        "status=Turn.Status.FAILED, error=reason, bind=False)",
        "status=Turn.Status.FAILED, error=reason, bind=bool(result and result.thread_id))",
        (T + "test_i1_durable_before_bound.py::test_a_failed_turn_binds_nothing_even_if_codex_ran_it",),
    ),
    Breakage(
        "bind-in-its-own-transaction", "I1", "hermes_sessions/services/turns.py",
        "        session, turn = locked\n"
        "        if result.approvals:",
        "        session, turn = locked\n"
        "        if bind and result.thread_action != Turn.ThreadAction.RESUMED:  # publish (and commit) the binding\n"
        "            bindings.binding_publish(session=session, turn=turn, thread_id=result.thread_id, resumed=False)\n"
        "    with pipelined_atomic(durable=True) as batch:  # the rest: the second publish below finds it done\n"
        "        session, turn = _lock_claimed(turn_id, token)\n"
        "        if result.approvals:",
        (T + "test_i1_durable_before_bound.py::test_rows_binding_notice_and_state_commit_together_or_not_at_all",),
    ),
    Breakage(
        "failed-rotation-keeps-dead-binding", "I1", "hermes_sessions/services/turns.py",
        "        if result.rotated_from and bindings.binding_rotate(",
        "        if result.rotated_from and bind and bindings.binding_rotate(",
        (T + "test_i1_durable_before_bound.py::test_a_failed_turn_after_codex_proved_the_thread_gone_ends_the_dead_binding_once",),
    ),
    # --- I2 exactly once -------------------------------------------------------------------------
    Breakage(
        "fence-finalize-fail-requeue", "I2", "hermes_sessions/services/turns.py",
        "    if locked[1].status != Turn.Status.RUNNING or locked[1].claim_token != token:\n",
        "    if locked[1].status != Turn.Status.RUNNING:\n",
        (T + "test_i2_claim_fence.py::test_a_stale_claim_commits_nothing_while_the_turn_runs_under_another",),
    ),
    Breakage(
        "fence-heartbeat", "I2", "hermes_sessions/services/turns.py",
        "    held = Turn.objects.filter(pk=turn_id, claim_token=token, status=Turn.Status.RUNNING).update(\n",
        "    held = Turn.objects.filter(pk=turn_id, status=Turn.Status.RUNNING).update(\n",
        (T + "test_i2_claim_fence.py::test_a_stale_heartbeat_neither_renews_the_lease_nor_relays_a_cancel",),
    ),
    Breakage(
        "fence-stream-events", "I2", "hermes_sessions/sql/queries.sql",
        'WHERE "id" = %(session)s FOR NO KEY UPDATE),\nc AS (SELECT t."id", t."attempt", t."session_id" FROM "hermes_sessions_turn" t JOIN l ON t."session_id" =\n    l."id" WHERE t."id" = %(turn)s AND t."claim_token" = %(token)s AND t."status" = %(running)s FOR SHARE OF\n    t),',
        'WHERE "id" = %(session)s FOR NO KEY UPDATE),\nc AS (SELECT t."id", t."attempt", t."session_id" FROM "hermes_sessions_turn" t JOIN l ON t."session_id" =\n    l."id" WHERE t."id" = %(turn)s),',
        ("tests/services/test_turn_events.py::test_a_fenced_out_worker_appends_no_event",),
    ),
    Breakage(
        "claim-a-running-turn", "I2", "hermes_sessions/sql/queries.sql",
        'ok AS (SELECT me.* FROM me CROSS JOIN blk WHERE me."status" = %(queued)s AND',
        'ok AS (SELECT me.* FROM me CROSS JOIN blk WHERE me."status" IN (%(queued)s, %(running)s) AND',
        (T + "test_i2_exactly_once.py::test_a_second_claim_of_a_running_turn_is_refused",),
    ),
    Breakage(
        "user-row-per-claim", "I2", "hermes_sessions/sql/queries.sql",
        'FROM ok WHERE ok."attempt" = 0 OR',
        'FROM ok WHERE TRUE OR ok."attempt" = 0 OR',
        (T + "test_i2_exactly_once.py::test_a_reclaimed_turn_keeps_one_user_row",),
    ),
    Breakage(
        "no-unique-message-seq", "I2", "hermes_sessions/migrations/0001_initial.py",
        "constraint=models.UniqueConstraint(fields=('session', 'seq'), name='message_unique_session_seq'),",
        "constraint=models.CheckConstraint(condition=models.Q(seq__gte=0), name='message_unique_session_seq'),",
        (T + "test_i2_exactly_once.py::test_the_database_refuses_duplicate_effects",),
    ),
    Breakage(
        "one-active-binding-per-thread-only", "I2", "hermes_sessions/migrations/0001_initial.py",
        "fields=('session',), name='binding_one_active_per_session'",
        "fields=('session', 'thread_id'), name='binding_one_active_per_session'",
        (T + "test_i2_exactly_once.py::test_the_database_refuses_duplicate_effects",),
    ),
    Breakage(
        "rotation-two-notices", "I2", "hermes_sessions/services/bindings.py",
        "    CodexBinding.objects.create(\n",
        "    if CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ENDED).exists():  # publish notes it too\n"
        "        Notice.objects.create(session=session, turn=turn, kind=Notice.Kind.LIFECYCLE, text=NOTICE_THREAD_ROTATED)\n"
        "    CodexBinding.objects.create(\n",
        ("tests/services/test_seed_scenario.py::test_dead_thread_rotates_once_with_notice",),
    ),
    # --- I3 one turn at a time -------------------------------------------------------------------
    Breakage(
        "session-row-not-locked", "I3", "hermes_sessions/sql/queries.sql",
        '"hermes_sessions_turn" WHERE "id" = %(turn)s) FOR UPDATE) SELECT',
        '"hermes_sessions_turn" WHERE "id" = %(turn)s)) SELECT',
        (T + "test_i3_one_turn_at_a_time.py::test_the_claim_lock_holds_the_session_row",),
    ),
    Breakage(
        "claim-beside-a-running-turn", "I3", "hermes_sessions/sql/queries.sql",
        'AND (o."status" = %(running)s OR ',
        'AND (o."status" = \'no such status\' OR ',
        (T + "test_i3_one_turn_at_a_time.py::test_claim_refuses_a_second_turn_while_one_runs",),
    ),
    Breakage(
        "claim-out-of-order", "I3", "hermes_sessions/sql/queries.sql",
        'OR (o."status" = %(queued)s AND o."seq" <',
        'OR (false AND o."seq" <',
        (T + "test_i3_one_turn_at_a_time.py::test_claim_refuses_a_later_turn_while_an_earlier_one_is_queued",),
    ),
    Breakage(
        "session-locked-while-codex-works", "I3", "hermes_sessions/worker/execution.py",
        "                outcome = drive_turn(client, spec)\n",
        # A connection of its own holds the session row in an open transaction while codex runs the turn
        # (the worker's connection cannot: its durable writes while codex works refuse an open one).
        "                from django.db import connections\n"
        "                locker = connections.create_connection(\"default\")\n"
        "                locker.set_autocommit(False)\n"
        "                locker.cursor().execute(\"SELECT 1 FROM hermes_sessions_session WHERE id = %s FOR UPDATE\", [claim.session_id])\n"
        "                try:\n"
        "                    outcome = drive_turn(client, spec)\n"
        "                finally:\n"
        "                    locker.close()\n",
        (T + "test_i3_one_turn_at_a_time.py::test_no_row_lock_is_held_while_codex_works",),
    ),
    # --- I4 every wait ends ----------------------------------------------------------------------
    Breakage(
        "request-deadline-infinite", "I4", "hermes_sessions/codex/client.py",
        "        timeout = self._request_timeout if timeout is None else timeout\n"
        "        deadline = time.monotonic() + timeout\n",
        "        timeout = self._request_timeout if timeout is None else timeout\n"
        "        deadline = time.monotonic() + 86400.0\n",
        (T + "test_i4_every_wait_ends.py::test_a_request_to_a_silent_app_server_times_out_at_its_deadline",),
    ),
    Breakage(
        "eof-fails-nothing", "I4", "hermes_sessions/codex/client.py",
        '            if not line:\n                self._fail("closed its stdout (EOF)")\n                return\n',
        "            if not line:\n                return\n",
        (T + "test_i4_every_wait_ends.py::test_stdout_eof_fails_every_pending_request_at_once",),
    ),
    Breakage(
        "turn-deadline-infinite", "I4", "hermes_sessions/codex/runner.py",
        "    deadline = time.monotonic() + spec.turn_timeout\n",
        "    deadline = time.monotonic() + 86400.0\n",
        (T + "test_i4_every_wait_ends.py::test_a_turn_whose_completion_never_comes_ends_failed_with_a_reason",),
    ),
    Breakage(
        "retry-deadline-ignored", "I4", "hermes_sessions/worker/retry_policy.py",
        "        if elapsed + delay > self.deadline:\n            return None\n",
        "",
        ("tests/services/test_retry_policy.py::test_the_deadline_ends_a_claims_retries_early",),
    ),
    # --- I5 our transcript is the source of truth --------------------------------------------------
    Breakage(
        "resume-rewrites-transcript", "I5", "hermes_sessions/services/turns.py",
        "        _append_messages(session, turn, result.messages, batch=batch)\n",
        "        if result.thread_action == Turn.ThreadAction.RESUMED:  # take codex's word for the earlier turns\n"
        "            Message.objects.filter(session=session, role=Message.Role.ASSISTANT).exclude(turn=turn)"
        ".update(content=result.final_text)\n"
        "        _append_messages(session, turn, result.messages, batch=batch)\n",
        (T + "test_i5_transcript_source_of_truth.py::test_resume_and_adoption_never_rewrite_earlier_rows",),
    ),
    # --- design §3.3 rotation only on a thread codex cannot hand back -----------------------------
    Breakage(
        "no-rollout-is-not-thread-gone", "§3.3", "hermes_sessions/codex/errors.py",
        '    ("no rollout found for thread id ", "", ThreadGone),\n',
        '    ("no rollout found for thread id ", "", ThreadBusy),\n',
        ("tests/codex/test_errors.py::test_error_from_response_types_each_observed_answer",),
    ),
    # --- I6 bad input ----------------------------------------------------------------------------
    Breakage(
        "no-input-length-limit", "I6", "hermes_sessions/services/turns.py",
        "    if len(text) > MAX_INPUT_CHARS:\n",
        "    if False:\n",
        (T + "test_i6_bad_input.py::test_bad_turn_input_is_400_and_writes_nothing",
         T + "test_i6_bad_input.py::test_the_service_refuses_input_over_the_limit_and_writes_nothing"),
    ),
    Breakage(
        "nul-in-query-string-passes", "I6", "hermes_sessions/middleware.py",
        ' or "%00" in query',
        "",
        (T + "test_i6_bad_input.py::test_nul_bytes_in_the_url_are_400_and_write_nothing",),
    ),
    Breakage(
        "input-not-cleaned", "I6", "hermes_sessions/services/turns.py",
        "    text = clean_text(input_text)\n",
        "    text = input_text\n",
        (T + "test_i6_bad_input.py::test_nul_bytes_in_input_are_stored_replaced_not_a_500",),
    ),
    # --- I7 isolation ----------------------------------------------------------------------------
    Breakage(
        "session-get-unscoped", "I7", "hermes_sessions/selectors.py",
        "    return session_list(user=user).get(pk=session_id)\n",
        "    return _annotate_sessions(Session.objects.all()).get(pk=session_id)\n",
        (T + "test_i7_isolation.py::test_another_users_session_is_404_everywhere_and_cannot_be_driven",),
    ),
    Breakage(
        "session-owned-unscoped", "I7", "hermes_sessions/selectors.py",
        "    return Session.objects.get(pk=session_id, owner_id=user.pk)\n",
        "    return Session.objects.get(pk=session_id)\n",
        (T + "test_i7_isolation.py::test_another_users_session_is_404_everywhere_and_cannot_be_driven",
         T + "test_i7_isolation.py::test_the_plain_session_lookups_find_only_the_owners_session"),
    ),
    Breakage(
        "session-stream-unscoped", "I7", "hermes_sessions/selectors.py",
        "Session.objects.filter(pk=session_id, owner_id=user.pk).exists()\n",
        "Session.objects.filter(pk=session_id).exists()\n",
        (T + "test_i7_isolation.py::test_the_plain_session_lookups_find_only_the_owners_session",),
    ),
    Breakage(
        "turn-get-unscoped", "I7", "hermes_sessions/selectors.py",
        "    return with_waiting(Turn.objects.filter(session__owner_id=user.pk)).get(pk=pk)\n",
        "    return with_waiting(Turn.objects.all()).get(pk=pk)\n",
        (T + "test_i7_isolation.py::test_another_users_session_is_404_everywhere_and_cannot_be_driven",),
    ),
    Breakage(
        "sandbox-writes-beside-the-session", "I7", "hermes_sessions/codex/launch.py",
        '        table[str(workdir)] = "read" if sandbox == "read-only" else "write"\n',
        '        table[str(workdir)] = "read" if sandbox == "read-only" else "write"\n'
        '        if sandbox == "workspace-write":  # the work root, i.e. every session\'s directory\n'
        '            table[str(workdir.parent)] = "write"\n',
        (T + "test_i7_isolation.py::test_each_session_runs_codex_in_its_own_directory_and_may_write_only_there",),
    ),
    # --- design §3.5 history seed cap --------------------------------------------------------------
    Breakage(
        "seed-tail-cap-removed", "§3.5", "hermes_sessions/history_seed.py",
        "        if used + cost > budget:\n",
        "        if False:\n",
        (T + "test_history_seed_cap.py::test_the_default_cap_bounds_the_whole_seed_marker_included",),
    ),
    Breakage(
        "seed-marker-not-counted", "§3.5", "hermes_sessions/history_seed.py",
        "    budget = cap - len(head)  # for the kept blocks and the separators between them\n",
        "    budget = cap - len(HEADER) - 2\n",
        (T + "test_history_seed_cap.py::test_the_default_cap_bounds_the_whole_seed_marker_included",),
    ),
    Breakage(
        "seed-service-ignores-cap", "§3.5", "hermes_sessions/services/turns.py",
        "    return render_history_seed(rows",
        "    return render_history_seed(rows, max_chars=10**9",
        (T + "test_history_seed_cap.py::test_the_service_seed_uses_the_configured_cap",),
    ),
    # --- I8 the database holds the whole session -------------------------------------------------
    Breakage(
        "rollout-not-stored", "I8", "hermes_sessions/services/turns.py",
        "            rollouts.rollout_store(session=session, delta=result.rollout, codex_version=result.codex_version)\n",
        "            pass  # the rollout stays on the worker's disk\n",
        ("tests/services/test_rollouts.py::test_a_wiped_disk_loses_nothing",),
    ),
    Breakage(
        "rollout-generation-not-fenced", "I8", "hermes_sessions/sql/queries.sql",
        '    WHERE "thread_id" = %(thread)s AND "generation" = %(generation)s AND "length" = %(base_length)s AND\n    "sha256" = %(base_sha256)s RETURNING "id") INSERT',
        '    WHERE "thread_id" = %(thread)s RETURNING "id") INSERT',
        ("tests/services/test_rollouts.py::test_a_stale_generation_commits_nothing",),
    ),
    Breakage(
        "rollout-fence-bytes-only", "I8", "hermes_sessions/sql/queries.sql",
        '    WHERE "thread_id" = %(thread)s AND "generation" = %(generation)s AND "length" = %(base_length)s AND\n    "sha256" = %(base_sha256)s RETURNING "id") INSERT',
        '    WHERE "thread_id" = %(thread)s AND "length" = %(base_length)s AND\n    "sha256" = %(base_sha256)s RETURNING "id") INSERT',
        ("tests/services/test_rollouts.py::test_a_stale_generation_commits_nothing_when_the_other_writer_appended_nothing",),
    ),
    # --- I9 a person's decision applies once (docs/contract.md §10) ----------------------------------
    Breakage(
        "approval-decided-twice", "I9", "hermes_sessions/services/approvals.py",
        "        if not approval.is_pending:\n            raise ApprovalClosed(f\"approval already {approval.status}\", approval=approval)\n",
        "",
        ("tests/api/test_approvals.py::test_accept_decides_once_and_a_second_decision_is_409",),
    ),
    Breakage(
        "approval-decision-not-offered", "I9", "hermes_sessions/services/approvals.py",
        "    if decision not in available:\n",
        "    if False:\n",
        ("tests/api/test_approvals.py::test_a_decision_not_offered_is_400_listing_the_offered_ones",),
    ),
    Breakage(
        "approval-decided-after-its-turn", "I9", "hermes_sessions/services/approvals.py",
        "        if (turn is None or turn.status not in (Turn.Status.RUNNING, Turn.Status.QUEUED)\n"
        "                or turn.cancel_requested_at is not None):\n",
        "        if turn is None:\n",
        ("tests/api/test_approvals.py::test_a_decision_on_a_turn_that_ended_is_409",),
    ),
    Breakage(
        "approval-outlives-the-cancel", "I9", "hermes_sessions/services/turns.py",
        "    turn.save(update_fields=[\"cancel_requested_at\"])\n    approvals.approvals_close_for_turn(turn=turn, reason=reason)\n",
        "    turn.save(update_fields=[\"cancel_requested_at\"])\n",
        ("tests/api/test_approvals.py::test_cancelling_the_turn_cancels_its_pending_approvals_and_a_late_decision_is_409",
         "tests/api/test_approvals.py::test_an_interrupting_input_closes_the_running_turns_pending_approvals"),
    ),
    Breakage(
        "approval-asked-again-after-a-lost-worker", "I9", "hermes_sessions/services/approvals.py",
        "    if turn.attempt <= 1:\n        return None\n",
        "    return None\n",
        ("tests/services/test_approvals_rerun.py::test_a_decision_given_while_the_turn_is_taken_back_is_applied_by_its_rerun",
         "tests/services/test_approvals_rerun.py::test_a_pending_approval_is_carried_to_the_rerun_and_decided_there"),
    ),
    Breakage(
        "approval-answered-twice", "I9", "hermes_sessions/services/approvals.py",
        "        return bool(Approval.objects.filter(pk=approval_id, attempt=attempt, answered_at__isnull=True)\n",
        "        return True or bool(Approval.objects.filter(pk=approval_id, attempt=attempt, answered_at__isnull=True)\n",
        ("tests/services/test_approvals_rerun.py::test_a_stale_worker_cannot_answer_from_a_row_carried_to_another_claim",),
    ),
    Breakage(
        "approval-outlives-the-rerun", "I9", "hermes_sessions/services/turns.py",
        "        if result.approvals or turn.attempt > 1:\n",
        "        if result.approvals:\n",
        ("tests/services/test_approvals_rerun.py::test_a_rerun_that_asks_nothing_ends_the_earlier_claims_approval_with_the_turn",),
    ),
    # --- the event streams (docs/contract.md §8) ---------------------------------------------------
    Breakage(
        "heartbeat-carries-an-id", "§8", "hermes_sessions/api/streams.py",
        '                yield b": heartbeat\\n\\n"\n                await events_hub.ensure_listening()',
        '                yield f": heartbeat\\nid: {after + 1}\\n\\n".encode()\n                await events_hub.ensure_listening()',
        ("tests/api/test_event_streams.py::test_heartbeats_are_comment_frames_byte_for_byte_and_move_no_id",
         "tests/api/test_event_streams.py::test_a_client_that_leaves_right_after_a_heartbeat_resumes_without_a_gap"),
    ),
]

IGNORE = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "var", ".mypy_cache", ".ruff_cache")


def copy_tree(dest: Path) -> Path:
    """The repository without its git data and caches; ``.venv``/``node_modules`` stay symlinks."""
    shutil.copytree(REPO, dest, symlinks=True, ignore=IGNORE)
    return dest


def apply(tree: Path, b: Breakage) -> str | None:
    """Apply ``b`` in ``tree``; return why it is stale, or None."""
    target = tree / b.path
    if not target.exists():
        return f"{b.path} does not exist"
    text = target.read_text()
    count = text.count(b.old)
    if count != 1:
        return f"`old` occurs {count} times in {b.path} (must be exactly once)"
    broken = text.replace(b.old, b.new)
    if target.suffix == ".py":
        try:
            compile(broken, str(target), "exec")
        except SyntaxError as exc:
            # Re-indented code can still hold ``old`` as a substring: the breakage then breaks the file's
            # syntax, not its behaviour, and every test fails for that (test_a_breakage_that_breaks_the_syntax_is_stale).
            return f"the broken {b.path} does not compile ({exc.msg}, line {exc.lineno}): update the entry"
    target.write_text(broken)
    return None


def edited_lines(original: str, b: Breakage) -> list[int]:
    """The 1-based lines of the broken file that ``b`` edits: from the line where ``new`` starts to the
    line where it ends. A deletion (``new`` empty) is the one line at its place — what is left of a line
    cut short, or the line that now follows the lines taken out."""
    start = original.index(b.old)
    first = original.count("\n", 0, start) + 1
    return list(range(first, first + max(b.new.rstrip("\n").count("\n"), 0) + 1))


def lines_run(out: Path) -> set[tuple[str, int]]:
    """The ``(path, line)`` pairs that any process of a probed run recorded under ``out``."""
    hits: set[tuple[str, int]] = set()
    for record in out.glob("*") if out.is_dir() else ():
        for row in record.read_text().splitlines():
            path, _, line = row.rpartition(":")
            if path:
                hits.add((path, int(line)))
    return hits


def probe_env(tree: Path, probe: dict[str, list[int]], out: Path) -> dict[str, str]:
    """``test_env()`` plus ``line_probe.py`` as the ``sitecustomize`` of every interpreter of the run,
    watching ``probe`` (``{absolute path: [line, ...]}``) and recording hits under ``out``."""
    site = out.parent / "probe-site"
    site.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tree / T / "line_probe.py", site / "sitecustomize.py")
    out.mkdir(parents=True, exist_ok=True)
    env = test_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    env["HERMES_LINE_PROBE"] = json.dumps(probe)
    env["HERMES_LINE_PROBE_OUT"] = str(out)
    return env


def test_env() -> dict[str, str]:
    """``make test``'s environment, on a database and broker of this script's own."""
    env = dict(os.environ)
    env["DATABASE_URL"] = os.environ.get("BREAKAGES_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/hermes_breakages")
    env["CELERY_BROKER_URL"] = os.environ.get("BREAKAGES_BROKER_URL", "redis://127.0.0.1:6379/11")
    env["CELERY_TASK_ALWAYS_EAGER"] = "1"
    env["HERMES_TURN_QUEUE"] = f"turns-breakages-{os.getpid()}-{time.time_ns()}"
    env.pop("PYTEST_ADDOPTS", None)
    return env


def run_tests(tree: Path, tests: tuple[str, ...], timeout: float,
              env: dict[str, str] | None = None) -> tuple[str, float, str]:
    """('passed' | 'failed' | 'timeout', seconds, output tail)."""
    cmd = [str(tree / ".venv/bin/pytest"), "-x", "-q", "-p", "no:cacheprovider", *tests]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env or test_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return "timeout", time.monotonic() - started, out[-2000:]
    elapsed = time.monotonic() - started
    out = (proc.stdout + proc.stderr)[-2000:]
    return ("passed" if proc.returncode == 0 else "failed"), elapsed, out


def failing_test(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0]
    return ""


def run_breakage(work: Path, b: Breakage, *, timeout: float, verbose: bool) -> bool:
    """Run ``b``'s tests on a broken copy under ``work`` and print its row; whether it was caught."""
    tree = copy_tree(work / "tree")
    original = (tree / b.path).read_text() if (tree / b.path).exists() else ""
    try:
        stale = apply(tree, b)
        if stale:
            print(f"{b.invariant:9} {b.id:38} {'STALE':9} {'-':>7}  {stale}", flush=True)
            return False
        target, lines = str((tree / b.path).resolve()), edited_lines(original, b)
        hits = work / "hits"
        outcome, seconds, out = run_tests(tree, b.tests, timeout, env=probe_env(tree, {target: lines}, hits))
        ran = {line for path, line in lines_run(hits) if path == target}
        if not b.path.endswith(".py"):
            ran = set(lines)  # a statement file (queries.sql) has no lines to trace: the code reads it whole
        where = f"{b.path}:{lines[0]}" + (f"-{lines[-1]}" if len(lines) > 1 else "")
        if ran:
            result = {"failed": "caught", "passed": "SURVIVED", "timeout": "TIMEOUT"}[outcome]
            detail = failing_test(out)
        else:
            # Never "caught": the tests did not run the edited code, so whatever they did, the breakage
            # changed nothing they ran (a line only another database runs, a branch no test takes).
            result, detail = "N/A", f"no test ran the edited line(s) {where} (the tests {outcome})"
        print(f"{b.invariant:9} {b.id:38} {result:9} {seconds:7.1f}  {detail}", flush=True)
        if verbose or result in ("SURVIVED", "TIMEOUT"):
            print("    " + "\n    ".join(out.splitlines()[-15:]))
        return result == "caught"
    finally:
        shutil.rmtree(work)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", metavar="ID", help="run only this breakage (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the breakages and exit")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the named tests on the unbroken tree")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per pytest run (default 180)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's output tail for each run")
    args = parser.parse_args(argv)

    chosen = [b for b in BREAKAGES if not args.only or b.id in args.only]
    if args.only and len(chosen) != len(set(args.only)):
        parser.error(f"unknown breakage id(s): {sorted(set(args.only) - {b.id for b in chosen})}")
    if args.list:
        for b in chosen:
            print(f"{b.invariant:5} {b.id:38} {b.path}")
        return 0

    bad = 0
    with tempfile.TemporaryDirectory(prefix="hermes-breakages-") as tmp:
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for b in chosen for t in b.tests))
            tree = copy_tree(Path(tmp) / "baseline")
            outcome, seconds, out = run_tests(tree, tests, args.timeout * 2)
            print(f"baseline ({len(tests)} tests, unbroken tree): {outcome} in {seconds:.1f} s", flush=True)
            if outcome != "passed":
                print(out)
                return 1
            shutil.rmtree(tree)
        print(f"{'invariant':9} {'breakage':38} {'result':9} {'seconds':>7}  failing test", flush=True)
        for b in chosen:
            bad += not run_breakage(Path(tmp) / b.id, b, timeout=args.timeout, verbose=args.verbose)
    print(f"{len(chosen) - bad} of {len(chosen)} breakages caught" + ("" if not bad else f"; {bad} not"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
