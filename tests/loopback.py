"""Loopback harness of the server and launcher tests: a real uvicorn server for an app, in a thread on
a free loopback port, and what a test watches from the other end of a socket."""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import uvicorn


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
