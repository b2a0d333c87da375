"""Every frame our client writes is valid under the pinned codex's schema.

The real runner drives the scripted app-server stand-in (tests/codex/scripted_app_server.py) through
each scenario the runner knows; the frame tap records the exact lines the client writes, and each is
validated, closed (an undeclared parameter fails), against the schema of its method: requests against
their ``ClientRequest`` arm, ``initialized`` against ``ClientNotification``, our answers to server
requests against ``<X>Response`` (or ``JSONRPCError`` when we refuse). Test ids name the scenario and
the frame (``answer to <method>`` for our answers).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hermes_sessions.policy import APPROVAL_POLICIES, STAFF_SANDBOXES

from .support import (
    KNOWN_SERVER_REQUESTS,
    AppServerClient,
    Frame,
    TurnControl,
    TurnSpec,
    check_client_frame,
    drive_turn,
    make_server_request_handler,
    read_frames,
    report,
    tapped,
)

SCRIPTED = Path(__file__).resolve().parents[1] / "scripted_app_server.py"
UNKNOWN_SERVER_REQUEST = "hermes/contract/unknownMethod"


class ScriptedRig:
    """One scenario's scripted app-server state, work directory and frame log."""

    def __init__(self, root: Path) -> None:
        self.state, self.work, self.log = root / "state", root / "work", root / "frames.jsonl"
        self.state.mkdir(parents=True)
        self.work.mkdir()

    def script(self, actions: dict[str, list[dict]]) -> None:
        (self.state / "script.json").write_text(json.dumps(actions))

    def remove_rollout(self, thread_id: str) -> None:
        (self.state / "rollouts" / f"{thread_id}.jsonl").unlink()

    def client(self, handler: Callable[[str, dict], dict] | None = None) -> AppServerClient:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SCRIPTED_STATE_DIR": str(self.state)}
        return AppServerClient(
            tapped(self.log, [sys.executable, str(SCRIPTED)]), env=env, cwd=str(self.work), request_timeout=5.0,
            server_request_handler=handler or make_server_request_handler(),
        )

    def spec(self, **fields: Any) -> TurnSpec:
        fields.setdefault("text", "hello")
        fields.setdefault("thread_id", None)
        return TurnSpec(cwd=str(self.work), turn_timeout=10.0, **fields)

    def turn(self, **fields: Any) -> Any:
        """One turn on a new app-server process (a restart before every turn, as workers do)."""
        with self.client() as client:
            client.start()
            return drive_turn(client, self.spec(**fields))

    def requests(self) -> list[list[str]]:
        """Request methods the client sent, per process."""
        per_pid: dict[int, list[str]] = {}
        for frame in read_frames(self.log):
            if frame.source == "client" and frame.kind == "request":
                per_pid.setdefault(frame.pid, []).append(frame.method)
        return list(per_pid.values())


# ---------------------------------------------------------------------------------------- scenarios


def first_turn(rig: ScriptedRig) -> None:
    out = rig.turn(text="hello one")
    assert (out.thread_action, out.status, out.methods) == ("started", "completed", ["thread/start"])


def policy(sandbox: str) -> Callable[[ScriptedRig], None]:
    """First turns under ``sandbox`` with every approval policy, model/instructions set and unset."""

    def scenario(rig: ScriptedRig) -> None:
        with rig.client() as client:
            client.start()
            for approval in APPROVAL_POLICIES:
                for extra in ({}, {"model": "gpt-5.5", "developer_instructions": "Answer in one line."}):
                    spec = rig.spec(sandbox=sandbox, approval_policy=approval, client_turn_id=str(uuid.uuid4()),
                                    **extra)
                    assert drive_turn(client, spec).status == "completed"
        sent = [f.message["params"] for f in read_frames(rig.log) if f.kind == "request" and f.method == "thread/start"]
        assert {p["approvalPolicy"] for p in sent} == set(APPROVAL_POLICIES)
        assert {("model" in p, "developerInstructions" in p) for p in sent} == {(True, True), (False, False)}

    return scenario


def resume(rig: ScriptedRig) -> None:
    first = rig.turn(text="hello one")
    out = rig.turn(text="hello two", thread_id=first.thread_id)
    assert (out.thread_action, out.thread_id, out.methods) == ("resumed", first.thread_id, ["thread/resume"])


def rotation(rig: ScriptedRig) -> None:
    first = rig.turn(text="hello one")
    rig.remove_rollout(first.thread_id)
    out = rig.turn(text="hello two", thread_id=first.thread_id, fresh_input=lambda: "[seed]\nhello two")
    assert (out.thread_action, out.rotated_from) == ("rotated", first.thread_id)
    assert out.methods == ["thread/resume", "thread/start"]


def rerun_adoption(rig: ScriptedRig) -> None:
    ours = str(uuid.uuid4())
    first = rig.turn(text="hello one", client_turn_id=ours)
    adopted = rig.turn(text="hello one", thread_id=first.thread_id, client_turn_id=ours, adopt_completed=True)
    assert (adopted.adopted, adopted.status, adopted.final_text) == (True, "completed", "echo: hello one")
    fresh = rig.turn(text="two", thread_id=first.thread_id, client_turn_id=str(uuid.uuid4()), adopt_completed=True)
    assert (fresh.adopted, fresh.status) == (False, "completed")
    assert rig.requests()[1:] == [
        ["initialize", "thread/resume", "thread/turns/list"],
        ["initialize", "thread/resume", "thread/turns/list", "turn/start"],
    ]


def rerun_previous_thread(rig: ScriptedRig) -> None:
    """A lost worker had rotated to a fresh thread: the re-run resumes that one and adopts the turn."""
    ours = str(uuid.uuid4())
    lost = rig.turn(text="hello", client_turn_id=ours)
    gone = str(uuid.uuid4())
    out = rig.turn(text="hello", thread_id=gone, previous_thread_id=lost.thread_id, client_turn_id=ours,
                   adopt_completed=True)
    assert (out.thread_action, out.rotated_from, out.thread_id, out.adopted) == ("rotated", gone, lost.thread_id, True)
    assert rig.requests()[1] == ["initialize", "thread/resume", "thread/resume", "thread/turns/list"]


def thread_not_found(rig: ScriptedRig) -> None:
    """turn/start answers ``thread not found``: the runner resumes and sends turn/start again."""
    first = rig.turn(text="hello one")
    rig.script({"turn/start": [{"error": {"code": -32600, "message": "thread not found: {thread_id}"}}]})
    out = rig.turn(text="hello two", thread_id=first.thread_id)
    assert out.status == "completed"
    assert rig.requests()[1] == ["initialize", "thread/resume", "turn/start", "thread/resume", "turn/start"]


def interrupt(rig: ScriptedRig) -> None:
    """A cancel (TurnControl.interrupt) mid-turn sends turn/interrupt; codex ends the turn interrupted."""
    rig.script({"turn/start": [{"no_completion": True}]})
    control = TurnControl()

    def cancel_once_running() -> None:
        deadline = time.monotonic() + 10
        while control.running is None and time.monotonic() < deadline:
            time.sleep(0.01)
        control.interrupt.set()

    canceller = threading.Thread(target=cancel_once_running, daemon=True)
    canceller.start()
    out = rig.turn(text="hello", control=control)
    canceller.join()
    assert out.status == "interrupted"


def server_requests(auto_approve: bool) -> Callable[[ScriptedRig], None]:
    """codex asks each server request it can send (and one it cannot) mid-turn; we answer each."""
    asked = [*KNOWN_SERVER_REQUESTS, UNKNOWN_SERVER_REQUEST]

    def scenario(rig: ScriptedRig) -> None:
        rig.script({"turn/start": [{"server_request": {"method": m, "params": {"itemId": "call_1"}}} for m in asked]})
        handler = make_server_request_handler(approval_policy="never", auto_approve=auto_approve)
        with rig.client(handler) as client:
            client.start()
            thread_id = None
            for _ in asked:
                out = drive_turn(client, rig.spec(thread_id=thread_id))
                assert out.status == "completed"
                thread_id = out.thread_id
        answers = (rig.state / "server_answers.jsonl").read_text().splitlines()
        answered = [json.loads(line)["method"] for line in answers]
        assert answered == asked

    return scenario


BASE = ["initialize", "initialized", "thread/start", "turn/start"]
SERVER_ANSWERS = [f"answer to {m}" for m in (*KNOWN_SERVER_REQUESTS, UNKNOWN_SERVER_REQUEST)]
# scenario → (what it does, the frames the client must write in it — exactly these kinds)
SCENARIOS: dict[str, tuple[Callable[[ScriptedRig], None], list[str]]] = {
    "first-turn": (first_turn, BASE),
    **{f"sandbox-{mode}": (policy(mode), BASE) for mode in STAFF_SANDBOXES},
    "resume": (resume, [*BASE, "thread/resume"]),
    "rotation": (rotation, [*BASE, "thread/resume"]),
    "rerun-adoption": (rerun_adoption, [*BASE, "thread/resume", "thread/turns/list"]),
    "rerun-previous-thread": (rerun_previous_thread, [*BASE, "thread/resume", "thread/turns/list"]),
    "thread-not-found": (thread_not_found, [*BASE, "thread/resume"]),
    "interrupt": (interrupt, [*BASE, "turn/interrupt"]),
    "server-requests": (server_requests(auto_approve=False), [*BASE, "thread/resume", *SERVER_ANSWERS]),
    "server-requests-auto-approve": (server_requests(auto_approve=True), [*BASE, "thread/resume", *SERVER_ANSWERS]),
}
CASES = [(scenario, key) for scenario, (_, keys) in SCENARIOS.items() for key in keys]


def frame_key(frame: Frame) -> str:
    return frame.method if frame.kind in ("request", "notification") else f"answer to {frame.method}"


@pytest.fixture(scope="session")
def scripted_frames(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[Frame]]:
    """``run(scenario)`` → the frames of that scenario, run once per test session."""
    done: dict[str, list[Frame]] = {}

    def run(scenario: str) -> list[Frame]:
        if scenario not in done:
            rig = ScriptedRig(tmp_path_factory.mktemp(f"contract-{scenario}"))
            SCENARIOS[scenario][0](rig)
            done[scenario] = read_frames(rig.log)
        return done[scenario]

    return run


@pytest.mark.parametrize(("scenario", "key"), CASES, ids=[f"{s}: {k}" for s, k in CASES])
def test_client_frame_matches_the_schema(codex_schema, scripted_frames, scenario, key):
    frames = [f for f in scripted_frames(scenario) if f.source == "client" and frame_key(f) == key]
    assert frames, f"scenario {scenario} wrote no {key!r} frame"
    problems = report(scenario, frames, check_client_frame, codex_schema)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario_writes_no_frame_outside_its_list(scripted_frames, scenario):
    """So every frame the client writes in a scenario is one the test above validates."""
    written = {frame_key(f) for f in scripted_frames(scenario) if f.source == "client"}
    assert written == set(SCENARIOS[scenario][1])
