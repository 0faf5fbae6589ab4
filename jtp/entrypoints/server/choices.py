"""One choice of a response, built from the engine's events.

`add(event)` returns the event's pieces of the choice as stream chunks' choice objects (none when
it carries nothing) and keeps them; `result()` is the whole choice for a non-streamed response.
Both come from the same pieces, so streamed and whole outputs always agree.
"""

from __future__ import annotations

from jtp.entrypoints.server.logprobs import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    merge_completion_logprobs,
    prompt_logprobs_entries,
)
from jtp.entrypoints.server.reasoning import Qwen3ReasoningParser
from jtp.entrypoints.server.tool_parsers import ToolCall, ToolCallParser


class CompletionChoice:
    def __init__(self, index: int, names: TokenNames, num_logprobs: int | None, echo: str | None = None,
                 echo_only: bool = False):
        """`echo`: the prompt's text, which then opens the choice's text (its tokens' logprobs too, from
        the first event's prompt logprobs); `echo_only`: the prompt alone, the generated token dropped."""
        self.index, self.names = index, names
        self.wants_logprobs = num_logprobs is not None
        self.echo, self.echo_only = echo, echo_only
        self.texts: list[str] = []
        self.logprobs: list[dict] = []
        self.text_offset = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: list | None = None  # vLLM's entries, when the request asked for them

    def opening(self) -> None:
        return None  # a completions stream starts with the first text

    def add(self, event) -> list[dict]:
        text, parts = ("", []) if self.echo_only else (event.text, [])
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs_entries(self.names, event.prompt_logprobs)
        if self.echo is not None and not self.texts:
            text = self.echo + text
            if self.wants_logprobs and event.prompt_logprobs is not None:
                part, self.text_offset = echo_logprobs(self.names, event.prompt_logprobs)
                parts.append(part)
        if self.wants_logprobs and event.token_ids and not self.echo_only:
            part, self.text_offset = completion_logprobs(
                self.names, event.token_ids, event.logprobs, event.top_logprobs, self.text_offset)
            parts.append(part)
        logprobs = merge_completion_logprobs(parts) if parts else None
        if logprobs:
            self.logprobs.append(logprobs)
        self.texts.append(text)
        if event.finished:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        if not (text or logprobs or event.finished):
            return []
        piece = {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        return [{**piece, "stop_reason": self.stop_reason} if event.finished else piece]

    def result(self) -> dict:
        out = {
            "index": self.index,
            "text": "".join(self.texts),
            "logprobs": merge_completion_logprobs(self.logprobs) if self.wants_logprobs else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,  # vLLM's: the stop string or stop token id that ended it
        }
        return out if self.prompt_logprobs is None else {**out, "prompt_logprobs": self.prompt_logprobs}


class ChatChoice:
    def __init__(self, index: int, names: TokenNames, num_logprobs: int | None,
                 reasoning: Qwen3ReasoningParser | None, tools: ToolCallParser | None = None):
        self.index, self.names = index, names
        self.wants_logprobs = num_logprobs is not None
        self.reasoning_parser = reasoning
        self.tool_parser = tools
        self.contents: list[str] = []
        self.reasonings: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: list | None = None  # vLLM's entries (the response's, not the choice's)

    def opening(self) -> dict:
        """The first streamed piece: the role, before any token (as OpenAI sends it)."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def add(self, event) -> list[dict]:
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs_entries(self.names, event.prompt_logprobs)
        reasoning, content = self._split(event.text, event.finished)
        content, calls = self._calls(content, event.finished)
        self.reasonings.append(reasoning)
        self.contents.append(content)
        logprobs = None
        if self.wants_logprobs and event.token_ids:
            logprobs = chat_logprobs(self.names, event.token_ids, event.logprobs, event.top_logprobs)
            self.logprobs += logprobs
        if event.finished:
            self.finish_reason = (self.tool_parser.finish_reason(event.finish_reason) if self.tool_parser
                                  else event.finish_reason)
            self.stop_reason = event.stop_reason
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        pieces = []
        # Each new call as OpenAI streams one: its id and name first, then its arguments.
        for call in calls:
            k = self.tool_calls.index(call)
            pieces.append({"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            pieces.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        if delta or not pieces:
            pieces.insert(0, delta)
        if not (delta or calls or logprobs or event.finished):
            return []
        out = [{"index": self.index, "delta": d, "logprobs": None, "finish_reason": None} for d in pieces]
        out[0]["logprobs"] = {"content": logprobs, "refusal": None} if logprobs else None
        out[-1]["finish_reason"] = self.finish_reason
        if event.finished:
            out[-1]["stop_reason"] = self.stop_reason
        return out

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        if self.reasoning_parser is None:
            return "", text
        reasoning, content = self.reasoning_parser.feed(text)
        if finished:
            rest_reasoning, rest_content = self.reasoning_parser.finish()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
        return reasoning, content

    def _calls(self, content: str, finished: bool) -> tuple[str, list[ToolCall]]:
        if self.tool_parser is None:
            return content, []
        content, calls = self.tool_parser.feed(content)
        if finished:
            rest, more = self.tool_parser.finish()
            content, calls = content + rest, calls + more
        self.tool_calls += calls
        return content, calls

    def result(self) -> dict:
        content = "".join(self.contents)
        message = {"role": "assistant", "content": content if content or not self.tool_calls else None}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = "".join(self.reasonings) or None
        if self.tool_parser is not None:
            message["tool_calls"] = [call.message_entry() for call in self.tool_calls]
        return {
            "index": self.index,
            "message": message,
            "logprobs": {"content": self.logprobs, "refusal": None} if self.wants_logprobs else None,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }

