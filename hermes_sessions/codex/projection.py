"""Project codex thread items into transcript rows.

Only ``item/completed`` items produce rows (``docs/contract.md`` §7):

| codex item          | rows |
| ------------------- | ---- |
| ``agentMessage``    | assistant ``content=text``; buffered reasoning attached |
| ``reasoning``       | none; ``summary`` + ``content`` texts attach to the next assistant row |
| ``commandExecution``| assistant tool call ``exec_command`` + a ``tool`` row with the output (``[exit N]`` prefix when N≠0) |
| ``fileChange``      | assistant tool call ``apply_patch`` (kinds and paths, no bodies) + ``tool`` row with the status |
| ``mcpToolCall``     | assistant tool call ``mcp.<server>.<tool>`` + ``tool`` row with the result or ``[error] …`` |
| ``userMessage``     | none: the service stored the user's row already; codex's echo is not stored twice |
| anything else       | none |

Call ids are deterministic (``codex_exec_<itemId>`` …), so a re-projection yields the same rows.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any, ClassVar

TOOL_OUTPUT_CHARS = 64_000
MCP_RESULT_CHARS = 4_000
MCP_ERROR_CHARS = 1_000


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _texts(value: Any) -> list[str]:
    """Texts of a reasoning ``summary``/``content`` list (strings or ``{"text": …}`` parts)."""
    out = []
    for part in value or []:
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, dict) and isinstance(part.get("text"), str):
            out.append(part["text"])
    return [t for t in out if t]


class ItemProjector:
    """Accumulates completed items of one turn into ``messages`` (dicts with ``role``, ``content``
    and optional ``tool_calls``, ``tool_call_id``, ``reasoning``, ``codex_item_id``) and tracks
    ``final_text`` (the last ``agentMessage`` text)."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.final_text = ""
        self._reasoning: list[str] = []
        self._seen: set[str] = set()
        self._anonymous = 0  # id-less items so far

    def add(self, item: object) -> None:
        """Project one completed ``ThreadItem`` (a dict; anything else is ignored); a repeated item id
        is ignored."""
        if not isinstance(item, dict):
            return
        item_id = str(item.get("id") or "")
        if item_id in self._seen:
            return
        if item_id:
            self._seen.add(item_id)
        else:
            # codex always sends ids; should one not, two identical items must still be two rows
            # (unique (turn, codex_item_id, role)), and projecting the turn again the same rows.
            item_id = "sha256_" + hashlib.sha256(f"{self._anonymous}:{_dumps(item)}".encode()).hexdigest()[:24]
            self._anonymous += 1
        project = self._BY_TYPE.get(str(item.get("type")))
        # userMessage: the user's row is already stored; everything else carries nothing we replay.
        if project is not None:
            project(self, item, item_id)

    def _agent_message(self, item: dict[str, Any], item_id: str) -> None:
        text = item.get("text") or ""
        row = {"role": "assistant", "content": text, "codex_item_id": item_id}
        if self._reasoning:
            row["reasoning"] = "\n".join(self._reasoning)
            self._reasoning = []
        self.messages.append(row)
        self.final_text = text

    def _reasoning_item(self, item: dict[str, Any], item_id: str) -> None:
        self._reasoning.extend(_texts(item.get("summary")) + _texts(item.get("content")))

    def _command(self, item: dict[str, Any], item_id: str) -> None:
        args = {"command": item.get("command"), "cwd": item.get("cwd")}
        output = item.get("aggregatedOutput") or ""
        exit_code = item.get("exitCode")
        if exit_code not in (None, 0):
            output = f"[exit {exit_code}]\n{output}"
        elif item.get("status") not in (None, "completed"):
            output = f"[{item.get('status')}]\n{output}"
        self._tool(item_id, f"codex_exec_{item_id}", "exec_command", args, output[:TOOL_OUTPUT_CHARS])

    def _file_change(self, item: dict[str, Any], item_id: str) -> None:
        changes = [
            {"kind": c.get("kind"), "path": c.get("path")} for c in (item.get("changes") or []) if isinstance(c, dict)
        ]
        content = f"apply_patch status={item.get('status')}, {len(changes)} change(s)"
        self._tool(item_id, f"codex_patch_{item_id}", "apply_patch", {"changes": changes}, content)

    def _mcp_tool_call(self, item: dict[str, Any], item_id: str) -> None:
        server, tool = item.get("server") or "mcp", item.get("tool") or "tool"
        if item.get("error"):
            content = "[error] " + _dumps(item.get("error"))[:MCP_ERROR_CHARS]
        else:
            content = _dumps(item.get("result"))[:MCP_RESULT_CHARS]
        self._tool(
            item_id, f"codex_mcp__{server}__{tool}_{item_id}", f"mcp.{server}.{tool}", item.get("arguments") or {}, content
        )

    _BY_TYPE: ClassVar[dict[str, Callable[[ItemProjector, dict[str, Any], str], None]]] = {
        "agentMessage": _agent_message,
        "reasoning": _reasoning_item,
        "commandExecution": _command,
        "fileChange": _file_change,
        "mcpToolCall": _mcp_tool_call,
    }

    def _tool(self, item_id: str, call_id: str, name: str, args: Any, output: str) -> None:
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": _dumps(args)}}
        row: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [call], "codex_item_id": item_id}
        if self._reasoning:
            row["reasoning"] = "\n".join(self._reasoning)
            self._reasoning = []
        self.messages.append(row)
        self.messages.append({"role": "tool", "content": output, "tool_call_id": call_id, "codex_item_id": item_id})
