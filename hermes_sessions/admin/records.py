"""The audit records: notices, turns, messages and approvals. None of them is added, changed or deleted here
(the services write them; turns and notices are the audit trail), so their pages say "View". The
writes operators make go through services: acknowledging notices, cancelling turns, deciding approvals.

Messages have no list of their own (a million rows): their changelist is the message search page
(``?q=``, keyset pages newest first, ``?before=<id>``), with no ``COUNT``.
"""
from __future__ import annotations

import uuid
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.middleware.csrf import get_token
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.safestring import SafeString

from .. import selectors, services
from ..models import Approval, Message, Notice, Turn
from . import approvals
from .pagination import EstimatedCountPaginator
from .rendering import preview
from .sessions import _int_param
from .timeline import duration_text, turn_duration


class _AuditAdmin(admin.ModelAdmin):
    """View-only: no add, change or delete (so Django shows "View"); actions carry their own rights."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class AcknowledgedFilter(admin.SimpleListFilter):
    """Filter notices by whether an operator has acknowledged them."""

    title = "acknowledged"
    parameter_name = "acknowledged"

    def lookups(self, request: HttpRequest, model_admin: Any) -> tuple[tuple[str, str], ...]:
        return (("yes", "Yes"), ("no", "No"))

    def queryset(self, request: HttpRequest, queryset: QuerySet[Notice]) -> QuerySet[Notice]:
        if self.value() == "yes":
            return queryset.filter(acknowledged_at__isnull=False)
        if self.value() == "no":
            return queryset.filter(acknowledged_at__isnull=True)
        return queryset


@admin.register(Notice)
class NoticeAdmin(_AuditAdmin):
    """Lifecycle notices across sessions, with "Acknowledge selected notices"."""

    list_display = ("kind", "session", "text", "created_at", "acknowledged")
    list_filter = (AcknowledgedFilter, "kind")
    list_select_related = ("session",)
    search_fields = ("session__id", "text")
    fields = ("session", "turn", "kind", "text", "created_at", "acknowledged_at", "acknowledged_by")
    readonly_fields = fields
    actions = ("acknowledge_notices",)
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    @admin.display(boolean=True, description="acknowledged", ordering="acknowledged_at")
    def acknowledged(self, obj: Notice) -> bool:
        return obj.acknowledged

    @admin.action(description="Acknowledge selected notices", permissions=["acknowledge"])
    def acknowledge_notices(self, request: HttpRequest, queryset: QuerySet[Notice]) -> None:
        """Mark the selected notices acknowledged by the current user (``services.notice_acknowledge``)."""
        changed = services.notice_acknowledge(notices=queryset, user=request.user)
        self.message_user(request, f"Acknowledged {changed} notice{'s' if changed != 1 else ''}.", messages.SUCCESS)

    def has_acknowledge_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("hermes_sessions.change_notice")


@admin.register(Turn)
class TurnAdmin(_AuditAdmin):
    """Turns across sessions, for finding failed or stuck ones: input, error, duration, token usage;
    "Cancel selected turns" (``services.turn_cancel``, as the API)."""

    list_display = ("session", "seq", "status", "waiting", "thread_action", "input_preview", "error_preview",
                    "duration", "total_tokens", "attempt", "created_at")
    list_filter = ("status", "thread_action")
    list_select_related = ("session",)
    search_fields = ("session__id", "codex_thread_id", "codex_turn_id")
    readonly_fields = [*(f.name for f in Turn._meta.fields), "waiting"]
    actions = ("cancel_turns",)
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> QuerySet[Turn]:
        return selectors.with_waiting(super().get_queryset(request))

    @admin.display(boolean=True, description="waiting for approval")
    def waiting(self, obj: Turn) -> bool:
        return bool(getattr(obj, "waiting_for_approval", False))

    @admin.display(description="input")
    def input_preview(self, obj: Turn) -> str:
        return preview(obj.input, 120)

    @admin.display(description="error")
    def error_preview(self, obj: Turn) -> str:
        return preview(obj.error, 200)

    @admin.display(description="duration")
    def duration(self, obj: Turn) -> str:
        return duration_text(turn_duration(obj))

    @admin.display(description="tokens")
    def total_tokens(self, obj: Turn) -> Any:
        return (obj.usage or {}).get("total_tokens", "—")

    @admin.action(description="Cancel selected turns", permissions=["cancel"])
    def cancel_turns(self, request: HttpRequest, queryset: QuerySet[Turn]) -> None:
        """Cancel each queued or running turn selected; finished ones are left as they are."""
        asked = 0
        for turn in queryset.exclude(status__in=Turn.TERMINAL):
            services.turn_cancel(turn=turn)
            asked += 1
        self.message_user(request, f"Cancelled or asked to stop {asked} turn(s).", messages.SUCCESS)

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("hermes_sessions.change_turn")


@admin.register(Approval)
class ApprovalAdmin(_AuditAdmin):
    """What codex asked a person, across sessions, and what was decided. Rows are never edited here; staff
    with ``change_approval`` decide pending ones with the buttons of the list (``?status__exact=pending``,
    linked from the index with its count) and of the approval's page, which also shows the command and
    cwd, the diff or the questions (``approvals.py``; the same service as
    ``POST /api/approvals/{id}/decision/``)."""

    # Few columns, so the decision buttons stay on screen; the turn and the times are on the approval's page.
    list_display = ("kind", "status", "session", "request_preview", "created_at", "decision", "decided_by")
    list_filter = ("status", "kind")
    list_select_related = ("session", "decided_by")
    search_fields = ("session__id", "=turn_ref", "=fingerprint")
    readonly_fields = [f.name for f in Approval._meta.fields]
    paginator = EstimatedCountPaginator
    show_full_result_count = False

    @admin.display(description="request")
    def request_preview(self, obj: Approval) -> str:
        return approvals.request_brief(obj)

    def get_list_display(self, request: HttpRequest) -> Any:
        """The pending list (``?status__exact=pending``) leaves out the decision columns (empty there) and
        puts the buttons beside the request, so they stay on screen; staff without ``change_approval`` get
        no buttons (``tests/admin/test_approvals.py::test_approvals_of_any_users_session_are_for_staff_only``)."""
        pending = request.GET.get("status__exact") == Approval.Status.PENDING
        shown = ("kind", "session", "request_preview", "created_at") if pending else self.list_display
        if not request.user.has_perm(approvals.DECIDE_PERMISSION):
            return shown
        back = request.get_full_path()

        @admin.display(description="decide")
        def decide(obj: Approval) -> SafeString:
            return approvals.decision_buttons(obj, next_url=back)

        return (*shown[:3], decide, *shown[3:]) if pending else (*shown, decide)

    def get_urls(self) -> list[URLPattern]:
        return [
            path("<path:object_id>/decide/", self.admin_site.admin_view(approvals.decide),
                 name="hermes_sessions_approval_decide"),
            *super().get_urls(),
        ]

    def change_view(self, request: HttpRequest, object_id: str, form_url: str = "",
                    extra_context: dict[str, Any] | None = None) -> HttpResponse:
        """The approval's page: what it asks (``approvals.request_details``) and, while it is pending, its
        decision buttons, above the recorded fields."""
        context = dict(extra_context or {})
        approval = self.get_object(request, unquote(object_id))
        if approval is not None:
            context["approval_details"] = approvals.request_details(approval)
            context["approval_session_url"] = reverse("admin:hermes_sessions_session_change", args=[quote(approval.session_id)])
            if request.user.has_perm(approvals.DECIDE_PERMISSION):
                context["approval_form"] = approvals.decision_form(approval, csrf_token=get_token(request),
                                                                   next_url=request.get_full_path())
        return super().change_view(request, object_id, form_url, extra_context=context)

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Approval | None:
        # A malformed id is simply not found (Django's admin then says so), never a 500.
        try:
            uuid.UUID(str(object_id))
        except ValueError:
            return None
        return super().get_object(request, object_id, from_field)


@admin.register(Message)
class MessageAdmin(_AuditAdmin):
    """Message search across every session (the model's changelist): ``?q=`` in web-search syntax
    (``selectors.message_search_all``), newest first, 50 per page, ``?before=<id>`` for older."""

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> HttpResponse:
        # Anything but an empty q is checked as given: whitespace only or too long shows the reason.
        q, error, page = request.GET.get("q", ""), "", None
        if q:
            try:
                page = selectors.message_search_all(q=selectors.search_text(q), before_id=_int_param(request, "before"))
            except selectors.InvalidSearch as exc:
                error = str(exc)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Search messages",
            "q": q,
            "search_error": error,
            "results": [(m, preview(m.content, 500)) for m in page.rows] if page else None,
            "older_before": page.older_before if page else None,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/hermes_sessions/message/search.html", context)
