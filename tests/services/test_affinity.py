"""Session affinity's database and broker side (``worker/affinity.py``, ``dispatch._route``, the
``warm_queue`` of ``turn_finalize``, the sweep of dead workers) and the execution steps that hand a
loaded app-server to the keeper and back (``execution._take_kept``, ``execution._Handover``).

Real PostgreSQL and, where messages are sent, the real Redis broker; no codex runs: a kept copy's
client is ``tests/codex/test_kept.FakeClient``. The end-to-end behaviour with real workers and the
real codex binary is ``tests/e2e/test_affinity.py``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
import redis
from django.conf import settings as django_settings
from django.db import transaction
from django.utils import timezone

from hermes_sessions import services, worker
from hermes_sessions.codex.rollout_files import RolloutBase, RolloutDelta
from hermes_sessions.codex.runner import TurnControl, TurnOutcome, TurnRunError
from hermes_sessions.models import CodexRollout, Turn, TurnWorker, WarmThread
from hermes_sessions.services import dispatch, rollouts, routing
from hermes_sessions.services.turns import TurnClaim
from hermes_sessions.worker import affinity, execution, process
from hermes_sessions.worker.warm import kept as kept_mod
from project.celery import app as celery_app
from tests.codex.test_kept import CONFIG, FakeClient, make_kept, write_rollout_file
from tests.factories import SessionFactory, TurnFactory

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(30)]

THREAD = "019a0000-0000-7000-8000-00000000aaaa"


def own(name: str) -> str:
    """A worker's route, unique per test run (the database and broker are shared with other runs)."""
    return routing.route_name(f"{name}-{uuid.uuid4().hex[:8]}@host")


def worker_row(queue: str, *, age: float = 0.0, **fields) -> TurnWorker:
    return TurnWorker.objects.create(queue=queue, node=queue, heartbeat_at=timezone.now() - timedelta(seconds=age),
                                     **fields)


def warm_row(session, queue: str, *, generation: int = 1, until_in: float = 60.0, thread_id: str = THREAD) -> WarmThread:
    return WarmThread.objects.create(session=session, queue=queue, thread_id=thread_id, generation=generation,
                                     until=timezone.now() + timedelta(seconds=until_in))


def rollout_row(session, *, thread_id: str = THREAD, generation: int = 1) -> CodexRollout:
    return CodexRollout.objects.create(thread_id=thread_id, session=session, relpath="sessions/x.jsonl", length=8,
                                       sha256="0" * 64, generation=generation)


@pytest.fixture
def sent(monkeypatch) -> list[str]:
    """Turn ids passed to ``dispatch.turn_dispatch_on_commit`` (nothing is sent)."""
    calls: list[str] = []

    def record(turn_id, **_) -> None:  # the stamp the real one writes (the sweep counts from it)
        Turn.objects.filter(pk=turn_id).update(dispatched_at=timezone.now())
        calls.append(str(turn_id))

    monkeypatch.setattr(dispatch, "turn_dispatch_on_commit", record)
    return calls


@pytest.fixture
def fresh_keeper(settings):
    """This process's keeper, made afresh for the test and closed after it."""
    settings.HERMES_WARM_IDLE_SECONDS, settings.HERMES_WARM_MAX_THREADS = 60.0, 4
    kept_mod.close_keeper()
    k = kept_mod.keeper_make()
    assert k is not None
    yield k
    kept_mod.close_keeper()


@pytest.fixture
def broker():
    """The real Redis broker, with Celery sending to it (not eager) for the test."""
    assert django_settings.CELERY_BROKER_URL.startswith("redis"), "these tests need the Redis broker"
    client = redis.Redis.from_url(django_settings.CELERY_BROKER_URL)
    celery_app.conf.task_always_eager = False
    try:
        yield client
    finally:
        celery_app.conf.task_always_eager = True


def forget_queue(client: redis.Redis, queue: str) -> None:
    """Drop an own queue's list and its bindings (its exchange is named after it)."""
    client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")


def is_for(raw: bytes, turn_id: object) -> bool:
    """Whether a broker message is ``run_turn(turn_id)`` (the task id is Celery's own)."""
    headers = json.loads(raw)["headers"]
    return headers["task"] == dispatch.RUN_TURN_TASK and headers["argsrepr"] == repr((str(turn_id),))


def messages_for(client: redis.Redis, queue: str, turn_id: object) -> list[dict]:
    return [json.loads(raw) for raw in client.lrange(queue, 0, -1) if is_for(raw, turn_id)]


def remove_messages(client: redis.Redis, queue: str, turn_id: object) -> None:
    for raw in client.lrange(queue, 0, -1):
        if is_for(raw, turn_id):
            client.lrem(queue, 0, raw)


# --- routing ----------------------------------------------------------------------------------------

def test_a_turn_is_routed_while_the_window_is_open_and_the_holder_is_alive(settings):
    settings.HERMES_WORKER_STALE_SECONDS = 10
    turn = TurnFactory()
    queue = own("a")
    warm_row(turn.session, queue)
    worker_row(queue, age=1)
    assert routing.turn_route(turn.pk) == (routing.Route(queue=queue, wakeable=False), str(turn.session_id))
    TurnWorker.objects.filter(queue=queue).update(wakeable=True)
    assert routing.turn_route(turn.pk) == (routing.Route(queue=queue, wakeable=True), str(turn.session_id))
    assert routing.turn_route(TurnFactory().pk) is None  # another session: no row


def test_no_route_once_the_window_closed(settings):
    turn = TurnFactory()
    queue = own("a")
    warm_row(turn.session, queue, until_in=-1)
    worker_row(queue)
    assert routing.turn_route(turn.pk) is None


def test_no_route_to_a_worker_whose_heartbeat_is_stale_or_gone(settings):
    settings.HERMES_WORKER_STALE_SECONDS = 10
    turn = TurnFactory()
    queue = own("a")
    warm_row(turn.session, queue)
    assert routing.turn_route(turn.pk) is None  # no TurnWorker row at all
    worker_row(queue, age=11)
    assert routing.turn_route(turn.pk) is None


def test_route_is_empty_when_tasks_run_in_process():
    turn = TurnFactory()
    queue = own("a")
    warm_row(turn.session, queue)
    worker_row(queue)
    assert celery_app.conf.task_always_eager is True
    assert dispatch._route(turn.pk) is None


def test_route_follows_the_celery_apps_eager_flag_not_the_django_setting(settings):
    """The e2e tests (and any process whose app sends to the broker) leave Django's setting as read:
    routing must follow what ``apply_async`` obeys, or those tests never exercise it."""
    turn = TurnFactory()
    queue = own("a")
    warm_row(turn.session, queue)
    worker_row(queue)
    settings.CELERY_TASK_ALWAYS_EAGER = True
    celery_app.conf.task_always_eager = False
    try:
        found = dispatch._route(turn.pk)
        assert found is not None and found[0].queue == queue
    finally:
        celery_app.conf.task_always_eager = True


def test_turn_enqueue_wakes_a_listening_holder_instead_of_a_message_and_not_when_tasks_run_in_process(
        monkeypatch, django_capture_on_commit_callbacks):
    """``turn_enqueue`` reads the route in its transaction (``routing.session_route_params``, the rule of
    ``turn_route``): a holder whose listener listens is woken in the transaction and gets no Celery
    message; any other turn goes to the shared queue; an eager app routes nothing; a turn queued behind
    another gets nothing (its predecessor's end dispatches it)."""
    from hermes_sessions import tasks

    sent: list[str | None] = []
    monkeypatch.setattr(tasks.run_turn, "apply_async", lambda args, **kw: sent.append(kw.get("queue")))
    session = SessionFactory()
    queue = own("a")
    warm_row(session, queue)
    worker_row(queue, wakeable=True)

    def enqueue(text: str) -> None:
        Turn.objects.filter(session=session).update(status=Turn.Status.SUCCEEDED)
        with django_capture_on_commit_callbacks(execute=True):
            services.turn_enqueue(session=session, input_text=text, user=session.owner)

    enqueue("one")
    assert sent == [None]  # in-process: no other worker to route to
    sent.clear()
    celery_app.conf.task_always_eager = False
    try:
        enqueue("two")
        assert sent == []  # woken: the wake is the only notification
        with django_capture_on_commit_callbacks(execute=True):
            services.turn_enqueue(session=session, input_text="behind", user=session.owner)
        assert sent == []  # queued behind "two"
        TurnWorker.objects.filter(queue=queue).update(wakeable=False)
        enqueue("three")
        assert sent == [None]  # its listener does not listen: the shared queue
        sent.clear()
        TurnWorker.objects.filter(queue=queue).update(wakeable=True, heartbeat_at=timezone.now() - timedelta(hours=1))
        enqueue("four")
        assert sent == [None]  # the holder's heartbeat is stale: the shared queue
    finally:
        celery_app.conf.task_always_eager = True


def test_route_is_empty_when_it_cannot_be_read(monkeypatch, caplog):
    def broken(turn_id):
        raise RuntimeError("connection lost")

    monkeypatch.setattr(routing, "turn_route", broken)
    celery_app.conf.task_always_eager = False
    try:
        assert dispatch._route(uuid.uuid4()) is None
    finally:
        celery_app.conf.task_always_eager = True
    assert "sending to the shared queue" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_dispatch_wakes_a_listening_holder_and_sends_the_shared_queue_nothing(
        settings, broker, django_capture_on_commit_callbacks):
    """The dispatch of a turn that became its session's next (a finalize, a requeue): the holder is woken
    by NOTIFY after the commit — no message anywhere; a holder that does not listen gets nothing, the
    shared queue the task, with no countdown."""
    shared = settings.HERMES_TURN_QUEUE
    turn = TurnFactory()
    queue = own("a")
    warm_row(turn.session, queue)
    row = worker_row(queue, wakeable=True)
    db = django_settings.DATABASES["default"]
    try:
        with psycopg.connect(host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"],
                             autocommit=True) as listener:
            listener.execute(f"LISTEN {routing.wake_channel(queue)}")
            with django_capture_on_commit_callbacks(execute=True):
                dispatch.turn_dispatch_on_commit(turn.pk)
            notes = [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)]
        assert notes == [f"{turn.pk} {turn.session_id}"]
        assert messages_for(broker, shared, turn.pk) == [] and not broker.exists(queue)
        row.wakeable = False
        row.save()
        with django_capture_on_commit_callbacks(execute=True):
            dispatch.turn_dispatch_on_commit(turn.pk)
        [only] = messages_for(broker, shared, turn.pk)
        assert only["headers"]["eta"] is None and not broker.exists(queue)
    finally:
        remove_messages(broker, shared, turn.pk)


@pytest.mark.django_db(transaction=True)
def test_an_unrouted_turn_goes_to_the_shared_queue_only(settings, broker, django_capture_on_commit_callbacks):
    shared = settings.HERMES_TURN_QUEUE
    turn = TurnFactory()
    try:
        with django_capture_on_commit_callbacks(execute=True):
            dispatch.turn_dispatch_on_commit(turn.pk)
        [only] = messages_for(broker, shared, turn.pk)
        assert only["headers"]["eta"] is None
    finally:
        remove_messages(broker, shared, turn.pk)


# --- turn_finalize records (or forgets) the holder ---------------------------------------------------

def _claimed(session, user, sent, text: str = "hello") -> TurnClaim:
    turn = services.turn_enqueue(session=session, input_text=text, user=user)
    claim = services.turn_claim(turn_id=turn.pk)
    assert claim is not None
    return claim


def _outcome(session, *, status: str = "completed", data: bytes = b'{"turn":1}\n') -> TurnOutcome:
    """A turn codex ran on ``THREAD`` that appended ``data`` to its rollout (after what is stored)."""
    base = rollouts.rollout_state(thread_id=THREAD)
    stored = rollouts.rollout_load(base=base) if base is not None else b""
    whole = stored + data
    delta = RolloutDelta(thread_id=THREAD, relpath=f"sessions/2026/11/30/rollout-x-{THREAD}.jsonl",
                         offset=len(stored), data=data, length=len(whole),
                         sha256=hashlib.sha256(whole).hexdigest(), base=base)
    return TurnOutcome(thread_action="resumed" if base else "started", thread_id=THREAD,
                       codex_turn_id=str(uuid.uuid4()), status=status, final_text="ok", rollout=delta)


def test_a_succeeded_turn_records_its_holder_at_the_stored_generation(user, sent, settings):
    settings.HERMES_WARM_IDLE_SECONDS = 90
    session = SessionFactory(owner=user)
    queue = own("a")
    for n in (1, 2):
        claim = _claimed(session, user, sent, f"turn {n}")
        turn = services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=_outcome(session),
                                      warm_queue=queue)
        assert turn.status == Turn.Status.SUCCEEDED
        row = WarmThread.objects.get(session=session)
        assert (row.queue, row.thread_id) == (queue, THREAD)
        assert row.generation == CodexRollout.objects.get(thread_id=THREAD).generation == n
        assert abs((row.until - (timezone.now() + timedelta(seconds=90))).total_seconds()) < 5


def test_a_succeeded_turn_without_warm_queue_forgets_the_holder(user, sent):
    session = SessionFactory(owner=user)
    warm_row(session, own("old"))
    claim = _claimed(session, user, sent)
    services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=_outcome(session))
    assert not WarmThread.objects.filter(session=session).exists()


def test_a_succeeded_turn_without_a_rollout_records_no_holder(user, sent):
    session = SessionFactory(owner=user)
    claim = _claimed(session, user, sent)
    result = _outcome(session)
    result.rollout = None
    services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=result, warm_queue=own("a"))
    assert not WarmThread.objects.filter(session=session).exists()


@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_a_failed_or_cancelled_turn_forgets_the_holder(user, sent, status):
    session = SessionFactory(owner=user)
    warm_row(session, own("old"))
    claim = _claimed(session, user, sent)
    turn = services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=_outcome(session, status=status),
                                  warm_queue=own("a"))
    assert turn.status in (Turn.Status.FAILED, Turn.Status.CANCELLED)
    assert not WarmThread.objects.filter(session=session).exists()


def test_turn_fail_forgets_the_holder(user, sent):
    session = SessionFactory(owner=user)
    warm_row(session, own("old"))
    claim = _claimed(session, user, sent)
    assert services.turn_fail(turn_id=claim.turn_id, token=claim.token, reason="codex exited").status == "failed"
    assert not WarmThread.objects.filter(session=session).exists()


def test_turn_requeue_leaves_the_holder_a_turn_not_ended_changes_nothing_about_it(user, sent):
    """A requeue ends nothing: no rollout was stored, so the holder's copy is as valid as before
    (``KeptThread.usable_for`` and ``AffinityLoop``'s generation check decide at use); the re-run
    after a requeue runs cold anyway (attempt > 1, ``execution._take_kept``)."""
    session = SessionFactory(owner=user)
    queue = own("old")
    warm_row(session, queue)
    claim = _claimed(session, user, sent)
    assert services.turn_requeue(turn_id=claim.turn_id, token=claim.token, reason="overloaded").status == "queued"
    assert WarmThread.objects.get(session=session).queue == queue
    assert sent[-1] == str(claim.turn_id)


@pytest.mark.django_db(transaction=True)
def test_warm_thread_record_refuses_to_run_outside_the_turns_transaction():
    session = SessionFactory()
    with pytest.raises(transaction.TransactionManagementError):
        routing.warm_thread_record(session=session, queue="q", thread_id=THREAD, generation=1)
    assert not WarmThread.objects.exists()


# --- taken_elsewhere --------------------------------------------------------------------------------

def test_taken_elsewhere_names_each_reason():
    queue, other = own("a"), own("b")
    mine, moved, gone, renamed = SessionFactory(), SessionFactory(), SessionFactory(), SessionFactory()
    threads = {s.pk: f"019a0000-0000-7000-8000-{n:012d}" for n, s in enumerate((mine, moved, gone, renamed))}
    for s in (mine, moved):
        warm_row(s, queue, generation=3, thread_id=threads[s.pk])
    warm_row(renamed, other, generation=3, thread_id=threads[renamed.pk])
    for s in (mine, gone, renamed):
        rollout_row(s, thread_id=threads[s.pk], generation=3)
    rollout_row(moved, thread_id=threads[moved.pk], generation=4)
    forgotten = SessionFactory()  # its rollout deleted (forget_rollout): no generation at all
    threads[forgotten.pk] = "019a0000-0000-7000-8000-000000000099"
    warm_row(forgotten, queue, generation=3, thread_id=threads[forgotten.pk])
    kept = [(s.pk, threads[s.pk], 3) for s in (mine, moved, gone, renamed, forgotten)]
    why = routing.taken_elsewhere(queue=queue, kept=kept)
    assert set(why) == {moved.pk, gone.pk, renamed.pk, forgotten.pk}
    assert why[moved.pk] == "its rollout moved on to generation 4"
    assert why[forgotten.pk] == "its stored rollout is gone"
    assert why[gone.pk] == "its last turn ended on a worker that keeps nothing"
    assert why[renamed.pk] == f"its last turn ended on {other}"
    assert routing.taken_elsewhere(queue=queue, kept=[]) == {}


# --- the sweep --------------------------------------------------------------------------------------

@pytest.mark.django_db(transaction=True)
def test_the_sweep_removes_a_dead_worker_and_dispatches_its_sessions_queued_turns(settings, sent):
    settings.HERMES_WORKER_STALE_SECONDS = 10
    dead, alive = own("dead"), own("alive")
    worker_row(dead, age=30)
    worker_row(alive, age=1)
    waiting, busy, idle, elsewhere = SessionFactory(), SessionFactory(), SessionFactory(), SessionFactory()
    for s in (waiting, busy, idle):
        warm_row(s, dead)
    warm_row(elsewhere, alive)
    head = TurnFactory(session=waiting, seq=1, dispatched_at=timezone.now())
    TurnFactory(session=waiting, seq=2)  # not the head: its head's end dispatches it
    TurnFactory(session=busy, seq=1, status=Turn.Status.RUNNING)
    TurnFactory(session=busy, seq=2)  # its running turn dispatches it when it ends
    TurnFactory(session=elsewhere, seq=1, dispatched_at=timezone.now())
    report = worker.turns_sweep()
    assert report.workers_removed == 1
    assert sent == [str(head.pk)]
    assert list(TurnWorker.objects.values_list("queue", flat=True)) == [alive]
    assert list(WarmThread.objects.values_list("session_id", flat=True)) == [elsewhere.pk]
    assert worker.turns_sweep().workers_removed == 0


@pytest.mark.django_db(transaction=True)
def test_the_sweep_passes_over_a_worker_row_another_transaction_holds(settings):
    """A worker frozen inside a transaction on its ``TurnWorker`` row must not hold the sweep (and with it
    lease recovery): the sweep skips a locked row for that round; the heartbeat holds no lock across
    statements."""
    settings.HERMES_WORKER_STALE_SECONDS = 10
    frozen = own("frozen-mid-write")
    worker_row(frozen, age=30)
    db = django_settings.DATABASES["default"]
    with psycopg.connect(host=db["HOST"], port=db["PORT"] or 5432, user=db["USER"], dbname=db["NAME"]) as other:
        other.execute("SELECT 1 FROM hermes_sessions_turnworker WHERE queue = %s FOR UPDATE", (frozen,))
        started = time.monotonic()
        assert worker.turns_sweep().workers_removed == 0
        assert time.monotonic() - started < 5
    assert worker.turns_sweep().workers_removed == 1  # released: the next round removes it
    assert not TurnWorker.objects.filter(queue=frozen).exists()


# --- the affinity loop ------------------------------------------------------------------------------

def _kept_sessions(keeper, sessions, *, generation: int):
    """Each of ``sessions`` with a stored rollout at ``generation`` and a kept copy of it in ``keeper``;
    returns ``({session id: thread id}, {session id: copy})``."""
    threads = {s.pk: f"019a0000-0000-7000-8000-{n:012d}" for n, s in enumerate(sessions)}
    copies = {}
    for s in sessions:
        rollout_row(s, thread_id=threads[s.pk], generation=generation)
        copies[s.pk] = make_kept(s.pk, thread_id=threads[s.pk], generation=generation)
        assert keeper.keep(copies[s.pk]) == []
    return threads, copies


def test_a_tick_beats_releases_taken_copies_and_forgets_expired_ones(fresh_keeper, settings):
    queue = routing.route_name("w1@host")
    keeps, taken, idle = SessionFactory(), SessionFactory(), SessionFactory()
    threads, copies = _kept_sessions(fresh_keeper, (keeps, taken, idle), generation=2)
    other = own("other")
    warm_row(keeps, queue, generation=2, thread_id=threads[keeps.pk])
    warm_row(taken, other, generation=2, thread_id=threads[taken.pk])
    warm_row(idle, queue, generation=2, thread_id=threads[idle.pk])
    copies[idle.pk].kept_at -= settings.HERMES_WARM_IDLE_SECONDS + 1

    affinity.AffinityLoop(fresh_keeper, queue).tick()

    assert [s for s, _, _ in fresh_keeper.kept_threads()] == [keeps.pk]
    assert copies[taken.pk].client.closes == 1 and copies[idle.pk].client.closes == 1
    assert copies[keeps.pk].client.closes == 0
    assert set(WarmThread.objects.values_list("session_id", "queue")) == {(keeps.pk, queue), (taken.pk, other)}
    row = TurnWorker.objects.get(queue=queue)
    assert (row.node, row.pid, row.kept) == ("w1@host", os.getpid(), 1)
    assert timezone.now() - row.heartbeat_at < timedelta(seconds=5)


def test_a_turn_its_holder_has_not_claimed_within_the_deadline_goes_cold_once(settings, sent):
    """Whatever keeps the holder from claiming a woken turn — busy with another session's turn, frozen,
    dead, or the wake lost — the sweep's round (every worker's) dispatches it to the shared queue once
    ``HERMES_AFFINITY_DEADLINE`` has passed since it was dispatched: the routing row goes (the turn runs
    cold wherever it lands), ``dispatched_at`` moves on, and a second caller finds nothing to do. A turn
    dispatched within the deadline, or queued behind a running one, is left alone."""
    from hermes_sessions.worker import recovery

    busy, frozen = own("busy"), own("frozen")
    worker_row(busy)
    worker_row(frozen, age=2 * settings.HERMES_WORKER_HEARTBEAT_SECONDS + 1)
    long_ago = timezone.now() - timedelta(seconds=settings.HERMES_AFFINITY_DEADLINE + 1)
    overdue = []
    for queue in (busy, frozen, own("gone")):  # the last one's worker has no row at all
        s = SessionFactory()
        warm_row(s, queue)
        overdue.append(TurnFactory(session=s, seq=1, status=Turn.Status.QUEUED, dispatched_at=long_ago).pk)
    fresh_one, claimed = SessionFactory(), SessionFactory()
    warm_row(fresh_one, busy)
    warm_row(claimed, busy)
    TurnFactory(session=fresh_one, seq=1, status=Turn.Status.QUEUED, dispatched_at=timezone.now())
    TurnFactory(session=claimed, seq=1, status=Turn.Status.RUNNING)
    TurnFactory(session=claimed, seq=2, status=Turn.Status.QUEUED, dispatched_at=long_ago)  # behind a running one

    assert recovery.turns_dispatch_unclaimed(limit=20, by="worker a") == 3
    assert recovery.turns_dispatch_unclaimed(limit=20, by="worker b") == 0

    assert sorted(sent) == sorted(str(t) for t in overdue)
    assert set(WarmThread.objects.values_list("session_id", flat=True)) == {fresh_one.pk, claimed.pk}
    assert all(timezone.now() - t < timedelta(seconds=5)
               for t in Turn.objects.filter(pk__in=overdue).values_list("dispatched_at", flat=True))


def test_a_clean_stop_forgets_the_workers_rows():
    queue = own("a")
    worker_row(queue, host=socket.gethostname(), pid=os.getpid())
    warm_row(SessionFactory(), queue)
    keeps = warm_row(SessionFactory(), own("b"))
    routing.worker_gone(queue=queue)
    assert not TurnWorker.objects.filter(queue=queue).exists()
    assert list(WarmThread.objects.values_list("session_id", flat=True)) == [keeps.session_id]


# --- execution: taking a kept copy, settling after the commit ----------------------------------------

def _claim(session_id: str, *, generation: int | None = 2, attempt: int = 1, config: dict | None = None) -> TurnClaim:
    return TurnClaim(turn_id=uuid.uuid4(), session_id=session_id, token=uuid.uuid4(), input_text="hi",
                     thread_id=THREAD, rollout_generation=generation, config=dict(config or CONFIG), attempt=attempt)


def _kept_on_disk(tmp_path: Path, session_id: str, generation: int = 2):
    home = tmp_path / session_id
    write_rollout_file(home, THREAD)
    return make_kept(session_id, home=home, thread_id=THREAD, generation=generation)


def test_a_usable_kept_copy_is_taken_for_the_turn(fresh_keeper, tmp_path):
    copy = _kept_on_disk(tmp_path, "s-use")
    fresh_keeper.keep(copy)
    assert execution._take_kept(_claim("s-use")) is copy
    assert copy.client.closes == 0 and fresh_keeper.kept_threads() == []


@pytest.mark.parametrize("claim_kwargs", [
    {"generation": 3},  # another worker stored a turn since
    {"config": {**CONFIG, "model": "other"}},  # settings changed
    {"attempt": 2},  # a re-run after a lost worker runs cold
], ids=["generation", "config", "re-run"])
def test_an_unusable_kept_copy_is_closed_and_the_turn_runs_cold(fresh_keeper, tmp_path, claim_kwargs):
    copy = _kept_on_disk(tmp_path, "s-cold")
    fresh_keeper.keep(copy)
    assert execution._take_kept(_claim("s-cold", **claim_kwargs)) is None
    assert copy.client.closes == 1 and fresh_keeper.kept_threads() == []


def test_no_kept_copy_without_a_keeper(settings):
    settings.HERMES_WARM_IDLE_SECONDS = 0
    kept_mod.close_keeper()
    assert execution._take_kept(_claim("s-none")) is None


def _handover_running(tmp_path: Path) -> tuple[execution._Handover, FakeClient]:
    client = FakeClient(pid=None)
    handover = execution._Handover(may_keep=True)
    home = tmp_path / "home"
    write_rollout_file(home, THREAD)
    handover.running = execution._Running(client=client, home=home, version="0.171.0",
                                      release=client.close, turns=2)
    return handover, client


def test_settle_keeps_the_app_server_after_a_succeeded_commit(user, sent, fresh_keeper, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(affinity, "affinity_start", lambda k, **_: started.append(k))
    queue = own("a")
    monkeypatch.setenv(routing.OWN_ROUTE_ENV, queue)
    session = SessionFactory(owner=user)
    handover, client = _handover_running(tmp_path)
    claim = _claimed(session, user, sent)
    outcome = _outcome(session)
    assert handover.queue() == queue
    turn = services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=outcome, warm_queue=handover.queue())
    handover.settle(claim, outcome, turn)
    handover.close()
    assert client.closes == 0 and started == [fresh_keeper]
    [(session_id, thread_id, generation)] = fresh_keeper.kept_threads()
    row = WarmThread.objects.get(session=session)
    assert (session_id, thread_id) == (session.pk, THREAD) and (row.queue, row.thread_id) == (queue, THREAD)
    assert generation == row.generation == CodexRollout.objects.get(thread_id=THREAD).generation
    copy = fresh_keeper.take(session.pk)
    assert copy.turns == 2 and copy.stamp is not None and copy.config == claim.config


@pytest.mark.parametrize("case", ["failed", "not committed", "no rollout"])
def test_settle_closes_the_app_server_otherwise(user, sent, fresh_keeper, tmp_path, monkeypatch, case):
    monkeypatch.setattr(affinity, "affinity_start", lambda k, **_: None)
    session = SessionFactory(owner=user)
    handover, client = _handover_running(tmp_path)
    claim = _claimed(session, user, sent)
    outcome = _outcome(session, status="failed" if case == "failed" else "completed")
    if case == "no rollout":
        outcome.rollout = None
    turn = services.turn_finalize(turn_id=claim.turn_id, token=claim.token, result=outcome, warm_queue=own("a"))
    handover.settle(claim, outcome, None if case == "not committed" else turn)
    assert fresh_keeper.kept_threads() == [] and client.closes == 0
    handover.close()
    assert client.closes == 1 and handover.running is None


def test_an_app_server_may_not_be_kept_without_a_route(fresh_keeper, monkeypatch):
    monkeypatch.delenv(routing.OWN_ROUTE_ENV, raising=False)
    assert execution._Handover().may_keep is False
    monkeypatch.setenv(routing.OWN_ROUTE_ENV, own("a"))
    assert execution._Handover().may_keep is True


def test_a_turn_that_fails_on_a_kept_copy_releases_it(fresh_keeper, scripted_codex, tmp_path, monkeypatch):
    """A kept copy that came from the warm pool is released with its home (``Spare.discard``) when a
    turn on it fails, as when it succeeds: closing only its process would leave the spare's home behind."""
    spare_home = tmp_path / "spare-7" / "home"
    write_rollout_file(spare_home, THREAD)
    copy = make_kept("s-fail", home=spare_home, thread_id=THREAD, generation=2)

    def discard() -> None:
        copy.client.close()
        shutil.rmtree(spare_home.parent, ignore_errors=True)

    copy.close = discard
    fresh_keeper.keep(copy)

    def fails(client, spec):
        raise TurnRunError("codex exited mid-turn", TurnOutcome(), before_turn_start=False)

    monkeypatch.setattr(execution, "drive_turn", fails)
    handover = execution._Handover(may_keep=True)
    with pytest.raises(TurnRunError):
        execution._run_once(_claim("s-fail"), TurnControl(), handover=handover)
    assert copy.client.closes >= 1 and handover.running is None
    assert not spare_home.parent.exists()


def test_a_turn_completed_on_a_kept_copy_is_held_for_keeping_again(fresh_keeper, scripted_codex, tmp_path, monkeypatch):
    """The warm path end to end but for codex: the copy runs the turn (no restore, no spawn), what the
    turn appended is read while the process still runs, and the process is left in ``handover``."""
    home = tmp_path / "warm" / "home"
    before = b'{"turn":1}\n'
    path = write_rollout_file(home, THREAD, data=before)
    copy = make_kept("s-warm", home=home, thread_id=THREAD, generation=2)
    copy.base = RolloutBase(thread_id=THREAD, relpath=str(path.relative_to(home)), length=len(before),
                            sha256=hashlib.sha256(before).hexdigest(), generation=2)
    fresh_keeper.keep(copy)

    def completes(client, spec):
        assert client is copy.client and spec.thread_id == THREAD
        with open(path, "ab") as fh:
            fh.write(b'{"turn":2}\n')
        return TurnOutcome(thread_action="resumed", thread_id=THREAD, codex_turn_id="t2", status="completed")

    monkeypatch.setattr(execution, "drive_turn", completes)
    handover = execution._Handover(may_keep=True)
    outcome = execution._run_once(_claim("s-warm"), TurnControl(), handover=handover)
    assert outcome.rollout.data == b'{"turn":2}\n' and outcome.rollout.base == copy.base
    assert (outcome.timings["warm"], outcome.timings["restore_ms"]) == (1, 0.0)
    assert handover.owns(copy.client) and handover.running.turns == 2 and copy.client.closes == 0
    handover.close()
    assert copy.client.closes == 1


@pytest.mark.django_db(transaction=True)
def test_the_heartbeat_runs_from_start_to_a_clean_stop(fresh_keeper, settings, monkeypatch):
    """``affinity_start`` (pool process start, or the first kept thread) beats on its own connection
    at once; ``affinity_stop`` (worker shutdown) stops it and forgets the worker's rows."""
    settings.HERMES_WORKER_HEARTBEAT_SECONDS = 0.05
    monkeypatch.delenv(routing.OWN_ROUTE_ENV, raising=False)
    assert affinity.affinity_start(fresh_keeper) is None  # no own queue: nothing to route to this process
    queue = own("a")
    monkeypatch.setenv(routing.OWN_ROUTE_ENV, queue)
    warm_row(SessionFactory(), queue)
    loop = affinity.affinity_start(fresh_keeper)
    try:
        assert loop is not None and affinity.affinity_start(fresh_keeper) is loop  # once per process
        deadline = timezone.now() + timedelta(seconds=5)
        while not TurnWorker.objects.filter(queue=queue).exists():
            assert timezone.now() < deadline, "no heartbeat row"
            time.sleep(0.01)
        first = TurnWorker.objects.get(queue=queue).heartbeat_at
        while TurnWorker.objects.get(queue=queue).heartbeat_at == first:
            assert timezone.now() < deadline, "the heartbeat is not renewed"
            time.sleep(0.01)
    finally:
        affinity.affinity_stop([])
    assert not TurnWorker.objects.filter(queue=queue).exists() and not WarmThread.objects.exists()


# --- two processes with one node name --------------------------------------------------------------

@pytest.fixture
def live_namesake():
    """Another live process on this host (the pid in a namesake worker's row)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc.pid
    proc.kill()
    proc.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_heartbeat_refuses_a_row_a_live_namesake_holds_and_takes_over_a_dead_ones(live_namesake):
    """A worker frozen (SIGSTOP) until the sweep removed it, and a namesake started meanwhile, took its
    queue; after SIGCONT both would write the one ``TurnWorker`` row in turn. The first live holder keeps
    it; the other is told why."""
    queue = own("same")
    worker_row(queue, host=socket.gethostname(), pid=live_namesake)
    why = routing.worker_heartbeat(queue=queue, kept=3)
    assert f"live process {live_namesake}" in why
    assert TurnWorker.objects.get(queue=queue).pid == live_namesake

    TurnWorker.objects.filter(queue=queue).update(pid=_dead_pid())  # it died with its heartbeat still fresh
    assert routing.worker_heartbeat(queue=queue, kept=1) == ""
    row = TurnWorker.objects.get(queue=queue)
    assert (row.pid, row.kept, row.host) == (os.getpid(), 1, socket.gethostname())

    other_host = own("elsewhere")
    worker_row(other_host, host="another-host", pid=os.getpid())
    assert "on host another-host" in routing.worker_heartbeat(queue=other_host, kept=0)
    TurnWorker.objects.filter(queue=other_host).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    assert routing.worker_heartbeat(queue=other_host, kept=0) == ""  # a stale row is nobody's


def test_a_loop_that_finds_a_live_namesake_closes_its_copies_and_stops_keeping(
        fresh_keeper, live_namesake, monkeypatch, caplog):
    queue = routing.route_name("frozen@host")
    monkeypatch.setenv(routing.OWN_ROUTE_ENV, queue)
    s = SessionFactory()
    _, copies = _kept_sessions(fresh_keeper, [s], generation=1)
    worker_row(queue, host=socket.gethostname(), pid=live_namesake)
    theirs = warm_row(SessionFactory(), queue)
    loop = affinity.AffinityLoop(fresh_keeper, queue)

    loop.tick()

    assert fresh_keeper.kept_threads() == [] and copies[s.pk].client.closes == 1
    assert routing.own_route() == ""  # no more keeping in this process: _Handover.may_keep is False
    assert loop.yielded
    from hermes_sessions.worker import recovery

    assert process.runtime().sweep is not None  # it still sweeps, as a process without a route does
    recovery.sweep_loop_stop()
    assert TurnWorker.objects.get(queue=queue).pid == live_namesake
    routing.worker_gone(queue=queue)  # this process's clean stop leaves the namesake's rows alone
    assert TurnWorker.objects.filter(queue=queue).exists() and WarmThread.objects.filter(pk=theirs.pk).exists()
    assert any("keeps no thread loaded from now on" in r.getMessage() for r in caplog.records)


# --- a frozen or dead holder ------------------------------------------------------------------------

def test_a_worker_swept_while_frozen_writes_its_row_again_at_its_next_beat(fresh_keeper):
    """A worker frozen past ``HERMES_WORKER_STALE_SECONDS`` is swept (its rows deleted); woken with no
    namesake started meanwhile, its next beat writes its row again, and turns are routed to it again."""
    queue = routing.route_name("revived@host")
    loop = affinity.AffinityLoop(fresh_keeper, queue)
    loop.tick()
    TurnWorker.objects.filter(queue=queue).delete()  # the sweep, while it was frozen
    loop._beat_due = 0.0
    loop.tick()
    assert TurnWorker.objects.get(queue=queue).pid == os.getpid()


def test_a_kept_app_server_that_died_as_its_turn_was_sent_runs_the_turn_again_cold(tmp_path):
    """A kept app-server SIGKILLed between turns (e2e/test_affinity): its death is not yet seen
    when the copy is taken, turn/start is written, then its stdout closes. Its rollout file is as kept
    and no turn id came back: codex recorded nothing, so the failure counts as before turn/start (the
    turn is run again on a fresh app-server). A trace of the turn in the file, or an answer, does not."""
    from hermes_sessions.codex.errors import TransportError

    def failure(turn_id: str = "") -> TurnRunError:
        return TurnRunError("eof", TurnOutcome(codex_turn_id=turn_id), TransportError("closed its stdout (EOF)"),
                            before_turn_start=False)

    copy = _kept_on_disk(tmp_path, "s-died")
    copy.client.running = False
    exc = failure()
    execution._unless_recorded(exc, copy)
    assert exc.before_turn_start is True and execution._may_retry(exc)

    answered = failure("turn-1")
    execution._unless_recorded(answered, copy)
    assert answered.before_turn_start is False

    copy.client.running = True  # alive: a lost connection, not a death — codex may be running the turn
    alive = failure()
    execution._unless_recorded(alive, copy)
    assert alive.before_turn_start is False

    copy.client.running = False
    write_rollout_file(copy.home, THREAD, b'{"a":1}\n{"user":"hi"}\n')  # codex recorded the turn
    recorded = failure()
    execution._unless_recorded(recorded, copy)
    assert recorded.before_turn_start is False


# --- lease recovery without beat (the function itself: test_lease_take_back.py) ---------------------------

def test_an_affinity_loop_tick_takes_back_expired_leases(fresh_keeper, sent):
    """The worker embedding beat killed -9: a live worker's loop round requeues the dead worker's turn, with no
    beat running; a live turn is left alone."""
    queue = own("live")
    lost, live = (TurnFactory(session=SessionFactory(), seq=1, status=Turn.Status.RUNNING, attempt=1,
                              claim_token=uuid.uuid4(), lease_expires_at=timezone.now() + timedelta(seconds=s))
                  for s in (-1, 30))

    affinity.AffinityLoop(fresh_keeper, queue).tick()

    lost.refresh_from_db()
    live.refresh_from_db()
    assert (lost.status, live.status) == (Turn.Status.QUEUED, Turn.Status.RUNNING)
    assert sent == [str(lost.pk)]  # through recovery's own dispatch, as the sweep's


def test_a_tick_runs_the_sweeps_round_after_its_heartbeat_and_beats_only_when_due(fresh_keeper, monkeypatch, settings):
    """Every round (``recovery.sweep_round_seconds()``, ≤ 1 s) sweeps; the heartbeat is written every
    ``HERMES_WORKER_HEARTBEAT_SECONDS``, before the round's sweep."""
    from hermes_sessions.worker import recovery

    settings.HERMES_WORKER_HEARTBEAT_SECONDS = 60
    assert recovery.sweep_round_seconds() == 1.0
    queue = own("live")
    calls: list = []
    monkeypatch.setattr(affinity, "sweep_round", lambda **kw: calls.append((kw, TurnWorker.objects.get(queue=queue).heartbeat_at)))
    loop = affinity.AffinityLoop(fresh_keeper, queue)
    loop.tick()
    loop.tick()
    assert [kw for kw, _ in calls] == [{"by": f"worker {queue}"}] * 2
    assert calls[0][1] == calls[1][1]  # one beat in the two rounds


def test_a_pool_process_starts_its_affinity_loop_or_else_a_sweep_loop(monkeypatch, fresh_keeper):
    """``project/celery.py`` at a pool process's start: with a route, the affinity loop (it sweeps too);
    without one, a ``recovery.SweepLoop`` — recovery never depends on beat alone."""
    from hermes_sessions.worker import execution, recovery, runners
    from hermes_sessions.worker.warm import kept
    from hermes_sessions.worker.warm import spares as warm
    from project import celery as celery_module

    started: list = []
    monkeypatch.setattr(runners, "runners_start", lambda: None)  # the test process keeps running turns on its thread
    monkeypatch.setattr(kept, "keeper_make", lambda: fresh_keeper)
    monkeypatch.setattr(warm, "spare_pool", lambda: None)
    monkeypatch.setattr(recovery, "sweep_loop_start", lambda by: started.append(("sweep", by)))
    monkeypatch.setattr(execution, "start_affinity", lambda k: started.append(("affinity", k)) or "loop")
    celery_module._start_worker_process()
    assert started == [("affinity", fresh_keeper)]
    started.clear()
    monkeypatch.setattr(execution, "start_affinity", lambda k: None)  # no route
    celery_module._start_worker_process()
    assert started == [("sweep", f"worker process {os.getpid()}")]




def test_a_sweep_round_with_nothing_to_do_is_one_query_per_kind(django_assert_num_queries, settings):
    """Every worker process runs the round each second: with nothing due it reads expired leases, unclaimed
    head turns, stale workers and due webhook deliveries (the claim's UPDATE, which finds none), one query
    each, and writes nothing."""
    from hermes_sessions.worker import recovery

    TurnFactory(status=Turn.Status.QUEUED, dispatched_at=timezone.now())  # dispatched just now: not due
    with django_assert_num_queries(4):
        report = recovery.sweep_round(by="worker test")
    assert (report.requeued, report.failed, report.redispatched, report.workers_removed,
            report.webhooks_claimed) == (0, 0, 0, 0, 0)


def test_a_send_the_broker_refused_is_dispatched_again_at_the_next_round(monkeypatch, caplog,
                                                                         django_capture_on_commit_callbacks):
    """The broker is down at the send: the turn's ``dispatched_at`` is cleared, and the next sweep round
    dispatches it (not after ``HERMES_REDISPATCH_SECONDS``)."""
    from hermes_sessions.worker import recovery

    class Down:
        def apply_async(self, **_):
            raise ConnectionRefusedError("broker down")

    monkeypatch.setattr(dispatch, "_run_turn_task", lambda: Down())
    turn = TurnFactory(status=Turn.Status.QUEUED)
    with django_capture_on_commit_callbacks(execute=True):
        dispatch.turn_dispatch_on_commit(turn.pk)
    assert Turn.objects.get(pk=turn.pk).dispatched_at is None
    assert "could not be dispatched; the sweep will dispatch it" in caplog.text
    sent: list = []
    monkeypatch.setattr(recovery.dispatch, "turn_dispatch_on_commit", lambda turn_id, **kw: sent.append((turn_id, kw)))
    assert recovery.turns_dispatch_unclaimed(limit=20, by="worker test") == 1
    assert sent == [(turn.pk, {"wake": False})]
