"""The log format of every process (``HERMES_LOG_FORMAT``, docs/operating.md §4): ``text`` (lines for a
person, as they always were) or ``json`` — one JSON object per line, from the API's processes (Django,
gunicorn and uvicorn: ``gunicorn.conf.py``) and the workers (Celery: ``project/celery.py`` keeps Celery
from replacing the handlers), rendered by structlog's ``ProcessorFormatter`` from standard-library records:

    {"turn": "0192…", "session": "sess-1", "thread_action": "resumed", "status": "failed", "attempt": 1,
     "task": "5f0c…", "reason": "the model call failed …", "timings": {…}, "level": "info",
     "logger": "hermes_sessions.turns", "timestamp": "2026-12-05T10:00:00.123456Z", "message": "turn 0192… ended …"}

Keys: ``timestamp`` (ISO 8601, UTC), ``level`` (lower case), ``logger``, ``message`` (the text line's
message), ``exception`` (a traceback, when there is one), and every ``extra=`` field of the record
(the turn-end line's fields, ``hermes_sessions/services/turn_log.py``; Celery's ``data``).
"""
from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import structlog

LOG_FORMATS = ("text", "json")


def _drop_color_message(logger: Any, name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """uvicorn passes its message again with terminal colour codes as ``extra={"color_message": …}``:
    noise in JSON (tests/test_log_format.py)."""
    event.pop("color_message", None)
    return event


def json_formatter() -> logging.Formatter:
    """A formatter writing each record as one JSON object (module docstring). A process that makes one
    routes Python's warnings through logging too (``py.warnings``: e.g. Celery's warning about running
    as root would otherwise be raw lines on stderr)."""
    logging.captureWarnings(True)
    return structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.stdlib.ExtraAdder(),
            _drop_color_message,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"),
        ],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.EventRenamer("message"),
            structlog.processors.JSONRenderer(ensure_ascii=False),
        ],
    )


def logging_config(log_format: str, level: str) -> dict[str, Any]:
    """Django's ``LOGGING`` for ``log_format`` (``text`` | ``json``); ``level``: the ``hermes_sessions``
    loggers'. ``text``: a console handler for ``hermes_sessions`` and ``django.request`` only (Celery
    and gunicorn print the rest with their own formats). ``json``: that handler writes JSON and sits on
    the root logger, so every logger's records (Django's, Celery's, uvicorn's, ours) reach it once."""
    quiet_sweep = {name: {"filters": ["quiet_sweep"]} for name in ("celery.app.trace", "celery.worker.strategy", "celery.beat")}
    if log_format == "text":
        return {
            "version": 1,
            "disable_existing_loggers": False,
            "filters": {"quiet_sweep": {"()": "project.logfilters.QuietSweep"}},
            "handlers": {"console": {"class": "logging.StreamHandler"}},
            "loggers": {
                "hermes_sessions": {"handlers": ["console"], "level": level},
                # An unhandled error in a request (a 500) is logged with its traceback; Django's default sends it
                # only to mail_admins when DEBUG is off, i.e. nowhere here.
                "django.request": {"handlers": ["console"], "level": "ERROR", "propagate": False},
                **quiet_sweep,
            },
        }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"quiet_sweep": {"()": "project.logfilters.QuietSweep"}},
        "formatters": {"json": {"()": "project.log_format.json_formatter"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
        "root": {"handlers": ["console"], "level": "INFO"},
        "loggers": {
            "hermes_sessions": {"handlers": [], "level": level},
            "django": {"handlers": [], "level": "INFO"},  # not Django's own text handlers (DEBUG)
            "django.request": {"handlers": [], "level": "ERROR"},
            **quiet_sweep,
        },
    }


def gunicorn_logconfig_dict(log_format: str) -> dict[str, Any]:
    """gunicorn's ``logconfig_dict`` (``gunicorn.conf.py``): ``{}`` (gunicorn's own) for ``text``; for
    ``json``, gunicorn's loggers — and uvicorn's, which ``uvicorn_worker`` gives gunicorn's handlers —
    write JSON to stderr, as gunicorn does by default."""
    if log_format != "json":
        return {}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "project.log_format.json_formatter"}},
        "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["console"], "level": "INFO"},
        "loggers": {
            "gunicorn.error": {"handlers": ["console"], "level": "INFO", "propagate": False},
            "gunicorn.access": {"handlers": ["console"], "level": "INFO", "propagate": False},
        },
    }
