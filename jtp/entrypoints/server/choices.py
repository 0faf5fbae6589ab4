"""One choice of a response, built from the engine's events.

`add(event)` returns the event's piece of the choice as a stream chunk's choice object (or
None when it carries nothing) and keeps it; `result()` is the whole choice for a non-streamed
response. Both come from the same pieces, so streamed and whole outputs always agree.
"""

from __future__ import annotations

from jtp.entrypoints.server.logprobs import (
    TokenNames,
    chat_logprobs,
    completion_logprobs,
    merge_completion_logprobs,
)
from jtp.entrypoints.server.reasoning import Qwen3ReasoningParser


class CompletionChoice:
    def __init__(self, index: int, names: TokenNames, num_logprobs: int | None):
        self.index, self.names = index, names
        self.wants_logprobs = num_logprobs is not None
        self.texts: list[str] = []
        self.logprobs: list[dict] = []
        self.text_offset = 0
        self.finish_reason: str | None = None

    def opening(self) -> None:
        return None  # a completions stream starts with the first text

    def add(self, event) -> dict | None:
        logprobs = None
        if self.wants_logprobs and event.token_ids:
            logprobs, self.text_offset = completion_logprobs(
                self.names, event.token_ids, event.logprobs, event.top_logprobs, self.text_offset)
            self.logprobs.append(logprobs)
        self.texts.append(event.text)
        if event.finished:
            self.finish_reason = event.finish_reason
        if not (event.text or logprobs or event.finished):
            return None
        return {"index": self.index, "text": event.text, "logprobs": logprobs, "finish_reason": self.finish_reason}

    def result(self) -> dict:
        return {
            "index": self.index,
            "text": "".join(self.texts),
            "logprobs": merge_completion_logprobs(self.logprobs) if self.wants_logprobs else None,
            "finish_reason": self.finish_reason,
        }


class ChatChoice:
    def __init__(self, index: int, names: TokenNames, num_logprobs: int | None,
                 reasoning: Qwen3ReasoningParser | None):
        self.index, self.names = index, names
        self.wants_logprobs = num_logprobs is not None
        self.reasoning_parser = reasoning
        self.contents: list[str] = []
        self.reasonings: list[str] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None

    def opening(self) -> dict:
        """The first streamed piece: the role, before any token (as OpenAI sends it)."""
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def add(self, event) -> dict | None:
        reasoning, content = self._split(event.text, event.finished)
        self.reasonings.append(reasoning)
        self.contents.append(content)
        logprobs = None
        if self.wants_logprobs and event.token_ids:
            logprobs = chat_logprobs(self.names, event.token_ids, event.logprobs, event.top_logprobs)
            self.logprobs += logprobs
        if event.finished:
            self.finish_reason = event.finish_reason
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if not (delta or logprobs or event.finished):
            return None
        return {
            "index": self.index,
            "delta": delta,
            "logprobs": {"content": logprobs, "refusal": None} if logprobs else None,
            "finish_reason": self.finish_reason,
        }

    def _split(self, text: str, finished: bool) -> tuple[str, str]:
        if self.reasoning_parser is None:
            return "", text
        reasoning, content = self.reasoning_parser.feed(text)
        if finished:
            rest_reasoning, rest_content = self.reasoning_parser.finish()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
        return reasoning, content

    def result(self) -> dict:
        message = {"role": "assistant", "content": "".join(self.contents)}
        if self.reasoning_parser is not None:
            message["reasoning_content"] = "".join(self.reasonings) or None
        return {
            "index": self.index,
            "message": message,
            "logprobs": {"content": self.logprobs, "refusal": None} if self.wants_logprobs else None,
            "finish_reason": self.finish_reason,
        }
