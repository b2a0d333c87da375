"""Session affinity: send a session's next turn to the worker that keeps its codex thread loaded.

The database side of ``codex/kept.py``. The pieces:

* **a worker's own queue**: a worker that runs one turn at a time (``-c 1`` prefork, or ``-P solo``)
  also consumes ``<HERMES_TURN_QUEUE>.<node name>`` (``project/celery.py`` adds it at start and names it
  in ``HERMES_OWN_QUEUE`` for the pool process). Only such a process keeps threads loaded: with more
  pool processes the queue could not reach the one holding the thread (Celery's prefork children
  cannot be addressed one by one; README "Warm turns").
* **its heartbeat** (``TurnWorker``): written every ``HERMES_WORKER_HEARTBEAT_SECONDS`` by a thread of
  the process that holds the threads (``AffinityLoop``), which also closes copies idle past the window
  and releases those whose session another worker took (its ``WarmThread`` row names another queue or
  is gone, or the stored generation moved on).
* **routing** (``turn_route``): a turn goes to the own queue of the worker named by its session's
  ``WarmThread`` while that row's window is open and that worker's heartbeat is fresh, *and* to the
  shared queue ``HERMES_AFFINITY_DEADLINE`` seconds later (a Celery countdown): whichever delivery
  claims first runs it, the other finds it taken and does nothing (``turn_claim``), and a queue nobody
  consumes holds only duplicates. A busy holder also hands off a turn it has not claimed by the deadline
  (``AffinityLoop``, ``overdue_turns``): the countdown copy may sit reserved behind another worker's turn.
* **the sweep** (``recovery.workers_sweep``): a worker whose heartbeat is older than
  ``HERMES_WORKER_STALE_SECONDS`` is gone (kill -9, lost host): its sessions' ``WarmThread`` rows are
  deleted, the queued head turns of those sessions are sent again (to the shared queue), its queue is
  deleted from the broker and its row removed (``../shared/pitfalls.md``, routing table).
* **lease recovery**: each loop round also takes back running turns whose lease expired
  (``recovery.leases_take_back``, shared with the sweep), so a dead worker's turns return to the queue
  while any keeping worker lives, beat or no beat.

Facts: ``docs/codex.md`` §11 (a loaded thread skips the ~1 s resume under a permission profile).
"""
from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.db.models.functions import Coalesce
from django.utils import timezone

from ..codex.kept import Keeper, KeptThread
from ..models import CodexRollout, Session, Turn, TurnWorker, WarmThread
from . import wake
from .periodic import PeriodicLoop
from .rows import rows_insert_sql

logger = logging.getLogger(__name__)

OWN_QUEUE_ENV = "HERMES_OWN_QUEUE"


def own_queue_name(node: str) -> str:
    """The own queue of worker ``node`` (its ``-n`` name, e.g. ``celery@host``): ``<HERMES_TURN_QUEUE>.<node>``."""
    return f"{settings.HERMES_TURN_QUEUE}.{node}"


def own_queue() -> str:
    """This process's own queue, or ``""`` when it has none (not a one-turn-at-a-time worker, or an
    API process): then it keeps no thread loaded. Set by ``project/celery.py`` at worker start."""
    return os.environ.get(OWN_QUEUE_ENV, "")


def own_queue_taken(queue: str, *, pid: int | None = None) -> str:
    """Why this process may not consume (or keep threads for) ``queue`` (``""``: it may): another live
    worker already does — its ``TurnWorker`` heartbeat is fresh and it runs on another host, or on this one
    as a live process other than ``pid`` (this process, when it checks its own row). Two workers with one
    node name (``make worker`` twice without ``WORKER_NAME``, or one started while a frozen one's row had
    been swept) would share the queue, and a session's turns would alternate between them, mostly cold."""
    fresh = timezone.now() - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS)
    row = TurnWorker.objects.filter(queue=queue, heartbeat_at__gt=fresh).values("host", "pid").first()
    return _live_elsewhere(queue, row, pid)


def _live_elsewhere(queue: str, row: Mapping[str, Any] | None, pid: int | None) -> str:
    if row is None:
        return ""
    if row["host"] != socket.gethostname():
        return f"worker queue {queue} is already consumed by a live worker on host {row['host']}"
    if row["pid"] == pid:
        return ""
    try:
        os.kill(row["pid"], 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return f"worker queue {queue} is already consumed by live process {row['pid']} on this host"


def _routable() -> QuerySet[WarmThread]:
    """The ``WarmThread`` rows a turn may be routed by: window open, and the worker holding the thread
    has a heartbeat fresher than ``HERMES_WORKER_STALE_SECONDS``."""
    now = timezone.now()
    fresh = TurnWorker.objects.filter(queue=OuterRef("queue"),
                                      heartbeat_at__gt=now - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS))
    return WarmThread.objects.filter(until__gt=now).filter(Exists(fresh))


def turn_route(turn_id: uuid.UUID | str) -> str:
    """The own queue to send turn ``turn_id`` to first, or ``""`` (shared queue only): its session's
    ``WarmThread`` window is open and that worker's heartbeat is fresher than
    ``HERMES_WORKER_STALE_SECONDS``. One query."""
    row = _routable().filter(session__turns__id=turn_id).values_list("queue", flat=True).first()
    return row or ""


@dataclass(frozen=True)
class Route:
    """Where a turn goes first: the own queue of the worker holding its session's thread, and whether
    that worker's wake listener listens (``TurnWorker.wakeable``, ``services/wake.py``)."""

    queue: str
    wakeable: bool = False


def parse_route(value: str | None) -> Route | None:
    """``session_route_sql``'s value (``'wake:<queue>'`` or ``'queue:<queue>'``) → ``Route``; ``None``
    for ``NULL`` (no route)."""
    if not value:
        return None
    kind, _, queue = value.partition(":")
    return Route(queue=queue, wakeable=kind == "wake") if queue else None


def session_route_sql(session_id: str) -> tuple[str, list[Any]]:
    """``turn_route`` for a turn of session ``session_id`` as a scalar subquery and its parameters: its
    value is ``'wake:<queue>'`` (the holder's wake listener listens) or ``'queue:<queue>'``, ``NULL`` for
    none (``parse_route`` reads it). Lets ``turn_enqueue`` read the route in a query it makes anyway, under
    the session lock. Raw SQL (text built once per process) on any backend: the ORM's compile of the
    annotated subquery cost ~1 ms of the POST."""
    now = timezone.now()
    until, beat = WarmThread._meta.get_field("until"), TurnWorker._meta.get_field("heartbeat_at")
    fresh = now - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS)
    return _session_route_sql(), [session_id, until.get_db_prep_value(now, connection),
                                  beat.get_db_prep_value(fresh, connection)]


@functools.cache
def _session_route_sql() -> str:
    """``_routable`` of one session (``%s``: its id, the time now, the oldest fresh heartbeat)."""
    q = connection.ops.quote_name
    warm, workers = q(WarmThread._meta.db_table), q(TurnWorker._meta.db_table)
    return (f"(SELECT CASE WHEN tw.{q('wakeable')} THEN 'wake:' ELSE 'queue:' END || w.{q('queue')} "
            f"FROM {warm} w JOIN {workers} tw ON tw.{q('queue')} = w.{q('queue')} "
            f"WHERE w.{q('session_id')} = %s AND w.{q('until')} > %s AND tw.{q('heartbeat_at')} > %s LIMIT 1)")


def warm_thread_record(*, session: Session, queue: str, thread_id: str, generation: int) -> None:
    """Record (inside the turn's finalize transaction, under the session lock) that worker ``queue``
    keeps ``thread_id`` loaded at rollout ``generation`` for ``HERMES_WARM_IDLE_SECONDS``; with an
    empty ``queue``, that no worker does. ``warm_thread_record_sql``'s one statement (the finalize
    sends that one inside a statement of its own)."""
    if not connection.in_atomic_block:
        raise transaction.TransactionManagementError("warm_thread_record runs inside the turn's transaction")
    with connection.cursor() as cursor:
        cursor.execute(*warm_thread_record_sql(session_id=session.pk, queue=queue, thread_id=thread_id,
                                               generation=generation))


def warm_thread_record_sql(*, session_id: str, queue: str, thread_id: str, generation: int) -> tuple[str, list[Any]]:
    """``warm_thread_record``'s statement and its parameters: an upsert (``INSERT … ON CONFLICT (session)
    DO UPDATE``; ``update_or_create`` took a savepoint, a
    ``SELECT … FOR UPDATE`` and an UPDATE) of the row for ``queue``, or with an empty ``queue`` the
    ``DELETE`` of the session's row. Raw SQL from the model's metadata: the ORM's ``bulk_create`` compile
    was ~7 % of a warm finalize (py-spy)."""
    if not queue:
        return _warm_delete_sql(), [session_id]
    until = timezone.now() + timedelta(seconds=settings.HERMES_WARM_IDLE_SECONDS)
    sql, params = rows_insert_sql(
        [WarmThread(session_id=session_id, queue=queue, thread_id=thread_id, generation=generation, until=until)],
        _WARM_FIELDS)
    return sql + _warm_upsert_tail(), params


_WARM_FIELDS = ("session", "queue", "thread_id", "generation", "until")


@functools.cache
def _warm_upsert_tail() -> str:
    q, column = connection.ops.quote_name, {f.name: str(f.column) for f in WarmThread._meta.concrete_fields}
    key, *rest = (q(column[name]) for name in _WARM_FIELDS)
    return f" ON CONFLICT ({key}) DO UPDATE SET " + ", ".join(f"{c} = EXCLUDED.{c}" for c in rest)


@functools.cache
def _warm_delete_sql() -> str:
    q = connection.ops.quote_name
    key = next(str(f.column) for f in WarmThread._meta.concrete_fields if f.name == "session")
    return f"DELETE FROM {q(WarmThread._meta.db_table)} WHERE {q(key)} = %s"


def warm_thread_forget(*, queue: str, session_ids: list[str] | None = None) -> int:
    """Delete the ``WarmThread`` rows naming ``queue`` (only of ``session_ids`` when given): that worker
    no longer holds them. Returns how many."""
    rows = WarmThread.objects.filter(queue=queue)
    if session_ids is not None:
        rows = rows.filter(session_id__in=session_ids)
    deleted, _ = rows.delete()
    return deleted


def taken_elsewhere(*, queue: str, held: list[tuple[str, str, int]]) -> dict[str, str]:
    """Of ``held`` (``(session id, thread id, generation)`` kept by worker ``queue``), those another
    worker took, with why: their ``WarmThread`` row names another queue or is gone (a turn ended
    elsewhere, or the session was deleted), or the thread's stored generation is not the held one."""
    if not held:
        return {}
    ids = [s for s, _, _ in held]
    rows = dict(WarmThread.objects.filter(session_id__in=ids).values_list("session_id", "queue"))
    generations = dict(CodexRollout.objects.filter(thread_id__in=[t for _, t, _ in held])
                       .values_list("thread_id", "generation"))
    why: dict[str, str] = {}
    for session_id, thread_id, generation in held:
        if rows.get(session_id) != queue:
            why[session_id] = f"its last turn ended on {rows.get(session_id) or 'a worker that keeps nothing'}"
        elif generations.get(thread_id) != generation:
            stored = generations.get(thread_id)
            why[session_id] = (f"its rollout moved on to generation {stored}" if stored is not None
                               else "its stored rollout is gone")
    return why


def overdue_turns(*, queue: str) -> list[tuple[str, uuid.UUID]]:
    """``(session id, turn id)`` of the queued head turns of the sessions whose ``WarmThread`` names
    ``queue`` that were sent more than ``HERMES_AFFINITY_DEADLINE`` ago and that no worker has claimed
    (no turn of the session running)."""
    return _overdue_heads(WarmThread.objects.filter(queue=queue).values("session_id"))


def stalled_holder_turns() -> list[tuple[str, uuid.UUID]]:
    """``(session id, turn id)``, as ``overdue_turns``, of the sessions whose ``WarmThread`` names a worker
    whose heartbeat is older than two ``HERMES_WORKER_HEARTBEAT_SECONDS`` (or that has no row): frozen or
    dead — a busy worker's loop thread still beats, and hands its own turns off (``overdue_turns``). Any
    keeping worker's loop takes these (``AffinityLoop``): otherwise they would wait for the shared queue's
    countdown copy, which a busy peer may hold reserved until its own long turn ends, or for the sweep
    (``HERMES_WORKER_STALE_SECONDS`` + ``HERMES_SWEEP_SECONDS``, ≈ 20 s; adversary F2, session 4)."""
    beating = TurnWorker.objects.filter(
        queue=OuterRef("queue"),
        heartbeat_at__gt=timezone.now() - timedelta(seconds=2 * settings.HERMES_WORKER_HEARTBEAT_SECONDS))
    return _overdue_heads(WarmThread.objects.exclude(Exists(beating)).values("session_id"))


def _overdue_heads(sessions: Any) -> list[tuple[str, uuid.UUID]]:
    cutoff = timezone.now() - timedelta(seconds=settings.HERMES_AFFINITY_DEADLINE)
    busy = Turn.objects.filter(session=OuterRef("session"), status__in=(Turn.Status.QUEUED, Turn.Status.RUNNING),
                               seq__lt=OuterRef("seq"))
    running = Turn.objects.filter(session=OuterRef("session"), status=Turn.Status.RUNNING)
    heads = (Turn.objects.filter(session_id__in=sessions, status=Turn.Status.QUEUED)
             .annotate(sent=Coalesce("dispatched_at", "created_at")).filter(sent__lt=cutoff)
             .exclude(Exists(busy)).exclude(Exists(running)))
    return [(str(sid), tid) for sid, tid in heads.values_list("session_id", "pk")[:100]]


def hand_off(*, session_id: str, turn_id: uuid.UUID, queue: str | None, redispatch: Callable[[uuid.UUID], None]) -> bool:
    """Delete the session's ``WarmThread`` row (only if it still names ``queue``; any queue when ``None``)
    and send turn ``turn_id`` again with ``redispatch`` (after the commit: to the shared queue, the row
    being gone), in one transaction; ``False`` when the row is gone or locked — another worker's loop is
    handing it off, or a finalize is rewriting it."""
    with transaction.atomic():
        rows = WarmThread.objects.select_for_update(skip_locked=True).filter(session_id=session_id)
        if queue is not None:
            rows = rows.filter(queue=queue)
        row = rows.values_list("queue", flat=True).first()
        if row is None:
            return False
        WarmThread.objects.filter(session_id=session_id).delete()
        redispatch(turn_id)
    return True


def worker_heartbeat(*, queue: str, kept: int, wakeable: bool = False) -> str:
    """Upsert this worker's ``TurnWorker`` row with ``heartbeat_at = now`` (``kept`` threads held loaded,
    ``wakeable``: its wake listener listens); returns ``""``. Refuses (writes
    nothing, returns why) when the row is another live worker's (``own_queue_taken``): this process was
    frozen (SIGSTOP, a stalled VM) long enough to be swept, and a worker started since with the same node
    name took the queue — the row is that worker's, and this one must keep nothing (``AffinityLoop``).

    Single statements, no transaction held across them: a process frozen between two of them holds no
    row lock (a lock held by a frozen process would stall the sweep and its namesake's heartbeat)."""
    host, pid = socket.gethostname()[:255], os.getpid()
    node = queue[len(settings.HERMES_TURN_QUEUE) + 1:] if queue.startswith(f"{settings.HERMES_TURN_QUEUE}.") else queue
    fields = {"node": node[:255], "host": host, "pid": pid, "kept": kept, "wakeable": wakeable}
    for _ in range(3):  # a namesake may insert or take the row between two statements
        now = timezone.now()
        stale = now - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS)
        mine_or_stale = Q(host=host, pid=pid) | Q(heartbeat_at__lte=stale)
        if TurnWorker.objects.filter(mine_or_stale, queue=queue).update(heartbeat_at=now, **fields):
            return ""
        row = TurnWorker.objects.filter(queue=queue).values("host", "pid").first()
        if row is None:
            TurnWorker.objects.bulk_create([TurnWorker(queue=queue, heartbeat_at=now, **fields)], ignore_conflicts=True)
            continue  # inserted, or a namesake's insert won: the next round tells
        why = _live_elsewhere(queue, row, pid)
        if why:
            return why
        # A fresh row of a process that died on this host: take it over, if it still names that process.
        if TurnWorker.objects.filter(queue=queue, host=row["host"], pid=row["pid"]).update(heartbeat_at=now, **fields):
            return ""
    return ""


def worker_gone(*, queue: str) -> None:
    """A worker stopping cleanly: forget its warm threads and its row (no turn is routed to it again).
    Only this process's row: a worker that yielded the queue to another (``worker_heartbeat``) leaves that
    worker's row and warm threads alone."""
    # Single statements, as the heartbeat: no row lock held across them by a process that may be frozen.
    mine, _ = TurnWorker.objects.filter(queue=queue, host=socket.gethostname()[:255], pid=os.getpid()).delete()
    if not mine and TurnWorker.objects.filter(queue=queue).exists():
        return  # another worker's row
    warm_thread_forget(queue=queue)


class AffinityLoop(PeriodicLoop):
    """The thread of a worker process that keeps threads loaded: every
    ``HERMES_WORKER_HEARTBEAT_SECONDS`` it renews the ``TurnWorker`` heartbeat, closes copies idle past
    the window (or whose process died) and releases copies another worker took (``taken_elsewhere``),
    deleting their ``WarmThread`` rows where they still name this worker; and hands off the turns of its
    sessions that it has not claimed within ``HERMES_AFFINITY_DEADLINE`` (``overdue_turns``: this process
    is busy with another session's turn), and those of any worker whose heartbeat stopped
    (``stalled_holder_turns``: frozen or dead) — the copy is closed, the row deleted and the turn sent again with
    ``redispatch`` (``dispatch.turn_dispatch_on_commit``, given by the caller: this module must not import
    dispatch, which imports it), now to the shared queue. The deadline's countdown copy alone is not enough:
    an idle worker may reserve it and then start a long turn before it is due (found by an adversary).
    With ``take_back_leases`` (``recovery.leases_take_back``, given by the caller like ``redispatch``:
    recovery imports this module) it also takes back the running turns whose lease expired, any worker's,
    as the sweep does: a worker killed -9 with beat embedded leaves its turns to the live workers, not to
    beat's return (adversary F2); it is called with ``by="worker <queue>"``. Own database connection."""

    name = "hermes-affinity"
    what = "affinity: heartbeat round"  # a failed round: routing has the deadline, the next round tries again

    def __init__(self, keeper: Keeper, queue: str, redispatch: Callable[[uuid.UUID], None] | None = None,
                 take_back_leases: Callable[[str], object] | None = None) -> None:
        self.keeper, self.queue, self.redispatch = keeper, queue, redispatch
        self.take_back_leases = take_back_leases
        self.beaten = False  # a heartbeat of this loop's was written
        super().__init__()

    def tick(self) -> None:
        """One round (also called by tests)."""
        gone = self.keeper.expired()
        why = taken_elsewhere(queue=self.queue, held=self.keeper.held())
        for session_id, reason in why.items():
            self.keeper.release(session_id, reason=reason)
        if gone:
            warm_thread_forget(queue=self.queue, session_ids=[k.session_id for k in gone])
        if self.redispatch is not None:
            for session_id, turn_id in overdue_turns(queue=self.queue):
                self.keeper.release(session_id, reason=f"its turn {turn_id} waited past HERMES_AFFINITY_DEADLINE "
                                                       "for this busy worker: handed to any worker")
                hand_off(session_id=session_id, turn_id=turn_id, queue=self.queue, redispatch=self.redispatch)
            for session_id, turn_id in stalled_holder_turns():
                if hand_off(session_id=session_id, turn_id=turn_id, queue=None, redispatch=self.redispatch):
                    logger.warning("affinity: turn %s of session %s waited past HERMES_AFFINITY_DEADLINE for a worker "
                                   "whose heartbeat stopped: handed to any worker", turn_id, session_id)
        swept = self.beaten and not TurnWorker.objects.filter(queue=self.queue).exists()
        refused = worker_heartbeat(queue=self.queue, kept=len(self.keeper.held()), wakeable=wake.wake_listening_now())
        if refused:
            self._yield(refused)
            return
        self.beaten = True
        if swept:
            self._consume_again()
        if self.take_back_leases is not None:
            # After the heartbeat, so a failure here never delays it; each turn taken back logs its own
            # line, naming this worker.
            self.take_back_leases(f"worker {self.queue}")

    def _consume_again(self) -> None:
        """This worker's row was gone: it was swept while frozen or stalled past
        ``HERMES_WORKER_STALE_SECONDS``, which deleted its own queue and both its bindings from the broker
        (``worker_queues.queue_delete``). Turns routed to the queue would be dropped or never read, each
        waiting for its countdown copy. So the queue is declared again in both forms
        (``worker_queues.queue_declare``) — on Redis that is all it takes: the worker's consumer never
        stopped polling the list. On RabbitMQ the deletion also cancelled the consumer, so this worker's
        main process is asked (Celery's remote control) to stop and start consuming it: the cancel is
        awaited before the add is sent — two broadcasts sent back to back may arrive in either order (the
        adversary saw the add land first, a no-op, and the cancel then end the consuming for good)."""
        from celery import current_app

        from .worker_queues import queue_declare, queue_is_redis

        node = self.queue[len(settings.HERMES_TURN_QUEUE) + 1:]
        logger.warning("affinity: worker %s had been swept (its heartbeat stopped for longer than "
                       "HERMES_WORKER_STALE_SECONDS); consuming its queue %s again", node, self.queue)
        try:
            queue_declare(self.queue)
            if queue_is_redis():
                return
            control = current_app.control
            if not control.cancel_consumer(self.queue, destination=[node], reply=True, timeout=5.0):
                raise RuntimeError("no answer to cancel_consumer")
            answers = control.add_consumer(self.queue, destination=[node], reply=True, timeout=5.0)
            if not answers:
                raise RuntimeError("no answer to add_consumer")
        except Exception:  # noqa: BLE001 — the broker is away: turns reach it by the countdown copy meanwhile
            logger.exception("affinity: could not have worker %s consume %s again", node, self.queue)

    def _yield(self, why: str) -> None:
        """Another live worker holds this queue's row (``worker_heartbeat``): close every copy kept here,
        stop keeping (``own_queue`` is ``""`` in this process from now on: turns still delivered here run
        cold; at its stop this worker deletes neither the queue nor the other worker's rows) and end the
        loop."""
        logger.error("affinity: %s — this process (pid %s) keeps no thread loaded from now on; give each worker "
                     "its own node name (-n, make worker WORKER_NAME=…)", why, os.getpid())
        os.environ.pop(OWN_QUEUE_ENV, None)
        self.keeper.close_all()
        self._stop.set()

_loop: tuple[int, AffinityLoop] | None = None
_loop_lock = threading.Lock()


def affinity_start(keeper: Keeper, redispatch: Callable[[uuid.UUID], None] | None = None,
                   take_back_leases: Callable[[str], object] | None = None) -> AffinityLoop | None:
    """Start this process's ``AffinityLoop`` once (after any fork); ``None`` without an own queue.
    ``redispatch``: how to send a handed-off turn again (``dispatch.turn_dispatch_on_commit``);
    ``take_back_leases``: how to take back expired leases each round (``recovery.leases_take_back``)."""
    global _loop
    queue = own_queue()
    if not queue:
        return None
    with _loop_lock:
        if _loop is None or _loop[0] != os.getpid():
            loop = AffinityLoop(keeper, queue, redispatch, take_back_leases)
            loop.start()  # its first round writes the heartbeat row at once (on its own connection)
            _loop = (os.getpid(), loop)
        return _loop[1]


def affinity_stop(closed: list[KeptThread]) -> None:
    """Worker shutdown: stop the loop and forget this worker's rows (``closed``: the copies just closed)."""
    global _loop
    with _loop_lock:
        loop, _loop = _loop, None
    if loop is None or loop[0] != os.getpid():
        return
    loop[1].stop()
    try:
        close_old_connections()
        worker_gone(queue=loop[1].queue)
    except Exception:  # noqa: BLE001 — the row goes stale and the sweep removes it
        logger.exception("affinity: could not remove worker %s's rows (%s kept threads closed)", loop[1].queue, len(closed))
