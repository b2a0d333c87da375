"""Who may do what (issue 6 §3, §4): the services never import the tasks, one ``run_turn`` in the tree,
only services/bindings.py writes bindings and notices, the worker's commit points are durable, and
the locks refuse to run outside a transaction."""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import transaction
from django.db.transaction import TransactionManagementError

from hermes_sessions import services
from hermes_sessions.services import bindings, dispatch
from hermes_sessions.services.locks import advisory_xact_lock, lock_session_and_turn, lock_session_for_events
from hermes_sessions.sql import query

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hermes_sessions"
WRITE_METHODS = {"create", "update", "delete", "bulk_create", "bulk_update", "get_or_create", "update_or_create"}


def modules(root=PACKAGE):
    for path in sorted(root.rglob("*.py")):
        if "migrations" not in path.parts:
            yield path, ast.parse(path.read_text(), filename=str(path))


def test_services_import_nothing_from_tasks():
    for path, tree in modules(PACKAGE / "services"):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [alias.name for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(name == "tasks" or name.endswith(".tasks") for name in names), (path, names)


def test_exactly_one_run_turn_in_the_tree_the_celery_task():
    found = [
        (path.relative_to(REPO), node.lineno)
        for root in (PACKAGE, REPO / "tests", REPO / "scripts")
        for path, tree in modules(root)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "run_turn"
    ]
    assert found == [(Path("hermes_sessions/tasks.py"), found[0][1])], found
    assert dispatch.RUN_TURN_TASK == "hermes_sessions.tasks.run_turn"


def _model_writes(tree):
    """(model, method) for every ``CodexBinding.objects….<write>(…)`` / ``Notice.objects….<write>(…)`` call."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in WRITE_METHODS):
            continue
        base = node.func.value
        while isinstance(base, ast.Call | ast.Attribute):
            base = base.func if isinstance(base, ast.Call) else base.value
        if isinstance(base, ast.Name) and base.id in {"CodexBinding", "Notice"}:
            yield base.id, node.func.attr


def test_only_services_bindings_writes_codex_bindings_and_notices():
    writers = {path.relative_to(REPO).as_posix() for path, tree in modules() if any(_model_writes(tree))}
    assert writers == {"hermes_sessions/services/bindings.py"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("call", [
    lambda: advisory_xact_lock("x"),
    lambda: lock_session_and_turn("00000000-0000-0000-0000-000000000000"),
    lambda: lock_session_for_events("s"),
    lambda: bindings.binding_publish(session=None, turn=None, thread_id="t", resumed=False),
    lambda: bindings.binding_rotate(session=None, turn=None, thread_id="t", reason="r"),
], ids=["advisory_xact_lock", "lock_session_and_turn", "lock_session_for_events", "binding_publish", "binding_rotate"])
def test_locks_and_binding_writes_refuse_to_run_outside_a_transaction(call):
    with pytest.raises(TransactionManagementError):
        call()


def _calls(tree, name):
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == name))]


def test_the_session_event_lock_is_taken_in_one_place_before_the_turn_row():
    """docs/contract.md §8 and I3: ``pg_advisory_xact_lock`` appears in locks.py only; no turn event
    takes an advisory lock (that one, taken after the turn row's share lock, deadlocked with posts and
    cancels holding the session row); the event lock is the session row (``lock_session_for_events``'s
    mode), taken by the event statement before its claim check."""
    sql_users = {path.relative_to(REPO).as_posix() for path, _ in modules() if "pg_advisory" in path.read_text()}
    assert sql_users == set() and "pg_advisory" in query("advisory_xact_lock")  # named in queries.sql only …
    named_by = {path.relative_to(REPO).as_posix() for path, _ in modules() if '"advisory_xact_lock"' in path.read_text()}
    assert named_by == {"hermes_sessions/services/locks.py"}  # … and run by locks.py only
    events_tree = ast.parse((PACKAGE / "services" / "events.py").read_text())
    assert _calls(events_tree, "advisory_xact_lock") == []
    # The one statement: CTE l locks the session row; the claim check's share lock of the turn
    # row (CTE c) reads through l, so its LockRows runs after l has locked (tests/services/test_event_lock_order.py).
    for name in ("events_append_claimed", "events_append_of_claim"):
        sql = query(name)
        assert sql.index("FOR NO KEY UPDATE") < sql.index("FOR SHARE OF t") and "JOIN l ON" in sql
    assert "FOR SHARE" not in query("events_append")


@pytest.mark.django_db(transaction=True)
def test_advisory_lock_runs_inside_a_transaction():
    with transaction.atomic():
        advisory_xact_lock("issue-6")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("call", [
    lambda: services.turn_claim(turn_id="00000000-0000-0000-0000-000000000000"),
    lambda: services.turn_heartbeat(turn_id="00000000-0000-0000-0000-000000000000",
                                    token="00000000-0000-0000-0000-000000000000"),
    lambda: services.turn_fail(turn_id="00000000-0000-0000-0000-000000000000",
                               token="00000000-0000-0000-0000-000000000000", reason="x"),
    lambda: services.turn_requeue(turn_id="00000000-0000-0000-0000-000000000000",
                                  token="00000000-0000-0000-0000-000000000000", reason="x"),
], ids=["turn_claim", "turn_heartbeat", "turn_fail", "turn_requeue"])
def test_the_workers_commit_points_are_durable(call):
    call()  # alone: fine
    with pytest.raises(RuntimeError, match="durable"), transaction.atomic():
        call()  # folded into a caller's transaction: refused


def test_dispatch_finds_the_task_in_an_api_process():
    """An API process never imports the tasks itself: the app registers them at ready (apps.py), and
    dispatch finds run_turn routed to the turn queue."""
    code = (
        "import sys, django; django.setup()\n"
        "from hermes_sessions.services import dispatch\n"
        "task = dispatch._run_turn_task()\n"
        "print(task.name, task.app.amqp.router.route({}, task.name)['queue'].name)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings", "HERMES_TURN_QUEUE": "turns"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["hermes_sessions.tasks.run_turn", "turns"]
