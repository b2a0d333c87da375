"""The Makefile as an operator meets it: every variable it reads is in docs/operating.md's
settings section, `make worker` follows HERMES_TURN_QUEUE, and `make demo-admin` serves the demo's own
database even when DATABASE_URL is exported."""
from __future__ import annotations

import http.cookiejar
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

BASE = Path(__file__).resolve().parent.parent
MAKEFILE = (BASE / "Makefile").read_text()
OPERATING = (BASE / "docs" / "operating.md").read_text()
SETTINGS_SECTION = OPERATING.split("## 3. Settings (environment)", 1)[1].split("\n## ", 1)[0]


def make_n(*args: str, env: dict[str, str] | None = None) -> str:
    """What `make -n` would run (prerequisites `install` taken as made)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("HERMES_TURN_QUEUE", "MAKEFLAGS", "MFLAGS")}
    result = subprocess.run(["make", "-n", "-o", "install", *args], cwd=BASE, env={**full_env, **(env or {})},
                            capture_output=True, text=True, timeout=60, check=True)
    return result.stdout


def test_every_variable_the_makefile_reads_is_in_the_settings_section():
    internal = set(re.findall(r"^([A-Z_]+) :=", MAKEFILE, re.M))  # VENV, PY: not for the operator
    read = set(re.findall(r"\$\(([A-Z][A-Z0-9_]*)\)", MAKEFILE)) | set(re.findall(r"\$\((?:or|strip) \$\(([A-Z_]+)", MAKEFILE))
    assert {"HERMES_TURN_QUEUE", "STAND_IN_PORT", "HTTP_BIND"} <= read  # the patterns still find them
    missing = sorted(name for name in read - internal if f"`{name}`" not in SETTINGS_SECTION)
    assert missing == [], f"docs/operating.md 'Settings (environment)' lacks the Makefile's {missing}"


def settings_default_turn_queue() -> str:
    code = "import project.settings as s; print(s.HERMES_TURN_QUEUE)"
    env = {"PATH": "/usr/bin:/bin", "HERMES_VAR_DIR": "/nonexistent-var"}
    return subprocess.run([sys.executable, "-c", code], cwd=BASE, env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def worker_queues(command: str) -> str:
    [line] = [line for line in command.splitlines() if " worker " in line]
    return re.search(r" -Q (\S+) ", line).group(1)


def test_make_worker_consumes_the_settings_turn_queue_and_celery():
    assert worker_queues(make_n("worker")) == f"{settings_default_turn_queue()},celery"
    assert worker_queues(make_n("worker", env={"HERMES_TURN_QUEUE": ""})) == "turns,celery"  # empty: the default, as settings
    assert worker_queues(make_n("worker", env={"HERMES_TURN_QUEUE": "turns-eu"})) == "turns-eu,celery"
    assert worker_queues(make_n("worker", "HERMES_TURN_QUEUE=turns-us")) == "turns-us,celery"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _demo_database(env: dict[str, str]) -> None:
    """The demo's database as `make demo` leaves it (the embedded PostgreSQL, migrated, with user demo/demo),
    without codex."""
    code = ("import django; django.setup(); from django.core.management import call_command; "
            "call_command('migrate', verbosity=0); from django.contrib.auth.models import User; "
            "User.objects.create_superuser('demo', 'demo@example.com', 'demo')")
    subprocess.run([sys.executable, "-c", code], cwd=BASE, env={k: v for k, v in env.items() if k != "DATABASE_URL"},
                   check=True, timeout=120, capture_output=True)


def _login(base: str) -> tuple[int, str]:
    """Log in to the admin as demo/demo; returns (status, final URL)."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    page = opener.open(f"{base}/admin/login/", timeout=10).read().decode()
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
    data = urllib.parse.urlencode({"csrfmiddlewaretoken": token, "username": "demo", "password": "demo",
                                   "next": "/admin/"}).encode()
    request = urllib.request.Request(f"{base}/admin/login/", data=data, headers={"Referer": f"{base}/admin/login/"})
    with opener.open(request, timeout=10) as resp:
        return resp.status, resp.geturl()


def test_make_demo_admin_serves_the_demo_database_even_with_database_url_exported(tmp_path):
    port = _free_port()
    env = {**{k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "CELERY_BROKER_URL")},
           "HERMES_VAR_DIR": str(tmp_path / "var"), "DJANGO_SETTINGS_MODULE": "project.settings",
           # the production shape's database, exported in this shell: unreachable on purpose
           "DATABASE_URL": "postgres://nobody@127.0.0.1:1/not-the-demo", "DJANGO_SECRET_KEY": "k" * 50}
    _demo_database(env)
    log = tmp_path / "demo-admin.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(["make", "-o", "install", "demo-admin", f"HTTP_BIND=127.0.0.1:{port}"], cwd=BASE,
                                env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                status, url = _login(base)
                break
            except OSError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.3)
        assert (status, url) == (200, f"{base}/admin/"), log.read_text()  # logged in: the demo's user exists there
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        # SIGTERM ends runserver without its exit handlers, so its embedded PostgreSQL still runs: a process
        # that joins and leaves is the last one and stops it (project/embedded_postgres).
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from project.embedded_postgres "
                        "import server; server(Path(sys.argv[1]))", str(tmp_path / "var" / "postgres")],
                       cwd=BASE, check=True, timeout=60, capture_output=True)
        proc.wait(timeout=20)
