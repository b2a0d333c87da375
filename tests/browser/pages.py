"""Page helpers for the Django admin, as an operator uses it: each method is one step a person
takes (open a page, read what it shows, click an action), run on the browser thread, returning plain
data for the test to assert on; ``shot(name)`` keeps a screenshot of the page as it is.

Adding a step for new admin features (notice count on the index, the session banner's timeline,
transcript search, running or cancelling a turn) means adding a method here that finds the element by
its id or label and returns what it shows; the fixtures in ``conftest.py`` stay as they are.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote as urlquote

from django.contrib.admin.utils import quote
from playwright.sync_api import BrowserContext, Locator, Page, expect

from .driver import ACTION_TIMEOUT_MS, BrowserThread

T = TypeVar("T")


class Screenshots:
    """Numbered PNGs of one test under ``directory``; ``taken`` lists their paths in order."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.taken: list[Path] = []

    def next_path(self, name: str) -> Path:
        path = self.directory / f"{len(self.taken) + 1:02d}-{name}.png"
        self.taken.append(path)
        return path


class AdminUI:
    """One operator's browser tab on the admin at ``base_url`` (the live server)."""

    def __init__(self, driver: BrowserThread, base_url: str, screenshots: Screenshots):
        self.driver = driver
        self.base_url = base_url.rstrip("/")
        self.screenshots = screenshots
        self._context: BrowserContext | None = None
        self._page: Page | None = None
        driver.call(self._open)

    def _open(self) -> None:
        self._context = self.driver.browser.new_context(viewport={"width": 1400, "height": 1000})
        self._context.set_default_timeout(ACTION_TIMEOUT_MS)
        self._page = self._context.new_page()

    def _on_page(self, fn: Callable[[Page], T]) -> T:
        def run() -> T:
            assert self._page is not None
            return fn(self._page)

        return self.driver.call(run)

    def close(self) -> None:
        def close() -> None:
            if self._context is not None:
                self._context.close()

        self.driver.call(close)

    # --- steps -----------------------------------------------------------------------------------

    def shot(self, name: str) -> Path:
        """Save a full-page screenshot of what the tab shows now; returns its path."""
        path = self.screenshots.next_path(name)
        self._on_page(lambda page: page.screenshot(path=str(path), full_page=True))
        return path

    def log_in(self, username: str, password: str) -> str:
        """Log in through the admin's login form; returns the page heading (the admin index's)."""
        def run(page: Page) -> str:
            page.goto(f"{self.base_url}/admin/login/?next=/admin/")
            page.fill("#id_username", username)
            page.fill("#id_password", password)
            page.click("input[type=submit]")
            expect(page.locator("#content h1")).to_have_text("Site administration")
            return page.locator("#content h1").inner_text()

        return self._on_page(run)

    def login_error(self, username: str, password: str) -> str:
        """Try to log in and return the form's error text (a refused login stays on the form)."""
        def run(page: Page) -> str:
            page.goto(f"{self.base_url}/admin/login/?next=/admin/")
            page.fill("#id_username", username)
            page.fill("#id_password", password)
            page.click("input[type=submit]")
            return page.locator(".errornote").inner_text()

        return self._on_page(run)

    def sessions_list(self) -> dict[str, dict[str, str]]:
        """Open the sessions list; returns ``{session id: {column: cell text}}`` for each row, columns
        by the admin's field names (``id``, ``active_thread``, ``unacknowledged_notices``, …)."""
        def run(page: Page) -> dict[str, dict[str, str]]:
            page.goto(f"{self.base_url}/admin/hermes_sessions/session/")
            expect(page.locator("#result_list")).to_be_visible()
            rows = [_cells(row) for row in page.locator("#result_list tbody tr").all()]
            return {row["id"]: row for row in rows}

        return self._on_page(run)

    def open_session(self, session_id: str, *, from_list: bool = True) -> dict[str, Any]:
        """Open a session's page (by clicking its id in the list, as an operator would, or by URL);
        returns ``{"title", "notices": [banner texts], "bindings": [{column: text}]}``."""
        def run(page: Page) -> dict[str, Any]:
            if from_list:
                page.click(f"#result_list a:text-is('{session_id}')")
            else:
                page.goto(f"{self.base_url}/admin/hermes_sessions/session/{urlquote(quote(session_id))}/change/")
            expect(page.locator("#content h1")).to_be_visible()
            return {
                "title": page.locator("#content h1").inner_text(),
                "notices": [t.strip() for t in page.locator("#session-notices .notice-text").all_inner_texts()],
                "bindings": _inline_rows(page, "bindings-group"),
            }

        return self._on_page(run)

    def follow_notices_link(self) -> list[str]:
        """On a session page, follow the banner's "Review and acknowledge these notices" link; returns
        the texts of the notices listed there."""
        def run(page: Page) -> list[str]:
            page.click("#session-notices a:text('Review and acknowledge these notices')")
            expect(page.locator("#result_list")).to_be_visible()
            return [t.strip() for t in page.locator("#result_list tbody td.field-text").all_inner_texts()]

        return self._on_page(run)

    def acknowledge_all_listed_notices(self) -> str:
        """On the notices list, select every row, run "Acknowledge selected notices"; returns the
        success message the admin shows."""
        def run(page: Page) -> str:
            page.check("#action-toggle")
            page.select_option("select[name=action]", "acknowledge_notices")
            page.click("button[name=index]")
            message = page.locator("ul.messagelist li.success")
            expect(message).to_be_visible()
            return message.inner_text()

        return self._on_page(run)

    def api_post(self, path: str, body: dict[str, Any], *, token: str) -> tuple[int, Any]:
        """POST JSON to the live server's REST API as the token's user (DRF tries the token first, so
        this tab's admin login does not interfere); returns ``(status, parsed body)``."""
        def run(page: Page) -> tuple[int, Any]:
            response = page.request.post(f"{self.base_url}{path}", data=body,
                                         headers={"Authorization": f"Token {token}"})
            return response.status, response.json()

        return self._on_page(run)

    def wait_for_turn(self, session_id: str, seq: int, *, status: str, timeout_s: float = 30.0) -> dict[str, str]:
        """Watch the Turns list (searched by session id, reloaded every half second) until turn
        ``seq`` of the session shows ``status`` (as the admin labels it, e.g. ``Succeeded``); returns
        its row ``{field: text}``. Raises ``AssertionError`` with the last row seen after ``timeout_s``."""
        def run(page: Page) -> dict[str, str]:
            deadline = time.monotonic() + timeout_s
            row: dict[str, str] = {}
            while True:
                page.goto(f"{self.base_url}/admin/hermes_sessions/turn/?q={urlquote(session_id)}")
                rows = [_cells(r) for r in page.locator("#result_list tbody tr").all()]
                row = next((r for r in rows if r.get("seq") == str(seq)), {})
                if row.get("status") == status or time.monotonic() > deadline:
                    break
                page.wait_for_timeout(500)
            assert row.get("status") == status, f"turn {seq} of {session_id} did not reach {status}: {row}"
            return row

        return self._on_page(run)

    def transcript(self, session_id: str) -> list[dict[str, str]]:
        """Open the session's page by URL; returns its transcript rows ``{field: text}`` in order."""
        def run(page: Page) -> list[dict[str, str]]:
            page.goto(f"{self.base_url}/admin/hermes_sessions/session/{urlquote(quote(session_id))}/change/")
            return _inline_rows(page, "messages-group")

        return self._on_page(run)


# The admin marks each cell with its field: ``<td class="field-<name>">`` (``th`` for a list's link column).
_CELLS_JS = """row => Object.fromEntries([...row.querySelectorAll('th, td')]
    .map(cell => [[...cell.classList].find(c => c.startsWith('field-')), cell.innerText.trim()])
    .filter(([name]) => name).map(([name, text]) => [name.slice(6), text]))"""


def _cells(row: Locator) -> dict[str, str]:
    return dict(row.evaluate(_CELLS_JS))


def _inline_rows(page: Page, group_id: str) -> list[dict[str, str]]:
    """Rows of the tabular inline ``#<group_id>`` (e.g. ``bindings-group``) as ``{field: cell text}``."""
    return [_cells(row) for row in page.locator(f"#{group_id} tbody tr.has_original").all()]
