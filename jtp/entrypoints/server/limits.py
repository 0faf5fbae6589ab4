"""What one client may ask of the server: sizes, counts and timeouts, with their defaults.

Each is a `jtp serve` flag (launch.py); `build_app` and the uvicorn config read them from here.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    max_request_bytes: int = 16 * 2**20  # a request body past this is a 413, unread
    max_buffered_bytes: int = 256 * 2**20  # all bodies being received at once; past this a 503
    body_timeout: float = 30.0  # seconds to receive a whole body once its headers are in (408)
    header_timeout: float = 10.0  # seconds from connecting (or going idle) to complete headers
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this
    limit_concurrency: int = 1024  # /v1 requests in flight; one more is a 503
    chat_template_timeout: float = 5.0  # seconds one chat-template render may take
    intake_threads: int = 4  # threads that parse, render and tokenize requests off the event loop

    def problems(self) -> list[str]:
        """Each bad value as '--flag VALUE: why'."""
        bad = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not value > 0:
                bad.append(f"--{f.name.replace('_', '-')} {value}: must be > 0")
        return bad
