"""Everything that runs in a worker process: executing a claimed turn, the retry policy, the leases and
the sweep, the wake listener, and ``warm/`` (threads kept loaded between turns, spare app-servers, the
early ``turn/start``). The domain writes it makes go through ``hermes_sessions.services``; codex is
spoken to through ``hermes_sessions.codex``. Callers (tasks, ``project/celery.py``, tests) import from here.
"""
from .execution import turn_execute
from .recovery import SweepReport, turns_sweep
from .retry_policy import RetryPolicy, retry_policy
from .wake import delivery_slot, wake_listening

__all__ = ["RetryPolicy", "SweepReport", "delivery_slot", "retry_policy", "turn_execute", "turns_sweep", "wake_listening"]
