"""Root URLs: the landing page, the admin, the REST API under /api/, the OpenAPI schema, /metrics, and
the unauthenticated probes ``/healthz`` and ``/readyz`` (``hermes_sessions/health.py``).

The ``handler…`` views answer JSON under ``/api/`` (``hermes_sessions/api/handlers.py``)."""
from django.contrib import admin
from django.urls import include, path
from django.views.generic import TemplateView
from drf_spectacular.views import SpectacularAPIView

from hermes_sessions import health
from hermes_sessions.api.schema import ApiDocsView
from hermes_sessions.metrics.views import MetricsView

urlpatterns = [
    path("", TemplateView.as_view(template_name="landing.html"), name="landing"),
    path("admin/", admin.site.urls),
    path("healthz", health.healthz, name="healthz"),
    path("readyz", health.readyz, name="readyz"),
    path("api/", include("hermes_sessions.api.urls")),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", ApiDocsView.as_view(url_name="schema"), name="api-docs"),
    path("metrics", MetricsView.as_view(), name="metrics"),  # Prometheus (hermes_sessions/metrics/views.py)
]

handler400 = "hermes_sessions.api.handlers.bad_request"
handler403 = "hermes_sessions.api.handlers.permission_denied"
handler404 = "hermes_sessions.api.handlers.page_not_found"
handler500 = "hermes_sessions.api.handlers.server_error"
