"""The durable state: sessions, their transcript, codex thread bindings, turns and notices.

Every write goes through ``hermes_sessions.services``; the constraints below are the last line of
defence for the invariants in ``docs/contract.md`` §6 (I1 durable-before-bound, I2 exactly once,
I3 one turn at a time).
"""
from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.contrib.postgres.search import SearchVectorField
from django.core.validators import RegexValidator
from django.db import models
from django.db.models import Q

SESSION_ID_RE = r"\A[A-Za-z0-9][A-Za-z0-9._:-]{0,63}\Z"
session_id_validator = RegexValidator(
    SESSION_ID_RE,
    "A session id is 1-64 characters: letters, digits, '.', '_', ':' or '-', starting with a letter or digit.",
)


def new_session_id() -> str:
    return f"sess-{uuid.uuid4().hex}"


class Session(models.Model):
    """One conversation, owned by a user.

    ``model_config`` holds the codex settings of the session: ``model``, ``cwd``,
    ``approval_policy``, ``sandbox``, ``developer_instructions`` (all optional; see
    ``hermes_sessions.policy``). ``last_message_seq`` / ``last_turn_seq`` are the per-session
    counters, advanced only under the session's row lock.
    """

    id = models.CharField(primary_key=True, max_length=64, default=new_session_id, validators=[session_id_validator])
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="hermes_sessions")
    title = models.CharField(max_length=200, blank=True)
    model_config = models.JSONField(default=dict, blank=True)
    last_message_seq = models.PositiveIntegerField(default=0)
    last_turn_seq = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-updated_at"]
        indexes = [
            models.Index(fields=["owner", "-updated_at"]),
            # The admin's sessions list: newest first, ties by id (the changelist adds "-pk").
            models.Index(fields=["-updated_at", "-id"], name="session_updated_id"),
        ]

    def __str__(self) -> str:
        return self.title or self.id


class Turn(models.Model):
    """One user input run through codex.

    Lifecycle: ``queued`` → ``running`` → ``succeeded`` | ``failed`` | ``cancelled``. ``seq`` orders
    the turns of a session in the order they were accepted; they run in that order, one at a time.
    ``thread_action`` records what the runner did before ``turn/start``: ``started`` (no binding),
    ``resumed`` (``thread/resume`` of the bound thread) or ``rotated`` (the bound thread was gone,
    a new one was started). ``usage`` holds codex's last ``thread/tokenUsage/updated`` figures
    (``input_tokens``, ``cached_input_tokens``, ``output_tokens``, ``reasoning_output_tokens``,
    ``total_tokens``). ``timings`` holds phase durations in milliseconds.
    """

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        CANCELLED = "cancelled"

    class ThreadAction(models.TextChoices):
        STARTED = "started"
        RESUMED = "resumed"
        ROTATED = "rotated"

    TERMINAL = (Status.SUCCEEDED, Status.FAILED, Status.CANCELLED)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="turns")
    seq = models.PositiveIntegerField()
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    input = models.TextField()
    thread_action = models.CharField(max_length=16, choices=ThreadAction.choices, blank=True)
    codex_thread_id = models.CharField(max_length=64, blank=True)
    codex_turn_id = models.CharField(max_length=64, blank=True)
    codex_methods = models.JSONField(default=list, blank=True, help_text="JSON-RPC methods sent before turn/start")
    final_text = models.TextField(blank=True)
    error = models.TextField(blank=True)
    usage = models.JSONField(default=dict, blank=True)
    timings = models.JSONField(default=dict, blank=True)
    attempt = models.PositiveIntegerField(default=0)
    claim_token = models.UUIDField(null=True, blank=True)
    # The claiming worker renews this while it runs the turn; past it, the sweep takes the turn back.
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)  # last time run_turn was sent for it
    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["session", "seq"]
        constraints = [models.UniqueConstraint(fields=["session", "seq"], name="turn_unique_session_seq")]
        indexes = [
            models.Index(fields=["session", "status", "seq"]),
            models.Index(fields=["status", "lease_expires_at"]),
        ]

    def __str__(self) -> str:
        return f"{self.session_id}#{self.seq} ({self.status})"

    @property
    def is_terminal(self) -> bool:
        return self.status in self.TERMINAL


#: PostgreSQL text search configuration of message search (``selectors.message_search``). ``simple``
#: lower-cases and splits on non-word characters without stemming or stop words: transcripts mix
#: languages, code, paths and identifiers, which a language's stemmer would mangle (``english`` turns
#: ``running`` into ``run`` and drops ``not``, ``this``…), and an operator searching a transcript looks
#: for the words that were written. Must match the expression of the ``message_content_search`` index.
MESSAGE_SEARCH_CONFIG = "simple"


class MessageSearchVector(models.Func):
    """``hermes_message_search_vector(content)``: ``to_tsvector('simple', coalesce(content, ''))`` in a
    PL/pgSQL function made by migration 0004, declared ``COST 1000``.

    Why a function: the planner costs the built-in ``to_tsvector`` at 100 × ``cpu_operator_cost`` per
    row, far below what parsing a chat message costs (measured with ``make bench-admin``: 20-40 µs a
    row). Believing that, it ordered a search newest first by walking the primary key backwards and
    parsing every row until 51 matched — 4.7 s for a word in 0.3 % of 1.1 million rows — instead of
    asking the GIN index (22 ms). With the true cost it picks the index for selective words and the
    backward walk only for words so common that 51 matches are near (1 ms). PL/pgSQL because a SQL
    function would be inlined and lose its cost."""

    function = "hermes_message_search_vector"
    output_field = SearchVectorField()


class Message(models.Model):
    """One row of the durable transcript, ordered by ``seq`` within its session.

    ``tool_calls`` is a list of OpenAI-style calls ``[{"id", "type": "function", "function":
    {"name", "arguments"}}]`` on assistant rows; ``tool_call_id`` links a ``tool`` row to its call.
    ``codex_item_id`` is the codex item the row was projected from (empty for user rows).
    """

    class Role(models.TextChoices):
        USER = "user"
        ASSISTANT = "assistant"
        TOOL = "tool"
        SYSTEM = "system"

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="messages")
    seq = models.PositiveIntegerField()
    turn = models.ForeignKey(Turn, on_delete=models.SET_NULL, null=True, blank=True, related_name="messages")
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField(blank=True)
    tool_calls = models.JSONField(null=True, blank=True)
    tool_call_id = models.CharField(max_length=255, blank=True)
    reasoning = models.TextField(blank=True)
    codex_item_id = models.CharField(max_length=255, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["session", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["session", "seq"], name="message_unique_session_seq"),
            # A codex item is projected once per turn (a tool item gives one assistant + one tool row).
            models.UniqueConstraint(
                fields=["turn", "codex_item_id", "role"],
                condition=~Q(codex_item_id=""),
                name="message_unique_turn_item_role",
            ),
        ]
        indexes = [
            # Full-text search over the content (migration 0004). Queries must use this exact
            # expression to use it (selectors.message_search_filter).
            GinIndex(MessageSearchVector("content"), name="message_content_search"),
        ]

    def __str__(self) -> str:
        return f"{self.session_id}:{self.seq} {self.role}"


class CodexBinding(models.Model):
    """Session → codex thread. At most one ``active`` binding per session (database constraint);
    ended bindings stay as history with ``ended_reason`` and ``ended_at``."""

    class Status(models.TextChoices):
        ACTIVE = "active"
        ENDED = "ended"

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="bindings")
    thread_id = models.CharField(max_length=64)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by_turn = models.ForeignKey(Turn, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    ended_at = models.DateTimeField(null=True, blank=True)
    ended_reason = models.TextField(blank=True)
    ended_by_turn = models.ForeignKey(Turn, on_delete=models.SET_NULL, null=True, blank=True, related_name="+")

    class Meta:
        ordering = ["session", "created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["session"], condition=Q(status="active"), name="binding_one_active_per_session"
            )
        ]

    def __str__(self) -> str:
        return f"{self.session_id} → {self.thread_id} ({self.status})"


class CodexRollout(models.Model):
    """A codex thread's rollout, kept in PostgreSQL (``docs/contract.md`` I8): the file
    ``CODEX_HOME/<relpath>`` is the concatenation of its ``RolloutChunk`` rows in ``seq`` order.

    ``length`` (bytes) and ``sha256`` (hex) describe those bytes; ``generation`` is the fencing
    token, +1 per committed turn (a finalize that read another generation commits nothing);
    ``codex_version`` is the codex that last wrote it. No chunk bytes live on this row, so listing
    rollouts never loads them."""

    thread_id = models.CharField(max_length=64, unique=True)
    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="rollouts")
    relpath = models.CharField(max_length=500)
    length = models.BigIntegerField(default=0)
    sha256 = models.CharField(max_length=64)
    generation = models.BigIntegerField(default=0)
    codex_version = models.CharField(max_length=64, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["session", "updated_at"]

    def __str__(self) -> str:
        return f"{self.thread_id} ({self.length} B, generation {self.generation})"


class RolloutChunk(models.Model):
    """The bytes one turn appended to a rollout, insert-only (never updated or deleted one by one:
    retention deletes whole rollouts, so TOAST never bloats — ``../shared/pitfalls.md``).
    ``offset`` is where they start in the file; ``data`` is stored as ``compression`` says
    (``zlib`` or ``""`` for none); ``sha256`` (hex) is of the uncompressed bytes, ``size`` their length."""

    rollout = models.ForeignKey(CodexRollout, on_delete=models.CASCADE, related_name="chunks")
    seq = models.PositiveIntegerField()
    offset = models.BigIntegerField()
    size = models.BigIntegerField()
    compression = models.CharField(max_length=8, blank=True)
    data = models.BinaryField()
    sha256 = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["rollout", "seq"]
        constraints = [models.UniqueConstraint(fields=["rollout", "seq"], name="rollout_chunk_unique_seq")]
        # A restore onto a host that holds a prefix reads only the chunks from its end (queries.sql:
        # rollout_chunks_from).
        indexes = [models.Index(fields=["rollout", "offset"], name="rollout_chunk_offset")]

    def __str__(self) -> str:
        return f"{self.rollout_id}#{self.seq} @{self.offset} ({self.size} B)"


class Notice(models.Model):
    """An operator-visible lifecycle message about a session (the hermes "status rail").

    At most one notice of a kind per turn (a turn rotates at most once).
    """

    class Kind(models.TextChoices):
        LIFECYCLE = "lifecycle"
        WEBHOOK = "webhook"  # a webhook endpoint was disabled (services/webhooks.py)

    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="notices")
    turn = models.ForeignKey(Turn, on_delete=models.SET_NULL, null=True, blank=True, related_name="notices")
    kind = models.CharField(max_length=32, choices=Kind.choices, default=Kind.LIFECYCLE)
    text = models.TextField()
    created_at = models.DateTimeField(auto_now_add=True)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # The unacknowledged ones are few: the admin index's count, the sessions list's column and filter.
            models.Index(fields=["session"], condition=Q(acknowledged_at__isnull=True), name="notice_unacked_session"),
        ]
        constraints = [
            models.UniqueConstraint(
                fields=["turn", "kind"], condition=Q(turn__isnull=False), name="notice_one_per_turn_kind"
            )
        ]

    def __str__(self) -> str:
        return f"{self.session_id}: {self.text}"

    @property
    def acknowledged(self) -> bool:
        return self.acknowledged_at is not None


class IdempotencyKey(models.Model):
    """A client's ``Idempotency-Key`` for one POST endpoint, scoped per user.

    The same key with the same body returns the object the first request created; the same key
    with a different body is refused (422). Rows older than ``settings.HERMES_IDEMPOTENCY_TTL``
    seconds are deleted by the sweep.
    """

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    scope = models.CharField(max_length=200, help_text="endpoint, e.g. 'sessions' or 'turns:<session id>'")
    key = models.CharField(max_length=255)
    request_hash = models.CharField(max_length=64)
    object_id = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["user", "scope", "key"], name="idempotency_unique_user_scope_key")]

    def __str__(self) -> str:
        return f"{self.scope}:{self.key}"


class TurnEvent(models.Model):
    """One durable event of a turn's live stream (``docs/contract.md`` §8), insert-only.

    ``id`` (bigint, assigned at insert) is the server-sent event's ``id:``; within a session, ids are
    in commit order (every insert first locks the session row, ``services/events.py``), so
    a client resuming after id N misses nothing. ``kind`` is the SSE ``event:`` name, ``data`` its JSON
    payload (without ``turn``/``attempt``, which live in their own columns). ``attempt`` is the turn's
    claim the event belongs to (0 before the first claim)."""

    id = models.BigAutoField(primary_key=True)
    # No single-column indexes: the two composite ones below lead with these columns.
    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="events", db_index=False)
    turn = models.ForeignKey(Turn, on_delete=models.CASCADE, related_name="events", db_index=False)
    attempt = models.PositiveIntegerField(default=0)
    kind = models.CharField(max_length=32)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["id"]
        indexes = [
            models.Index(fields=["turn", "id"], name="turnevent_turn_id"),
            models.Index(fields=["session", "id"], name="turnevent_session_id"),
        ]

    def __str__(self) -> str:
        return f"{self.turn_id}#{self.id} {self.kind}"


class TurnWorker(models.Model):
    """A worker process that keeps codex threads loaded between turns (session affinity,
    ``worker/affinity.py``): its route (``queue``: ``<HERMES_TURN_QUEUE>.<node name>``, the primary key,
    which names its wake channel; no broker queue has that name), where it runs (``node``, ``host``,
    ``pid``) and its last ``heartbeat_at`` (renewed every ``HERMES_WORKER_HEARTBEAT_SECONDS`` by the
    process itself). Turns are routed to it only while the heartbeat is younger than
    ``HERMES_WORKER_STALE_SECONDS``; the sweep deletes the row of a worker whose heartbeat is older."""

    queue = models.CharField(primary_key=True, max_length=255)
    node = models.CharField(max_length=255)
    host = models.CharField(max_length=255, blank=True)
    pid = models.PositiveIntegerField(default=0)
    started_at = models.DateTimeField(auto_now_add=True)
    heartbeat_at = models.DateTimeField()
    kept = models.PositiveIntegerField(default=0)  # threads it holds loaded at its last heartbeat
    # Its wake listener was listening at its last heartbeat (``worker/wake.py``): a turn routed to it
    # is announced by NOTIFY, with no Celery message.
    wakeable = models.BooleanField(default=False)

    def __str__(self) -> str:
        return self.queue


class WorkerHealth(models.Model):
    """A Celery worker as the readiness checks see it (``hermes_sessions/health.py``), one row per node
    name (``hermes-1@host``), written by every worker whatever its concurrency (``TurnWorker`` rows exist
    only for workers that keep threads): ``heartbeat_at``, renewed every ``HERMES_WORKER_HEARTBEAT_SECONDS``
    by each of its pool processes (``worker/health_beat.py``; fresh while younger than
    ``HERMES_WORKER_STALE_SECONDS``, as for routing), and the result of codex's sandbox check on its host
    (``codex/sandbox_check.py``): ``sandbox_ok`` (``None``: not checked yet), ``sandbox_reason`` and
    ``sandbox_checked_at``. A worker's clean stop deletes its row; a dead worker's goes stale and is
    deleted a day later. Written only by ``services/worker_health.py``."""

    node = models.CharField(primary_key=True, max_length=255)
    host = models.CharField(max_length=255, blank=True)
    heartbeat_at = models.DateTimeField()
    sandbox_ok = models.BooleanField(null=True)
    sandbox_reason = models.TextField(blank=True)
    sandbox_checked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return self.node


class WarmThread(models.Model):
    """Where a session's codex thread is kept loaded after its last turn: the worker route that holds
    it, the thread and the rollout ``generation`` it holds (what its finalize stored), and ``until``
    (end of the idle window). Written in the turn's finalize transaction under the session lock,
    deleted by every other end of a turn and when the worker lets the thread go. Only a hint for
    routing: a worker checks the generation against ``CodexRollout`` before it uses a loaded thread."""

    session = models.OneToOneField(Session, on_delete=models.CASCADE, primary_key=True, related_name="warm_thread")
    queue = models.CharField(max_length=255, db_index=True)
    thread_id = models.CharField(max_length=64)
    generation = models.PositiveIntegerField()
    until = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.session_id} @ {self.queue}"


class Approval(models.Model):
    """One request codex sent for a person's decision during a turn (``docs/contract.md`` §9): a command
    to run, a file change, extra permissions, answers to questions, an MCP server's form. Written only by
    ``services/approvals.py``; an audit trail: kept when its turn is deleted (``turn`` becomes null, the
    ``turn_ref`` stays) and deleted only with its session.

    ``request`` is what codex asked, in our words (``codex.server_requests.ApprovalRequest.as_dict``):
    ``{"method", "command", "cwd", "reason", "paths", "diff", "permissions", "questions", "server",
    "message", "schema", "item_id"}`` — the keys its kind has. ``available_decisions`` lists the
    decision names a person may choose (``accept``, ``acceptForSession``, ``decline``, ``cancel``, …);
    ``offered`` keeps codex's own ``availableDecisions`` verbatim (amendment objects included), to answer
    with. ``fingerprint`` (sha256 hex of kind + command + cwd, or of the paths and diff, …) names "the same
    request": an ``acceptForSession`` decision answers later requests with the same fingerprint in the
    session, and a re-run after a lost worker can match the request it asks again. ``attempt`` is the
    turn's claim that asked; ``codex_request_id`` the JSON-RPC id codex sent it under. ``decision`` is
    the decision given (a name from ``available_decisions``; ``decline`` for an expired or cancelled
    one), ``response`` the extra answer (``{"answers": …}`` for questions, ``{"content": …}`` for a form),
    ``decided_by`` / ``decided_at`` who and when (no user: the worker — expiry, a session grant).
    ``expires_at``: a pending one is answered ``decline`` and ``expired`` then (HERMES_APPROVAL_TIMEOUT_SECONDS).
    ``answered_at``: when a worker took the row's decision to answer codex with it (set just before the
    answer is sent, at most once: ``services.approval_answered``); null while no codex has been answered
    from it. A re-run of the turn after a lost worker matches only rows still unanswered
    (``docs/contract.md`` §10, "The same request after a lost worker").
    """

    class Kind(models.TextChoices):
        COMMAND = "command"
        FILE_CHANGE = "file_change"
        PERMISSIONS = "permissions"
        USER_INPUT = "user_input"
        MCP_ELICITATION = "mcp_elicitation"

    class Status(models.TextChoices):
        PENDING = "pending"
        ACCEPTED = "accepted"
        DECLINED = "declined"
        CANCELLED = "cancelled"
        EXPIRED = "expired"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    session = models.ForeignKey(Session, on_delete=models.CASCADE, related_name="approvals")
    turn = models.ForeignKey(Turn, on_delete=models.SET_NULL, null=True, blank=True, related_name="approvals")
    turn_ref = models.UUIDField(help_text="the turn's id, kept when the turn row is deleted")
    attempt = models.PositiveIntegerField(default=0)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    codex_request_id = models.CharField(max_length=64, blank=True)
    codex_item_id = models.CharField(max_length=255, blank=True)
    request = models.JSONField(default=dict, blank=True)
    available_decisions = models.JSONField(default=list, blank=True)
    offered = models.JSONField(default=list, blank=True)
    fingerprint = models.CharField(max_length=64)
    decision = models.CharField(max_length=64, blank=True)
    response = models.JSONField(default=dict, blank=True)
    reason = models.TextField(blank=True, help_text="why it ended so (expired, cancelled, a session grant)")
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                                   related_name="+")
    decided_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    answered_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["session", "status", "-created_at"], name="approval_session_status"),
            models.Index(fields=["turn_ref", "status"], name="approval_turn_status"),
            models.Index(fields=["session", "fingerprint"], name="approval_session_fingerprint"),
            # The admin index counts and lists the pending ones across all sessions: a partial index keeps
            # that read the size of what waits, not of the audit trail.
            models.Index(fields=["-created_at"], name="approval_pending", condition=Q(status="pending")),
        ]
        constraints = [
            # One row per request codex sent in a claim of a turn: a request is put to a person once (I9).
            models.UniqueConstraint(fields=["turn_ref", "attempt", "codex_request_id"],
                                    name="approval_unique_turn_attempt_request"),
        ]

    def __str__(self) -> str:
        return f"{self.kind} {self.status} ({self.turn_ref})"

    @property
    def is_pending(self) -> bool:
        return self.status == self.Status.PENDING


class MetricReport(models.Model):
    """What one process counted since it started (``hermes_sessions/metrics/``), written by that process
    every ``HERMES_METRICS_REPORT_SECONDS`` and at its clean stop (``services/metric_reports.py``); any API
    process serves the sum of every row at ``GET /metrics``, so the figures do not depend on which process
    answers or on which host a worker runs.

    ``process`` names one process's life (``<host>:<pid>:<start, ms since the epoch>``; ``retired``: the
    folded total of processes gone for ``HERMES_METRICS_RETIRE_SECONDS``). ``counters``: the cumulative
    samples of its counters and histograms, ``[[sample name, {label: value}, value], …]``, only ever
    growing; ``gauges``: its gauges as of ``reported_at`` in the same shape (counted only while the report
    is fresh; ``[]`` after a clean stop). ``role``: ``api``, ``worker`` or ``other``; ``worker``: a worker's
    route or ``<host>:<pid>``, the ``worker`` label of its gauges."""

    process = models.CharField(primary_key=True, max_length=255)
    role = models.CharField(max_length=16, blank=True)
    worker = models.CharField(max_length=255, blank=True)
    started_at = models.DateTimeField()
    reported_at = models.DateTimeField(db_index=True)
    counters = models.JSONField(default=list, blank=True)
    gauges = models.JSONField(default=list, blank=True)

    def __str__(self) -> str:
        return self.process


class WebhookEndpoint(models.Model):
    """A URL that receives the events of its owner's sessions (``docs/api.md`` §Webhooks), signed as
    the Standard Webhooks specification says with ``secret`` (``whsec_<base64 of 24-64 bytes>``).

    ``event_types`` is a non-empty subset of ``EVENT_TYPES``. ``all_sessions`` (staff only): every
    session's events, not only the owner's. An inactive endpoint gets no new deliveries and its pending
    ones wait; ``disabled_reason`` says why it was disabled (``HERMES_WEBHOOK_DISABLE_AFTER`` consecutive
    failed attempts, or its owner). ``consecutive_failures`` counts failed attempts since the last
    success. Written only by ``services/webhooks.py``; the outbox rows are written by the trigger of
    migration 0013 (``hermes_webhook_outbox``), in the transaction of the event."""

    EVENT_TYPES = ("turn.succeeded", "turn.failed", "turn.cancelled", "thread.rotated", "approval.requested")

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhook_endpoints")
    url = models.URLField(max_length=2000)
    secret = models.CharField(max_length=128)
    event_types = ArrayField(models.CharField(max_length=32), default=list)
    all_sessions = models.BooleanField(default=False, help_text="every session's events (staff only)")
    active = models.BooleanField(default=True)
    disabled_reason = models.TextField(blank=True)
    disabled_at = models.DateTimeField(null=True, blank=True)
    consecutive_failures = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            # The trigger's read: the active endpoints (few) of an owner, or for all sessions.
            models.Index(fields=["owner"], condition=Q(active=True), name="webhook_endpoint_active_owner"),
        ]

    def __str__(self) -> str:
        return f"{self.url} ({'active' if self.active else 'disabled'})"


class WebhookDelivery(models.Model):
    """The outbox: one event to one endpoint (unique ``(event_id, endpoint)``), inserted by the trigger
    on ``TurnEvent`` in the event's own transaction — a rolled-back turn leaves none, a committed one
    cannot lose it.

    ``event_id`` is the ``TurnEvent`` id (no foreign key: the delivery outlives the session's retention);
    ``webhook_id`` the ``webhook-id`` header, the same on every attempt (receivers dedupe on it);
    ``payload`` the body ``{"type", "timestamp", "data"}``. Status: ``pending`` (not tried yet),
    ``failed`` (the last attempt failed; tried again at ``next_attempt_at``), ``succeeded`` (a 2xx),
    ``gave_up`` (``HERMES_WEBHOOK_RETRY_SECONDS`` after ``created_at`` with no success). A claim
    (``worker/webhooks.py``) sets ``claim_token`` and moves ``next_attempt_at`` past the attempt's end,
    so a worker that dies mid-send leaves the row due again later."""

    class Status(models.TextChoices):
        PENDING = "pending"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        GAVE_UP = "gave_up"

    DUE = (Status.PENDING, Status.FAILED)

    id = models.BigAutoField(primary_key=True)
    endpoint = models.ForeignKey(WebhookEndpoint, on_delete=models.CASCADE, related_name="deliveries")
    event_id = models.BigIntegerField()
    event_type = models.CharField(max_length=32)
    session_id = models.CharField(max_length=64)
    turn_id = models.UUIDField(null=True, blank=True)
    webhook_id = models.CharField(max_length=64, unique=True)
    payload = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField()
    claim_token = models.UUIDField(null=True, blank=True)
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "webhook deliveries"
        ordering = ["-id"]
        constraints = [
            models.UniqueConstraint(fields=["event_id", "endpoint"], name="webhook_delivery_one_per_event_endpoint"),
        ]
        indexes = [
            # The sender's claim: the due rows only (few), oldest due first.
            models.Index(fields=["next_attempt_at"], condition=Q(status__in=["pending", "failed"]),
                         name="webhook_delivery_due"),
            models.Index(fields=["endpoint", "-id"], name="webhook_delivery_endpoint"),
        ]

    def __str__(self) -> str:
        return f"{self.event_type} → {self.endpoint_id} ({self.status})"


class WebhookAttempt(models.Model):
    """One HTTP attempt of a delivery, insert-only (the admin's log): when, to which checked address,
    the HTTP status (null: no answer) or the error, and how long it took (milliseconds)."""

    delivery = models.ForeignKey(WebhookDelivery, on_delete=models.CASCADE, related_name="attempt_log")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    address = models.CharField(max_length=64, blank=True, help_text="the IP address connected to")
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    duration_ms = models.FloatField(default=0)

    class Meta:
        ordering = ["delivery", "number"]
        constraints = [models.UniqueConstraint(fields=["delivery", "number"], name="webhook_attempt_unique_number")]

    def __str__(self) -> str:
        return f"{self.delivery_id}#{self.number} {self.status_code or self.error[:40]}"
