"""Errors as the OpenAI API returns them: `{"error": {"message", "type", "param", "code"}}`.

`APIError` is raised anywhere in the server for a request that cannot be served; the engine's
own `RequestError`s (bad parameters, context length, queue full, engine closed) carry their
HTTP status and code and are mapped here too, so every failure reaches the client in one shape.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from jtp.errors import RequestError

RETRY_AFTER_SECONDS = 1  # what a 429 / 503 asks the client to wait

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.code, self.param = message, status, code, param
        self.headers = headers or {}

    @classmethod
    def from_request_error(cls, e: RequestError) -> "APIError":
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if e.status in (429, 503) else None
        return cls(str(e), e.status, e.code, e.param, headers)

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
