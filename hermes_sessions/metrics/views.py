"""``GET /metrics``: every hermes metric in Prometheus's text format (version 0.0.4), for staff and for
the addresses an operator allows.

Who may read it (``MetricsAccess``): a client whose address (``REMOTE_ADDR``) is in one of the networks
of ``HERMES_METRICS_ALLOW``, or a staff user (a DRF token, ``Authorization: Token <key>``, or an admin
session). Anyone else gets the API's JSON errors: 401 without credentials (``WWW-Authenticate: Token``),
403 with a user who is not staff; a database that cannot answer is 503 (``api/errors.py``). Behind a
reverse proxy on the same host every request comes from the proxy's address: allow 127.0.0.1 only when
no proxy forwards outside traffic to the API.
"""
from __future__ import annotations

import functools
import ipaddress
from typing import Any

from django.conf import settings
from django.http import HttpResponse
from drf_spectacular.utils import extend_schema
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from rest_framework.negotiation import BaseContentNegotiation
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.views import APIView

from ..api.renderers import SafeJSONRenderer
from .collector import HermesCollector

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@functools.cache
def _allowed_networks(spec: tuple[str, ...]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(item, strict=False) for item in spec)


def address_allowed(address: str | None) -> bool:
    """Whether ``address`` (an IP, as ``REMOTE_ADDR`` gives it) is in ``HERMES_METRICS_ALLOW``."""
    if not address:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in _allowed_networks(tuple(settings.HERMES_METRICS_ALLOW)))


class MetricsAccess(BasePermission):
    message = ("Metrics are for staff users (a staff user's token or admin session) and for the addresses in "
               "HERMES_METRICS_ALLOW.")

    def has_permission(self, request: Request, view: Any) -> bool:
        if address_allowed(request.META.get("REMOTE_ADDR")):
            return True
        user = request.user
        return bool(user and user.is_authenticated and user.is_staff)


class _FirstRenderer(BaseContentNegotiation):
    """The body is the text format whatever ``Accept`` says (Prometheus asks for OpenMetrics first and
    takes text/plain); errors are JSON."""

    def select_parser(self, request: Request, parsers: Any) -> Any:
        return parsers[0] if parsers else None

    def select_renderer(self, request: Request, renderers: Any, format_suffix: str | None = None) -> Any:
        return renderers[0], renderers[0].media_type


@extend_schema(exclude=True)  # for Prometheus, not for API clients: not in the API's schema
class MetricsView(APIView):
    """Every hermes metric (``hermes_sessions/metrics/families.py``), computed at the request."""

    permission_classes = [MetricsAccess]
    renderer_classes = [SafeJSONRenderer]
    content_negotiation_class = _FirstRenderer

    def get(self, request: Request) -> HttpResponse:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(HermesCollector())
        return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_PLAIN_0_0_4)
