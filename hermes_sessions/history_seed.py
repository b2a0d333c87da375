"""Render a session's earlier transcript for a fresh codex thread (``docs/contract.md`` §3).

Follows hermes-agent's ``render_history_seed`` (``agent/codex_runtime_history_seed.py``; see ``docs/contract.md`` §3): user rows as
``[USER]``, assistant rows as ``[ASSISTANT]`` plus the tools they called, tool results cut to 400
characters, system rows skipped, and a tail cap (``settings.HERMES_HISTORY_SEED_MAX_CHARS``, default
32,000) on the whole seed, header and omission marker included, that keeps the newest turns. The
seed goes into the first ``turn/start`` input ahead of a ``[CURRENT USER TURN]`` marker; it writes
no transcript rows.
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
# The fewest characters a rendered row adds to the seed: "[USER]\n" (7) plus the 2-character separator.
MIN_SEED_ROW_CHARS = 9


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


def render_history_seed(rows: Iterable[Message], *, max_chars: int | None = None, more_before: bool = False) -> str:
    """Return the seed text for ``rows`` (Message-like objects with ``role``, ``content``,
    ``tool_calls``, oldest first), or ``""`` when there is nothing to replay.

    The whole result — header, the ``OMITTED`` marker and the kept rows — is at most ``max_chars``
    characters (default ``settings.HERMES_HISTORY_SEED_MAX_CHARS``). When the rows do not fit, the newest
    whole rows that do are kept behind the marker; if even the newest row does not fit, its end is
    kept. A cap too small to hold the header and the marker gives ``""`` (no seed). ``more_before``:
    ``rows`` is only the tail of the transcript (older rows were not read), so the marker is always shown."""
    cap = settings.HERMES_HISTORY_SEED_MAX_CHARS if max_chars is None else max_chars
    blocks = [b for b in (_render_row(r) for r in rows) if b]
    if not blocks:
        return ""
    head = HEADER + "\n\n"
    whole = head + "\n\n".join(blocks)
    if len(whole) <= cap and not more_before:
        return whole
    head += OMITTED + "\n\n"
    budget = cap - len(head)  # for the kept blocks and the separators between them
    if budget <= 0:
        return ""
    kept: list[str] = []
    used = 0
    for block in reversed(blocks):
        cost = len(block) + (2 if kept else 0)
        if used + cost > budget:
            if not kept:  # even the newest block is too long: keep its end
                kept.append(block[-budget:])
            break
        kept.append(block)
        used += cost
    return head + "\n\n".join(reversed(kept))


def seeded_input(seed: str, text: str) -> str:
    """The first input of a fresh thread: the seed, the marker, then the user's text."""
    if not seed:
        return text
    return f"{seed}\n\n{CURRENT_TURN_MARKER}\n{text}"
