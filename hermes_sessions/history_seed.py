"""Render a session's earlier transcript for a fresh codex thread (design §3.5).

Follows hermes-agent's ``render_history_seed`` (hermes-reference.md §2.7): user rows as
``[USER]``, assistant rows as ``[ASSISTANT]`` plus the tools they called, tool results cut to 400
characters, system rows skipped, and a tail cap (``settings.HERMES_HISTORY_SEED_MAX_CHARS``, default
32,000) that keeps the newest turns. The seed goes into the first ``turn/start`` input ahead of a
``[CURRENT USER TURN]`` marker; it writes no transcript rows.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.conf import settings

if TYPE_CHECKING:
    from .models import Message

HEADER = (
    "Prior conversation from this session (the thread you are continuing was started fresh; "
    "treat these turns as already having happened):"
)
OMITTED = "[… earlier turns omitted …]"
CURRENT_TURN_MARKER = "[CURRENT USER TURN]"
TOOL_RESULT_CHARS = 400


def _render_row(row: Message) -> str | None:
    if row.role == "user":
        return f"[USER]\n{row.content}"
    if row.role == "assistant":
        parts = []
        if row.content:
            parts.append(f"[ASSISTANT]\n{row.content}")
        names = [((c or {}).get("function") or {}).get("name", "tool") for c in (row.tool_calls or [])]
        if names:
            parts.append(f"[ASSISTANT called tools: {', '.join(names)}]")
        return "\n".join(parts) or None
    if row.role == "tool":
        text = row.content or ""
        cut = text[:TOOL_RESULT_CHARS] + (" …" if len(text) > TOOL_RESULT_CHARS else "")
        return f"[TOOL RESULT]\n{cut}"
    return None  # system rows are not replayed


def render_history_seed(rows: Iterable[Message], *, max_chars: int | None = None) -> str:
    """Return the seed text for ``rows`` (Message-like objects with ``role``, ``content``,
    ``tool_calls``, oldest first), or ``""`` when there is nothing to replay. The result is at most
    ``max_chars`` characters plus the header."""
    cap = settings.HERMES_HISTORY_SEED_MAX_CHARS if max_chars is None else max_chars
    blocks = [b for b in (_render_row(r) for r in rows) if b]
    if not blocks:
        return ""
    kept: list[str] = []
    used = 0
    for block in reversed(blocks):
        cost = len(block) + 2
        if used + cost > cap:
            if not kept:  # even the newest block is too long: keep its tail
                kept.append(block[-max(0, cap - len(OMITTED) - 2):])
            kept.append(OMITTED)
            break
        kept.append(block)
        used += cost
    return HEADER + "\n\n" + "\n\n".join(reversed(kept))


def seeded_input(seed: str, text: str) -> str:
    """The first input of a fresh thread: the seed, the marker, then the user's text."""
    if not seed:
        return text
    return f"{seed}\n\n{CURRENT_TURN_MARKER}\n{text}"
