"""A staff-only sandbox is checked when a turn runs, not only when its session was made: a session made
with ``danger-full-access`` by staff runs under ``workspace-write`` once its owner is no longer staff."""
from __future__ import annotations

import pytest

from hermes_sessions import services
from tests.factories import SessionFactory, UserFactory
from tests.support.dispatch import hold_dispatches

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("staff", "active", "sandbox"), [
    (True, True, "danger-full-access"),
    (False, True, "workspace-write"),
    (True, False, "workspace-write"),
])
def test_a_staff_only_sandbox_needs_active_staff_at_each_claim(monkeypatch, staff, active, sandbox):
    hold_dispatches(monkeypatch)
    owner = UserFactory(is_staff=True)
    session = SessionFactory(owner=owner, model_config={"sandbox": "danger-full-access"})
    turn = services.turn_enqueue(session=session, input_text="hi", user=owner)
    type(owner).objects.filter(pk=owner.pk).update(is_staff=staff, is_active=active)
    claim = services.turn_claim(turn_id=turn.pk)
    assert claim is not None and claim.config["sandbox"] == sandbox
