"""Request hygiene that applies to every URL (API and admin)."""
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest


class RejectNulMiddleware:
    """Answer 400 to any request whose path or query string carries a NUL byte.

    No id, filter or cursor of ours can contain NUL, and PostgreSQL refuses NUL in text (psycopg
    raises ``ValueError`` → a 500 deep inside whatever view got it, e.g. an admin list filter).
    Refusing the class here keeps every view from needing its own guard.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if "\x00" in request.path or "%00" in request.META.get("QUERY_STRING", "") or "\x00" in request.META.get("QUERY_STRING", ""):
            return HttpResponseBadRequest("NUL bytes are not allowed in URLs.", content_type="text/plain")
        return self.get_response(request)
