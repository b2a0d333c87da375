"""Pagination for the API's lists.

DRF reads ``?page_size=`` leniently (``null`` or ``abc`` silently become the default) and answers a
non-numeric ``?page=`` with 404. Here both query parameters are what the schema says they are:
an integer ≥ 1, or the request is refused with 400 naming the parameter. ``page_size`` above
``max_page_size`` is served as ``max_page_size`` (the schema says so); a ``page`` past the last
one is DRF's 404 ``Invalid page.`` (documented on each list operation).
"""
from __future__ import annotations

import re
from typing import Any

from django.core.paginator import Paginator
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import Cursor, CursorPagination, PageNumberPagination
from rest_framework.request import Request

_DIGITS = re.compile(r"[0-9]+")
# Longer numbers are past any page or page size there is; int() of them is not needed (and Python
# refuses int() of strings over 4,300 digits).
_MAX_DIGITS = 18
PAGE_SIZE_PARAM = "page_size"


def positive_int_param(request: Request, name: str) -> int | None:
    """``?name=`` as an int ≥ 1; ``None`` when absent. Raises DRF's ``ValidationError`` (400,
    ``errors: {name: [...]}``) for anything else: ``null``, ``abc``, ``1.5``, ``0``, ``-3``, empty.
    A number of more than 18 digits is returned as ``10**18`` (larger than any page or cap)."""
    raw = request.query_params.get(name)
    if raw is None:
        return None
    digits = raw.lstrip("0") if _DIGITS.fullmatch(raw) else ""
    if not digits:
        raise ValidationError({name: [f"{name} must be an integer of at least 1, not {raw[:40]!r}."]})
    return 10**_MAX_DIGITS if len(digits) > _MAX_DIGITS else int(digits)


class _StrictPageSize:
    """``page_size`` parsed by ``positive_int_param`` and capped at ``max_page_size``."""

    page_size: int
    max_page_size: int

    def get_page_size(self, request: Request) -> int:
        """The page size asked for (capped at ``max_page_size``), or the default when absent."""
        asked = positive_int_param(request, PAGE_SIZE_PARAM)
        return self.page_size if asked is None else min(asked, self.max_page_size)

    def page_size_schema(self) -> dict[str, Any]:
        """The OpenAPI parameter for ``page_size``, saying what the code above does."""
        return {
            "name": PAGE_SIZE_PARAM,
            "required": False,
            "in": "query",
            "description": f"Rows per page, default {self.page_size}; values above {self.max_page_size} are served as "
            f"{self.max_page_size}. Not an integer ≥ 1: 400.",
            "schema": {"type": "integer", "minimum": 1},
        }


class StandardPagination(_StrictPageSize, PageNumberPagination):
    """Page-numbered lists (sessions, turns, notices): ``?page=N`` (≥ 1; past the last page: 404),
    ``?page_size=`` up to 500 (default 50)."""

    page_size = 50
    page_size_query_param = PAGE_SIZE_PARAM
    max_page_size = 500

    def get_page_number(self, request: Request, paginator: Paginator) -> int:
        """``?page=`` as an int ≥ 1 (400 otherwise); DRF's ``last`` is not offered. A number past
        the last page raises 404 here already when it is too long to be a page at all."""
        number = positive_int_param(request, self.page_query_param)
        if number is not None and number >= 10**_MAX_DIGITS:
            raise NotFound(self.invalid_page_message)
        return number or 1

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        """``page`` and ``page_size`` with their real bounds."""
        page = {
            "name": self.page_query_param,
            "required": False,
            "in": "query",
            "description": "Page number, from 1 (the default). Not an integer ≥ 1: 400; past the last page: 404.",
            "schema": {"type": "integer", "minimum": 1},
        }
        return [page, self.page_size_schema()]


class TranscriptPagination(_StrictPageSize, CursorPagination):
    """The transcript in ``seq`` order. A cursor (not an offset) so rows appended while a client
    pages never shift or repeat a page; ``seq`` is unique within a session. ``?page_size=`` up to 500."""

    ordering = "seq"
    page_size = 50
    page_size_query_param = PAGE_SIZE_PARAM
    max_page_size = 500

    def decode_cursor(self, request: Request) -> Cursor | None:
        """DRF's cursor, with the position checked: ``seq`` is an integer, so a forged cursor whose
        position is not one is refused like any other invalid cursor (404), never a 500."""
        cursor = super().decode_cursor(request)
        if cursor is not None and cursor.position is not None:
            try:
                int(cursor.position)
            except (TypeError, ValueError):
                raise NotFound(self.invalid_cursor_message) from None
        return cursor

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        """``cursor`` (opaque, from ``next``/``previous``) and ``page_size`` with its real bounds."""
        cursor = {
            "name": self.cursor_query_param,
            "required": False,
            "in": "query",
            "description": "The opaque position from a page's `next` or `previous` link (base64). One the server "
            "did not make: 404 `Invalid cursor`.",
            # DRF writes cursors with base64.b64encode: these characters only.
            "schema": {"type": "string", "pattern": "^[A-Za-z0-9+/=]*$"},
        }
        return [cursor, self.page_size_schema()]

class TranscriptSearchPagination(TranscriptPagination):
    """Search results within one session (``?q=``), newest first: a keyset cursor on ``-seq``."""

    ordering = "-seq"


class MessageSearchPagination(TranscriptPagination):
    """Search results across the caller's sessions, newest first: a keyset cursor on ``-id`` (message
    ids grow with insertion and are unique)."""

    ordering = "-id"
