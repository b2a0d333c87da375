"""deploy/: the systemd units and their EnvironmentFile example (docs/operating.md "Running under systemd").

Each unit is checked by ``systemd-analyze verify`` with its install path (/opt/hermes_sessions) and
EnvironmentFile pointed at this checkout, so the commands it runs must exist in this checkout's .venv;
and for the keys a warm shutdown, a restart and the queues depend on.
"""
from __future__ import annotations

import configparser
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from hermes_sessions.tasks import run_turn

BASE = Path(__file__).resolve().parent.parent
UNITS = BASE / "deploy" / "systemd"
ENV_EXAMPLE = BASE / "deploy" / "hermes.env.example"
README = (BASE / "README.md").read_text()
OPERATING = (BASE / "docs" / "operating.md").read_text()
UNIT_NAMES = ["hermes-api.service", "hermes-worker@.service", "hermes-beat.service", "hermes-stand-in.service"]


def unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string((UNITS / name).read_text())
    return parser


def exec_start(name: str) -> list[str]:
    return unit(name)["Service"]["ExecStart"].split()


def env_example() -> dict[str, str]:
    pairs = (line.split("=", 1) for line in ENV_EXAMPLE.read_text().splitlines()
             if line.strip() and not line.startswith("#"))
    return {k: v for k, v in pairs}


def test_the_units_are_all_there():
    assert sorted(p.name for p in UNITS.iterdir()) == sorted(UNIT_NAMES)


def test_systemd_accepts_every_unit_and_finds_its_commands(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is needed (Debian: systemd)"
    paths = []
    for name in UNIT_NAMES:
        text = (UNITS / name).read_text().replace("/etc/hermes_sessions/hermes.env", str(ENV_EXAMPLE))
        text = text.replace("/opt/hermes_sessions", str(BASE))
        target = tmp_path / name.replace("@.service", "@1.service")  # a template is verified as an instance
        target.write_text(text)
        paths.append(str(target))
    result = subprocess.run([analyze, "verify", *paths], capture_output=True, text=True, timeout=120)
    # Unknown keys and missing commands are reported on stderr; nothing may be reported.
    own = [ln for ln in (result.stdout + result.stderr).splitlines() if str(tmp_path) in ln or "hermes" in ln]
    assert result.returncode == 0 and own == [], result.stdout + result.stderr


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_every_unit_restarts_runs_as_the_service_user_and_reads_the_environment_file(name):
    service = unit(name)["Service"]
    assert service["Restart"] == "always"
    assert service["User"] == "hermes" and service["WorkingDirectory"] == "/opt/hermes_sessions"
    assert service["EnvironmentFile"] == "/etc/hermes_sessions/hermes.env"
    argv = exec_start(name)
    assert argv[0].startswith("/opt/hermes_sessions/.venv/bin/")
    assert (BASE / ".venv" / "bin" / Path(argv[0]).name).exists()
    # every ${VAR} the command line uses is given in the EnvironmentFile example
    used = set(re.findall(r"\$\{([A-Z0-9_]+)\}", " ".join(argv)))
    assert used <= set(env_example()), used - set(env_example())


def test_the_api_runs_the_asgi_app_on_uvicorn_workers():
    argv = exec_start("hermes-api.service")
    assert Path(argv[0]).name == "gunicorn" and argv[1] == "project.asgi:application"
    assert argv[argv.index("-k") + 1] == "uvicorn_worker.UvicornWorker"
    assert "--max-requests" not in argv  # recycling would cut open event streams
    # as make run: the connection pool with CONN_MAX_AGE 0 under ASGI (docs/architecture.md "Event streams")
    assert "DATABASE_POOL=1" in unit("hermes-api.service")["Service"]["Environment"]
    assert importlib.util.find_spec("project.asgi") and importlib.util.find_spec("uvicorn_worker")


def test_a_worker_stops_warm_and_outwaits_the_longest_turn():
    service = unit("hermes-worker@.service")["Service"]
    argv = exec_start("hermes-worker@.service")
    assert argv[1:5] == ["-A", "project", "worker", "-Q"]
    assert argv[5] == "${HERMES_TURN_QUEUE},celery"  # turns and the sweep (docs/operating.md "Rules for workers and queues")
    assert "-B" not in argv  # beat runs once, in hermes-beat.service
    assert "%i" in argv[argv.index("-n") + 1]  # each instance its own node name
    # SIGTERM to Celery's main process only: its warm shutdown waits for the running turns; the pool and
    # codex are killed only after TimeoutStopSec, which outlasts run_turn's hard time limit.
    assert service["KillMode"] == "mixed" and service.get("KillSignal", "SIGTERM") == "SIGTERM"
    assert int(service["TimeoutStopSec"]) > run_turn.time_limit


def test_a_worker_is_started_only_once_its_readiness_checks_pass():
    """``ExecStartPost`` runs ``manage.py health`` for this instance's node name (the one ``-n`` gives
    Celery), waiting less than systemd waits for the start."""
    service = unit("hermes-worker@.service")["Service"]
    argv = service["ExecStartPost"].split()
    assert argv[0] == "/opt/hermes_sessions/.venv/bin/python" and argv[1:3] == ["manage.py", "health"]
    assert argv[argv.index("--node") + 1] == exec_start("hermes-worker@.service")[-1].split()[-1]
    assert float(argv[argv.index("--wait") + 1]) < float(service["TimeoutStartSec"])
    assert importlib.util.find_spec("hermes_sessions.management.commands.health")


def test_beat_and_the_stand_in_run_what_make_runs():
    assert exec_start("hermes-beat.service")[1:4] == ["-A", "project", "beat"]
    argv = exec_start("hermes-stand-in.service")
    assert argv[1:3] == ["-m", "devtools.model_stand_in"] and argv[argv.index("--port") + 1] == "${STAND_IN_PORT}"
    assert importlib.util.find_spec("devtools.model_stand_in")


def test_the_environment_file_example_names_only_documented_variables():
    table = OPERATING.split("## 3. Settings (environment)", 1)[1].split("\n## ", 1)[0]
    commented = set(re.findall(r"^# ([A-Z][A-Z0-9_]+)=", ENV_EXAMPLE.read_text(), re.M))
    missing = sorted(n for n in set(env_example()) | commented if f"`{n}`" not in table)
    assert missing == [], f"docs/operating.md 'Settings (environment)' lacks {missing}"
    assert "Running under systemd" in OPERATING and "deploy/systemd" in OPERATING
    assert "docs/operating.md" in README and "deploy/systemd" in README  # the README points an operator there
