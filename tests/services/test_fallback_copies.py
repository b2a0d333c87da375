"""services/fallback_copies.py: a woken turn's fallback copy is sent by the process when due, not at the
commit (its ~3 ms of CPU competed there with the woken worker's claim)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable

from hermes_sessions.services.fallback_copies import FallbackSender


def _collecting() -> tuple[FallbackSender, list[tuple[uuid.UUID, float]], threading.Event, Callable[[uuid.UUID], None]]:
    sent: list[tuple[uuid.UUID, float]] = []
    arrived = threading.Event()

    def send(turn_id: uuid.UUID) -> None:
        sent.append((turn_id, time.monotonic()))
        arrived.set()

    return FallbackSender(), sent, arrived, send


def test_a_copy_is_sent_once_when_due_and_not_before():
    sender, sent, arrived, send = _collecting()
    turn = uuid.uuid4()
    t0 = time.monotonic()
    sender.send_later(turn, delay=0.3, send=send)
    assert sender.pending() == [turn] and sent == []
    assert arrived.wait(5)
    [(got, at)] = sent
    assert got == turn and at - t0 >= 0.3
    time.sleep(0.2)
    assert len(sent) == 1 and sender.pending() == []


def test_copies_go_in_due_order_whatever_order_they_came_in():
    sender, sent, _, send = _collecting()
    late, early = uuid.uuid4(), uuid.uuid4()
    sender.send_later(late, delay=0.4, send=send)
    sender.send_later(early, delay=0.1, send=send)
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [t for t, _ in sent] == [early, late]


def test_a_send_that_raises_is_logged_and_the_next_copies_still_go(caplog):
    sent: list[uuid.UUID] = []
    bad, good = uuid.uuid4(), uuid.uuid4()

    def send(turn_id: uuid.UUID) -> None:
        if turn_id == bad:
            raise ConnectionError("broker down")
        sent.append(turn_id)

    sender = FallbackSender()
    sender.send_later(bad, delay=0.0, send=send)
    sender.send_later(good, delay=0.05, send=send)
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sent == [good]
    assert f"turn {bad}: its fallback copy could not be sent" in caplog.text


def test_flush_sends_what_is_held_now_and_drop_forgets_it():
    sender, sent, _, send = _collecting()
    a, b = uuid.uuid4(), uuid.uuid4()
    sender.send_later(a, delay=60, send=send)
    assert sender.flush() == 1 and [t for t, _ in sent] == [a]
    sender.send_later(b, delay=60, send=send)
    assert sender.drop() == 1 and sender.pending() == [] and len(sent) == 1


def test_a_process_that_exits_normally_sends_what_it_still_holds(tmp_path):
    """gunicorn's graceful stop of an API process: ``atexit`` sends the held copies at once, due or not."""
    out = tmp_path / "sent"
    code = (
        "import uuid\n"
        "import django\n"
        "django.setup()\n"
        "from hermes_sessions.services import fallback_copies\n"
        "fallback_copies.fallback_copy_later(uuid.UUID(int=7), delay=600,\n"
        f"    send=lambda t: open({str(out)!r}, 'a').write(str(t) + '\\n'))\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.read_text().split() == [str(uuid.UUID(int=7))]


def test_sigterm_to_an_api_process_sends_what_it_holds_and_still_ends_it(tmp_path):
    """Found by an adversary: gunicorn's graceful stop of a uvicorn worker ends with SIGTERM's default action
    (uvicorn hands the captured signal back once it has shut down), which skips ``atexit``: the held
    copies were lost. ``project/asgi.py`` installs ``flush_on_sigterm``; the process still ends by SIGTERM."""
    import signal

    out = tmp_path / "sent"
    code = (
        "import signal, uuid\n"
        "import project.asgi\n"
        "from hermes_sessions.services import fallback_copies\n"
        "fallback_copies.fallback_copy_later(uuid.UUID(int=9), delay=600,\n"
        f"    send=lambda t: open({str(out)!r}, 'a').write(str(t) + '\\n'))\n"
        "signal.raise_signal(signal.SIGTERM)  # as uvicorn does after its shutdown\n"
        "import time; time.sleep(5)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "project.settings"}
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == -signal.SIGTERM
    assert out.read_text().split() == [str(uuid.UUID(int=9))]
