"""Output processing: sampled tokens -> per-request streams of `TokenEvent`s and a `Completion`.

The engine's step hands each sampled token to `OutputProcessor.append_token`, which detokenises it,
checks the stop strings, collects logprobs and queues the event on the request's `RequestStream`.
Consumers (`stream`, `astream`, `result`) read from those streams on their own threads. Events of
one step are delivered together by `publish()`: one lock and one wake-up per request per step
(a multi-step or speculative step yields several tokens per request), not one per token. A
request's finished event is delivered at once, with whatever the step had queued before it.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from typing import Callable, NamedTuple

import numpy as np

from jtp.core.scheduler import Request, Status
from jtp.core.step_input import scored_prompt_positions
from jtp.engine.stop_strings import StopMatcher
from jtp.engine.tokenizer import Tokenizer
from jtp.errors import QueueFullError


@dataclasses.dataclass
class PromptLogprobs:
    """A request's prompt logprobs (vLLM's `prompt_logprobs`), one entry per prompt token; the first
    token has no context to be scored in, so its entries are None."""

    token_ids: list[int]  # the prompt
    logprobs: list[float | None]  # the raw log-probability of the prompt token where it stands
    ranks: list[int | None]  # its rank in that distribution (1: the most likely)
    top: list[dict[int, float] | None]  # the `prompt_logprobs` most likely tokens there, best first


@dataclasses.dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]  # new tokens
    text: str  # new text (complete UTF-8 characters; stop strings held back until resolved)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # set when finish_reason == "error"
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (finished event)
    retryable: bool = False  # an "error" the same request may succeed on later (a failed group or replica)
    # What stopped a "stop" (vLLM's stop_reason): the stop string matched, or the stop token id given in
    # stop_token_ids; None for an end-of-sequence token (or any other end).
    stop_reason: str | int | None = None
    prompt_logprobs: PromptLogprobs | None = None  # on a request's first event, when it asked for them
    timing: RequestTiming | None = None  # on the finished event


class RequestTiming(NamedTuple):
    """A finished request's phases in seconds, as vLLM's request_*_time_seconds: `queue` from
    submission until the scheduler first gave it a row, `prefill` from then until its first token,
    `decode` from its first token to the end, `inference` from its first row to the end. None for a
    phase the request never reached (an abort while waiting, a failure before its first token): each
    phase's histogram counts the requests that reached it."""

    queue: float
    prefill: float | None
    decode: float | None
    inference: float | None

    @classmethod
    def of(cls, req: Request, now: float) -> RequestTiming:
        scheduled, first = req.scheduled_time, req.first_token_time
        return cls((scheduled if scheduled is not None else now) - req.arrival,
                   None if scheduled is None or first is None else first - scheduled,
                   None if first is None else now - first,
                   None if scheduled is None else now - scheduled)


@dataclasses.dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    retryable: bool = False  # an "error" the same request may succeed on later (a failed group or replica)


class RequestStream:
    """One request's output: its detokeniser and stop strings, and the queue its consumer reads."""

    def __init__(self, request: Request, tokenizer: Tokenizer | None):
        self.request = request
        self.detok = tokenizer.incremental_decoder(request.params.skip_special_tokens) if tokenizer else None
        self.text = ""
        self.emitted = 0  # chars of text already streamed
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._unpublished: list[TokenEvent] = []  # this step's events, delivered by publish()
        self._ready = threading.Condition()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.done = threading.Event()
        self.error: str | None = None
        self.retryable = False
        self.stopped_by_string = False
        self.stop_reason: str | int | None = None  # see TokenEvent.stop_reason
        self.orphaned = False  # its consumer went away before the end
        self.stops = StopMatcher(request.params.stop)
        self.prompt_logprobs = (PromptLogprobs(request.prompt_ids, [None], [None], [None])
                                if request.params.prompt_logprobs is not None else None)

    def add_token(self, token: int, may_stop: bool = True) -> bool:
        """Append the token's text; True if a stop string now ends the output (never unless `may_stop`)."""
        if self.detok is None:
            return False
        new = self.detok.add(token)
        self.text += new
        if not self.stops.active:
            return False
        cut = self.stops.feed(new, may_stop)  # O(len(new)), however many stop strings there are
        if cut is None:
            return False
        # The stop string that ended it: the longest one the text goes on with at the cut.
        self.stop_reason = max((s for s in self.request.params.stop if self.text.startswith(s, cut)), key=len,
                               default=None)
        if self.request.params.include_stop_str_in_output and self.stop_reason is not None:
            cut += len(self.stop_reason)  # vLLM's: the text ends with the stop string, not before it
        self.text = self.text[:cut]
        self.stopped_by_string = True
        return True

    def take_text(self, finished: bool) -> str:
        if finished and self.detok is not None and not self.stopped_by_string:
            self.text += self.detok.flush()
        # Hold back only the tail that could still begin a stop string.
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.stops.pending)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def queue(self, event: TokenEvent) -> bool:
        """Hold `event` for the next publish(); True if it is the first one held."""
        self._unpublished.append(event)
        return len(self._unpublished) == 1

    def publish(self) -> None:
        """Deliver the held events to the consumer: one lock, one wake-up."""
        if not self._unpublished:
            return
        events, self._unpublished = self._unpublished, []
        with self._ready:
            self._events.extend(events)
            self._ready.notify_all()
            wakers = list(self._wakers)
        for loop, flag in wakers:
            try:
                loop.call_soon_threadsafe(flag.set)
            except RuntimeError:  # that consumer's event loop is closed
                pass

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event, waiting up to `timeout` (None: forever); None if none came."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._events, timeout):
                return None
            return self._events.popleft()

    def has_events(self) -> bool:
        with self._ready:
            return bool(self._events)

    def get_nowait(self) -> TokenEvent | None:
        with self._ready:
            return self._events.popleft() if self._events else None

    def add_waker(self, loop: asyncio.AbstractEventLoop, flag: asyncio.Event) -> None:
        with self._ready:
            self._wakers.append((loop, flag))


class OutputProcessor:
    """Every live request's stream, by id, and the consumers that read them. The dict is guarded
    by the engine's intake lock (`lock`); the streams' text and event state by whoever steps (the
    step lock). `pump()` runs an engine step when no loop thread does (manual mode) and says
    whether it did; `abort(request_id)` is the engine's."""

    def __init__(self, tokenizer: Tokenizer | None, lock: threading.Condition, pump: Callable[[], bool],
                 abort: Callable[[str], bool]):
        self.tokenizer = tokenizer
        self.lock = lock
        self.pump, self.abort = pump, abort
        self._streams: dict[str, RequestStream] = {}
        self._to_publish: list[RequestStream] = []

    # --------------------------------------------------------------- the registry (intake lock held)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, request: Request) -> RequestStream:
        stream = self._streams[request.id] = RequestStream(request, self.tokenizer)
        return stream

    def get(self, request_id: str) -> RequestStream | None:
        return self._streams.get(request_id)

    def unfinished(self) -> list[RequestStream]:
        return [s for s in self._streams.values() if not s.done.is_set()]

    # --------------------------------------------------------------- (takes the intake lock)

    def stream(self, request_id: str) -> RequestStream:
        with self.lock:
            out = self._streams.get(request_id)
        if out is None:
            raise KeyError(f"unknown request id {request_id!r} (never submitted, or already consumed)")
        return out

    def release(self, request_id: str) -> None:
        """Forget a finished request (idempotent)."""
        with self.lock:
            out = self._streams.get(request_id)
            if out is not None and out.request.status is Status.FINISHED:
                del self._streams[request_id]

    # --------------------------------------------------------------- the step's side (step lock held)

    def append_token(self, req: Request, token: int, result, b: int) -> tuple[TokenEvent, str | None]:
        """Add a sampled token (row `b` of a step's `result`) to the request: its event, and the
        finish reason it brings (the caller then finishes the request with that event), else None
        and the event is queued for publish()."""
        out = self._streams[req.id]
        req.output_ids.append(token)
        logprob = top = None
        if req.params.logprobs is not None:
            logprob = [float(result.logprob[b])]
            out.logprobs += logprob
            n = req.params.logprobs
            top = [{int(i): float(v) for i, v in zip(result.top_ids[b][:n], result.top_logprobs[b][:n])}] if n else None
            if top:
                out.top_logprobs += top
        reason = None
        may_stop = len(req.output_ids) >= req.params.min_tokens  # vLLM's: no stop before min_tokens
        if may_stop and token in req.stop_ids:
            reason = "stop"
            out.stop_reason = token if token in req.params.stop_token_ids else None
            if req.params.include_stop_str_in_output:  # vLLM's: the stop token's text too (none when skipped)
                out.add_token(token, False)
        elif out.add_token(token, may_stop):  # a stop string
            reason = "stop"
        elif len(req.output_ids) >= req.params.max_tokens:
            reason = "length"
        event = TokenEvent(req.id, [token], "", logprob, top)
        if len(req.output_ids) == 1:
            event.prompt_logprobs = out.prompt_logprobs
        if reason is None:
            event.text = out.take_text(False)
            if out.queue(event):
                self._to_publish.append(out)
        return event, reason

    def add_prompt_scores(self, rows: list, chunks: tuple) -> None:
        """File a step's prompt logprobs (`PromptScores` of its positions in row order, chunk after
        chunk, on the host) with the requests of its scheduled rows that asked for them."""
        scores = type(chunks[0])(*(np.concatenate(field) for field in zip(*chunks)))
        at = 0
        for row in rows:
            req = row.request
            if req.params.prompt_logprobs is None:
                continue
            n = scored_prompt_positions(row.start, row.num_tokens, len(req.prompt_ids))
            out, k = self._streams.get(req.id), req.params.prompt_logprobs
            if out is not None:
                kept = out.prompt_logprobs
                kept.logprobs += scores.logprob[at : at + n].tolist()
                kept.ranks += scores.rank[at : at + n].tolist()
                kept.top += [dict(zip(ids, lps)) for ids, lps in
                             zip(scores.top_ids[at : at + n, :k].tolist(), scores.top_logprobs[at : at + n, :k].tolist())]
            at += n

    def finish(self, out: RequestStream, reason: str, event: TokenEvent | None = None) -> None:
        """End the request's stream with its finished event, delivered at once (the request's
        status is already FINISHED)."""
        req = out.request
        req.finish_reason = reason
        event = event or TokenEvent(req.id, [], "", error=out.error, retryable=out.retryable)
        event.cached_tokens = req.cached_tokens
        event.timing = RequestTiming.of(req, time.monotonic())
        event.text += out.take_text(True)
        event.finished, event.finish_reason = True, reason
        event.stop_reason = out.stop_reason if reason == "stop" else None
        out.queue(event)
        out.publish()
        out.done.set()
        if out.orphaned:
            self.release(req.id)

    def publish(self) -> None:
        """Deliver the events queued since the last call, one wake-up per request."""
        pending, self._to_publish = self._to_publish, []
        for out in pending:
            out.publish()

    # --------------------------------------------------------------- consumers (any thread)

    def events(self, request_id: str, timeout: float | None = None):
        """Yield the request's events up to its finished one, then release it; closing early aborts it."""
        out = self.stream(request_id)  # claimed now: an abort after this still reaches the consumer
        return self._events(out, timeout)

    def _events(self, out: RequestStream, timeout: float | None):
        finished = False
        try:
            while not finished:
                while not out.has_events() and self.pump():
                    pass
                event = out.get(timeout)
                if event is None:
                    raise TimeoutError(f"no event for request {out.request.id!r} within {timeout} s")
                finished = event.finished
                yield event
        finally:
            self._end_consumer(out.request.id, finished)

    async def aevents(self, request_id: str):
        """`events` for asyncio: waits without blocking the event loop (a loop thread steps)."""
        out = self.stream(request_id)
        flag = asyncio.Event()
        out.add_waker(asyncio.get_running_loop(), flag)
        finished = False
        try:
            while not finished:
                event = out.get_nowait()
                if event is None:
                    await flag.wait()
                    flag.clear()
                    continue
                finished = event.finished
                yield event
        finally:
            self._end_consumer(request_id, finished)

    def _end_consumer(self, request_id: str, finished: bool) -> None:
        if not finished:
            self.abort(request_id)  # marks it orphaned: released once its abort is carried out
        self.release(request_id)

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait for the request to finish and return it whole; releases it."""
        out = self.stream(request_id)
        while not out.done.is_set() and self.pump():
            pass
        if not out.done.wait(timeout):
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s")
        self.release(request_id)
        req = out.request
        return Completion(
            req.id, req.prompt_ids, list(req.output_ids), out.text, req.finish_reason,
            out.logprobs or None, out.top_logprobs or None, out.error, out.prompt_logprobs,
            out.retryable,
        )


def generate_all(engine, prompts, params=None) -> list[Completion]:
    """An offline batch on `engine` (an Engine, or anything with its submit / abort / release /
    result): submit everything, run until all finish, results in input order. A batch larger than
    the waiting queue (max_waiting_requests) is fed as its earlier requests finish."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids, results = [], []
    try:
        for p, sp in zip(prompts, params_list, strict=True):
            while True:
                try:
                    ids.append(engine.submit(p, sp))
                    break
                except QueueFullError:
                    if len(results) == len(ids):  # none of ours is queued: others fill the queue
                        raise
                    results.append(engine.result(ids[len(results)]))  # room comes as ours finish
    except BaseException:  # Ctrl-C in a wait for room too
        for rid in ids[len(results):]:  # all or nothing: don't leave the valid ones running unowned
            engine.abort(rid)
            engine.release(rid)
        raise
    return results + [engine.result(rid) for rid in ids[len(results):]]
