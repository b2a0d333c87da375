"""Fixtures shared by the end-to-end tests (real codex binary, real Celery workers)."""
import pytest

from devtools.model_stand_in import ModelStandIn


@pytest.fixture
def stand_in():
    """The offline model stand-in, running for the test (codex's model provider)."""
    with ModelStandIn() as server:
        yield server
