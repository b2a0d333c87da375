"""Session affinity with real workers and the real codex binary (issue 9 §2, §4).

Each worker is a real ``celery worker -c 1`` process (so it has a route and keeps threads loaded,
``worker/affinity.py``), all on one host (one ``CODEX_HOMES_ROOT``), against the model
stand-in. What is checked is what a user and an operator see: turns succeed, the thread is resumed (no
rotation, no notice), the model gets the whole conversation, consecutive turns run on the loaded thread
(``timings.warm``), woken by NOTIFY (``timings.woken``), and no codex process outlives its worker or a thread another worker took.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings

from devtools.processes import ancestors, codex_processes
from hermes_sessions import services, worker
from hermes_sessions.models import CodexRollout, Notice, Turn, TurnWorker, WarmThread
from project.celery import app as celery_app
from tests.support.broker_keys import keys_naming

from .conftest import stop_workers, wait_ready, worker_env
from .test_seed_e2e import TURN_QUEUE, _database_url, _forget_queue

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True), pytest.mark.timeout(240)]


class Workers:
    """Starts named ``-c 1`` workers on one host (shared homes root) and finds their codex processes."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.root, self.env = root, env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str) -> subprocess.Popen:
        log = self.root / f"{name}.log"
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "project", "worker", "-Q", TURN_QUEUE, "-c", "1",
                 "-n", f"{name}@%h", "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
                env=self.env, cwd=settings.BASE_DIR, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        wait_ready([(proc, log)])
        self.procs[name] = proc
        return proc

    def queue(self, name: str) -> str:
        """Worker ``name``'s route, from its heartbeat row (written when its pool process starts)."""
        rows: list[str] = []
        _wait(lambda: rows.extend(q for q in TurnWorker.objects.values_list("queue", flat=True) if f".{name}@" in q)
              or rows, 10, f"worker {name} has no heartbeat row")
        return rows[0]

    def codex_of(self, name: str) -> list[int]:
        """Pids of the codex app-servers running under worker ``name`` (its pool process's children)."""
        root = self.procs[name].pid
        return [p.pid for p in codex_processes(self.root / "homes") if root in ancestors(p.pid)]

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()


@pytest.fixture
def stand_in():
    """The model stand-in with ``SLOW`` replies of 10 s (a worker kept busy while another takes over)."""
    from devtools.model_stand_in import ModelStandIn

    with ModelStandIn(slow_seconds=10) as server:
        yield server


@pytest.fixture
def workers(tmp_path, stand_in, real_codex_bin, settings):
    assert settings.CELERY_BROKER_URL, "the e2e tests need CELERY_BROKER_URL (make test sets it)"
    settings.CODEX_HOMES_ROOT = tmp_path / "homes"
    env = worker_env(database_url=_database_url(), broker_url=settings.CELERY_BROKER_URL, codex_bin=real_codex_bin,
                     stand_in_url=stand_in.base_url, codex_home=str(tmp_path / "legacy_home"),
                     CODEX_HOMES_ROOT=str(tmp_path / "homes"), CODEX_WORK_ROOT=str(tmp_path / "work"),
                     HERMES_WARM_IDLE_SECONDS="120", HERMES_WORKER_HEARTBEAT_SECONDS="0.5",
                     HERMES_AFFINITY_DEADLINE="2", HERMES_REDISPATCH_SECONDS="3")
    subprocess.run([sys.executable, "-m", "celery", "-A", "project", "purge", "-f", "-Q", TURN_QUEUE], env=env,
                   cwd=settings.BASE_DIR, check=True, capture_output=True, timeout=60)
    w = Workers(tmp_path, env)
    celery_app.conf.task_always_eager = False
    try:
        yield w
    finally:
        celery_app.conf.task_always_eager = True
        for proc in w.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
        stop_workers([p for p in w.procs.values() if p.poll() is None])
        _forget_queue(settings.CELERY_BROKER_URL)
        deadline = time.monotonic() + 10
        while codex_processes(tmp_path / "homes") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert codex_processes(tmp_path / "homes") == [], "codex processes outlived their workers"


#: A turn its holder cannot claim (busy, dead) is claimed elsewhere within HERMES_AFFINITY_DEADLINE (2) + one
#: sweep round (0.5 s here) + a worker's pickup and claim; 2 s of slack for a loaded 2-core machine.
COLD_BOUND = 2 + 0.5 + 2.0


def _claimed_after(turn: Turn) -> float:
    """Seconds from the turn's enqueue to its claim (its first attempt's)."""
    return (turn.started_at - turn.created_at).total_seconds()


def _turn(session, user, text: str, *, timeout: float = 60) -> Turn:
    turn = services.turn_enqueue(session=session, input_text=text, user=user)
    deadline = time.monotonic() + timeout
    while True:
        turn.refresh_from_db()
        if turn.is_terminal:
            return turn
        assert time.monotonic() < deadline, f"turn {text!r} still {turn.status}"
        time.sleep(0.05)


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _model_saw(stand_in, text: str) -> set[str]:
    asked = [r for r in stand_in.requests() if (stand_in.user_texts(r) or [("", "")])[-1][1] == text]
    assert asked, f"no model request for {text!r}"
    return {t for _, t in stand_in.user_texts(asked[-1])}


def test_consecutive_turns_run_on_the_loaded_thread(user, workers, stand_in):
    workers.start("a")
    session = services.session_create(owner=user, session_id="aff-warm")
    first = _turn(session, user, "warm one")
    assert (first.status, first.thread_action) == ("succeeded", "started"), first.error
    app_server = workers.codex_of("a")
    assert len(app_server) == 1  # kept after the turn
    _wait(lambda: TurnWorker.objects.filter(queue=workers.queue("a"), wakeable=True).exists(), 10,
          "a's wake listener is not listening")
    row = WarmThread.objects.get(session=session)
    assert row.queue == workers.queue("a") and row.thread_id == first.codex_thread_id
    assert row.generation == CodexRollout.objects.get(thread_id=first.codex_thread_id).generation

    for n in (2, 3):
        turn = _turn(session, user, f"warm {n}")
        assert (turn.status, turn.thread_action) == ("succeeded", "resumed"), turn.error
        assert turn.timings.get("warm") == 1 and turn.timings.get("restore_ms") == 0.0, turn.timings
        assert turn.timings.get("woken") == 1, turn.timings  # by NOTIFY, not a Celery message (worker/wake.py)
        assert turn.timings.get("early_start") == 1, turn.timings  # turn/start sent beside the claim
        assert turn.codex_thread_id == first.codex_thread_id
        assert workers.codex_of("a") == app_server  # the same process ran it
    texts = _model_saw(stand_in, "warm 3")
    assert {"warm one", "echo: warm one", "warm 2", "echo: warm 2"} <= texts
    assert CodexRollout.objects.get(thread_id=first.codex_thread_id).generation == 3

    # The session's codex settings change: the loaded copy is not used (it was started with the old ones).
    # Its wake still sends turn/start to it early; the claim shows the change, the copy is killed before
    # codex asks the model (early_start.py), and the turn runs cold: the model is asked once.
    type(session).objects.filter(pk=session.pk).update(model_config={"developer_instructions": "be brief"})
    changed = _turn(session, user, "warm 4")
    assert (changed.status, changed.thread_action) == ("succeeded", "resumed"), changed.error
    assert "warm" not in changed.timings and "early_start" not in changed.timings
    assert sum(1 for r in stand_in.requests() if (stand_in.user_texts(r) or [("", "")])[-1][1] == "warm 4") == 1
    assert "changed" in workers.log("a") or "settings" in workers.log("a")
    assert "early turn/start withdrawn: the session's codex settings changed" in workers.log("a")
    assert not Notice.objects.exists()

    # A clean stop (warm shutdown) leaves nothing of the worker behind: no app-server, no routing rows,
    # and nothing on the broker named after it.
    queue = workers.queue("a")
    stop_workers([workers.procs["a"]])
    assert workers.codex_of("a") == [] and not TurnWorker.objects.exists() and not WarmThread.objects.exists()
    assert keys_naming(redis.Redis.from_url(settings.CELERY_BROKER_URL), queue) == {}


@pytest.mark.parametrize("worker_turns", [2, 1])
def test_two_sessions_kept_on_one_worker_run_their_next_turns_at_once_on_their_kept_threads(
        user, workers, stand_in, worker_turns):
    """Two sessions whose threads one ``-c 1`` worker keeps post their next turns at once. With
    ``HERMES_WORKER_TURNS=2`` the wake listener hands both to runners: both run on their kept thread
    (``timings.warm``), woken, and their runs overlap in time. With 1 the second waits for the first (one
    turn at a time); its 3 s outlast ``HERMES_AFFINITY_DEADLINE``, so the second is sent on by the sweep."""
    workers.env["HERMES_WORKER_TURNS"] = str(worker_turns)
    workers.start("a")
    sessions = [services.session_create(owner=user, session_id=f"aff-both-{worker_turns}-{n}") for n in (1, 2)]
    for n, session in enumerate(sessions):
        assert _turn(session, user, f"first {n}").status == "succeeded"
    _wait(lambda: TurnWorker.objects.filter(queue=workers.queue("a"), wakeable=True).exists(), 10,
          "a's wake listener is not listening")
    assert set(WarmThread.objects.values_list("queue", flat=True)) == {workers.queue("a")}
    assert WarmThread.objects.count() == 2 and len(workers.codex_of("a")) == 2
    posted = [services.turn_enqueue(session=session, input_text=f"SLOW3 next {n}", user=user)
              for n, session in enumerate(sessions)]
    one, two = (_turn_done(turn, timeout=60) for turn in posted)
    assert (one.status, two.status) == ("succeeded", "succeeded"), (one.error, two.error)
    overlap = one.started_at < two.finished_at and two.started_at < one.finished_at
    if worker_turns == 1:
        assert not overlap, (one.started_at, one.finished_at, two.started_at, two.finished_at)
        return
    for turn in (one, two):
        assert (turn.timings.get("warm"), turn.timings.get("woken")) == (1, 1), turn.timings
        assert turn.thread_action == "resumed" and turn.attempt == 1
    assert overlap, (one.started_at, one.finished_at, two.started_at, two.finished_at)
    assert not Notice.objects.exists()


def test_a_dead_app_server_between_turns_runs_cold(user, workers, stand_in):
    workers.start("a")
    session = services.session_create(owner=user, session_id="aff-dead-codex")
    assert _turn(session, user, "before the crash").status == "succeeded"
    [pid] = workers.codex_of("a")
    os.kill(pid, signal.SIGKILL)
    after = _turn(session, user, "after the crash")
    assert (after.status, after.thread_action) == ("succeeded", "resumed"), after.error
    assert "warm" not in after.timings
    assert "before the crash" in _model_saw(stand_in, "after the crash")
    assert not Notice.objects.exists()


def test_killed_holder_another_worker_resumes(user, workers, stand_in, settings):
    a = workers.start("a")
    session = services.session_create(owner=user, session_id="aff-killed")
    assert _turn(session, user, "held by a").status == "succeeded"
    [held] = workers.codex_of("a")
    queue_a = workers.queue("a")
    workers.start("b")
    os.killpg(a.pid, signal.SIGKILL)  # the worker and its pool process; codex is in its own session
    a.wait()
    _wait(lambda: not os.path.exists(f"/proc/{held}") or open(f"/proc/{held}/stat").read().split()[2] == "Z",
          10, "the kept app-server outlived its SIGKILLed worker")

    moved = _turn(session, user, "taken by b")
    assert (moved.status, moved.thread_action) == ("succeeded", "resumed"), moved.error
    # Woken on a (its heartbeat still fresh), nobody claimed it: b's sweep round dispatched it to the shared
    # queue once HERMES_AFFINITY_DEADLINE had passed (``recovery.turns_dispatch_unclaimed``).
    assert _claimed_after(moved) < COLD_BOUND, moved.timings
    assert "held by a" in _model_saw(stand_in, "taken by b")
    assert not Notice.objects.exists()
    assert WarmThread.objects.get(session=session).queue == workers.queue("b")

    # The sweep removes the dead worker once its heartbeat is stale.
    settings.HERMES_WORKER_STALE_SECONDS = 1.0
    _wait(lambda: TurnWorker.objects.filter(queue=queue_a).exists() and worker.turns_sweep().workers_removed >= 1
          or not TurnWorker.objects.filter(queue=queue_a).exists(), 15, "dead worker not swept")
    assert not TurnWorker.objects.filter(queue=queue_a).exists()
    assert TurnWorker.objects.filter(queue=workers.queue("b")).exists()


def test_a_session_taken_elsewhere_is_released_by_its_old_holder(user, workers, stand_in):
    """a holds the session's thread but is busy with another session's long turn when the next turn
    comes: after the affinity deadline the sweep dispatches it to the shared queue and b takes it (cold,
    on the same host: it re-makes the session's home under a's loaded copy), a then lets its copy go, and
    the turn after runs warm on b. One permit (``HERMES_WORKER_TURNS=1``): a's one long turn keeps it busy."""
    workers.env["HERMES_WORKER_TURNS"] = "1"
    workers.start("a")
    session = services.session_create(owner=user, session_id="aff-taken")
    assert _turn(session, user, "first on a").status == "succeeded"
    [held] = workers.codex_of("a")
    other = services.session_create(owner=user, session_id="aff-busy")
    busy = services.turn_enqueue(session=other, input_text="SLOW keep a busy", user=user)
    _wait(lambda: Turn.objects.get(pk=busy.pk).status == "running", 30, "a did not start the long turn")
    workers.start("b")
    assert Turn.objects.get(pk=busy.pk).status == "running"
    moved = _turn(session, user, "second on b")  # a woken first, then the shared queue after 2 s
    assert (moved.status, moved.thread_action) == ("succeeded", "resumed"), moved.error
    assert _claimed_after(moved) < COLD_BOUND, moved.timings
    assert "warm" not in moved.timings
    _wait(lambda: held not in workers.codex_of("a"), 15, "a kept a thread b had taken")
    third = _turn(session, user, "third on b")
    assert (third.status, third.timings.get("warm")) == ("succeeded", 1), (third.error, third.timings)
    texts = _model_saw(stand_in, "third on b")
    assert {"first on a", "second on b", "echo: second on b"} <= texts
    assert _turn_done(busy).status == "succeeded"
    assert not Notice.objects.exists()
    assert "released its loaded thread" in workers.log("a")


def test_a_warm_shutdown_lets_a_woken_turn_finish(user, workers, stand_in):
    """SIGTERM to the worker's main process (systemd's KillMode=mixed) while a turn it was woken for runs:
    Celery's warm shutdown waits only for its own tasks, so the pool process's shutdown waits for the woken
    turn (``wake.wake_stop``) before it closes the app-servers — the turn succeeds, nothing is left."""
    a = workers.start("a")
    session = services.session_create(owner=user, session_id="aff-stop")
    assert _turn(session, user, "first").status == "succeeded"
    _wait(lambda: TurnWorker.objects.filter(queue=workers.queue("a"), wakeable=True).exists(), 10,
          "a's wake listener is not listening")
    slow = services.turn_enqueue(session=session, input_text="SLOW finish me", user=user)
    _wait(lambda: Turn.objects.get(pk=slow.pk).status == "running", 30, "a did not start the woken turn")
    os.kill(a.pid, signal.SIGTERM)
    done = _turn_done(slow)
    assert (done.status, done.timings.get("woken"), done.attempt) == ("succeeded", 1, 1), (done.error, done.timings)
    a.wait(timeout=60)
    assert workers.codex_of("a") == [] and not TurnWorker.objects.exists()
    assert done.final_text  # the model's whole reply, streamed past the SIGTERM


def test_a_worker_busy_with_a_woken_turn_leaves_other_turns_to_the_sweep_and_they_do_not_starve(
        user, workers, stand_in):
    """A woken turn holds the worker's permit, which Celery cannot see, so it hands that pool process
    the shared queue's next message — here the first turns of new sessions. The delivery waits at most
    ``HERMES_AFFINITY_DEADLINE`` for a permit, then leaves its turn undispatched; the sweep's next
    round dispatches it again, until the idle worker takes it: each runs within seconds, not after the
    woken turn's 30 s or the sweep's ``HERMES_REDISPATCH_SECONDS``. One permit (``HERMES_WORKER_TURNS=1``):
    with more, the woken turn leaves the others free and a runs the new sessions' turns itself."""
    workers.env["HERMES_WORKER_TURNS"] = "1"
    workers.start("a")
    held = services.session_create(owner=user, session_id="aff-woken-busy")
    assert _turn(held, user, "held by a").status == "succeeded"
    _wait(lambda: TurnWorker.objects.filter(queue=workers.queue("a"), wakeable=True).exists(), 10,
          "a's wake listener is not listening")
    workers.start("b")
    slow = services.turn_enqueue(session=held, input_text="SLOW30 keep a busy", user=user)
    _wait(lambda: Turn.objects.get(pk=slow.pk).status == "running", 30, "a did not start the woken turn")
    t0 = time.monotonic()
    posted = []
    for n in range(3):
        posted.append(services.turn_enqueue(session=services.session_create(owner=user, session_id=f"aff-new-{n}"),
                                            input_text=f"new {n}", user=user))
        time.sleep(0.3)
    for turn in posted:
        done = _turn_done(turn, timeout=25)
        assert done.status == "succeeded", done.error
    assert time.monotonic() - t0 < 15, "a new session's turn waited behind the woken turn"
    assert Turn.objects.get(pk=slow.pk).status == "running"  # all that while
    services.turn_cancel(turn=Turn.objects.get(pk=slow.pk))
    assert _turn_done(slow).status == "cancelled"


def test_a_turn_whose_dispatch_died_with_the_api_process_still_runs(user, workers, stand_in, monkeypatch):
    """The API process commits a turn and dies before its Celery send (kill -9 between the two): the turn
    row is all there is. A woken one loses nothing (PostgreSQL sent the wake at the commit); an unrouted
    one is dispatched by a worker's sweep round ``HERMES_REDISPATCH_SECONDS`` (3 s here) after its
    enqueue. Simulated in this process: the dispatch after the commit does nothing."""
    from hermes_sessions.services import dispatch

    workers.start("a")
    monkeypatch.setattr(dispatch, "turn_dispatch_on_commit", lambda turn_id, **_: None)  # the send never happens
    session = services.session_create(owner=user, session_id="aff-api-died")
    first = _turn(session, user, "sent by nobody", timeout=30)
    assert first.status == "succeeded", first.error
    assert 3 <= _claimed_after(first) < 3 + 0.5 + 4, first.timings
    _wait(lambda: TurnWorker.objects.filter(queue=workers.queue("a"), wakeable=True).exists(), 10,
          "a's wake listener is not listening")
    second = _turn(session, user, "woken at the commit", timeout=30)
    assert (second.status, second.timings.get("woken")) == ("succeeded", 1), (second.error, second.timings)
    assert _claimed_after(second) < 2, second.timings


def _turn_done(turn: Turn, timeout: float = 60) -> Turn:
    _wait(lambda: Turn.objects.get(pk=turn.pk).is_terminal, timeout, f"turn {turn.input!r} did not end")
    return Turn.objects.get(pk=turn.pk)
