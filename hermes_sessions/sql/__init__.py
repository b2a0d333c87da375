"""The service's hand-written SQL, in one place: ``queries.sql`` beside this file, one statement per
``-- name: <name>`` header, read once per process. Code that runs SQL by hand names its statement
(``query("claim")``) and passes parameters; no statement is assembled from the models' metadata. Tables
and columns are spelled as the migrations made them; ``tests/test_sql_statements.py`` prepares every
statement against the migrated test database, so a rename that misses this file fails there.

``rows`` (beside this module): the models' values as statements take them and rows back into instances.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

QUERIES_FILE = Path(__file__).with_name("queries.sql")

_NAME = re.compile(r"^-- name: ([a-z_]+)$")


def parse(text: str) -> dict[str, str]:
    """``{name: statement}`` of a ``queries.sql`` text: a statement's lines joined by single spaces (their
    indentation dropped), without its comment lines and its final ``;``. Raises ``ValueError`` for a name
    given twice or a statement without text."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        header = _NAME.match(line)
        if header:
            if header.group(1) in found:
                raise ValueError(f"{QUERIES_FILE.name}: statement {header.group(1)!r} is named twice")
            current = found[header.group(1)] = []
        elif current is not None and line.strip() and not line.startswith("--"):
            current.append(line.strip())
    statements = {name: " ".join(lines).removesuffix(";") for name, lines in found.items()}
    empty = [name for name, statement in statements.items() if not statement]
    if empty:
        raise ValueError(f"{QUERIES_FILE.name}: no text for {', '.join(empty)}")
    return statements


@functools.cache
def queries() -> dict[str, str]:
    """Every statement of ``queries.sql`` by name (read once per process)."""
    return parse(QUERIES_FILE.read_text(encoding="utf-8"))


def query(name: str) -> str:
    """The text of statement ``name`` (``KeyError`` for a name ``queries.sql`` does not have)."""
    return queries()[name]


def value_rows(columns: int, rows: int) -> str:
    """``(%s, …), (%s, …)``: ``rows`` tuples of ``columns`` placeholders, for a statement's ``{rows}``."""
    row = "(" + ", ".join(["%s"] * columns) + ")"
    return ", ".join([row] * rows)
