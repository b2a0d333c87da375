"""Codex runs on the worker's host: what the model's commands can see and touch (real codex 0.169.0).

The model stand-in answers ``RUNCMD <cmd>`` with a shell tool call, so these tests make real codex
run real commands in its sandbox, through the real task code (eager, in-process).
"""
import uuid
from pathlib import Path

import pytest

from devtools.model_stand_in import ModelStandIn
from hermes_sessions import services
from hermes_sessions.models import Message, Turn
from tests.support.real_codex import use_real_codex

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def real_codex(codex_dirs, settings, real_codex_bin, monkeypatch):
    with ModelStandIn() as stand_in:
        use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
        monkeypatch.setenv("DATABASE_URL", "postgres://u:S3CR3T-DB@db/x")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3CR3T-AWS")
        yield stand_in


def tool_output(session) -> str:
    return "\n".join(Message.objects.filter(session=session, role="tool").values_list("content", flat=True))


def test_commands_see_no_secrets_not_even_the_provider_key(user, real_codex, run_turn_now):
    session = services.session_create(owner=user)
    turn = run_turn_now(session=session, text="RUNCMD env", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    seen = tool_output(session) + turn.final_text
    assert "PATH=" in seen  # the command really ran and printed its environment
    for secret in ("S3CR3T", "HERMES_STAND_IN_API_KEY", "DATABASE_URL", "CELERY_BROKER_URL"):
        assert secret not in seen


def test_workspace_write_cannot_write_outside_the_session_directory(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user, model_config={"sandbox": "workspace-write"})
    escape = Path("/tmp") / f"hermes-escape-{uuid.uuid4().hex}"
    inside = f"inside-{uuid.uuid4().hex}"
    turn = run_turn_now(session=session, text=f"RUNCMD touch {inside} {escape}; ls", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert (Path(settings.CODEX_WORK_ROOT) / session.id / inside).exists()  # its own directory: writable
    assert not escape.exists()  # /tmp, shared with everything else on the host: not


def test_read_only_sandbox_writes_nothing(user, real_codex, run_turn_now, settings):
    session = services.session_create(owner=user)  # default policy: read-only, approvals declined
    name = f"nope-{uuid.uuid4().hex}"
    turn = run_turn_now(session=session, text=f"RUNCMD touch {name}", user=user)
    assert turn.status == Turn.Status.SUCCEEDED, turn.error
    assert not (Path(settings.CODEX_WORK_ROOT) / session.id / name).exists()
