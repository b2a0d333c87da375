"""Make text and JSON safe to store in PostgreSQL without losing the rest of the value.

PostgreSQL refuses NUL (``\\x00``) in ``text`` and ``\\u0000`` in ``jsonb``, and psycopg cannot
encode lone UTF-16 surrogates (``\\ud800``) as UTF-8. Either would make the whole write fail —
including the write that records the failure — so every string that came from a client or from
codex passes through here first. Offending code points become U+FFFD.
"""
from __future__ import annotations

import re
from typing import Any

REPLACEMENT = "\ufffd"
_UNSAFE = re.compile("[\x00\ud800-\udfff]")


def clean_text(value: object, *, max_chars: int | None = None) -> str:
    """Return ``value`` with NUL and lone surrogates replaced by U+FFFD; ``None`` becomes ``""``, any
    other non-string its ``str()``.
    With ``max_chars``, longer text is cut and ends with ``"…[truncated]"``."""
    if value is None:
        return ""
    if not isinstance(value, str):
        value = str(value)
    value = _UNSAFE.sub(REPLACEMENT, value)
    if max_chars is not None and len(value) > max_chars:
        marker = "…[truncated]"
        value = value[: max(0, max_chars - len(marker))] + marker
    return value


def clean_json(value: Any) -> Any:
    """Recursively clean every string (keys included) inside a JSON-shaped value."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_text(str(k)): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value
