"""Server-sent events: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end (OpenAI's chat and
completions); `event: NAME\\ndata: {json}\\n\\n` per event (Anthropic's Messages, OpenAI's Responses)."""

from __future__ import annotations

import json

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


# Characters JSON leaves raw that line readers built on str.splitlines() (httpx's among them) take for
# line ends: escaped, so a model's text can never cut an event in two.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _json(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def sse_data(payload: dict) -> str:
    return f"data: {_json(payload)}\n\n"


def sse_event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {_json(payload)}\n\n"


class EventStream(StreamingResponse):
    """A streamed response whose event generator is always closed when the response ends.

    Starlette stops iterating when the client disconnects but leaves closing the generator to
    the garbage collector; closing it here runs its cleanup (aborting the engine requests,
    freeing their KV blocks) at once, however the response ended.
    """

    media_type = "text/event-stream"

    def __init__(self, events):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
