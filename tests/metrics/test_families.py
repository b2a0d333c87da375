"""The names outside the code agree with ``hermes_sessions/metrics/families.py``: every expression of the
Grafana dashboard names only metrics ``GET /metrics`` serves, and the operator's docs list every family."""
from __future__ import annotations

import json
import re
from pathlib import Path

from hermes_sessions.metrics.families import FAMILIES, sample_names

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\bhermes_[a-z_]+\b")


def _exprs(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "expr" and isinstance(v, str)] + [
            e for v in node.values() for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def test_every_dashboard_expression_names_served_metrics():
    dashboard = json.loads((ROOT / "deploy/grafana/hermes-sessions.json").read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 14
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used and used <= sample_names(), sorted(used - sample_names())
    on_dashboard = {f.name for f in FAMILIES if used & set(f.sample_names())}
    assert on_dashboard == {f.name for f in FAMILIES}


def test_the_operating_docs_list_every_family():
    docs = (ROOT / "docs/operating.md").read_text()
    section = docs[docs.index("## 11. Metrics"):]
    missing = [f.name for f in FAMILIES if f"`{f.name}" not in section]
    assert missing == []
