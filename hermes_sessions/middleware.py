"""Request hygiene that applies to every URL (API and admin)."""
from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest


class RejectNulMiddleware:
    """Answer 400 to any request whose path, query string, header or cookie carries a NUL byte.

    No id, filter, cursor, token or session key of ours can contain NUL, and PostgreSQL refuses NUL in
    text (psycopg raises ``ValueError`` → a 500 deep inside whatever view got it: an admin list
    filter, the token lookup of ``Authorization``, the session lookup of the ``sessionid`` cookie).
    gunicorn refuses NUL in headers itself; runserver and other servers pass it through. Refusing
    the class here keeps every view from needing its own guard.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        query = request.META.get("QUERY_STRING", "")
        if "\x00" in request.path or "%00" in query or "\x00" in query:
            return HttpResponseBadRequest("NUL bytes are not allowed in URLs.", content_type="text/plain")
        headers = (value for key, value in request.META.items() if key.startswith("HTTP_") and isinstance(value, str))
        # Cookie values are checked after parsing too: a quoted cookie carries NUL as the escape "\000".
        if any("\x00" in value for value in headers) or any("\x00" in value for value in request.COOKIES.values()):
            return HttpResponseBadRequest("NUL bytes are not allowed in headers or cookies.", content_type="text/plain")
        return self.get_response(request)
