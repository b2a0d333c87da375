"""Token authentication (DRF's ``TokenAuthentication``, ``Authorization: Token <key>``): what the API answers
for a good, an unknown, a revoked and an inactive user's token."""
from __future__ import annotations

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

pytestmark = pytest.mark.django_db


def _get(key: str):
    return APIClient().get("/api/sessions/", HTTP_AUTHORIZATION=f"Token {key}")


def test_a_valid_token_authenticates_its_user(user):
    token = Token.objects.create(user=user)
    response = _get(token.key)
    assert response.status_code == 200, response.content
    assert response.wsgi_request.user == user


@pytest.mark.parametrize("key", ["0" * 40, "x" * 500, "'OR'1'='1"])
def test_an_unknown_key_is_a_401_with_drfs_body_and_challenge(user, key):
    Token.objects.create(user=user)
    response = _get(key)
    assert response.status_code == 401
    assert response.json() == {"detail": "Invalid token.", "code": "authentication_failed"}
    assert response["WWW-Authenticate"] == "Token"


def test_a_token_that_is_not_utf8_is_a_401_not_a_500(user):
    """A server hands header bytes over as latin-1 (WSGI and ASGI alike): ``é`` sent as UTF-8 arrives as ``Ã©``,
    a lone ``\xe9`` byte as ``é``, which DRF cannot decode as UTF-8."""
    Token.objects.create(user=user)
    response = _get("\u00e9\u00ff")
    assert response.status_code == 401 and response.json()["code"] == "authentication_failed"
    assert response["WWW-Authenticate"] == "Token"


def test_a_nul_byte_in_the_token_is_a_400_not_a_500(user):
    """PostgreSQL refuses NUL in text; ``RejectNulMiddleware`` answers before the token is looked up."""
    Token.objects.create(user=user)
    response = _get("abc\x00def")
    assert response.status_code == 400 and response.json()["code"] == "bad_request"


def test_a_revoked_token_stops_working_at_once(user):
    token = Token.objects.create(user=user)
    assert _get(token.key).status_code == 200
    token.delete()
    response = _get(token.key)
    assert response.status_code == 401 and response.json()["detail"] == "Invalid token."


def test_an_inactive_users_token_is_refused(user):
    token = Token.objects.create(user=user)
    user.is_active = False
    user.save(update_fields=["is_active"])
    response = _get(token.key)
    assert response.status_code == 401 and response.json()["detail"] == "User inactive or deleted."


def test_no_credentials_is_a_401_not_authenticated():
    response = APIClient().get("/api/sessions/")
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated" and response["WWW-Authenticate"] == "Token"
