#!/usr/bin/env python
"""Shows that ``scripts/faults.py``'s checks can fail: runs its ``concurrent-posts`` scenario, then
damages the database the way the faults it hunts would (a doubled user row, a lost reply, two turns
of a session overlapping, a stray notice, a binding naming the wrong thread, a turn left running)
and expects the checks to report each one. Exits 0 when every planted defect was reported.

    DATABASE_URL=postgres://… CELERY_BROKER_URL=redis://… .venv/bin/python scripts/faults_selftest.py
"""
from __future__ import annotations

import importlib.util
import io
import sys
from contextlib import redirect_stdout
from datetime import timedelta
from pathlib import Path

spec = importlib.util.spec_from_file_location("faults", Path(__file__).with_name("faults.py"))
faults = importlib.util.module_from_spec(spec)
sys.modules["faults"] = faults
spec.loader.exec_module(faults)

EXPECTED = (
    "user rows",                       # doubled user row → duplicates
    "lacks its assistant reply",       # lost reply → messages lost
    "overlapped or ran out of order",  # I3
    "notices for 0 rotations",         # one notice per rotation
    "is not the thread of its latest succeeded turn",  # I1/I2 binding
    "not terminal",                    # stuck turn
)

_run = faults.scenario_concurrent_posts


def damaged(sc):
    _run(sc)
    sc.wait_terminal()
    from hermes_sessions.models import CodexBinding, Message, Notice, Session, Turn

    session = Session.objects.get(pk=sc.rec.sessions[0])
    t1, t2, t3 = Turn.objects.filter(session=session).order_by("seq")[:3]
    session.last_message_seq += 1
    session.save()
    Message.objects.create(session=session, seq=session.last_message_seq, turn=t1, role="user", content=t1.input)
    Message.objects.filter(turn=t2, role="assistant").delete()
    t3.started_at = t2.finished_at - timedelta(milliseconds=50)
    t3.save()
    Notice.objects.create(session=session, turn=t3, text="planted")
    CodexBinding.objects.filter(session=session, status="active").update(thread_id="planted-thread")
    last = Turn.objects.filter(session=session).order_by("-seq").first()
    last.status = "running"
    last.save()


faults.scenario_concurrent_posts = damaged
sys.argv = [sys.argv[0], "--scenarios", "concurrent-posts", "--bound", "20"]
out = io.StringIO()
with redirect_stdout(out):
    rc = faults.main()
text = out.getvalue()
print(text)
missed = [e for e in EXPECTED if e not in text]
if rc == 0 or missed:
    print(f"faults_selftest: FAILED (exit {rc}; not reported: {missed})")
    sys.exit(1)
print(f"faults_selftest: OK — all {len(EXPECTED)} planted defects reported")
