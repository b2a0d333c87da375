"""Row reads and writes of the worker's hot path (claim, stream events, finalize) without the ORM's
query compilation.

On a 2-core host each ORM query costs ~0.3–1 ms of Python to compile before its round trip, and a
warm turn's claim and finalize made ~40 of them while codex competed for the CPU (``make bench-warm``,
py-spy). These helpers build the SQL from the models' own metadata (tables, columns, and each field's
``get_db_prep_save`` / database converters, as the ORM does), so they follow a renamed column or a
changed field type; they work on any backend Django supports. They do not send signals or run
``pre_save`` (set ``auto_now`` fields yourself: ``touch``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, TypeVar

from django.db import connection
from django.db.models import Field, Model
from django.utils import timezone

M = TypeVar("M", bound=Model)


def instance_from_row(model: type[M], values: Sequence[Any]) -> M:
    """A saved instance of ``model`` from a raw row holding all its concrete fields, in their order,
    converted as the ORM's compiler converts them (on PostgreSQL ``JSONField`` values arrive as text:
    Django registers a text loader for jsonb)."""
    converted = list(values)
    for i, col in _converted_columns(model):
        value = converted[i]
        for convert in connection.ops.get_db_converters(col) + col.get_db_converters(connection):
            value = convert(value, col, connection)
        converted[i] = value
    return model.from_db(connection.alias, _attnames(model), converted)


@functools.cache
def _attnames(model: type[Model]) -> list[str]:
    return [f.attname for f in model._meta.concrete_fields]


@functools.cache
def _converted_columns(model: type[Model]) -> tuple[tuple[int, Any], ...]:
    """``(position, column)`` of the concrete fields of ``model`` that have database converters (on
    PostgreSQL only the ``JSONField`` ones): the others are taken as they come. Whether a field has
    converters depends on its type and the backend, never on the connection; the converters
    themselves are looked up per call (bound to the calling thread's connection)."""
    found = []
    for i, f in enumerate(model._meta.concrete_fields):
        col = f.cached_col
        if connection.ops.get_db_converters(col) + col.get_db_converters(connection):
            found.append((i, col))
    return tuple(found)


def columns(model: type[Model], alias: str = "") -> str:
    """``alias.col1, alias.col2, …`` of all concrete fields of ``model`` (the order ``instance_from_row``
    reads)."""
    q = connection.ops.quote_name
    prefix = f"{alias}." if alias else ""
    return ", ".join(f"{prefix}{q(str(f.column))}" for f in model._meta.concrete_fields)


def row_update_sql(instance: Model, fields: Sequence[str]) -> tuple[str, list[Any]]:
    """``UPDATE … SET <fields> WHERE pk = …`` of ``instance``'s current values, and its parameters."""
    model = type(instance)
    sql, targets = _update_sql(model, tuple(fields))
    params = [f.get_db_prep_save(getattr(instance, f.attname), connection) for f in targets]
    pk = model._meta.pk
    assert pk is not None
    return sql, [*params, pk.get_db_prep_value(instance.pk, connection)]


@functools.cache
def _update_sql(model: type[Model], fields: tuple[str, ...]) -> tuple[str, list[Field[Any, Any]]]:
    """The text of ``row_update_sql`` and its target fields, built once per process (one backend)."""
    q = connection.ops.quote_name
    targets: list[Field[Any, Any]] = [model._meta.get_field(name) for name in fields]  # type: ignore[misc]
    pk = model._meta.pk
    assert pk is not None
    sql = (f"UPDATE {q(model._meta.db_table)} SET " + ", ".join(f"{q(str(f.column))} = %s" for f in targets)
           + f" WHERE {q(str(pk.column))} = %s")
    return sql, targets


def row_update(instance: Model, fields: Sequence[str]) -> int:
    """Write ``fields`` of ``instance`` (by primary key) in one statement; returns the rows changed.
    ``save(update_fields=…)`` without its compilation."""
    sql, params = row_update_sql(instance, fields)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def rows_insert_sql(objs: Sequence[Model], fields: Sequence[str]) -> tuple[str, list[Any]]:
    """``INSERT INTO … (<fields>) VALUES (…), (…)`` of unsaved instances of one model, and its parameters."""
    sql, targets = _insert_sql(type(objs[0]), tuple(fields), len(objs))
    params = [f.get_db_prep_save(getattr(obj, f.attname), connection) for obj in objs for f in targets]
    return sql, params


@functools.lru_cache(maxsize=256)
def _insert_sql(model: type[Model], fields: tuple[str, ...], rows: int) -> tuple[str, list[Field[Any, Any]]]:
    """The text of ``rows_insert_sql`` for ``rows`` rows and its target fields (cached: most inserts
    of the hot path are of one to a few rows)."""
    q = connection.ops.quote_name
    targets: list[Field[Any, Any]] = [model._meta.get_field(name) for name in fields]  # type: ignore[misc]
    row = "(" + ", ".join(["%s"] * len(targets)) + ")"
    sql = (f"INSERT INTO {q(model._meta.db_table)} (" + ", ".join(q(str(f.column)) for f in targets) + ") VALUES "
           + ", ".join([row] * rows))
    return sql, targets


def touch(instance: Model, *names: str) -> None:
    """Set the ``auto_now`` fields ``names`` of ``instance`` to now, as ``save()`` would."""
    now = timezone.now()
    for name in names:
        setattr(instance, name, now)
