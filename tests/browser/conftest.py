"""Fixtures of the browser tests: one headless Debian Chromium for the run (``driver.py``), the live
server (pytest-django's ``live_server``, a real HTTP server on the test database, so tests are
``transaction=True``), a staff operator, a tab on the admin (``pages.AdminUI``) and its screenshots,
kept under ``var/screenshots/<test name>/`` (gitignored) and listed in the test output.

A turn run from the admin's *Run a turn* form needs nothing more: the suite's tasks are eager, so
the live server's thread runs it through the worker code on whatever codex the test chose
(``scripted_codex`` sets the settings for every thread; ``tests/e2e`` shows a real worker with the
real binary), and the test reloads the session page until it shows the turn finished. A test that
wants a turn to stay queued holds the sends (``tests/support/dispatch.py``)."""
from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.conf import settings

from tests.support.rotation import RotatedSession, make_rotated_session

from .driver import BrowserThread
from .pages import AdminUI, Screenshots

SCREENSHOT_ROOT = Path(settings.BASE_DIR) / "var" / "screenshots"
OPERATOR_PASSWORD = "operator-pw"


def report(config: pytest.Config, line: str) -> None:
    """Write ``line`` to the terminal now (outside pytest's capture), so it shows even when the test
    passes: the browser's version, the screenshots' paths."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    capture = config.pluginmanager.getplugin("capturemanager")
    if reporter is None or capture is None:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    # Keep each phase's report on the item, so fixtures can tell in teardown that the test failed.
    report_ = yield
    setattr(item, f"report_{report_.when}", report_)
    return report_


@pytest.fixture(scope="session")
def browser_thread(request: pytest.FixtureRequest) -> Iterator[BrowserThread]:
    """Debian's Chromium, headless, started once per run; fails (never skips) when it is missing."""
    try:
        driver = BrowserThread()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    report(request.config, driver.describe())
    yield driver
    driver.close()


@pytest.fixture
def screenshots(request: pytest.FixtureRequest) -> Iterator[Screenshots]:
    directory = SCREENSHOT_ROOT / re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    shots = Screenshots(directory)
    yield shots
    for path in shots.taken:
        report(request.config, f"screenshot: {path}")


@pytest.fixture
def operator(django_user_model: Any) -> Any:
    """A staff superuser ``operator`` with password ``OPERATOR_PASSWORD``."""
    return django_user_model.objects.create_superuser("operator", "operator@example.com", OPERATOR_PASSWORD)


@pytest.fixture
def admin_ui(browser_thread: BrowserThread, live_server: Any, screenshots: Screenshots,
             request: pytest.FixtureRequest) -> Iterator[AdminUI]:
    """A fresh browser tab (its own cookies) on the live server's admin; on failure the page as it
    was is kept as a last screenshot."""
    ui = AdminUI(browser_thread, live_server.url, screenshots)
    yield ui
    failed = getattr(request.node, "report_call", None)
    if failed is not None and failed.failed:
        ui.shot("failure")
    ui.close()


@pytest.fixture
def rotated(user: Any, scripted_codex: Any, run_turn_now: Any) -> RotatedSession:
    """A session of ``alice`` that went through a rotation, made by the real task code on the
    scripted app-server (``tests/support/rotation.py``)."""
    return make_rotated_session(owner=user, run_turn_now=run_turn_now, scripted_codex=scripted_codex,
                                session_id="sess-browser-rotated", title="Rotated in the browser test")
