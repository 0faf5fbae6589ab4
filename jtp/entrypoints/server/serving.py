"""The two generation endpoints: a checked request in, a JSON response or an SSE stream out.

    request body -> protocol (checked fields) -> prompt token ids -> Generation (n engine
    requests per prompt) -> choices (text, logprobs, reasoning split) -> response / chunks

Errors raise `APIError` or jtp's `RequestError`; the app turns both into OpenAI error bodies.
Once a stream has started, an error is sent as a final `data: {"error": ...}` event instead.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

import jinja2
from starlette.responses import JSONResponse, Response

from jtp.engine.multimodal_input import check_image_count, expand_images, load_images
from jtp.engine.structured_output import StructuredOutputError
from jtp.engine.template_sandbox import TemplateLimitError, TemplateLimits, TemplateOutputError

from jtp.entrypoints.server.anthropic import MessageBuilder, parse_messages_request, to_chat_body
from jtp.entrypoints.server.anthropic import error_body as anthropic_error
from jtp.entrypoints.server.choices import ChatChoice, CompletionChoice
from jtp.entrypoints.server.errors import RETRY_AFTER_SECONDS, APIError
from jtp.entrypoints.server.generation import ChoiceRequest, Generation
from jtp.entrypoints.server.intake import Intake, parse_json
from jtp.entrypoints.server.logprobs import TokenNames
from jtp.entrypoints.server.metrics import ServerMetrics
from jtp.entrypoints.server.protocol import (
    ChatRequest,
    GenerationRequest,
    parse_chat_request,
    parse_completion_request,
    sampling_params,
)
from jtp.entrypoints.server.reasoning import THINK_END, THINK_START, make_reasoning_parser, think_first
from jtp.entrypoints.server.responses import ResponseBuilder, ResponseStore, parse_responses_request
from jtp.entrypoints.server.responses import error_event as responses_error
from jtp.entrypoints.server.responses import to_chat_body as responses_chat_body
from jtp.entrypoints.server.sse import DONE, KEEPALIVE_INTERVAL, EventStream, sse_data, sse_event
from jtp.entrypoints.server.tool_parsers import ToolCallParser, make_tool_parser
from jtp.errors import ContextLengthError

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Normalizers can merge a few characters into one (NFC), so text this many times the context's
# worth of longest tokens may still fit; anything longer never can.
NORMALIZATION_SLACK = 4
# Longer texts are first counted piece by piece (the encoder holds the GIL for a whole call).
LONG_TEXT_CHARS = 65536


@dataclasses.dataclass(frozen=True)
class _Endpoint:
    id_prefix: str
    object_name: str  # of the whole response
    chunk_object: str  # of a streamed chunk


COMPLETIONS = _Endpoint("cmpl", "text_completion", "text_completion")
CHAT = _Endpoint("chatcmpl", "chat.completion", "chat.completion.chunk")


class OpenAIServing:
    """Parsing, rendering and tokenizing run on the intake's threads (`_prepare_*`); the event
    loop only submits and streams."""

    def __init__(self, engine, model_name: str, metrics: ServerMetrics, intake: Intake,
                 reasoning_parser: str | None = None, template_timeout: float = TemplateLimits.time_limit,
                 tool_parser: str | None = None, keepalive_interval: float = KEEPALIVE_INTERVAL,
                 allowed_media_domains: tuple[str, ...] = ()):
        """`allowed_media_domains`: hosts whose http(s) image URLs are fetched (none: data: URIs only).
        `tool_parser`: the format of the model's tool calls (`TOOL_PARSERS`), set by
        --enable-auto-tool-choice --tool-call-parser; None: requests with tool_choice "auto" are refused.
        `keepalive_interval`: seconds a stream may stay silent before a keep-alive comment (0: never)."""
        self.engine, self.model_name, self.metrics, self.intake = engine, model_name, metrics, intake
        self.reasoning_parser, self.tool_parser = reasoning_parser, tool_parser
        self.keepalive_interval = keepalive_interval
        self.allowed_media_domains = tuple(allowed_media_domains)
        self.vision = getattr(engine, "vision", None)  # None: the model takes no images
        self.stored_responses = ResponseStore()  # /v1/responses' conversations, for previous_response_id
        self.names = TokenNames(engine.tokenizer)
        tok = engine.tokenizer
        # A grammar can leave a think block free only when <think> and </think> are tokens it can name.
        self.think_tokens = tok is not None and None not in (tok.token_to_id(THINK_START), tok.token_to_id(THINK_END))
        self.max_prompt_chars = engine.max_model_len * NORMALIZATION_SLACK * (tok.max_token_chars if tok else 1)
        self.template_limits = TemplateLimits(template_timeout, self.max_prompt_chars)
        # Room for a batch of token-id prompts of a full context each, plus commas in prose.
        self.max_json_values = 8 * engine.max_model_len + 65536

    # ------------------------------------------------------------------ endpoints

    async def completions(self, raw: bytes) -> Response:
        req, prompts, echoes = await self.intake.run(self._prepare_completion, raw)
        choices = [CompletionChoice(i, self.names, req.num_logprobs, echoes[i // req.n], req.echo_only)
                   for i in range(len(prompts) * req.n)]
        return await self._respond(COMPLETIONS, req, prompts, choices)

    async def chat(self, raw: bytes) -> Response:
        req, text, ids, max_tokens, images = await self.intake.run(self._prepare_chat, raw)
        choices = [ChatChoice(i, self.names, req.num_logprobs, make_reasoning_parser(self.reasoning_parser, text),
                              self._tool_call_parser(req))
                   for i in range(req.n)]
        return await self._respond(CHAT, req, [(ids, max_tokens)], choices, images)

    async def messages(self, raw: bytes) -> Response:
        """Anthropic's POST /v1/messages: the chat path, its output written as Anthropic content blocks."""
        req, text, ids, max_tokens, images = await self.intake.run(self._prepare_messages, raw)
        choice, generation = await self._one_chat_choice("msg", req, text, ids, max_tokens, images)
        builder = MessageBuilder(self.model_name, len(ids))

        def finish():
            return builder.stop(choice.finish_reason, choice.stop_reason, generation.usage()["completion_tokens"])

        if req.stream:
            return EventStream(self._stream_built(generation, choice, builder, finish, anthropic_error),
                               self.keepalive_interval)
        await self._collect_built(generation, choice, builder)
        finish()
        return JSONResponse(builder.message())

    async def responses(self, raw: bytes) -> Response:
        """OpenAI's POST /v1/responses: the chat path, its output written as response items (and stored)."""
        rreq, req, text, ids, max_tokens, images, messages = await self.intake.run(self._prepare_responses, raw)
        choice, generation = await self._one_chat_choice("resp", req, text, ids, max_tokens, images)
        builder = ResponseBuilder(rreq, self.model_name)

        def finish():
            events = builder.finish(choice.finish_reason, generation.usage())
            if rreq.store:  # what a follow-up with previous_response_id continues after
                self.stored_responses.put(builder.id, messages + [builder.assistant_turn()])
            return events

        if rreq.stream:
            return EventStream(self._stream_built(generation, choice, builder, finish, responses_error),
                               self.keepalive_interval)
        await self._collect_built(generation, choice, builder)
        finish()
        return JSONResponse(builder.response())

    async def _one_chat_choice(self, id_prefix: str, req: ChatRequest, text: str, ids: list[int],
                               max_tokens: int, images: list) -> tuple[ChatChoice, Generation]:
        """Submit the one choice of a Messages or Responses request (the chat path underneath)."""
        choice = ChatChoice(0, self.names, None, make_reasoning_parser(self.reasoning_parser, text),
                            self._tool_call_parser(req))
        generation = Generation(self.engine, self.metrics, f"{id_prefix}-{uuid.uuid4().hex}",
                                [ChoiceRequest(0, ids, sampling_params(req, max_tokens, 0, self.engine.sampling_defaults),
                                               images)])
        await self._submit(generation)
        return choice, generation

    async def _collect_built(self, generation: Generation, choice: ChatChoice, builder) -> None:
        async for _, event in generation.events():
            _raise_if_failed(event)
            for piece in choice.add(event):
                builder.delta(piece["delta"])

    async def _stream_built(self, generation: Generation, choice: ChatChoice, builder, finish,
                            error_event) -> AsyncIterator[str]:
        """A built response's events (Anthropic's, the Responses API's): the builder's opening ones, its
        events for each chat delta, then `finish()`'s; an error after the start is an error event."""
        try:
            for name, payload in builder.start():
                yield sse_event(name, payload)
            async for _, event in generation.events():
                _raise_if_failed(event)
                for piece in choice.add(event):
                    for name, payload in builder.delta(piece["delta"]):
                        yield sse_event(name, payload)
            for name, payload in finish():
                yield sse_event(name, payload)
        except APIError as e:
            yield sse_event("error", error_event(e))
        except Exception as e:  # noqa: BLE001 - the response has started; end it with an error event
            log.exception("stream %s failed", builder.id)
            yield sse_event("error", error_event(APIError(f"internal error: {type(e).__name__}: {e}", 500)))

    async def tokenize(self, raw: bytes) -> Response:
        """vLLM's POST /tokenize: a prompt, or chat messages rendered by the chat template, as token ids."""
        return JSONResponse(await self.intake.run(self._tokenize, raw))

    async def detokenize(self, raw: bytes) -> Response:
        """vLLM's POST /detokenize: token ids back to text."""
        return JSONResponse(await self.intake.run(self._detokenize, raw))

    def probe_template(self) -> None:
        """Render a one-message chat as a request would; TemplateLimitError (or the template's own
        error) if this checkpoint's template cannot serve even that."""
        if self.engine.tokenizer is not None and self.engine.tokenizer.chat_template is not None:
            self.engine.tokenizer.render_chat([{"role": "user", "content": "Hello"}], limits=self.template_limits)

    # ------------------------------------------------------------------ intake (on the intake's threads)

    def _prepare_completion(self, raw: bytes) -> tuple:
        req = parse_completion_request(parse_json(raw, self.max_json_values))
        self._check_model(req.model)
        self._check_structure(req)
        self._check_choices(len(req.prompts) * req.n)
        ids = [self._prompt_ids(p) for p in req.prompts]
        # Unset: vLLM's 16, capped by the generation config's max_new_tokens and the room left.
        cap = self.engine.sampling_defaults.get("max_tokens", DEFAULT_COMPLETION_MAX_TOKENS)
        prompts = [(p, req.max_tokens if req.max_tokens is not None
                    else min(DEFAULT_COMPLETION_MAX_TOKENS, cap, self._rest_of_context(p))) for p in ids]
        # echo: each prompt's text opens its choices' text (token ids decoded)
        echoes = [(p if isinstance(p, str) else self.names.decode(p)) if req.echo else None for p in req.prompts]
        return req, prompts, echoes

    def _prepare_chat(self, raw: bytes) -> tuple:
        return self._prepare_chat_body(parse_json(raw, self.max_json_values))

    def _prepare_chat_body(self, body, image_param: str = "messages") -> tuple:
        """(request, rendered text, prompt ids, max_tokens, images): the ids hold each image's placeholders."""
        req = parse_chat_request(body)
        self._check_model(req.model)
        self._check_tool_choice(req.tool_choice)
        self._check_choices(req.n)
        self._check_chars(sum(_text_chars(m.get("content")) for m in req.messages), "the messages' content")
        check_image_count(len(req.images), self.vision, f"model {self.model_name!r}", image_param)
        text = self._render_chat(req)
        if self.reasoning_parser is not None and self.think_tokens and "structured_outputs" in req.sampling:
            # as vLLM's: the model thinks freely, then the structure applies (unless the prompt closed the block)
            req.sampling["think_first"] = think_first(text)
        self._check_structure(req)  # before the images: a refused request fetches and decodes none
        images = load_images(req.images, self.vision.processor, self.allowed_media_domains, image_param) if req.images else []
        ids = self._prompt_ids(text)
        prompts = []
        if self.vision is not None:  # a text that spells the placeholder token is refused here too
            ids, prompts = expand_images(ids, images, self.vision.image_token_id, self.vision.merge_size, image_param)
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(self._rest_of_context(ids), self.engine.sampling_defaults.get("max_tokens", self.engine.max_model_len))
        return req, text, ids, max_tokens, prompts

    def _prepare_responses(self, raw: bytes) -> tuple:
        rreq = parse_responses_request(parse_json(raw, self.max_json_values))
        history = self.stored_responses.get(rreq.previous_response_id) if rreq.previous_response_id else []
        body = responses_chat_body(rreq, history)
        conversation = body["messages"][1:] if rreq.instructions else body["messages"]  # stored without them
        try:
            return (rreq, *self._prepare_chat_body(body, "input"), conversation)
        except APIError as e:
            if e.param == "response_format":  # the chat field text.format became: name the one the client sent
                e.param = "text.format"
            raise

    def _prepare_messages(self, raw: bytes) -> tuple:
        return self._prepare_chat_body(to_chat_body(parse_messages_request(parse_json(raw, self.max_json_values))))

    def _tokenize(self, raw: bytes) -> dict:
        body = self._utility_body(raw)
        tok = self._tokenizer("prompt")
        if body.get("messages") is not None:
            req = parse_chat_request({k: body[k] for k in ("messages", "tools", "chat_template_kwargs",
                                                           "add_generation_prompt", "continue_final_message")
                                      if k in body})
            text, special = self._render_chat(req), body.get("add_special_tokens", False)
            check_image_count(len(req.images), self.vision, f"model {self.model_name!r}", "messages")
        elif isinstance(body.get("prompt"), str):
            text, special = body["prompt"], body.get("add_special_tokens", True)
        else:
            raise APIError("give prompt (a string) or messages (an array)", param="prompt")
        if not isinstance(special, bool):
            raise APIError(f"add_special_tokens must be a boolean, got {special!r}", param="add_special_tokens")
        self._check_chars(len(text), "the text")
        ids = tok.encode(text, add_special_tokens=special)
        if body.get("messages") is not None and req.images:  # each image's placeholders, as a request's prompt
            images = load_images(req.images, self.vision.processor, self.allowed_media_domains, "messages")
            ids, _ = expand_images(ids, images, self.vision.image_token_id, self.vision.merge_size, "messages")
        strs = [tok.id_to_token(i) for i in ids] if body.get("return_token_strs") else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}

    def _detokenize(self, raw: bytes) -> dict:
        body = self._utility_body(raw)
        tok, ids = self._tokenizer("tokens"), body.get("tokens")
        vocab = tok.vocab_size
        if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab for i in ids):
            raise APIError(f"tokens must be an array of token ids in [0, {vocab})", param="tokens")
        return {"prompt": tok.decode(ids, skip_special_tokens=False)}  # as vLLM: the ids as they are

    def _utility_body(self, raw: bytes) -> dict:
        """The JSON object of a /tokenize or /detokenize request, its model checked."""
        body = parse_json(raw, self.max_json_values)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        self._check_model(body.get("model"))
        return body

    def _tokenizer(self, param: str):
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer", param=param)
        return self.engine.tokenizer

    # ------------------------------------------------------------------ shared flow

    async def _respond(self, endpoint: _Endpoint, req: GenerationRequest, prompts: list[tuple[list[int], int]],
                       choices: list, images: list = ()) -> Response:
        """Submit n choices per (prompt ids, max_tokens), then answer whole or as a stream (`images`:
        the one chat prompt's)."""
        response_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        requests = [
            ChoiceRequest(p, ids, sampling_params(req, max_tokens, j, self.engine.sampling_defaults), images)
            for p, (ids, max_tokens) in enumerate(prompts)
            for j in range(req.n)
        ]
        generation = Generation(self.engine, self.metrics, response_id, requests)
        await self._submit(generation)
        head = {"id": response_id, "object": endpoint.chunk_object, "created": int(time.time()),
                "model": self.model_name}
        if req.stream:
            return EventStream(self._stream(generation, choices, head, req.include_usage), self.keepalive_interval)
        await self._collect(generation, choices)
        body = {**head, "object": endpoint.object_name, "choices": [c.result() for c in choices],
                "usage": generation.usage()}
        if endpoint is CHAT and choices[0].prompt_logprobs is not None:  # vLLM's: the response's, one prompt
            body["prompt_logprobs"] = choices[0].prompt_logprobs
        return JSONResponse(body)

    async def _submit(self, generation: Generation) -> None:
        """Submit on an intake thread: the engine checks every prompt id of every choice (n x the
        context), too long a walk for the event loop. Cancelled meanwhile (the client left), the
        submits still finish on their thread; whatever they queued is then aborted."""
        submitting = asyncio.ensure_future(self.intake.run(generation.submit))
        try:
            await asyncio.shield(submitting)
        except asyncio.CancelledError:
            submitting.add_done_callback(lambda done: done.cancelled() or done.exception() or generation.abort())
            raise

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
                for piece in choices[i].add(event):
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

    def _check_tool_choice(self, tool_choice: str | None) -> None:
        if tool_choice == "auto" and self.tool_parser is None:
            raise APIError('tool_choice "auto" (the default when tools are given) needs a server started with '
                           '--enable-auto-tool-choice --tool-call-parser NAME; send tool_choice "none" to pass the '
                           'tools to the chat template only', param="tool_choice")

    def _check_structure(self, req: GenerationRequest) -> None:
        """Compile the request's grammar now (cached for its submit), so a bad schema is a 400 naming its field."""
        spec = req.sampling.get("structured_outputs")
        if spec is None:
            return
        grammars = getattr(self.engine, "grammars", None)
        if grammars is None:
            raise APIError("structured outputs need the model's tokenizer, which this server has not loaded",
                           param=req.structure_param)
        try:
            grammars.grammar(spec, req.sampling.get("think_first"))
        except StructuredOutputError as e:
            raise APIError(str(e), param=req.structure_param) from None

    def _tool_call_parser(self, req: ChatRequest) -> ToolCallParser | None:
        if req.tool_choice in (None, "none"):
            return None
        return make_tool_parser(self.tool_parser, req.tools, req.parallel_tool_calls, req.tool_choice)

    def _check_choices(self, count: int) -> None:
        """n choices of every prompt are submitted at once: more than the waiting queue holds can
        never be taken, so that is a 400 (a full queue is a 429: retry later)."""
        limit = self.engine.config.max_waiting_requests
        if limit is not None and count > limit:
            raise APIError(f"the request asks for {count} choices (prompts x n) but this server queues at most "
                           f"{limit} requests at once (--max-waiting-requests); ask for fewer", param="n")

    def _check_chars(self, length: int, what: str) -> None:
        if length > self.max_prompt_chars:
            raise ContextLengthError(f"{what} ({length} characters) can never fit the model's context length "
                                     f"({self.engine.max_model_len} tokens, at most {self.max_prompt_chars} "
                                     f"characters); refused before tokenizing")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            if len(prompt) >= self.engine.max_model_len:  # no room left for even one new token
                raise ContextLengthError(f"the prompt ({len(prompt)} tokens) leaves no room in the model's "
                                         f"context length ({self.engine.max_model_len})")
            return prompt
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer: send the prompt as token ids", param="prompt")
        self._check_chars(len(prompt), "the prompt")
        tok, limit = self.engine.tokenizer, self.engine.max_model_len - 1  # room for one new token at least
        try:
            if len(prompt) > LONG_TEXT_CHARS and tok.certainly_longer_than(prompt, limit):
                raise ContextLengthError(f"the prompt ({len(prompt)} characters) is longer than the model's "
                                         f"context length ({self.engine.max_model_len} tokens)")
            return tok.encode(prompt)
        except TypeError:
            _refuse_surrogates(prompt)
            raise

    def _render_chat(self, req: ChatRequest) -> str:
        if self.engine.tokenizer is None:
            raise APIError("this model has no tokenizer, so no chat template", param="messages")
        try:
            return self.engine.tokenizer.render_chat(req.messages, req.add_generation_prompt, req.tools,
                                                     req.template_kwargs, self.template_limits,
                                                     req.continue_final_message)
        except TemplateOutputError as e:
            raise ContextLengthError(f"{e}: more than the model's context length ({self.engine.max_model_len} "
                                     f"tokens) can hold") from e
        except TemplateLimitError as e:
            raise APIError(f"cannot render the chat template: {e}", param="messages",
                           code="chat_template_limit") from e
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(f"cannot render the chat template: {e}", param="messages") from e

    def _rest_of_context(self, prompt_ids: list[int]) -> int:
        """Chat's default max_tokens: whatever the context has left after the prompt."""
        left = self.engine.max_model_len - len(prompt_ids)
        if left < 1:
            raise ContextLengthError(f"the prompt ({len(prompt_ids)} tokens) leaves no room in the model's "
                                     f"context length ({self.engine.max_model_len})")
        return left


def _text_chars(content) -> int:
    """Characters of a message's text (a string, or the text parts of a content list)."""
    if isinstance(content, list):
        return sum(len(part.get("text", "")) for part in content)
    return len(content or "")


def _refuse_surrogates(text: str) -> None:
    """A lone surrogate (JSON allows "\\ud800") is not Unicode text: a 400 saying where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"the prompt holds a lone surrogate {text[e.start]!r} at character {e.start}: "
                       f"it is not valid Unicode text", param="prompt") from None


def _raise_if_failed(event) -> None:
    # The server's own requests end in "abort" only when it stops (a client that went away reads no more).
    if event.finished and event.finish_reason == "abort":
        raise APIError("the server is shutting down; retry the request", 503, code="server_shutting_down",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if event.finished and event.finish_reason == "error":
        if event.retryable:  # a worker group or a replica failed and is being restarted: the same request may succeed
            raise APIError(f"generation failed: {event.error}", 503, code="worker_group_failed",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        raise APIError(f"generation failed: {event.error}", 500)

