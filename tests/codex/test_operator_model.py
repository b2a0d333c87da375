"""The operator's default model reaches existing sessions (docs/operating.md §3, "What follows the
operator"): every ``turn/start`` that carries overrides names the session's own ``model`` or else the
current ``CODEX_MODEL``; ``thread/resume`` stays bare (the wire sequence before ``turn/start`` is
``["thread/resume"]``). With the real binary and the provider's view: ``tests/e2e/test_operator_settings.py``."""
from __future__ import annotations

import pytest

from hermes_sessions import services
from hermes_sessions.models import Turn

pytestmark = pytest.mark.django_db


def _sent(scripted_codex, method: str) -> list[dict]:
    return [c["params"] for c in scripted_codex.calls() if c["method"] == method]


def test_a_session_without_a_model_follows_codex_model_on_its_next_turn(scripted_codex, settings, user, run_turn_now):
    settings.CODEX_MODEL = "model-a"
    session = services.session_create(owner=user)
    first = run_turn_now(session=session, text="one", user=user)
    settings.CODEX_MODEL = "model-b"  # the operator changed it (a restarted worker reads it so)
    second = run_turn_now(session=session, text="two", user=user)
    assert (first.status, second.status) == (Turn.Status.SUCCEEDED, Turn.Status.SUCCEEDED), (first.error, second.error)
    assert second.thread_action == "resumed" and second.codex_methods == ["thread/resume"]
    assert [p["model"] for p in _sent(scripted_codex, "turn/start")] == ["model-a", "model-b"]
    assert _sent(scripted_codex, "thread/start")[0]["model"] == "model-a"
    assert all("model" not in p for p in _sent(scripted_codex, "thread/resume"))


def test_a_session_with_its_own_model_keeps_it(scripted_codex, settings, user, run_turn_now):
    settings.CODEX_MODEL = "model-a"
    session = services.session_create(owner=user, model_config={"model": "own-model"})
    run_turn_now(session=session, text="one", user=user)
    settings.CODEX_MODEL = "model-b"
    run_turn_now(session=session, text="two", user=user)
    assert [p["model"] for p in _sent(scripted_codex, "turn/start")] == ["own-model", "own-model"]


def test_with_the_operators_config_toml_its_model_is_the_default(scripted_codex, settings, tmp_path, user, run_turn_now):
    config = tmp_path / "config.toml"
    config.write_text('model = "from-toml"\n')
    settings.CODEX_MODEL_PROVIDER, settings.CODEX_CONFIG_TOML = "config", str(config)
    session = services.session_create(owner=user)
    run_turn_now(session=session, text="one", user=user)
    config.write_text("# no model: codex's own default\n")
    run_turn_now(session=session, text="two", user=user)
    starts = _sent(scripted_codex, "turn/start")
    assert starts[0]["model"] == "from-toml" and "model" not in starts[1]
