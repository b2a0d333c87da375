"""The session page's two long tables (turns, transcript), rendered in Python.

Each is ≤ 50 rows, but through the template engine a row cost ≈ 1 ms (variable lookups, the ``date``
filter's translation lookups); ``format_html`` builds the same markup several times faster (profiled
under ``make bench-admin``). Every value is escaped by ``format_html``; the ids and classes are the
page's stable hooks (README "The admin").
"""
from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from django.template.defaultfilters import linebreaksbr
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from ..models import Message, Turn
from .timeline import duration_text, turn_duration


def when(at: datetime | None) -> str:
    """``YYYY-MM-DD HH:MM:SS`` in the current time zone (``""`` for ``None``)."""
    return timezone.localtime(at).strftime("%Y-%m-%d %H:%M:%S") if at else ""


def preview(text: str, limit: int = 2_000) -> str:
    """``text`` cut to ``limit`` characters with a note of how much was left out (the API has it all)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters; full text in the API]"


def turn_rows(turns: Iterable[Turn], *, cancel_url: str | None, csrf_token: str) -> SafeString:
    """``<tr id="turn-<seq>">`` rows of the session page's turns table; a *Cancel* form on queued and
    running turns when ``cancel_url`` is given (the user may cancel)."""
    rows = []
    for turn in turns:
        cancel = ""
        if cancel_url and not turn.is_terminal:
            cancel = format_html(
                '<form method="post" action="{}"><input type="hidden" name="csrfmiddlewaretoken" value="{}">'
                '<input type="hidden" name="turn" value="{}"><button type="submit" class="cancel-turn">Cancel</button></form>',
                cancel_url, csrf_token, turn.pk,
            )
        rows.append(format_html(
            '<tr id="turn-{}" data-turn="{}"><td>{}</td><td class="turn-status status-{}">{}</td><td>{}</td>'
            '<td class="turn-input">{}</td><td class="turn-error">{}</td><td class="turn-duration">{}</td>'
            '<td class="turn-tokens">{}</td><td>{}</td><td>{}</td></tr>',
            turn.seq, turn.pk, turn.seq, turn.status, turn.status, turn.thread_action or "—", preview(turn.input, 200),
            preview(turn.error, 300), duration_text(turn_duration(turn)), (turn.usage or {}).get("total_tokens", "—"),
            when(turn.created_at), cancel,
        ))
    return SafeString("".join(rows))


def transcript_rows(messages: Iterable[Message]) -> SafeString:
    """``<tr class="transcript-row role-<role>" data-seq="<seq>">`` rows, long texts cut by ``preview``."""
    return format_html_join(
        "",
        '<tr class="transcript-row role-{}" data-seq="{}"><td>{}</td><td>{}</td><td class="message-content">{}</td>'
        "<td>{}{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        (
            (m.role, m.seq, m.seq, m.role, linebreaksbr(preview(m.content), autoescape=True), m.tool_calls or "",
             f" → {m.tool_call_id}" if m.tool_call_id else "", preview(m.reasoning), m.turn_id or "", when(m.created_at))
            for m in messages
        ),
    )
