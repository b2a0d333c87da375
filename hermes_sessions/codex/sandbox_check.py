"""Can codex's sandbox run a command on this host? Checked once per worker process (at start, and
before its first turn), so a host without unprivileged user namespaces refuses turns with a clear
reason instead of failing every command (openai/codex#29908, #15057) — and nothing ever runs
unsandboxed.

The check runs ``codex sandbox -P hermes-read-only`` (0.171.0 has no ``linux`` subcommand; measured,
``docs/codex.md`` §10) with the same profile a read-only turn gets, in a scratch directory whose
sibling holds a marker file: it passes only if the command runs *and* cannot read the marker.
``settings.CODEX_SANDBOX_CHECK_COMMAND`` (a JSON list) replaces the command (tests simulate a broken
host with it); with the scripted app-server (``CODEX_APP_SERVER_COMMAND``) and no such command, the
check is skipped.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from .errors import CodexError
from .launch import app_server_env, codex_binary, permission_overrides, permission_profile

logger = logging.getLogger(__name__)

OK_WORD = "HERMES-SANDBOX-OK"
MARKER = "HERMES-SANDBOX-MARKER"
TIMEOUT_SECONDS = 20.0
RECHECK_FAILED_SECONDS = 60.0  # a failed check is repeated at most this often


class SandboxUnavailable(CodexError):
    """codex's sandbox cannot run commands on this host; turns are refused (never run unsandboxed)."""


@dataclass(frozen=True)
class CheckResult:
    """One run of the check: ``ok``, ``reason`` (``"ok"``, or why it failed) and ``at`` (monotonic s)."""

    ok: bool
    reason: str
    at: float


_cache: dict[str, CheckResult] = {}


def _key() -> str:
    return json.dumps([settings.CODEX_SANDBOX_CHECK_COMMAND, settings.CODEX_APP_SERVER_COMMAND, settings.CODEX_BIN])


def check_sandbox(*, force: bool = False) -> None:
    """Raise ``SandboxUnavailable("codex sandbox unavailable on this host: …")`` unless the sandbox
    works. Cached per process: a success for good, a failure for ``RECHECK_FAILED_SECONDS``."""
    key = _key()
    cached = _cache.get(key)
    if cached is not None and not force and (cached.ok or time.monotonic() - cached.at < RECHECK_FAILED_SECONDS):
        result = cached
    else:
        result = _run_check()
        _cache[key] = result
        if not result.ok:
            logger.error("codex sandbox unavailable on this host: %s", result.reason)
    if not result.ok:
        raise SandboxUnavailable(f"codex sandbox unavailable on this host: {result.reason}")


def _run_check() -> CheckResult:
    now = time.monotonic()
    if settings.CODEX_APP_SERVER_COMMAND and not settings.CODEX_SANDBOX_CHECK_COMMAND:
        return CheckResult(True, "skipped (scripted app-server)", now)
    scratch = Path(tempfile.mkdtemp(prefix="hermes-sandbox-check-"))
    try:
        work, home = scratch / "work", scratch / "home"
        work.mkdir()
        home.mkdir()
        (scratch / "marker.txt").write_text(MARKER + "\n")
        if settings.CODEX_SANDBOX_CHECK_COMMAND:
            argv = json.loads(settings.CODEX_SANDBOX_CHECK_COMMAND)
        else:
            argv = [codex_binary(), "sandbox", *permission_overrides("read-only", work),
                    "-P", permission_profile("read-only"), "-C", str(work), "--",
                    "sh", "-c", f'cat ../marker.txt "{scratch}/marker.txt" 2>/dev/null; echo {OK_WORD}']
        env = app_server_env()
        env["CODEX_HOME"] = str(home)
        try:
            proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return CheckResult(False, f"the check command could not run: {exc}", now)
        out = (proc.stdout or "") + (proc.stderr or "")
        lines = [line for line in out.splitlines() if line.strip() and not line.startswith("WARNING: proceeding")]
        if any(line.lstrip().startswith("bwrap:") for line in lines):
            return CheckResult(False, next(line for line in lines if line.lstrip().startswith("bwrap:")).strip()[:300], now)
        if proc.returncode != 0 or OK_WORD not in out:
            tail = " | ".join(lines[-3:])[:300] or "no output"
            return CheckResult(False, f"a trivial sandboxed command failed (exit {proc.returncode}): {tail}", now)
        if MARKER in out:
            return CheckResult(False, "a sandboxed command could read a file outside its profile", now)
        return CheckResult(True, "ok", now)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def last_result() -> CheckResult | None:
    """This process's latest result for the current settings, or ``None`` when it has not checked
    (``worker/health_beat.py`` records it; the readiness checks read it from there)."""
    return _cache.get(_key())


def reset_cache() -> None:
    """Forget earlier results (tests)."""
    _cache.clear()


def check_at_worker_start() -> CheckResult:
    """Run the check when a worker starts and log the result (the turn path checks again, from the
    cache); returns it, for the worker's health record."""
    try:
        check_sandbox(force=True)
    except SandboxUnavailable as exc:
        logger.error("%s — this worker refuses turns until it works", exc)
    except Exception as exc:  # noqa: BLE001 — a worker must start even if the check itself breaks
        logger.exception("codex sandbox check failed to run")
        return CheckResult(False, f"the check itself failed: {exc}", time.monotonic())
    else:
        logger.info("codex sandbox check passed (pid %s)", os.getpid())
    return _cache[_key()]
