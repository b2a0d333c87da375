"""Shared fixtures. The suite runs on PostgreSQL (``DATABASE_URL``); see docs/development.md."""
import pytest
from django.conf import settings


def pytest_configure(config):
    # The suite runs on DATABASE_URL's PostgreSQL, never on the demo's embedded one (var/postgres).
    if not settings.DATABASE_URL:
        raise pytest.UsageError(
            "The test suite needs PostgreSQL: set DATABASE_URL=postgres://… (make test does this)."
        )
    # Tasks run in the test process unless a test starts a real worker (tests/e2e flips this).
    from project.celery import app

    app.conf.task_always_eager = True


import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

SCRIPTED_APP_SERVER = Path(__file__).parent / "codex" / "scripted_app_server.py"
REAL_CODEX_GLOB = "node_modules/@openai/codex-linux-*/vendor/*/bin/codex"


@pytest.fixture
def codex_dirs(tmp_path, settings):
    """Per-test homes root, legacy CODEX_HOME, HOME and work root (absolute, as codex requires)."""
    settings.CODEX_HOMES_ROOT = tmp_path / "homes"
    settings.CODEX_HOME = tmp_path / "codex_home"
    settings.CODEX_USER_HOME = tmp_path / "codex_user_home"
    settings.CODEX_WORK_ROOT = tmp_path / "work"
    return tmp_path


class ScriptedCodex:
    """Handle on the scripted app-server stand-in (tests/codex/scripted_app_server.py)."""

    def __init__(self, state: Path):
        self.state = state
        state.mkdir(parents=True, exist_ok=True)

    def script(self, actions: dict) -> None:
        """Fault script: ``{method: [action, …]}`` (see the stand-in's docstring)."""
        (self.state / "script.json").write_text(json.dumps(actions))

    def calls(self) -> list[dict]:
        path = self.state / "methods.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def argvs(self) -> list[list[str]]:
        """Each app-server process's command-line arguments, in spawn order."""
        path = self.state / "argv.jsonl"
        if not path.exists():
            return []
        return [json.loads(line)["argv"] for line in path.read_text().splitlines() if line.strip()]

    def processes(self) -> list[list[str]]:
        """Request methods grouped per app-server process, in spawn order."""
        groups: dict[int, list[str]] = {}
        for call in self.calls():
            groups.setdefault(call["pid"], []).append(call["method"])
        return list(groups.values())

    def turn_inputs(self) -> list[str]:
        return [
            "".join(part.get("text", "") for part in c["params"]["input"])
            for c in self.calls()
            if c["method"] == "turn/start"
        ]

    def remove_rollout(self, thread_id: str) -> None:
        """The thread's rollout is lost: gone from PostgreSQL (each turn's home is made from it)."""
        from hermes_sessions.services.rollouts import rollout_forget

        assert rollout_forget(thread_id=thread_id) == 1


@pytest.fixture
def scripted_codex(codex_dirs, settings) -> ScriptedCodex:
    """Point the worker code at the scripted app-server stand-in instead of the real binary."""
    state = codex_dirs / "scripted"
    settings.CODEX_APP_SERVER_COMMAND = json.dumps(
        ["/usr/bin/env", f"SCRIPTED_STATE_DIR={state}", sys.executable, str(SCRIPTED_APP_SERVER)]
    )
    settings.CODEX_REQUEST_TIMEOUT = 5.0
    settings.CODEX_TURN_TIMEOUT = 10.0
    return ScriptedCodex(state)


@pytest.fixture
def real_codex_bin(settings) -> str:
    """The pinned native codex binary; the suite fails (not skips) without it — run `make install`."""
    found = sorted(Path(settings.BASE_DIR).glob(REAL_CODEX_GLOB))
    assert found, f"codex binary missing ({REAL_CODEX_GLOB}); run `make install`"
    return str(found[0])


@pytest.fixture
def user(django_user_model):
    return django_user_model.objects.create_user(username="alice", password="pw")


@pytest.fixture
def run_turn_now(django_capture_on_commit_callbacks):
    """Enqueue a turn and run the real task code for it (and any turn it dispatches) in-process."""
    from hermes_sessions import services

    def run(*, session, text, user):
        with django_capture_on_commit_callbacks(execute=True):
            turn = services.turn_enqueue(session=session, input_text=text, user=user)
        turn.refresh_from_db()
        return turn

    return run



@pytest.fixture
def redis_broker(tmp_path: Path):
    """A private redis-server of the test's own (``devtools.faults.brokers.RedisBroker``), stopped after."""
    from devtools.faults.brokers import RedisBroker

    broker = RedisBroker(tmp_path, tmp_path)
    broker.start({"PATH": "/usr/bin:/bin:/usr/sbin:/usr/local/bin"})
    yield broker
    broker.stop()


@pytest.fixture(autouse=True)
def _no_sweep_loop_left():
    """A test that starts a worker process's sweep loop (``recovery.SweepLoop``) in the test process must
    stop it: a leaked one takes back other tests' running turns and dispatches their queued ones."""
    yield
    from hermes_sessions.worker import process, recovery

    leaked = process.runtime().sweep
    if leaked is not None:
        recovery.sweep_loop_stop()
        pytest.fail(f"the test left a sweep loop running ({leaked.by})")


@pytest.fixture(autouse=True)
def _fresh_turn_permits(monkeypatch):
    """Each test gets this process's turn permits made anew (``wake.turn_slots``, from
    ``HERMES_WORKER_TURNS`` as the test sets it): a permit another test left taken must not make this one
    busy."""
    from hermes_sessions.worker import process

    monkeypatch.setattr(process.runtime(), "slots", None)


@pytest.fixture(autouse=True)
def _no_runners_left(monkeypatch):
    """Each test starts without this process's runner threads (``worker/runners.py``: outside a worker
    process turns run on the caller's thread), and runners a test started are stopped after it: a pool
    left behind would make a later test's woken turn run detached, its end not yet written when it looks."""
    from hermes_sessions.worker import process

    rt = process.runtime()
    monkeypatch.setattr(rt, "runners", None)
    yield
    left = rt.runners
    if left is not None:
        left.stop(timeout=10)
