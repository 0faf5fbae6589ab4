"""Request intake kept off the event loop: bodies read with a size cap and a time limit, then
parsed, rendered and tokenized on a small thread pool.

One event loop serves every connection, so anything slow on it (a 10 MB JSON body, a chat
template, a tokenizer call) stalls /health and every other stream. Here the loop only moves
bytes; the CPU work runs on `run`'s threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
from typing import Any, AsyncIterator, Callable, TypeVar

from starlette.requests import Request

from jtp.entrypoints.server.errors import RETRY_AFTER_SECONDS, APIError
from jtp.entrypoints.server.limits import ServerLimits

T = TypeVar("T")


class Intake:
    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self._pool = concurrent.futures.ThreadPoolExecutor(limits.intake_threads, thread_name_prefix="jtp-intake")
        self._buffered = 0  # bytes of bodies being received now (event loop only: no lock)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @contextlib.asynccontextmanager
    async def body(self, request: Request) -> AsyncIterator[bytes]:
        """The whole body, counted against the bytes all clients may have buffered until the
        block ends: 413 past the size limit (refused from Content-Length before reading when it is
        given), 408 when it does not arrive in time, 503 when the buffers of all are full."""
        limit = self.limits.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        size = 0
        try:
            chunks = []
            try:
                async with asyncio.timeout(self.limits.body_timeout):
                    async for chunk in request.stream():
                        size += len(chunk)
                        self._buffered += len(chunk)
                        if size > limit:
                            raise _too_large(size, limit)
                        # Many clients each under the size limit must not add up to all the memory.
                        if self._buffered > self.limits.max_buffered_bytes:
                            raise APIError(f"the server is receiving {self._buffered} bytes of request bodies "
                                           f"at once, past its limit of {self.limits.max_buffered_bytes} "
                                           f"(--max-buffered-bytes); retry shortly", 503, code="server_busy",
                                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                        chunks.append(chunk)
            except TimeoutError:
                raise APIError(f"the request body did not arrive within {self.limits.body_timeout:g} s "
                               f"({size} bytes came)", 408, code="request_timeout") from None
            raw = b"".join(chunks)
            del chunks
            yield raw
        finally:
            self._buffered -= size

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# json.loads holds the GIL while it builds objects (seconds for a few MB of `[[],[],...]`), which
# no thread pool hides: bound the number of values it can build, counted on the raw bytes first.
MAX_JSON_CONTAINERS = 16384  # arrays and objects


def parse_json(raw: bytes, max_values: int) -> Any:
    """The parsed body; a 400 if it is not JSON or holds more than `max_values` comma-separated
    values or MAX_JSON_CONTAINERS arrays and objects (an over-count: commas in strings count too)."""
    containers = raw.count(b"[") + raw.count(b"{")
    if containers > MAX_JSON_CONTAINERS:
        raise APIError(f"the request body holds up to {containers} JSON arrays and objects; at most "
                       f"{MAX_JSON_CONTAINERS} are accepted", code="request_too_complex")
    values = raw.count(b",")
    if values > max_values:
        raise APIError(f"the request body holds up to {values} comma-separated values; at most {max_values} "
                       f"are accepted (a prompt can never be longer than the context)", code="request_too_complex")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(f"the request body is not valid JSON: {e}") from e


def _too_large(size: int, limit: int) -> APIError:
    return APIError(f"the request body ({size} bytes or more) is larger than this server's limit of {limit} "
                    f"bytes (--max-request-bytes)", 413, code="request_too_large")
