"""One app-server per kept thread against app-servers that hold several sessions' threads, on the real
pinned codex binary and the model stand-in (run in its own process), all in one run (issue 26 item 2).

Shapes: ``--threads`` (50) loaded threads, one per session, spread over app-servers of ``--per-server``
threads each (``1,10,50``: 50 app-servers of one thread, 5 of ten, 1 of fifty). Every thread runs under its
session's permission profile for its own work dir (``launch.permission_filesystem``, workspace-write):

* one thread per app-server: as a worker runs it today — the session's own home and ``config.toml``, the
  profile on the command line (``launch.app_server_argv``), ``thread/start {cwd}``;
* several threads per app-server: one shared home whose ``config.toml`` names no profile, the command line
  with a deny-all default profile (``deny_all_overrides``) instead of a session's, and each thread's profile
  in its own ``thread/start``
  ``config: {default_permissions, permissions: {<id>: {filesystem, network}}}`` (docs/codex.md §10).

Figures (``name: value`` lines, ``bench_figures.parse_figures``), ``<k>`` the threads per app-server:

* ``shape_<k>_private_kb_per_thread`` / ``…_pss_kb_per_thread``: private memory (USS) and PSS of the shape's
  app-server trees (``worker.warm.process_memory.tree_memory``) after one turn on every thread, over the
  thread count. An idle witness app-server stays up for the whole run, so codex's text pages are shared
  (not private) in every shape; PSS of a later shape is diluted by the earlier shapes' processes.
* ``shape_<k>_warm_turn_ms``: median of warm turns run one at a time (concurrency 1), interleaved with the
  other shapes round by round.
* ``shape_<k>_turns_per_s``: all threads' turns started at once (one per thread), threads / wall time
  from the first ``turn/start`` to the last ``turn/completed``; median of ``--rounds``; ``…_burst_p50_ms``
  / ``…_burst_max_ms`` the turns' own latencies in those bursts.
* ``shape_<k>_slow_burst_s``: the same burst with every model reply taking 1 s (``SLOW1``): ≈ 1 s when
  an app-server runs its threads' turns side by side, ≈ k s if it ran them one after the other.
* ``isolation_*``: two threads in one app-server (shared home, one ``thread/start`` profile each), the
  stand-in's ``RUNCMD``/``PATCHFILE`` making codex read the other thread's work dir and rollout, list the
  shared home and write into the other work dir; ``1`` means the other session's words (or file) were
  reached. Then the ways the per-thread profile is lost: a thread started without ``config``, a
  ``thread/resume`` without it, a ``turn/start`` ``sandboxPolicy``; and the same first two on an app-server
  whose own default profile denies every session's directory (``isolation_fail_closed_*``, the shape the
  shared shapes above run in).

Alone: ``python -m devtools.bench_app_server_shapes`` (no database, no broker; ~3–6 min on 2 busy cores).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.processes import stand_in_argv, wait_for_port_file

BASE = Path(__file__).resolve().parent.parent
SETTLE_SECONDS = 1.0  # after the turns, before reading memory (codex's post-turn rollout flush ends)
TURN_TIMEOUT = 300.0
SANDBOX = "workspace-write"
PROFILE = "hermes-workspace-write"  # launch.permission_profile(SANDBOX)


# ------------------------------------------------------------------------------------------- arithmetic

def shape_layout(threads: int, per_server: int) -> list[int]:
    """Threads per app-server for ``threads`` threads in app-servers of ``per_server`` each (the last one
    holds the remainder): ``shape_layout(50, 10) == [10] * 5``, ``shape_layout(7, 3) == [3, 3, 1]``.
    Raises ``ValueError`` unless both are positive."""
    if threads < 1 or per_server < 1:
        raise ValueError("threads and per_server must be positive")
    full, rest = divmod(threads, per_server)
    return [per_server] * full + ([rest] if rest else [])


def per_thread_kb(tree_kbs: list[int], threads: int) -> float:
    """Memory per loaded thread (kB): the app-server trees' sum over the threads they hold."""
    if threads < 1:
        raise ValueError("threads must be positive")
    return sum(tree_kbs) / threads


def turns_per_second(turns: int, first_start: float, last_done: float) -> float:
    """``turns`` over the wall time from the first ``turn/start`` sent to the last ``turn/completed`` seen
    (monotonic seconds); raises ``ValueError`` on an empty or negative interval."""
    if last_done <= first_start:
        raise ValueError("last_done must come after first_start")
    return turns / (last_done - first_start)


# ------------------------------------------------------------------------------------------- the client

@dataclass
class _Turn:
    thread_id: str
    sent: float
    done: threading.Event = field(default_factory=threading.Event)
    finished: float = 0.0
    status: str = ""
    items: list[dict] = field(default_factory=list)


class AppServer:
    """A ``codex app-server`` driven over stdio from one reader thread: requests may be pipelined and any
    number of its threads' turns run at once (``start_turn`` / ``_Turn.done``)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, cwd=cwd)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._responses: dict[int, dict] = {}
        self._waiting: dict[int, threading.Event] = {}
        self._turns: dict[str, _Turn] = {}           # turn id → turn
        self._early: dict[str, list[dict]] = {}      # notifications of a turn id not yet known
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for raw in self.proc.stdout:  # type: ignore[union-attr]
            msg = json.loads(raw)
            if "id" in msg and "method" in msg:  # a server request (approvals): never asked for, decline
                self._send({"id": msg["id"], "error": {"code": -32601, "message": "bench client"}})
                continue
            if "id" in msg:
                with self._lock:
                    self._responses[msg["id"]] = msg
                    event = self._waiting.pop(msg["id"], None)
                if event:
                    event.set()
                continue
            params = msg.get("params") or {}
            turn_id = params.get("turnId") or (params.get("turn") or {}).get("id")
            if not turn_id:
                continue
            with self._lock:
                turn = self._turns.get(turn_id)
                if turn is None:
                    self._early.setdefault(turn_id, []).append(msg)
                    continue
            self._on_turn_message(turn, msg)

    @staticmethod
    def _on_turn_message(turn: _Turn, msg: dict) -> None:
        if msg.get("method") == "item/completed":
            turn.items.append(msg["params"]["item"])
        elif msg.get("method") == "turn/completed":
            turn.finished = time.monotonic()
            turn.status = msg["params"]["turn"]["status"]
            turn.done.set()

    def _send(self, msg: dict) -> None:
        with self._lock:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]

    def send_request(self, method: str, params: dict) -> tuple[int, threading.Event]:
        rid = next(self._ids)
        event = threading.Event()
        with self._lock:
            self._waiting[rid] = event
        self._send({"id": rid, "method": method, "params": params})
        return rid, event

    def result(self, rid: int, event: threading.Event, method: str = "") -> Any:
        if not event.wait(TURN_TIMEOUT):
            raise TimeoutError(f"{method}: no answer in {TURN_TIMEOUT} s")
        with self._lock:
            msg = self._responses.pop(rid)
        if "error" in msg:
            raise RuntimeError(f"{method}: {msg['error']}")
        return msg["result"]

    def request(self, method: str, params: dict) -> Any:
        return self.result(*self.send_request(method, params), method)

    def initialize(self) -> None:
        self.request("initialize", {"clientInfo": {"name": "bench-shapes", "title": None, "version": "0"}})
        self._send({"method": "initialized", "params": {}})

    def send_turn(self, thread_id: str, text: str, **overrides: Any) -> tuple[float, int, threading.Event]:
        """Send ``turn/start`` without waiting; ``(sent at, request id, its event)`` for ``register_turn``."""
        sent = time.monotonic()
        rid, event = self.send_request("turn/start", {"threadId": thread_id,
                                                      "input": [{"type": "text", "text": text}], **overrides})
        return sent, rid, event

    def register_turn(self, thread_id: str, sent: float, rid: int, event: threading.Event) -> _Turn:
        turn_id = self.result(rid, event, "turn/start")["turn"]["id"]
        turn = _Turn(thread_id=thread_id, sent=sent)
        with self._lock:
            self._turns[turn_id] = turn
            early = self._early.pop(turn_id, [])
        for msg in early:
            self._on_turn_message(turn, msg)
        return turn

    def turn(self, thread_id: str, text: str, **overrides: Any) -> _Turn:
        turn = self.register_turn(thread_id, *self.send_turn(thread_id, text, **overrides))
        if not turn.done.wait(TURN_TIMEOUT):
            raise TimeoutError("turn did not complete")
        return turn

    def close(self) -> None:
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)


def command_output(turn: _Turn) -> str:
    """Everything the turn's commands printed, and the paths its file changes touched."""
    out = []
    for item in turn.items:
        if item.get("type") == "commandExecution":
            out.append(item.get("aggregatedOutput") or "")
        elif item.get("type") == "fileChange":
            out.append(json.dumps(item.get("changes")) + " " + str(item.get("status")))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- set-up

def _configure(scratch: Path, stand_in_url: str) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    os.environ.setdefault("DJANGO_SECRET_KEY", "bench-app-server-shapes-only")
    os.environ.update({"CODEX_HOMES_ROOT": str(scratch / "homes"), "CODEX_WORK_ROOT": str(scratch / "work"),
                       "CODEX_HOME": str(scratch / "codex_home"), "CODEX_USER_HOME": str(scratch / "user_home"),
                       "CODEX_MODEL_PROVIDER": "stand-in", "CODEX_STAND_IN_URL": stand_in_url,
                       "HERMES_VAR_DIR": str(scratch)})
    os.environ.pop("CODEX_APP_SERVER_COMMAND", None)
    import django

    django.setup()


def workdir_for(session_id: str) -> Path:
    """``policy.session_workdir(session_id)``, made."""
    from hermes_sessions import policy

    workdir = policy.session_workdir(session_id)
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def thread_config(workdir: Path) -> dict:
    """``thread/start`` ``config`` selecting and defining a session's profile for ``workdir`` (the per-thread
    form of ``launch.permission_overrides``)."""
    from hermes_sessions.codex.launch import permission_filesystem

    return {"default_permissions": PROFILE,
            "permissions": {PROFILE: {"filesystem": permission_filesystem(SANDBOX, workdir),
                                      "network": {"enabled": False}}}}


def own_app_server(session_id: str) -> tuple[AppServer, Path]:
    """An app-server as a worker runs one session's thread today: its home, its profile on the command line."""
    from hermes_sessions.codex.launch import app_server_argv, app_server_env, prepare_session_home

    workdir = workdir_for(session_id)
    home = prepare_session_home(session_id, sandbox=SANDBOX, workdir=workdir)
    server = AppServer(app_server_argv(sandbox=SANDBOX, workdir=workdir), app_server_env(home), str(workdir))
    server.initialize()
    return server, workdir


def deny_all_overrides() -> list[str]:
    """``-c`` arguments making ``PROFILE`` the app-server's default with a filesystem that holds no session's
    directory (``:minimal``, codex's install and one empty directory, read-only): a thread started or resumed
    without its own ``config`` then reaches nobody's files (fails closed) instead of falling back to codex's
    legacy ``:read-only`` sandbox, which reads everything (``isolation_fail_closed_*``)."""
    from hermes_sessions.codex.launch import permission_filesystem

    nobody = workdir_for("nobody")
    fs = ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in permission_filesystem("read-only", nobody).items())
    return ["-c", f"default_permissions={json.dumps(PROFILE)}", "-c", f"permissions.{PROFILE}.filesystem={{{fs}}}",
            "-c", f"permissions.{PROFILE}.network={{enabled = false}}"]


def shared_app_server(name: str, *extra: str, fail_closed: bool = False) -> AppServer:
    """An app-server on one shared home whose config names no profile (as a spare's), no session's ``-c``;
    ``fail_closed``: with ``deny_all_overrides`` as its default profile."""
    from hermes_sessions.codex.launch import app_server_argv, app_server_env, prepare_session_home

    home = prepare_session_home(name)  # config.toml without a profile
    argv = app_server_argv() + (deny_all_overrides() if fail_closed else []) + list(extra)
    server = AppServer(argv, app_server_env(home), str(home.user_home))
    server.initialize()
    return server


def start_thread(server: AppServer, workdir: Path, *, per_thread_profile: bool) -> str:
    params: dict[str, Any] = {"cwd": str(workdir)}
    if per_thread_profile:
        params["config"] = thread_config(workdir)
    started = server.request("thread/start", params)
    active = (started.get("activePermissionProfile") or {}).get("id")
    if active != PROFILE:
        raise RuntimeError(f"thread/start: activePermissionProfile {active!r}, not {PROFILE!r}")
    return started["thread"]["id"]


@dataclass
class Shape:
    per_server: int
    servers: list[AppServer]
    threads: list[tuple[AppServer, str]]  # (its app-server, thread id)


def build_shape(threads: int, per_server: int, tag: str) -> Shape:
    servers: list[AppServer] = []
    loaded: list[tuple[AppServer, str]] = []
    for s, count in enumerate(shape_layout(threads, per_server)):
        if per_server == 1:
            server, workdir = own_app_server(f"{tag}-{s}-0")
            servers.append(server)
            loaded.append((server, start_thread(server, workdir, per_thread_profile=False)))
            continue
        server = shared_app_server(f"{tag}-{s}-shared", fail_closed=True)
        servers.append(server)
        for t in range(count):
            loaded.append((server, start_thread(server, workdir_for(f"{tag}-{s}-{t}"), per_thread_profile=True)))
    burst(loaded, "hello")  # a rollout and a finished first turn on every thread
    return Shape(per_server=per_server, servers=servers, threads=loaded)


def burst(threads: list[tuple[AppServer, str]], text: str) -> tuple[float, list[float]]:
    """Start one turn on every thread at once; (turns/s, each turn's latency in ms). Raises on a failed turn."""
    first = time.monotonic()
    sent = [(server, thread, server.send_turn(thread, text)) for server, thread in threads]
    turns = [server.register_turn(thread, *s) for server, thread, s in sent]
    for t in turns:
        if not t.done.wait(TURN_TIMEOUT):
            raise TimeoutError("a burst turn did not complete")
        if t.status != "completed":
            raise RuntimeError(f"a burst turn ended {t.status}")
    last = max(t.finished for t in turns)
    return turns_per_second(len(turns), first, last), [(t.finished - t.sent) * 1000 for t in turns]


# ------------------------------------------------------------------------------------------- isolation

def _reached(output: str, *words: str) -> int:
    return int(any(w in output for w in words))


def isolation(stand_in_url: str) -> dict[str, float]:
    """The ``isolation_*`` figures (module docstring); 1 = the other session's data was reached."""
    from hermes_sessions.worker.warm.spares import UNLOAD_AT_ONCE

    f: dict[str, float] = {}
    server = shared_app_server("iso-shared", *UNLOAD_AT_ONCE)
    try:
        work = {name: workdir_for(f"iso-{name}") for name in ("a", "b")}
        words = {name: f"{name.upper()}WORD-{uuid.uuid4().hex}" for name in work}
        for name, w in work.items():
            (w / "secret.txt").write_text(words[name])
        thread = {name: start_thread(server, work[name], per_thread_profile=True) for name in work}
        server.turn(thread["b"], f"remember {words['b']}")  # B's words now in B's rollout, in the shared home
        server.turn(thread["a"], f"remember {words['a']}")
        # The model's context: nothing of B's (memories, history) reaches A's next request through the shared home.
        server.turn(thread["a"], "anything new?")
        requests = json.loads(urllib.request.urlopen(stand_in_url.rsplit("/v1", 1)[0] + "/__requests").read())
        a_bodies = [json.dumps(r.get("body")) for r in requests if (r.get("headers") or {}).get("thread-id") == thread["a"]]
        f["isolation_a_model_requests"] = len(a_bodies)
        f["isolation_b_words_in_a_model_requests"] = int(any(words["b"] in body for body in a_bodies))
        rollouts = {name: next(Path(os.environ["CODEX_HOMES_ROOT"]).rglob(f"rollout-*{thread[name]}.jsonl"))
                    for name in work}
        shared_home = rollouts["a"].parents[4]  # <home>/sessions/YYYY/MM/DD/rollout-….jsonl

        def probe(me: str, other: str, **overrides: Any) -> tuple[int, int, int]:
            """(read the other's work dir or rollout or found it in the shared home, read and wrote its own work dir,
            wrote into the other's work dir)."""
            cmd = (f"cat {work[other]}/secret.txt; cat {rollouts[other]}; grep -rl {words[other]} {shared_home}; "
                   f"ls {shared_home}/sessions; cat secret.txt; echo DONE")
            out = command_output(server.turn(thread[me], f"RUNCMD {cmd}", **overrides))
            target, own = (work[w] / f"from-{me}-{uuid.uuid4().hex[:6]}.txt" for w in (other, me))
            server.turn(thread[me], f"PATCHFILE {target} hello")
            server.turn(thread[me], f"PATCHFILE {own} hello")  # the control: a write in its own work dir lands
            return _reached(out, words[other]), _reached(out, words[me]) * own.exists(), int(target.exists())

        f["isolation_a_reads_b"], f["isolation_a_reads_own"], f["isolation_a_writes_b"] = probe("a", "b")
        f["isolation_b_reads_a"], f["isolation_b_reads_own"], f["isolation_b_writes_a"] = probe("b", "a")

        # Ways the per-thread profile is lost in a shared app-server.
        c_work = workdir_for("iso-c")
        c = server.request("thread/start", {"cwd": str(c_work)})
        f["isolation_no_config_thread_has_profile"] = int((c.get("activePermissionProfile") or {}).get("id") == PROFILE)
        out = command_output(server.turn(c["thread"]["id"], f"RUNCMD cat {work['b']}/secret.txt; echo DONE"))
        f["isolation_no_config_thread_reads_b"] = _reached(out, words["b"])

        server.request("thread/unsubscribe", {"threadId": thread["a"]})
        time.sleep(0.5)
        resumed = server.request("thread/resume", {"threadId": thread["a"], "excludeTurns": True})
        f["isolation_resume_without_config_profile_kept"] = int(
            (resumed.get("activePermissionProfile") or {}).get("id") == PROFILE)
        out = command_output(server.turn(thread["a"], f"RUNCMD cat {work['b']}/secret.txt; echo DONE"))
        f["isolation_resume_without_config_reads_b"] = _reached(out, words["b"])
        server.request("thread/unsubscribe", {"threadId": thread["a"]})
        time.sleep(0.5)
        resumed = server.request("thread/resume", {"threadId": thread["a"], "excludeTurns": True,
                                                   "config": thread_config(work["a"])})
        f["isolation_resume_with_config_profile_kept"] = int(
            (resumed.get("activePermissionProfile") or {}).get("id") == PROFILE)
        out = command_output(server.turn(thread["a"], f"RUNCMD cat {work['b']}/secret.txt; cat secret.txt; echo DONE"))
        f["isolation_resume_with_config_reads_b"] = _reached(out, words["b"])
        f["isolation_resume_with_config_reads_own"] = _reached(out, words["a"])

        out = command_output(server.turn(thread["b"], f"RUNCMD cat {work['a']}/secret.txt; echo DONE",
                                         sandboxPolicy={"type": "readOnly"}))
        f["isolation_turn_sandbox_policy_reads_a"] = _reached(out, words["a"])
    finally:
        server.close()

    server = shared_app_server("iso-closed", *UNLOAD_AT_ONCE, fail_closed=True)
    try:
        d = start_thread(server, work["a"], per_thread_profile=True)
        out = command_output(server.turn(d, "RUNCMD cat secret.txt; echo DONE"))
        f["isolation_fail_closed_configured_thread_reads_own"] = _reached(out, words["a"])
        probe_b = f"RUNCMD cat {work['b']}/secret.txt; cat {work['a']}/secret.txt; echo DONE"
        c = server.request("thread/start", {"cwd": str(work["a"])})
        f["isolation_fail_closed_no_config_thread_has_profile"] = int(
            (c.get("activePermissionProfile") or {}).get("id") == PROFILE)
        out = command_output(server.turn(c["thread"]["id"], probe_b))
        f["isolation_fail_closed_no_config_thread_reads_any"] = _reached(out, words["a"], words["b"])
        server.request("thread/unsubscribe", {"threadId": d})
        time.sleep(0.5)
        server.request("thread/resume", {"threadId": d, "excludeTurns": True})
        out = command_output(server.turn(d, probe_b))
        f["isolation_fail_closed_resume_without_config_reads_any"] = _reached(out, words["a"], words["b"])
    finally:
        server.close()
    return f


# ------------------------------------------------------------------------------------------- the run

def measure(*, threads: int = 50, per_server: tuple[int, ...] = (1, 10, 50), rounds: int = 3,
            warm_turns: int = 10, stand_in_url: str) -> dict[str, float]:
    """All figures (module docstring); Django must be set up (``_configure``)."""
    from hermes_sessions.worker.warm.process_memory import tree_memory

    f = isolation(stand_in_url)
    urllib.request.urlopen(urllib.request.Request(stand_in_url.rsplit("/v1", 1)[0] + "/__reset", method="POST"))
    witness, witness_work = own_app_server("witness")
    shapes: list[Shape] = []
    try:
        start_thread(witness, witness_work, per_thread_profile=False)
        for k in per_server:
            shape = build_shape(threads, k, f"s{k}")
            shapes.append(shape)
            time.sleep(SETTLE_SECONDS)
            mem = [tree_memory(s.proc.pid) for s in shape.servers]
            f[f"shape_{k}_app_servers"] = len(shape.servers)
            f[f"shape_{k}_private_kb_per_thread"] = round(per_thread_kb([m.private_kb for m in mem], threads))
            f[f"shape_{k}_pss_kb_per_thread"] = round(per_thread_kb([m.pss_kb for m in mem], threads))
        warm: dict[int, list[float]] = {k: [] for k in per_server}
        rates: dict[int, list[float]] = {k: [] for k in per_server}
        lat: dict[int, list[float]] = {k: [] for k in per_server}
        for r in range(rounds):
            order = shapes[r % len(shapes):] + shapes[:r % len(shapes)]
            for shape in order:
                for server, thread in shape.threads[:warm_turns]:
                    t = server.turn(thread, "warm")
                    warm[shape.per_server].append((t.finished - t.sent) * 1000)
            for shape in order:
                rate, ms = burst(shape.threads, "burst")
                rates[shape.per_server].append(rate)
                lat[shape.per_server] += ms
        for shape in shapes:
            first = time.monotonic()
            burst(shape.threads, "SLOW1 burst")
            f[f"shape_{shape.per_server}_slow_burst_s"] = round(time.monotonic() - first, 2)
        for k in per_server:
            f[f"shape_{k}_warm_turn_ms"] = round(statistics.median(warm[k]), 1)
            f[f"shape_{k}_turns_per_s"] = round(statistics.median(rates[k]), 1)
            f[f"shape_{k}_burst_p50_ms"] = round(statistics.median(lat[k]))
            f[f"shape_{k}_burst_max_ms"] = round(max(lat[k]))
    finally:
        for s in [witness, *(server for shape in shapes for server in shape.servers)]:
            s.close()
    f["threads"], f["rounds"] = threads, rounds
    return f


def print_figures(f: dict[str, float]) -> None:
    for name, value in f.items():
        print(f"{name}: {value:g}" if isinstance(value, (int, float)) else f"{name}: {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.bench_app_server_shapes",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, default=50)
    parser.add_argument("--per-server", default="1,10,50", help="threads per app-server, one shape each")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm-turns", type=int, default=10, help="concurrency-1 turns per shape and round")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="hermes-app-server-shapes-"))
    stand_in = subprocess.Popen(stand_in_argv(scratch / "stand_in.port"), cwd=BASE, stdout=subprocess.DEVNULL)
    try:
        port = wait_for_port_file(scratch / "stand_in.port", timeout=30,
                                  failed=lambda: None if stand_in.poll() is None else "the model stand-in exited")
        url = f"http://127.0.0.1:{port}/v1"
        _configure(scratch, url)
        print_figures(measure(threads=args.threads, per_server=tuple(int(k) for k in args.per_server.split(",")),
                              rounds=args.rounds, warm_turns=args.warm_turns, stand_in_url=url))
    finally:
        stand_in.terminate()
        stand_in.wait(timeout=10)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
