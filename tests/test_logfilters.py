"""project/logfilters.py: Celery's routine lines about the sweep task are dropped, nothing else is."""
import logging

import pytest

from project.logfilters import SWEEP_TASK, QuietSweep

RUN_TURN = "hermes_sessions.tasks.run_turn"


def celery_record(logger: str, level: int, msg: str, args: object, data: dict | None = None) -> logging.LogRecord:
    """A record shaped as Celery 5.7 logs it (``app/trace.py`` ``info``, ``worker/strategy.py``, ``beat.py``)."""
    record = logging.getLogger(logger).makeRecord(logger, level, __file__, 1, msg, args, None,
                                                   extra={"data": data} if data is not None else None)
    return record


@pytest.mark.parametrize(("record", "kept"), [
    (celery_record("celery.app.trace", logging.INFO, "Task %(name)s[%(id)s] succeeded in %(runtime)ss: %(return_value)s",
                   ({"name": SWEEP_TASK, "id": "1", "runtime": 0.1, "return_value": "{}"},),
                   {"name": SWEEP_TASK, "id": "1"}), False),
    (celery_record("celery.worker.strategy", logging.INFO, "Task %(name)s[%(id)s] received",
                   ({"name": SWEEP_TASK, "id": "1"},), {"name": SWEEP_TASK, "id": "1"}), False),
    (celery_record("celery.beat", logging.INFO, "Scheduler: Sending due task %s (%s)", ("sweep-turns", SWEEP_TASK)), False),
    # the turn task's lines stay, and so does any warning or error about the sweep
    (celery_record("celery.app.trace", logging.INFO, "Task %(name)s[%(id)s] received",
                   ({"name": RUN_TURN, "id": "2"},), {"name": RUN_TURN, "id": "2"}), True),
    (celery_record("celery.app.trace", logging.ERROR, "Task %(name)s[%(id)s] raised: %(exc)s",
                   ({"name": SWEEP_TASK, "id": "1", "exc": "boom"},), {"name": SWEEP_TASK, "id": "1"}), True),
    (celery_record("celery.beat", logging.INFO, "beat: Starting...", ()), True),
])
def test_quiet_sweep_drops_only_routine_lines_about_the_sweep(record, kept):
    assert QuietSweep().filter(record) is kept


@pytest.mark.parametrize("name", ["celery.app.trace", "celery.worker.strategy", "celery.beat"])
def test_the_settings_install_it_on_celerys_loggers(name):
    assert any(isinstance(f, QuietSweep) for f in logging.getLogger(name).filters)
