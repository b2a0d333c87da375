"""Everything that runs in a worker process: executing a claimed turn on a runner thread (where a turn waiting for a person parks), the retry policy, the leases and
the sweep, the scheduler and the wake listener, and ``warm/`` (threads kept loaded between turns, spare
app-servers, the early ``turn/start``). The domain writes it makes go through ``hermes_sessions.services``;
codex is spoken to through ``hermes_sessions.codex``. Callers (tasks, ``project/celery.py``, tests) import
from here; ``process.py`` is the runtime's one entry point (``process_start``, ``process_stop``).
"""
from .execution import turn_execute, turn_run
from .process import start as process_start
from .process import stop as process_stop
from .process import thread_names
from .recovery import SweepReport, turns_sweep
from .retry_policy import RetryPolicy, retry_policy
from .time_limits import turn_time_limits
from .wake import delivery_slot, wake_listening
from .webhooks import webhooks_deliver, webhooks_dispatch_due

__all__ = ["RetryPolicy", "SweepReport", "delivery_slot", "process_start", "process_stop", "retry_policy",
           "thread_names", "turn_execute", "turn_run", "turn_time_limits", "turns_sweep", "wake_listening",
           "webhooks_deliver", "webhooks_dispatch_due"]
