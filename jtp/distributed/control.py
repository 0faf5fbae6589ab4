"""The leader <-> follower control channel: framed binary messages over TCP, authenticated.

Not a collective layer (the step's all-reduces are XLA's, over JAX's own runtime); this only
carries what the leader decides: each step's `PackedStep` bytes and the other operations every
process must run in the same order, plus followers' heartbeats and token digests.

Wire format, per message (after the handshake):

    u32 length | 32-byte tag | u8 kind | payload        (length counts tag + kind + payload)
    tag = HMAC-SHA256(session key, direction | u64 sequence number | kind | payload)

The sequence number is implicit (each side counts), so a frame cannot be replayed, reordered or
moved to the other direction. No pickle: payloads are bytes the caller encodes (JSON or
`PackedStep.encode()`).

Handshake (mutual, before anything else is read): the server sends a nonce; the client answers
HMAC(secret, "client" | server nonce) and its own nonce; the server checks it and answers
HMAC(secret, "server" | client nonce). A client with a wrong secret is told so in plain text and
disconnected; neither side ever sends the secret itself.

Every read has a deadline except the wait for a frame to begin, which the caller chooses (a
follower waits as long as the leader is idle; the leader waits one heartbeat period): once a frame
has begun, the rest must arrive within the channel's `io_timeout`, and a send that the peer does
not drain within it fails, so a stalled peer costs a bounded wait, never a stuck thread.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import select
import socket
import struct
import threading
import time

MAGIC = b"JTPC1"
_NONCE = 32
_TAG = 32
_MAX_FRAME = 1 << 30


class Kind(enum.IntEnum):
    HELLO = 1  # follower -> leader: its fingerprint (JSON)
    WELCOME = 2  # leader -> follower: admitted, or refused with the reason (JSON)
    READY = 3  # follower -> leader: devices up, model loaded (JSON: its mesh description)
    ALLOCATE = 4  # leader -> follower: allocate the KV cache with this many blocks (JSON)
    STEP = 5  # leader -> follower: one step's packed buffers (PackedStep.encode())
    DIGEST = 6  # follower -> leader: a digest of one step's sampled tokens (JSON)
    HEARTBEAT = 7  # follower -> leader: alive (empty)
    FAILED = 8  # follower -> leader: a local operation raised (JSON)
    SHUTDOWN = 9  # leader -> follower: exit cleanly (empty)
    PAGES = 10  # leader -> follower: one snapshot-pages operation (JSON: op and its arguments)
    STAGES = 11  # follower -> leader: its pipeline stages' counts (JSON: PipelineRunner.stage_stats() entries)


class ChannelError(ConnectionError):
    """The channel is closed, or a frame failed authentication."""


class AuthenticationError(ChannelError):
    """The peer does not hold this launch's secret."""


class ChannelTimeout(ChannelError):
    """The peer sent nothing (or not a whole frame) within the deadline."""


class Channel:
    """One authenticated, framed connection. `send` is thread-safe; one thread reads.

    `io_timeout` bounds a send and the rest of a frame once it has begun (None: no bound)."""

    def __init__(self, sock: socket.socket, key: bytes, is_server: bool, io_timeout: float | None = None):
        self.sock = sock
        self.io_timeout = io_timeout
        self._key = key
        self._out_dir, self._in_dir = (b"S", b"C") if is_server else (b"C", b"S")
        self._sent = 0
        self._received = 0
        self._send_lock = threading.Lock()
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go out at once

    @property
    def io_timeout(self) -> float | None:
        return self._io_timeout

    @io_timeout.setter
    def io_timeout(self, seconds: float | None) -> None:
        self._io_timeout = seconds
        self.sock.settimeout(seconds)  # sendall's bound; reads poll with their own deadlines

    def _tag(self, direction: bytes, seq: int, kind: int, payload: bytes) -> bytes:
        mac = hmac.new(self._key, direction + struct.pack(">QB", seq, kind), hashlib.sha256)
        mac.update(payload)
        return mac.digest()

    def send(self, kind: Kind, payload: bytes = b"") -> None:
        payload = bytes(payload)
        with self._send_lock:
            tag = self._tag(self._out_dir, self._sent, kind, payload)
            header = struct.pack(">I", _TAG + 1 + len(payload)) + tag + bytes([kind])
            _send(self.sock, header + payload if len(payload) < 65536 else header)
            if len(payload) >= 65536:
                _send(self.sock, payload)
            self._sent += 1

    def recv(self, wait: float | None = None) -> tuple[Kind, bytes]:
        """The next message. Waits up to `wait` seconds for it to begin (None: as long as it takes),
        then `io_timeout` for the whole frame. Raises ChannelTimeout past either, ChannelError on
        EOF or a frame that fails its tag."""
        if not _wait_readable(self.sock, wait):
            raise ChannelTimeout(f"the peer sent nothing for {wait:g} s")
        deadline = None if self.io_timeout is None else time.monotonic() + self.io_timeout
        (length,) = struct.unpack(">I", _read_exact(self.sock, 4, deadline))
        if not _TAG + 1 <= length <= _MAX_FRAME:
            raise ChannelError(f"malformed control frame (length {length})")
        body = _read_exact(self.sock, length, deadline)
        tag, kind, payload = body[:_TAG], body[_TAG], body[_TAG + 1 :]
        if not hmac.compare_digest(tag, self._tag(self._in_dir, self._received, kind, payload)):
            raise AuthenticationError("a control frame failed authentication (wrong key, replayed or corrupted)")
        self._received += 1
        try:
            return Kind(kind), payload
        except ValueError:
            raise ChannelError(f"unknown control message kind {kind}") from None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _wait_readable(sock: socket.socket, timeout: float | None) -> bool:
    """Whether `sock` has data (or EOF) within `timeout` seconds (None: wait for it). poll, not
    select: a leader holds more than select's 1024 descriptors."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000))))


def _read_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """n bytes, all of them before `deadline` (monotonic; None: no bound), however slowly they come."""
    buf = bytearray()
    while len(buf) < n:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and (remaining <= 0 or not _wait_readable(sock, remaining)):
            raise ChannelTimeout(f"the peer sent {len(buf)} of {n} bytes and stalled")
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except OSError as e:
            raise ChannelError(f"control channel closed: {e}") from None
        if not chunk:
            raise ChannelError("control channel closed by the peer")
        buf += chunk
    return bytes(buf)


def _proof(secret: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, role + nonce, hashlib.sha256).digest()


def _session_key(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()


def accept_handshake(sock: socket.socket, secret: bytes, timeout: float = 10.0) -> Channel:
    """Server side of the handshake on an accepted socket, all of it within `timeout` seconds
    (however slowly the client trickles bytes); AuthenticationError if the client's proof is
    wrong (the client has been told before the socket closes). The channel keeps `timeout` as
    its io_timeout."""
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    server_nonce = os.urandom(_NONCE)
    _send(sock, MAGIC + server_nonce)
    reply = _read_exact(sock, len(MAGIC) + _TAG + _NONCE, deadline)
    if reply[: len(MAGIC)] != MAGIC:
        raise ChannelError("the peer does not speak the jtp control protocol")
    proof, client_nonce = reply[len(MAGIC) : len(MAGIC) + _TAG], reply[len(MAGIC) + _TAG :]
    if not hmac.compare_digest(proof, _proof(secret, b"client", server_nonce)):
        message = b"refused: wrong launch secret"
        _send(sock, b"\x00" + struct.pack(">H", len(message)) + message)
        raise AuthenticationError("a process connected with a wrong launch secret and was refused")
    _send(sock, b"\x01" + _proof(secret, b"server", client_nonce))
    return Channel(sock, _session_key(secret, server_nonce, client_nonce), is_server=True, io_timeout=timeout)


def connect_handshake(sock: socket.socket, secret: bytes, timeout: float = 10.0) -> Channel:
    """Client side of the handshake on a connected socket, all of it within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    sock.settimeout(timeout)
    hello = _read_exact(sock, len(MAGIC) + _NONCE, deadline)
    if hello[: len(MAGIC)] != MAGIC:
        raise ChannelError("the leader's address answered, but not with the jtp control protocol")
    server_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(_NONCE)
    _send(sock, MAGIC + _proof(secret, b"client", server_nonce) + client_nonce)
    status = _read_exact(sock, 1, deadline)
    if status == b"\x00":
        (n,) = struct.unpack(">H", _read_exact(sock, 2, deadline))
        reason = _read_exact(sock, n, deadline).decode()
        raise AuthenticationError(f"the leader {reason} (check JTP_LAUNCH_SECRET / --secret-file)")
    if not hmac.compare_digest(_read_exact(sock, _TAG, deadline), _proof(secret, b"server", client_nonce)):
        raise AuthenticationError("the leader could not prove it holds the launch secret")
    return Channel(sock, _session_key(secret, server_nonce, client_nonce), is_server=False, io_timeout=timeout)


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as e:
        raise ChannelError(f"control channel closed while sending: {e}") from None
