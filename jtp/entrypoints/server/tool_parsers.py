"""Tool calls in a model's text: `<tool_call>...</tool_call>` blocks turned into OpenAI tool calls.

Two formats, selected as vLLM does (`--tool-call-parser`):
- `hermes` (Qwen3, Qwen2.5): a JSON object per block,
  `<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>`;
- `qwen3_coder` (Qwen3-Coder, Qwen3.5): XML-ish parameters per block,
  `<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>`, each value
  converted by the type its tool's JSON schema gives that parameter (strings stay strings).

The parser is fed the content deltas as the engine streams them (after the reasoning split, so
thinking comes first and calls after) and returns the text that is content and the calls that are
complete. A tag cut across deltas (`<tool_` + `call>`) is held back until it is decided, so a
streamed and a whole output give the same content and calls. Whitespace just before a call and
between calls is layout, not content. A block that does not parse (bad JSON, no name) comes back
as text (the whitespace before it too), never as an error; a block the output ends inside is parsed as far as it goes (a call
whose closing tag the stop token replaced), else it is text too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import uuid
from typing import Any

from jtp.entrypoints.server.reasoning import partial_tag_len

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def message_entry(self) -> dict:
        """The call in a response message's `tool_calls`."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallParser:
    """Splits streamed content into text and tool calls; subclasses parse one block's body."""

    def __init__(self, tools: list[dict], parallel: bool = True):
        """`parallel` False (the request's parallel_tool_calls): calls after the first are dropped."""
        self.tools = {t["function"]["name"]: t["function"] for t in tools}
        self.parallel = parallel
        self._held = ""  # received, not yet decided
        self._inside = False  # within a <tool_call> block
        self._gap = ""  # the whitespace before the open block: text again if the block does not parse
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Add streamed content; return the text and the calls that are now decided."""
        self._held += delta
        text, calls = [], []
        while True:
            if self._inside:
                end = self._held.find(CALL_END)
                if end < 0:
                    break
                body, self._held, self._inside = self._held[:end], self._held[end + len(CALL_END):], False
                self._settle(body, closed=True, text=text, calls=calls)
            else:
                start = self._held.find(CALL_START)
                if start < 0:
                    # Hold a possible partial tag, and the whitespace before it (dropped if a call follows).
                    cut = len(self._held) - partial_tag_len(self._held, CALL_START)
                    cut = len(self._held[:cut].rstrip())
                    if cut:
                        text.append(self._held[:cut])
                        self._held = self._held[cut:]
                    break
                before = self._held[:start].rstrip()
                if before:
                    text.append(before)
                self._gap = self._held[len(before):start]
                self._held, self._inside = self._held[start + len(CALL_START):], True
        return "".join(text), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of output: the held text, or the last block parsed as far as it goes."""
        held, self._held = self._held, ""
        text, calls = [], []
        if self._inside:
            self._inside = False
            self._settle(held, closed=False, text=text, calls=calls)
        elif not self.calls:  # trailing whitespace is content unless it only separated calls
            text.append(held)
        elif held.strip():
            text.append(held)
        return "".join(text), calls

    def _settle(self, body: str, closed: bool, text: list[str], calls: list[ToolCall]) -> None:
        call = self.parse_block(body)
        if call is None:
            text.append(self._gap + CALL_START + body + (CALL_END if closed else ""))
        elif self.parallel or not self.calls:
            calls.append(call)
            self.calls.append(call)

    def parse_block(self, body: str) -> ToolCall | None:
        raise NotImplementedError

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling (a cut-off output keeps "length")."""
        return "tool_calls" if self.calls and reason == "stop" else reason


class ForcedToolCalls(ToolCallParser):
    """tool_choice "required" or a named function: the grammar made the whole output the calls' JSON
    (`protocol.forced_calls_schema`), read once it is complete. A named call finishes with "stop",
    as vLLM (and OpenAI) answer it; "required" with "tool_calls"."""

    def __init__(self, tools: list[dict], tool_choice: str, parallel: bool = True):
        super().__init__(tools, parallel)
        self.tool_choice = tool_choice

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._held += delta
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        try:
            value = json.loads(held)
        except ValueError:  # cut off by max_tokens: the text as it is
            return held, []
        if self.tool_choice == "required":
            calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
        else:
            calls = [ToolCall(self.tool_choice, json.dumps(value, ensure_ascii=False))]
        self.calls = calls if self.parallel else calls[:1]
        return "", list(self.calls)

    def finish_reason(self, reason: str | None) -> str | None:
        return reason if self.tool_choice != "required" else super().finish_reason(reason)


class HermesToolParser(ToolCallParser):
    def parse_block(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


class Qwen3CoderToolParser(ToolCallParser):
    def parse_block(self, body: str) -> ToolCall | None:
        match = _FUNCTION.search(body)
        if match is None or body[: match.start()].strip():
            return None
        name = match.group(1).strip()
        schema = (self.tools.get(name) or {}).get("parameters") or {}
        properties = schema.get("properties") or {}
        arguments = {}
        for key, raw in _PARAMETER.findall(match.group(2)):
            key = key.strip()
            arguments[key] = _typed(_strip_one_newline(raw), (properties.get(key) or {}).get("type"))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _typed(value: str, kind: Any) -> Any:
    """A parameter's text as the JSON type its schema names; text that does not convert stays text."""
    kinds = kind if isinstance(kind, list) else [kind]
    if value.strip() == "null" and "string" not in kinds:
        return None
    for k in kinds:
        try:
            if k == "integer":
                return int(value.strip())
            if k == "number":
                try:
                    return int(value.strip())
                except ValueError:
                    number = float(value.strip())
                    if math.isfinite(number):  # NaN and infinities are not JSON
                        return number
            if k == "boolean":
                if value.strip().lower() in ("true", "false"):
                    return value.strip().lower() == "true"
            if k in ("object", "array"):
                parsed = json.loads(value)
                if isinstance(parsed, dict if k == "object" else list):
                    return parsed
        except ValueError:
            continue
    if "string" in kinds or kind is not None:
        return value
    try:  # no schema for this parameter: a JSON value if it is one, else the text
        return json.loads(value)
    except ValueError:
        return value


TOOL_PARSERS = {"hermes": HermesToolParser, "qwen3_coder": Qwen3CoderToolParser}


def make_tool_parser(name: str | None, tools: list[dict], parallel: bool = True,
                     tool_choice: str = "auto") -> ToolCallParser:
    """The parser of a response's calls: the model's own format (`name`) for tool_choice "auto",
    else the forced calls' JSON."""
    if tool_choice != "auto":
        return ForcedToolCalls(tools, tool_choice, parallel)
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name](tools, parallel)
