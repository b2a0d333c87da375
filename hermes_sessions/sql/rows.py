"""The models' values as the named statements (``queries.sql``) take them, and their rows back as model
instances, for the worker's hot path (claim, stream events, finalize) without the ORM's query compilation.

On a 2-core host each ORM query costs ~0.3–1 ms of Python to compile before its round trip, and a
warm turn's claim and finalize made ~40 of them while codex competed for the CPU (``make bench-warm``,
py-spy). Values are adapted as the ORM adapts them (each field's ``get_db_prep_save`` and database
converters). Nothing here sends signals or runs ``pre_save`` (set ``auto_now`` fields yourself: ``touch``).
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


def save_values(instance: Model, fields: Sequence[str]) -> list[Any]:
    """The values of ``instance``'s ``fields`` as a statement takes them (each field's ``get_db_prep_save``,
    as ``save`` adapts them: JSON fields to jsonb text, times to aware datetimes)."""
    return [f.get_db_prep_save(getattr(instance, f.attname), connection) for f in _fields(type(instance), tuple(fields))]


def pk_value(instance: Model) -> Any:
    """``instance``'s primary key as a statement takes it."""
    pk = type(instance)._meta.pk
    assert pk is not None
    return pk.get_db_prep_value(instance.pk, connection)


@functools.cache
def _fields(model: type[Model], names: tuple[str, ...]) -> list[Field[Any, Any]]:
    return [model._meta.get_field(name) for name in names]  # type: ignore[misc]


def touch(instance: Model, *names: str) -> None:
    """Set the ``auto_now`` fields ``names`` of ``instance`` to now, as ``save()`` would."""
    now = timezone.now()
    for name in names:
        setattr(instance, name, now)
