"""The rollout scenarios of ``make faults`` (issue 7): faults while a worker restores a thread's rollout
from PostgreSQL or stores what a turn appended. The turn workers reach PostgreSQL only through the
harness's proxy (:mod:`devtools.faults.pgproxy`), which stops a worker at an exact statement — no hook
in the product's code:

``kill-during-rollout``     ``kill -9`` of the worker (its whole process group) caught at, in turn:
                            *restore* — its ``SELECT … FROM rolloutchunk`` of the session's thread
                            (after the claim committed and the home was wiped, before the file is
                            written and before codex is spawned, so before ``thread/resume``);
                            *store* — the finalize's second round trip held (the transcript rows,
                            the turn's end, its events and the COMMIT: ``services/pipelining.py``),
                            its first one done — the locks and the rollout's generation bump and
                            chunk executed in the open transaction —, nothing committed;
                            *commit* — that transaction's ``COMMIT`` forwarded and PostgreSQL's answer
                            withheld (committed; the worker dies before it learns so or dispatches
                            the session's next turn).
``db-down-during-restore``  PostgreSQL unreachable for every turn worker (connections cut, new ones
                            refused) the moment a worker sends the restore's chunk ``SELECT``; back
                            after ``--db-down`` seconds (alternating: shorter and longer than the lease).

A session's thread kept loaded by a worker (session affinity) is not restored by its next turn, so
before a restore is aimed at, the app-server keeping it is SIGKILLed (as in ``warm-codex-dies``).

Where each fault landed is confirmed from outside (the session's home holds no rollout yet and no
codex runs for it; ``pg_stat_activity`` shows the worker's transaction open; the turn committed) and
reported per phase. The checks (:mod:`devtools.faults.invariants`) add, for these scenarios, that no
thread rotated.
"""
from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from devtools.faults.pgproxy import Trap
from devtools.faults.scenarios import Scenario
from devtools.faults.supervisor import log
from devtools.faults.warm_scenarios import drop_kept
from devtools.processes import codex_processes

CHUNKS = b'FROM "hermes_sessions_rolloutchunk"'
CHUNK_INSERT = b'INSERT INTO "hermes_sessions_rolloutchunk"'
FINISH_UPDATE = b'UPDATE "hermes_sessions_turn" SET "status"'
PHASES = ("restore", "store", "commit")


def _quoted(thread_id: str) -> bytes:
    """The thread id as it travels in a write: inlined as a quoted literal by Django's cursors, a Bind
    message's value for the pipelined statements (server-side binding) — its bytes match both."""
    return thread_id.encode()


def _start_threads(sc: Scenario, n: int) -> list[str]:
    """``n`` sessions, each with a first turn that started and stored its thread; waits for them."""
    from hermes_sessions.models import CodexRollout

    sessions = [sc.new_session() for _ in range(n)]
    for i, s in enumerate(sessions):
        sc.post(s, sc.text(i + 1))
    deadline = time.monotonic() + sc.args.bound
    while time.monotonic() < deadline:
        if CodexRollout.objects.filter(session_id__in=sessions).count() == n:
            break
        time.sleep(0.3)
    else:
        sc.rec.notes.append(f"only {CodexRollout.objects.filter(session_id__in=sessions).count()} of {n} "
                            "first turns stored a rollout in time")
    return sessions


def _thread_of(session_id: str) -> tuple[str, int] | None:
    """The session's bound thread and the primary key of its stored rollout."""
    from hermes_sessions.models import CodexBinding, CodexRollout

    b = CodexBinding.objects.filter(session_id=session_id, status="active").first()
    r = CodexRollout.objects.filter(thread_id=b.thread_id).first() if b else None
    return (b.thread_id, r.pk) if b and r else None


def _home_without_rollout(sc: Scenario, session_id: str, thread_id: str) -> bool:
    """The session's home was made afresh for this run and holds no rollout of the thread yet."""
    home = Path(sc.stack.codex_home) / "homes" / session_id / "home"
    return (home / "config.toml").is_file() and not list((home / "sessions").glob(f"**/*{thread_id}.jsonl"))


def _codex_running_for(sc: Scenario, session_id: str) -> bool:
    workdir = os.path.join(sc.stack.work_root, session_id)
    return any(cp.cwd == workdir for cp in codex_processes(sc.stack.codex_home))


def _in_transaction(app: str) -> bool:
    """A backend of the worker ``app`` has a transaction open that has written (``pg_stat_activity``:
    ``backend_xid`` set) — ``idle in transaction``, or ``active`` when part of the held round trip's first
    write already reached PostgreSQL (pipelined statements span several writes)."""
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                    "AND xact_start IS NOT NULL AND backend_xid IS NOT NULL", [app])
        return bool(cur.fetchone()[0])


def forget_host_copy(sc: Scenario, session_id: str) -> None:
    """Remove the session's home from this host (all workers share it here), as on a host that never ran
    the session: a worker holding the thread's rollout file from its last turn would append only what it
    lacks and send no chunk ``SELECT`` for the trap (``services.rollouts.rollout_write``)."""
    shutil.rmtree(Path(sc.stack.codex_home) / "homes" / session_id, ignore_errors=True)


def _caught_turn(session_id: str) -> tuple[str, int] | None:
    """The turn the caught worker runs: the session's latest turn that is not queued (its next turns
    stay queued until this one's finalize dispatches them), with its attempt."""
    from hermes_sessions.models import Turn

    t = (Turn.objects.filter(session_id=session_id).exclude(status="queued").order_by("-seq")
         .values_list("pk", "attempt").first())
    return (str(t[0]), t[1]) if t else None


def _arm(sc: Scenario, phase: str, thread_id: str) -> Trap:
    proxy = sc.stack.pgproxy
    assert proxy is not None
    # The finalize's one statement that moves the rollout's header on and inserts its chunk (``WITH u AS
    # (UPDATE … WHERE "thread_id" = '<thread>' …) INSERT INTO … rolloutchunk``, services/rollouts.py).
    insert = (CHUNK_INSERT, _quoted(thread_id))
    if phase == "restore":
        return proxy.arm(CHUNKS, _quoted(thread_id))
    if phase == "store":
        # The turn's final UPDATE (``turns._end_turn``, naming the thread) travels in the finalize's second round
        # trip, after the first one stored the rollout (the trap is not on the chunk INSERT: it goes with
        # BEGIN and the locks, so holding it would hold a transaction PostgreSQL has not seen begin).
        return proxy.arm(FINISH_UPDATE, _quoted(thread_id), after=insert)
    return proxy.arm(b"COMMIT", action="mute", after=insert)


def _landed(sc: Scenario, phase: str, trap: Trap, session_id: str, thread_id: str) -> tuple[bool, str]:
    """Whether the caught worker is where the phase means it to be (checked before the kill)."""
    if phase == "restore":
        ok = _home_without_rollout(sc, session_id, thread_id) and not _codex_running_for(sc, session_id)
        return ok, "home wiped, rollout not yet written, no codex" if ok else "restore had moved on"
    if phase == "store":
        # codex's turn is over; its app-server is gone, or (session affinity) still running, idle, to be
        # kept loaded after the commit — its rollout file was complete at turn/completed.
        ok = _in_transaction(trap.app)
        codex = "codex held to be kept loaded" if _codex_running_for(sc, session_id) else "codex gone"
        return ok, f"finalize transaction open and written (pg_stat_activity), {codex}" if ok else "no open transaction seen"
    return True, ""


def _kill_caught(sc: Scenario, trap: Trap, what: str) -> bool:
    """``kill -9`` the worker whose connection ``trap`` caught, drop that connection, start a new worker."""
    stack = sc.stack
    owner = stack.worker_named(trap.app)
    if owner is None:
        trap.drop()
        sc.rec.notes.append(f"{what}: caught a connection of {trap.app or '?'}, not a running turn worker")
        return False
    log(f"{sc.rec.name}: kill -9 {owner.name} (pid group {owner.pid}) {what}")
    stack.kill9_worker(owner)
    trap.drop()
    stack.wait_ready(stack.start_worker())
    return True


def scenario_kill_during_rollout(sc: Scenario) -> None:
    a = sc.args
    sc.rec.expect_no_rotation = True
    sessions = _start_threads(sc, a.rollout_sessions)
    tried: Counter[str] = Counter()
    landed: Counter[str] = Counter()
    for rnd in range(a.rollout_kills):
        phase = PHASES[rnd % len(PHASES)]
        s = sessions[rnd % len(sessions)]
        bound = _thread_of(s)
        if bound is None:
            sc.rec.notes.append(f"round {rnd + 1}: session {s} has no bound, stored thread; skipped")
            continue
        thread_id, _ = bound
        if phase == "restore":  # a thread kept loaded is not restored: make the next turn run cold
            _settle(sc, s, timeout=a.bound)
            drop_kept(sc, s)
            forget_host_copy(sc, s)
        trap = _arm(sc, phase, thread_id)
        i = 100 * (rnd + 1)
        sc.post(s, sc.text(i))
        sc.post(s, sc.text(i + 1))  # queued behind it: dispatched by the finalize the kill interrupts
        sc.post(sessions[(rnd + 1) % len(sessions)], sc.text(i + 2))
        if not trap.wait(60):
            sc.stack.pgproxy.disarm(trap)  # type: ignore[union-attr]
            # A violation, not a note: a trap that never fires means the statement it waits for changed shape
            # (e.g. the chunk INSERT made one statement with the header UPDATE: the store and commit rounds
            # would silently stop killing anything).
            sc.rec.violations.append(f"round {rnd + 1} ({phase}): the trap caught nothing within 60 s — "
                                     "its SQL pattern no longer matches what the worker sends?")
            continue
        tried[phase] += 1
        caught = _caught_turn(s)
        ok, evidence = _landed(sc, phase, trap, s, thread_id)
        if not _kill_caught(sc, trap, f"caught at {phase} of turn {caught[0][:8] if caught else '?'} of {s} ({evidence})"):
            continue
        if phase == "commit":
            from hermes_sessions.models import Turn

            # Committed by the killed worker: succeeded in the attempt it was caught in, not by a re-run.
            ok = bool(caught) and Turn.objects.filter(pk=caught[0], status="succeeded", attempt=caught[1]).exists()

        landed[phase] += ok
    kills = sum(tried.values())
    sc.rec.runs = kills
    for p in PHASES:
        if tried[p] and not landed[p]:
            # As for a trap that never fires: none landing where aimed means the phase stopped testing what it
            # names (e.g. "store 0 of 2" when the rollout's store goes with the finalize's first round trip).
            sc.rec.violations.append(f"{p}: none of {tried[p]} kill(s) landed where aimed")
    sc.rec.notes.append("kills landed where aimed: " + ", ".join(
        f"{p} {landed[p]} of {tried[p]}" for p in PHASES)
        + " (commit: landed = the killed worker's finalize committed; its answer never reached it)")


def scenario_db_down_during_restore(sc: Scenario) -> None:
    a = sc.args
    sc.rec.expect_no_rotation = True
    proxy = sc.stack.pgproxy
    assert proxy is not None
    downs = [float(x) for x in a.db_down.split(",")]
    sessions = _start_threads(sc, a.rollout_sessions)
    caught = landed = 0
    for rnd in range(a.db_down_rounds):
        s = sessions[rnd % len(sessions)]
        bound = _thread_of(s)
        if bound is None:
            sc.rec.notes.append(f"round {rnd + 1}: session {s} has no bound, stored thread; skipped")
            continue
        thread_id = bound[0]
        _settle(sc, s, timeout=a.bound)
        drop_kept(sc, s)  # a thread kept loaded is not restored: make the next turn run cold
        forget_host_copy(sc, s)
        down = downs[rnd % len(downs)]
        trap = proxy.arm(CHUNKS, _quoted(thread_id), action="down")
        i = 100 * (rnd + 1)
        sc.post(s, sc.text(i))
        sc.post(s, sc.text(i + 1))
        sc.post(sessions[(rnd + 1) % len(sessions)], sc.text(i + 2))
        if not trap.wait(60):
            proxy.disarm(trap)
            sc.rec.notes.append(f"round {rnd + 1}: no restore of {s}'s thread seen within 60 s")
            continue
        caught += 1
        landed += _home_without_rollout(sc, s, thread_id)
        log(f"{sc.rec.name} round {rnd + 1}: PostgreSQL unreachable for the workers during a restore of {s} "
            f"({trap.app}); back in {down:g} s")
        try:
            time.sleep(down)
        finally:
            proxy.up()
        _settle(sc, s, timeout=a.bound)
    sc.rec.runs = caught
    sc.rec.notes.append(f"{caught} outages began at a restore's chunk SELECT ({landed} with the home wiped and "
                        f"the rollout not yet written); down {', '.join(f'{d:g}' for d in downs)} s in turn")


def _settle(sc: Scenario, session_id: str, timeout: float) -> None:
    """Until the session has no queued or running turn (the next outage then hits a fresh restore)."""
    from hermes_sessions.models import Turn

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Turn.objects.filter(session_id=session_id, status__in=("queued", "running")).exists():
            return
        time.sleep(0.3)


ROLLOUT_SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "kill-during-rollout": scenario_kill_during_rollout,
    "db-down-during-restore": scenario_db_down_during_restore,
}
