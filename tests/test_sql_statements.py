"""The named statements (``hermes_sessions/sql/queries.sql``) against the migrated test database and the
models: a renamed table or column, a field added to a model whose rows a statement reads whole, or a
statement named in code that the file lacks fails here instead of in production."""
from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from django.db import connection, transaction
from psycopg import sql as psycopg_sql

from hermes_sessions import sql
from hermes_sessions.api.event_hub import ROW_FIELDS
from hermes_sessions.models import Message, Session, Turn, TurnEvent
from hermes_sessions.services import turns

PACKAGE = Path(sql.__file__).resolve().parents[1]
# Utility statements PostgreSQL does not PREPARE: run instead (below).
NOT_PREPARABLE = {"transaction_repeatable_read", "listen"}


def _placeholders_filled(text: str) -> str:
    """``text`` with its caller-filled parts as one row, and psycopg's ``%s`` / ``%(name)s`` as ``$n``."""
    text = text.replace("{values}", "(0, %(k0)s, %(d0)s::jsonb)").replace("{rows}", sql.value_rows(10, 1))
    numbers: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        key = match.group(1) or f"#{len(numbers)}"
        return f"${numbers.setdefault(key, len(numbers) + 1)}"

    return re.sub(r"%(?:\((\w+)\))?s", number, text)


@pytest.mark.django_db
@pytest.mark.parametrize("name", sorted(set(sql.queries()) - NOT_PREPARABLE))
def test_every_statement_prepares_against_the_migrated_database(name):
    """PostgreSQL parses and analyzes a prepared statement (every table, column and type) without running it."""
    with connection.cursor() as cursor:
        cursor.execute(f"PREPARE hermes_check AS {_placeholders_filled(sql.query(name))}")
        cursor.execute("DEALLOCATE hermes_check")


@pytest.mark.django_db(transaction=True)  # SET TRANSACTION must be a transaction's first statement
def test_the_utility_statements_run():
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql.query("transaction_repeatable_read"))
        cursor.execute("SHOW transaction_isolation")
        assert cursor.fetchone()[0] == "repeatable read"
    raw = connection.connection
    raw.execute(psycopg_sql.SQL(sql.query("listen")).format(channel=psycopg_sql.Identifier("hermes check")))
    raw.execute("UNLISTEN *")


@pytest.mark.django_db
@pytest.mark.parametrize("name", ["lock_session_and_turn", "lock_session_and_turn_skip_locked"])
def test_the_lock_reads_every_column_of_both_models_in_their_order(name):
    """``locks._locked_rows`` splits the row at the session's column count and builds both instances."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute(sql.query(name), {"turn": uuid.uuid4()})
        got = [column.name for column in cursor.description]
    assert got == [f.column for f in Session._meta.concrete_fields] + [f.column for f in Turn._meta.concrete_fields]


@pytest.mark.django_db
def test_the_hubs_read_names_its_row_fields():
    with connection.cursor() as cursor:
        cursor.execute(sql.query("turn_events_after"), ["none", 0, 1])
        assert tuple(column.name for column in cursor.description) == ROW_FIELDS
    assert {f.name for f in TurnEvent._meta.concrete_fields} >= {name.removesuffix("_id") for name in ROW_FIELDS}


def _columns(text: str, after: str) -> list[str]:
    """The quoted column list that follows ``after`` in ``text``."""
    found = re.search(re.escape(after) + r" \(([^)]*)\)", text)
    assert found, after
    return [c.strip().strip('"') for c in found.group(1).split(",")]


def test_the_statements_python_fills_by_field_list_name_those_fields_in_order():
    """The writes whose parameters Python lists field by field (``turns._TURN_FIELDS``, ``_MESSAGE_FIELDS``,
    ``_FINISH_FIELDS``): the statement's columns are those fields' columns, in that order, and a turn
    insert writes every column of ``Turn``."""
    def columns_of(model, names):
        return [model._meta.get_field(name).column for name in names]

    turn_columns = columns_of(Turn, turns._TURN_FIELDS)
    assert turn_columns == [f.column for f in Turn._meta.concrete_fields]
    for name in ("turn_insert", "turn_insert_drawn", "turn_insert_drawn_owned"):
        assert _columns(sql.query(name), 'INSERT INTO "hermes_sessions_turn"') == turn_columns
    assert _columns(sql.query("messages_append"), 'INSERT INTO "hermes_sessions_message"') == columns_of(
        Message, turns._MESSAGE_FIELDS)
    finish = re.findall(r'"(\w+)" = %s', sql.query("turn_finish"))
    assert finish == [*columns_of(Turn, turns._FINISH_FIELDS), Turn._meta.pk.column]
    for name in ("turn_end_keeping_warm", "turn_end_forgetting_warm"):
        assert sql.query(name).startswith(f"WITH t AS ({sql.query('turn_finish')})")


def test_every_statement_is_named_by_the_code_and_every_name_in_the_code_is_a_statement():
    code = "\n".join(path.read_text() for path in PACKAGE.rglob("*.py") if "migrations" not in path.parts)
    called = set(re.findall(r'query\("(\w+)"\)', code))
    assert called - set(sql.queries()) == set()
    quoted = set(re.findall(r'"(\w+)"', code))
    assert set(sql.queries()) - quoted == set()  # a statement no code names is dead: remove it


def test_a_name_given_twice_or_a_statement_without_text_is_refused():
    with pytest.raises(ValueError, match="named twice"):
        sql.parse("-- name: a\nSELECT 1;\n-- name: a\nSELECT 2;\n")
    with pytest.raises(ValueError, match="no text for b"):
        sql.parse("-- name: a\nSELECT 1;\n-- name: b\n-- nothing\n")
    assert sql.parse("-- name: a\n-- what it does\nSELECT 1,\n    2;\n") == {"a": "SELECT 1, 2"}
