"""The session-affinity scenarios of ``make faults`` (issue 9 §4): faults of the app-servers a ``-c 1``
worker keeps with a session's thread loaded between its turns (``hermes_sessions/codex/kept.py``,
``services/affinity.py``).

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
                      sweep removes its ``TurnWorker`` row, its ``WarmThread`` rows and its own queue.

Both rotate nothing (``Record.expect_no_rotation``: every thread's rollout is stored).
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from devtools.faults.scenarios import Scenario
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
    """Until the dead worker's ``TurnWorker`` row, ``WarmThread`` rows and own queue are gone; seconds
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
        f"the dead worker's row, warm rows and own queue gone (swept) {', '.join(f'{t:.1f}' for t in swept)} s "
        f"after the kill (HERMES_WORKER_STALE_SECONDS {settings.HERMES_WORKER_STALE_SECONDS:g}); "
        f"{_writer_lines(sc) - writer_before} worker log line(s) name 'already has an active writer'")


WARM_SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "warm-codex-dies": scenario_warm_codex_dies,
    "kill-warm-holder": scenario_kill_warm_holder,
}
