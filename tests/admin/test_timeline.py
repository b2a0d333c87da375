"""The session page's SVG timeline: turns by status and duration, threads with their rotations."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.admin.utils import quote
from django.urls import reverse
from django.utils import timezone

from hermes_sessions.admin.timeline import ROTATION_COLOUR, STATUS_COLOURS, timeline_svg
from hermes_sessions.models import CodexBinding, Turn
from hermes_sessions.services.bindings import binding_rotate
from tests.factories import CodexBindingFactory, SessionFactory, TurnFactory

pytestmark = pytest.mark.django_db


def test_a_rotation_is_drawn(admin_client):
    session = SessionFactory(id="timeline-rotated")
    t0 = timezone.now() - timedelta(minutes=10)
    old = CodexBindingFactory(session=session, thread_id="019a-old-thread-0001")
    first = TurnFactory(session=session, seq=1, status="succeeded", thread_action="started",
                        started_at=t0, finished_at=t0 + timedelta(seconds=2))
    rotated = TurnFactory(session=session, seq=2, status="succeeded", thread_action="rotated",
                          started_at=t0 + timedelta(minutes=5), finished_at=t0 + timedelta(minutes=5, seconds=3))
    from django.db import transaction

    with transaction.atomic():  # as the turn's finalize does
        binding_rotate(session=session, turn=rotated, thread_id=old.thread_id, reason="no rollout found for thread id x")
    CodexBindingFactory(session=session, thread_id="019a-new-thread-0002", created_by_turn=rotated)
    failed = TurnFactory(session=session, seq=3, status="failed", started_at=t0 + timedelta(minutes=6),
                         finished_at=t0 + timedelta(minutes=6, seconds=1))
    html = admin_client.get(reverse("admin:hermes_sessions_session_change", args=[quote(session.id)])).content.decode()
    start = html.index('<svg id="session-timeline"')
    svg = html[start:html.index("</svg>", start) + 6]
    for turn, status in ((first, "succeeded"), (rotated, "succeeded"), (failed, "failed")):
        assert re.search(rf'class="timeline-turn status-{status}" data-turn="{turn.id}"[^>]*fill="{STATUS_COLOURS[status]}"', svg)
    assert "turn 2: succeeded, 3.0 s, thread rotated" in svg
    assert svg.count('class="timeline-rotation"') == 2  # on the turn and where the old thread ended
    assert ROTATION_COLOUR in svg
    assert 'class="timeline-thread ended"' in svg and 'class="timeline-thread active"' in svg
    assert "…ead-0001" in svg and "…ead-0002" in svg


def test_turn_bars_scale_with_duration_and_escape_text():
    now = timezone.now()
    session = SessionFactory()
    short = Turn(session=session, seq=1, status="succeeded", created_at=now, started_at=now,
                 finished_at=now + timedelta(seconds=1))
    long = Turn(session=session, seq=2, status="running", created_at=now, started_at=now + timedelta(seconds=1))
    binding = CodexBinding(session=session, thread_id="<script>", created_at=now,
                           ended_reason="<b>", status="active")
    svg = str(timeline_svg(turns=[short, long], bindings=[binding], now=now + timedelta(seconds=10)))
    widths = [float(w) for w in re.findall(r'class="timeline-turn[^"]*"[^>]*width="([\d.]+)"', svg)]
    assert widths[1] > 5 * widths[0]  # the running turn reaches "now"
    assert "<script>" not in svg and "&lt;script&gt;" in svg


def test_empty_session_still_has_a_timeline():
    svg = str(timeline_svg(turns=[], bindings=[], now=timezone.now()))
    assert svg.startswith('<svg id="session-timeline"') and "timeline-turn" not in svg
