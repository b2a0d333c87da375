"""Webhooks in the admin: endpoints (register, change, re-enable) and the outbox's deliveries with their
attempts (a read-only log; "Send again"). Every write goes through ``services.webhooks``; the secret of
an endpoint registered here is shown once, in the message after saving."""
from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from .. import services
from ..models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from ..services.webhooks import WebhookRefused, webhook_secret_check, webhook_url_check
from .records import _AuditAdmin


class WebhookEndpointForm(forms.ModelForm):
    """The URL and the secret checked as the API checks them (``services.webhooks``): a 400 there is a
    field error here."""

    url = forms.URLField(max_length=2000, assume_scheme="https")
    event_types = forms.MultipleChoiceField(choices=[(t, t) for t in WebhookEndpoint.EVENT_TYPES],
                                            widget=forms.CheckboxSelectMultiple)
    secret = forms.CharField(required=False, help_text="whsec_…; left empty, one is made and shown once after "
                             "saving. Only when registering.")

    class Meta:
        model = WebhookEndpoint
        fields = ("owner", "url", "event_types", "all_sessions", "active")

    def clean_url(self) -> str:
        try:
            return webhook_url_check(self.cleaned_data["url"])
        except WebhookRefused as exc:
            raise forms.ValidationError(str(exc)) from exc

    def clean_secret(self) -> str:
        secret = self.cleaned_data.get("secret") or ""
        try:
            return webhook_secret_check(secret) if secret else ""
        except WebhookRefused as exc:
            raise forms.ValidationError(str(exc)) from exc

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        owner = data.get("owner")
        if data.get("all_sessions") and owner is not None and not owner.is_staff:
            self.add_error("all_sessions", "all_sessions is for staff users only")
        return data


class WebhookAttemptInline(admin.TabularInline):
    """A delivery's HTTP attempts, read-only."""

    model = WebhookAttempt
    extra = 0
    can_delete = False
    fields = ("number", "started_at", "address", "status_code", "error", "duration_ms")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(WebhookEndpoint)
class WebhookEndpointAdmin(admin.ModelAdmin):
    """Webhook endpoints of every user; "Re-enable selected endpoints"."""

    form = WebhookEndpointForm
    list_display = ("id", "url", "owner", "event_list", "all_sessions", "active", "consecutive_failures",
                    "disabled_reason", "created_at")
    list_filter = ("active", "all_sessions")
    list_select_related = ("owner",)
    search_fields = ("url", "owner__username")
    readonly_fields = ("disabled_reason", "disabled_at", "consecutive_failures", "created_at", "updated_at")
    actions = ("enable_endpoints",)

    @admin.display(description="event types")
    def event_list(self, obj: WebhookEndpoint) -> str:
        return ", ".join(obj.event_types)

    def get_fields(self, request: HttpRequest, obj: Any = None) -> Any:
        if obj is None:
            return ["owner", "url", "event_types", "all_sessions", "secret"]
        return ["owner", "url", "event_types", "all_sessions", "active", *self.readonly_fields]

    def save_model(self, request: HttpRequest, obj: WebhookEndpoint, form: forms.ModelForm, change: bool) -> None:
        data = form.cleaned_data
        if change:
            saved = services.webhook_endpoint_update(
                endpoint=obj, user=data["owner"],
                changes={key: data[key] for key in ("url", "event_types", "all_sessions", "active")})
        else:
            saved = services.webhook_endpoint_create(owner=data["owner"], url=data["url"],
                                                     event_types=data["event_types"], secret=data.get("secret", ""),
                                                     all_sessions=data["all_sessions"])
            self.message_user(request, f"The endpoint's secret (shown this once): {saved.secret}", messages.WARNING)
        obj.pk, obj.secret = saved.pk, saved.secret

    @admin.action(description="Re-enable selected endpoints", permissions=["change"])
    def enable_endpoints(self, request: HttpRequest, queryset: QuerySet[WebhookEndpoint]) -> None:
        """``services.webhook_endpoint_enable`` of each: their waiting deliveries go out at the next round."""
        changed = sum(services.webhook_endpoint_enable(endpoint_id=pk) for pk in queryset.values_list("pk", flat=True))
        self.message_user(request, f"Re-enabled {changed} endpoint{'s' if changed != 1 else ''}.", messages.SUCCESS)


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(_AuditAdmin):
    """The outbox: one row per event and endpoint, with its attempts; "Send again"."""

    list_display = ("id", "event_type", "endpoint", "session_id", "status", "attempts", "last_status_code",
                    "next_attempt_at", "created_at")
    list_filter = ("status", "event_type")
    list_select_related = ("endpoint",)
    search_fields = ("webhook_id", "session_id", "endpoint__url")
    readonly_fields = [f.name for f in WebhookDelivery._meta.fields if f.name != "claim_token"]
    fields = tuple(readonly_fields)
    inlines = [WebhookAttemptInline]
    actions = ("send_again",)
    show_full_result_count = False

    @admin.action(description="Send again (same webhook-id)", permissions=["send_again"])
    def send_again(self, request: HttpRequest, queryset: QuerySet[WebhookDelivery]) -> None:
        """``services.webhook_delivery_send_again``: due now, sent at the next round."""
        changed = services.webhook_delivery_send_again(delivery_ids=list(queryset.values_list("pk", flat=True)))
        self.message_user(request, f"{changed} deliver{'ies' if changed != 1 else 'y'} will be sent again.",
                          messages.SUCCESS)

    def has_send_again_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("hermes_sessions.change_webhookdelivery")
