"""The session-affinity scenarios of ``make faults`` (issue 9 §4): faults of the app-servers a ``-c 1``
worker keeps with a session's thread loaded between its turns (``hermes_sessions/worker/warm/kept.py``,
``worker/affinity.py``).

``warm-codex-dies``   each session's thread is kept loaded by the worker that ran its last turn; between
                      turns the harness SIGKILLs that kept app-server (found as the codex process working
                      in the session's directory under the worker's pool process); the session's next
                      turn must run cold and resume the thread from PostgreSQL: succeeded,
                      ``thread_action`` resumed, not on the loaded copy, no rotation, no notice. Several
                      sessions, several rounds; in each round the other half of the sessions is left alone
                      (their next turns may run warm: counted, not required).
``kill-warm-holder``  ``kill -9`` (the whole process group) of the worker that holds the most sessions'
                      threads loaded; the next turns of those sessions are posted at once: the other
                      workers resume them from PostgreSQL (succeeded, resumed, attempt 1, claimed within
                      the lease of the post — the holder held no claim, so nobody waits for a lease), no
                      turn fails (``already has an active writer`` or anything else), none of the killed
                      worker's app-servers survives it by more than 5 s (``PR_SET_PDEATHSIG``), and the
                      sweep removes its ``TurnWorker`` row and its ``WarmThread`` rows.
``freeze-warm-holder`` SIGSTOP (its process group and its app-servers) of the worker that holds the most
                      sessions' threads loaded, while the others are busy: all but one with a SLOW turn
                      (``--slow-seconds``); the held sessions' next turns are posted (each wakes the frozen
                      holder by NOTIFY: its heartbeat is still fresh), and the one idle worker then starts a
                      long turn (``SLOW<--freeze-slow-seconds>``); a round starts with every worker idle, and
                      notes when the set-up did not hold (the turns not woken on the holder). The sweep's
                      round of a busy worker must dispatch the turns to the shared queue
                      (``recovery.turns_dispatch_unclaimed``): each claimed within
                      ``HERMES_AFFINITY_DEADLINE`` + 3 heartbeats + 3 s of its post, or 3 s after a turn slot
                      came free if that is later (a SLOW turn ended); succeeded, resumed cold, attempt 1.
                      Beat's sweeper is paused meanwhile. Then SIGCONT: the holder keeps running and beating
                      (no yield: nobody took its name), closes its kept copies within 5 s, and no later turn
                      runs on a loaded copy unless the session's previous turn ended on that worker (worker
                      logs); the held sessions' next turns succeed.

``kill-beat-with-worker`` ``kill -9`` of the sweeper (the worker that embeds beat) together with
                      a worker running a SLOW turn: with beat dead, the live workers' affinity loops must take
                      the turn back (``recovery.leases_take_back``) within the lease + one loop heartbeat + 3 s
                      of the kill (a log line ``worker <queue>: turn …: worker lost``), and it must succeed at
                      attempt 2 on another worker, resumed cold from PostgreSQL; then beat comes back and
                      sweeps the dead worker's rows and queue.

All four rotate nothing (``Record.expect_no_rotation``: every thread's rollout is stored).
"""
from __future__ import annotations

import heapq
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

from devtools.faults.scenarios import Scenario, _find_victim
from devtools.faults.supervisor import Proc, log, pid_alive
from devtools.processes import CodexProcess, ancestors, codex_processes


def _settled(sc: Scenario, sessions: list[str], timeout: float) -> bool:
    """Until none of ``sessions`` has a queued or running turn."""
    from hermes_sessions.models import Turn

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not Turn.objects.filter(session_id__in=sessions, status__in=("queued", "running")).exists():
            return True
        time.sleep(0.2)
    return False


def kept_codex(sc: Scenario, session_id: str) -> tuple[Proc, CodexProcess] | None:
    """The running worker keeping ``session_id``'s thread loaded and that app-server: a codex process
    working in the session's directory under the worker its ``WarmThread`` row names."""
    from hermes_sessions.models import WarmThread

    row = WarmThread.objects.filter(session_id=session_id).values_list("queue", flat=True).first()
    if not row:
        return None
    worker = next((w for w in sc.stack.workers if w.alive() and sc.stack.worker_queue(w) == row), None)
    if worker is None:
        return None
    workdir = os.path.join(sc.stack.work_root, session_id)
    cp = next((cp for cp in codex_processes(sc.stack.codex_home)
               if cp.cwd == workdir and worker.pid in ancestors(cp.pid)), None)
    return (worker, cp) if cp is not None else None


def _wait_kept(sc: Scenario, session_id: str, timeout: float = 10.0) -> tuple[Proc, CodexProcess] | None:
    """``_kept_codex`` once it is there (the keeper takes the process just after the finalize commit)."""
    deadline = time.monotonic() + timeout
    while True:
        found = kept_codex(sc, session_id)
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def drop_kept(sc: Scenario, session_id: str) -> int | None:
    """SIGKILL the app-server keeping ``session_id``'s thread loaded, if one does (call it with no turn of
    the session running), so that its next turn runs cold — restores the rollout from PostgreSQL (the
    rollout scenarios aim at that restore). Returns the pid killed."""
    found = kept_codex(sc, session_id)
    if found is None:
        return None
    try:
        os.kill(found[1].pid, 9)
    except OSError:
        return None
    return found[1].pid


def _turn_of(sc: Scenario, posted: dict[str, Any] | None) -> Any:
    from hermes_sessions.models import Turn

    return Turn.objects.filter(pk=posted["id"]).first() if posted else None


def _cold_resumed(sc: Scenario, turn: Any, what: str) -> bool:
    """The turn succeeded by resuming its session's thread from PostgreSQL (not on a loaded copy);
    a violation otherwise."""
    if turn is None:
        return False
    why = []
    if turn.status != "succeeded":
        why.append(f"ended {turn.status} ({(turn.error or '')[:160]})")
    if turn.thread_action != "resumed":
        why.append(f"thread_action {turn.thread_action or '-'}")
    if (turn.timings or {}).get("warm"):
        why.append("ran on a loaded copy")
    if why:
        sc.rec.violations.append(f"{what}: turn {turn.pk} " + ", ".join(why))
    return not why


def _kill_kept(sc: Scenario, rnd: int, victims: list[str]) -> list[int]:
    """SIGKILL the app-server keeping each of ``victims`` loaded; the pids killed (a session none keeps
    is noted)."""
    pids = []
    for s in victims:
        found = _wait_kept(sc, s)
        if found is None:
            sc.rec.notes.append(f"round {rnd}: no app-server kept {s}'s thread loaded within 10 s")
            continue
        worker, cp = found
        log(f"warm-codex-dies round {rnd}: SIGKILL the app-server {cp.pid} {worker.name} keeps for {s}")
        os.kill(cp.pid, 9)
        pids.append(cp.pid)
    return pids


def scenario_warm_codex_dies(sc: Scenario) -> None:
    a = sc.args
    sc.rec.expect_no_rotation = True
    sessions = [sc.new_session() for _ in range(a.warm_sessions)]
    for i, s in enumerate(sessions):
        sc.post(s, sc.text(i + 1))
    _settled(sc, sessions, a.bound)
    killed = cold = warm = 0
    for rnd in range(1, a.warm_rounds + 1):
        victims = sessions[rnd % 2::2]  # half the sessions each round, the other half the next
        pids = _kill_kept(sc, rnd, victims)
        killed += len(pids)
        posted = [(s, sc.post(s, sc.text(100 * rnd + n))) for n, s in enumerate(sessions)]
        _settled(sc, sessions, a.bound)
        for s, p in posted:
            turn = _turn_of(sc, p)
            if turn is not None and s in victims:
                cold += _cold_resumed(sc, turn, f"round {rnd}: the turn after {s}'s kept app-server died")
            elif turn is not None:
                warm += bool((turn.timings or {}).get("warm"))
        if left := [pid for pid in pids if pid_alive(pid)]:
            sc.rec.violations.append(f"round {rnd}: SIGKILLed app-server(s) {left} still running")
    sc.rec.runs = killed
    sc.rec.notes.append(f"{killed} kept app-servers SIGKILLed between turns; {cold} next turns ran cold and resumed "
                        f"the thread; {warm} turns of the sessions left alone ran on their loaded thread")


def _holder(sc: Scenario, sessions: list[str]) -> tuple[Proc, str, list[str], list[int]] | None:
    """The running worker keeping the most of ``sessions`` loaded: (worker, its queue, those sessions,
    the pids of its app-servers)."""
    from hermes_sessions.models import WarmThread

    rows = dict(WarmThread.objects.filter(session_id__in=sessions).values_list("session_id", "queue"))
    best: tuple[Proc, str, list[str], list[int]] | None = None
    for w in sc.stack.workers:
        queue = sc.stack.worker_queue(w) if w.alive() else ""
        held = sorted(s for s, q in rows.items() if queue and q == queue)
        if held and (best is None or len(held) > len(best[2])):
            best = (w, queue, held, [cp.pid for cp in sc.stack.codex_of(w)])
    return best


def _check_swept(sc: Scenario, rnd: int, queue: str, timeout: float) -> float | None:
    """Until the dead worker's ``TurnWorker`` row and ``WarmThread`` rows are gone (and nothing in the broker
    is named after it); seconds
    it took, or ``None`` (a violation) after ``timeout``."""
    from hermes_sessions.models import TurnWorker, WarmThread

    t0 = time.monotonic()
    while True:
        row = TurnWorker.objects.filter(queue=queue).exists()
        warm = WarmThread.objects.filter(queue=queue).count()
        try:
            in_broker = sc.stack.broker.queue_exists(queue)
        except Exception as exc:  # noqa: BLE001 — a broker that cannot say is reported, not a crash
            in_broker = True
            why = f"the broker could not say: {exc}"
        else:
            why = ""
        if not row and not warm and not in_broker:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            sc.rec.violations.append(f"round {rnd}: {timeout:.0f} s after the kill the dead worker still has "
                                     f"{'its TurnWorker row, ' if row else ''}{warm} WarmThread row(s)"
                                     f"{', its own queue in the broker' if in_broker else ''} {why}".rstrip())
            return None
        time.sleep(0.3)


def _check_taken_over(sc: Scenario, rnd: int, worker: Proc, posted: list[dict[str, Any] | None]) -> list[float]:
    """The next turns of the sessions the killed ``worker`` kept: each succeeded by resuming its thread
    cold at attempt 1, none failed; as many as there are workers left were claimed within the lease of
    their post. Returns the post → claim delays."""
    from django.conf import settings

    lease = float(settings.HERMES_LEASE_SECONDS)
    posted_at = {p.turn_id: p.posted_at for p in sc.rec.posted}
    delays = []
    for p in posted:
        turn = _turn_of(sc, p)
        if turn is None:
            continue
        _cold_resumed(sc, turn, f"round {rnd}: a session {worker.name} kept loaded")
        if turn.attempt != 1:
            sc.rec.violations.append(f"round {rnd}: turn {turn.pk} ran at attempt {turn.attempt} "
                                     "(the dead holder held no claim: nobody should wait for a lease)")
        if turn.started_at is not None:
            delays.append(turn.started_at.timestamp() - posted_at[str(turn.pk)])
    delays.sort()
    late = [d for d in delays[:len(sc.stack.workers)] if d > lease]
    if late:
        sc.rec.violations.append(f"round {rnd}: {len(late)} turn(s) claimed later than the lease ({lease:g} s) "
                                 f"after the post: {', '.join(f'{d:.1f}' for d in late)} s")
    return delays


def _holder_round(sc: Scenario, rnd: int, sessions: list[str], first: int) -> tuple[int, list[float], float | None]:
    """One round: a turn of each session, kill -9 the worker keeping the most loaded, post their next
    turns, check; returns (sessions it kept, post → claim delays, seconds from the kill until it was swept)."""
    from django.conf import settings

    a, stack = sc.args, sc.stack
    for n, s in enumerate(sessions):  # one turn each: every session's thread is kept loaded by some worker
        sc.post(s, sc.text(first + n))
    _settled(sc, sessions, a.bound)
    time.sleep(1.0)  # the keepers take their processes just after the finalize commits
    found = _holder(sc, sessions)
    if found is None:
        sc.rec.notes.append(f"round {rnd}: no worker keeps any of the sessions loaded; skipped")
        return 0, [], None
    worker, queue, held, pids = found
    log(f"kill-warm-holder round {rnd}: kill -9 {worker.name} (pid group {worker.pid}) keeping "
        f"{len(held)} session(s) loaded, app-servers {pids}")
    t_kill = time.monotonic()
    stack.kill9_worker(worker, grace=0)  # its app-servers are checked below, while the next turns run
    posted = [sc.post(s, sc.text(first + len(sessions) + n)) for n, s in enumerate(held)]
    # None of its app-servers may outlive it (PR_SET_PDEATHSIG): gone within 5 s.
    while any(pid_alive(p) for p in pids) and time.monotonic() - t_kill < 5:
        time.sleep(0.1)
    stack.outlived.clear()  # grace=0 noted every one still running at the kill: judged here instead
    if left := [p for p in pids if pid_alive(p)]:
        sc.rec.violations.append(f"round {rnd}: app-server(s) {left} of the SIGKILLed {worker.name} still "
                                 "running 5 s after it")
    _settled(sc, held, a.bound)
    delays = _check_taken_over(sc, rnd, worker, posted)
    swept = _check_swept(sc, rnd, queue, timeout=float(settings.HERMES_WORKER_STALE_SECONDS) + 15)
    stack.wait_ready(stack.start_worker())
    return len(held), delays, None if swept is None else time.monotonic() - t_kill


def _writer_lines(sc: Scenario) -> int:
    """Lines of the turn workers' logs (the killed ones' too) naming codex's ``already has an active
    writer`` (a resume refused while another live app-server holds the thread; retried, else a failed turn)."""
    return sum(f.read_text(errors="replace").count("already has an active writer")
               for f in sc.stack.logdir.glob("worker*.log"))


def scenario_kill_warm_holder(sc: Scenario) -> None:
    from django.conf import settings

    a = sc.args
    sc.rec.expect_no_rotation = True
    writer_before = _writer_lines(sc)
    sessions = [sc.new_session() for _ in range(a.holder_sessions)]
    kills = held_total = 0
    delays: list[float] = []
    swept: list[float] = []
    for rnd in range(1, a.holder_rounds + 1):
        held, round_delays, took = _holder_round(sc, rnd, sessions, first=100 * rnd)
        kills += bool(held)
        held_total += held
        delays += round_delays
        swept += [took] if took is not None else []
    sc.rec.runs = kills
    sc.rec.notes.append(
        f"{kills} warm holders killed, keeping {held_total} sessions loaded; their next turns were claimed "
        f"{', '.join(f'{d:.1f}' for d in delays)} s after the post (lease {settings.HERMES_LEASE_SECONDS:g} s); "
        f"the dead worker's row and warm rows gone (swept) {', '.join(f'{t:.1f}' for t in swept)} s "
        f"after the kill (HERMES_WORKER_STALE_SECONDS {settings.HERMES_WORKER_STALE_SECONDS:g}); "
        f"{_writer_lines(sc) - writer_before} worker log line(s) name 'already has an active writer'")


# --------------------------------------------------------------------------------------- freeze-warm-holder

#: Seconds of slack on the hand-off bound (a loaded 2-core machine: the API's commit, the broker, a claim).
FREEZE_SLACK = 3.0
_HANDED_OFF = "not claimed within HERMES_AFFINITY_DEADLINE by the worker holding its thread"  # recovery.HANDED_TO_SHARED_QUEUE
_YIELDED = "keeps no thread loaded from now on"  # affinity.AffinityLoop._yield's log line


def _signal_holder(worker: Proc, codex: list[int], sig: int) -> None:
    """``sig`` to the worker's process group (MainProcess and pool process) and to each of its app-servers,
    which lead process groups of their own (``codex/client.py``: ``start_new_session``)."""
    if sig == signal.SIGCONT:  # its app-servers first: the worker wakes to running processes
        _signal_groups(codex, sig)
        worker.signal_group(sig)
    else:
        worker.signal_group(sig)
        _signal_groups(codex, sig)


def _signal_groups(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except OSError:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def _turn_ids(posted: list[dict[str, Any] | None]) -> list[str]:
    return [str(p["id"]) for p in posted if p]


def _wait_claimed(ids: list[str], timeout: float) -> bool:
    """Until every turn of ``ids`` was claimed (``started_at`` set), at most ``timeout`` seconds."""
    from hermes_sessions.models import Turn

    deadline = time.monotonic() + timeout
    while True:
        if Turn.objects.filter(pk__in=ids, started_at__isnull=False).count() == len(ids):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _ended_on(sc: Scenario, turn_ids: set[str]) -> dict[str, str]:
    """The turn worker (its log's name) whose ``turn … ended`` line names each of ``turn_ids``."""
    found: dict[str, str] = {}
    for path in sc.stack.logdir.glob("worker*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = re.search(r"turn ([0-9a-f-]{36}) ended status=", line)
            if m and m.group(1) in turn_ids:
                found[m.group(1)] = path.stem
    return found


def _handed_off_at(sc: Scenario, turn_ids: list[str]) -> dict[str, float]:
    """When (epoch seconds, from the line's local time stamp) a worker's loop logged handing off each of
    ``turn_ids`` from a holder whose heartbeat stopped."""
    found: dict[str, float] = {}
    for path in sc.stack.logdir.glob("worker*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): .*?turn ([0-9a-f-]{36}) ", line)
            if m and _HANDED_OFF in line and m.group(3) in turn_ids:
                at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
                found.setdefault(m.group(3), at)
    return found


def _log_count(sc: Scenario, text: str, names: list[str] | None = None) -> int:
    return sum(p.read_text(errors="replace").count(text) for p in sc.stack.logdir.glob("worker*.log")
               if names is None or p.stem in names)


def _claim_bounds(sc: Scenario, held: list[Any], busy: list[Any]) -> list[tuple[Any, float, float]]:
    """``(turn, post → claim delay, bound)`` of each held session's turn posted during the freeze, in claim
    order. Bound: ``HERMES_AFFINITY_DEADLINE`` + 2 heartbeats (the holder's counts as stopped) + one more
    (the next loop round of any keeping worker) + ``FREEZE_SLACK`` after the post — or, if later, the moment
    a turn slot came free + ``FREEZE_SLACK``: every other worker was busy, so a turn can only be claimed once
    one is; the slots free up as the busy turns end (``busy``: their rows) and then as each held turn claimed
    before it ends (one slot each, in order)."""
    from django.conf import settings

    limit = (float(settings.HERMES_AFFINITY_DEADLINE) + 3 * float(settings.HERMES_WORKER_HEARTBEAT_SECONDS)
             + FREEZE_SLACK)
    posted_at = {p.turn_id: p.posted_at for p in sc.rec.posted}
    free = sorted(t.finished_at.timestamp() if t.finished_at else float("inf") for t in busy)
    out = []
    for turn in sorted((t for t in held if t.started_at), key=lambda t: t.started_at):
        at = posted_at[str(turn.pk)]
        slot = heapq.heappop(free) if free else float("inf")
        out.append((turn, turn.started_at.timestamp() - at, max(limit, slot + FREEZE_SLACK - at)))
        heapq.heappush(free, turn.finished_at.timestamp() if turn.finished_at else float("inf"))
    return out


def _check_warm_only_after_own(sc: Scenario, rnd: int, sessions: list[str]) -> int:
    """No turn of ``sessions`` ran on a loaded copy (``timings.warm``) unless the session's previous turn
    ended on that same worker: a copy kept by the frozen holder must never serve a turn after the session's
    thread moved on elsewhere. Returns the warm turns seen."""
    from hermes_sessions.models import Turn

    rows = list(Turn.objects.filter(session_id__in=sessions).order_by("session_id", "seq"))
    where = _ended_on(sc, {str(t.pk) for t in rows})
    warm = 0
    for prev, turn in zip(rows, rows[1:], strict=False):
        if prev.session_id != turn.session_id or not (turn.timings or {}).get("warm"):
            continue
        warm += 1
        if where.get(str(turn.pk)) != where.get(str(prev.pk)):
            sc.rec.violations.append(
                f"round {rnd}: turn {turn.pk} of {turn.session_id} ran on a loaded copy on "
                f"{where.get(str(turn.pk), '?')}, but the session's previous turn ended on {where.get(str(prev.pk), '?')}")
    return warm


def _check_released(sc: Scenario, rnd: int, worker: Proc, held: list[str], t0: float, timeout: float = 5.0) -> float | None:
    """After SIGCONT (at ``t0``, monotonic): the woken holder keeps on running (MainProcess and pool process),
    beats again without yielding, and closes its kept copies of ``held`` (their threads moved on to other
    workers meanwhile) within ``timeout``; seconds it took (by 0.2 s polls), or ``None`` (a violation)."""
    from hermes_sessions.models import TurnWorker

    workdirs = {os.path.join(sc.stack.work_root, s) for s in held}
    while True:
        kept = [cp.pid for cp in sc.stack.codex_of(worker) if cp.cwd in workdirs]
        if not kept:
            break
        if time.monotonic() - t0 > timeout:
            sc.rec.violations.append(f"round {rnd}: {timeout:g} s after SIGCONT {worker.name} still runs app-server(s) "
                                     f"{kept} for session(s) whose thread moved on to other workers")
            break
        time.sleep(0.2)
    took = time.monotonic() - t0
    queue = sc.stack.worker_queue(worker)
    row = TurnWorker.objects.filter(queue=queue).values("pid", "heartbeat_at").first() if queue else None
    fresh = row is not None and (time.time() - row["heartbeat_at"].timestamp()
                                 < 4 * float(_setting("HERMES_WORKER_HEARTBEAT_SECONDS")) + 1)
    if not worker.alive() or row is None or not pid_alive(row["pid"]) or not fresh:
        sc.rec.violations.append(f"round {rnd}: after SIGCONT {worker.name} is not running and beating "
                                 f"(alive {worker.alive()}, heartbeat row {row})")
    if _log_count(sc, _YIELDED, [worker.name]):
        sc.rec.violations.append(f"round {rnd}: {worker.name} yielded its queue after SIGCONT (no worker took its name)")
    return None if kept else took


def _setting(name: str) -> Any:
    from django.conf import settings

    return getattr(settings, name)


class _WakeWatch:
    """The NOTIFY wake-ups sent to one worker (``hermes_sessions/worker/wake.py``), heard on a connection of
    the harness's own: a turn routed to a holder whose wake listener listens gets a wake-up, no message."""

    def __init__(self, queue: str) -> None:
        import psycopg

        from hermes_sessions.listener import connection_params
        from hermes_sessions.services.routing import wake_channel

        self.conn = psycopg.connect(**connection_params("faults-wake-watch"), autocommit=True)
        self.conn.execute(f"LISTEN {wake_channel(queue)}")
        self.turns: set[str] = set()

    def count(self, turn_ids: list[str]) -> int:
        """How many of ``turn_ids`` were woken so far."""
        self.turns.update(n.payload.partition(" ")[0] for n in self.conn.notifies(timeout=0.2))
        return len(self.turns & {str(t) for t in turn_ids})

    def close(self) -> None:
        self.conn.close()


def _freeze(sc: Scenario, rnd: int, worker: Proc, pids: list[int], held: list[str], first: int) -> dict[str, Any]:
    """SIGSTOP the holder (and pause the sweeper), make the other workers busy, post the held sessions'
    next turns, wait until they are claimed and done, SIGCONT; what was posted and seen."""
    a, stack = sc.args, sc.stack
    peers = [w for w in stack.workers if w.alive() and w is not worker]
    sweeper = stack.procs[2]
    out: dict[str, Any] = {"short": [], "long": [], "posted": [], "frozen_for": 0.0, "in_queue": -1, "woken": 0,
                           "t_cont": 0.0}
    own_route = stack.worker_queue(worker)
    wakes = _WakeWatch(own_route) if own_route else None
    try:
        # The sweep (here every 1 s, stale after 4 s; by default 10 + 10 s) would free the held turns ≈ 5 s
        # after the freeze and hide the wait: paused, as if it had not come yet.
        sweeper.signal_group(signal.SIGSTOP)
        _signal_holder(worker, pids, signal.SIGSTOP)
        t_freeze = time.monotonic()
        time.sleep(1.2)  # its broker poll (BRPOP, 1 s) ends: the frozen worker takes no message meant for others
        # All but one of the others busy with a SLOW turn (they free up after --slow-seconds) …
        out["short"] = [sc.post(sc.new_session(), sc.text(first + 50 + n, slow=True)) for n in range(len(peers) - 1)]
        if not _wait_claimed(_turn_ids(out["short"]), 15):
            sc.rec.notes.append(f"round {rnd}: the SLOW turns were not all claimed within 15 s")
        # … the held sessions' next turns: each wakes the frozen holder (its heartbeat is still fresh) …
        out["posted"] = [sc.post(s, sc.text(first + 60 + n)) for n, s in enumerate(held)]
        # … and the one idle worker starts a long turn: only busy workers' sweep rounds are left to move them.
        out["long"] = [sc.post(sc.new_session(), sc.text(first + 90, slow_for=a.freeze_slow_seconds))]
        if not _wait_claimed(_turn_ids(out["long"]), 10):
            sc.rec.notes.append(f"round {rnd}: the long SLOW turn was not claimed within 10 s")
        out["in_queue"] = stack.broker.queue_length(own_route) if own_route else -1
        out["woken"] = wakes.count(_turn_ids(out["posted"])) if wakes is not None else 0
        claimed = _wait_claimed(_turn_ids(out["posted"]), a.freeze_slow_seconds + 20)
        _settled(sc, held, 30 if claimed else 1)
        out["frozen_for"] = time.monotonic() - t_freeze
    finally:
        if wakes is not None:
            wakes.close()
        _signal_holder(worker, pids, signal.SIGCONT)
        out["t_cont"] = time.monotonic()
        # The holder beats again before the sweep resumes: a sweep now would remove the row of a live worker.
        time.sleep(3 * float(_setting("HERMES_WORKER_HEARTBEAT_SECONDS")) + 0.5)
        sweeper.signal_group(signal.SIGCONT)
    return out


def _check_frozen_turns(sc: Scenario, rnd: int, worker: Proc, seen: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """The held sessions' turns posted during the freeze: each succeeded cold at attempt 1, claimed within
    its bound (``_claim_bounds``). Returns the bounds and the SLOW turns that kept the others busy."""
    held_turns = [t for t in (_turn_of(sc, p) for p in seen["posted"]) if t is not None]
    shorts = [t for t in (_turn_of(sc, p) for p in seen["short"]) if t is not None]
    busy = shorts + [t for t in (_turn_of(sc, p) for p in seen["long"]) if t is not None]
    for turn in held_turns:
        _cold_resumed(sc, turn, f"round {rnd}: a session the frozen {worker.name} kept loaded")
        if turn.attempt != 1:
            sc.rec.violations.append(f"round {rnd}: turn {turn.pk} ran at attempt {turn.attempt} "
                                     "(the frozen holder held no claim)")
        if turn.started_at is None:
            sc.rec.violations.append(f"round {rnd}: turn {turn.pk} of {turn.session_id} was never claimed while "
                                     f"{worker.name} was frozen ({seen['frozen_for']:.1f} s)")
    bounds = _claim_bounds(sc, held_turns, busy)
    for turn, delay, bound in bounds:
        if delay > bound:
            sc.rec.violations.append(f"round {rnd}: turn {turn.pk} of {turn.session_id} was claimed {delay:.1f} s after "
                                     f"its post, bound {bound:.1f} s ({worker.name} frozen, the others busy)")
    return bounds, shorts


def _freeze_round(sc: Scenario, rnd: int, sessions: list[str], first: int) -> dict[str, Any] | None:
    """One round of freeze-warm-holder (see the module docstring); what it measured, or ``None`` when it
    could not set the fault up (noted)."""
    a, stack = sc.args, sc.stack
    # Every worker idle first: the last round's long turn outlasts that round (with it still running, the
    # worker meant to start the long turn was busy, and the held turns went to it instead).
    _settled(sc, sc.rec.sessions, a.bound)
    for n, s in enumerate(sessions):  # one turn each: every session's thread is kept loaded by some worker
        sc.post(s, sc.text(first + n))
    _settled(sc, sessions, a.bound)
    time.sleep(1.0)  # the keepers take their processes just after the finalize commits
    found = _holder(sc, sessions)
    if found is None or sum(w.alive() for w in stack.workers) < 3:
        sc.rec.notes.append(f"round {rnd}: no holder, or fewer than 2 other workers (needs --workers ≥ 3); skipped")
        return None
    worker, _queue, held, pids = found
    log(f"freeze-warm-holder round {rnd}: SIGSTOP {worker.name} (pid group {worker.pid}, app-servers {pids}) keeping "
        f"{len(held)} session(s) loaded; the sweeper paused")
    handed_before = _log_count(sc, _HANDED_OFF)
    seen = _freeze(sc, rnd, worker, pids, held, first)
    bounds, shorts = _check_frozen_turns(sc, rnd, worker, seen)
    if seen["in_queue"] + seen["woken"] != len(held):  # routed to the shared queue only: the round did not set up F2
        sc.rec.notes.append(f"round {rnd}: {seen['in_queue'] + seen['woken']} of {len(held)} first copies went to the "
                            "frozen holder (a wake-up; its heartbeat went stale before the posts?): "
                            "this round proves less")
    released = _check_released(sc, rnd, worker, held, seen["t_cont"])
    after = [sc.post(s, sc.text(first + 95 + n)) for n, s in enumerate(held)]
    _settled(sc, held, a.bound)
    for turn in (_turn_of(sc, p) for p in after):
        if turn is not None and turn.status != "succeeded":
            sc.rec.violations.append(f"round {rnd}: turn {turn.pk} after SIGCONT ended {turn.status} "
                                     f"({(turn.error or '')[:160]})")
    posted_at = {p.turn_id: p.posted_at for p in sc.rec.posted if p.turn_id in _turn_ids(seen["posted"])}
    first_post = min(posted_at.values(), default=0.0)
    long = [t for t in (_turn_of(sc, p) for p in seen["long"]) if t is not None and t.started_at]
    long_at = long[0].started_at.timestamp() - first_post if long else float("inf")
    if long_at > float(_setting("HERMES_AFFINITY_DEADLINE")):  # the held turns were dispatched to an idle worker
        sc.rec.notes.append(f"round {rnd}: the long SLOW turn was claimed {long_at:.1f} s after the held turns' post, "
                            "after the sweep could dispatch them to the idle worker: this round proves less")
    ran_on = _ended_on(sc, set(posted_at) | {str(t.pk) for t in shorts})
    return {
        "worker": worker.name, "held": len(held), "frozen_for": seen["frozen_for"], "released": released,
        "delays": [d for _, d, _ in bounds], "bounds": [b for _, _, b in bounds],
        "warm": _check_warm_only_after_own(sc, rnd, held),
        "peer_free": sorted(t.finished_at.timestamp() - first_post for t in shorts if t.finished_at),
        "handed_off": _log_count(sc, _HANDED_OFF) - handed_before, "in_queue": seen["in_queue"], "woken": seen["woken"],
        "long_at": long_at, "held_on": sorted(ran_on.get(i, "?") for i in posted_at),
        "short_on": sorted(ran_on.get(str(t.pk), "?") for t in shorts),
        "handed_after": sorted(t - posted_at[i] for i, t in _handed_off_at(sc, list(posted_at)).items()),
    }


def scenario_freeze_warm_holder(sc: Scenario) -> None:
    a = sc.args
    sc.rec.expect_no_rotation = True
    sessions = [sc.new_session() for _ in range(a.holder_sessions)]
    rounds = [r for r in (_freeze_round(sc, rnd, sessions, first=100 * rnd) for rnd in range(1, a.freeze_rounds + 1))
              if r is not None]
    sc.rec.runs = len(rounds)
    limit = (float(_setting("HERMES_AFFINITY_DEADLINE")) + 3 * float(_setting("HERMES_WORKER_HEARTBEAT_SECONDS"))
             + FREEZE_SLACK)
    for n, r in enumerate(rounds, 1):
        handed = ", ".join(f"{h:.1f}" for h in r["handed_after"]) or "-"
        closed = f"closed within {r['released']:.1f} s" if r["released"] is not None else "NOT closed"
        sc.rec.notes.append(
            f"freeze {n}: {r['worker']} frozen {r['frozen_for']:.1f} s keeping {r['held']} session(s); the other "
            f"workers busy (SLOW turns on {', '.join(r['short_on'])} freeing "
            f"{', '.join(f'{f:.1f}' for f in r['peer_free'])} s after the post, one SLOW{a.freeze_slow_seconds:g} "
            f"claimed {r['long_at']:.1f} s after it); {r['woken']} wake-up(s) "
            f"sent to it while frozen; "
            f"{r['handed_off']} hand-off log line(s), {handed} s after the post; the held turns claimed "
            f"{', '.join(f'{d:.1f}' for d in r['delays'])} s after the post, ran on {', '.join(r['held_on'])} (bound "
            f"{', '.join(f'{b:.1f}' for b in r['bounds'])} s: max(HERMES_AFFINITY_DEADLINE + 3 heartbeats + "
            f"{FREEZE_SLACK:g} = {limit:g}, a slot free + {FREEZE_SLACK:g})); after SIGCONT its copies were {closed}; "
            f"{r['warm']} later turn(s) ran warm, each on the worker that ran the session's previous turn")


# --------------------------------------------------------------------------------------- kill-beat-with-worker

#: Seconds of slack on the lease take-back bound (a loaded 2-core machine: the loop's query, a commit).
LEASE_SLACK = 3.0
NO_BEAT_SESSIONS, NO_BEAT_ROUNDS = 3, 2


def _wait_taken_back(turn_id: str, timeout: float) -> float | None:
    """Until the turn is no longer running its first attempt's claim (queued again, or claimed again);
    the wall-clock time it was seen so, or ``None`` after ``timeout``."""
    from hermes_sessions.models import Turn

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, attempt = Turn.objects.filter(pk=turn_id).values_list("status", "attempt").get()
        if status != "running" or attempt > 1:
            return time.time()
        time.sleep(0.05)
    return None


def _no_beat_round(sc: Scenario, rnd: int, sessions: list[str], first: int) -> float | None:
    """One round of kill-beat-with-worker; seconds from the kill until the turn was taken back, or ``None``."""
    from collections import Counter

    from hermes_sessions.models import Turn

    stack = sc.stack
    for n, s in enumerate(sessions):
        sc.post(s, sc.text(first + n, slow=True))
    victim = _find_victim(sc, Counter())
    if victim is None:
        sc.rec.notes.append(f"round {rnd}: no SLOW turn seen running on a worker within 60 s; skipped")
        return None
    tid, sid, owner = victim
    queue = stack.worker_queue(owner)
    time.sleep(1.0)  # mid-turn: the lease was renewed a moment ago
    sweeper = stack.procs[2]
    log(f"kill-beat-with-worker round {rnd}: kill -9 the sweeper (beat) and {owner.name} (pid group {owner.pid}) "
        f"running turn {tid[:8]} of {sid}")
    sweeper.kill9()
    t_kill = time.time()
    stack.kill9_worker(owner)
    limit = (float(_setting("HERMES_LEASE_SECONDS")) + float(_setting("HERMES_WORKER_HEARTBEAT_SECONDS"))
             + LEASE_SLACK)
    seen = _wait_taken_back(tid, limit + 10)
    took = None if seen is None else seen - t_kill
    if took is None or took > limit:
        sc.rec.violations.append(f"round {rnd}: with beat dead, turn {tid} of the killed {owner.name} was taken back "
                                 f"{'not within ' + format(limit + 10, 'g') + ' s' if took is None else f'{took:.1f} s'}"
                                 f" after the kill (bound: lease + a loop heartbeat + {LEASE_SLACK:g} = {limit:g} s)")
    _settled(sc, sessions, sc.args.bound)  # recovered by the live workers alone: beat is still dead
    turn = Turn.objects.get(pk=tid)
    if turn.status != "succeeded" or turn.attempt != 2:
        sc.rec.violations.append(f"round {rnd}: turn {tid} ended {turn.status} at attempt {turn.attempt} "
                                 f"({(turn.error or '')[:160]})")
    else:
        _cold_resumed(sc, turn, f"round {rnd}: the killed worker's turn")
    # recovery._take_back's line, "worker <queue>: turn …" from a loop ("sweep: turn …" from beat's, in sweeper*.log).
    if not _log_count(sc, f": turn {tid}: worker lost (lease expired"):
        sc.rec.violations.append(f"round {rnd}: no live worker's log names taking back turn {tid}")
    # Beat back (a fresh sweeper), and a replacement worker; the dead one's rows go with the next sweep.
    stack.procs[2] = Proc(f"sweeper-r{rnd}-{stack.worker_seq}", list(sweeper.popen.args), stack.env, stack.logdir)
    stack.wait_ready(stack.procs[2])
    stack.wait_ready(stack.start_worker())
    _check_swept(sc, rnd, queue, timeout=float(_setting("HERMES_WORKER_STALE_SECONDS")) + 15)
    return took


def scenario_kill_beat_with_worker(sc: Scenario) -> None:
    """The worker that embeds beat dies with a turn worker (here: the sweeper and a worker
    running a SLOW turn, both ``kill -9`` at once); the live workers' affinity loops take the turn back
    (``recovery.leases_take_back``) within the lease + one loop heartbeat, with no beat, and it succeeds on
    another worker, resumed from PostgreSQL."""
    sc.rec.expect_no_rotation = True
    sessions = [sc.new_session() for _ in range(NO_BEAT_SESSIONS)]
    for n, s in enumerate(sessions):  # each session's thread first
        sc.post(s, sc.text(n + 1))
    _settled(sc, sessions, sc.args.bound)
    took = [t for t in (_no_beat_round(sc, rnd, sessions, first=100 * rnd) for rnd in range(1, NO_BEAT_ROUNDS + 1))
            if t is not None]
    sc.rec.runs = len(took)
    sc.rec.notes.append(f"{len(took)} rounds: beat (the sweeper) and a worker mid-turn killed -9 together; the "
                        f"turn taken back by a live worker {', '.join(f'{t:.1f}' for t in took)} s after the kill "
                        f"(HERMES_LEASE_SECONDS {_setting('HERMES_LEASE_SECONDS'):g}, loop heartbeat "
                        f"{_setting('HERMES_WORKER_HEARTBEAT_SECONDS'):g} s), and run to success with beat still dead")


WARM_SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "warm-codex-dies": scenario_warm_codex_dies,
    "kill-warm-holder": scenario_kill_warm_holder,
    "freeze-warm-holder": scenario_freeze_warm_holder,
    "kill-beat-with-worker": scenario_kill_beat_with_worker,
}
