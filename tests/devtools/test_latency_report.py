"""``devtools.latency_report``: the hops of a turn from marks and the bench client's records."""
from __future__ import annotations

import json

from devtools import latency_report


def _marks(t0: float, turn: str, session: str) -> list[str]:
    def line(key: str, name: str, dt_ms: float, cpu: float, where: str) -> str:
        return f"{key} {name} {t0 + dt_ms / 1000:.6f} {cpu:.6f} {where}"
    return [
        line(session, "api.post.start", 3, 1.000, "10 hermes-request_0"),
        line(turn, "api.post.enqueued", 8, 1.002, "10 hermes-request_0"),
        line(turn, "wake.received", 7, 5.0, "20 hermes-wake"),
        line(turn, "claim.start", 7.5, 5.0, "20 hermes-wake"),
        line(turn, "claim.end", 10, 5.001, "20 hermes-wake"),
        line(turn, "codex.turn_start.sent", 11, 5.0015, "20 hermes-wake"),
        line(turn, "codex.turn_completed", 81, 5.003, "20 hermes-wake"),
        line(turn, "stream.terminal_frame", 90, 0, "10 MainThread"),
    ]


def test_hops_are_medians_over_turns_and_the_post_start_is_matched_by_time(tmp_path):
    lines, records = [], []
    for i, extra in enumerate((0.0, 2.0, 4.0)):  # three turns of one session, 1 s apart
        t0, turn = 1000.0 + i, f"turn{i}"
        lines += _marks(t0, turn, "s1")
        records.append({"turn": turn, "post_start": t0, "post_end": t0 + 0.012, "seen": t0 + (91 + extra) / 1000,
                        "direct_start": t0 + 0.2, "direct_end": t0 + 0.27})
    marks = latency_report.parse_marks("\n".join(lines))
    hops = {(a, b): (round(wall, 2), None if cpu is None else round(cpu, 2), n)
            for a, b, wall, cpu, n in latency_report.hop_medians(marks, records)}
    assert hops[("post_start", "api.post.start")] == (3.0, None, 3)
    assert hops[("api.post.start", "api.post.enqueued")] == (5.0, 2.0, 3)  # one thread: its CPU too
    assert hops[("claim.start", "claim.end")] == (2.5, 1.0, 3)
    assert hops[("stream.terminal_frame", "seen")] == (3.0, None, 3)  # the middle of 1, 3 and 5 ms
    assert ("codex.turn_start.answered", "codex.turn_completed") not in hops  # a mark no turn has: no hop


def test_main_reads_the_records_beside_the_marks(tmp_path, capsys):
    path = tmp_path / "marks"
    path.write_text("\n".join(_marks(1000.0, "turn0", "s1")) + "\n")
    records = [{"turn": {"id": "turn0"}, "post_start": 1000.0, "post_end": 1000.01, "seen": 1000.093,
                "direct_start": 1000.2, "direct_end": 1000.27, "seconds": 0.093}]
    written = latency_report.write_records(path, records)
    assert json.loads(written.read_text())[0]["turn"] == "turn0"
    assert latency_report.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "turns: 1" in out and "POST → terminal event read: 93.00 ms" in out
    assert "stack turn/start → turn/completed: 70.00 ms" in out and "direct warm turn: 70.00 ms" in out
