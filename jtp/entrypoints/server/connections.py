"""Connection hygiene below the app: slow clients are closed, and past a concurrency limit a
request gets a clear 503 instead of a queue that never drains.

uvicorn closes idle keep-alive connections but has no timeout for a request's headers: a client
that sends half a request line holds its socket (and a file descriptor) forever, so a few hundred
such sockets starve every other client (slowloris). `header_timeout_protocol` closes a connection
whose headers are not complete in time, counted from connecting or from its last response.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from jtp.entrypoints.server.errors import RETRY_AFTER_SECONDS, APIError

log = logging.getLogger(__name__)


def header_timeout_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing connections that do not send complete headers in `seconds`."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # still waiting for a request's headers
                if self._header_timer is None:
                    self._arm()  # idle after a response: uvicorn's keep-alive timer was just cancelled
            else:
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closing %s: no complete request headers within %g s", _peer(self.client), seconds)
                self.transport.close()

    return HeaderTimeoutProtocol


def _peer(client) -> str:
    return "%s:%d" % client if client else "a client"


class ConcurrencyLimit:
    """ASGI middleware: at most `limit` requests in flight (streams until their last byte); one
    more gets a 503 with Retry-After in the OpenAI shape. `exempt` paths (health checks) always pass."""

    def __init__(self, app, limit: int, exempt: tuple[str, ...] = ("/health", "/ready", "/metrics")):
        self.app, self.limit, self.exempt = app, limit, exempt
        self.active = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt:
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            error = APIError(f"the server is at its limit of {self.limit} concurrent requests "
                             f"(--limit-concurrency); retry shortly", 503, code="too_many_requests_in_flight",
                             headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
            return await error.response()(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
