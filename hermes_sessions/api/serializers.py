"""Request and response shapes of the REST API.

Input serializers only check shape (types, presence, lengths); the domain rules — session id
availability, ``model_config`` policy, turn input limits — are the services' and raise their own
errors (mapped in ``api.errors``). Output serializers read annotated rows from ``selectors``.
"""
from __future__ import annotations

from typing import Any

from django.core.validators import ProhibitNullCharactersValidator
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.validators import ProhibitSurrogateCharactersValidator

from ..models import Message, Notice, Session, Turn
from ..selectors import is_valid_session_id


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


class SessionCreateSerializer(serializers.Serializer):
    """``POST /api/sessions/`` body. ``id`` is optional (the server picks ``sess-<hex>``);
    ``model_config`` is checked by ``policy.validate_model_config`` in the service."""

    id = StrictTextField(
        required=False,
        allow_blank=True,
        max_length=64,
        help_text="Optional client-chosen id: 1-64 of letters, digits, '.', '_', ':' or '-', starting with a letter or digit.",
    )
    title = StrictTextField(required=False, allow_blank=True, max_length=200, default="")
    model_config = serializers.DictField(
        required=False,
        default=dict,
        help_text="Codex settings: model, developer_instructions, sandbox, approval_policy.",
    )

    def validate_id(self, value: str) -> str:
        """Refuse malformed ids here, with the id rule as the reason."""
        if value and not is_valid_session_id(value):
            raise serializers.ValidationError(
                "A session id is 1-64 characters: letters, digits, '.', '_', ':' or '-', starting with a letter or digit."
            )
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
    """``POST /api/sessions/{id}/turns/`` body. Emptiness and length are the service's to judge."""

    input = StrictTextField(allow_blank=True, help_text="The user's input for this turn.")
    on_busy = serializers.ChoiceField(
        choices=["enqueue", "reject", "interrupt"],
        default="enqueue",
        help_text="When the session already has a turn running or queued: enqueue (run after it, in order), "
        "reject (409 naming that turn) or interrupt (turn/interrupt the running turn, then run).",
    )


class TurnSerializer(serializers.ModelSerializer):
    """A turn and its outcome. ``usage`` holds codex token counts; ``timings`` phase durations (ms)."""

    session = serializers.CharField(source="session_id", read_only=True)
    usage = serializers.DictField(read_only=True)
    timings = serializers.DictField(read_only=True)

    class Meta:
        model = Turn
        fields = [
            "id",
            "session",
            "seq",
            "status",
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
