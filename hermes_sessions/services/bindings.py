"""Codex bindings and notices: the only code that writes ``CodexBinding`` and ``Notice`` rows.

A binding says which codex thread a session continues (``docs/contract.md`` §1); at most one is active per session
(a partial unique constraint), ended ones stay as history with the reason they ended. Writers:

* ``binding_publish`` — bind the thread a turn ran on, once its transcript rows are durable (I1);
* ``binding_rotate`` — end the binding codex proved gone and record the one rotation notice;
* ``binding_end`` — an operator ends the active binding (admin action), with its own notice;
* ``notice_acknowledge`` — an operator marks notices read;
* ``notice_webhook_disabled`` — a webhook endpoint was disabled (``webhooks.py``), told on a session.

``binding_publish`` and ``binding_rotate`` run inside the one transaction that ends a turn
(``turns._commit_turn``), under the session row lock; ``binding_end`` and ``notice_acknowledge`` open
their own.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Final, NamedTuple

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.utils import timezone

from ..metrics.process import thread_rotated
from ..models import CodexBinding, Notice, Session, Turn
from ..sanitize import clean_text
from .verbatim import rows_insert_verbatim

NOTICE_THREAD_ROTATED = "Codex thread could not be resumed; starting a new one."
NOTICE_BINDING_ENDED = "Codex thread binding ended by an operator; the next turn starts a new one."
MAX_REASON_CHARS = 8_000


def _require_transaction() -> None:
    if not connection.in_atomic_block:
        raise TransactionManagementError("binding writes of a turn run inside its finalize transaction")


def binding_rotate(*, session: Session, turn: Turn, thread_id: str, reason: str) -> bool:
    """End the session's active binding to ``thread_id`` — codex answered ``no rollout found`` for
    it during ``turn`` — and record the one rotation notice (``docs/contract.md`` §3); no notice when
    that binding was no longer active (an operator ended it meanwhile and got a notice of their own). ``reason`` is codex's
    error text. Inside the turn's finalize transaction, under the session lock. Returns whether it
    ended the binding (and so recorded the notice)."""
    _require_transaction()
    ended_reason = clean_text(f"codex could not resume the thread: {reason}", max_chars=MAX_REASON_CHARS)
    ended = CodexBinding.objects.filter(
        session=session, status=CodexBinding.Status.ACTIVE, thread_id=thread_id
    ).update(status=CodexBinding.Status.ENDED, ended_at=timezone.now(), ended_reason=ended_reason, ended_by_turn=turn)
    if ended:  # an operator who ended it while the turn ran has already said so in a notice of their own
        Notice.objects.create(session=session, turn=turn, kind=Notice.Kind.LIFECYCLE, text=NOTICE_THREAD_ROTATED)
        transaction.on_commit(thread_rotated)
    return bool(ended)


class ActiveBinding(NamedTuple):
    """The session's active binding as the finalize read it: its primary key and thread."""

    pk: int
    thread_id: str


#: ``binding_publish(active=UNREAD)``: it reads the active binding itself.
UNREAD: Final = object()


def binding_publish(*, session: Session, turn: Turn, thread_id: str, resumed: bool,
                    active: ActiveBinding | None | object = UNREAD) -> None:
    """Bind ``session`` to ``thread_id``, the thread ``turn`` ran on, now that the turn's rows commit
    with it (I1). Inside the turn's finalize transaction, under the session lock.

    * Already bound to it: nothing to do (its rollout is stored in the same transaction).
    * ``resumed`` but the binding was ended meanwhile (an operator's decision while the turn ran):
      nothing — the next turn starts a fresh thread.
    * Otherwise an active binding to another thread ends ("replaced by a newer thread") and a new
      one is created.

    ``active``: the session's active binding (``None``: none) as the caller read it in this transaction,
    after the session lock and after any ``binding_rotate`` (the finalize's one statement,
    ``turns._end_turn``); by default it is read here.
    """
    _require_transaction()
    if active is UNREAD:
        row = CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ACTIVE).values_list(
            "pk", "thread_id").first()
        active = ActiveBinding(*row) if row is not None else None
    assert active is None or isinstance(active, ActiveBinding)
    if active and active.thread_id == thread_id:
        return
    if resumed:
        return
    if active:
        CodexBinding.objects.filter(pk=active.pk).update(
            status=CodexBinding.Status.ENDED, ended_at=timezone.now(), ended_reason="replaced by a newer thread",
            ended_by_turn=turn)
    CodexBinding.objects.create(
        session=session, thread_id=clean_text(thread_id, max_chars=64), created_by_turn=turn
    )


def binding_end(*, session: Session, reason: str) -> bool:
    """End the session's active binding (an operator's decision) and record a notice; the next turn
    then starts a fresh thread seeded with the transcript. Returns False when there was none."""
    with transaction.atomic():
        Session.objects.select_for_update().get(pk=session.pk)
        ended = CodexBinding.objects.filter(session=session, status=CodexBinding.Status.ACTIVE).update(
            status=CodexBinding.Status.ENDED, ended_at=timezone.now(), ended_reason=clean_text(reason, max_chars=1000)
        )
        if ended:
            Notice.objects.create(session=session, kind=Notice.Kind.LIFECYCLE, text=NOTICE_BINDING_ENDED)
        return bool(ended)


def notice_webhook_disabled(*, session_id: str, text: str) -> bool:
    """Record a ``webhook`` notice ``text`` on session ``session_id`` (no turn); ``False`` when the session
    no longer exists (nothing written). In the caller's transaction (``webhooks.webhook_attempt_record``)."""
    _require_transaction()
    if not Session.objects.filter(pk=session_id).exists():
        return False
    Notice.objects.create(session_id=session_id, kind=Notice.Kind.WEBHOOK, text=clean_text(text))
    return True


def notice_acknowledge(*, notices: Iterable[Notice], user: AbstractBaseUser | AnonymousUser) -> int:
    """Mark unacknowledged notices acknowledged by ``user``; returns how many changed."""
    ids = [n.pk for n in notices]
    with transaction.atomic():
        return Notice.objects.filter(pk__in=ids, acknowledged_at__isnull=True).update(
            acknowledged_at=timezone.now(), acknowledged_by=user
        )


def binding_history_insert(*, bindings: list[CodexBinding], notices: list[Notice]) -> None:
    """Store an exported session's bindings and notices as they were (``manage.py import_sessions``):
    times, reasons and acknowledgements kept. Inside the import's transaction, after the session and
    its turns are inserted. Raises ``ValueError`` when more than one binding is active (the database's
    one-active-binding constraint would refuse it too), ``IntegrityError`` from the database."""
    _require_transaction()
    if sum(b.status == CodexBinding.Status.ACTIVE for b in bindings) > 1:
        raise ValueError("more than one active codex binding")
    rows_insert_verbatim(bindings)
    rows_insert_verbatim(notices)
