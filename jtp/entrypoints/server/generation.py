"""The engine requests behind one API request, merged into one stream of events.

An API request asks for n choices of one or more prompts; each choice is its own engine
request. `Generation` submits them all or none, pumps each one's event stream into one queue
(so choices interleave as the engine produces them), records their metrics, and aborts
whatever is unfinished when the consumer stops early: a client that goes away frees its KV
blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import AsyncIterator, Sequence

from jtp.core.sampling_params import SamplingParams
from jtp.entrypoints.server.metrics import ServerMetrics


@dataclasses.dataclass
class ChoiceRequest:
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    images: Sequence = ()  # ImagePrompts whose placeholders prompt_ids hold


@dataclasses.dataclass
class _Tracked:
    """One engine request's progress, for usage and metrics."""

    choice: ChoiceRequest
    request_id: str | None = None
    submitted_at: float = 0.0
    first_token_at: float | None = None
    num_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None


class Generation:
    def __init__(self, engine, metrics: ServerMetrics, request_id: str, choices: list[ChoiceRequest]):
        self.engine, self.metrics = engine, metrics
        self.request_id = request_id
        self.tracked = [_Tracked(c) for c in choices]

    def submit(self) -> None:
        """Submit every choice, or none: on a refusal the ones already in are aborted first."""
        try:
            for i, t in enumerate(self.tracked):
                t.submitted_at = time.monotonic()
                # images= only when there are some: engines of text models take no such argument
                extra = {"images": t.choice.images} if t.choice.images else {}
                t.request_id = self.engine.submit(t.choice.prompt_ids, t.choice.params,
                                                  request_id=f"{self.request_id}-{i}", **extra)
        except BaseException:
            for t in self.tracked:
                if t.request_id is not None:
                    self.engine.abort(t.request_id)
            raise

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """(choice index, TokenEvent) until every choice has finished; an engine failure raises."""
        queue: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(i, queue)) for i in range(len(self.tracked))]
        try:
            remaining = len(pumps)
            while remaining:
                i, event = await queue.get()
                if isinstance(event, BaseException):
                    raise event
                if event.finished:
                    remaining -= 1
                yield i, event
        finally:
            self._abort_unfinished()  # synchronous, so it happens even if the awaits below are cancelled
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, i: int, queue: asyncio.Queue) -> None:
        tracked = self.tracked[i]
        try:
            # Closing the engine stream early (on cancel) aborts the request and releases it.
            async with contextlib.aclosing(self.engine.astream(tracked.request_id)) as stream:
                async for event in stream:
                    self._observe(tracked, event)
                    queue.put_nowait((i, event))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which answers the client
            queue.put_nowait((i, e))

    def _observe(self, t: _Tracked, event) -> None:
        now = time.monotonic()
        if event.token_ids:
            if t.first_token_at is None:
                t.first_token_at = now
                self.metrics.first_token(len(t.choice.prompt_ids), now - t.submitted_at)
            t.num_tokens += len(event.token_ids)
            self.metrics.generation_tokens.inc(len(event.token_ids))
        t.cached_tokens = max(t.cached_tokens, event.cached_tokens or 0)
        if event.finished:
            self._record_finish(t, event.finish_reason, now)
            if event.timing is not None:
                self.metrics.request_phases(event.timing)

    def _record_finish(self, t: _Tracked, reason: str, now: float) -> None:
        t.finish_reason = reason
        first = None if t.first_token_at is None else t.first_token_at - t.submitted_at
        self.metrics.finished(reason, t.num_tokens, now - t.submitted_at, first)

    def abort(self) -> None:
        """Abort every choice still unfinished (for a consumer that never started reading)."""
        self._abort_unfinished()

    def _abort_unfinished(self) -> None:
        now = time.monotonic()
        for t in self.tracked:
            if t.finish_reason is None:
                self.engine.abort(t.request_id)
                self._record_finish(t, "abort", now)

    # ------------------------------------------------------------------ usage

    def usage(self) -> dict:
        """OpenAI usage: each prompt counts once however many choices it has."""
        prompt_tokens: dict[int, int] = {}
        cached_tokens: dict[int, int] = {}
        for t in self.tracked:
            p = t.choice.prompt_index
            prompt_tokens[p] = len(t.choice.prompt_ids)
            cached_tokens[p] = max(cached_tokens.get(p, 0), t.cached_tokens)
        prompt_total = sum(prompt_tokens.values())
        completion_total = sum(t.num_tokens for t in self.tracked)
        return {
            "prompt_tokens": prompt_total,
            "completion_tokens": completion_total,
            "total_tokens": prompt_total + completion_total,
            "prompt_tokens_details": {"cached_tokens": sum(cached_tokens.values())},
        }
