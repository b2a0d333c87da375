"""Request and response shapes of the REST API.

Input serializers only check shape (types, presence, lengths); the domain rules — session id
availability, ``model_config`` policy, turn input limits — are the services' and raise their own
errors (mapped in ``api.errors``). Output serializers read annotated rows from ``selectors``.
"""
from __future__ import annotations

from typing import Any

from django.core.validators import ProhibitNullCharactersValidator, RegexValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from .. import policy
from ..models import Approval, Message, Notice, Session, Turn, WebhookAttempt, WebhookDelivery, WebhookEndpoint
from ..selectors import is_valid_session_id
from ..services.idempotency import MAX_KEY_CHARS
from ..services.turns import MAX_INPUT_CHARS, ON_BUSY

# The schema's spelling of ``models.SESSION_ID_RE`` for ``POST /api/sessions/``'s optional ``id``
# (drf-spectacular adds the empty string, which asks the server to pick one, as a second ``oneOf``
# arm, so the pattern itself must not match it). ECMA-262 and Python read it alike (ASCII classes
# only); ``validate_id`` still checks with ``is_valid_session_id``, which also refuses a trailing newline.
SESSION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
SESSION_ID_RULE = "A session id is 1-64 characters: letters, digits, '.', '_', ':' or '-', starting with a letter or digit."
# An Idempotency-Key as ``services.idempotency`` accepts it: 1-255 printable ASCII characters. HTTP
# strips the spaces and tabs around a header value before the service sees it (runserver and gunicorn
# alike), so the schema lets them surround the key: what it allows is what arrives, and what it
# refuses (a longer key, a non-ASCII or control character, nothing but blanks) the service refuses.
IDEMPOTENCY_KEY_PATTERN = rf"^[ \t]*[!-~](?:[ -~]{{0,{MAX_KEY_CHARS - 2}}}[!-~])?[ \t]*$"


class StrictTextField(serializers.CharField):
    """A string field that refuses non-strings (DRF's ``CharField`` turns ``42`` into ``"42"``)
    and lets NUL bytes and lone surrogates through to the services, which store them safely as
    U+FFFD (``sanitize.clean_text``) instead of refusing the whole input."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)
        refused = (ProhibitNullCharactersValidator, ProhibitSurrogateCharactersValidator)
        self.validators = [v for v in self.validators if not isinstance(v, refused)]

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


# --- sessions --------------------------------------------------------------------------------------


# ``policy.validate_model_config`` judges model_config (400, or 403 for a staff-only value); this is
# the same rule as a schema, so that the schema refuses what the policy refuses.
MODEL_CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "model": {"type": "string", "minLength": 1, "maxLength": 100, "description": "The codex model name."},
        "developer_instructions": {"type": "string", "maxLength": policy.MAX_INSTRUCTIONS_CHARS},
        "sandbox": {
            "type": "string",
            "enum": list(policy.STAFF_SANDBOXES),
            "description": "`danger-full-access` is reserved to staff (403 for others).",
        },
        "approval_policy": {"type": "string", "enum": list(policy.APPROVAL_POLICIES)},
    },
    "description": "Codex settings within the operator's policy (hermes_sessions/policy.py); unknown keys, "
    "including `cwd`, are refused.",
}


@extend_schema_field(MODEL_CONFIG_SCHEMA)
class ModelConfigField(serializers.DictField):
    """``model_config``: any JSON object here; ``policy.validate_model_config`` (in the service) is
    the one judge of its keys and values, the schema above spells the same rule out."""


class SessionCreateSerializer(serializers.Serializer):
    """``POST /api/sessions/`` body. ``id`` is optional (the server picks ``sess-<hex>``);
    ``model_config`` is checked by ``policy.validate_model_config`` in the service."""

    id = StrictTextField(
        required=False,
        allow_blank=True,
        max_length=64,
        validators=[RegexValidator(SESSION_ID_PATTERN, message=SESSION_ID_RULE)],
        help_text="Optional client-chosen id: 1-64 of letters, digits, '.', '_', ':' or '-', starting with a "
        "letter or digit; empty or absent: the server picks `sess-<hex>` (random). Ids are one namespace for "
        "all users: an id anyone holds is a 409, so a chosen id is a public name, not a secret.",
    )
    title = StrictTextField(required=False, allow_blank=True, max_length=200, default="", help_text="May be empty.")
    model_config = ModelConfigField(required=False, default=dict)

    def validate_id(self, value: str) -> str:
        """Refuse malformed ids here, with the id rule as the reason."""
        if value and not is_valid_session_id(value):
            raise serializers.ValidationError(SESSION_ID_RULE)
        return value


class SessionSerializer(serializers.ModelSerializer):
    """A session as the API shows it; expects a row from ``selectors.session_list`` (annotated)."""

    codex_thread_id = serializers.CharField(
        source="active_thread_id", read_only=True, allow_null=True, help_text="The active binding's codex thread id."
    )
    turn_count = serializers.IntegerField(read_only=True)
    unacknowledged_notice_count = serializers.IntegerField(read_only=True)
    last_activity = serializers.DateTimeField(read_only=True)

    class Meta:
        model = Session
        fields = [
            "id",
            "title",
            "model_config",
            "codex_thread_id",
            "turn_count",
            "unacknowledged_notice_count",
            "last_activity",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields


# --- turns -----------------------------------------------------------------------------------------


class TurnCreateSerializer(serializers.Serializer):
    """``POST /api/sessions/{id}/turns/`` body. ``input`` must hold a non-whitespace character and at
    most ``services.MAX_INPUT_CHARS`` characters — the service's rule (``turn_enqueue``), written
    here too so the schema says it (``minLength``, ``maxLength``, ``pattern``)."""

    input = StrictTextField(
        min_length=1,
        max_length=MAX_INPUT_CHARS,
        # Python's \S is "not str.isspace()", exactly the service's ``text.strip()`` test.
        validators=[RegexValidator(r"\S", message="input must be a non-empty string: it has no non-whitespace character")],
        error_messages={
            "blank": "input must be a non-empty string",
            "max_length": f"input is longer than the limit of {MAX_INPUT_CHARS} characters",
        },
        help_text="The user's input for this turn: at least one non-whitespace character, at most "
        f"{MAX_INPUT_CHARS} characters.",
    )
    on_busy = serializers.ChoiceField(
        choices=list(ON_BUSY),
        default="enqueue",
        help_text="When the session already has a turn running or queued: enqueue (run after it, in order), "
        "reject (409 naming that turn) or interrupt (turn/interrupt the running turn, then run).",
    )


class ThreadActionField(serializers.ChoiceField):
    """``Turn.thread_action`` as the API shows it: ``started``, ``resumed``, ``rotated``, or ``null``
    while it is not known — queued, running, or ended before codex opened a thread (the row stores
    ``""`` then; ``docs/contract.md`` §3 says when each value is set)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(choices=Turn.ThreadAction.choices, allow_null=True, read_only=True, **kwargs)

    def to_representation(self, value: Any) -> Any:
        return str(value) if value else None


class TurnSerializer(serializers.ModelSerializer):
    """A turn and its outcome. ``usage`` holds codex token counts; ``timings`` phase durations (ms);
    ``thread_action`` is null until the runner has opened a thread."""

    session = serializers.CharField(source="session_id", read_only=True)
    thread_action = ThreadActionField(
        help_text="started | resumed | rotated once the runner opened a thread; null before that (queued, running, "
        "or ended before codex opened a thread)."
    )
    usage = serializers.DictField(read_only=True)
    timings = serializers.DictField(read_only=True)
    waiting_for_approval = serializers.SerializerMethodField(
        help_text="True while codex waits for a decision on one of this turn's approvals "
        "(`GET /api/sessions/{id}/approvals/?status=pending`)."
    )

    class Meta:
        model = Turn
        fields = [
            "id",
            "session",
            "seq",
            "status",
            "waiting_for_approval",
            "input",
            "thread_action",
            "codex_thread_id",
            "codex_turn_id",
            "final_text",
            "error",
            "usage",
            "timings",
            "created_at",
            "started_at",
            "finished_at",
        ]
        read_only_fields = fields


    def get_waiting_for_approval(self, turn: Turn) -> bool:
        # Annotated by the selectors that show turns (``selectors.with_waiting``); a turn read without it
        # (one just queued or cancelled) has nothing pending to show.
        return bool(getattr(turn, "waiting_for_approval", False))


# --- approvals -----------------------------------------------------------------------------------

#: Every decision name codex 0.171.0 knows (``CommandExecutionApprovalDecision``, ``FileChangeApprovalDecision``,
#: the elicitation actions); which of them an approval takes is its ``available_decisions``.
DECISIONS = ["accept", "acceptForSession", "acceptWithExecpolicyAmendment", "applyNetworkPolicyAmendment",
             "decline", "cancel"]


class ApprovalSerializer(serializers.ModelSerializer):
    """A request codex made during a turn for a person's decision, and what became of it."""

    session = serializers.CharField(source="session_id", read_only=True)
    turn = serializers.UUIDField(source="turn_ref", read_only=True)
    request = serializers.DictField(
        read_only=True,
        help_text="What codex asked, by kind: command `{command, cwd, reason, command_actions}`; file_change "
        "`{changes: [{path, kind, diff}], reason, grant_root}`; permissions `{permissions, reason, cwd}`; user_input "
        "`{questions: [{id, header, question, options}]}`; mcp_elicitation `{server, mode, message, schema, url}`; "
        "always `method` and `item_id` (codex's).",
    )
    available_decisions = serializers.ListField(child=serializers.CharField(), read_only=True,
                                                help_text="The decisions you may give (POST …/decision/).")
    response = serializers.DictField(read_only=True, help_text="The answers or form content given with the decision.")
    decided_by = serializers.SerializerMethodField(help_text="Who decided (a username); null: nobody yet, or the "
                                                   "service (expired, cancelled with its turn, a session grant).")

    class Meta:
        model = Approval
        fields = ["id", "session", "turn", "kind", "status", "request", "available_decisions", "decision",
                  "response", "reason", "decided_by", "decided_at", "expires_at", "created_at"]
        read_only_fields = fields

    def get_decided_by(self, approval: Approval) -> str | None:
        return approval.decided_by.get_username() if approval.decided_by is not None else None


@extend_schema_field({"type": "object", "additionalProperties": {
    "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]}})
class AnswersField(serializers.JSONField):
    """``{"<question id>": "answer" | ["answer", …]}``; checked against the questions by the service."""


class ApprovalDecisionSerializer(serializers.Serializer):
    """``POST /api/approvals/{id}/decision/`` body."""

    decision = serializers.ChoiceField(choices=DECISIONS, help_text="One of the approval's `available_decisions`; "
                                       "another: 400 listing them.")
    answers = AnswersField(required=False, help_text="user_input, with accept: an answer to every question, by "
                           "question id.")
    content = serializers.DictField(required=False, help_text="mcp_elicitation, with accept: the form's values.")


# --- transcript and notices -----------------------------------------------------------------------


@extend_schema_field({"type": "array", "items": {"type": "object", "additionalProperties": {}}, "nullable": True})
class ToolCallsField(serializers.JSONField):
    """OpenAI-style ``tool_calls`` list (or null)."""


class MessageSerializer(serializers.ModelSerializer):
    """One transcript row."""

    turn = serializers.UUIDField(source="turn_id", read_only=True, allow_null=True)
    tool_calls = ToolCallsField(read_only=True)

    class Meta:
        model = Message
        fields = [
            "seq",
            "role",
            "content",
            "tool_calls",
            "tool_call_id",
            "reasoning",
            "codex_item_id",
            "turn",
            "created_at",
        ]
        read_only_fields = fields


class MessageSearchResultSerializer(MessageSerializer):
    """A transcript row found by ``GET /api/messages/?q=``, with the session it belongs to."""

    session = serializers.CharField(source="session_id", read_only=True)

    class Meta(MessageSerializer.Meta):
        fields = ["session", *MessageSerializer.Meta.fields]
        read_only_fields = fields


class NoticeSerializer(serializers.ModelSerializer):
    """One lifecycle notice about a session."""

    turn = serializers.UUIDField(source="turn_id", read_only=True, allow_null=True)

    class Meta:
        model = Notice
        fields = ["id", "kind", "text", "turn", "created_at", "acknowledged_at"]
        read_only_fields = fields


class StrictBooleanField(serializers.BooleanField):
    """A JSON ``true`` or ``false`` only (DRF's ``BooleanField`` also takes ``"yes"``, ``1``, ``"on"``…)."""

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


EVENT_TYPES_HELP = ("Which events are sent: a non-empty subset of " + ", ".join(f"`{t}`" for t in WebhookEndpoint.EVENT_TYPES)
                    + " (docs/api.md, Webhooks).")
URL_HELP = ("Where the events are POSTed: http or https, no credentials, a host that resolves to public addresses "
            "only — private, loopback, link-local and other internal addresses are refused (400) unless the "
            "operator allows them. Redirects are not followed.")


class WebhookEndpointSerializer(serializers.ModelSerializer):
    """A webhook endpoint as the API shows it (never its secret, which only the creation's answer holds)."""

    event_types = serializers.ListField(child=serializers.ChoiceField(choices=list(WebhookEndpoint.EVENT_TYPES)),
                                        help_text=EVENT_TYPES_HELP)

    class Meta:
        model = WebhookEndpoint
        fields = ["id", "url", "event_types", "all_sessions", "active", "disabled_reason", "disabled_at",
                  "consecutive_failures", "created_at", "updated_at"]
        read_only_fields = fields


class WebhookEndpointCreatedSerializer(WebhookEndpointSerializer):
    """``POST /api/webhooks/``'s answer: the endpoint with its ``secret``, shown this once."""

    secret = serializers.CharField(read_only=True, help_text="`whsec_…`: verify each delivery's "
                                   "`webhook-signature` with it (Standard Webhooks). Shown only in this answer.")

    class Meta(WebhookEndpointSerializer.Meta):
        fields = [*WebhookEndpointSerializer.Meta.fields, "secret"]
        read_only_fields = fields


class WebhookEndpointWriteSerializer(serializers.Serializer):
    """``POST /api/webhooks/`` (``url`` and ``event_types`` required) and ``PATCH /api/webhooks/{id}/``
    (any of them; ``active`` re-enables or disables). The URL's target and the secret's form are the
    service's rules (``services.webhooks``: 400 with the reason)."""

    url = StrictTextField(min_length=1, max_length=2000, help_text=URL_HELP)
    event_types = serializers.ListField(child=serializers.ChoiceField(choices=list(WebhookEndpoint.EVENT_TYPES)),
                                        min_length=1, max_length=len(WebhookEndpoint.EVENT_TYPES) * 4,
                                        help_text=EVENT_TYPES_HELP)
    secret = StrictTextField(required=False, min_length=38, max_length=128, write_only=True,
                             validators=[RegexValidator(r"^whsec_[A-Za-z0-9+/]+={0,2}$",
                                                        message="the secret must be whsec_ followed by base64")],
                             help_text="Your own secret, `whsec_` + base64 of 24-64 bytes; left out, one is made "
                             "and returned once. Only at creation.")
    all_sessions = StrictBooleanField(required=False, help_text="Every session's events, not only yours "
                                      "(staff only; others: 400).")
    active = StrictBooleanField(required=False, help_text="`true` re-enables a disabled endpoint (its failures "
                                "are cleared, its waiting deliveries go out); `false` disables it. Only on PATCH.")


class WebhookAttemptSerializer(serializers.ModelSerializer):
    """One HTTP attempt of a delivery."""

    class Meta:
        model = WebhookAttempt
        fields = ["number", "started_at", "status_code", "error", "duration_ms"]
        read_only_fields = fields


class WebhookDeliverySerializer(serializers.ModelSerializer):
    """One event sent (or to be sent) to an endpoint, with its attempts."""

    turn = serializers.UUIDField(source="turn_id", read_only=True, allow_null=True)
    session = serializers.CharField(source="session_id", read_only=True)
    attempt_log = WebhookAttemptSerializer(many=True, read_only=True)

    class Meta:
        model = WebhookDelivery
        fields = ["id", "webhook_id", "event_type", "session", "turn", "status", "attempts", "next_attempt_at",
                  "last_status_code", "last_error", "created_at", "finished_at", "payload", "attempt_log"]
        read_only_fields = fields
