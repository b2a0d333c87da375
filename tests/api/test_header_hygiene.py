"""NUL bytes in headers and cookies are a 400, never a 500 (I6): PostgreSQL refuses NUL in text, and the
token and session lookups would otherwise pass it straight into a query. (Under runserver; gunicorn
refuses such headers itself.)"""
import pytest
from django.test import Client
from rest_framework.authtoken.models import Token

from hermes_sessions.models import Session


@pytest.mark.django_db
def test_nul_in_the_authorization_header_is_400(user):
    Token.objects.create(user=user)
    response = Client(raise_request_exception=False).get("/api/sessions/", HTTP_AUTHORIZATION="Token abc\x00def")
    assert response.status_code == 400
    assert b"NUL" in response.content


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/sessions/", "/admin/"])
def test_nul_in_the_session_cookie_is_400(path):
    client = Client(raise_request_exception=False)
    client.cookies["sessionid"] = "abcdefghij\x00klmnop"
    assert client.get(path).status_code == 400


@pytest.mark.django_db
def test_nul_in_any_other_header_is_400_and_creates_nothing(user):
    token = Token.objects.create(user=user)
    response = Client(raise_request_exception=False).post(
        "/api/sessions/", {"title": "t"}, content_type="application/json",
        HTTP_AUTHORIZATION=f"Token {token.key}", HTTP_X_TRACE="a\x00b",
    )
    assert response.status_code == 400
    assert not Session.objects.exists()
