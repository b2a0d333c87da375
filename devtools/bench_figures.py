"""The figures ``make bench`` prints, computed from what it measured (pure: no stack, no database)."""
from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# The worker timings (ms, ``Turn.timings``) that the rollout store adds to a turn: restore the session's
# CODEX_HOME from PostgreSQL, read what codex appended, store it in the finalize transaction.
ROLLOUT_PHASES = ("restore_ms", "capture_ms", "store_ms")


def median_ms(seconds: Iterable[float]) -> float:
    """The median of durations in seconds, in milliseconds (one decimal)."""
    return round(statistics.median(list(seconds)) * 1000, 1)


def phase_median(timings: Iterable[Mapping[str, Any]], key: str) -> float | None:
    """The median of ``key`` over the turns' timings that have it (``None``: none has it)."""
    values = [float(t[key]) for t in timings if isinstance(t.get(key), (int, float))]
    return round(statistics.median(values), 1) if values else None


def rollout_overhead(stack_seconds: Sequence[float], timings: Sequence[Mapping[str, Any]]) -> dict[str, float | None]:
    """What restoring and storing rollouts cost a stack turn: the medians of ``ROLLOUT_PHASES`` and
    ``ratio_rollout_overhead`` = median(turn) / median(turn − restore − capture − store), each turn
    paired with its own timings (a phase a turn lacks counts 0)."""
    if len(stack_seconds) != len(timings) or not stack_seconds:
        raise ValueError("one timings dict per stack turn is needed")
    whole = [s * 1000 for s in stack_seconds]
    net = [w - sum(float(t.get(k) or 0) for k in ROLLOUT_PHASES) for w, t in zip(whole, timings, strict=True)]
    out: dict[str, float | None] = {k: phase_median(timings, k) for k in ROLLOUT_PHASES}
    out["ratio_rollout_overhead"] = round(statistics.median(whole) / statistics.median(net), 3)
    return out


def chunk_figures(chunks: Iterable[tuple[int, int, int]]) -> dict[str, float]:
    """Bytes stored per turn from one thread's chunks ``(seq, size, stored bytes)``: the medians over the
    turns that extended the rollout (``seq`` > 1) and the first turn's chunk (which holds codex's
    session header and base instructions) on its own."""
    rows = sorted(chunks)
    if not rows:
        raise ValueError("no rollout chunks")
    later = [r for r in rows if r[0] > 1] or rows
    raw = statistics.median(r[1] for r in later)
    stored = statistics.median(r[2] for r in later)
    first = rows[0] if rows[0][0] == 1 else (0, 0, 0)
    return {
        "chunk_bytes_raw_median": raw,
        "chunk_bytes_stored_median": stored,
        "chunk_stored_percent": round(100 * stored / raw, 1) if raw else 0.0,
        "first_chunk_bytes_raw": first[1],
        "first_chunk_bytes_stored": first[2],
        "turns": len(later),
    }


def ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float:
    """median(numerator) / median(denominator), three decimals."""
    return round(statistics.median(numerator) / statistics.median(denominator), 3)
