"""Anthropic's Messages API (`POST /v1/messages`) over the chat path.

A Messages request is checked with pydantic models of its shapes (the field's path in every error),
then turned into the OpenAI chat request it means: `system` first, text blocks joined, `tool_use`
blocks as an assistant's `tool_calls`, `tool_result` blocks (text, or text and images) as
`role: "tool"` messages, tools' `input_schema` as function parameters, `tool_choice` auto / any /
tool / none as auto / required / the function / none. The same chat choice (reasoning split,
tool-call parser, grammar-forced calls) then reads the model's output, and `MessageBuilder` writes
it as Anthropic content blocks: `thinking`, `text` and `tool_use`, whole or as Anthropic's stream of
events.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from jtp.entrypoints.server.errors import APIError
from jtp.entrypoints.server.shapes import Shape, parse_body

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error"}


def error_body(e: APIError) -> dict:
    """An APIError in Anthropic's shape (the field, when known, named in the message)."""
    message = e.message if e.param is None or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(e.status, "api_error"), "message": message}}


# ----------------------------------------------------------------------------- request shapes


class TextBlock(Shape):
    type: Literal["text"]
    text: str


class Base64Source(Shape):
    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(Shape):
    type: Literal["url"]
    url: str


class ImageBlock(Shape):
    type: Literal["image"]
    source: Union[Base64Source, URLSource] = Field(discriminator="type")

    def url(self) -> str:
        """As a chat image_url: the base64 data as a data: URI."""
        s = self.source
        return s.url if isinstance(s, URLSource) else f"data:{s.media_type};base64,{s.data}"


class ToolUseBlock(Shape):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Shape):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[Union[TextBlock, ImageBlock]]] = ""
    is_error: bool = False


class ThinkingBlock(Shape):
    type: Literal["thinking", "redacted_thinking"]


# told apart by `type`: a refused block's error is its own kind's (not one from every kind)
Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock],
                  Field(discriminator="type")]


class Message(Shape):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class Tool(Shape):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Shape):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(Shape):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


def parse_messages_request(body: Any) -> MessagesRequest:
    return parse_body(MessagesRequest, body)


def to_chat_body(req: MessagesRequest) -> dict:
    """The OpenAI chat request the Messages request means (checked again by the chat parser)."""
    messages = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                     for b in blocks if isinstance(b, ToolUseBlock)]
            messages.append({"role": "assistant", "content": text or (None if calls else ""),
                             **({"tool_calls": calls} if calls else {})})
            continue
        for b in blocks:  # results first: they answer the assistant's calls just before
            if isinstance(b, ToolResultBlock):
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _tool_result(b.content)})
        if any(isinstance(b, ImageBlock) for b in blocks):  # text and images in order, as chat content parts
            messages.append({"role": "user", "content": _chat_parts(blocks)})
        elif text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            messages.append({"role": "user", "content": text})
    body: dict[str, Any] = {"messages": messages, "max_tokens": req.max_tokens, "stream": req.stream}
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] and "tool_calls" not in last:  # a prefill: continue it
        body["continue_final_message"] = True
    if req.model is not None:
        body["model"] = req.model
    for name, value in (("stop", req.stop_sequences), ("temperature", req.temperature), ("top_p", req.top_p),
                        ("top_k", req.top_k)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                           **({"description": t.description} if t.description else {})}}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError("tool_choice of type tool needs the tool's name", param="tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    return body


def _chat_parts(blocks: list) -> list[dict]:
    """The text and image blocks in order, as chat content parts."""
    return [{"type": "text", "text": b.text} if isinstance(b, TextBlock)
            else {"type": "image_url", "image_url": {"url": b.url()}}
            for b in blocks if isinstance(b, (TextBlock, ImageBlock))]


def _tool_result(content: Union[str, list]) -> Union[str, list[dict]]:
    """A tool message's content: its text, or content parts when it holds images (a screenshot)."""
    if isinstance(content, str):
        return content
    if any(isinstance(b, ImageBlock) for b in content):
        return _chat_parts(content)
    return "".join(b.text for b in content)


# ----------------------------------------------------------------------------- responses


def stop_reason(finish_reason: str | None, matched: str | int | None, called: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat choice's finish reason and the stop string it matched;
    `called`: the message holds a tool_use block (a forced tool's call ends in the chat path's "stop")."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "tool_calls" or called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


class MessageBuilder:
    """One Messages response from the chat choice's pieces: whole (`message`) or as stream events."""

    def __init__(self, model: str, input_tokens: int):
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model, self.input_tokens = model, input_tokens
        self.blocks: list[dict] = []
        self._open: str | None = None  # the type of the block being streamed

    def start(self) -> list[tuple[str, dict]]:
        return [("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}})]

    def delta(self, delta: dict) -> list[tuple[str, dict]]:
        """Events for one chat delta (reasoning, content, or a tool call's start or arguments)."""
        events = []
        if delta.get("reasoning_content"):
            events += self._text("thinking", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for part in delta.get("tool_calls") or ():
            function = part.get("function") or {}
            if part.get("id"):
                events += self._close()
                block = {"type": "tool_use", "id": part["id"], "name": function.get("name", ""), "input": {}}
                self.blocks.append({**block, "_json": ""})
                self._open = "tool_use"
                events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                       "content_block": block}))
            if function.get("arguments"):
                self.blocks[-1]["_json"] += function["arguments"]
                events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                                       "delta": {"type": "input_json_delta",
                                                                 "partial_json": function["arguments"]}}))
        return events

    def stop(self, finish_reason: str | None, matched: str | int | None, output_tokens: int) -> list[tuple[str, dict]]:
        reason, sequence = stop_reason(finish_reason, matched, any(b["type"] == "tool_use" for b in self.blocks))
        self.stop_reason, self.stop_sequence, self.output_tokens = reason, sequence, output_tokens
        return self._close() + [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                               "usage": {"output_tokens": output_tokens}}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def message(self) -> dict:
        """The whole response (after `stop`)."""
        content = []
        for b in self.blocks:
            if b["type"] == "tool_use":
                content.append({"type": "tool_use", "id": b["id"], "name": b["name"], "input": json.loads(b["_json"] or "{}")})
            else:
                content.append({k: v for k, v in b.items() if not k.startswith("_")})
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence,
                "usage": {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}}

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = []
        if self._open != kind:
            events += self._close()
            block = {"type": kind, kind: ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
            self.blocks.append(dict(block))
            self._open = kind
            events.append(("content_block_start", {"type": "content_block_start", "index": len(self.blocks) - 1,
                                                   "content_block": block}))
        self.blocks[-1][kind] += text
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        events.append(("content_block_delta", {"type": "content_block_delta", "index": len(self.blocks) - 1,
                                               "delta": delta}))
        return events

    def _close(self) -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        self._open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.blocks) - 1})]
