"""The one retry budget of a turn, declared once (compare Sentry's per-task ``Retry(times=…, on=…)``).

Every layer uses the same :class:`RetryPolicy` object, built from settings by :func:`retry_policy`:

* the codex runner (``codex/runner.py``) never retries: it raises ``ThreadBusy``, ``Overloaded`` or a
  ``TransportError`` and says whether ``turn/start`` had been sent;
* the execution service (``worker/execution.py``) runs the whole pre-``turn/start`` part again on a
  new app-server after each delay in :attr:`RetryPolicy.delays`, while :meth:`RetryPolicy.next_delay`
  allows it (delays left and the claim's :attr:`RetryPolicy.deadline` not passed); then it gives the
  turn back to the queue, at most :attr:`RetryPolicy.max_claims` claims in all, and the last claim fails
  the turn with the reason;
* the commit of a finished turn retries a lost database connection by the same ``next_delay``.

Worst case from a failing codex call to the turn's terminal state (:meth:`RetryPolicy.worst_case_seconds`;
the README's "Durability" section quotes it)::

    W = max_claims × (deadline + REQUESTS_PER_TRY × request_timeout + CLOSE_SECONDS) + Σ delays

    defaults: 3 × (60 s + 7 × 30 s + 2 s) + 15.5 s = 831.5 s  (≈ 14 min)

Each claim starts its last try before ``deadline``; one try sends at most ``REQUESTS_PER_TRY`` requests
before ``turn/start`` is accepted, each bounded by ``CODEX_REQUEST_TIMEOUT``, then closes the app-server
(``CLOSE_SECONDS``); the final commit may wait ``Σ delays`` for the database. Queue time between claims
(the next claim is dispatched at once) and a worker lost meanwhile (``HERMES_LEASE_SECONDS`` +
``HERMES_SWEEP_SECONDS``) come on top. A codex that refuses at once (busy writer, overload) ends far
sooner: ``max_claims × Σ delays`` = 46.5 s plus 18 app-server spawns (~0.1 s each) with the defaults.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings

#: Requests one try can send before ``turn/start`` is accepted: ``initialize``, ``thread/resume`` (the
#: binding), ``thread/resume`` (a lost worker's fresh thread, re-runs only), ``thread/start`` or
#: ``thread/turns/list``, ``turn/start`` refused, ``thread/resume`` after ``thread not found``, ``turn/start``.
REQUESTS_PER_TRY = 7
#: ``AppServerClient.close()``: waits up to 2 s for codex to exit after stdin closes, then SIGKILLs it.
CLOSE_SECONDS = 2.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often, how long and how many times one turn is tried.

    ``delays``: seconds to wait before try 2, 3, … of one claim (``HERMES_RETRY_DELAYS``, default
    ``0.5,1,2,4,8``), so a claim makes at most ``len(delays) + 1`` tries. ``deadline``: seconds from a
    claim's first try after which no further try starts (``HERMES_RETRY_DEADLINE``, default 60).
    ``max_claims``: claims of one turn before it fails (``HERMES_MAX_ATTEMPTS``, default 3).
    """

    delays: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
    deadline: float = 60.0
    max_claims: int = 3

    def next_delay(self, *, retries: int, elapsed: float) -> float | None:
        """Seconds to wait before retry number ``retries + 1``, or ``None`` when the budget is spent
        (no delay left, or the retry would start after ``deadline``). ``elapsed``: seconds since the
        first try of this claim (or of this commit)."""
        if retries >= len(self.delays):
            return None
        delay = self.delays[retries]
        if elapsed + delay > self.deadline:
            return None
        return delay

    def worst_case_seconds(self, *, request_timeout: float) -> float:
        """The bound in the module docstring, in seconds, for ``request_timeout`` (``CODEX_REQUEST_TIMEOUT``)."""
        per_claim = self.deadline + REQUESTS_PER_TRY * request_timeout + CLOSE_SECONDS
        return self.max_claims * per_claim + sum(self.delays)


def retry_policy() -> RetryPolicy:
    """The policy from settings, read at each call so a test's ``settings`` override applies."""
    return RetryPolicy(
        delays=tuple(settings.HERMES_RETRY_DELAYS),
        deadline=float(settings.HERMES_RETRY_DEADLINE),
        max_claims=int(settings.HERMES_MAX_ATTEMPTS),
    )
