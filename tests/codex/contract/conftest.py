"""Session fixtures of the codex contract test: the pinned binary and the schema it generates."""
from __future__ import annotations

import pytest

from hermes_sessions.codex.launch import CodexNotInstalled, codex_binary

from .support import CodexSchema, generate_schema


@pytest.fixture(scope="session")
def pinned_codex() -> str:
    """The native binary, found the way workers find it; missing is a failure, never a skip."""
    try:
        return codex_binary()
    except CodexNotInstalled as exc:
        pytest.fail(f"the codex contract test needs the pinned binary: {exc}")


@pytest.fixture(scope="session")
def codex_schema(pinned_codex: str, tmp_path_factory: pytest.TempPathFactory) -> CodexSchema:
    """``codex app-server generate-json-schema`` of the pinned binary, loaded (about 0.2 s)."""
    return CodexSchema(generate_schema(pinned_codex, tmp_path_factory.mktemp("codex-schema")))
