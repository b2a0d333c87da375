import pytest


@pytest.fixture
def state_dir(tmp_path):
    """The scripted app-server's state directory (rollouts, methods.jsonl, script.json)."""
    path = tmp_path / "state"
    path.mkdir()
    return path
