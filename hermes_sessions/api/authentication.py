"""``PreparedTokenAuthentication``: DRF's ``TokenAuthentication`` (``Authorization: Token <key>``), its token
read done as one prepared statement.

Why: every API request authenticates first, and a turn's ``POST`` waits for it before anything else. DRF
reads the token with ``Token.objects.select_related("user").get(key=key)``: the ORM compiles the join on
every request and Django binds its values client-side, so PostgreSQL parses and plans a new text each time.
That was ~1.3 ms on an idle host (the median of 500 reads in a loop: 1.29 ms against 0.22 ms for this
read; session 10) and ~2.4 ms of a warm turn's ``POST`` on the loaded 2-core host (``make bench-warm``
with timestamps along the request) — the largest single step before the turn row is written. The same
read, by the model's metadata, bound server-side and prepared after ``DATABASE_PREPARE_THRESHOLD`` runs
(``services.pipelining.prepared_cursor``), builds the same ``Token`` and ``User`` instances
(``Model.from_db``). Everything else — the header parsing, the errors and their messages, the inactive-user
check, ``WWW-Authenticate`` — is DRF's own code.
"""
from __future__ import annotations

import functools
from typing import Any

from django.contrib.auth import get_user_model
from django.db import connection
from django.utils.translation import gettext_lazy as _
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token

from ..services.pipelining import prepared_cursor


class PreparedTokenAuthentication(TokenAuthentication):
    """DRF's ``TokenAuthentication`` with ``authenticate_credentials`` as one prepared statement
    (module docstring). Returns ``(user, token)``; raises ``AuthenticationFailed("Invalid token.")`` for an
    unknown key (a NUL byte in it included: PostgreSQL refuses NUL in text, so it never reaches the server)
    and ``AuthenticationFailed("User inactive or deleted.")`` for an inactive user — DRF's messages."""

    def authenticate_credentials(self, key: str) -> tuple[Any, Token]:
        if self.get_model() is not Token:
            return super().authenticate_credentials(key)
        if "\x00" in key:
            raise exceptions.AuthenticationFailed(_("Invalid token."))
        sql, token_fields, user_fields = _token_user_sql()
        connection.ensure_connection()
        with prepared_cursor() as cursor:
            cursor.execute(sql, [key])
            row = cursor.fetchone()
        if row is None:
            raise exceptions.AuthenticationFailed(_("Invalid token."))
        token = Token.from_db(connection.alias, token_fields, row[:len(token_fields)])
        user = get_user_model().from_db(connection.alias, user_fields, row[len(token_fields):])
        token.user = user  # what select_related("user") caches
        if not user.is_active:
            raise exceptions.AuthenticationFailed(_("User inactive or deleted."))
        return user, token


@functools.cache
def _token_user_sql() -> tuple[str, list[str], list[str]]:
    """``SELECT <token columns>, <user columns> FROM token JOIN user … WHERE key = %s`` from the models'
    metadata, and the two models' ``attname`` lists in column order (for ``Model.from_db``)."""
    user_model = get_user_model()
    q = connection.ops.quote_name
    token_cols = list(Token._meta.concrete_fields)
    user_cols = list(user_model._meta.concrete_fields)
    user_fk = Token._meta.get_field("user")
    select = ", ".join([*(f"t.{q(str(f.column))}" for f in token_cols), *(f"u.{q(str(f.column))}" for f in user_cols)])
    user_pk, token_pk = user_model._meta.pk, Token._meta.pk
    assert user_pk is not None and token_pk is not None
    sql = (f"SELECT {select} FROM {q(Token._meta.db_table)} t JOIN {q(user_model._meta.db_table)} u "
           f"ON u.{q(str(user_pk.column))} = t.{q(str(user_fk.column))} WHERE t.{q(str(token_pk.column))} = %s")
    return sql, [f.attname for f in token_cols], [f.attname for f in user_cols]
