"""API routes (mounted under ``/api/``).

Session ids are matched loosely (``[^/]+``) and checked by the selectors, so that every unknown
or malformed id is the API's JSON 404 rather than the URL resolver's HTML one. Ids such as
``sess-codex-restart`` or ``a.b:c`` route as they are. A path no route matches is answered by
``api.handlers.page_not_found`` (JSON 404). ``GET /api/`` lists these routes (``api.routes``).
"""
from django.urls import path

from . import streams, views

app_name = "api"

urlpatterns = [
    path("", views.ApiRootView.as_view(), name="root"),
    path("sessions/", views.SessionListCreateView.as_view(), name="session-list"),
    path("sessions/<str:session_id>/", views.SessionDetailView.as_view(), name="session-detail"),
    path("sessions/<str:session_id>/turns/", views.TurnListCreateView.as_view(), name="session-turns"),
    path("sessions/<str:session_id>/messages/", views.MessageListView.as_view(), name="session-messages"),
    path("sessions/<str:session_id>/notices/", views.NoticeListView.as_view(), name="session-notices"),
    path("sessions/<str:session_id>/approvals/", views.ApprovalListView.as_view(), name="session-approvals"),
    path("approvals/<str:approval_id>/", views.ApprovalDetailView.as_view(), name="approval-detail"),
    path("approvals/<str:approval_id>/decision/", views.ApprovalDecisionView.as_view(), name="approval-decision"),
    path("messages/", views.MessageSearchView.as_view(), name="message-search"),
    path("webhooks/", views.WebhookListCreateView.as_view(), name="webhook-list"),
    path("webhooks/<str:webhook_id>/", views.WebhookDetailView.as_view(), name="webhook-detail"),
    path("webhooks/<str:webhook_id>/deliveries/", views.WebhookDeliveryListView.as_view(), name="webhook-deliveries"),
    path("turns/<str:turn_id>/", views.TurnDetailView.as_view(), name="turn-detail"),
    path("turns/<str:turn_id>/cancel/", views.TurnCancelView.as_view(), name="turn-cancel"),
    # Server-sent events (async views; docs/contract.md §8). Schema: api/schema.py's hook.
    path("turns/<str:turn_id>/events/", streams.turn_events, name="turn-events"),
    path("sessions/<str:session_id>/events/", streams.session_events, name="session-events"),
]
