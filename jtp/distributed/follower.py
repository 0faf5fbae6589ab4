"""A follower process: joins the leader's group, then runs exactly the operations the leader
sends, in order, on its own devices. It schedules nothing and samples nothing of its own: each
step arrives as a `PackedStep` (the leader's own packed buffers) and goes through the same
`ModelRunner.dispatch` as the leader's.

    python -m jtp.entrypoints.follower     spawned by a local leader (reads $JTP_LAUNCH)
    jtp serve ... --process-id 1 ...       one host of a launch across machines

A reader thread takes the leader's messages; when the channel closes (the leader exited or was
killed) the follower exits at once, even with its main thread stuck in a collective. A heartbeat
thread tells the leader it is alive; every `digest_interval` steps it reports a digest of the
sampled tokens so the leader can detect divergence.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import sys
import threading
import time

from jtp.config.engine_args import EngineArgs
from jtp.config.engine_config import EngineConfig
from jtp.distributed.control import (
    AuthenticationError,
    Channel,
    ChannelError,
    Kind,
    connect_handshake,
)
from jtp.distributed.launcher import (
    LaunchSpec,
    describe_mesh,
    fingerprint,
    join_group,
    split_address,
)
from jtp.errors import ConfigError

log = logging.getLogger("jtp.distributed.follower")

EXIT_LEADER_GONE = 75  # EX_TEMPFAIL: the group ended under us; a supervisor may start us again
HANDSHAKE_TIMEOUT = 10.0  # one attempt's connect and handshake; the leader answers in milliseconds


def join_leader(spec: LaunchSpec, hello: dict, timeout: float) -> Channel:
    """Connect, authenticate, say HELLO and wait for the leader's WELCOME, all within `timeout`
    seconds; a connection that fails before the WELCOME (the leader not listening yet, or busy
    dropping stalled peers) is retried. A wrong secret or a refusal is final."""
    deadline = time.monotonic() + timeout
    while True:
        channel = None
        try:
            channel = _say_hello(spec, hello, deadline)
            kind, payload = channel.recv(wait=max(0.0, deadline - time.monotonic()))
            break
        except AuthenticationError:
            raise
        except (ChannelError, OSError) as e:
            if channel is not None:
                channel.close()
            if time.monotonic() > deadline:
                raise ConnectionError(f"could not join the leader at {spec.control_address} within "
                                      f"{timeout:.0f} s: {e}") from None
            time.sleep(0.2)
    welcome = json.loads(payload) if kind is Kind.WELCOME else {"refused": f"unexpected {kind.name}"}
    if "refused" in welcome:
        raise ConfigError(f"the leader refused process {spec.process_id}: {welcome['refused']}")
    return channel


def _say_hello(spec: LaunchSpec, hello: dict, deadline: float) -> Channel:
    host, port = split_address(spec.control_address)
    wait = min(HANDSHAKE_TIMEOUT, max(0.1, deadline - time.monotonic()))
    sock = socket.create_connection((host, port), timeout=wait)
    try:
        channel = connect_handshake(sock, spec.secret, wait)
        channel.send(Kind.HELLO, json.dumps(hello).encode())
    except BaseException:
        sock.close()
        raise
    return channel


def run_follower(args: EngineArgs, spec: LaunchSpec, init_timeout: float = 300.0) -> int:
    # The fingerprint first (it reads the checkpoint's headers): HELLO then follows the handshake at once.
    hello = {"process_id": spec.process_id, "pid": os.getpid(), "fingerprint": fingerprint(args)}
    channel = join_leader(spec, hello, init_timeout)
    channel.io_timeout = args.heartbeat_timeout  # a frame begun must arrive within it; so must a send

    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read, args=(channel, inbox), name="jtp-control-reader", daemon=True).start()
    threading.Thread(target=_heartbeat, args=(channel, args.heartbeat_timeout / 4), name="jtp-heartbeat",
                     daemon=True).start()

    devices = join_group(spec, args.devices_per_process, args.heartbeat_timeout)

    from jtp.core.packed_step import PackedStep
    from jtp.distributed.group import digest_interval, tokens_digest
    from jtp.worker.pipeline import runner_class

    # Resolved as the leader resolves the same args: the same model, dtype, slots and MTP head.
    config = EngineConfig.from_args(args)
    runner = runner_class(config)(config, devices)
    every = digest_interval(args)
    channel.send(Kind.READY, json.dumps(describe_mesh(devices)).encode())
    if hasattr(runner, "stage_stats"):  # a pipeline: its stages' counts for the leader's /stats
        threading.Thread(target=_report_stages, args=(channel, runner, args.heartbeat_timeout / 4),
                         name="jtp-stages", daemon=True).start()
    log.info("follower %d ready: %d devices", spec.process_id, len(devices))
    step = 0
    pages: dict = {}  # this process's shards of snapshot pages between two PAGES operations
    try:
        while True:
            kind, payload = inbox.get()
            if kind is Kind.STEP:
                result = runner.dispatch(PackedStep.decode(payload))
                if every and step % every == 0:
                    threading.Thread(target=_send_digest, args=(channel, step, result, tokens_digest),
                                     daemon=True).start()
                step += 1
            elif kind is Kind.ALLOCATE:
                runner.allocate_cache(json.loads(payload)["num_blocks"])
            elif kind is Kind.PAGES:
                pages = _pages(runner, json.loads(payload), pages)
            elif kind is Kind.SHUTDOWN:
                log.info("follower %d: shutdown", spec.process_id)
                runner.close()
                import jax

                jax.distributed.shutdown()  # leave JAX's runtime while the leader still hosts it
                return 0
            else:
                raise RuntimeError(f"unexpected control message {kind.name}")
    except Exception as e:
        try:
            channel.send(Kind.FAILED, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        except ChannelError:
            pass
        raise


def _pages(runner, msg: dict, pages: dict) -> dict:
    """Run one snapshot-pages operation as the leader runs it; returns the pages kept for the next."""
    import numpy as np

    ids = {k: np.asarray(msg[k], np.int32) for k in ("block_ids", "slot_ids", "block_rows", "slot_rows") if k in msg}
    op = msg["op"]
    if op == "gather":
        return runner.gather_pages(ids["block_ids"], ids["slot_ids"])
    if op == "write":
        runner.write_pages(msg["path"], pages, msg["metadata"], msg["overwrite"])
        return {}
    if op == "read":
        return runner.read_pages(msg["path"], msg["meta"])
    if op == "scatter":
        runner.scatter_pages(ids["block_ids"], ids["block_rows"], ids["slot_ids"], ids["slot_rows"], pages)
        return {}
    raise RuntimeError(f"unknown snapshot-pages operation {op!r}")


def _read(channel: Channel, inbox: queue.Queue) -> None:
    """Hand messages to the main thread; exit the process the moment the leader is gone."""
    while True:
        try:
            kind, payload = channel.recv()
            inbox.put((kind, payload))
            if kind is Kind.SHUTDOWN:  # the leader closes the channel next: that is not a loss
                return
        except ChannelError as e:
            print(f"jtp follower: the leader is gone ({e}); exiting", file=sys.stderr, flush=True)
            os._exit(EXIT_LEADER_GONE)


def _heartbeat(channel: Channel, interval: float) -> None:
    while True:
        time.sleep(interval)
        try:
            channel.send(Kind.HEARTBEAT)
        except ChannelError:
            return


def _report_stages(channel: Channel, runner, interval: float) -> None:
    """Send this process's pipeline stages' counts (steps, busy time, bubbles) every `interval` s."""
    while True:
        time.sleep(interval)
        mine = [stage for stage in runner.stage_stats() if stage["steps"] is not None]
        try:
            channel.send(Kind.STAGES, json.dumps(mine).encode())
        except ChannelError:
            return


def _send_digest(channel: Channel, step: int, result, digest) -> None:
    import jax

    try:
        tokens = jax.device_get(result.tokens)
        channel.send(Kind.DIGEST, json.dumps({"step": step, "digest": digest(tokens)}).encode())
    except Exception:  # noqa: BLE001 - a failed step is reported by the main loop
        pass
