"""Waking a session's holder by PostgreSQL ``NOTIFY`` (``worker/wake.py``): what the enqueue sends and
when, the listener thread, the process's one turn slot, and the deliveries that find a woken turn run.

Real PostgreSQL (the notifications are PostgreSQL's own, received on a connection of the test's) and the
real Redis broker where messages are sent; no codex runs. The whole path with real workers and the real
codex binary: ``tests/e2e/test_affinity.py`` (``timings["woken"]``).
"""
from __future__ import annotations

import os
import threading
import time
import uuid

import psycopg
import pytest
from django.db import connection, transaction
from django.utils import timezone

from hermes_sessions import services, tasks, worker
from hermes_sessions.listener import connection_params
from hermes_sessions.models import Turn, TurnWorker
from hermes_sessions.services import pipelining, routing
from hermes_sessions.worker import execution, process, wake
from project.celery import app as celery_app
from tests.factories import SessionFactory, TurnFactory

from .test_affinity import broker, forget_queue, messages_for, own, remove_messages, warm_row, worker_row  # noqa: F401

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(30)]


class Listening:
    """A ``LISTEN`` on one channel on a connection of the test's own (autocommit)."""

    def __init__(self, channel: str) -> None:
        self.conn = psycopg.Connection.connect(**connection_params("test-wake"), autocommit=True)
        self.conn.execute(f"LISTEN {channel}")

    def payloads(self, wait: float = 0.5) -> list[str]:
        return [n.payload for n in self.conn.notifies(timeout=wait, stop_after=10)]

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def listening():
    opened: list[Listening] = []

    def listen(queue: str) -> Listening:
        opened.append(Listening(routing.wake_channel(queue)))
        return opened[-1]

    yield listen
    for one in opened:
        one.close()


# --- the route and the channel ------------------------------------------------------------------------

def test_parse_route_reads_the_route_subquerys_value():
    assert routing.parse_route(None) is None and routing.parse_route("") is None
    assert routing.parse_route("wake:turns.a@h") == routing.Route("turns.a@h", wakeable=True)
    assert routing.parse_route("queue:turns.a@h") == routing.Route("turns.a@h", wakeable=False)
    assert routing.parse_route("queue:") is None


def test_a_wakes_payload_carries_the_input_when_it_fits_and_a_bad_hint_is_dropped_not_the_wake():
    turn = uuid.uuid4()
    text = "line one\nline two — ünïcode\n"
    payload = routing.wake_payload(turn_id=turn, session_id="sess-1", text=text, sent_at=1700000000.25)
    assert routing.parse_payload(payload) == (turn, "sess-1", routing.WakeHint(text=text, sent_at=1700000000.25))
    assert routing.wake_payload(turn_id=turn, session_id="sess-1") == f"{turn} sess-1"
    assert routing.parse_payload(f"{turn} sess-1") == (turn, "sess-1", None)
    # PostgreSQL refuses a payload of 8000 bytes or more: a longer input goes without the hint.
    big = "é" * 4000  # 8000 bytes in UTF-8
    assert routing.wake_payload(turn_id=turn, session_id="sess-1", text=big) == f"{turn} sess-1"
    fits = "x" * (routing.NOTIFY_PAYLOAD_MAX_BYTES - 100)
    assert routing.parse_payload(routing.wake_payload(turn_id=turn, session_id="s", text=fits))[2].text == fits
    for bad in (f"{turn} s\nnot a time\nhi", f"{turn} s\n1700000000.0", f"{turn} s\n1700000000.0\n"):
        assert routing.parse_payload(bad) == (turn, "s", None)


@pytest.mark.django_db(transaction=True)
def test_a_big_input_still_wakes_its_holder_and_early_start_off_sends_no_input(
        settings, broker, listening, django_capture_on_commit_callbacks):  # noqa: F811
    queue = own("wake-big")
    session = SessionFactory()
    warm_row(session, queue)
    worker_row(queue, wakeable=True)
    heard = listening(queue)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            big = services.turn_enqueue(session=session, input_text="ü" * 5000, user=session.owner)
        assert heard.payloads() == [f"{big.pk} {session.pk}"]  # PostgreSQL took it: the wake went out
        Turn.objects.filter(pk=big.pk).update(status=Turn.Status.SUCCEEDED)  # so the next one is the session's next
        settings.HERMES_EARLY_START = False
        with django_capture_on_commit_callbacks(execute=True):
            small = services.turn_enqueue(session=session, input_text="hi", user=session.owner)
        assert heard.payloads() == [f"{small.pk} {session.pk}"]
    finally:
        forget_queue(broker, queue)
        remove_messages(broker, settings.HERMES_TURN_QUEUE, big.pk)
        remove_messages(broker, settings.HERMES_TURN_QUEUE, small.pk)


def test_a_channel_name_fits_postgresqls_identifier_limit_for_any_queue():
    long = own("n" * 300)
    assert len(routing.wake_channel(long)) <= 63 and routing.wake_channel(long).startswith("hermes_wake_")
    assert routing.wake_channel(long) != routing.wake_channel(own("n" * 300))


@pytest.mark.parametrize("wakeable", [True, False])
def test_the_heartbeat_records_whether_the_listener_listens(wakeable):
    queue = own("beat")
    assert routing.worker_heartbeat(queue=queue, kept=2, wakeable=wakeable) == ""
    row = TurnWorker.objects.get(queue=queue)
    assert (row.kept, row.wakeable) == (2, wakeable)
    assert routing.worker_heartbeat(queue=queue, kept=1, wakeable=not wakeable) == ""
    assert TurnWorker.objects.get(queue=queue).wakeable is (not wakeable)


# --- what the enqueue sends ---------------------------------------------------------------------------

def _enqueue(session, text: str, captured):
    with captured(execute=True):
        return services.turn_enqueue(session=session, input_text=text, user=session.owner)


@pytest.mark.django_db(transaction=True)
def test_a_turn_for_a_wakeable_holder_wakes_it_at_the_commit_and_sends_no_message(
        settings, broker, listening, django_capture_on_commit_callbacks):  # noqa: F811
    """The wake is the only notification (its Celery message's ~3 ms of CPU competed with the woken claim);
    should the holder not claim the turn, the sweep dispatches it (``recovery.turns_dispatch_unclaimed``)."""
    shared, queue = settings.HERMES_TURN_QUEUE, own("wake")
    session = SessionFactory()
    warm_row(session, queue)
    worker_row(queue, wakeable=True)
    heard = listening(queue)
    try:
        with django_capture_on_commit_callbacks(execute=True), transaction.atomic():
            turn = services.turn_enqueue(session=session, input_text="hi", user=session.owner)
            assert heard.payloads(wait=0.3) == []  # not before the commit
        [payload] = heard.payloads()
        woken_turn, woken_session, hint = routing.parse_payload(payload)
        assert (woken_turn, woken_session, hint.text) == (turn.pk, session.pk, "hi")  # the input: early_start.py
        assert 0 <= time.time() - hint.sent_at < 5
        time.sleep(0.3)
        assert messages_for(broker, shared, turn.pk) == [] and not broker.exists(queue)
    finally:
        remove_messages(broker, shared, turn.pk)


@pytest.mark.django_db(transaction=True)
def test_a_holder_that_does_not_listen_gets_no_wake_and_the_shared_queue_the_turn(
        settings, broker, listening, django_capture_on_commit_callbacks):  # noqa: F811
    shared, queue = settings.HERMES_TURN_QUEUE, own("nowake")
    session = SessionFactory()
    warm_row(session, queue)
    worker_row(queue, wakeable=False)
    heard = listening(queue)
    try:
        turn = _enqueue(session, "hi", django_capture_on_commit_callbacks)
        assert heard.payloads() == []
        assert len(messages_for(broker, shared, turn.pk)) == 1 and not broker.exists(queue)
    finally:
        remove_messages(broker, shared, turn.pk)


@pytest.mark.django_db(transaction=True)
def test_a_turn_queued_behind_another_wakes_nobody(settings, broker, listening, django_capture_on_commit_callbacks):  # noqa: F811
    """The holder claims it only after the running one ends; that one's finalize dispatches it."""
    shared, queue = settings.HERMES_TURN_QUEUE, own("busy")
    session = SessionFactory(last_turn_seq=1)
    TurnFactory(session=session, seq=1, status=Turn.Status.RUNNING)
    warm_row(session, queue)
    worker_row(queue, wakeable=True)
    heard = listening(queue)
    turn = None
    try:
        turn = _enqueue(session, "behind", django_capture_on_commit_callbacks)
        assert turn.status == Turn.Status.QUEUED and heard.payloads() == []
        assert messages_for(broker, shared, turn.pk) == []  # nor a message: the running one's end dispatches it
    finally:
        if turn is not None:
            remove_messages(broker, shared, turn.pk)


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_enqueue_wakes_nobody(listening, monkeypatch):
    """The NOTIFY rides in the enqueue's transaction: PostgreSQL drops it with a rollback."""
    queue = own("rollback")
    session = SessionFactory()
    warm_row(session, queue)
    worker_row(queue, wakeable=True)
    heard = listening(queue)
    celery_app.conf.task_always_eager = False
    real_send = pipelining.Batch.send

    def send_then_fail(self, *, commit=False):
        real_send(self)  # every batched statement runs in the transaction, the wake's pg_notify included …
        if commit:
            raise RuntimeError("… and the COMMIT never comes")

    monkeypatch.setattr(pipelining.Batch, "send", send_then_fail)
    try:
        with pytest.raises(RuntimeError):
            services.turn_enqueue(session=session, input_text="lost", user=session.owner)
    finally:
        celery_app.conf.task_always_eager = True
    assert heard.payloads() == [] and not Turn.objects.filter(session=session).exists()


@pytest.mark.django_db(transaction=True)
def test_tasks_run_in_process_wake_nobody(listening, django_capture_on_commit_callbacks, monkeypatch):
    ran: list = []
    monkeypatch.setattr(worker, "turn_run", lambda **kw: ran.append(kw["turn_id"]))
    queue = own("eager")
    session = SessionFactory()
    warm_row(session, queue)
    worker_row(queue, wakeable=True)
    heard = listening(queue)
    assert celery_app.conf.task_always_eager is True
    turn = _enqueue(session, "here", django_capture_on_commit_callbacks)
    assert heard.payloads() == [] and ran == [str(turn.pk)]


# --- the listener ---------------------------------------------------------------------------------------

def _notify(queue: str, payload: str) -> None:
    with psycopg.Connection.connect(**connection_params("test-wake-sender"), autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", [routing.wake_channel(queue), payload])


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.django_db(transaction=True)
def test_the_listener_runs_each_wake_skips_malformed_ones_and_survives_a_failing_run(caplog):
    queue = own("listen")
    ran: list[tuple[uuid.UUID, str]] = []

    def run(turn_id: uuid.UUID, session_id: str, hint: routing.WakeHint | None) -> None:
        ran.append((turn_id, session_id))
        if session_id == "boom":
            raise RuntimeError("the run failed")

    listener = wake.WakeListener(queue, run)
    listener.start()
    try:
        assert listener.listening.wait(10)
        first, second = uuid.uuid4(), uuid.uuid4()
        for payload in ("not a wake", f"{first} boom", "\x01" * 50, f"{second} s-2"):
            _notify(queue, payload)
        _wait_for(lambda: len(ran) == 2)
        assert ran == [(first, "boom"), (second, "s-2")]
        assert "ignoring payload 'not a wake'" in caplog.text and "the run failed" in caplog.text
        _notify(own("other"), f"{uuid.uuid4()} s-x")  # another worker's channel
        time.sleep(0.3)
        assert len(ran) == 2
    finally:
        listener.stop()
    assert not listener.is_alive() and not listener.listening.is_set()


@pytest.mark.django_db(transaction=True)
def test_a_wake_that_arrived_while_the_listener_ran_another_loses_its_hint(caplog):
    """Its own clock says nothing of how long it waited here (another host's clock may be off): a wake the
    listener is handed right after a run ended waited behind it, so no early turn/start."""
    queue = own("behind")
    seen: list[tuple[uuid.UUID, bool]] = []

    def run(turn_id: uuid.UUID, session_id: str, hint: routing.WakeHint | None) -> None:
        seen.append((turn_id, hint is not None))
        if len(seen) == 1:
            time.sleep(0.3)  # the second wake arrives meanwhile

    listener = wake.WakeListener(queue, run)
    listener.start()
    try:
        assert listener.listening.wait(10)
        first, second, third = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
        _notify(queue, routing.wake_payload(turn_id=first, session_id="s", text="one"))
        _wait_for(lambda: len(seen) == 1)
        _notify(queue, routing.wake_payload(turn_id=second, session_id="s", text="two"))
        _wait_for(lambda: len(seen) == 2)
        time.sleep(0.1)
        _notify(queue, routing.wake_payload(turn_id=third, session_id="s", text="three"))
        _wait_for(lambda: len(seen) == 3)
        assert seen == [(first, True), (second, False), (third, True)]
    finally:
        listener.stop()


def _listeners_named(name: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND application_name = %s", [name])
        return cursor.fetchone()[0]


@pytest.mark.django_db(transaction=True)
def test_a_wake_sent_1_5_s_after_the_listeners_backend_is_killed_is_received():
    """The shared reconnect rule (``hermes_sessions/listener.py``): a broken LISTEN connection is opened
    again at once (attempts at least a second apart), so a wake sent 1.5 s after ``pg_terminate_backend``
    runs its turn; the listener's connection is closed when it stops."""
    queue = own("relisten")
    ran: list = []
    listener = wake.WakeListener(queue, lambda t, s, h: ran.append(t))
    listener.start()
    try:
        assert listener.listening.wait(10)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND application_name = 'hermes-wake'")
            assert cursor.rowcount == 1
        killed = time.monotonic()
        _wait_for(lambda: listener.connects == 2, 1.5)  # within a second (its connection is under a second old)
        time.sleep(max(0.0, 1.5 - (time.monotonic() - killed)))
        turn = uuid.uuid4()
        _notify(queue, f"{turn} s")
        _wait_for(lambda: ran == [turn], 2)
    finally:
        listener.stop()
    assert not listener.is_alive()
    _wait_for(lambda: _listeners_named("hermes-wake") == 0, 2)  # closed by stop


def test_wake_start_starts_one_listener_per_process_and_wake_stop_ends_it(monkeypatch):
    started: list = []
    monkeypatch.setattr(wake.WakeListener, "start", lambda self: started.append(self))
    monkeypatch.setattr(process.runtime(), "listener", None)
    assert wake.wake_start("", run=lambda *_: None) is None  # no own queue
    queue = own("once")
    one = wake.wake_start(queue, run=lambda *_: None)
    assert one is not None and wake.wake_start(queue, run=lambda *_: None) is one and started == [one]
    assert wake.wake_listening() and not wake.wake_listening_now()  # started, not yet listening
    one.listening.set()
    assert wake.wake_listening_now()
    monkeypatch.setattr(process, "_runtime", process.Runtime(pid=os.getpid() + 1, listener=one))  # a forked child's
    assert not wake.wake_listening() and not wake.wake_listening_now()
    monkeypatch.setattr(process.runtime(), "listener", one)
    wake.wake_stop(turn_timeout=1)
    assert process.runtime().listener is None and not wake.wake_listening() and one.stopping


# --- the process's turn permits (HERMES_WORKER_TURNS) -------------------------------------------------

def _held_slot() -> tuple[threading.Event, threading.Event]:
    """Another thread holds every turn permit of this process until the returned ``release`` is set."""
    taken, release = threading.Event(), threading.Event()
    slots = wake.turn_slots()

    def hold() -> None:
        for _ in range(slots.permits):
            assert slots.acquire(timeout=5)
        taken.set()
        release.wait(10)
        for _ in range(slots.permits):
            slots.release()

    threading.Thread(target=hold, daemon=True).start()
    assert taken.wait(5)
    return taken, release


def test_a_woken_turn_waits_for_a_running_one_and_gives_up_past_the_deadline(settings, monkeypatch, caplog):
    settings.HERMES_AFFINITY_DEADLINE = 0.2
    ran: list = []
    monkeypatch.setattr(execution, "turn_execute", lambda **kw: ran.append(kw))
    undispatched: list = []
    monkeypatch.setattr(execution, "turn_undispatched", undispatched.append)
    turn_id = uuid.uuid4()
    _, release = _held_slot()
    t0 = time.monotonic()
    assert execution.turn_execute_woken(turn_id, "s-1") is None
    assert 0.15 < time.monotonic() - t0 < 2 and ran == []
    assert "the sweep dispatches it to the shared queue" in caplog.text
    assert undispatched == [turn_id]  # its wake spent: the sweep's next round dispatches it
    release.set()
    # Once the holder has let go: a run that still had to wait for the slot would lose its hint (by design) —
    # on a busy host the holder's thread may take longer than QUEUED_BEHIND_SECONDS to get there.
    with wake.turn_slot(timeout=5) as free:
        assert free
    hint = routing.WakeHint(text="hi", sent_at=time.time())
    execution.turn_execute_woken(turn_id, "s-1", hint)
    [limits] = [r.pop("limits") for r in ran]
    assert [r.pop("parking") for r in ran] == [None]  # no runners in this process: on this thread
    assert ran == [{"turn_id": turn_id, "task_id": "wake", "woken": True, "session_id": "s-1", "hint": hint}]
    assert limits is not None and limits.what == f"woken turn {turn_id}"  # the task's time limits watch it


def test_a_woken_turn_that_waited_for_the_slot_loses_its_hint(settings, monkeypatch):
    settings.HERMES_AFFINITY_DEADLINE = 5.0
    ran: list = []
    monkeypatch.setattr(execution, "turn_execute", lambda **kw: ran.append(kw))
    _, release = _held_slot()
    threading.Timer(0.2, release.set).start()
    execution.turn_execute_woken(uuid.uuid4(), "s-1", routing.WakeHint(text="hi", sent_at=time.time()))
    assert [kw["hint"] for kw in ran] == [None]


def test_a_celery_delivery_waits_for_a_woken_turn_only_where_a_listener_runs(monkeypatch):
    _, release = _held_slot()
    try:
        monkeypatch.setattr(process.runtime(), "listener", None)
        with wake.delivery_slot():  # no listener: nothing else runs turns here
            pass
        monkeypatch.setattr(process.runtime(), "listener", object())
        entered = threading.Event()

        def deliver() -> None:
            with wake.delivery_slot():
                entered.set()

        threading.Thread(target=deliver, daemon=True).start()
        assert not entered.wait(0.3)  # waits for the woken turn
        release.set()
        assert entered.wait(5)
    finally:
        release.set()


def test_a_delivery_stuck_behind_a_woken_turn_leaves_its_turn_to_the_sweep(user, settings, monkeypatch, caplog):
    """A woken long turn holds the slot; Celery, which cannot see it, hands the same pool process a new
    session's turn from the shared queue. The delivery waits at most ``HERMES_AFFINITY_DEADLINE``, clears
    the turn's ``dispatched_at`` and returns: the sweep's next round dispatches it again, for an idle
    worker (``tests/e2e/test_affinity.py`` runs it end to end)."""
    from hermes_sessions.worker import recovery

    settings.HERMES_AFFINITY_DEADLINE = 0.2
    ran: list = []
    sent: list = []
    monkeypatch.setattr(worker, "turn_run", lambda **kw: ran.append(kw["turn_id"]))
    monkeypatch.setattr(process.runtime(), "listener", object())
    queued = TurnFactory(session=SessionFactory(owner=user), seq=1, status=Turn.Status.QUEUED,
                         dispatched_at=timezone.now())
    _, release = _held_slot()  # the woken turn runs on the listener's thread
    try:
        t0 = time.monotonic()
        result = tasks.run_turn.run(str(queued.pk))
        assert result == {"turn": str(queued.pk), "turn_status": "busy"}
        assert 0.15 < time.monotonic() - t0 < 2 and ran == []
        assert Turn.objects.get(pk=queued.pk).dispatched_at is None
        assert "left to the sweep" in caplog.text
        monkeypatch.setattr(recovery.dispatch, "turn_dispatch_on_commit", lambda turn_id, **kw: sent.append(turn_id))
        assert recovery.turns_dispatch_unclaimed(limit=20, by="test") == 1  # at once, not after any deadline
        assert sent == [queued.pk]
    finally:
        release.set()
    tasks.run_turn.run(str(queued.pk))  # the slot free again: this delivery runs it
    assert ran == [str(queued.pk)]


def test_wake_stop_waits_for_a_woken_turn_then_returns(monkeypatch, caplog):
    listener = wake.WakeListener(own("stop"), lambda *_: None)
    monkeypatch.setattr(process.runtime(), "listener", listener)
    _, release = _held_slot()
    threading.Timer(0.3, release.set).start()
    t0 = time.monotonic()
    wake.wake_stop(turn_timeout=5)
    assert 0.2 < time.monotonic() - t0 < 4 and "still run" not in caplog.text
    monkeypatch.setattr(process.runtime(), "listener", listener)
    _, release = _held_slot()
    try:
        wake.wake_stop(turn_timeout=0.1)
        assert f"{wake.turn_slots().permits} woken turn(s) still run after" in caplog.text
    finally:
        release.set()


def test_the_permits_bound_the_turns_at_once_and_drain_waits_for_every_one():
    slots = wake.TurnSlots(2)
    assert slots.acquire(timeout=0) and slots.acquire(timeout=0)
    assert not slots.acquire(timeout=0.05) and slots.held() == 2  # a third turn waits
    threading.Timer(0.1, slots.release).start()
    threading.Timer(0.3, slots.release).start()
    t0 = time.monotonic()
    assert slots.drain(timeout=5) == 0  # both turns ended
    assert 0.25 < time.monotonic() - t0 < 4 and slots.held() == 0
    assert slots.acquire(timeout=0)  # drained permits are given back
    assert slots.drain(timeout=0.05) == 1  # one still held at the deadline
    slots.release()
    with pytest.raises(ValueError):
        slots.release()  # bounded: a permit given back twice is a bug, not a new permit
    with pytest.raises(ValueError):
        wake.TurnSlots(0)


@pytest.fixture
def runner_pool(monkeypatch):
    """This process runs turns on runners, as a worker process does (``process.start``)."""
    from hermes_sessions.worker import runners

    made = runners.Runners()
    made.start()
    monkeypatch.setattr(process.runtime(), "runners", made)
    yield made
    made.stop(timeout=10)


@pytest.fixture
def gated_turns(monkeypatch):
    """``turn_execute`` replaced by a run that records its turn id and blocks until ``gates[turn_id]`` is set."""
    gates: dict[uuid.UUID, threading.Event] = {}
    started: list[uuid.UUID] = []

    def execute(**kw) -> None:
        started.append(kw["turn_id"])
        if not gates.setdefault(kw["turn_id"], threading.Event()).wait(10):
            raise RuntimeError("gate never opened")
        if kw["session_id"] == "boom":
            raise RuntimeError("the woken run failed")

    monkeypatch.setattr(execution, "turn_execute", execute)
    return gates, started


def test_the_listener_hands_woken_turns_to_runners_and_they_run_at_once(settings, monkeypatch, runner_pool,
                                                                          gated_turns, caplog):
    """The wake listener does not wait for a woken turn: it takes a permit, hands the turn to a runner and
    returns, so up to ``HERMES_WORKER_TURNS`` woken turns run at once; a wake that finds every permit taken
    past ``HERMES_AFFINITY_DEADLINE`` is left to the sweep; the runner gives the permit back at the end."""
    settings.HERMES_WORKER_TURNS, settings.HERMES_AFFINITY_DEADLINE = 2, 0.3
    gates, started = gated_turns
    undispatched: list = []
    monkeypatch.setattr(execution, "turn_undispatched", undispatched.append)
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    for turn in (a, b, c):
        gates[turn] = threading.Event()
    t0 = time.monotonic()
    run_a = execution.turn_execute_woken(a, "s-a")
    run_b = execution.turn_execute_woken(b, "boom")
    assert time.monotonic() - t0 < 0.25  # handed over, not waited for
    assert not run_a.released.is_set() and not run_b.released.is_set()
    _wait_for(lambda: set(started) == {a, b})  # both run at once, on two runners
    assert wake.turn_slots().held() == 2
    assert execution.turn_execute_woken(c, "s-c") is None and undispatched == [c]  # every permit taken
    gates[b].set()  # the run raises: logged, its permit given back all the same
    _wait_for(lambda: wake.turn_slots().held() == 1)
    _wait_for(lambda: "the woken run failed" in caplog.text)
    execution.turn_execute_woken(c, "s-c")
    _wait_for(lambda: c in started)
    gates[a].set()
    gates[c].set()
    _wait_for(lambda: wake.turn_slots().held() == 0)
    _wait_for(lambda: runner_pool.idle_threads() == 2)


def test_with_one_permit_a_woken_turn_waits_for_the_running_one(settings, monkeypatch, runner_pool, gated_turns):
    """``HERMES_WORKER_TURNS=1``: one turn at a time, as a worker with a route ran before the permits."""
    settings.HERMES_WORKER_TURNS, settings.HERMES_AFFINITY_DEADLINE = 1, 5.0
    gates, started = gated_turns
    a, b = uuid.uuid4(), uuid.uuid4()
    gates[a], gates[b] = threading.Event(), threading.Event()
    execution.turn_execute_woken(a, "s-a")
    _wait_for(lambda: started == [a])
    threading.Timer(0.3, gates[a].set).start()
    t0 = time.monotonic()
    execution.turn_execute_woken(b, "s-b")  # waits for a's permit
    assert time.monotonic() - t0 > 0.25
    _wait_for(lambda: started == [a, b])
    gates[b].set()
    _wait_for(lambda: wake.turn_slots().held() == 0)


def test_wake_stop_waits_for_every_woken_turn(settings, monkeypatch, runner_pool, gated_turns, caplog):
    settings.HERMES_WORKER_TURNS = 3
    gates, started = gated_turns
    listener = wake.WakeListener(own("stop-all"), lambda *_: None)
    monkeypatch.setattr(process.runtime(), "listener", listener)
    a, b = uuid.uuid4(), uuid.uuid4()
    gates[a], gates[b] = threading.Event(), threading.Event()
    execution.turn_execute_woken(a, "s-a")
    execution.turn_execute_woken(b, "s-b")
    _wait_for(lambda: len(started) == 2)
    threading.Timer(0.1, gates[a].set).start()
    threading.Timer(0.5, gates[b].set).start()
    t0 = time.monotonic()
    wake.wake_stop(turn_timeout=5)
    assert 0.45 < time.monotonic() - t0 < 4 and "still run" not in caplog.text  # the later one too
    assert wake.turn_slots().held() == 0


def test_a_woken_turn_waits_for_its_sessions_last_run_here_and_loses_its_hint(settings, monkeypatch):
    """The finalize of a session's turn makes its next turn claimable before the app-server is handed to the
    keeper: the next turn, on another runner, waits for the end of that run (``runners.SessionRuns``) so it
    finds the kept thread; having waited, it starts no early ``turn/start``. Another session's turn does
    not wait."""
    from hermes_sessions.worker import runners

    early: list = []
    claimed: list[float] = []
    monkeypatch.setattr(execution, "early_start", lambda **kw: early.append(kw["session_id"]))
    monkeypatch.setattr(execution, "_claim_with", lambda turn_id, e: (claimed.append(time.monotonic()), (None, e))[1])
    registered, done = threading.Event(), threading.Event()

    def last_run() -> None:
        with runners.session_runs().running("s-1"):
            registered.set()
            done.wait(0.3)

    threading.Thread(target=last_run, daemon=True).start()
    assert registered.wait(5)
    hint = routing.WakeHint(text="hi", sent_at=time.time())
    t0 = time.monotonic()
    assert execution.turn_execute(turn_id=uuid.uuid4(), woken=True, session_id="s-1", hint=hint) is None
    assert claimed[0] - t0 > 0.25 and early == []
    t0 = time.monotonic()
    execution.turn_execute(turn_id=uuid.uuid4(), woken=True, session_id="s-2",
                           hint=routing.WakeHint(text="hi", sent_at=time.time()))
    assert claimed[1] - t0 < 0.25 and early == ["s-2"]


def test_a_delivery_of_a_turn_the_wake_already_ran_costs_one_read(user, monkeypatch, django_assert_num_queries):
    ran: list = []
    monkeypatch.setattr(worker, "turn_run", lambda **kw: ran.append(kw["turn_id"]))
    monkeypatch.setattr(process.runtime(), "listener", object())
    session = SessionFactory(owner=user)
    done = TurnFactory(session=session, seq=1, status=Turn.Status.SUCCEEDED)
    queued = TurnFactory(session=session, seq=2, status=Turn.Status.QUEUED)
    with django_assert_num_queries(1):
        assert tasks.run_turn.run(str(done.pk))["turn_status"] == "skipped"
    tasks.run_turn.run(str(queued.pk))
    assert ran == [str(queued.pk)]
    monkeypatch.setattr(process.runtime(), "listener", None)
    tasks.run_turn.run(str(done.pk))  # no listener: the claim decides, as always
    assert ran == [str(queued.pk), str(done.pk)]


# --- a woken turn's time limits (Celery enforces its own only in its tasks) ----------------------------

class _Codex:
    """An app-server the turn blocks on: ``kill_nowait`` ends the blocked read (as a SIGKILL's EOF does)."""

    def __init__(self) -> None:
        self.killed = threading.Event()

    def kill_nowait(self) -> None:
        self.killed.set()

    def read(self, timeout: float) -> None:
        """A blocked read of codex: ``TransportError`` once the process is killed."""
        from hermes_sessions.codex.errors import TransportError

        if self.killed.wait(timeout):
            raise TransportError("codex app-server exited")


def test_past_the_soft_limit_a_woken_turns_codex_is_ended_and_its_blocked_read_raises(monkeypatch):
    from hermes_sessions.codex.errors import TransportError
    from hermes_sessions.codex.runner import TurnControl
    from hermes_sessions.worker import time_limits

    killed: list = []
    monkeypatch.setattr(time_limits.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    codex, control = _Codex(), TurnControl()
    t0 = time.monotonic()
    with pytest.raises(TransportError):
        with time_limits.thread_time_limits(soft=0.2, hard=30, what="test") as limits:
            limits.watch(control)
            control.attach(codex.kill_nowait)
            codex.read(timeout=10)  # one long blocked read: nothing is raised into this thread
    assert 0.15 < time.monotonic() - t0 < 2 and killed == []
    assert control.time_limit == time_limits.TIME_LIMIT_REASON and control.stopping()


def test_a_control_attached_after_the_soft_limit_ends_its_codex_at_once(monkeypatch):
    from hermes_sessions.codex.runner import TurnControl
    from hermes_sessions.worker import time_limits

    monkeypatch.setattr(time_limits.os, "kill", lambda pid, sig: None)
    with time_limits.thread_time_limits(soft=0.05, hard=30, what="test") as limits:
        assert limits.exceeded.wait(2)
        control, codex = TurnControl(), _Codex()
        limits.watch(control)  # e.g. the soft limit passed while the turn was being claimed
        control.attach(codex.kill_nowait)
        assert codex.killed.is_set() and control.time_limit


def test_a_block_that_ends_in_time_gets_nothing_after_it(monkeypatch):
    from hermes_sessions.codex.runner import TurnControl
    from hermes_sessions.worker import time_limits

    killed: list = []
    monkeypatch.setattr(time_limits.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    control, codex = TurnControl(), _Codex()
    with time_limits.thread_time_limits(soft=0.2, hard=0.4, what="test") as limits:
        limits.watch(control)
        control.attach(codex.kill_nowait)
        time.sleep(0.01)
    time.sleep(0.6)  # past both limits: no kill of codex, none of the process
    assert killed == [] and not codex.killed.is_set() and not control.time_limit


def test_past_the_hard_limit_the_process_is_killed_as_celery_would(monkeypatch, caplog):
    import signal as signals

    from hermes_sessions.worker import time_limits

    killed: list = []
    monkeypatch.setattr(time_limits.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    with time_limits.thread_time_limits(soft=0.1, hard=0.3, what="woken turn t"):
        time.sleep(1.0)  # a turn that does not notice its codex ended (a bug) meets the hard limit
    assert killed == [(os.getpid(), signals.SIGKILL)]
    assert "past the hard time limit" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_a_woken_turn_past_its_soft_limit_ends_failed_with_the_reason(settings, monkeypatch, user, scripted_codex):
    """The real run: a turn whose codex never completes is ended at the soft limit — its app-server
    killed, the turn ``failed`` with ``TIME_LIMIT_REASON``, not retried — before the runner's own
    deadline (``CODEX_TURN_TIMEOUT``)."""
    from hermes_sessions.worker import time_limits

    monkeypatch.setattr(time_limits.os, "kill", lambda pid, sig: None)
    settings.CODEX_TURN_TIMEOUT = 30
    monkeypatch.setattr(execution, "turn_time_limits", lambda: (1, 60))
    from hermes_sessions.services import dispatch

    monkeypatch.setattr(dispatch, "turn_dispatch_on_commit", lambda *a, **kw: None)
    scripted_codex.script({"turn/start": [{"no_completion": True}]})
    session = services.session_create(owner=user, session_id="soft-limit")
    turn = services.turn_enqueue(session=session, input_text="hang", user=user)
    t0 = time.monotonic()
    execution.turn_execute_woken(turn.pk, session.pk)
    turn.refresh_from_db()
    assert (turn.status, turn.error) == ("failed", time_limits.TIME_LIMIT_REASON)
    assert time.monotonic() - t0 < 15 and turn.attempt == 1


def test_a_woken_turn_runs_under_the_tasks_time_limits(settings, monkeypatch):
    from hermes_sessions import tasks as tasks_module

    seen: list = []
    monkeypatch.setattr(execution, "thread_time_limits",
                        lambda **kw: (seen.append(kw), __import__("contextlib").nullcontext())[1])
    monkeypatch.setattr(execution, "turn_execute", lambda **kw: None)
    execution.turn_execute_woken(uuid.uuid4(), "s")
    [limits] = seen
    assert (limits["soft"], limits["hard"]) == (tasks_module.run_turn.soft_time_limit, tasks_module.run_turn.time_limit)
    assert limits["soft"] >= settings.CODEX_TURN_TIMEOUT + 60


def test_blocks_share_the_one_scheduler_thread(monkeypatch):
    """No thread started per block (it was one per woken turn, on its way to codex): the time limits are
    jobs on the process's scheduler."""
    from hermes_sessions.codex.runner import TurnControl
    from hermes_sessions.worker import time_limits

    monkeypatch.setattr(time_limits.os, "kill", lambda pid, sig: None)
    ended: list[str] = []

    def block() -> None:
        control, codex = TurnControl(), _Codex()
        with time_limits.thread_time_limits(soft=0.2, hard=30, what="test") as limits:
            limits.watch(control)
            control.attach(codex.kill_nowait)
            if codex.killed.wait(5):
                ended.append(control.time_limit)

    threads = [threading.Thread(target=block) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert ended == [time_limits.TIME_LIMIT_REASON] * 3
    names = [t.name for t in threading.enumerate()]
    assert names.count("hermes-scheduler") == 1 and "hermes-time-limits" not in names
