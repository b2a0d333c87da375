"""What the pinned codex binary really sends is valid under its own schema, in every frame the runner
reads; and what our client sends is accepted by the real thing.

The real runner drives the real ``codex app-server`` (started the way workers start it:
``hermes_sessions.codex.launch``) against the project's model stand-in, through the turns the runner
meets in production: a first turn, a turn that runs a command, one that asks for an approval (declined),
one the model fails, one interrupted mid-stream; then, in a new process, a re-run that adopts a turn
codex completed and a resume of a thread that is gone (rotation). Every frame on the wire is recorded
by the frame tap and validated against the schema of its method.
"""
from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings

from hermes_sessions.codex.launch import app_server_argv, app_server_env, ensure_codex_home

from .support import (
    AppServerClient,
    Frame,
    ModelStandIn,
    TurnControl,
    TurnSpec,
    check_client_frame,
    check_server_frame,
    drive_turn,
    make_server_request_handler,
    read_frames,
    report,
    tapped,
)

SCENARIO = "real codex"
# Frames codex must send in the run below; each is validated on its own (ids name them).
EXPECTED_SERVER_FRAMES = [
    "result of initialize", "result of thread/start", "result of thread/resume", "result of turn/start",
    "result of turn/interrupt", "result of thread/turns/list", "error answering thread/resume",
    "thread/started", "turn/started", "item/started", "item/completed", "item/agentMessage/delta",
    "turn/completed", "thread/tokenUsage/updated", "thread/status/changed", "error",
    "item/commandExecution/requestApproval",
]


def frame_key(frame: Frame) -> str:
    if frame.kind == "response":
        return f"result of {frame.method}"
    if frame.kind == "error":
        return f"error answering {frame.method}"
    return frame.method


class RealRun:
    """One CODEX_HOME, one work directory, one frame log; app-servers started as workers start them."""

    def __init__(self, root: Path) -> None:
        self.log, self.work = root / "frames.jsonl", root / "work"
        self.work.mkdir()
        self.outcomes: dict[str, Any] = {}

    def client(self) -> AppServerClient:
        ensure_codex_home()
        return AppServerClient(
            tapped(self.log, app_server_argv()), env=app_server_env(), cwd=str(self.work), request_timeout=20.0,
            server_request_handler=make_server_request_handler(approval_policy="untrusted"),
        )

    def spec(self, text: str, **fields: Any) -> TurnSpec:
        fields.setdefault("thread_id", None)
        return TurnSpec(text=text, cwd=str(self.work), turn_timeout=30.0, **fields)


def _interrupt_when_running(control: TurnControl) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 20
        while control.running is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # let the model stream start
        control.interrupt.set()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _first_process(run: RealRun, ours: str) -> str:
    """Five turns on one app-server; returns the thread id."""
    with run.client() as client:
        client.start()
        first = drive_turn(client, run.spec("hello one", sandbox="workspace-write", model="mock-model",
                                            developer_instructions="Answer briefly.", client_turn_id=ours))
        thread = first.thread_id
        run.outcomes["first"] = first
        run.outcomes["command"] = drive_turn(
            client, run.spec("RUNCMD echo contract-ok", thread_id=thread, sandbox="workspace-write"))
        run.outcomes["approval"] = drive_turn(client, run.spec(
            "RUNCMD touch approved.txt", thread_id=thread, sandbox="danger-full-access", approval_policy="untrusted"))
        run.outcomes["failed"] = drive_turn(client, run.spec("FAIL500", thread_id=thread))
        run.outcomes["unauthorized"] = drive_turn(client, run.spec("FAIL401", thread_id=thread))
        control = TurnControl()
        watcher = _interrupt_when_running(control)
        run.outcomes["interrupted"] = drive_turn(client, run.spec("SLOW hello", thread_id=thread, control=control))
        watcher.join()
    return thread


def _second_process(run: RealRun, thread: str, ours: str) -> None:
    """A restart: adopt the turn codex completed; then a bound thread codex has no rollout for."""
    with run.client() as client:
        client.start()
        run.outcomes["adopted"] = drive_turn(
            client, run.spec("hello one", thread_id=thread, client_turn_id=ours, adopt_completed=True))
        run.outcomes["rotated"] = drive_turn(client, run.spec(
            "hello again", thread_id=str(uuid.uuid4()), sandbox="read-only", fresh_input=lambda: "[seed]\nhello again"))


@pytest.fixture(scope="module")
def real_run(pinned_codex: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[RealRun, list[Frame]]:
    root = tmp_path_factory.mktemp("contract-real-codex")
    run = RealRun(root)
    with ModelStandIn(slow_seconds=5) as stand_in, override_settings(
        CODEX_BIN=pinned_codex, CODEX_APP_SERVER_COMMAND="", CODEX_MODEL_PROVIDER="stand-in", CODEX_MODEL="",
        CODEX_STAND_IN_URL=stand_in.base_url, CODEX_HOME=root / "codex_home", CODEX_USER_HOME=root / "user_home",
    ):
        ours = str(uuid.uuid4())
        thread = _first_process(run, ours)
        _second_process(run, thread, ours)
    return run, read_frames(run.log)


def test_the_run_went_through_every_path(real_run):
    """The frames below come from turns that did what they are named for."""
    run, _ = real_run
    out = run.outcomes
    assert (out["first"].status, out["first"].final_text) == ("completed", "echo: hello one")
    assert out["first"].usage.get("input_tokens", 0) > 0
    assert "contract-ok" in "\n".join(m["content"] for m in out["command"].messages if m["role"] == "tool")
    assert out["approval"].status == "completed" and not (run.work / "approved.txt").exists()
    assert out["failed"].status == "failed" and out["failed"].error
    # What failed is named: the HTTP status codex saw (codexErrorInfo, docs/codex.md §4).
    assert out["failed"].error.startswith("the model call failed with HTTP 500 (codex: internalServerError): ")
    assert out["unauthorized"].status == "failed"
    assert out["unauthorized"].error.startswith("the model call failed with HTTP 401 (codex: httpConnectionFailed): ")
    assert out["interrupted"].status == "interrupted"
    assert (out["adopted"].adopted, out["adopted"].status) == (True, "completed")
    assert (out["rotated"].thread_action, out["rotated"].status) == ("rotated", "completed")


@pytest.mark.parametrize("key", EXPECTED_SERVER_FRAMES)
def test_codex_frame_matches_the_schema(codex_schema, real_run, key):
    frames = [f for f in real_run[1] if f.source == "server" and frame_key(f) == key]
    assert frames, f"codex sent no {key!r} frame in the run"
    problems = report(SCENARIO, frames, check_server_frame, codex_schema)
    assert not problems, "\n".join(problems)


def test_every_other_codex_frame_matches_the_schema_too(codex_schema, real_run):
    """Warnings, status and rate-limit notifications, … : nothing codex sent is outside its schema."""
    frames = [f for f in real_run[1] if f.source == "server" and frame_key(f) not in EXPECTED_SERVER_FRAMES]
    problems = report(SCENARIO, frames, check_server_frame, codex_schema)
    assert not problems, "\n".join(problems)


def test_item_kinds_the_projection_reads_came_through(real_run):
    kinds = {f.message["params"]["item"]["type"] for f in real_run[1] if f.method == "item/completed"}
    assert {"userMessage", "agentMessage", "commandExecution"} <= kinds


def test_every_frame_our_client_wrote_to_real_codex_matches_the_schema(codex_schema, real_run):
    frames = [f for f in real_run[1] if f.source == "client"]
    assert {frame_key(f) for f in frames} >= {"initialize", "initialized", "thread/start", "thread/resume",
                                              "turn/start", "turn/interrupt", "thread/turns/list",
                                              "result of item/commandExecution/requestApproval"}
    problems = report(SCENARIO, frames, check_client_frame, codex_schema)
    assert not problems, "\n".join(problems)
