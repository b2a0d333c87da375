"""Sessions as JSON Lines: ``manage.py export_sessions`` writes one line per session,
``manage.py import_sessions`` reads them back into another (or the same, wiped) database.

A line holds everything needed to continue the session (``docs/contract.md`` I8): its transcript,
turns, codex bindings, notices and its threads' stored rollouts, so an imported session's next turn
resumes its codex thread instead of rotating. Shape (``FORMAT``; every column of each model except
auto ids other than a notice's (kept: the API names notices by id) and the parent link; times ISO 8601 with microseconds and offset, UUIDs as strings)::

    {"format": "hermes_sessions.session/1",
     "session":  {id, owner (username), title, model_config, last_message_seq, last_turn_seq, created_at, updated_at},
     "turns":    [{id, seq, status, input, thread_action, …, created_by (username | null), …}],
     "messages": [{seq, turn (turn id | null), role, content, tool_calls, …, created_at}],
     "bindings": [{thread_id, status, created_at, created_by_turn, ended_at, ended_reason, ended_by_turn}],
     "notices":  [{id, turn, kind, text, created_at, acknowledged_at, acknowledged_by (username | null)}],
     "rollouts": [{thread_id, relpath, length, sha256, generation, codex_version, updated_at,
                   "chunks": [{seq, offset, size, compression, data (base64 of the stored bytes), sha256, created_at}]}]}

Import is one transaction per line: a line is imported whole or not at all. A line is trusted no
more than an API request: it is refused (``ImportRefused``, nothing written) when it is over
``MAX_LINE_BYTES`` (64 MiB, refused before parsing), not JSON or not that shape — types, lengths
(a turn's ``input`` at most the API's ``MAX_INPUT_CHARS``), integer ranges, no NUL or unpaired
surrogate, a rollout ``relpath`` under ``sessions/`` (``_field_schema``) —, has a ``model_config`` the
API's policy refuses for its owner (``policy.validate_model_config``: a staff-only sandbox for a
non-staff owner, a ``cwd``), names an owner that does
not exist here, has counters behind its rows (``last_message_seq`` / ``last_turn_seq``), holds a
queued or running turn (its worker state would not survive the move), refers to a turn it does not
hold, holds a rollout whose chunks do not add up to its sha256, or collides with rows already here (a
thread or turn id of another session), or any database error its rows raise (that line only: the
next lines still import). A session id that exists already is skipped or refused, as
the caller chooses. Turn events (``docs/contract.md`` §8) are not carried: import writes each
finished turn's terminal event (new ids, in turn order), so its stream ends as it did. Other users a line names (who ran a turn, who acknowledged
a notice) are matched by username; one that does not exist here becomes null.
"""
from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError
from django.db import DatabaseError, connection, models, transaction
from django.db.backends.base.operations import BaseDatabaseOperations
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from .. import policy, selectors
from ..codex.rollout_files import RolloutDiverged
from ..models import CodexBinding, CodexRollout, Message, Notice, RolloutChunk, Session, Turn, session_id_validator
from ..sanitize import clean_text
from ..sql import query
from .bindings import binding_history_insert
from .events import event_terminal
from .locks import advisory_xact_lock
from .rollouts import rollout_insert_verified
from .turns import MAX_INPUT_CHARS
from .verbatim import rows_insert_verbatim

FORMAT = "hermes_sessions.session/1"
ON_EXISTING = ("skip", "refuse")


class ImportRefused(Exception):
    """One line could not be imported; ``str(exc)`` says why. Nothing of that line was written."""


@dataclass(frozen=True)
class _Section:
    """How one model's rows appear in a line: every concrete column except ``skip``; the foreign
    keys in ``users`` as usernames, other foreign keys as the target's id."""

    model: type[models.Model]
    skip: frozenset[str] = frozenset()
    users: frozenset[str] = frozenset()

    def fields(self) -> list[models.Field]:
        # A generated column is computed by the database from the others: neither exported nor written.
        return [f for f in self.model._meta.concrete_fields
                if f.name not in self.skip and not getattr(f, "generated", False)]


SESSION = _Section(Session, users=frozenset({"owner"}))
TURN = _Section(Turn, skip=frozenset({"session"}), users=frozenset({"created_by"}))
MESSAGE = _Section(Message, skip=frozenset({"id", "session"}))
BINDING = _Section(CodexBinding, skip=frozenset({"id", "session"}))
NOTICE = _Section(Notice, skip=frozenset({"session"}), users=frozenset({"acknowledged_by"}))
ROLLOUT = _Section(CodexRollout, skip=frozenset({"id", "session"}))
CHUNK = _Section(RolloutChunk, skip=frozenset({"id", "rollout"}))
LISTS = {"turns": TURN, "messages": MESSAGE, "bindings": BINDING, "notices": NOTICE}


# --- export --------------------------------------------------------------------------------------

def _json_value(f: models.Field, obj: models.Model, users: frozenset[str]) -> Any:
    if f.name in users:
        user = getattr(obj, f.name)
        return None if user is None else user.get_username()
    value = f.value_from_object(obj)
    if value is None or isinstance(f, models.JSONField):
        return value
    if isinstance(f, models.BinaryField):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(f, models.DateTimeField):
        return value.isoformat()  # full microseconds (DjangoJSONEncoder would cut them to milliseconds)
    if isinstance(f, (models.UUIDField, models.ForeignKey)):
        return str(value)
    return value


def _row(section: _Section, obj: models.Model) -> dict[str, Any]:
    return {f.name: _json_value(f, obj, section.users) for f in section.fields()}


def session_export_record(*, session_id: str) -> dict[str, Any] | None:
    """One session as the dict a line holds (module docstring), or ``None`` when it no longer
    exists. Read in one snapshot (``REPEATABLE READ`` when not already inside a transaction), session
    row included, so a turn ending meanwhile cannot leave its rows half in the line."""
    with transaction.atomic():
        if len(connection.atomic_blocks) == 1:
            with connection.cursor() as cursor:
                cursor.execute(query("transaction_repeatable_read"))
        session = Session.objects.select_related("owner").filter(pk=session_id).first()
        if session is None:
            return None
        return {
            "format": FORMAT,
            "session": _row(SESSION, session),
            "turns": [_row(TURN, t) for t in selectors.turn_list(session=session).select_related("created_by")],
            "messages": [_row(MESSAGE, m) for m in selectors.message_list(session=session).iterator(chunk_size=2_000)],
            "bindings": [_row(BINDING, b) for b in selectors.binding_list(session=session)],
            "notices": [_row(NOTICE, n) for n in selectors.notice_list(session=session).select_related("acknowledged_by")],
            "rollouts": [
                {**_row(ROLLOUT, r), "chunks": [_row(CHUNK, c) for c in selectors.rollout_chunk_list(rollout=r)]}
                for r in selectors.rollout_list(session=session)
            ],
        }


class ExportRefused(Exception):
    """A session that import would refuse (a queued or running turn); ``str(exc)`` names the session
    and the turn. ``manage.py export_sessions`` skips it with a warning and exits 1."""


def session_export_line(*, session_id: str) -> str | None:
    """``session_export_record`` as one line of compact JSON (no trailing newline; UTF-8 text kept
    as is, so a line may be long: a 100,000-message session is one line); ``None`` when the session
    no longer exists (pruned while the export ran). Raises ``ExportRefused`` when the snapshot holds a
    queued or running turn: import would refuse the line (its worker state would not survive)."""
    record = session_export_record(session_id=session_id)
    if record is None:
        return None
    active = [t for t in record["turns"] if t["status"] in (Turn.Status.QUEUED, Turn.Status.RUNNING)]
    if active:
        raise ExportRefused(f"session {session_id}: turn {active[0]['id']} is {active[0]['status']}; "
                            "export it again once its turns ended")
    return json.dumps(record, ensure_ascii=False, separators=(",", ":"))


# --- import: shape -------------------------------------------------------------------------------

_INTEGER_FIELDS = (models.IntegerField, models.AutoField)

#: A line longer than this many bytes is refused before it is parsed (``manage.py import_sessions``
#: reads at most this much of it). 64 MiB: a long session's transcript and rollouts fit; a session
#: exported bigger than this has to be imported with a raised limit (change the constant).
MAX_LINE_BYTES = 64 * 1024 * 1024

# Every string a line holds is text PostgreSQL and psycopg can store: no NUL, no unpaired surrogate.
_SAFE_TEXT = "^[^\x00\ud800-\udfff]*$"
_BASE64 = "^[A-Za-z0-9+/]*={0,2}$"
# A stored rollout lives under CODEX_HOME/sessions/ (codex/rollout_files.py): relative, no "." or ".."
# segment, a rollout-*.jsonl file name (its thread id is checked in _build).
_RELPATH = r"^sessions/(?:(?!\.\.?/)[^/\x00\\]+/)*rollout-[^/\x00\\]+\.jsonl$"
# JSON columns: the type the code reading them expects (a wrong one made the turn pages 500).
_JSON_TYPES: dict[tuple[type[models.Model], str], str] = {
    (Session, "model_config"): "object",
    (Turn, "codex_methods"): "array",
    (Turn, "usage"): "object",
    (Turn, "timings"): "object",
    (Message, "tool_calls"): "array",
}
# Text the API bounds: an import line may not hold more than a request could have.
_MAX_CHARS: dict[tuple[type[models.Model], str], int] = {(Turn, "input"): MAX_INPUT_CHARS}


def _field_schema(f: models.Field, users: frozenset[str]) -> dict[str, Any]:
    """The JSON schema of one column's value: the type, and the bounds PostgreSQL or the API would
    enforce (length, integer range, no NUL), so a line the database or the API would refuse is
    refused whole before anything is written."""
    schema: dict[str, Any]
    key = (f.model, f.name)
    if isinstance(f, models.JSONField):
        schema = {"type": _JSON_TYPES[key]} if key in _JSON_TYPES else {}
    elif f.name not in users and isinstance(f, _INTEGER_FIELDS) and not isinstance(f, models.ForeignKey):
        # Django's standard column ranges (PostgreSQL's): the bounds the database would enforce.
        _low, high = BaseDatabaseOperations.integer_field_ranges[f.get_internal_type()]
        schema = {"type": "integer", "minimum": 0, "maximum": high}  # seqs, counters, sizes, offsets
    elif isinstance(f, models.BinaryField):
        schema = {"type": "string", "pattern": _BASE64}
    else:
        schema = {"type": "string", "pattern": _SAFE_TEXT}
        limit = _MAX_CHARS.get(key, f.max_length if isinstance(f, models.CharField) else None)
        if limit is not None:
            schema["maxLength"] = limit
        if key == (CodexRollout, "relpath"):
            schema["pattern"] = _RELPATH
    if f.choices:
        schema["enum"] = [value for value, _label in f.flatchoices] + ([""] if f.blank else [])
    return {"anyOf": [schema, {"type": "null"}]} if f.null else schema


def _may_be_absent(f: models.Field) -> bool:
    # A column added after an export was made: the row gets the model's default (or "now"), so exports
    # stay importable across additive migrations; a key the model does not know is refused.
    if f.primary_key:  # ids are what makes a second import of the same line a no-op
        return isinstance(f, (models.AutoField, models.BigAutoField, models.SmallAutoField))  # a notice's id, absent from older exports: a new one
    if f.blank and f.empty_strings_allowed:  # a text column that may be empty: Django's default is ""
        return True
    return f.has_default() or f.null or bool(getattr(f, "auto_now", False) or getattr(f, "auto_now_add", False))


def _object_schema(section: _Section, **extra: Any) -> dict[str, Any]:
    properties = {f.name: _field_schema(f, section.users) for f in section.fields()} | extra
    required = sorted({f.name for f in section.fields() if not _may_be_absent(f)} | set(extra))
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


def _line_schema() -> dict[str, Any]:
    lists = {key: {"type": "array", "items": _object_schema(section)} for key, section in LISTS.items()}
    chunks = {"type": "array", "items": _object_schema(CHUNK)}
    properties = {
        "format": {"const": FORMAT},
        "session": _object_schema(SESSION),
        **lists,
        "rollouts": {"type": "array", "items": _object_schema(ROLLOUT, chunks=chunks)},
    }
    return {"type": "object", "required": sorted(properties), "properties": properties, "additionalProperties": False}


_VALIDATOR = Draft202012Validator(_line_schema())


def _parse(line: str | bytes) -> dict[str, Any]:
    if isinstance(line, bytes):
        size = len(line) - line.endswith(b"\n")
    else:
        size = len(line.encode("utf-8", "surrogatepass")) - line.endswith("\n")
    if size > MAX_LINE_BYTES:
        raise ImportRefused(f"the line is over {MAX_LINE_BYTES} bytes (portability.MAX_LINE_BYTES); not parsed")
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ImportRefused(f"not JSON: {exc}") from exc
    try:
        error = best_match(_VALIDATOR.iter_errors(record))
    except RecursionError as exc:
        raise ImportRefused("nested too deeply to check") from exc
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the line"
        if error.validator == "pattern" and error.validator_value == _SAFE_TEXT:
            message = "holds a NUL or an unpaired surrogate, which PostgreSQL cannot store"
        elif error.validator == "pattern" and error.validator_value == _RELPATH:
            message = "is not a relative path to a rollout-*.jsonl file under sessions/"
        elif error.validator == "maxLength":
            message = f"is longer than {error.validator_value} characters"
        else:
            message = error.message[:300]
        raise ImportRefused(clean_text(f"{where}: {message}"))  # the message may quote the bad value
    return record


# --- import: rows --------------------------------------------------------------------------------

def _instance(section: _Section, data: dict[str, Any], users: dict[str, Any], **parent: Any) -> Any:
    values: dict[str, Any] = dict(parent)
    for f in section.fields():
        if f.name not in data:  # allowed by the schema only when the model has a default (_may_be_absent)
            continue
        raw = data[f.name]
        if f.name in section.users:
            user = users.get(raw) if raw is not None else None
            values[f.attname] = None if user is None else user.pk
        elif raw is None or isinstance(f, models.JSONField):
            if _json_unsafe(raw):  # jsonb refuses \u0000; psycopg cannot encode a lone surrogate
                raise ValueError(f"{section.model.__name__.lower()} {f.name} holds a NUL or an unpaired surrogate")
            values[f.attname] = raw
        elif isinstance(f, models.BinaryField):
            values[f.attname] = base64.b64decode(raw, validate=True)
        else:
            values[f.attname] = f.to_python(raw)  # ISO times → aware datetimes, ids → UUIDs
    return section.model(**values)


def _json_unsafe(value: Any) -> bool:
    if isinstance(value, str):
        return _UNSAFE_TEXT.search(value) is not None
    if isinstance(value, dict):
        return any(_json_unsafe(k) or _json_unsafe(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_json_unsafe(v) for v in value)
    return False


_UNSAFE_TEXT = re.compile(_SAFE_TEXT.replace("^[^", "[").removesuffix("]*$") + "]")


@dataclass
class _Rows:
    session: Session
    turns: list[Turn] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    bindings: list[CodexBinding] = field(default_factory=list)
    notices: list[Notice] = field(default_factory=list)
    rollouts: list[tuple[CodexRollout, list[RolloutChunk]]] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        return {"messages": len(self.messages), "turns": len(self.turns), "bindings": len(self.bindings),
                "notices": len(self.notices), "rollouts": len(self.rollouts)}


def _users(record: dict[str, Any]) -> dict[str, Any]:
    names = {record["session"]["owner"]}
    names |= {t["created_by"] for t in record["turns"]} | {n["acknowledged_by"] for n in record["notices"]}
    found = {u.get_username(): u for u in get_user_model()._default_manager.filter(username__in=names - {None})}
    owner = record["session"]["owner"]
    if owner not in found:
        raise ImportRefused(f"owner {owner!r} does not exist here; create that user first")
    return found


def _check_model_config(record: dict[str, Any], users: dict[str, Any]) -> None:
    # An import line is trusted no more than an API request (docs/contract.md I8): the session's
    # codex settings pass the policy the API applies for its owner (policy.validate_model_config), so a
    # line cannot hand a non-staff owner a staff-only sandbox or a server-assigned cwd.
    owner = users[record["session"]["owner"]]
    try:
        policy.validate_model_config(record["session"]["model_config"], is_staff=bool(owner.is_staff))
    except policy.PolicyError as exc:
        raise ImportRefused(f"session/model_config/{exc.field}: {exc} (owner {owner.get_username()!r}, "
                            f"{'staff' if owner.is_staff else 'not staff'}; the API's policy applies)") from exc


def _build(record: dict[str, Any]) -> _Rows:
    users = _users(record)
    _check_model_config(record, users)
    try:
        session_id_validator(record["session"]["id"])
        rows = _Rows(session=_instance(SESSION, record["session"], users))
        sid = {"session_id": rows.session.pk}
        rows.turns = [_instance(TURN, t, users, **sid) for t in record["turns"]]
        rows.messages = [_instance(MESSAGE, m, users, **sid) for m in record["messages"]]
        rows.bindings = [_instance(BINDING, b, users, **sid) for b in record["bindings"]]
        rows.notices = [_instance(NOTICE, n, users, **sid) for n in record["notices"]]
        rows.rollouts = [
            (_instance(ROLLOUT, r, users, **sid), [_instance(CHUNK, c, users) for c in r["chunks"]])
            for r in record["rollouts"]
        ]
        for rollout, _chunks in rows.rollouts:
            if not rollout.relpath.endswith(f"-{rollout.thread_id}.jsonl"):
                raise ValueError(f"rollout relpath {rollout.relpath!r} does not name thread {rollout.thread_id}")
    except (ValidationError, binascii.Error, ValueError, RecursionError) as exc:
        raise ImportRefused(f"bad value: {exc}") from exc
    _check_turns(rows)
    _check_counters(rows)
    return rows


def _check_counters(rows: _Rows) -> None:
    # The session's counters hand out the next seq; one behind its rows would make the next turn collide.
    last_message = max((m.seq for m in rows.messages), default=0)
    last_turn = max((t.seq for t in rows.turns), default=0)
    if rows.session.last_message_seq < last_message or rows.session.last_turn_seq < last_turn:
        raise ImportRefused(f"session counters (last_message_seq {rows.session.last_message_seq}, last_turn_seq "
                            f"{rows.session.last_turn_seq}) are behind its rows (message {last_message}, turn {last_turn})")


def _check_turns(rows: _Rows) -> None:
    active = [t for t in rows.turns if t.status in (Turn.Status.QUEUED, Turn.Status.RUNNING)]
    if active:
        raise ImportRefused(f"turn {active[0].pk} is {active[0].status}; export the session again once its turns ended")
    known = {t.pk for t in rows.turns}
    if len(known) != len(rows.turns):
        raise ImportRefused("a turn id appears twice")
    refs = [m.turn_id for m in rows.messages] + [n.turn_id for n in rows.notices]
    refs += [b.created_by_turn_id for b in rows.bindings] + [b.ended_by_turn_id for b in rows.bindings]
    dangling = {r for r in refs if r is not None} - known
    if dangling:
        raise ImportRefused(f"refers to turn {sorted(map(str, dangling))[0]}, which the line does not hold")


def _insert(rows: _Rows) -> None:
    rows_insert_verbatim([rows.session])
    rows_insert_verbatim(rows.turns)
    for turn in sorted(rows.turns, key=lambda t: t.seq):
        if turn.status in Turn.TERMINAL:  # its stream (docs/contract.md §8) ends with it; new ids, in order
            event_terminal(turn=turn)
    rows_insert_verbatim(rows.messages)
    binding_history_insert(bindings=rows.bindings, notices=rows.notices)
    for rollout, chunks in rows.rollouts:
        rollout_insert_verified(rollout=rollout, chunks=chunks)


@dataclass(frozen=True)
class ImportOutcome:
    """What ``session_import_line`` did: ``imported`` False means skipped (the id exists already);
    ``rows`` counts what was written per kind (``messages``, ``turns``, ``bindings``, ``notices``,
    ``rollouts``), empty when skipped."""

    session_id: str
    imported: bool
    rows: dict[str, int]


def session_import_line(*, line: str | bytes, on_existing: str = "refuse") -> ImportOutcome:
    """Import one exported line (module docstring) in one transaction. ``on_existing``: ``skip``
    (an existing session id is left alone, reported as skipped) or ``refuse`` (``ImportRefused``).
    Raises ``ImportRefused`` with the reason for a bad line; nothing of it is written then."""
    if on_existing not in ON_EXISTING:
        raise ValueError(f"on_existing must be one of {', '.join(ON_EXISTING)}")
    rows = _build(_parse(line))
    session_id = rows.session.pk
    try:
        with transaction.atomic():
            advisory_xact_lock(f"session-import:{session_id}")  # two imports of one id: one writes
            if Session.objects.filter(pk=session_id).exists():
                if on_existing == "skip":
                    return ImportOutcome(session_id=session_id, imported=False, rows={})
                raise ImportRefused(f"session {session_id} already exists (--on-existing skip leaves it alone)")
            _insert(rows)
    except (DatabaseError, RolloutDiverged, ValueError) as exc:
        # IntegrityError may surface only at commit (deferred foreign keys): the block rolled back. Any
        # database error (DataError: a value out of range…) refuses this line only; the next ones still
        # import. The schema (_field_schema) should have refused such a value already.
        raise ImportRefused(clean_text(f"session {session_id}: {str(exc).strip()[:500]}")) from exc
    return ImportOutcome(session_id=session_id, imported=True, rows=rows.counts())


def sessions_import_lines(
    *, lines: Iterable[str | bytes], on_existing: str = "refuse"
) -> Iterator[tuple[int, ImportOutcome | ImportRefused]]:
    """Import each non-blank line in turn; yields ``(line number from 1, outcome or the refusal)``.
    A refused line does not stop the ones after it."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield number, session_import_line(line=line, on_existing=on_existing)
        except ImportRefused as exc:
            yield number, exc
