"""Inserting rows exactly as an export holds them (``manage.py import_sessions``).

Django's ``auto_now`` / ``auto_now_add`` fields are overwritten with "now" by every insert, including
``bulk_create``; a restored session must keep its own times (``created_at`` orders notices and
bindings, ``updated_at`` is the session's last activity). ``bulk_update`` writes the given values
without that step, so insert first, then put the exported times back, in the caller's transaction.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from django.db import connection, models
from django.db.transaction import TransactionManagementError

from ..sql import query

M = TypeVar("M", bound=models.Model)

BATCH_SIZE = 2_000


def _auto_time_fields(model: type[models.Model]) -> list[str]:
    return [
        f.name for f in model._meta.concrete_fields
        if getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False)
    ]


def _sequence_catch_up(model: type[models.Model], given: list[int]) -> None:
    """Rows inserted with their own auto ids (a notice's ``id``) leave the table's sequence behind
    them; move it past the largest, never back, so the next ordinary insert does not collide."""
    pk = model._meta.pk
    if not given or not isinstance(pk, (models.AutoField, models.BigAutoField, models.SmallAutoField)):
        return
    table = model._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(query("sequence_catch_up"), [table, pk.column, max(given), max(given), table, pk.column])


def rows_insert_verbatim(objs: Sequence[M]) -> list[M]:
    """Insert unsaved instances of one model keeping every value they carry, automatic timestamps
    included (one left ``None`` gets the insert's "now") and auto ids (the sequence is moved past
them; one left ``None`` gets the next); returns them with primary keys set. Runs inside the caller's ``transaction.atomic``
    (raises ``TransactionManagementError`` otherwise: a half-restored session must roll back whole);
    database errors (``IntegrityError``, …) propagate."""
    if not connection.in_atomic_block:
        raise TransactionManagementError("rows_insert_verbatim runs inside the import's transaction")
    if not objs:
        return []
    model = type(objs[0])
    timed = _auto_time_fields(model)
    kept = [[getattr(obj, name) for name in timed] for obj in objs]
    created = model._default_manager.bulk_create(objs, batch_size=BATCH_SIZE)
    _sequence_catch_up(model, [obj.pk for obj in objs if isinstance(obj.pk, int)])
    if timed:
        for obj, values in zip(created, kept, strict=True):
            for name, value in zip(timed, values, strict=True):
                if value is not None:  # None: the row had no time of its own; "now" from the insert stays
                    setattr(obj, name, value)
        model._default_manager.bulk_update(created, timed, batch_size=BATCH_SIZE)
    return created
