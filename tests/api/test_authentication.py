"""api/authentication.py: DRF's token authentication with its read prepared — the same answers as DRF's
own ``TokenAuthentication`` (users, errors, messages), in one statement that PostgreSQL prepares."""
from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from hermes_sessions.api.authentication import PreparedTokenAuthentication

pytestmark = pytest.mark.django_db


def test_a_token_gives_the_same_user_and_token_as_drfs_read(user):
    token = Token.objects.create(user=user)
    with CaptureQueriesContext(connection) as captured:
        got_user, got_token = PreparedTokenAuthentication().authenticate_credentials(token.key)
    drf_user, drf_token = TokenAuthentication().authenticate_credentials(token.key)
    assert len(captured) == 1
    assert (got_user, got_token) == (drf_user, drf_token)
    fields = [f.attname for f in type(user)._meta.concrete_fields]
    assert [getattr(got_user, f) for f in fields] == [getattr(drf_user, f) for f in fields]
    assert got_token.created == drf_token.created and got_token.user is got_user
    assert got_user.is_authenticated and not got_user._state.adding and got_user._state.db == "default"


@pytest.mark.parametrize("key", ["0" * 40, "", "x" * 500, "abc\x00def", "' OR 1=1 --", "\u00e9\U0001f600"])
def test_an_unknown_key_is_drfs_invalid_token(user, key):
    Token.objects.create(user=user)
    with pytest.raises(exceptions.AuthenticationFailed) as caught:
        PreparedTokenAuthentication().authenticate_credentials(key)
    assert str(caught.value.detail) == "Invalid token."


def test_an_inactive_users_token_is_refused_as_drf_refuses_it(user):
    token = Token.objects.create(user=user)
    user.is_active = False
    user.save(update_fields=["is_active"])
    with pytest.raises(exceptions.AuthenticationFailed) as caught:
        PreparedTokenAuthentication().authenticate_credentials(token.key)
    assert str(caught.value.detail) == "User inactive or deleted."


def test_the_api_answers_401_with_drfs_body_and_challenge_for_a_bad_token(user):
    response = APIClient().get("/api/sessions/", HTTP_AUTHORIZATION="Token " + "f" * 40)
    assert response.status_code == 401
    assert response.json()["detail"] == "Invalid token."
    assert response["WWW-Authenticate"] == "Token"


def test_a_deleted_token_stops_working_at_once(user):
    token = Token.objects.create(user=user)
    client = APIClient()
    assert client.get("/api/sessions/", HTTP_AUTHORIZATION=f"Token {token.key}").status_code == 200
    token.delete()
    assert client.get("/api/sessions/", HTTP_AUTHORIZATION=f"Token {token.key}").status_code == 401


def test_the_read_is_prepared_by_postgresql_after_the_threshold(user, settings):
    """Server-side binding, the same text each time: psycopg prepares it after DATABASE_PREPARE_THRESHOLD runs."""
    settings.DATABASE_PREPARE_THRESHOLD = 2
    token = Token.objects.create(user=user)
    for _ in range(4):
        PreparedTokenAuthentication().authenticate_credentials(token.key)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_prepared_statements WHERE statement LIKE %s",
                       ["%authtoken_token%"])
        assert cursor.fetchone()[0] == 1
