"""The session page's picture: a server-rendered SVG timeline of its turns and its codex threads.

Two lanes on one time axis. **Turns**: one bar per turn from ``started_at`` (or ``created_at`` while
queued) to ``finished_at`` (or now while running), coloured by status, with the duration and thread
action in its tooltip; a rotated turn carries a red triangle. **Threads**: one bar per binding from
``created_at`` to ``ended_at`` (or now), labelled with the thread id's tail; a binding that ended
because codex could not resume it (``services.bindings.binding_rotate``) ends in a red rotation mark,
so a rotation is seen rather than read. Pure function of the rows given (no queries).
"""
from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from django.utils.html import format_html
from django.utils.safestring import SafeString

from ..models import CodexBinding, Turn

WIDTH, LEFT, RIGHT = 900, 70, 10
TURN_Y, THREAD_Y, BAR_H, HEIGHT = 18, 58, 22, 100
STATUS_COLOURS: dict[str, str] = {
    Turn.Status.QUEUED: "#9e9e9e",
    Turn.Status.RUNNING: "#1e88e5",
    Turn.Status.SUCCEEDED: "#43a047",
    Turn.Status.FAILED: "#e53935",
    Turn.Status.CANCELLED: "#fb8c00",
}
THREAD_COLOURS = ("#5e35b1", "#00897b")
ROTATION_COLOUR = "#d50000"
#: ``ended_reason`` prefix written by ``binding_rotate`` (codex proved the thread gone).
ROTATION_REASON = "codex could not resume the thread"


def _turn_span(turn: Turn, now: datetime) -> tuple[datetime, datetime]:
    start = turn.started_at or turn.created_at
    return start, turn.finished_at or (now if turn.status == Turn.Status.RUNNING else start)


def _binding_span(binding: CodexBinding, now: datetime) -> tuple[datetime, datetime]:
    return binding.created_at, binding.ended_at or now


def duration_text(seconds: float | None) -> str:
    """``1.2 s`` / ``350 ms`` / ``2 min 5 s``; ``—`` for ``None``."""
    if seconds is None:
        return "—"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{int(seconds // 60)} min {int(seconds % 60)} s"


def turn_duration(turn: Turn) -> float | None:
    """Seconds from ``started_at`` to ``finished_at`` (``None`` until both are set)."""
    if turn.started_at and turn.finished_at:
        return (turn.finished_at - turn.started_at).total_seconds()
    return None


class _Scale:
    def __init__(self, start: datetime, end: datetime):
        self.start = start
        self.span = max((end - start).total_seconds(), 0.001)

    def x(self, at: datetime) -> float:
        frac = min(max((at - self.start).total_seconds() / self.span, 0.0), 1.0)
        return round(LEFT + frac * (WIDTH - LEFT - RIGHT), 1)


def _turn_bars(turns: Sequence[Turn], scale: _Scale, now: datetime) -> SafeString:
    bars = []
    for turn in turns:
        start, end = _turn_span(turn, now)
        x0, x1 = scale.x(start), scale.x(end)
        title = f"turn {turn.seq}: {turn.status}, {duration_text(turn_duration(turn))}"
        if turn.thread_action:
            title += f", thread {turn.thread_action}"
        bars.append(format_html(
            '<rect class="timeline-turn status-{}" data-turn="{}" x="{}" y="{}" width="{}" height="{}" fill="{}">'
            "<title>{}</title></rect>",
            turn.status, turn.pk, x0, TURN_Y, max(x1 - x0, 3), BAR_H, STATUS_COLOURS.get(turn.status, "#000"), title,
        ))
        if turn.thread_action == Turn.ThreadAction.ROTATED:
            bars.append(format_html(
                '<path class="timeline-rotation" d="M{} {} l5 -9 l-10 0 z" fill="{}"><title>turn {}: thread rotated'
                "</title></path>", x0, TURN_Y - 1, ROTATION_COLOUR, turn.seq,
            ))
    return SafeString("".join(bars))


def _thread_bars(bindings: Sequence[CodexBinding], scale: _Scale, now: datetime) -> SafeString:
    bars = []
    for index, binding in enumerate(bindings):
        start, end = _binding_span(binding, now)
        x0, x1 = scale.x(start), scale.x(end)
        rotated = binding.ended_reason.startswith(ROTATION_REASON)
        title = f"thread {binding.thread_id}: {binding.status}"
        if binding.ended_reason:
            title += f" ({binding.ended_reason[:200]})"
        bars.append(format_html(
            '<rect class="timeline-thread {}" x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>'
            '<text x="{}" y="{}" font-size="10" fill="#fff">…{}</text>',
            binding.status, x0, THREAD_Y, max(x1 - x0, 3), BAR_H, THREAD_COLOURS[index % 2], title,
            x0 + 3, THREAD_Y + 15, binding.thread_id[-8:],
        ))
        if rotated:
            bars.append(format_html(
                '<line class="timeline-rotation" x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}" stroke-width="3">'
                "<title>rotated: {}</title></line>",
                x1, TURN_Y - 4, x1, THREAD_Y + BAR_H + 4, ROTATION_COLOUR, binding.ended_reason[:200],
            ))
    return SafeString("".join(bars))


def timeline_svg(*, turns: Sequence[Turn], bindings: Sequence[CodexBinding], now: datetime) -> SafeString:
    """The SVG (``<svg id="session-timeline">``) for ``turns`` and ``bindings``; an empty axis when
    there are neither. Times are laid out linearly from the earliest start to the latest end."""
    spans = [_turn_span(t, now) for t in turns] + [_binding_span(b, now) for b in bindings]
    if spans:
        scale = _Scale(min(s for s, _ in spans), max(e for _, e in spans))
        first, last = scale.start, max(e for _, e in spans)
    else:
        scale, first, last = _Scale(now, now), now, now
    labels = format_html(
        '<text x="4" y="{}" font-size="11">turns</text><text x="4" y="{}" font-size="11">threads</text>'
        '<text x="{}" y="{}" font-size="10">{}</text><text x="{}" y="{}" font-size="10" text-anchor="end">{}</text>',
        TURN_Y + 15, THREAD_Y + 15, LEFT, HEIGHT - 4, first.strftime("%Y-%m-%d %H:%M:%S"),
        WIDTH - RIGHT, HEIGHT - 4, last.strftime("%Y-%m-%d %H:%M:%S"),
    )
    return format_html(
        '<svg id="session-timeline" xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" viewBox="0 0 {} {}" '
        'role="img" aria-label="timeline of turns and codex threads">{}{}{}</svg>',
        WIDTH, HEIGHT, WIDTH, HEIGHT, labels, _turn_bars(turns, scale, now), _thread_bars(bindings, scale, now),
    )
