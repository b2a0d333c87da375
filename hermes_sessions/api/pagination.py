"""Pagination for the API's lists."""
from __future__ import annotations

from rest_framework.exceptions import NotFound
from rest_framework.pagination import Cursor, CursorPagination, PageNumberPagination
from rest_framework.request import Request


class StandardPagination(PageNumberPagination):
    """Page-numbered lists (sessions, notices): ``?page=N``, ``?page_size=`` up to 500 (default 50)."""

    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 500


class TranscriptPagination(CursorPagination):
    """The transcript in ``seq`` order. A cursor (not an offset) so rows appended while a client
    pages never shift or repeat a page; ``seq`` is unique within a session. ``?page_size=`` up to 500."""

    ordering = "seq"
    page_size = 50
    page_size_query_param = "page_size"
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


class TranscriptSearchPagination(TranscriptPagination):
    """Search results within one session (``?q=``), newest first: a keyset cursor on ``-seq``."""

    ordering = "-seq"


class MessageSearchPagination(TranscriptPagination):
    """Search results across the caller's sessions, newest first: a keyset cursor on ``-id`` (message
    ids grow with insertion and are unique)."""

    ordering = "-id"
