"""Loopback harness of the server and launcher tests: a real uvicorn server for an app, in a thread on
a free loopback port, and what a test watches from the other end of a socket."""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import uvicorn


CHAT = [{"role": "user", "content": "Hello! How are you today?"}]


@contextlib.contextmanager
def serving_engine(args):
    """`build_engine(args)` with its loop started (no warm-up: a test compiles only what it uses)
    behind a loopback server; yields (engine, base URL, an openai client of it), closes the engine."""
    import openai

    from jtp.engine.data_parallel import build_engine
    from jtp.entrypoints.server import build_app

    engine = build_engine(args)
    engine.start()
    engine.ready.set()
    try:
        with serving(build_app(engine, args.model_name())) as url:
            yield engine, url, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        engine.close()


def chat_whole_and_streamed(client, model: str, **extra):
    """CHAT answered greedily (8 tokens) whole and streamed: the whole response, and the streamed
    text, which must equal its content."""
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, **extra)
    parts = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert whole.choices[0].message.content and streamed == whole.choices[0].message.content
    return whole


@contextlib.contextmanager
def serving(app, **config):
    """Yields the base URL; `config` goes to uvicorn.Config (e.g. the protocol and timeouts
    `jtp serve` sets)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True once the peer hangs up within `timeout` (whatever it sends before, e.g. its greeting)."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if sock.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False
