"""`jtp serve`: build the engine, listen at once, warm up in the background, serve until stopped.

/health answers as soon as the weights are loaded; /ready (and generation) wait for the
warm-up to compile the step shapes. Ctrl-C ends every open stream with an error event that says
the server is shutting down (a whole response: HTTP 503) before uvicorn waits for connections to
close, then the engine is closed. SIGTERM drains: the port stays open and a new request gets a
503 (`server_shutting_down`), the running ones get `--drain-timeout` seconds to finish (the server
exits as soon as none is left), then the rest end like Ctrl-C's and the engine (and its follower
processes) shut down. A stop during warm-up exits at once: nothing can be in flight before /ready,
and a compile under way is not waited for.

Multi-process groups: when a follower dies, hangs or diverges, the engine ends every request
with a retryable error (HTTP 503, Retry-After), the server stops, the followers are reaped, and
this process restarts its own image (JAX's runtime initialises once per process) keeping the
listening socket, so clients that connect meanwhile wait in its backlog and are then served.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from jtp.config.engine_args import EngineArgs
from jtp.distributed.launcher import is_follower
from jtp.engine.template_sandbox import TemplateLimitError
from jtp.entrypoints.cli_support import EXIT_INTERRUPTED, exit_now, interrupted, note, one_line, open_engine, run_follower
from jtp.entrypoints.server.app import build_app
from jtp.entrypoints.server.connections import header_timeout_protocol
from jtp.entrypoints.server.limits import ServerLimits
from jtp.entrypoints.server.reasoning import REASONING_PARSERS
from jtp.entrypoints.server.sse import KEEPALIVE_INTERVAL
from jtp.entrypoints.server.tool_parsers import TOOL_PARSERS
from jtp.errors import ConfigError, JtpError, WorkerGroupError

log = logging.getLogger(__name__)

API_KEY_ENV = "JTP_API_KEY"


@dataclasses.dataclass
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    reasoning_parser: str | None = None
    disable_uvicorn_access_log: bool = False
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    drain_timeout: float = 30.0
    sse_keepalive_interval: float = KEEPALIVE_INTERVAL
    max_request_bytes: int = ServerLimits.max_request_bytes
    max_buffered_bytes: int = ServerLimits.max_buffered_bytes
    body_timeout: float = ServerLimits.body_timeout
    header_timeout: float = ServerLimits.header_timeout
    keep_alive_timeout: float = ServerLimits.keep_alive_timeout
    limit_concurrency: int = ServerLimits.limit_concurrency
    chat_template_timeout: float = ServerLimits.chat_template_timeout
    allowed_media_domains: list[str] | None = None  # hosts whose image URLs are fetched (vLLM's flag)

    def limits(self) -> ServerLimits:
        return ServerLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ServerLimits)
                               if hasattr(self, f.name)})

    def validate(self) -> None:
        problems = self.limits().problems()
        if problems:
            raise ConfigError("; ".join(problems))
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError(f"--api-key (or ${API_KEY_ENV}) is empty: an empty key would let every client in; "
                              f"give a real key or leave both unset")
        if not self.sse_keepalive_interval >= 0:
            raise ConfigError(f"--sse-keepalive-interval {self.sse_keepalive_interval}: must be >= 0 seconds "
                              f"(0 sends no keep-alive comments)")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port}: must be in [0, 65535] (0 picks a free port)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser {self.reasoning_parser!r}: known parsers are "
                              f"{', '.join(REASONING_PARSERS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"--tool-call-parser {self.tool_call_parser!r}: known parsers are "
                              f"{', '.join(TOOL_PARSERS)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser NAME (the format of the model's "
                              f"calls: {', '.join(TOOL_PARSERS)})")

    @property
    def tool_parser(self) -> str | None:
        """The parser of tool calls in responses: only with --enable-auto-tool-choice (vLLM's rule)."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


def add_server_args(p: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    p.add_argument("--host", default=d.host, help=f"address to listen on (default: {d.host}, this machine only)")
    p.add_argument("--port", type=int, default=d.port, help=f"port to listen on (default: {d.port})")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}, else none); "
                        f"prefer setting ${API_KEY_ENV}, since a key in argv is readable by every local user in ps")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help=f"on SIGTERM, seconds the running requests get to finish before they are cut "
                        f"(default: {d.drain_timeout:g})")
    p.add_argument("--sse-keepalive-interval", type=float, default=d.sse_keepalive_interval,
                   help="send an SSE comment (': keep-alive', which clients skip) whenever a stream has sent "
                        "nothing for this many seconds (a long prompt prefilling), so proxies with idle timeouts "
                        f"do not cut it; 0: never (default: {d.sse_keepalive_interval:g})")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="return <think>...</think> as reasoning_content in chat responses")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access log line per request (probes of /health, /ready and /metrics never log one)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse the model's tool calls into message.tool_calls (tool_choice \"auto\"); needs "
                        "--tool-call-parser")
    p.add_argument("--tool-call-parser", choices=tuple(TOOL_PARSERS), default=None,
                   help="the format of the model's tool calls: hermes (Qwen3's <tool_call>{json}</tool_call>) or "
                        "qwen3_coder (Qwen3-Coder's and Qwen3.5's <function=...><parameter=...>)")
    p.add_argument("--allowed-media-domains", nargs="+", metavar="HOST", default=None,
                   help="fetch http(s) image URLs from these hosts (exact names; redirects are not followed); "
                        "default: none, images come as data: URIs only")
    g = p.add_argument_group("limits per client (see docs/security.md)")
    g.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help=f"largest request body accepted; larger is a 413 (default: {d.max_request_bytes})")
    g.add_argument("--max-buffered-bytes", type=int, default=d.max_buffered_bytes,
                   help="request-body bytes all clients together may have in flight; past it a 503 "
                        f"(default: {d.max_buffered_bytes})")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help=f"seconds a request body may take to arrive; slower is a 408 (default: {d.body_timeout:g})")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a connection may take to send complete request headers before it is closed "
                        f"(slowloris; default: {d.header_timeout:g})")
    g.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                   help=f"seconds an idle keep-alive connection stays open (default: {d.keep_alive_timeout:g})")
    g.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                   help=f"/v1 requests in flight at once; one more is a 503 (default: {d.limit_concurrency})")
    g.add_argument("--chat-template-timeout", type=float, default=d.chat_template_timeout,
                   help="seconds one chat-template render may take; longer is a 400 "
                        f"(default: {d.chat_template_timeout:g})")


# The engine's step thread shares the GIL with the event loop. When both want it CPython hands it
# over once per switch interval (5 ms by default), so under load every wait inside a step (the jitted
# call, the device's results) could cost the step thread 5 ms: Qwen3-8B decode steps of 64 streams took
# 13 ms instead of 7.6 (docs/bench/h200-serving2.md).
GIL_SWITCH_INTERVAL_S = 2e-4


def run_server(engine_args: EngineArgs, server_args: ServerArgs | argparse.Namespace) -> int:
    if isinstance(server_args, argparse.Namespace):
        server_args = ServerArgs.from_cli_args(server_args)
    server_args.validate()
    if is_follower(engine_args):  # one host of a launch across machines: follow the leader
        return run_follower(engine_args)
    sock = _listen(server_args.host, server_args.port)  # before loading: a busy port fails fast
    # A group restart re-executes this process; a duplicate of the socket keeps it listening.
    keep_fd = os.dup(sock.fileno()) if engine_args.is_multiprocess else None
    try:
        engine = open_engine(engine_args)
    except Exception as e:
        if keep_fd is not None and _start_again(e):
            # A restarted group failed to form (a follower died starting up): its clients wait in
            # the backlog, so back off and restart again rather than close the port.
            _restart(keep_fd, f"the worker group failed to start ({type(e).__name__}: {e})")
        sock.close()
        raise
    except BaseException:
        sock.close()
        raise
    os.environ.pop(FAILED_STARTS_ENV, None)
    warmup = None
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        engine.start()
        limits = server_args.limits()
        app = build_app(engine, engine_args.model_name(), server_args.api_key, server_args.reasoning_parser, limits,
                        server_args.tool_parser, server_args.sse_keepalive_interval,
                        tuple(server_args.allowed_media_domains or ()))
        _probe_template(app, engine_args.model_name())
        config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=10,
                                http=header_timeout_protocol(limits.header_timeout),
                                timeout_keep_alive=limits.keep_alive_timeout,
                                access_log=not server_args.disable_uvicorn_access_log)
        logging.getLogger("uvicorn.access").addFilter(QuietProbes())
        server = _Server(engine, config, server_args.drain_timeout, app.state.draining)
        warmup = _WarmUp(engine, engine_args.warmup, server)
        warmup.start()
        threading.Thread(target=_stop_on_failure, args=(engine, server), name="jtp-failure-watch", daemon=True).start()
        host, port = sock.getsockname()[:2]
        key = " (API key required)" if server_args.api_key else ""
        note(f"serving {engine_args.model_name()!r} on http://{_url_host(host)}:{port}/v1{key}; "
             f"/ready answers 200 after warm-up")
        server.run(sockets=[sock])
        status = 1 if warmup.failed and engine.failure is None else 0
    finally:
        if warmup is not None and warmup.is_alive() and engine.failure is None:  # (a failed group restarts)
            _exit_during_warmup(engine)
        engine.close()
    if engine.failure is not None and keep_fd is not None:
        if server.drain:  # the group failed while draining: SIGTERM asked this process to end
            note("the worker group failed while draining; exiting as SIGTERM asked, not restarting")
            exit_now(status)  # the broken group's native threads can abort an ordinary interpreter exit
        else:
            _restart(keep_fd, engine.failure)
    return status


class QuietProbes(logging.Filter):
    """Leaves health probes out of the access log: a load balancer's every few seconds would bury the requests."""

    PATHS = ("/health", "/ready", "/metrics")

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path, http version, status)
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and isinstance(args[2], str) and args[2].split("?")[0] in self.PATHS)


def _probe_template(app, model: str) -> None:
    """A checkpoint whose chat template cannot render one short message within the limits is
    refused at start-up, in one line, rather than failing every chat request."""
    try:
        app.state.serving.probe_template()
    except TemplateLimitError as e:
        raise ConfigError(f"{model}: {e} rendering a one-message chat; fix or replace its chat template") from None
    except Exception as e:  # noqa: BLE001 - any template failure is the checkpoint's, reported in one line
        raise ConfigError(f"{model}: its chat template fails on a one-message chat: {type(e).__name__}: {e}") from None


def _exit_during_warmup(engine) -> None:
    """Stopped while the warm-up compiles: no request can be running (nothing is served before
    /ready), and closing the engine would wait for the compile under way, so end the followers and
    exit now (0 for SIGTERM, 130 for Ctrl-C), quietly."""
    if engine.group is not None:
        engine.group.close(kill=True)
    exit_now(EXIT_INTERRUPTED if interrupted() else 0)


def _stop_on_failure(engine, server: uvicorn.Server) -> None:
    engine.failed.wait()
    note("the worker group failed; stopping the server to restart it")
    server.should_exit = True


RESTARTS_ENV = "JTP_RESTARTS"  # "count,first restart time" of recent group restarts
LISTEN_FD_ENV = "JTP_LISTEN_FD"
FAILED_STARTS_ENV = "JTP_FAILED_STARTS"  # restarted groups in a row that failed to start
MAX_FAILED_STARTS = 5


def _is_final(e: Exception) -> bool:
    """A start-up failure that another start would meet again: the configuration or the checkpoint."""
    return isinstance(e, JtpError) and not isinstance(e, WorkerGroupError)


def _start_again(e: Exception) -> bool:
    """Whether a restarted group that failed to start (`e`) is restarted again: not for the configuration
    or the checkpoint, and not after MAX_FAILED_STARTS in a row -- a failure every start meets (out of
    memory, a bug) ends the process for its supervisor to see."""
    failed_starts = int(os.environ.get(FAILED_STARTS_ENV, "0")) + 1
    if RESTARTS_ENV not in os.environ or _is_final(e) or failed_starts >= MAX_FAILED_STARTS:
        return False
    os.environ[FAILED_STARTS_ENV] = str(failed_starts)
    return True


def _restart(listen_fd: int, reason: str) -> None:
    """Re-execute this process (same interpreter and arguments) keeping the listening socket.
    Restarts back off (0, 1, 2, 4 ... 30 s) while they keep coming within ten minutes."""
    count, first = (float(x) for x in os.environ.get(RESTARTS_ENV, "0,0").split(","))
    now = time.time()
    if now - first > 600:
        count, first = 0, now
    delay = 0.0 if count == 0 else min(30.0, 2 ** (count - 1))
    note(f"restarting the worker group (restart {int(count) + 1}; in {delay:.0f} s): {reason}")
    time.sleep(delay)
    os.environ[RESTARTS_ENV] = f"{int(count) + 1},{first}"
    os.environ[LISTEN_FD_ENV] = str(listen_fd)
    os.set_inheritable(listen_fd, True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, sys.orig_argv)


class _Server(uvicorn.Server):
    """uvicorn waits for open connections before it shuts down: end the engine's streams first."""

    def __init__(self, engine, config: uvicorn.Config, drain_timeout: float = 0.0,
                 draining: threading.Event | None = None):
        super().__init__(config)
        self.engine, self.drain_timeout = engine, drain_timeout
        self.drain = False  # SIGTERM came: drain, and a group failure then ends the process (no restart)
        self.draining = draining or threading.Event()

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGTERM:  # drain, then exit 0 once the followers are reaped (uvicorn would
            self.drain = True  # re-raise SIGTERM after serving and skip that)
            self.should_exit = True
            return
        super().handle_exit(sig, frame)  # Ctrl-C aborts at once

    async def shutdown(self, sockets=None) -> None:
        if self.drain and self.engine.ready.is_set():
            # Still listening: a new request gets the app's 503, not a refused connection.
            self.draining.set()
            await asyncio.to_thread(self.engine.drain, self.drain_timeout)
        for server in self.servers:
            server.close()  # no new connections while the open streams end
        if self.engine.ready.is_set():  # (warming up: nothing is in flight; run_server exits at once)
            await asyncio.to_thread(self.engine.stop)  # every unfinished request gets its "abort" event
        await super().shutdown(sockets)
        if self.force_exit:  # a second Ctrl-C made uvicorn skip the app's shutdown; its task would be
            await self.lifespan.shutdown()  # cancelled at exit and log a traceback


class _WarmUp(threading.Thread):
    """Compiles the step shapes while /health already answers; a failure stops the server."""

    def __init__(self, engine, enabled: bool, server: uvicorn.Server):
        super().__init__(name="jtp-warmup", daemon=True)
        self.engine, self.enabled, self.server = engine, enabled, server
        self.failed = False

    def run(self) -> None:
        try:
            if self.enabled:
                self.engine.warmup(progress=True)
                if self.engine.warmup_report is not None:
                    note(self.engine.warmup_report.summary())
            self.engine.ready.set()
            if not self.server.should_exit:
                note("ready")
        except Exception as e:  # noqa: BLE001 - reported, then the server exits non-zero
            if self.engine.failure is not None:  # a group failure: the server restarts instead
                return
            if isinstance(e, JtpError):  # says what to change (out of device memory, say): one line
                print(f"error: {one_line(e)}; stopping the server", file=sys.stderr, flush=True)
            else:
                log.exception("warm-up failed; stopping the server")
            self.failed = True
            self.server.should_exit = True


def _listen(host: str, port: int) -> socket.socket:
    inherited = os.environ.pop(LISTEN_FD_ENV, None)
    if inherited is not None:  # restarted after a worker-group failure: the socket never closed
        sock = socket.socket(fileno=int(inherited))
        os.set_inheritable(sock.fileno(), False)
        return sock
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ConfigError(f"--host {host}: {e.strerror or e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # Listen now, not when uvicorn starts: once the address is announced, a client that connects
    # waits in the backlog instead of being refused while the app is still being set up.
    sock.listen(2048)
    return sock


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
