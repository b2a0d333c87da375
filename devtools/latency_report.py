"""Where a warm turn's time goes, hop by hop, from ``hermes_sessions/latency_marks.py``'s marks.

``HERMES_LATENCY_MARKS=/tmp/marks make bench-warm`` writes the stack's marks to ``/tmp/marks`` and the
bench client's records (``post_start``, ``post_end``, ``seen``, the direct turn's ``direct_start`` /
``direct_end``, epoch seconds) to ``/tmp/marks.records.json``; then::

    python -m devtools.latency_report /tmp/marks

prints, for the measured turns, the median of each hop from the client's ``POST`` to its reading of the
terminal event (wall ms, and the CPU ms of the thread that marked both ends where it is one thread), and
the direct turn beside the stack's ``turn/start`` → ``turn/completed``. The ``POST``'s first mark carries
the session's id, not the turn's (no turn exists yet): it is matched as the first one after the record's
``post_start``.
"""
from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

# The hops of a woken warm turn, in order (names as marked; post_start / seen are the client's).
HOPS = ["post_start", "api.post.start", "api.post.enqueued", "wake.received", "claim.start", "claim.end",
        "codex.turn_start.sent", "codex.turn_start.answered", "codex.turn_completed", "rollout.capture.start",
        "finalize.start", "finalize.end", "stream.terminal_frame", "seen"]


def write_records(marks: Path, records: list[dict[str, Any]]) -> Path:
    """Write the bench client's ``records`` (``StackClient.timed_turn``'s, plus the direct turn's times)
    beside ``marks`` as ``<marks>.records.json``: the turn as its id. Returns that path."""
    out = marks.with_name(marks.name + ".records.json")
    rows = [{k: (str(v["id"]) if k == "turn" else v) for k, v in r.items() if k in (
        "turn", "post_start", "post_end", "seen", "direct_start", "direct_end")} for r in records]
    out.write_text(json.dumps(rows))
    return out


Mark = tuple[float, float, str]  # (epoch s, thread CPU s, "<pid> <thread>")


def parse_marks(text: str) -> dict[str, dict[str, Mark]]:
    """``{key: {name: Mark}}`` — the first mark of each name per key, except ``api.post.start`` (keyed by
    the session, one per ``POST``): all of those under the key ``"api.post.start"``, by their order."""
    found: dict[str, dict[str, Mark]] = defaultdict(dict)
    for line in text.splitlines():
        parts = line.split(" ", 5)
        if len(parts) < 6:
            continue
        key, name, at, cpu, pid, thread = parts
        if name == "api.post.start":
            key, name = name, str(len(found[name]))
        found[key].setdefault(name, (float(at), float(cpu), f"{pid} {thread}"))
    return found


def hop_medians(marks: dict[str, dict[str, Mark]], records: list[dict[str, Any]]
                ) -> list[tuple[str, str, float, float | None, int]]:
    """``(from, to, median wall ms, median CPU ms or None, turns)`` for each consecutive pair of ``HOPS``."""
    starts = sorted(marks.get("api.post.start", {}).values())
    rows: list[dict[str, Mark]] = []
    for r in records:
        per = dict(marks.get(r["turn"], {}))
        per["post_start"], per["seen"] = (r["post_start"], 0.0, "client"), (r["seen"], 0.0, "client")
        i = bisect.bisect_left(starts, (r["post_start"],))
        if i < len(starts):
            per["api.post.start"] = starts[i]
        rows.append(per)
    out = []
    for a, b in zip(HOPS, HOPS[1:], strict=False):
        pairs = [(p[a], p[b]) for p in rows if a in p and b in p]
        if not pairs:
            continue
        wall = statistics.median((y[0] - x[0]) * 1000 for x, y in pairs)
        same = [(y[1] - x[1]) * 1000 for x, y in pairs if x[2] == y[2] and x[2] != "client"]
        out.append((a, b, wall, statistics.median(same) if len(same) == len(pairs) else None, len(pairs)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.latency_report", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("marks", type=Path)
    args = parser.parse_args(argv)
    records = json.loads(args.marks.with_name(args.marks.name + ".records.json").read_text())
    marks = parse_marks(args.marks.read_text())
    print(f"turns: {len(records)}")
    for a, b, wall, cpu, n in hop_medians(marks, records):
        print(f"  {a:>26} → {b:<26} {wall:7.2f} ms" + (f"  (cpu {cpu:.2f})" if cpu is not None else "") + f"  n={n}")
    total = [(r["seen"] - r["post_start"]) * 1000 for r in records]
    direct = [(r["direct_end"] - r["direct_start"]) * 1000 for r in records if "direct_end" in r]
    codex = [(m["codex.turn_completed"][0] - m["codex.turn_start.sent"][0]) * 1000 for m in
             (marks.get(r["turn"], {}) for r in records) if "codex.turn_completed" in m and "codex.turn_start.sent" in m]
    print(f"  POST → terminal event read: {statistics.median(total):.2f} ms")
    if codex:
        print(f"  stack turn/start → turn/completed: {statistics.median(codex):.2f} ms")
    if direct:
        print(f"  direct warm turn: {statistics.median(direct):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
