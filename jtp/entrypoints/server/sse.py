"""Server-sent events: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end (OpenAI's chat and
completions); `event: NAME\\ndata: {json}\\n\\n` per event (Anthropic's Messages, OpenAI's Responses).

A stream that has sent nothing for a while (a long prompt prefilling) gets a `: keep-alive` comment,
which every SSE client skips, so that proxies with idle timeouts do not cut it."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncGenerator

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"
KEEPALIVE_INTERVAL = 15.0  # seconds of silence before a keep-alive comment (vLLM's and SGLang's users expect one)


# Characters JSON leaves raw that line readers built on str.splitlines() (httpx's among them) take for
# line ends: escaped, so a model's text can never cut an event in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _json(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def sse_data(payload: dict) -> str:
    return f"data: {_json(payload)}\n\n"


def sse_event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {_json(payload)}\n\n"


async def keepalive(events: AsyncGenerator[str, None], interval: float) -> AsyncGenerator[str, None]:
    """`events` in order, with a `KEEPALIVE` comment after each `interval` seconds in which none came.

    The step under way runs as a task of its own, which a timeout leaves running (cancelling it
    would end `events`); closing this generator cancels that step and closes `events`.
    """
    step = None
    try:
        while True:
            if step is None:
                step = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait([step], timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            finished, step = step, None
            try:
                event = finished.result()
            except StopAsyncIteration:
                return
            yield event
    finally:
        if step is not None:
            # Cancelled, the step unwinds `events` in its own task (aborting the engine requests at
            # once) even if this wait is cut short: a disconnect's cancel scope cancels it again.
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
        await events.aclose()


class EventStream(StreamingResponse):
    """A streamed response whose event generator is always closed when the response ends.

    Starlette stops iterating when the client disconnects but leaves closing the generator to
    the garbage collector; closing it here runs its cleanup (aborting the engine requests,
    freeing their KV blocks) at once, however the response ended.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], keepalive_interval: float):
        """`keepalive_interval`: seconds of silence before each keep-alive comment; 0: none."""
        if keepalive_interval > 0:
            events = keepalive(events, keepalive_interval)
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()

