"""Page helpers for the Django admin, as an operator uses it: each method is one step a person
takes (open a page, read what it shows, click an action), run on the browser thread, returning plain
data for the test to assert on; ``shot(name)`` keeps a screenshot of the page as it is.

The session page is read whole by ``_session_page`` (banner, binding history, timeline, turns,
transcript) after each step that lands on it, by the page's stable ids (docs/operating.md "The admin"); a new
step is a method here that finds its element by id or label and returns what the page then shows.
The fixtures in ``conftest.py`` stay as they are.
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

    def index(self) -> dict[str, Any]:
        """Open the admin index; returns ``{"heading", "notice_count", "approval_count"}``
        (``#unacknowledged-notice-count`` and ``#pending-approval-count`` as numbers)."""
        def run(page: Page) -> dict[str, Any]:
            page.goto(f"{self.base_url}/admin/")
            return _index(page)

        return self._on_page(run)

    def wait_for_pending_approvals(self, count: int, *, timeout_s: float = 60.0) -> dict[str, Any]:
        """Reload the admin index (every half second, at most ``timeout_s``) until its pending-approvals
        count reads ``count``; returns the index (``index``). Raises ``AssertionError`` with the count last seen."""
        def run(page: Page) -> dict[str, Any]:
            deadline = time.monotonic() + timeout_s
            while True:
                page.goto(f"{self.base_url}/admin/")
                shown = _index(page)
                if shown["approval_count"] == count:
                    return shown
                assert time.monotonic() < deadline, f"the index shows {shown['approval_count']} pending approvals, not {count}"
                page.wait_for_timeout(500)

        return self._on_page(run)

    def open_pending_approvals(self) -> dict[str, Any]:
        """On the admin index, click the pending-approvals count; returns the list it opens (``approvals_list``)."""
        def run(page: Page) -> dict[str, Any]:
            page.click("#pending-approvals-link")
            return _approvals_list(page)

        return self._on_page(run)

    def open_approval_from_list(self, text: str) -> dict[str, Any]:
        """On the approvals list, open the approval whose request reads ``text`` (its kind is the row's
        link); returns its page: ``{"heading", "command", "cwd", "diff", "buttons"}`` (``#approval-decision``)."""
        def run(page: Page) -> dict[str, Any]:
            row = page.locator("#result_list tbody tr").filter(has=page.locator(".field-request_preview", has_text=text))
            row.locator("th a, td a").first.click()
            box = page.locator("#approval-decision")
            expect(box).to_be_visible()
            return {"heading": box.locator("h2").inner_text(), "command": _texts(box.locator(".approval-command")),
                    "cwd": _texts(box.locator(".approval-cwd")), "diff": _texts(box.locator("pre.approval-diff")),
                    "buttons": _texts(box.locator("button.approval-decision"))}

        return self._on_page(run)

    def back(self) -> None:
        """The browser's Back button."""
        self._on_page(lambda page: page.go_back())

    def decide_in_list(self, text: str, label: str) -> dict[str, Any]:
        """On the approvals list, press the decision button ``label`` (e.g. "Accept") in the row whose
        request reads ``text``; returns the list the admin comes back to (its ``messages`` say what happened)."""
        def run(page: Page) -> dict[str, Any]:
            row = page.locator("#result_list tbody tr").filter(has=page.locator(".field-request_preview", has_text=text))
            row.get_by_role("button", name=label, exact=True).click()
            expect(page.locator("ul.messagelist li").first).to_be_visible()
            return _approvals_list(page)

        return self._on_page(run)

    def wait_for_session_approval(self, session_id: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
        """Open the session's page and reload it (every half second, at most ``timeout_s``) until its
        *Waiting for a decision* section shows an approval; returns the page (``session_page``)."""
        def run(page: Page) -> dict[str, Any]:
            deadline = time.monotonic() + timeout_s
            page.goto(self._session_url(session_id))
            while True:
                shown = _session_page(page)
                if shown["approvals"]:
                    return shown
                assert time.monotonic() < deadline, f"session {session_id} shows no pending approval in {timeout_s} s"
                page.wait_for_timeout(500)
                page.reload()

        return self._on_page(run)

    def decide_on_session_page(self, label: str) -> dict[str, Any]:
        """On a session page, press the decision button ``label`` of its (first) pending approval; returns
        the session page the admin comes back to."""
        def run(page: Page) -> dict[str, Any]:
            page.locator("#session-approvals .pending-approval").first.get_by_role("button", name=label, exact=True).click()
            expect(page.locator("ul.messagelist li").first).to_be_visible()
            return _session_page(page)

        return self._on_page(run)

    def sessions_list(self, *, filter_label: str | None = None) -> dict[str, dict[str, str]]:
        """Open the sessions list (and, given ``filter_label``, click that choice in the filter sidebar,
        e.g. "Has unacknowledged notices"); returns ``{session id: {column: cell text}}`` for each row,
        columns by the admin's field names (``id``, ``active_thread``, ``unacknowledged_notices``, …)."""
        def run(page: Page) -> dict[str, dict[str, str]]:
            page.goto(f"{self.base_url}/admin/hermes_sessions/session/")
            if filter_label is not None:
                page.locator("#changelist-filter").get_by_role("link", name=filter_label, exact=True).click()
                expect(page.locator("#changelist-filter li.selected").get_by_text(filter_label, exact=True)).to_be_visible()
            expect(page.locator("#result_list")).to_be_visible()
            rows = [_cells(row) for row in page.locator("#result_list tbody tr").all()]
            return {row["id"]: row for row in rows}

        return self._on_page(run)

    def open_session(self, session_id: str, *, from_list: bool = True) -> dict[str, Any]:
        """Open a session's page (by clicking its id in the list on screen, as an operator would, or by
        URL); returns what it shows (``session_page``)."""
        def run(page: Page) -> dict[str, Any]:
            if from_list:
                page.click(f"#result_list a:text-is('{session_id}')")
            else:
                page.goto(self._session_url(session_id))
            return _session_page(page)

        return self._on_page(run)

    def session_page(self) -> dict[str, Any]:
        """What the session page on screen shows (see ``_session_page``), without reloading it."""
        return self._on_page(_session_page)

    def acknowledge_notice(self, text: str) -> dict[str, Any]:
        """On a session page, click *Acknowledge* next to the banner's notice reading ``text``; returns
        the page it comes back to (``messages`` holds the admin's success line)."""
        def run(page: Page) -> dict[str, Any]:
            item = page.locator("#session-notices li").filter(has=page.locator(".notice-text", has_text=text))
            item.locator(".acknowledge-notice").click()
            expect(page.locator("ul.messagelist li.success")).to_be_visible()
            return _session_page(page)

        return self._on_page(run)

    def search_transcript(self, words: str) -> dict[str, Any]:
        """On a session page, type ``words`` in the transcript's search box and submit; returns the
        page shown (``transcript`` holds the matching rows, ``transcript_empty`` the empty table's text)."""
        def run(page: Page) -> dict[str, Any]:
            page.fill("#transcript-q", words)
            page.locator("#transcript-search button[type=submit]").click()
            expect(page.locator("#transcript-heading")).to_contain_text(f"matching “{words}”")
            return _session_page(page)

        return self._on_page(run)

    def submit_turn(self, text: str) -> dict[str, Any]:
        """On a session page, type ``text`` in *Run a turn* and submit; returns the page the admin
        comes back to (its ``messages`` say whether the turn was queued)."""
        def run(page: Page) -> dict[str, Any]:
            page.fill("#run-turn-form #id_input", text)
            page.click("#run-turn-submit")
            expect(page.locator("ul.messagelist li").first).to_be_visible()
            return _session_page(page)

        return self._on_page(run)

    def cancel_turn(self, seq: int) -> dict[str, Any]:
        """On a session page, click *Cancel* on turn ``seq``'s row; returns the page shown after."""
        def run(page: Page) -> dict[str, Any]:
            page.locator(f"#turn-{seq} .cancel-turn").click()
            expect(page.locator("ul.messagelist li").first).to_be_visible()
            return _session_page(page)

        return self._on_page(run)

    def wait_for_turn_on_page(self, seq: int, *, status: str, timeout_s: float = 20.0) -> dict[str, Any]:
        """Reload the session page on screen (every half second, at most ``timeout_s``) until turn
        ``seq``'s ``.turn-status`` reads ``status`` (e.g. ``succeeded``); returns the page. Raises
        ``AssertionError`` with the row last seen."""
        def run(page: Page) -> dict[str, Any]:
            deadline = time.monotonic() + timeout_s
            while True:
                shown = _session_page(page)
                row = next((t for t in shown["turns"] if t["seq"] == str(seq)), {})
                if row.get("status") == status:
                    return shown
                assert time.monotonic() < deadline, f"turn {seq} did not reach {status} in {timeout_s} s: {row}"
                page.wait_for_timeout(500)
                page.reload()

        return self._on_page(run)

    def _session_url(self, session_id: str) -> str:
        return f"{self.base_url}/admin/hermes_sessions/session/{urlquote(quote(session_id))}/change/"

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
        """Open the session's page by URL; returns its transcript's first page (newest first), each row
        ``{"seq", "role", "content"}``."""
        def run(page: Page) -> list[dict[str, str]]:
            page.goto(self._session_url(session_id))
            return list(_session_page(page)["transcript"])

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


def _texts(locator: Locator) -> list[str]:
    return [t.strip() for t in locator.all_inner_texts()]


def _table(page: Page, row_selector: str, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """Rows matching ``row_selector`` as ``{column: cell text}``, cells named by position."""
    rows: list[list[str]] = page.locator(row_selector).evaluate_all(
        "rows => rows.map(row => [...row.cells].map(cell => cell.innerText.trim()))")
    return [dict(zip(columns, cells, strict=False)) for cells in rows]


def _index(page: Page) -> dict[str, Any]:
    notices, approvals = page.locator("#unacknowledged-notice-count"), page.locator("#pending-approval-count")
    expect(notices).to_be_visible()
    return {"heading": page.locator("#content h1").inner_text(), "notice_count": int(notices.inner_text()),
            "approval_count": int(approvals.inner_text())}


def _approvals_list(page: Page) -> dict[str, Any]:
    """The approvals list on screen: ``{"messages", "rows"}``, each row ``{field: cell text}`` (``kind``,
    ``status``, ``session``, ``request_preview``, …) plus ``buttons``: the labels of its decision buttons."""
    expect(page.locator("#changelist")).to_be_visible()
    rows = []
    for row in page.locator("#result_list tbody tr").all():
        cells = _cells(row)
        cells["buttons"] = _texts(row.locator("button.approval-decision"))
        rows.append(cells)
    return {"messages": _texts(page.locator("ul.messagelist li")), "rows": rows}


def _session_page(page: Page) -> dict[str, Any]:
    """What a session page shows, as plain data:

    * ``title``; ``messages`` (the admin's message lines); ``notices`` (the banner's notice texts, empty
      when there is no ``#session-notices``);
    * ``bindings``: the binding history ``{field: text}``;
    * ``timeline``: ``{"turns": [the status of each .timeline-turn bar], "rotations": number of
      .timeline-rotation marks, "threads": number of thread bars}`` of ``svg#session-timeline``;
    * ``turns``: ``#session-turns`` rows ``{"seq", "status", "thread", "input", "error", "duration",
      "tokens", "cancel"}`` (``cancel``: whether the row offers *Cancel*); ``turns_in_progress``: the
      ``#turns-in-progress`` line or ``""``;
    * ``transcript``: ``#transcript`` rows ``{"seq", "role", "content"}`` in page order (newest first),
      ``transcript_empty``: the empty table's text, ``older``: whether ``#transcript-older`` is offered;
    * ``approvals``: the *Waiting for a decision* section's approvals, ``{"command", "cwd", "buttons"}``
      (``buttons``: the labels of its decision buttons).
    """
    expect(page.locator("svg#session-timeline")).to_be_visible()
    timeline = page.locator("svg#session-timeline")
    turn_classes: list[str] = timeline.locator(".timeline-turn").evaluate_all(
        "bars => bars.map(bar => bar.getAttribute('class'))")
    turns = _table(page, "#session-turns tbody tr[id^=turn-]",
                   ("seq", "status", "thread", "input", "error", "duration", "tokens", "created"))
    for turn in turns:
        turn["cancel"] = "yes" if page.locator(f"#turn-{turn['seq']} .cancel-turn").count() else "no"
    in_progress = page.locator("#turns-in-progress")
    empty = page.locator("#transcript tbody tr:not(.transcript-row)")
    return {
        "title": page.locator("#content h1").inner_text(),
        "messages": _texts(page.locator("ul.messagelist:not(#session-notices) li")),
        "notices": _texts(page.locator("#session-notices .notice-text")),
        "bindings": _inline_rows(page, "bindings-group"),
        "timeline": {
            "turns": [c.split("status-", 1)[1] for c in turn_classes],
            "rotations": timeline.locator(".timeline-rotation").count(),
            "threads": timeline.locator(".timeline-thread").count(),
        },
        "turns": turns,
        "turns_in_progress": in_progress.inner_text().strip() if in_progress.count() else "",
        "transcript": _table(page, "#transcript tbody tr.transcript-row", ("seq", "role", "content")),
        "transcript_empty": empty.inner_text().strip() if empty.count() else "",
        "older": page.locator("#transcript-older").count() > 0,
        "approvals": [{"command": _texts(a.locator(".approval-command")), "cwd": _texts(a.locator(".approval-cwd")),
                       "buttons": _texts(a.locator("button.approval-decision"))}
                      for a in page.locator("#session-approvals .pending-approval").all()],
    }
