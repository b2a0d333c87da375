"""What an API client may choose for a session's codex settings (``Session.model_config``).

Codex runs on the worker's host, so its powers are the operator's to grant: clients choose only
within this policy. The working directory is never client-chosen: each session gets its own
directory under ``settings.CODEX_WORK_ROOT``.
"""
from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.conf import settings

# Sandboxes an ordinary client may pick; "danger-full-access" is staff-only.
CLIENT_SANDBOXES = ("read-only", "workspace-write")
STAFF_SANDBOXES = CLIENT_SANDBOXES + ("danger-full-access",)
# Approval policies codex 0.169.0 accepts on thread/start (``docs/codex.md`` §3). Approvals themselves
# are always answered "decline" by the worker: no human is there to approve.
APPROVAL_POLICIES = ("never", "on-request", "untrusted")
DEFAULTS: dict[str, Any] = {"sandbox": "read-only", "approval_policy": "never"}
MAX_INSTRUCTIONS_CHARS = 20_000


class PolicyError(ValueError):
    """A requested setting is outside what the operator allows. ``.field`` names the key;
    ``.forbidden`` is True when the value exists but needs staff rights (HTTP 403 rather than 400)."""

    def __init__(self, field: str, message: str, *, forbidden: bool = False):
        super().__init__(message)
        self.field = field
        self.forbidden = forbidden


def validate_model_config(config: Any, *, is_staff: bool = False) -> dict[str, Any]:
    """Return the cleaned ``model_config`` dict or raise ``PolicyError``.

    Accepted keys: ``model`` (str ≤ 100), ``developer_instructions`` (str ≤ 20,000 chars),
    ``sandbox`` (``read-only`` | ``workspace-write``; ``danger-full-access`` for staff),
    ``approval_policy`` (``never`` | ``on-request`` | ``untrusted``). Anything else is refused,
    including ``cwd``, which the server assigns.
    """
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise PolicyError("model_config", "model_config must be a JSON object.")
    cleaned: dict[str, Any] = {}
    for key, value in config.items():
        check = _CHECKS.get(key)
        if check is None:
            raise PolicyError(key, f"unknown model_config key {key!r}.")
        check(value, is_staff)
        cleaned[key] = value
    return cleaned


def _check_model(value: Any, is_staff: bool) -> None:
    if not isinstance(value, str) or not value or len(value) > 100:
        raise PolicyError("model", "model must be a non-empty string of at most 100 characters.")


def _check_developer_instructions(value: Any, is_staff: bool) -> None:
    if not isinstance(value, str) or len(value) > MAX_INSTRUCTIONS_CHARS:
        raise PolicyError(
            "developer_instructions",
            f"developer_instructions must be a string of at most {MAX_INSTRUCTIONS_CHARS} characters.",
        )


def _check_sandbox(value: Any, is_staff: bool) -> None:
    if value not in STAFF_SANDBOXES:
        raise PolicyError("sandbox", f"sandbox must be one of {', '.join(CLIENT_SANDBOXES)}.")
    if value not in CLIENT_SANDBOXES and not is_staff:
        raise PolicyError("sandbox", f"sandbox {value!r} is reserved to staff.", forbidden=True)


def _check_approval_policy(value: Any, is_staff: bool) -> None:
    if value not in APPROVAL_POLICIES:
        raise PolicyError("approval_policy", f"approval_policy must be one of {', '.join(APPROVAL_POLICIES)}.")


def _refuse_cwd(value: Any, is_staff: bool) -> None:
    raise PolicyError("cwd", "cwd is assigned by the server (one directory per session); it cannot be set.", forbidden=True)


# One check per key a client may send; each raises PolicyError or returns.
_CHECKS: dict[str, Callable[[Any, bool], None]] = {
    "model": _check_model,
    "developer_instructions": _check_developer_instructions,
    "sandbox": _check_sandbox,
    "approval_policy": _check_approval_policy,
    "cwd": _refuse_cwd,
}


def session_workdir(session_id: str) -> Path:
    """The session's codex working directory: ``CODEX_WORK_ROOT/<session id>`` (created on use).
    Session ids are validated by ``models.session_id_validator`` so they cannot escape the root."""
    root = Path(settings.CODEX_WORK_ROOT).resolve()
    path = (root / session_id).resolve()
    if root not in path.parents:
        raise PolicyError("id", "session id escapes the work root")
    return path


#: Under ``CODEX_WORK_ROOT``, outside every session's directory (no session's commands can read or
#: write it): ``<session id>`` holds the id and creation time of the session its directory belongs to.
WORKDIR_MARKS = ".sessions"


def session_workdir_ready(session_id: str, *, created: str) -> Path:
    """``session_workdir(session_id)``, made if missing — and emptied first when it belonged to another
    session: one deleted since, whose id this one (created at ``created``, ISO 8601) took. A session's
    files must never reach the next owner of its id (tests/codex/test_workdir.py). A directory without a
    mark is taken as this session's (it predates the marks)."""
    path = session_workdir(session_id)
    marks = Path(settings.CODEX_WORK_ROOT).resolve() / WORKDIR_MARKS
    mark, owner = marks / session_id, f"{session_id} {created}"
    try:
        found = mark.read_text()
    except FileNotFoundError:
        found = ""
    if found != owner:
        if found:
            shutil.rmtree(path, ignore_errors=True)
        marks.mkdir(parents=True, exist_ok=True)
        mark.write_text(owner)
    path.mkdir(parents=True, exist_ok=True)
    return path


def effective_config(model_config: dict[str, Any]) -> dict[str, Any]:
    """The settings a turn runs with: defaults overlaid with the session's cleaned config. ``model``: the
    session's own, else the operator's current default (``codex.launch.default_model``; absent when
    codex's config decides) — so a changed ``CODEX_MODEL`` reaches existing sessions at their next turn
    (docs/operating.md §3, "What follows the operator"), and a thread kept loaded under the old default
    is not used for it (``KeptThread.usable_for`` compares this dict)."""
    from .codex.launch import default_model

    merged = dict(DEFAULTS)
    merged.update({k: v for k, v in (model_config or {}).items() if k in ("model", "developer_instructions", "sandbox", "approval_policy")})
    if not merged.get("model"):
        model = default_model()
        if model:
            merged["model"] = model
    return merged
