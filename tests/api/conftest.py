"""Fixtures shared by the API tests: a user, an authenticated client, and a dispatch recorder."""
import pytest
from rest_framework.test import APIClient

from hermes_sessions import tasks
from tests.factories import UserFactory


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
    sent: list[str] = []

    def record(*args, **kwargs):
        task_args = kwargs.get("args") if "args" in kwargs else (args[0] if args else [])
        sent.append(str(task_args[0]))

    monkeypatch.setattr(tasks.run_turn, "apply_async", record)
    return sent
