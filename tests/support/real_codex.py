"""Running the worker code on the real pinned codex binary with the model stand-in as its model."""
from __future__ import annotations

from typing import Any

from devtools.model_stand_in import ModelStandIn


def use_real_codex(settings: Any, *, codex_bin: str, stand_in: ModelStandIn, turn_timeout: float = 60) -> None:
    """Point ``hermes_sessions.codex.launch`` (through pytest-django's ``settings``) at ``codex_bin``,
    with ``stand_in`` as the model provider and ``turn_timeout`` seconds per turn."""
    settings.CODEX_APP_SERVER_COMMAND = ""
    settings.CODEX_BIN = codex_bin
    settings.CODEX_MODEL_PROVIDER = "stand-in"
    settings.CODEX_STAND_IN_URL = stand_in.base_url
    settings.CODEX_TURN_TIMEOUT = turn_timeout
