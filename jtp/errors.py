"""The errors jtp raises on purpose. Each says what is wrong and why, in one line.

`JtpError` is what the CLI prints as one line (no traceback); the HTTP server maps
`RequestError` and its kinds onto OpenAI-shaped error bodies and status codes.
"""

from __future__ import annotations


class JtpError(Exception):
    """An error whose message is meant for the user as it is."""


class ConfigError(JtpError, ValueError):
    """A model directory, config.json or engine setting jtp cannot serve."""


class CheckpointError(JtpError, ValueError):
    """The checkpoint does not match what the config describes."""


class ShardingError(JtpError, ValueError):
    """The model cannot be split over the requested number of devices."""


class RequestError(JtpError, ValueError):
    """A request that can never be served (bad parameters, too long, larger than the pool).

    `code` follows the OpenAI error body's `code` field where one applies; `param` names the
    request field at fault, where one is.
    """

    status = 400
    code: str | None = None

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.param = param


class ContextLengthError(RequestError):
    code = "context_length_exceeded"


class QueueFullError(RequestError):
    """The waiting queue is full: try again later (HTTP 429)."""

    status = 429
    code = "queue_full"


class EngineClosedError(RequestError):
    """The engine was stopped or closed and takes no new requests (HTTP 503)."""

    status = 503
    code = "engine_closed"


class WorkerGroupError(RequestError):
    """A follower process of a multi-process group died, hung or diverged; the group is being
    restarted and the same request may be retried (HTTP 503 with Retry-After)."""

    status = 503
    code = "worker_group_failed"


class NoReplicaError(RequestError):
    """Every data-parallel replica has failed and is being rebuilt: the same request may be retried
    shortly (HTTP 503 with Retry-After)."""

    status = 503
    code = "no_replica_available"


class DeviceMemoryError(JtpError, RuntimeError):
    """The device (or, on a CPU, the host) ran out of memory; the message names the flag to change."""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA's out-of-memory (RESOURCE_EXHAUSTED), whatever exception type carries it."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text


def out_of_memory(error: BaseException, doing: str, remedy: str) -> DeviceMemoryError:
    """One line: what ran out of memory while `doing` what, XLA's own first line, and what to change."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return DeviceMemoryError(f"out of device memory {doing} ({first[:300]}): {remedy}")
