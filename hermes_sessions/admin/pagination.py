"""A changelist paginator that never counts a whole big table."""
from __future__ import annotations

from typing import Any

from django.core.paginator import Paginator
from django.db import connections
from django.utils.functional import cached_property


class EstimatedCountPaginator(Paginator):
    """Django's ``Paginator``, except that an **unfiltered** queryset on PostgreSQL is not counted with
    ``COUNT(*)`` (a sequential scan of the table) but estimated from the planner's statistics
    (``pg_class.reltuples``, kept by autovacuum/``ANALYZE``). A filtered queryset (a search, a list
    filter) is counted exactly: its ``WHERE`` narrows the scan. With no statistics yet (``reltuples``
    < 0, a table never analysed) or on another database, it counts.

    The estimate only sizes the page links; a page past the real end is simply empty."""

    @cached_property
    def count(self) -> int:
        queryset: Any = self.object_list
        query = getattr(queryset, "query", None)
        if query is None or query.where or connections[queryset.db].vendor != "postgresql":
            return super().count
        with connections[queryset.db].cursor() as cursor:
            cursor.execute("SELECT reltuples FROM pg_class WHERE oid = %s::regclass", [queryset.model._meta.db_table])
            row: Any = cursor.fetchone()
        if row is None or row[0] < 0:
            return super().count
        return int(row[0])
