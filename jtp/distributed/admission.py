"""Admitting followers on the control port without letting any connection hold the door.

Any local user can see the control port (`ss -tln`) and connect to it, so the leader never waits
on one peer: an accept thread hands every connection to a short-lived thread of its own, which
must complete the handshake and read the follower's HELLO within `handshake_timeout` seconds or
closes the connection. Idle, slow and half-finished connections therefore cost a thread and a
descriptor each until their deadline, never a real follower's time: its handshake takes
milliseconds once accepted. At most `max_pending` are kept; past that the oldest is dropped, so a
flood cannot exhaust the leader's descriptors either.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import socket
import threading
import time

from jtp.distributed.control import (
    AuthenticationError,
    Channel,
    ChannelError,
    Kind,
    accept_handshake,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Arrival:
    """A peer that proved the launch secret and said HELLO."""

    channel: Channel
    hello: dict
    peer: str


class Admission:
    """Accepts and handshakes connections concurrently; `next()` yields the ones that said HELLO."""

    def __init__(self, listener: socket.socket, secret: bytes, handshake_timeout: float = 10.0,
                 max_pending: int = 64):
        self._listener, self._secret = listener, secret
        self._handshake_timeout, self._max_pending = handshake_timeout, max_pending
        self._arrivals: queue.Queue[Arrival] = queue.Queue()
        self._pending: dict[socket.socket, threading.Thread] = {}  # in arrival order: the oldest first
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._flooded = False
        self._acceptor = threading.Thread(target=self._accept_loop, name="jtp-admission", daemon=True)

    def start(self) -> "Admission":
        self._acceptor.start()
        return self

    def next(self, timeout: float) -> Arrival | None:
        """The next peer that said HELLO, or None after `timeout` seconds."""
        try:
            return self._arrivals.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stop accepting; drop every connection still handshaking and every arrival not taken."""
        self._closed.set()
        self._acceptor.join()
        with self._lock:
            pending = list(self._pending.items())
        for sock, _ in pending:
            _hang_up(sock)
        for _, thread in pending:
            thread.join(self._handshake_timeout)
        while (arrival := self.next(0)) is not None:
            arrival.channel.close()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def _accept_loop(self) -> None:
        self._listener.settimeout(0.1)  # to notice close()
        while not self._closed.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as e:  # out of descriptors, for one: wait, the pending ones expire
                log.warning("control port: accept failed: %s", e)
                time.sleep(0.1)
                continue
            self._handshake_later(sock, peer[0])

    def _handshake_later(self, sock: socket.socket, peer: str) -> None:
        thread = threading.Thread(target=self._handshake, args=(sock, peer), name="jtp-handshake", daemon=True)
        with self._lock:
            if len(self._pending) >= self._max_pending:
                oldest = next(iter(self._pending))
                if not self._flooded:  # once per flood: a flood must not flood the log too
                    log.warning("control port: %d connections handshaking at once; dropping the oldest", len(self._pending))
                self._flooded = True
                del self._pending[oldest]
                _hang_up(oldest)  # its thread wakes up, fails and closes it
            else:
                self._flooded = False
            self._pending[sock] = thread
        thread.start()

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        deadline = time.monotonic() + self._handshake_timeout
        try:
            channel = accept_handshake(sock, self._secret, self._handshake_timeout)
            left = max(0.01, deadline - time.monotonic())
            channel.io_timeout = left  # HELLO's frame too must end within the handshake's deadline
            kind, payload = channel.recv(wait=left)
            if kind is not Kind.HELLO:
                raise ChannelError(f"expected HELLO, got {kind.name}")
            self._arrivals.put(Arrival(channel, json.loads(payload), peer))
        except AuthenticationError as e:
            log.warning("%s (from %s)", e, peer)
            sock.close()
        except (ChannelError, OSError, ValueError) as e:  # idle, stalled or not ours: not worth a warning
            log.info("a connection from %s failed the control handshake: %s", peer, e)
            sock.close()
        finally:
            with self._lock:
                self._pending.pop(sock, None)


def _hang_up(sock: socket.socket) -> None:
    """Wake whatever thread waits on `sock` (shutdown does; close alone does not); it closes it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
