"""OpenAI's Responses API (`POST /v1/responses`) over the chat path.

A Responses request is checked with pydantic models of its shapes, then turned into the chat
request it means: `instructions` as the system message, `input` (a string, or message /
`function_call` / `function_call_output` items) as the turns, function tools as tools,
`text.format` as response_format, `max_output_tokens` as max_tokens. With `previous_response_id`
the stored conversation of that response comes first. The chat choice (reasoning split, tool-call
parser, grammar-forced calls) reads the model's output, and `ResponseBuilder` writes it as output
items (`reasoning`, `message`, `function_call`), whole or as the Responses stream of events.

Stored responses (`store`, true by default as in OpenAI's API) live in memory, least recently used
first out, within a count and a character budget: a server restart forgets them.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field

from jtp.entrypoints.server.errors import APIError
from jtp.entrypoints.server.shapes import Shape, parse_body

STORED_RESPONSES = 1024
STORED_CHARS = 64 << 20  # characters of stored conversations, all together


def error_event(e: APIError) -> dict:
    """A stream's error event in the Responses API's shape."""
    return {"type": "error", "code": e.code, "message": e.message, "param": e.param}


class TextPart(Shape):
    type: Literal["input_text", "output_text", "text"]
    text: str


class ImagePart(Shape):
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URI (or a URL on an --allowed-media-domains host)
    file_id: str | None = None
    detail: str | None = None  # accepted, no meaning here: the image processor sizes every image alike


class MessageItem(Shape):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]]]


class FunctionCallItem(Shape):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Shape):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(Shape):
    type: Literal["reasoning"]


Item = Union[FunctionCallItem, FunctionCallOutputItem, ReasoningItem, MessageItem]


class FunctionTool(Shape):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class NamedFunction(Shape):
    type: Literal["function"]
    name: str


class TextFormat(Shape):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")


class TextConfig(Shape):
    format: TextFormat | None = None


class ResponsesRequest(Shape):
    model: str | None = None
    input: Union[str, list[Item]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Union[Literal["auto", "none", "required"], NamedFunction, None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None


def parse_responses_request(body: Any) -> ResponsesRequest:
    return parse_body(ResponsesRequest, body)


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's own turns as chat messages (without instructions or a previous response)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            if isinstance(item.content, list) and any(isinstance(p, ImagePart) for p in item.content):
                messages.append({"role": role, "content": [_chat_part(p) for p in item.content]})
                continue
            text = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
            messages.append({"role": role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":  # calls after the assistant's text: one turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def _chat_part(part: Union[TextPart, ImagePart]) -> dict:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    if part.image_url is None:
        raise APIError("input_image needs image_url (a data: URI); file_id is not supported (this server keeps "
                       "no files)", param="input")
    return {"type": "image_url", "image_url": {"url": part.image_url}}


def to_chat_body(req: ResponsesRequest, history: list[dict]) -> dict:
    """The chat request the Responses request means, after the stored conversation `history` (which
    holds no instructions: a previous response's are not carried over, OpenAI's rule)."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += history + input_messages(req)
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    for name, value in (("model", req.model), ("max_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("parallel_tool_calls", req.parallel_tool_calls)):
        if value is not None:
            body[name] = value
    if req.tools:
        body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.parameters or {"type": "object"},
                                                           **({"description": t.description} if t.description else {})}}
                         for t in req.tools]
    if isinstance(req.tool_choice, NamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError("text.format of type json_schema needs a schema", param="text")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "output", "schema": fmt.schema_}}
    return body


class ResponseStore:
    """Stored responses' conversations (chat messages, the response's own output last), by id."""

    def __init__(self, max_responses: int = STORED_RESPONSES, max_chars: int = STORED_CHARS):
        self.max_responses, self.max_chars = max_responses, max_chars
        self._items: collections.OrderedDict[str, tuple[list[dict], int]] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, response_id: str) -> list[dict]:
        with self._lock:
            if response_id not in self._items:
                raise APIError(f"previous response {response_id!r} not found (responses are kept in memory, "
                               f"{self.max_responses} at most)", param="previous_response_id")
            self._items.move_to_end(response_id)
            return list(self._items[response_id][0])

    def put(self, response_id: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages))
        if size > self.max_chars:
            return
        with self._lock:
            self._items[response_id] = (messages, size)
            self._chars += size
            while len(self._items) > self.max_responses or self._chars > self.max_chars:
                _, (_, dropped) = self._items.popitem(last=False)
                self._chars -= dropped


class ResponseBuilder:
    """One Responses response from the chat choice's pieces: whole (`response`) or as stream events."""

    def __init__(self, req: ResponsesRequest, model: str):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.req, self.model, self.created = req, model, int(time.time())
        self.items: list[dict] = []
        self._open: str | None = None  # the type of the item being streamed
        self._sequence = 0
        self.status, self.incomplete, self.usage = "in_progress", None, None

    def start(self) -> list[tuple[str, dict]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def delta(self, delta: dict) -> list[tuple[str, dict]]:
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for part in delta.get("tool_calls") or ():
            function = part.get("function") or {}
            if part.get("id"):
                events += self._close()
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": part["id"],
                        "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
                self.items.append(item)
                self._open = "function_call"
                events.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
            if function.get("arguments"):
                self.items[-1]["arguments"] += function["arguments"]
                events.append(self._event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                          output_index=len(self.items) - 1, delta=function["arguments"]))
        return events

    def finish(self, finish_reason: str | None, usage: dict) -> list[tuple[str, dict]]:
        self.status = "incomplete" if finish_reason == "length" else "completed"
        events = self._close(self.status)  # the item the limit cut off is incomplete too (OpenAI's)
        self.incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        self.usage = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"],
                      "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens_details": {"reasoning_tokens": 0}}
        return events + [self._event("response.completed" if self.status == "completed" else "response.incomplete",
                                     response=self.response())]

    def response(self) -> dict:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": self.status,
            "model": self.model, "output": self.items, "error": None, "incomplete_details": self.incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature, "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "tool_choice": req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else (req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "previous_response_id": req.previous_response_id, "store": req.store, "usage": self.usage,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
            if req.text is not None and req.text.format is not None else {"format": {"type": "text"}},
            "metadata": {},
        }

    def assistant_turn(self) -> dict:
        """The response's output as the chat message a follow-up request continues after."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        return {"role": "assistant", "content": text or (None if calls else ""),
                **({"tool_calls": calls} if calls else {})}

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        events = []
        if self._open != kind:
            events += self._close()
            prefix, part_type = ("msg", "output_text") if kind == "message" else ("rs", "reasoning_text")
            item = {"type": kind, "id": f"{prefix}_{uuid.uuid4().hex[:24]}", "status": "in_progress",
                    **({"role": "assistant"} if kind == "message" else {"summary": []}), "content": []}
            self.items.append(item)
            self._open = kind
            part = {"type": part_type, "text": "", **({"annotations": []} if kind == "message" else {})}
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                      item={**item, "content": []}))
            item["content"].append(part)
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=len(self.items) - 1, content_index=0, part=dict(part)))
        item = self.items[-1]
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append(self._event(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                                  delta=text, **({"logprobs": []} if kind == "message" else {})))
        return events

    def _close(self, status: str = "completed") -> list[tuple[str, dict]]:
        if self._open is None:
            return []
        kind, self._open = self._open, None
        index, item = len(self.items) - 1, self.items[-1]
        item["status"] = status
        events = []
        if kind == "function_call":
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      arguments=item["arguments"]))
        else:
            part = item["content"][0]
            name = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
            events.append(self._event(name, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                      **({"logprobs": []} if kind == "message" else {})))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=dict(part)))
        events.append(self._event("response.output_item.done", output_index=index, item=json.loads(json.dumps(item))))
        return events

    def _event(self, name: str, **fields) -> tuple[str, dict]:
        self._sequence += 1
        return name, {"type": name, "sequence_number": self._sequence - 1, **fields}
