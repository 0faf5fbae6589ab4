"""The Starlette app: routes, API-key check, and errors in the OpenAI shape.

    POST /v1/completions, /v1/chat/completions    generation (JSON or SSE)
    POST /v1/messages                             Anthropic's Messages API (errors in Anthropic's shape)
    POST /v1/responses                            OpenAI's Responses API (stored responses in memory)
    GET  /v1/models, /v1/models/{id}              the served model
    POST /tokenize, /detokenize                   vLLM's token-id helpers (behind the key, like /v1)
    GET  /version                                 jtp's version
    GET  /health  (alive)  /ready  (warmed up)  /metrics  (Prometheus)   never need a key
    GET  /stats                                   counts as JSON: the engine's, each replica's and pipeline stage's

No request can take the server down: whatever a handler raises becomes an error response. While
`jtp serve` drains (SIGTERM, `app.state.draining` set) it keeps accepting connections so that new
generation requests get a clear 503 instead of a refused connection, and /ready and /health say so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from typing import Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jtp.entrypoints.server.anthropic import error_body as anthropic_error
from jtp.entrypoints.server.connections import ConcurrencyLimit
from jtp.entrypoints.server.errors import RETRY_AFTER_SECONDS, APIError
from jtp.entrypoints.server.intake import Intake
from jtp.entrypoints.server.limits import ServerLimits
from jtp.entrypoints.server.metrics import ServerMetrics, stats_report
from jtp.entrypoints.server.serving import OpenAIServing
from jtp.entrypoints.server.sse import KEEPALIVE_INTERVAL
from jtp import __version__
from jtp.errors import RequestError

log = logging.getLogger(__name__)

Handler = Callable[[Request], Awaitable[Response]]


def build_app(engine, model_name: str, api_key: str | None = None, reasoning_parser: str | None = None,
              limits: ServerLimits = ServerLimits(), tool_parser: str | None = None,
              sse_keepalive_interval: float = KEEPALIVE_INTERVAL, allowed_media_domains: tuple[str, ...] = ()) -> Starlette:
    """The OpenAI-compatible app over a started engine (the caller warms it up and closes it).
    `allowed_media_domains`: hosts whose image URLs the server fetches (none: images as data: URIs only)."""
    metrics = ServerMetrics(engine, model_name)
    intake = Intake(limits)
    serving = OpenAIServing(engine, model_name, metrics, intake, reasoning_parser, limits.chat_template_timeout,
                            tool_parser, sse_keepalive_interval, allowed_media_domains)
    created = int(time.time())
    draining = threading.Event()  # set by `jtp serve` on SIGTERM

    def api(handler: Handler, generates: bool = False, anthropic: bool = False) -> Handler:
        """An /v1 route: key checked, errors answered in the OpenAI shape (or Anthropic's), never raised."""

        def answer(e: APIError) -> Response:
            if anthropic:
                return JSONResponse(anthropic_error(e), status_code=e.status, headers=e.headers)
            return e.response()

        async def route(request: Request) -> Response:
            try:
                _check_api_key(request, api_key)
                if generates and draining.is_set():
                    raise APIError("the server is shutting down and takes no new requests; retry the request", 503,
                                   code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                if generates and not engine.ready.is_set():
                    raise APIError("the model is still warming up; retry shortly", 503, code="not_ready",
                                   headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
                return await handler(request)
            except APIError as e:
                return answer(e)
            except RequestError as e:
                return answer(APIError.from_request_error(e))
            except Exception as e:  # noqa: BLE001 - a bad request must never take the server down
                log.exception("%s %s failed", request.method, request.url.path)
                return answer(APIError(f"internal error: {type(e).__name__}: {e}", 500))

        return route

    def with_body(handle: Callable[[bytes], Awaitable[Response]]) -> Handler:
        """A POST route: the body received within the limits, `handle(body)` cancelled if the client leaves."""

        async def route(request: Request) -> Response:
            async with intake.body(request) as raw:
                return await _cancel_on_disconnect(request, handle(raw))

        return route

    card = {"id": model_name, "object": "model", "created": created, "owned_by": "jtp",
            "max_model_len": engine.max_model_len}

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model(request: Request) -> Response:  # the openai client's models.retrieve
        name = request.path_params["name"]
        if name != model_name:
            raise APIError(f"the model {name!r} does not exist; this server serves {model_name!r}", 404,
                           code="model_not_found", param="model")
        return JSONResponse(card)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "draining" if draining.is_set() else "ok"})  # alive either way

    async def ready(request: Request) -> Response:
        if draining.is_set():  # a load balancer stops sending requests here
            return JSONResponse({"status": "draining"}, 503)
        if engine.ready.is_set():
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "warming up"}, 503, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    async def prometheus(request: Request) -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    async def stats(request: Request) -> Response:
        return JSONResponse(stats_report(engine))

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return APIError(exc.detail, exc.status_code, headers=exc.headers).response()

    routes = [
        Route("/v1/completions", api(with_body(serving.completions), generates=True), methods=["POST"]),
        Route("/v1/chat/completions", api(with_body(serving.chat), generates=True), methods=["POST"]),
        Route("/v1/messages", api(with_body(serving.messages), generates=True, anthropic=True), methods=["POST"]),
        Route("/v1/responses", api(with_body(serving.responses), generates=True), methods=["POST"]),
        Route("/v1/models", api(models), methods=["GET"]),
        Route("/v1/models/{name:path}", api(model), methods=["GET"]),
        Route("/tokenize", api(with_body(serving.tokenize)), methods=["POST"]),
        Route("/detokenize", api(with_body(serving.detokenize)), methods=["POST"]),
        Route("/version", version, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        intake.close()

    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan,
                    middleware=[Middleware(ConcurrencyLimit, limit=limits.limit_concurrency)])
    app.state.metrics = metrics
    app.state.draining = draining
    app.state.serving = serving  # launch.py probes the chat template through it
    return app


def _check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if "x-api-key" in request.headers:  # Anthropic's clients send the key in x-api-key
        scheme, token = "bearer", request.headers["x-api-key"]
    # Starlette decodes header bytes as latin-1; re-encode to get the bytes sent, so a UTF-8 key
    # compares as the UTF-8 bytes it is.
    token_bytes = token.strip().encode("latin-1")
    if scheme.lower() != "bearer" or not token_bytes or not hmac.compare_digest(token_bytes, api_key.encode()):
        raise APIError("missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'", 401,
                       code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


async def _cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run `work`, cancelling it if the client disconnects first (its engine requests are then
    aborted). A streamed response returns at once; the stream watches for disconnects itself."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
        raise
    finally:
        watcher.cancel()
