"""The operators' view: sessions with their transcript, binding history, turns and notices.

Staff see every session. Nothing here writes sessions, messages, turns or bindings — the services
are the only writers — so those pages are view-only; the one write is acknowledging notices,
through ``services.notice_acknowledge``. Unacknowledged notices show as a warning banner at the
top of the session page (``templates/admin/hermes_sessions/session/change_form.html``).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import unquote
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse

from . import selectors, services
from .models import CodexBinding, Message, Notice, Session, Turn


class _ReadOnlyInline(admin.TabularInline):
    """A view-only inline: no add, change or delete; every listed field read-only."""

    extra = 0
    max_num = 0
    can_delete = False
    show_change_link = False

    def get_readonly_fields(self, request: HttpRequest, obj: Model | None = None) -> Any:
        return self.fields

    def has_add_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Model | None = None) -> bool:
        return False


PREVIEW_CHARS = 2_000


class MessageInline(_ReadOnlyInline):
    """The transcript, in ``seq`` order; long texts are cut to ``PREVIEW_CHARS`` so a session with
    huge turns still renders (the API serves the full rows)."""

    model = Message
    verbose_name = "transcript message"
    verbose_name_plural = "transcript"
    fields = ("seq", "role", "content_preview", "tool_calls", "tool_call_id", "reasoning_preview", "codex_item_id", "turn", "created_at")
    ordering = ("seq",)

    @admin.display(description="content")
    def content_preview(self, obj: Message) -> str:
        return _preview(obj.content)

    @admin.display(description="reasoning")
    def reasoning_preview(self, obj: Message) -> str:
        return _preview(obj.reasoning)


def _preview(text: str) -> str:
    if len(text) <= PREVIEW_CHARS:
        return text
    return f"{text[:PREVIEW_CHARS]}… [{len(text) - PREVIEW_CHARS} more characters; full text in the API]"


class CodexBindingInline(_ReadOnlyInline):
    """Binding history: which codex thread the session continued in, and why each one ended."""

    model = CodexBinding
    verbose_name = "codex binding"
    verbose_name_plural = "codex binding history"
    fields = ("thread_id", "status", "created_at", "ended_at", "ended_reason")
    ordering = ("created_at", "id")


class TurnInline(_ReadOnlyInline):
    """The session's turns in the order they were accepted."""

    model = Turn
    fields = ("seq", "status", "thread_action", "codex_thread_id", "error", "created_at", "finished_at")
    ordering = ("seq",)


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    """Sessions list (one annotated query: active thread, turn and unacknowledged-notice counts,
    last activity) and a view-only session page with notices, transcript, bindings and turns."""

    list_display = (
        "id",
        "owner",
        "title",
        "active_thread",
        "turns",
        "last_activity",
        "unacknowledged_notices",
    )
    list_filter = ("created_at",)
    search_fields = ("id", "title", "owner__username", "bindings__thread_id")
    fields = ("id", "owner", "title", "model_config", "active_thread", "last_message_seq", "last_turn_seq", "created_at", "updated_at")
    readonly_fields = fields
    inlines = (MessageInline, CodexBindingInline, TurnInline)
    show_full_result_count = False
    actions = ("end_codex_binding",)

    @admin.action(description="End the codex binding (the next turn starts a new, seeded thread)", permissions=["end_binding"])
    def end_codex_binding(self, request: HttpRequest, queryset: QuerySet[Session]) -> None:
        """The way out when codex can no longer read a thread but its error is not the one that
        rotates (e.g. a damaged rollout: -32603 "failed to read session metadata")."""
        ended = sum(services.binding_end(session=s, reason=f"ended by operator {request.user}") for s in queryset)
        self.message_user(request, f"Ended {ended} codex binding(s).", messages.SUCCESS)

    def has_end_binding_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("hermes_sessions.change_codexbinding")

    def get_queryset(self, request: HttpRequest) -> QuerySet[Session]:
        return selectors.session_admin_list()

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Session | None:
        # A malformed id (e.g. a NUL byte, which PostgreSQL refuses in a query) is simply not found.
        if from_field is None and not selectors.is_valid_session_id(object_id):
            return None
        return super().get_object(request, object_id, from_field)

    def has_add_permission(self, request: HttpRequest) -> bool:
        # Sessions are made by services.session_create (the API), which applies the config policy.
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="active thread", ordering="active_thread_id")
    def active_thread(self, obj: Session) -> str:
        return selectors.active_thread_id(session=obj) or "—"

    @admin.display(description="turns", ordering="turn_count")
    def turns(self, obj: Session) -> int:
        return int(getattr(obj, "turn_count", 0))  # annotated by selectors.session_admin_list

    @admin.display(description="last activity", ordering="last_activity")
    def last_activity(self, obj: Session) -> datetime | None:
        return getattr(obj, "last_activity", None)  # annotated by selectors.session_admin_list

    @admin.display(description="unacknowledged notices", ordering="unacknowledged_notice_count")
    def unacknowledged_notices(self, obj: Session) -> int:
        return int(getattr(obj, "unacknowledged_notice_count", 0))  # annotated by selectors.session_admin_list

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Add ``unacknowledged_notices`` (newest first) for the banner at the top of the page."""
        extra_context = dict(extra_context or {})
        session_id = unquote(object_id)
        notices = Notice.objects.none()
        if selectors.is_valid_session_id(session_id):
            notices = Notice.objects.filter(session_id=session_id, acknowledged_at__isnull=True).order_by("-created_at", "-id")
        extra_context["unacknowledged_notices"] = list(notices)
        extra_context["notice_session_id"] = session_id
        return super().change_view(request, object_id, form_url, extra_context=extra_context)


class AcknowledgedFilter(admin.SimpleListFilter):
    """Filter notices by whether an operator has acknowledged them."""

    title = "acknowledged"
    parameter_name = "acknowledged"

    def lookups(self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]) -> tuple[tuple[str, str], ...]:
        return (("yes", "Yes"), ("no", "No"))

    def queryset(self, request: HttpRequest, queryset: QuerySet[Notice]) -> QuerySet[Notice]:
        if self.value() == "yes":
            return queryset.filter(acknowledged_at__isnull=False)
        if self.value() == "no":
            return queryset.filter(acknowledged_at__isnull=True)
        return queryset


@admin.register(Notice)
class NoticeAdmin(admin.ModelAdmin):
    """Lifecycle notices across sessions, with the "Acknowledge selected notices" action."""

    list_display = ("kind", "session", "text", "created_at", "acknowledged")
    list_filter = (AcknowledgedFilter, "kind")
    list_select_related = ("session",)
    search_fields = ("session__id", "text")
    fields = ("session", "turn", "kind", "text", "created_at", "acknowledged_at", "acknowledged_by")
    readonly_fields = fields
    actions = ("acknowledge_notices",)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # The list-level change right lets the acknowledge action run; a notice's page stays view-only.
        return obj is None and super().has_change_permission(request, obj)

    @admin.display(boolean=True, description="acknowledged", ordering="acknowledged_at")
    def acknowledged(self, obj: Notice) -> bool:
        return obj.acknowledged

    @admin.action(description="Acknowledge selected notices", permissions=["change"])
    def acknowledge_notices(self, request: HttpRequest, queryset: QuerySet[Notice]) -> None:
        """Mark the selected notices acknowledged by the current user (``services.notice_acknowledge``)."""
        changed = services.notice_acknowledge(notices=queryset, user=request.user)
        self.message_user(request, f"Acknowledged {changed} notice{'s' if changed != 1 else ''}.", messages.SUCCESS)


@admin.register(Turn)
class TurnAdmin(admin.ModelAdmin):
    """View-only list of turns across sessions, for finding failed or stuck ones."""

    list_display = ("session", "seq", "status", "thread_action", "codex_thread_id", "attempt", "created_at", "finished_at")
    list_filter = ("status", "thread_action")
    list_select_related = ("session",)
    search_fields = ("session__id", "codex_thread_id", "codex_turn_id")
    readonly_fields = [f.name for f in Turn._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False
