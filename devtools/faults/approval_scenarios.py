"""The approval scenario of ``make faults`` (``docs/contract.md`` §10, A8): a worker dies while a person's
decision is pending.

``kill-while-approval-waits``  sessions with ``approval_policy: untrusted`` post ``RUNCMD`` commands that
                      append a line to a file of the session's work directory; codex asks for the
                      command's approval and the turn waits. Then ``kill -9`` of the worker running it
                      (its app-server dies with it: codex keeps no pending request across app-servers),
                      and a replacement worker starts. The sweep takes the turn back (lease), its re-run's
                      codex asks the same command again. The person decides ``accept`` — in turn, per
                      session: while the worker is frozen just before the kill (the decision never reached
                      that codex), right after the kill (the turn not yet re-run), or once the re-run asked
                      again (the approval carried over to the new claim). Each turn must succeed with the
                      command run exactly once (one line in the file, its output in the transcript), one
                      approval row for the turn (nobody asked twice), accepted, by the person, answered to
                      codex once (``answered_at``), and nothing left pending.
"""
from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devtools.faults.scenarios import Scenario, _worker_running
from devtools.faults.supervisor import Proc, log
from devtools.faults.warm_scenarios import _signal_holder
from devtools.processes import codex_processes

UNTRUSTED = {"sandbox": "workspace-write", "approval_policy": "untrusted"}
#: When the person decides, relative to the kill of the worker that asked.
WHEN = ("before-the-kill", "after-the-kill", "after-the-rerun-asks")


def _session(sc: Scenario) -> str:
    sid = f"{sc.tag}-s{len(sc.rec.sessions) + 1}"
    status, data = sc.stack.call("POST", "/sessions/", {"id": sid, "title": sc.rec.name, "model_config": UNTRUSTED})
    if status != 201:
        raise RuntimeError(f"session create: {status} {data}")
    sc.rec.sessions.append(sid)
    return sid


def _until(what: str, probe: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.1)
    raise RuntimeError(f"{what}: not within {timeout:g} s")


def _pending(sc: Scenario, sid: str) -> dict[str, Any] | None:
    status, data = sc.stack.call("GET", f"/sessions/{sid}/approvals/?status=pending")
    return data["results"][0] if status == 200 and data["results"] else None


def _decide(sc: Scenario, approval_id: str, when: str) -> None:
    status, data = sc.stack.call("POST", f"/approvals/{approval_id}/decision/", {"decision": "accept"})
    if status != 200:
        sc.rec.violations.append(f"{when}: the decision on {approval_id} answered {status}: {str(data)[:200]}")


def _one_round(sc: Scenario, when: str) -> None:
    from hermes_sessions.models import Approval

    stack = sc.stack
    sid = _session(sc)
    mark = f"{sc.tag}-{uuid.uuid4().hex[:8]}"
    posted = sc.post(sid, f"RUNCMD echo {mark} >> ran.txt && echo ran-{mark}")
    if posted is None:
        return
    approval = _until(f"{when}: the approval pending", lambda: _pending(sc, sid), 60)
    worker: Proc = _until(f"{when}: the worker running the turn",
                          lambda: _worker_running(stack, sid, codex_processes(stack.codex_home)), 30)
    log(f"kill-while-approval-waits ({when}): kill -9 {worker.name} while approval {approval['id'][:8]} waits")
    if when == "before-the-kill":
        codex = [cp.pid for cp in stack.codex_of(worker)]
        _signal_holder(worker, codex, signal.SIGSTOP)  # it can no longer read the decision
        _decide(sc, approval["id"], when)
    stack.kill9_worker(worker)
    if when == "after-the-kill":
        _decide(sc, approval["id"], when)
    stack.wait_ready(stack.start_worker())
    if when == "after-the-rerun-asks":
        carried = _until(f"{when}: the re-run asking again",
                         lambda: Approval.objects.filter(pk=approval["id"], attempt__gte=2, status="pending").exists(), 60)
        if carried:
            _decide(sc, approval["id"], when)
    sc.wait_terminal()
    _check(sc, sid, posted["id"], approval["id"], mark, when)


def _check(sc: Scenario, sid: str, turn_id: str, approval_id: str, mark: str, when: str) -> None:
    from hermes_sessions.models import Approval, Message, Turn

    v = sc.rec.violations
    turn = Turn.objects.get(pk=turn_id)
    if turn.status != "succeeded" or turn.attempt < 2:
        v.append(f"{when}: turn {turn_id} ended {turn.status} at attempt {turn.attempt} ({turn.error[:200]})")
    rows = list(Approval.objects.filter(turn_ref=turn_id))
    if [str(a.pk) for a in rows] != [approval_id]:
        v.append(f"{when}: turn {turn_id} has {len(rows)} approval rows (a person was asked again): "
                 + ", ".join(f"{a.pk} {a.status} attempt {a.attempt}" for a in rows))
    for a in rows:
        if a.status != "accepted" or a.decided_by_id is None or a.answered_at is None:
            v.append(f"{when}: approval {a.pk} is {a.status}, decided by {a.decided_by_id}, answered {a.answered_at}")
    ran = Path(sc.stack.work_root, sid, "ran.txt")
    lines = ran.read_text().splitlines() if ran.exists() else []
    if lines != [mark]:
        v.append(f"{when}: the command ran {len(lines)} time(s) (ran.txt: {lines[:5]})")
    tool = " ".join(Message.objects.filter(turn_id=turn_id, role="tool").values_list("content", flat=True))
    if tool.count(f"ran-{mark}") != 1:
        v.append(f"{when}: the command's output is {tool.count(f'ran-{mark}')} time(s) in the transcript")


def scenario_kill_while_approval_waits(sc: Scenario) -> None:
    for when in WHEN:
        _one_round(sc, when)
        sc.rec.runs += 1
    sc.rec.notes.append(f"{sc.rec.runs} workers killed while an approval waited (decided {', '.join(WHEN)})")


APPROVAL_SCENARIOS: dict[str, Callable[[Scenario], None]] = {
    "kill-while-approval-waits": scenario_kill_while_approval_waits,
}
