"""The sessions list and the session page.

Sessions list: one query per page (annotated by ``selectors.session_admin_list``: active thread,
turns, unacknowledged notices, last activity), a "has unacknowledged notices" filter, and no count of
the whole table (``EstimatedCountPaginator``, ``show_full_result_count = False``).

Session page (view-only fields): the unacknowledged-notice banner with an acknowledge button, the
approvals its turns wait for (what codex asks, a button per offered decision: ``approvals.py``), token
totals, the SVG timeline (``timeline.py``), the run-a-turn form, the newest turns with a cancel
button, and the transcript newest first in keyset pages (``?before=<seq>``) with a search box
(``?q=``). A fixed number of queries whatever the transcript's length.

Operators create sessions here (``services.session_create``), run turns (``services.turn_enqueue``,
the API's service and queue), cancel them (``services.turn_cancel``), end bindings
(``services.binding_end``) and acknowledge notices (``services.notice_acknowledge``).
"""
from __future__ import annotations

import re
import uuid
from datetime import datetime
from typing import Any

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import quote, unquote
from django.db.models import QuerySet
from django.forms import ModelForm
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden, HttpResponseNotAllowed, HttpResponseRedirect
from django.middleware.csrf import get_token
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString

from .. import selectors, services
from ..models import Approval, CodexBinding, Notice, Session, Turn
from .approvals import approval_sections
from .forms import SessionCreateForm, TurnRunForm
from .pagination import EstimatedCountPaginator
from .rendering import transcript_rows, turn_rows
from .timeline import timeline_svg


class CodexBindingInline(admin.TabularInline):
    """Binding history (a handful of rows per session): which codex thread the session continued in,
    and why each one ended. View-only."""

    model = CodexBinding
    verbose_name = "codex binding"
    verbose_name_plural = "codex binding history"
    fields = ("thread_id", "status", "created_at", "ended_at", "ended_reason")
    readonly_fields = fields
    ordering = ("created_at", "id")
    extra = 0
    max_num = 0
    can_delete = False

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class UnacknowledgedNoticesFilter(admin.SimpleListFilter):
    """Sessions with (``yes``) or without (``no``) a notice waiting for an operator."""

    title = "unacknowledged notices"
    parameter_name = "unacknowledged"

    def lookups(self, request: HttpRequest, model_admin: Any) -> tuple[tuple[str, str], ...]:
        return (("yes", "Has unacknowledged notices"), ("no", "None waiting"))

    def queryset(self, request: HttpRequest, queryset: QuerySet[Session]) -> QuerySet[Session]:
        if self.value() in ("yes", "no"):
            return selectors.session_with_unacknowledged_notices(queryset, present=self.value() == "yes")
        return queryset


#: Pending approvals shown on a session page (a session's running turn asks one at a time; the list has the rest).
PAGE_APPROVALS = 20


def _int_param(request: HttpRequest, name: str) -> int | None:
    """A non-negative integer query parameter, or ``None`` when absent or not one (ignored, not a 500)."""
    value = request.GET.get(name, "")
    return int(value) if value.isdigit() and len(value) < 19 else None


@admin.register(Session)
class SessionAdmin(admin.ModelAdmin):
    """Sessions: list, create, and the session page where operators act on a session."""

    list_display = ("id", "owner", "title", "active_thread", "turns", "last_activity", "unacknowledged_notices")
    list_filter = (UnacknowledgedNoticesFilter, "created_at")
    search_fields = ("id", "title", "owner__username", "bindings__thread_id")
    ordering = ("-updated_at", "-id")  # index session_updated_id
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    # Rendering a changelist row costs ≈ 1 ms of Python (9 cells, the action checkbox): 50 rows keep the
    # list within its 150 ms budget on a busy 2-core machine (make bench-admin).
    list_per_page = 50
    raw_id_fields = ("owner",)
    form = SessionCreateForm
    view_fields = ("id", "owner", "title", "model_config", "active_thread", "last_message_seq", "last_turn_seq",
                   "created_at", "updated_at")
    inlines = (CodexBindingInline,)
    actions = ("end_codex_binding",)

    # --- list ---------------------------------------------------------------------------------------

    def get_queryset(self, request: HttpRequest) -> QuerySet[Session]:
        return selectors.session_admin_list()

    @admin.action(description="End the codex binding (the next turn starts a new, seeded thread)", permissions=["end_binding"])
    def end_codex_binding(self, request: HttpRequest, queryset: QuerySet[Session]) -> None:
        """The way out when codex can no longer read a thread but its error is not the one that
        rotates (e.g. a damaged rollout: -32603 "failed to read session metadata")."""
        ended = sum(services.binding_end(session=s, reason=f"ended by operator {request.user}") for s in queryset)
        self.message_user(request, f"Ended {ended} codex binding(s).", messages.SUCCESS)

    def action_checkbox(self, obj: Session) -> SafeString:
        """Django's row checkbox, written directly: rendering a ``CheckboxInput`` through the template
        engine cost ≈ 0.5 ms a row, half of the list's rendering (profiled under make bench-admin)."""
        return format_html(
            '<input type="checkbox" name="{}" value="{}" class="action-select" aria-label="Select this object for an action - {}">',
            helpers.ACTION_CHECKBOX_NAME, obj.pk, str(obj),
        )

    def has_end_binding_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("hermes_sessions.change_codexbinding")

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

    # --- rights: add (through the service) and view; fields are never edited, sessions never deleted here

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        # Deleting a session deletes its turns and notices (the audit trail) and, on a long session,
        # its delete-confirmation page would list every message.
        return False

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return ("id", "owner", "title", "model_config") if obj is None else self.view_fields

    def get_readonly_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        return () if obj is None else self.view_fields

    def get_inlines(self, request: HttpRequest, obj: Any) -> Any:
        return () if obj is None else self.inlines

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        return {"owner": request.user.pk, "model_config": {}}

    def get_object(self, request: HttpRequest, object_id: str, from_field: str | None = None) -> Session | None:
        # A malformed id (e.g. a newline, which no session id has) is simply not found.
        if from_field is None and not selectors.is_valid_session_id(object_id):
            return None
        return super().get_object(request, object_id, from_field)

    def changeform_view(
        self, request: HttpRequest, object_id: str | None = None, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """The add form answers a taken id with a form error, as the API answers 409
        ``session_id_taken`` (``docs/contract.md`` §9), even when another request inserts that id
        between the form's check and this insert: ``session_create`` then raises ``SessionIdTaken``
        (the other row committed), the admin's transaction is rolled back, and the form is checked
        once more — it now sees the row and shows "already taken". Before, that race was a 500."""
        try:
            return super().changeform_view(request, object_id, form_url, extra_context)
        except services.SessionIdTaken:
            if object_id is not None:
                raise
            return super().changeform_view(request, object_id, form_url, extra_context)

    def save_model(self, request: HttpRequest, obj: Session, form: ModelForm, change: bool) -> None:
        """Create the session through ``services.session_create`` (the form has checked id and policy;
        a concurrent insert of the same id raises ``SessionIdTaken``, see ``changeform_view``)."""
        data = form.cleaned_data
        created = services.session_create(
            owner=data["owner"], session_id=data.get("id") or None, title=data.get("title") or "",
            model_config=data.get("model_config") or {},
        )
        obj.pk, obj.model_config, obj.title = created.pk, created.model_config, created.title
        obj.created_at, obj.updated_at = created.created_at, created.updated_at

    def response_add(self, request: HttpRequest, obj: Session, post_url_continue: str | None = None) -> HttpResponse:
        self.message_user(request, f"Created session {obj.pk}.", messages.SUCCESS)
        return HttpResponseRedirect(_session_url(obj.pk))

    # --- the session page ---------------------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        own = [
            path("<path:object_id>/run-turn/", self.admin_site.admin_view(self.run_turn_view),
                 name="hermes_sessions_session_run_turn"),
            path("<path:object_id>/cancel-turn/", self.admin_site.admin_view(self.cancel_turn_view),
                 name="hermes_sessions_session_cancel_turn"),
            path("<path:object_id>/acknowledge-notices/", self.admin_site.admin_view(self.acknowledge_view),
                 name="hermes_sessions_session_acknowledge"),
        ]
        return own + super().get_urls()

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        """Add the banner, totals, timeline, turns, run form and transcript page to the context."""
        session_id = unquote(object_id)
        context = dict(extra_context or {})
        if selectors.is_valid_session_id(session_id):
            context.update(self._page_context(request, session_id))
        return super().change_view(request, object_id, form_url, extra_context=context)

    def _page_context(self, request: HttpRequest, session_id: str) -> dict[str, Any]:
        """What the session page shows beyond its fields: a fixed number of bounded queries."""
        q = request.GET.get("q", "")  # checked as given: whitespace only or too long shows the reason
        search_error = ""
        if q:
            try:
                q = selectors.search_text(q)
            except selectors.InvalidSearch as exc:
                search_error, q = str(exc), ""
        page = selectors.transcript_page(session_id=session_id, before_seq=_int_param(request, "before"), q=q)
        turns = selectors.session_page_turns(session_id=session_id)  # oldest first (the timeline); the table: newest first
        bindings = list(selectors.binding_list(session=Session(pk=session_id)))
        pending = list(selectors.approval_list(session=Session(pk=session_id), status=Approval.Status.PENDING)
                       [:PAGE_APPROVALS])
        return {
            "unacknowledged_notices": list(selectors.notice_list(session=Session(pk=session_id), unacknowledged_only=True)),
            "notice_session_id": session_id,
            "can_acknowledge": request.user.has_perm("hermes_sessions.change_notice"),
            "can_run_turn": request.user.has_perm("hermes_sessions.add_turn"),
            "can_cancel_turn": request.user.has_perm("hermes_sessions.change_turn"),
            "token_totals": selectors.session_token_totals(session_id=session_id),
            "timeline_svg": timeline_svg(turns=turns, bindings=bindings, now=timezone.now()),
            "page_turns": turns,
            "turn_rows": turn_rows(turns[::-1], csrf_token=get_token(request), cancel_url=reverse(
                "admin:hermes_sessions_session_cancel_turn", args=[quote(session_id)])
                if request.user.has_perm("hermes_sessions.change_turn") else None),
            "turn_form": TurnRunForm(),
            "turns_in_progress": sum(1 for t in turns if not t.is_terminal),
            "transcript": page.rows,
            "transcript_rows": transcript_rows(page.rows),
            "transcript_older": page.older_before,
            "transcript_q": q,
            "transcript_search_error": search_error,
            "transcript_paged": request.GET.get("before") is not None,
            "turns_list_url": reverse("admin:hermes_sessions_turn_changelist") + f"?session__id__exact={session_id}",
            "pending_approvals": approval_sections(pending, request=request),
            "approvals_list_url": reverse("admin:hermes_sessions_approval_changelist") + f"?session__id__exact={session_id}",
        }

    def _post_only(self, request: HttpRequest, object_id: str, perm: str) -> HttpResponse | Session:
        """The session named by ``object_id`` for a POST by a user holding ``perm``; else the refusal."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not request.user.has_perm(perm):
            return HttpResponseForbidden("You may not do this.")
        session = self.get_object(request, unquote(object_id))
        if session is None:
            self.message_user(request, f"No session with id {unquote(object_id)!r}.", messages.WARNING)
            return HttpResponseRedirect(reverse("admin:hermes_sessions_session_changelist"))
        return session

    def run_turn_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST: queue a turn on the session (``services.turn_enqueue``, as the API does) and go back
        to the session page, where its status shows; a bad input or a busy session is a message."""
        session = self._post_only(request, object_id, "hermes_sessions.add_turn")
        if not isinstance(session, Session):
            return session
        form = TurnRunForm(request.POST)
        if not form.is_valid():
            errors = "; ".join(f"{field}: {' '.join(str(e) for e in errs)}" for field, errs in form.errors.items())
            self.message_user(request, f"No turn queued: {errors}", messages.ERROR)
            return HttpResponseRedirect(_session_url(session.pk))
        try:
            turn = services.turn_enqueue(session=session, input_text=form.cleaned_data["input"], user=request.user,
                                         on_busy=form.cleaned_data["on_busy"])
        except services.ServiceError as exc:
            self.message_user(request, f"No turn queued: {exc}", messages.ERROR)
        else:
            self.message_user(request, f"Turn {turn.seq} queued ({turn.id}).", messages.SUCCESS)
        return HttpResponseRedirect(_session_url(session.pk))

    def cancel_turn_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST ``turn``: cancel that turn of the session (``services.turn_cancel``, as the API does)."""
        session = self._post_only(request, object_id, "hermes_sessions.change_turn")
        if not isinstance(session, Session):
            return session
        turn_id = _uuid_or_none(request.POST.get("turn"))
        turn = Turn.objects.filter(session=session, pk=turn_id).first() if turn_id else None
        if turn is None:
            self.message_user(request, "No such turn in this session.", messages.ERROR)
        elif turn.is_terminal:
            self.message_user(request, f"Turn {turn.seq} already {turn.status}; nothing to cancel.", messages.WARNING)
        else:
            turn = services.turn_cancel(turn=turn)
            state = "cancelled" if turn.status == Turn.Status.CANCELLED else "asked to stop (turn/interrupt)"
            self.message_user(request, f"Turn {turn.seq} {state}.", messages.SUCCESS)
        return HttpResponseRedirect(_session_url(session.pk))

    def acknowledge_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """POST ``notice`` (one or more ids; none at all = every unacknowledged notice of the session):
        acknowledge them (notices: ``docs/contract.md`` §1, the rotation notice of §3). A
        value that is not an id, or the id of no notice of this session, refuses the whole request
        with a message and acknowledges nothing — never "all of them" for a bad id."""
        session = self._post_only(request, object_id, "hermes_sessions.change_notice")
        if not isinstance(session, Session):
            return session
        notices = Notice.objects.filter(session=session, acknowledged_at__isnull=True)
        given = request.POST.getlist("notice")
        if given:
            bad = [v for v in given if not _NOTICE_ID.fullmatch(v)]
            ids = {int(v) for v in given if v not in bad}
            unknown = sorted(ids - set(Notice.objects.filter(session=session, pk__in=ids).values_list("pk", flat=True)))
            if bad or unknown:
                what = f"{bad[0][:40]!r} is not a notice id" if bad else f"no notice {unknown[0]} in this session"
                self.message_user(request, f"No notice acknowledged: {what}.", messages.ERROR)
                return HttpResponseRedirect(_session_url(session.pk))
            notices = notices.filter(pk__in=ids)
        changed = services.notice_acknowledge(notices=notices, user=request.user)
        self.message_user(request, f"Acknowledged {changed} notice{'s' if changed != 1 else ''}.", messages.SUCCESS)
        return HttpResponseRedirect(_session_url(session.pk))


#: A notice id as the form posts it: ASCII digits, within a bigint (not ``str.isdigit``: "²" is a digit).
_NOTICE_ID = re.compile(r"[0-9]{1,18}")


def _session_url(session_id: str) -> str:
    return reverse("admin:hermes_sessions_session_change", args=[quote(session_id)])


def _uuid_or_none(value: Any) -> str | None:
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        return None
