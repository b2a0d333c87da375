"""The figures ``make bench`` prints, computed from what it measured (pure: no stack, no database)."""
from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
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


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[float]:
    """``numerator[i] / denominator[i]`` for each pair of measurements taken side by side (same round,
    one right after the other), so drift of the machine between rounds cancels in each ratio."""
    if len(numerator) != len(denominator) or not numerator:
        raise ValueError("one denominator per numerator is needed")
    return [n / d for n, d in zip(numerator, denominator, strict=True)]


def median_ci_ranks(n: int, confidence: float = 0.95) -> tuple[int, int, float]:
    """Distribution-free confidence interval of a median of ``n`` values: 1-based ranks ``(lo, hi)`` of
    the sorted values that bound it and its exact coverage (binomial, p = ½). The widest choice,
    min–max, is returned when ``n`` is too small for ``confidence`` (its coverage is then below it)."""
    if n < 1:
        raise ValueError("no values")
    def miss(k: int) -> float:  # [x_(k), x_(n+1−k)] misses the median with 2·P(X ≤ k − 1), X ~ Binomial(n, ½)
        return 2 * sum(math.comb(n, j) for j in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) / 2 and miss(k + 1) <= 1 - confidence:
        k += 1
    coverage = 1 - miss(k)
    return k, n + 1 - k, coverage


def ratio_spread(ratios: Sequence[float]) -> dict[str, float | int]:
    """The median of per-pair ratios (``paired_ratios``) with what a reader needs to tell noise from a
    change: their quartiles (``q1``, ``q3``), ``min``/``max``, and the 95 % confidence interval of the
    median (``ci_low``, ``ci_high``, ``ci_coverage``: ``median_ci_ranks``); three decimals."""
    values = sorted(ratios)
    n = len(values)
    if not n:
        raise ValueError("no ratios")
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if n > 1 else (values[0],) * 3
    lo, hi, coverage = median_ci_ranks(n)
    return {"n": n, "median": round(statistics.median(values), 3), "q1": round(q1, 3), "q3": round(q3, 3),
            "min": round(values[0], 3), "max": round(values[-1], 3), "ci_low": round(values[lo - 1], 3),
            "ci_high": round(values[hi - 1], 3), "ci_coverage": round(coverage, 3)}


# --------------------------------------------------------------------------------------- where a turn's time goes

# The phases of a stack turn that ``turn_phases`` derives (all milliseconds).
PHASES = ("http_ms", "queue_ms", "claim_restore_ms", "codex_ms", "finalize_ms", "total_ms")


def epoch_seconds(value: str | float) -> float:
    """An API timestamp (ISO 8601, ``Z`` or an offset) or epoch seconds, as epoch seconds."""
    if isinstance(value, (int, float)):
        return float(value)
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def turn_phases(record: Mapping[str, Any]) -> dict[str, float]:
    """Where one stack turn's time went, in ms, from the client's wall-clock times and the turn as the
    API returned it (the API, the worker and the bench share this machine's clock).

    ``record``: ``post_start`` / ``post_end`` (epoch seconds around the ``POST``), ``seen`` (epoch
    seconds when the client's poll saw the terminal status), ``turn`` (its ``created_at``,
    ``started_at``, ``finished_at`` and ``timings``). Timings a turn lacks count 0 (a warm turn may have
    no ``restore_ms``, a turn that stored nothing no ``store_ms``).

    * ``http_ms``: the ``POST`` round trip (it also covers ``created_at``, so it overlaps ``queue_ms``);
    * ``queue_ms``: ``created_at`` → ``started_at`` (broker, Celery, until the worker's claim stamps it);
    * ``claim_restore_ms``: ``started_at`` → the app-server being asked for the turn (spawn onwards):
      ``run_ms − codex_ms − store_ms + restore_ms`` — the claim transaction after ``started_at`` and the
      restore, plus the finalize transaction's lock and transcript rows before the store (not separable
      from Turn rows);
    * ``codex_ms``: ``timings.codex_ms − restore_ms``: spawn or take an app-server, initialize, thread,
      turn, close/keep, read the appended rollout;
    * ``finalize_ms``: ``store_ms`` + ``finished_at`` → ``seen``: storing the rollout, the rest of the
      finalize transaction and its commit, and the client's poll (every 5 ms) seeing it;
    * ``total_ms``: ``post_start`` → ``seen``.

    ``queue_ms + claim_restore_ms + codex_ms + finalize_ms`` = ``created_at`` → ``seen``."""
    t = record["turn"]
    timings = t.get("timings") or {}

    def ms(key: str) -> float:
        value = timings.get(key)
        return float(value) if isinstance(value, (int, float)) else 0.0

    created, started, finished = (epoch_seconds(t[k]) for k in ("created_at", "started_at", "finished_at"))
    seen = epoch_seconds(record["seen"])
    run_ms = ms("run_ms") if "run_ms" in timings else (finished - started) * 1000
    codex_total, restore, store = ms("codex_ms"), ms("restore_ms"), ms("store_ms")
    out = {
        "http_ms": (epoch_seconds(record["post_end"]) - epoch_seconds(record["post_start"])) * 1000,
        "queue_ms": (started - created) * 1000,
        "claim_restore_ms": run_ms - codex_total - store + restore,
        "codex_ms": codex_total - restore,
        "finalize_ms": store + (seen - finished) * 1000,
        "total_ms": (seen - epoch_seconds(record["post_start"])) * 1000,
    }
    return {k: round(v, 1) for k, v in out.items()}


def phase_medians(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The median of each of ``PHASES`` over the turns (``turn_phases`` of each), ms, one decimal."""
    rows = [turn_phases(r) for r in records]
    if not rows:
        raise ValueError("no turns")
    return {k: round(statistics.median(r[k] for r in rows), 1) for k in PHASES}


# --------------------------------------------------------------------------------------- throughput and memory


def throughput(turns: int, seconds: float) -> float:
    """Turns per second, two decimals (``turns`` that ended in ``seconds`` of wall time)."""
    if seconds <= 0:
        raise ValueError("no time measured")
    return round(turns / seconds, 2)


def memory_growth(samples: Sequence[tuple[int, float]], warmup_turns: int, window: int = 5) -> dict[str, float]:
    """The worker's memory over a long run from ``samples`` ``(turns done, kB)`` in any order:
    ``after_warmup_kb`` = median of the first ``window`` samples taken at or after ``warmup_turns``,
    ``end_kb`` = median of the last ``window`` samples, ``growth`` = end / after warm-up (three
    decimals). Medians of a few samples, so one sample caught mid-allocation does not decide it.
    Raises ``ValueError`` when no sample is at or after the warm-up."""
    rows = sorted(samples)
    after = [kb for n, kb in rows if n >= warmup_turns]
    if not after:
        raise ValueError(f"no sample at or after {warmup_turns} turns")
    start = statistics.median(after[:window])
    end = statistics.median(after[-window:])
    return {"after_warmup_kb": round(start, 1), "end_kb": round(end, 1), "growth": round(end / start, 3)}


def parse_figures(text: str) -> dict[str, float]:
    """The ``name: value`` / ``name value`` lines of a bench's output whose value is a number (the rest
    of the line is commentary), e.g. ``{"ratio_vs_warm": 1.21}``; a name seen twice keeps its last."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _FIGURE.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


_FIGURE = re.compile(r"^([a-z][a-z0-9_]*):?\s+(-?\d+(?:\.\d+)?)(?:\s|$)")
