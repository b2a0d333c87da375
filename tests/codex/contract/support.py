"""The codex contract: the pinned binary's own JSON schema, and the frames our client exchanges with it.

``codex app-server generate-json-schema --out DIR`` (0.169.0) writes one file per type plus a bundle,
``codex_app_server_protocol.schemas.json`` (draft-07): its ``definitions`` hold the v1 types and the
unions at the top level and the v2 types under ``definitions.v2``. The unions name every method:

* ``ClientRequest``  — one arm per request method: ``{id, method: enum[<method>], params: $ref <X>Params}``;
* ``ClientNotification`` (``initialized``), ``ServerNotification``, ``ServerRequest`` — likewise;
* responses have no union: the result of ``<X>Params``'s method is ``<X>Response`` (checked to exist).

Frames are recorded by ``frame_tap.py`` (put in front of the app-server), so what is validated is the
bytes on the wire. Requests we send and answers we give are validated *closed*: an object schema that
lists its properties (and composes nothing) gets ``additionalProperties: false``, because codex's serde
ignores unknown fields — a renamed parameter would otherwise be dropped without a word. Frames codex
sends are validated as the schema stands (open).
"""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft7Validator
from jsonschema.validators import validator_for

from devtools.model_stand_in import ModelStandIn

# The only imports of the code under contract (and the model stand-in); the tests take these names from here.
from hermes_sessions.codex import runner as _runner
from hermes_sessions.codex.client import AppServerClient
from hermes_sessions.codex.server_requests import make_server_request_handler

# The codex driver, named in this one line.
drive_turn = _runner.drive_turn
TurnSpec, TurnControl = _runner.TurnSpec, _runner.TurnControl

__all__ = [
    "KNOWN_SERVER_REQUESTS", "AppServerClient", "CodexSchema", "FieldMissing", "Frame", "ModelStandIn",
    "TurnControl", "TurnSpec",
    "check_client_frame", "check_server_frame", "drive_turn", "generate_schema", "make_server_request_handler",
    "read_frames", "report", "tapped",
]

TAP = Path(__file__).with_name("frame_tap.py")
# Every server request the pinned codex can send (its ServerRequest union, same in 0.169.0 and 0.171.0);
# the client answers each (I4).
KNOWN_SERVER_REQUESTS = (
    "item/commandExecution/requestApproval", "item/fileChange/requestApproval", "item/tool/requestUserInput",
    "mcpServer/elicitation/request", "item/permissions/requestApproval", "item/tool/call",
    "account/chatgptAuthTokens/refresh", "attestation/generate", "applyPatchApproval", "execCommandApproval",
)
BUNDLE = "codex_app_server_protocol.schemas.json"
_COMPOSITE = ("oneOf", "anyOf", "allOf")


def generate_schema(binary: str, out: Path) -> Path:
    """Run the binary's schema generator into ``out`` (hermetic HOME/CODEX_HOME); return the bundle."""
    home = out / "home"
    home.mkdir(parents=True, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "CODEX_HOME": str(home)}
    schema_dir = out / "schema"
    subprocess.run(
        [binary, "app-server", "generate-json-schema", "--out", str(schema_dir)],
        env=env, check=True, capture_output=True, timeout=60,
    )
    return schema_dir / BUNDLE


def tapped(log: Path, argv: list[str]) -> list[str]:
    """``argv`` behind the frame tap, which appends every frame to ``log``."""
    return [sys.executable, str(TAP), str(log), "--", *argv]


class FieldMissing(AssertionError):
    """A field the runner or projection reads is not in the schema."""


def _close(node: Any, *, parent_has_properties: bool = False) -> None:
    """Make plain object schemas reject properties they do not declare (see the module docstring)."""
    if not isinstance(node, dict):
        return
    has_properties = "properties" in node
    plain = has_properties and not any(key in node for key in _COMPOSITE)
    if plain and "additionalProperties" not in node and not parent_has_properties:
        node["additionalProperties"] = False
    for key, value in node.items():
        for child, inherits in _subschemas(key, value):
            _close(child, parent_has_properties=inherits and has_properties)


def _subschemas(key: str, value: Any) -> list[tuple[Any, bool]]:
    """The schemas under ``key`` and whether they are arms of the node (and so share its properties)."""
    if key == "definitions":  # definitions.v2 is a namespace of definitions, not a schema
        return [(child, False) for name, child in value.items() if name != "v2"] + (
            [(child, False) for child in value["v2"].values()] if "v2" in value else []
        )
    if key == "properties" and isinstance(value, dict):
        return [(child, False) for child in value.values()]
    if key in _COMPOSITE:
        return [(arm, True) for arm in value]
    if key in ("items", "additionalProperties", "not"):
        return [(value, False)]
    return []


class CodexSchema:
    """The generated bundle: method → type lookups, cached validators, field look-ups."""

    def __init__(self, bundle_path: Path) -> None:
        self.path = bundle_path
        self.bundle = json.loads(bundle_path.read_text())
        self.validator_class = validator_for(self.bundle)  # by its "$schema"
        self._closed = copy.deepcopy(self.bundle)
        _close(self._closed)
        self._validators: dict[tuple[str, bool], Draft7Validator] = {}

    # ---------------------------------------------------------------- names
    @property
    def definitions(self) -> dict[str, Any]:
        return self.bundle["definitions"]

    def ref(self, name: str) -> str:
        """JSON pointer of the definition called ``name`` (top level first, then ``v2``)."""
        if name in self.definitions and name != "v2":
            return f"#/definitions/{name}"
        if name in self.definitions.get("v2", {}):
            return f"#/definitions/v2/{name}"
        raise FieldMissing(f"the schema defines no type {name!r}")

    def arms(self, union: str) -> dict[str, tuple[int, str | None]]:
        """``method → (arm index, params $ref or None)`` for one of the method unions."""
        out = {}
        for index, arm in enumerate(self.definitions[union]["oneOf"]):
            props = arm["properties"]
            out[props["method"]["enum"][0]] = (index, (props.get("params") or {}).get("$ref"))
        return out

    def arm_ref(self, union: str, method: str) -> str:
        arms = self.arms(union)
        if method not in arms:
            raise FieldMissing(f"{union} has no method {method!r} in this codex version")
        return f"#/definitions/{union}/oneOf/{arms[method][0]}"

    def params_ref(self, union: str, method: str) -> str:
        self.arm_ref(union, method)
        ref = self.arms(union)[method][1]
        if ref is None:
            raise FieldMissing(f"{union} method {method!r} takes no params")
        return ref

    def response_ref(self, union: str, method: str) -> str:
        """``<X>Response`` for the method whose params are ``<X>Params`` (``ClientRequest``/``ServerRequest``)."""
        params = self.params_ref(union, method)
        name = params.rsplit("/", 1)[1]
        if not name.endswith("Params"):
            raise FieldMissing(f"{method}: params type {name} does not end in Params")
        return self.ref(name[: -len("Params")] + "Response")

    # ---------------------------------------------------------------- validation
    def errors(self, ref: str, instance: Any, *, closed: bool = False) -> list[str]:
        """Validation errors of ``instance`` against the type at ``ref``, each with its JSON path."""
        key = (ref, closed)
        if key not in self._validators:
            root = self._closed if closed else self.bundle
            self._validators[key] = self.validator_class(
                {"$schema": root["$schema"], "definitions": root["definitions"], "$ref": ref}
            )
        found = sorted(self._validators[key].iter_errors(instance), key=lambda e: list(e.absolute_path))
        return [_describe_error(error) for error in found]

    def resolve(self, ref: str) -> dict[str, Any]:
        node: Any = self.bundle
        for part in ref.removeprefix("#/").split("/"):
            node = node[int(part)] if isinstance(node, list) else node[part]
        return node

    # ---------------------------------------------------------------- fields
    def _candidates(self, node: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """``node`` and every schema it stands for through ``$ref`` and ``anyOf``/``oneOf``/``allOf``."""
        if "$ref" in node:
            yield from self._candidates(self.resolve(node["$ref"]))
            return
        yield node
        for key in _COMPOSITE:
            for arm in node.get(key, []):
                yield from self._candidates(arm)

    def field(self, ref: str, path: str) -> dict[str, Any]:
        """The schema of ``path`` below the type at ``ref``. Path syntax: ``turn.error.message``,
        ``data[]`` for array items, ``item{agentMessage}`` for the arm of a union tagged ``type``."""
        node, walked = self.resolve(ref), ref.rsplit("/", 1)[1]
        for name, is_array, tag in re.findall(r"([^.\[{]+)(\[\])?(?:\{([^}]+)\})?", path):
            node = self._property(node, name, f"{walked}.{name}")
            walked += f".{name}"
            if is_array:
                node = self._items(node, walked)
                walked += "[]"
            if tag:
                node = self._variant(node, tag, walked)
                walked += f"{{{tag}}}"
        return node

    def _property(self, node: dict[str, Any], name: str, walked: str) -> dict[str, Any]:
        for candidate in self._candidates(node):
            if name in candidate.get("properties", {}):
                return candidate["properties"][name]
        raise FieldMissing(f"{walked}: no such field in codex's schema")

    def _items(self, node: dict[str, Any], walked: str) -> dict[str, Any]:
        for candidate in self._candidates(node):
            if isinstance(candidate.get("items"), dict):
                return candidate["items"]
        raise FieldMissing(f"{walked}: not an array in codex's schema")

    def _variant(self, node: dict[str, Any], tag: str, walked: str) -> dict[str, Any]:
        for candidate in self._candidates(node):
            if (candidate.get("properties", {}).get("type") or {}).get("enum") == [tag]:
                return candidate
        raise FieldMissing(f"{walked}: no variant with type {tag!r} in codex's schema")

    def enum_values(self, node: dict[str, Any]) -> set[Any]:
        return {value for candidate in self._candidates(node) for value in candidate.get("enum", [])}


def _describe_error(error: Any) -> str:
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path) or "(root)"
    detail = error.message if len(error.message) < 400 else error.message[:400] + "…"
    if error.context:  # oneOf/anyOf: the deepest complaint of an arm says more than "not valid under any"
        best = max(error.context, key=lambda e: len(e.absolute_path))
        detail += f" — e.g. {best.message[:300]}"
    return f"{where}: {detail}"


# -------------------------------------------------------------------------------------------- frames


@dataclass
class Frame:
    """One line on the wire. ``kind``: request | notification | response | error;
    ``method``: its method, or for a response the method of the request it answers."""

    pid: int
    source: str  # "client" | "server"
    message: dict[str, Any]
    kind: str
    method: str

    def label(self) -> str:
        return f"{self.source} {self.kind} {self.method} (pid {self.pid})"


def _kind(message: dict[str, Any]) -> str:
    if "method" in message:
        return "request" if "id" in message else "notification"
    return "error" if "error" in message else "response"


def read_frames(log: Path) -> list[Frame]:
    """Frames of a tap log, in order; responses are named after the request they answer (ids are
    per process and per direction). A line that is not a JSON object fails here."""
    frames: list[Frame] = []
    asked: dict[tuple[int, str, Any], str] = {}  # (pid, asker, id) → method
    for line in log.read_text().splitlines():
        entry = json.loads(line)
        message = json.loads(entry["line"])
        assert isinstance(message, dict), f"not a JSON object on the wire: {entry['line'][:200]}"
        kind, pid, source = _kind(message), entry["pid"], entry["from"]
        if kind == "request":
            asked[(pid, source, message["id"])] = message["method"]
            method = message["method"]
        elif kind == "notification":
            method = message["method"]
        else:
            other = "server" if source == "client" else "client"
            method = asked.get((pid, other, message.get("id")), "<unmatched id>")
        frames.append(Frame(pid, source, message, kind, method))
    return frames


def check_client_frame(schema: CodexSchema, frame: Frame) -> list[str]:
    """Errors of one frame the client wrote (closed validation)."""
    if frame.kind == "request":
        return schema.errors(schema.arm_ref("ClientRequest", frame.method), frame.message, closed=True)
    if frame.kind == "notification":
        return schema.errors(schema.arm_ref("ClientNotification", frame.method), frame.message, closed=True)
    if frame.kind == "error":  # our refusal of a server request
        return schema.errors(schema.ref("JSONRPCError"), frame.message, closed=True)
    return schema.errors(schema.ref("JSONRPCResponse"), frame.message) + schema.errors(
        schema.response_ref("ServerRequest", frame.method), frame.message["result"], closed=True
    )


def check_server_frame(schema: CodexSchema, frame: Frame) -> list[str]:
    """Errors of one frame codex wrote (open validation)."""
    if frame.kind == "request":
        return schema.errors(schema.arm_ref("ServerRequest", frame.method), frame.message)
    if frame.kind == "notification":
        return schema.errors(schema.arm_ref("ServerNotification", frame.method), frame.message)
    if frame.kind == "error":
        return schema.errors(schema.ref("JSONRPCError"), frame.message)
    return schema.errors(schema.ref("JSONRPCResponse"), frame.message) + schema.errors(
        schema.response_ref("ClientRequest", frame.method), frame.message["result"]
    )


@cache
def _abridged(text: str) -> str:
    return text if len(text) <= 300 else text[:300] + "…"


def report(scenario: str, frames: list[Frame], check: Any, schema: CodexSchema) -> list[str]:
    """One line per invalid frame: scenario, direction, method, the frame (abridged), the errors."""
    lines = []
    for frame in frames:
        try:
            errors = check(schema, frame)
        except FieldMissing as exc:
            errors = [str(exc)]
        if errors:
            shown = _abridged(json.dumps(frame.message, sort_keys=True))
            lines.append(f"[{scenario}] {frame.label()}: {'; '.join(errors)}\n    frame: {shown}")
    return lines
