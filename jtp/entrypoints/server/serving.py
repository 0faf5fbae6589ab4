"""The two generation endpoints: a checked request in, a JSON response or an SSE stream out.

    request body -> protocol (checked fields) -> prompt token ids -> Generation (n engine
    requests per prompt) -> choices (text, logprobs, reasoning split) -> response / chunks

Errors raise `APIError` or jtp's `RequestError`; the app turns both into OpenAI error bodies.
Once a stream has started, an error is sent as a final `data: {"error": ...}` event instead.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

import jinja2
from starlette.responses import JSONResponse, Response

from jtp.entrypoints.server.choices import ChatChoice, CompletionChoice
from jtp.entrypoints.server.errors import RETRY_AFTER_SECONDS, APIError
from jtp.entrypoints.server.generation import ChoiceRequest, Generation
from jtp.entrypoints.server.logprobs import TokenNames
from jtp.entrypoints.server.metrics import ServerMetrics
from jtp.entrypoints.server.protocol import (
    ChatRequest,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    sampling_params,
)
from jtp.entrypoints.server.reasoning import make_reasoning_parser
from jtp.entrypoints.server.sse import DONE, EventStream, sse_data
from jtp.errors import ContextLengthError

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class _Endpoint:
    id_prefix: str
    object_name: str  # of the whole response
    chunk_object: str  # of a streamed chunk


COMPLETIONS = _Endpoint("cmpl", "text_completion", "text_completion")
CHAT = _Endpoint("chatcmpl", "chat.completion", "chat.completion.chunk")


class OpenAIServing:
    def __init__(self, engine, model_name: str, metrics: ServerMetrics, reasoning_parser: str | None = None):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.reasoning_parser = reasoning_parser
        self.names = TokenNames(engine.tokenizer)

    # ------------------------------------------------------------------ endpoints

    async def completions(self, body) -> Response:
        req = parse_completion_request(body)
        self._check_model(req.model)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        prompts = [(self._prompt_ids(p), max_tokens) for p in req.prompts]
        choices = [CompletionChoice(i, self.names, req.num_logprobs) for i in range(len(prompts) * req.n)]
        return await self._respond(COMPLETIONS, req, prompts, choices)

    async def chat(self, body) -> Response:
        req = parse_chat_request(body)
        self._check_model(req.model)
        text = self._render_chat(req)
        ids = self._prompt_ids(text)
        max_tokens = req.max_tokens if req.max_tokens is not None else self._rest_of_context(ids)
        choices = [ChatChoice(i, self.names, req.num_logprobs, make_reasoning_parser(self.reasoning_parser, text))
                   for i in range(req.n)]
        return await self._respond(CHAT, req, [(ids, max_tokens)], choices)

    # ------------------------------------------------------------------ shared flow

    async def _respond(self, endpoint: _Endpoint, req: GenerationRequest, prompts: list[tuple[list[int], int]],
                       choices: list) -> Response:
        """Submit n choices per (prompt ids, max_tokens), then answer whole or as a stream."""
        response_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        requests = [
            ChoiceRequest(p, ids, sampling_params(req, max_tokens, j))
            for p, (ids, max_tokens) in enumerate(prompts)
            for j in range(req.n)
        ]
        generation = Generation(self.engine, self.metrics, response_id, requests)
        generation.submit()
        head = {"id": response_id, "object": endpoint.chunk_object, "created": int(time.time()),
                "model": self.model_name}
        if req.stream:
            return EventStream(self._stream(generation, choices, head, req.include_usage))
        await self._collect(generation, choices)
        body = {**head, "object": endpoint.object_name, "choices": [c.result() for c in choices],
                "usage": generation.usage()}
        return JSONResponse(body)

    async def _collect(self, generation: Generation, choices: list) -> None:
        async for i, event in generation.events():
            _raise_if_failed(event)
            choices[i].add(event)

    async def _stream(self, generation: Generation, choices: list, head: dict,
                      include_usage: bool) -> AsyncIterator[str]:
        usage_field = {"usage": None} if include_usage else {}  # OpenAI: null on all but the last chunk
        try:
            for choice in choices:
                if (opening := choice.opening()) is not None:
                    yield sse_data({**head, "choices": [opening], **usage_field})
            async for i, event in generation.events():
                _raise_if_failed(event)
                piece = choices[i].add(event)
                if piece is not None:
                    yield sse_data({**head, "choices": [piece], **usage_field})
            if include_usage:
                yield sse_data({**head, "choices": [], "usage": generation.usage()})
        except APIError as e:
            yield sse_data(e.body())
        except Exception as e:  # noqa: BLE001 - the response has started; end it with an error event
            log.exception("stream %s failed", head["id"])
            yield sse_data(APIError(f"internal error: {type(e).__name__}: {e}", 500).body())
        yield DONE

    # ------------------------------------------------------------------ pieces

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           404, code="model_not_found", param="model")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
        return self.engine.tokenizer.encode(prompt)

    def _render_chat(self, req: ChatRequest) -> str:
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template", param="messages")
        try:
            return self.engine.tokenizer.apply_chat_template(
                req.messages, add_generation_prompt=True, tools=req.tools, **req.template_kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(f"cannot render the chat template: {e}", param="messages") from e

    def _rest_of_context(self, prompt_ids: list[int]) -> int:
        """Chat's default max_tokens: whatever the context has left after the prompt."""
        left = self.engine.max_model_len - len(prompt_ids)
        if left < 1:
            raise ContextLengthError(f"the prompt ({len(prompt_ids)} tokens) leaves no room in the model's "
                                     f"context length ({self.engine.max_model_len})")
        return left


def _raise_if_failed(event) -> None:
    # The server's own requests end in "abort" only when it stops (a client that went away reads no more).
    if event.finished and event.finish_reason == "abort":
        raise APIError("the server is shutting down; retry the request", 503, code="server_shutting_down",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if event.finished and event.finish_reason == "error":
        if event.retryable:  # the worker group failed and is being restarted: the same request may succeed
            raise APIError(f"generation failed: {event.error}", 503, code="worker_group_failed",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        raise APIError(f"generation failed: {event.error}", 500)

