"""A client generated from the live schema runs the seed scenario: openapi-python-client (pinned in
requirements.txt) writes a Python package from ``GET /api/schema/`` into a temporary directory (never
committed), and that package — nothing else — drives the live app: create a session, three turns
through the real pinned codex binary with the model stand-in (start, resume, and a rotation after the
thread's rollout is lost), then the notice, the turns list and the transcript. Every answer is parsed
into the generated models with ``raise_on_unexpected_status``, so an undocumented status or a value
the schema does not allow (a queued turn's ``thread_action`` was ``""``, outside its enum) fails here.

Turns run eagerly inside the live server's request (as in the demo), so the 202 of each POST still
shows the turn queued — ``thread_action`` null — and the next GET shows it finished.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from rest_framework.authtoken.models import Token

from hermes_sessions.services.rollouts import rollout_forget
from tests.factories import UserFactory
from tests.support.real_codex import use_real_codex

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

GENERATOR = Path(sys.executable).parent / "openapi-python-client"
PACKAGE = "hermes_generated_client"
NOTICE = "Codex thread could not be resumed; starting a new one."


@pytest.fixture
def generated(django_db_setup, live_server, tmp_path) -> Iterator[ModuleType]:
    """The client package generated from the live schema, importable for the test. (The test
    database is set up before the live server, so the server stops before the database is dropped.)"""
    with urllib.request.urlopen(f"{live_server.url}/api/schema/?format=json") as response:
        (tmp_path / "schema.json").write_bytes(response.read())
    # No post hooks: the generator would otherwise run ruff over its output (not needed to import it).
    (tmp_path / "config.json").write_text(json.dumps({"post_hooks": [], "package_name_override": PACKAGE}))
    run = subprocess.run(
        [str(GENERATOR), "generate", "--path", str(tmp_path / "schema.json"), "--meta", "none",
         "--output-path", str(tmp_path / "client" / PACKAGE), "--config", str(tmp_path / "config.json"),
         "--fail-on-warning"],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    sys.path.insert(0, str(tmp_path / "client"))
    try:
        yield importlib.import_module(PACKAGE)
    finally:
        sys.path.remove(str(tmp_path / "client"))
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def _api(package: str) -> Any:
    return importlib.import_module(f"{PACKAGE}.api.{package}")


def _models() -> Any:
    return importlib.import_module(f"{PACKAGE}.models")


def _turn(client: Any, session_id: str, text: str) -> Any:
    """POST an input through the generated client, then GET the turn until it ends; returns the parsed Turn."""
    models = _models()
    posted = _api("sessions.sessions_turns_create").sync_detailed(session_id, client=client, body=models.TurnCreate(input_=text))
    assert posted.status_code == 202
    assert (posted.parsed.status, posted.parsed.thread_action) == (models.StatusEnum.QUEUED, None)
    deadline = time.monotonic() + 90
    while True:
        turn = _api("turns.turns_retrieve").sync(posted.parsed.id, client=client)
        if turn.status not in (models.StatusEnum.QUEUED, models.StatusEnum.RUNNING):
            return turn
        assert time.monotonic() < deadline, f"turn stuck: {turn}"
        time.sleep(0.1)


def test_the_seed_scenario_through_a_client_generated_from_the_schema(
    generated, live_server, stand_in, real_codex_bin, codex_dirs, settings
):
    use_real_codex(settings, codex_bin=real_codex_bin, stand_in=stand_in)
    key = Token.objects.create(user=UserFactory()).key
    # Closed at the end: a kept-alive HTTP connection would keep a live-server thread, and its
    # database connection, open past the test.
    with generated.AuthenticatedClient(base_url=live_server.url, token=key, prefix="Token", timeout=120.0,
                                       raise_on_unexpected_status=True) as client:
        _seed_scenario(client)


def _seed_scenario(client: Any) -> None:
    models = _models()
    action = models.ThreadActionEnum

    created = _api("sessions.sessions_create").sync_detailed(client=client, body=models.SessionCreate(id="sess-client", title=""))
    assert created.status_code == 201 and created.parsed.id == "sess-client" and created.parsed.codex_thread_id is None

    t1 = _turn(client, "sess-client", "hello one")
    assert (t1.status, t1.thread_action, t1.final_text) == (models.StatusEnum.SUCCEEDED, action.STARTED, "echo: hello one"), t1.error
    t2 = _turn(client, "sess-client", "hello two")
    assert (t2.status, t2.thread_action, t2.codex_thread_id) == (models.StatusEnum.SUCCEEDED, action.RESUMED, t1.codex_thread_id)

    # The thread's rollout is lost (PostgreSQL, which each turn's codex home is made from, no longer
    # has it): codex answers "no rollout found" and the turn rotates (docs/contract.md §3).
    assert rollout_forget(thread_id=t1.codex_thread_id) == 1
    t3 = _turn(client, "sess-client", "hello three")
    assert (t3.status, t3.thread_action) == (models.StatusEnum.SUCCEEDED, action.ROTATED), t3.error
    assert t3.codex_thread_id != t1.codex_thread_id
    # The fresh thread is not amnesic: its first input carried the history seed, which the stand-in echoes.
    assert t3.final_text.startswith("echo: ") and t3.final_text.endswith("[CURRENT USER TURN]\nhello three")
    assert "[USER]\nhello one" in t3.final_text and "[ASSISTANT]\necho: hello two" in t3.final_text

    session = _api("sessions.sessions_retrieve").sync("sess-client", client=client)
    assert session.codex_thread_id == t3.codex_thread_id and session.turn_count == 3
    notices = _api("sessions.sessions_notices_list").sync("sess-client", client=client)
    assert notices.count == 1 and [n.text for n in notices.results] == [NOTICE]
    assert notices.results[0].turn == t3.id
    turns = _api("sessions.sessions_turns_list").sync("sess-client", client=client)
    assert [(t.seq, t.thread_action) for t in turns.results] == [(3, action.ROTATED), (2, action.RESUMED), (1, action.STARTED)]
    transcript = _api("sessions.sessions_messages_list").sync("sess-client", client=client)
    assert [(m.role.value, m.content) for m in transcript.results] == [
        ("user", "hello one"), ("assistant", "echo: hello one"),
        ("user", "hello two"), ("assistant", "echo: hello two"),
        ("user", "hello three"), ("assistant", t3.final_text),
    ]

    # Errors parse into the documented error models too.
    finished = _api("turns.turns_cancel_create").sync_detailed(t3.id, client=client)
    assert finished.status_code == 409 and finished.parsed.code == "turn_finished"
    assert finished.parsed.turn.thread_action == action.ROTATED
    missing = _api("turns.turns_retrieve").sync_detailed(uuid.uuid4(), client=client)
    assert missing.status_code == 404 and missing.parsed.code == "not_found"
    refused = _api("sessions.sessions_turns_create").sync_detailed("sess-client", client=client, body=models.TurnCreate(input_=" "))
    assert refused.status_code == 400 and refused.parsed.code == "invalid" and refused.parsed.errors["input"]

