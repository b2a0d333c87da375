"""The API does what its schema says: schemathesis (pinned in requirements.txt) against the live app
and the schema it serves at ``/api/schema/``, with every check and every phase — examples, coverage,
fuzzing and the stateful phase — finding 0 failures.

* Two users (``alice``, ``bob``) are given as peers, so ``object_level_authorization`` replays one
  user's reads as the other (invariant I7); ``ignored_auth`` drops or spoils the token.
* Turns posted during the run are held (``tests/support/dispatch.py``): they stay queued, no codex
  runs. The run posts, lists, reads and cancels turns like any client.
* Operations whose path ends in ``/events/`` (server-sent events) are excluded: their bodies never
  end while a turn can still run, so a checker that reads the body to its end waits forever; they
  have tests of their own.
* ``EXAMPLES_PER_OPERATION`` and ``SEED`` keep the run reproducible and time-boxed (docs/development.md).
  One worker: with two, the generators run in threads, and hypothesis reading a filter's lambda
  source in both at once failed a run here with CPython 3.11.7's "AST constructor recursion depth
  mismatch" (a tool error, not an API failure, but a red run all the same).
* Webhook endpoints it registers are refused unless their URL resolves to public addresses (the
  run's hosts do not resolve, or are private), and no worker runs: nothing is ever sent.
* One setting names a status the check does not assume: on the two POSTs that take an
  ``Idempotency-Key``, a key reused with another body is answered 422 (documented on both; the
  status the IETF idempotency-key draft gives), which ``positive_data_acceptance`` would otherwise
  count as a refused valid request — the run reuses short keys across bodies by design.

Each failure this run found was fixed in the product and is kept as a regular test in
``tests/api/test_contract.py``.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from rest_framework.authtoken.models import Token

from hermes_sessions.models import Turn, WebhookAttempt
from tests.factories import UserFactory
from tests.support.dispatch import hold_dispatches

pytestmark = pytest.mark.django_db(transaction=True)  # the live server reads rows from its own connection

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
EXAMPLES_PER_OPERATION = 50
SEED = 20261130
EXCLUDED_PATHS = r"/events/$"
# The 2xx/3xx/4xx a valid request may get by default in schemathesis 4.32, plus 422 (see above).
ACCEPTED_WITH_IDEMPOTENCY = ["2xx", "3xx", "401", "403", "404", "409", "422", "429", "5xx"]
# A webhook's URL is checked by resolving its host (private, loopback, link-local targets and names that do
# not resolve are 400, documented): no schema can say which strings pass, so a valid body may get 400.
ACCEPTED_WEBHOOK_WRITES = ["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]

CONFIG = """
seed = {seed}
workers = 1
[generation]
max-examples = {examples}
database = "none"
[auth.wfc]
path = "{auth}"
peers = ["alice", "bob"]
# First: the first block that applies to an operation wins, and a block's filters are ORed (the next one
# applies to every POST).
[[operations]]
include-path-regex = "^/api/webhooks/"
checks.positive_data_acceptance.expected-statuses = {accepted_webhooks}
[[operations]]
include-path-regex = "^/api/sessions/(\\\\{{session_id\\\\}}/turns/)?$"
include-method = "POST"
checks.positive_data_acceptance.expected-statuses = {accepted}
"""


def _write_config(tmp_path: Path) -> Path:
    """Two users with tokens (a WFC auth file) and the run's settings; returns the config's path."""
    users = {name: Token.objects.create(user=UserFactory(username=f"st-{name}")).key for name in ("alice", "bob")}
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auth": [
        {"name": name, "fixedHeaders": [{"name": "Authorization", "value": f"Token {key}"}]} for name, key in users.items()
    ]}))
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG.format(seed=SEED, examples=EXAMPLES_PER_OPERATION, auth=auth,
                                    accepted=json.dumps(ACCEPTED_WITH_IDEMPOTENCY),
                                    accepted_webhooks=json.dumps(ACCEPTED_WEBHOOK_WRITES)))
    return config


def _tested_operations(junit: Path) -> set[str]:
    """``"METHOD /path"`` of every operation the JUnit report has a test case for."""
    names = {case.get("name", "") for case in ET.parse(junit).getroot().iter("testcase")}
    return {name for name in names if re.match(r"^[A-Z]+ /", name)}


def _schema_operations(live_server_url: str) -> set[str]:
    import urllib.request

    with urllib.request.urlopen(f"{live_server_url}/api/schema/?format=json") as response:
        schema = json.load(response)
    return {f"{method.upper()} {path}" for path, item in schema["paths"].items() for method in item}


def test_schemathesis_finds_no_failures(django_db_setup, live_server, monkeypatch, tmp_path, settings):
    # django_db_setup first: the live server then stops before the test database is dropped.
    held = hold_dispatches(monkeypatch)
    settings.HERMES_WEBHOOK_ALLOW_PRIVATE, settings.HERMES_WEBHOOK_ALLOWED_NETWORKS = False, []  # nothing internal
    config = _write_config(tmp_path)
    junit = tmp_path / "junit.xml"
    command = [
        str(SCHEMATHESIS), "--config-file", str(config), "run", f"{live_server.url}/api/schema/?format=json",
        "--checks", "all", "--phases", "examples,coverage,fuzzing,stateful",
        "--exclude-path-regex", EXCLUDED_PATHS,
        "--report", "junit", "--report-junit-path", str(junit), "--no-color",
    ]
    started = time.monotonic()
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=420)
    elapsed = time.monotonic() - started
    # Reproduction commands can hold megabyte bodies on one line: cut lines, keep the whole report.
    report = "\n".join(line[:400] for line in (run.stdout + run.stderr).splitlines())
    print(report[-3000:])
    print(f"schemathesis: {EXAMPLES_PER_OPERATION} examples per operation, seed {SEED}: {elapsed:.0f} s")
    assert run.returncode == 0, report[-20000:]
    # Until the SSE operations land, the /events/ filter matches nothing: a warning, not a failure.
    counts = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert counts and counts[1] == counts[2] and int(counts[1]) > 0, report[-20000:]
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅\s+{phase}", run.stdout), f"phase {phase} did not pass: {report[-5000:]}"

    # Every operation of the schema but the excluded ones was tested, and none of those.
    expected = {op for op in _schema_operations(live_server.url) if not re.search(EXCLUDED_PATHS, op.split(" ", 1)[1])}
    assert _tested_operations(junit) == expected
    # The run really posted turns, and none of them ran codex: each stayed queued or was cancelled.
    assert held and Turn.objects.exists()
    assert set(Turn.objects.values_list("status", flat=True)) <= {Turn.Status.QUEUED, Turn.Status.CANCELLED}
    # Webhooks it registered (public targets only) were never sent: no worker runs in this test.
    assert not WebhookAttempt.objects.exists()
