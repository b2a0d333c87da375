"""Fixtures shared by the API tests: a user, an authenticated client, and a dispatch recorder."""
import pytest
from rest_framework.test import APIClient

from tests.factories import UserFactory
from tests.support.dispatch import hold_dispatches


@pytest.fixture
def user():
    return UserFactory()


@pytest.fixture
def client(user):
    api = APIClient()
    api.force_authenticate(user)
    return api


@pytest.fixture
def dispatched(monkeypatch):
    """Record run_turn dispatches instead of running codex; returns the list of turn ids sent."""
    return hold_dispatches(monkeypatch)
