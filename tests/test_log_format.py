"""``HERMES_LOG_FORMAT`` (``project/log_format.py``, docs/operating.md §4): ``json`` makes every line of
the workers and the API one JSON object, the turn-end line with its fields as keys; ``text`` keeps the
lines as they were (``tests/services/test_turn_log.py`` pins the text line). Real processes: ``tests/e2e/test_json_logs.py``."""
from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys

import pytest
from django.conf import settings

from hermes_sessions import services
from hermes_sessions.models import Turn
from project.log_format import json_formatter, logging_config

TURN_KEYS = {"turn", "session", "thread_action", "status", "attempt", "task", "reason"}


# What Celery 5.7 prints outside logging (``safe_say`` to sys.__stdout__ in its SIGTERM handler).
NOT_LOG_LINES = {"worker: Warm shutdown (MainProcess)"}


def _json_lines(text: str) -> list[dict]:
    """Every non-empty line of ``text`` parsed as JSON (a line that is not fails the test)."""
    out = []
    for line in text.splitlines():
        if line.strip() and line.strip() not in NOT_LOG_LINES:
            try:
                out.append(json.loads(line))
            except ValueError:
                pytest.fail(f"not a JSON line: {line!r}\n{text[-3000:]}")
    return out


@pytest.mark.django_db(transaction=True)
def test_the_turn_end_line_as_json_carries_its_fields_as_keys(user, scripted_codex, run_turn_now):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(json_formatter())
    turns_logger = logging.getLogger("hermes_sessions.turns")
    turns_logger.addHandler(handler)
    try:
        session = services.session_create(owner=user, session_id="sess-json-log")
        turn = run_turn_now(session=session, text="hello", user=user)
    finally:
        turns_logger.removeHandler(handler)
    assert turn.status == Turn.Status.SUCCEEDED
    [line] = _json_lines(stream.getvalue())
    assert TURN_KEYS | {"timestamp", "level", "logger", "message"} <= set(line), line
    assert (line["turn"], line["session"], line["status"], line["thread_action"], line["attempt"], line["reason"]) == (
        str(turn.id), "sess-json-log", "succeeded", "started", 1, "")
    assert (line["level"], line["logger"]) == ("info", "hermes_sessions.turns")
    assert line["message"].startswith(f"turn {turn.id} ended status=succeeded session=sess-json-log ")
    assert line["timestamp"].endswith("Z") and isinstance(line["timings"], dict)


def test_the_setting_refuses_an_unknown_format():
    env = {**os.environ, "HERMES_LOG_FORMAT": "xml", "DJANGO_SETTINGS_MODULE": "project.settings_test"}
    result = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env, cwd=settings.BASE_DIR,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "HERMES_LOG_FORMAT must be one of text, json, not 'xml'" in result.stderr


def test_text_keeps_celery_and_gunicorn_formats_and_json_takes_the_root_logger():
    assert "root" not in logging_config("text", "INFO")
    config = logging_config("json", "DEBUG")
    assert config["root"]["handlers"] == ["console"] and config["handlers"]["console"]["formatter"] == "json"
    assert config["loggers"]["hermes_sessions"] == {"handlers": [], "level": "DEBUG"}  # each line once, at the root


def test_uvicorns_coloured_copy_of_its_message_is_left_out():
    record = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started server process [%d]", (42,), None)
    record.color_message = "Started server process [\x1b[36m%d\x1b[0m]"
    line = json.loads(json_formatter().format(record))
    assert line["message"] == "Started server process [42]" and "color_message" not in line
