"""Where a session's next turn goes: the worker holding its thread loaded, and how that worker is woken.

The rows session affinity routes by (``WarmThread``: which worker keeps a session's thread loaded, until
when, at which rollout generation; ``TurnWorker``: that worker's heartbeat and whether its wake listener
listens), read at enqueue and written at finalize under the session lock, and the wake's wire format
(``pg_notify(wake_channel(route), wake_payload(...))``, sent in the enqueue's transaction). A worker is
named by its **route**, ``<HERMES_TURN_QUEUE>.<node name>`` (the ``queue`` column of both tables, the
wake channel's name is derived from it): no Celery queue of that name exists; the worker hears of its
turns by the wake alone (docs/architecture.md §4, the delivery table). The process-side half — the
heartbeat loop and the listener — is ``hermes_sessions/worker/`` (``affinity.py``, ``wake.py``).

Facts: PostgreSQL 15 delivers a notification sent in a transaction only when it commits, and never for
one rolled back (docs: NOTIFY); a channel name is an identifier of at most 63 bytes, so a worker's
channel is named by a hash of its route.
"""
from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from ..models import CodexRollout, Session, TurnWorker, WarmThread
from ..sql import query
from .pipelining import Batch

OWN_ROUTE_ENV = "HERMES_OWN_ROUTE"


def route_name(node: str) -> str:
    """The route of worker ``node`` (its ``-n`` name, e.g. ``celery@host``): ``<HERMES_TURN_QUEUE>.<node>``."""
    return f"{settings.HERMES_TURN_QUEUE}.{node}"


def own_route() -> str:
    """This process's route, or ``""`` when it has none (not a one-turn-at-a-time worker, or an API
    process): then it keeps no thread loaded. Set by ``project/celery.py`` at worker start."""
    return os.environ.get(OWN_ROUTE_ENV, "")


def route_taken(queue: str, *, pid: int | None = None) -> str:
    """Why this process may not keep threads under route ``queue`` (``""``: it may): another live
    worker already does — its ``TurnWorker`` heartbeat is fresh and it runs on another host, or on this one
    as a live process other than ``pid`` (this process, when it checks its own row). Two workers with one
    node name (``make worker`` twice without ``WORKER_NAME``, or one started while a frozen one's row had
    been swept) would share the route, and a session's turns would alternate between them, mostly cold."""
    fresh = timezone.now() - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS)
    row = TurnWorker.objects.filter(queue=queue, heartbeat_at__gt=fresh).values("host", "pid").first()
    return _live_elsewhere(queue, row, pid)


def _live_elsewhere(queue: str, row: Mapping[str, Any] | None, pid: int | None) -> str:
    if row is None:
        return ""
    if row["host"] != socket.gethostname():
        return f"worker route {queue} is already used by a live worker on host {row['host']}"
    if row["pid"] == pid:
        return ""
    try:
        os.kill(row["pid"], 0)
    except ProcessLookupError:
        return ""
    except PermissionError:
        pass
    return f"worker route {queue} is already used by live process {row['pid']} on this host"


def _routable() -> QuerySet[WarmThread]:
    """The ``WarmThread`` rows a turn may be routed by: window open, and the worker holding the thread
    has a heartbeat fresher than ``HERMES_WORKER_STALE_SECONDS``."""
    now = timezone.now()
    fresh = TurnWorker.objects.filter(queue=OuterRef("queue"),
                                      heartbeat_at__gt=now - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS))
    return WarmThread.objects.filter(until__gt=now).filter(Exists(fresh))


@dataclass(frozen=True)
class Route:
    """Where a turn goes first: the route of the worker holding its session's thread, and whether that
    worker's wake listener listens (``TurnWorker.wakeable``, ``worker/wake.py``): only then is it woken;
    otherwise the turn goes to the shared queue."""

    queue: str
    wakeable: bool = False


def turn_route(turn_id: uuid.UUID | str) -> tuple[Route, str] | None:
    """Where turn ``turn_id`` goes first, with its session id: its session's ``WarmThread`` window is open
    and that worker's heartbeat is fresher than ``HERMES_WORKER_STALE_SECONDS`` (``None``: no holder, the
    shared queue). One query."""
    wakeable = TurnWorker.objects.filter(queue=OuterRef("queue"), wakeable=True)
    row = (_routable().filter(session__turns__id=turn_id).annotate(wakeable=Exists(wakeable))
           .values_list("queue", "wakeable", "session_id").first())
    return (Route(queue=row[0], wakeable=bool(row[1])), str(row[2])) if row else None


def parse_route(value: str | None) -> Route | None:
    """The enqueue's route value (``'wake:<queue>'`` or ``'queue:<queue>'``) → ``Route``; ``None``
    for ``NULL`` (no route)."""
    if not value:
        return None
    kind, _, queue = value.partition(":")
    return Route(queue=queue, wakeable=kind == "wake") if queue else None


def session_route_params(session_id: str) -> list[Any]:
    """The parameters of the route that ``turn_route`` reads, for a turn of session ``session_id``, as the
    enqueue's statements read it (``queries.sql``: ``enqueue_reads``, ``enqueue_reads_and_wake``): the
    session, the time now, the oldest fresh heartbeat. Its value there is ``'wake:<queue>'`` (the holder's
    wake listener listens) or ``'queue:<queue>'``, ``NULL`` for none (``parse_route`` reads it): the
    enqueue reads the route in a query it makes anyway, under the session lock (the ORM's compile of the
    annotated subquery cost ~1 ms of the POST)."""
    now = timezone.now()
    fresh = now - timedelta(seconds=settings.HERMES_WORKER_STALE_SECONDS)
    return [session_id, now, fresh]


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
    """``warm_thread_record``'s statement and its parameters: an upsert (``queries.sql``:
    ``warm_thread_upsert``; ``update_or_create`` took a savepoint, a ``SELECT … FOR UPDATE`` and an UPDATE)
    of the row for ``queue``, or with an empty ``queue`` the ``DELETE`` of the session's row
    (``warm_thread_delete``). The ORM's ``bulk_create`` compile was ~7 % of a warm finalize (py-spy)."""
    if not queue:
        return query("warm_thread_delete"), [session_id]
    until = timezone.now() + timedelta(seconds=settings.HERMES_WARM_IDLE_SECONDS)
    return query("warm_thread_upsert"), [session_id, queue, thread_id, generation, until]


def warm_thread_forget(*, queue: str, session_ids: list[str] | None = None) -> int:
    """Delete the ``WarmThread`` rows naming ``queue`` (only of ``session_ids`` when given): that worker
    no longer holds them. Returns how many."""
    rows = WarmThread.objects.filter(queue=queue)
    if session_ids is not None:
        rows = rows.filter(session_id__in=session_ids)
    deleted, _ = rows.delete()
    return deleted


def taken_elsewhere(*, queue: str, kept: list[tuple[str, str, int]]) -> dict[str, str]:
    """Of ``kept`` (``(session id, thread id, generation)`` kept by worker ``queue``), those another
    worker took, with why: their ``WarmThread`` row names another queue or is gone (a turn ended
    elsewhere, or the session was deleted), or the thread's stored generation is not the kept one."""
    if not kept:
        return {}
    ids = [s for s, _, _ in kept]
    rows = dict(WarmThread.objects.filter(session_id__in=ids).values_list("session_id", "queue"))
    generations = dict(CodexRollout.objects.filter(thread_id__in=[t for _, t, _ in kept])
                       .values_list("thread_id", "generation"))
    why: dict[str, str] = {}
    for session_id, thread_id, generation in kept:
        if rows.get(session_id) != queue:
            why[session_id] = f"its last turn ended on {rows.get(session_id) or 'a worker that keeps nothing'}"
        elif generations.get(thread_id) != generation:
            stored = generations.get(thread_id)
            why[session_id] = (f"its rollout moved on to generation {stored}" if stored is not None
                               else "its stored rollout is gone")
    return why


def worker_heartbeat(*, queue: str, kept: int, wakeable: bool = False) -> str:
    """Upsert this worker's ``TurnWorker`` row with ``heartbeat_at = now`` (``kept``: the threads it keeps loaded,
    ``wakeable``: its wake listener listens); returns ``""``. Refuses (writes
    nothing, returns why) when the row is another live worker's (``route_taken``): this process was
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


CHANNEL_PREFIX = "hermes_wake_"


# PostgreSQL 15: a NOTIFY payload "must be shorter than 8000 bytes" in the default configuration (docs: NOTIFY).
NOTIFY_PAYLOAD_MAX_BYTES = 7999


def wake_channel(queue: str) -> str:
    """The ``LISTEN`` channel of the worker of route ``queue``: ``hermes_wake_`` + 20 hex
    digits of its SHA-256 (a node name can be longer than a channel name may be). SHA-256 because
    PostgreSQL computes it too: the enqueue's one round trip names the channel in SQL from the route it
    reads there (``queries.sql``: ``enqueue_reads_and_wake``)."""
    return CHANNEL_PREFIX + hashlib.sha256(queue.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class WakeHint:
    """What a wake carries besides its turn so that the woken worker may send ``turn/start`` to the kept
    thread while it claims the turn (``early_start.py``): the turn's ``text`` (its stored input) and
    ``sent_at``, the enqueuing process's ``time.time()`` just before its commit (epoch seconds)."""

    text: str
    sent_at: float


def wake_payload(*, turn_id: uuid.UUID, session_id: str, text: str | None = None, sent_at: float | None = None) -> str:
    """``'<turn id> <session id>'``, and with ``text`` (``HERMES_EARLY_START``) ``'\n<sent_at>\n<text>'``
    after it (``WakeHint``) when the whole payload fits PostgreSQL's limit (``NOTIFY_PAYLOAD_MAX_BYTES``;
    a longer input goes without: its worker claims before ``turn/start``, as without the hint)."""
    head = f"{turn_id} {session_id}"
    if text is None:
        return head
    full = f"{head}\n{time.time() if sent_at is None else sent_at:.6f}\n{text}"
    return full if len(full.encode("utf-8")) <= NOTIFY_PAYLOAD_MAX_BYTES else head


def wake_batched(batch: Batch, *, queue: str, turn_id: uuid.UUID, session_id: str, text: str | None = None) -> None:
    """Hold, in ``batch``'s transaction, the ``pg_notify`` that wakes the worker of route ``queue`` for
    turn ``turn_id`` of ``session_id`` — delivered by PostgreSQL at the commit, never if it rolls back —
    with the turn's ``text`` as its hint (``wake_payload``) when ``HERMES_EARLY_START`` is on. A no-op
    when ``queue`` is empty."""
    if queue:
        hint = text if settings.HERMES_EARLY_START else None
        batch.add(query("notify"), [wake_channel(queue),
                                     wake_payload(turn_id=turn_id, session_id=session_id, text=hint)])


def parse_payload(payload: str) -> tuple[uuid.UUID, str, WakeHint | None] | None:
    """``wake_payload``'s text → ``(turn id, session id, hint or None)``; ``None`` for anything else (a
    malformed hint is dropped, the wake kept: the hint only saves time)."""
    head, _, rest = payload.partition("\n")
    turn, _, session = head.partition(" ")
    try:
        turn_id = uuid.UUID(turn)
    except ValueError:
        return None
    hint = None
    if rest:
        stamp, sep, text = rest.partition("\n")
        try:
            hint = WakeHint(text=text, sent_at=float(stamp)) if sep and text else None
        except ValueError:
            hint = None
    return turn_id, session, hint
