"""The leader's side of a multi-process group: admitting followers, sending them every collective
operation in order, and watching their health.

`WorkerGroup.start` runs before JAX's distributed runtime exists: it opens the control channel,
spawns local followers (or waits for remote ones), authenticates each (every connection on its
own thread with a deadline: jtp/distributed/admission.py), and compares its fingerprint with the
leader's. Then every process joins JAX's runtime and loads the model.
`GroupRunner` is the engine's `ModelRunner` with one change: each collective call (KV allocation,
every step) is sent to the followers before the leader runs it, so all processes run the same
jitted calls in the same order.

Health: followers send heartbeats; a missed heartbeat (`heartbeat_timeout`), a closed or stalled
channel, a child that exits, a step that outlives `step_timeout`, a digest of sampled tokens that
differs from the leader's or that does not come within `step_timeout` marks the group failed. Failure is final for this process (JAX's
runtime initialises once per process): local followers are killed and reaped, the callbacks run
(the engine fails its requests with a retryable error), and `jtp serve` restarts its own process
image (jtp/entrypoints/server/launch.py).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import socket
import subprocess
import threading
import time
import weakref

from jtp.core.packed_step import PackedStep
from jtp.core.step_input import StepInput
from jtp.distributed.admission import Admission, Arrival
from jtp.distributed.control import Channel, ChannelError, Kind
from jtp.distributed.launcher import (
    LaunchSpec,
    describe_exit,
    describe_mesh,
    fingerprint_mismatches,
    reap,
    spawn_followers,
    split_address,
)
from jtp.errors import ConfigError, WorkerGroupError
from jtp.worker.pipeline import PipelineRunner
from jtp.worker.runner import ModelRunner, is_ready

log = logging.getLogger(__name__)


def tokens_digest(tokens) -> str:
    import numpy as np

    return hashlib.sha256(np.ascontiguousarray(tokens, np.int32).tobytes()).hexdigest()[:32]


class _Follower:
    def __init__(self, process_id: int, channel: Channel, pid: int, proc: subprocess.Popen | None):
        self.process_id, self.channel, self.pid, self.proc = process_id, channel, pid, proc
        self.last_seen = time.monotonic()
        self.ready: dict | None = None
        self.ready_event = threading.Event()
        self.gone = threading.Event()  # its channel closed (it exited)
        self.last_digest = -1  # the latest step it sent a digest of
        self.stages: list[dict] = []  # its pipeline stages' latest counts (Kind.STAGES)

    def name(self) -> str:
        return f"follower {self.process_id} (pid {self.pid})"


class WorkerGroup:
    def __init__(self, spec: LaunchSpec, heartbeat_timeout: float, step_timeout: float, digest_interval: int):
        self.spec = spec
        self.heartbeat_timeout, self.step_timeout, self.digest_interval = heartbeat_timeout, step_timeout, digest_interval
        self.followers: list[_Follower] = []
        self.procs: list[subprocess.Popen] = []
        self.failure: str | None = None
        self.failed = threading.Event()
        self._callbacks: list = []
        self._lock = threading.Lock()
        self._inflight: tuple[int, float, object] | None = None  # (step, dispatched at, result)
        self._to_digest: list[tuple[int, object]] = []  # the leader's digest steps, not yet ready
        self._digests: dict[int, str] = {}  # the leader's digests by step (the recent ones)
        self._their_digests: list[tuple[_Follower, int, str]] = []  # followers', not yet compared
        self._awaited: collections.deque[tuple[int, float]] = collections.deque()  # (step, leader's ready at)
        self._closed = False
        self.devices_per_process = 0

    # ------------------------------------------------------------------ start-up

    @classmethod
    def start(cls, args, spec: LaunchSpec, my_fingerprint: dict, init_timeout: float = 300.0) -> "WorkerGroup":
        """Open the control channel, start (or wait for) the followers and admit them. A follower
        whose fingerprint differs is refused and start-up fails with ConfigError naming what."""
        group = cls(spec, args.heartbeat_timeout, args.step_timeout, digest_interval(args))
        group.devices_per_process = args.devices_per_process
        host, port = split_address(spec.control_address)
        listener = socket.create_server((host, port), reuse_port=False)
        try:
            if spec.bind_loopback:
                group.procs = spawn_followers(spec, args, group.devices_per_process)
            weakref.finalize(group, reap, list(group.procs), 0.0)  # a leader that never closes still reaps
            group._admit(listener, my_fingerprint, time.monotonic() + init_timeout)
        except BaseException:
            group.close(kill=True)
            raise
        finally:
            listener.close()
        return group

    def _admit(self, listener: socket.socket, mine: dict, deadline: float) -> None:
        """Admit followers 1..N-1. Connections are handshaken concurrently (jtp/distributed/admission.py),
        so idle or stalled ones never delay a real follower."""
        pending = set(range(1, self.spec.num_processes))
        admission = Admission(listener, self.spec.secret).start()
        try:
            while pending:
                self._check_children()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ConfigError(f"follower(s) {sorted(pending)} did not join within the start-up timeout")
                arrival = admission.next(min(0.5, remaining))
                if arrival is not None and self._accept(arrival, mine, pending):
                    pending.discard(arrival.hello["process_id"])
        finally:
            admission.close()
        self.followers.sort(key=lambda f: f.process_id)
        for f in self.followers:
            f.channel.io_timeout = self.heartbeat_timeout  # a send or frame that takes longer: the peer is hung
            f.last_seen = time.monotonic()  # its heartbeats start with WELCOME, however long ago it joined
            f.channel.send(Kind.WELCOME, b"{}")
            threading.Thread(target=self._read, args=(f,), name=f"jtp-follower-{f.process_id}", daemon=True).start()
        threading.Thread(target=self._monitor, name="jtp-group-monitor", daemon=True).start()

    def _accept(self, arrival: Arrival, mine: dict, pending: set[int]) -> bool:
        """Take one authenticated follower into the group; False (it was told why) if its process id
        is not expected. A fingerprint that differs fails the start-up."""
        channel, hello = arrival.channel, arrival.hello
        pid = hello.get("process_id")
        if pid not in pending:
            _refuse(channel, f"process id {pid!r} is not expected")
            return False
        diffs = fingerprint_mismatches(mine, hello.get("fingerprint", {}))
        if diffs:
            reason = "its configuration differs from the leader's: " + "; ".join(diffs)
            _refuse(channel, reason)
            raise ConfigError(f"refused process {pid} (pid {hello.get('pid')}): {reason}")
        proc = self.procs[pid - 1] if self.procs else None
        self.followers.append(_Follower(pid, channel, hello.get("pid"), proc))
        return True

    def _check_children(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc.poll() is not None:
                raise RuntimeError(f"follower {i + 1} (pid {proc.pid}) ended during start-up ({describe_exit(proc)}); "
                                   "see its output above")

    def wait_ready(self, devices: dict, timeout: float = 600.0) -> None:
        """Wait until every follower has loaded the model; their meshes must equal the leader's."""
        deadline = time.monotonic() + timeout
        for f in self.followers:
            while not f.ready_event.wait(0.2):
                self.check()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{f.name()} did not finish loading within {timeout:.0f} s")
            if f.ready != devices:
                raise ConfigError(f"{f.name()} built another mesh: {f.ready} vs the leader's {devices}")

    # ------------------------------------------------------------------ operations

    def broadcast(self, kind: Kind, payload: bytes = b"") -> None:
        self.check()
        for f in self.followers:
            try:
                f.channel.send(kind, payload)
            except ChannelError as e:
                self.fail(f"{f.name()}: {e}")
                self.check()

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerGroupError(self.failure)  # this process can run no more steps

    def dispatched(self, step: int, result) -> None:
        """The leader dispatched `step` (the monitor watches its deadline and digest)."""
        with self._lock:
            self._inflight = (step, time.monotonic(), result)
            if self.digest_interval and step % self.digest_interval == 0:
                self._to_digest.append((step, result))

    def on_failure(self, callback) -> None:
        self._callbacks.append(callback)

    # ------------------------------------------------------------------ health

    def _read(self, f: _Follower) -> None:
        try:
            self._read_until_closed(f)
        finally:
            f.gone.set()

    def _read_until_closed(self, f: _Follower) -> None:
        while True:
            try:
                kind, payload = f.channel.recv()  # silence is _monitor's to judge, from last_seen
            except ChannelError as e:
                if not self._closed:
                    if f.proc is not None and _exited(f.proc, 0.5):
                        self.fail(f"{f.name()} {describe_exit(f.proc)}")
                    else:
                        self.fail(f"{f.name()} closed its control channel: {e}")
                return
            f.last_seen = time.monotonic()
            if kind is Kind.READY:
                f.ready = json.loads(payload)
                f.ready_event.set()
            elif kind is Kind.DIGEST:
                msg = json.loads(payload)
                with self._lock:
                    self._their_digests.append((f, msg["step"], msg["digest"]))
                    f.last_digest = max(f.last_digest, msg["step"])
            elif kind is Kind.STAGES:
                f.stages = json.loads(payload)
            elif kind is Kind.FAILED:
                self.fail(f"{f.name()} failed: {json.loads(payload).get('error')}")

    def _compare_digests(self) -> None:
        """Digest the leader's finished digest steps; compare every follower digest that has a match."""
        import jax

        with self._lock:
            ready = [(s, r) for s, r in self._to_digest if is_ready(r)]
            self._to_digest = [item for item in self._to_digest if item not in ready]
        for step, result in ready:
            self._digests[step] = tokens_digest(jax.device_get(result.tokens))
            self._awaited.append((step, time.monotonic()))
        with self._lock:
            theirs, self._their_digests = self._their_digests, []
        for f, step, digest in theirs:
            mine = self._digests.get(step)
            if mine is None:
                if not self._digests or step > max(self._digests):  # the leader's is not ready yet
                    with self._lock:
                        self._their_digests.append((f, step, digest))
            elif mine != digest:
                self.fail(f"{f.name()} diverged: its sampled tokens at step {step} differ from the leader's "
                          f"(digest {digest[:12]} vs {mine[:12]})")
        for step in sorted(self._digests)[:-8]:  # keep the last few
            del self._digests[step]
        self._check_digests_arrive()

    def _check_digests_arrive(self) -> None:
        """A follower's digest is its reply to a digest step: one still missing `step_timeout` after
        the leader's own was ready means its step loop is stuck (heartbeats alone would not tell) or
        its digests fail, and divergence would go unseen."""
        with self._lock:
            while self._awaited and all(f.last_digest >= self._awaited[0][0] for f in self.followers):
                self._awaited.popleft()
            step, since = self._awaited[0] if self._awaited else (None, 0.0)
        if step is not None and time.monotonic() - since > self.step_timeout:
            late = ", ".join(f.name() for f in self.followers if f.last_digest < step)
            self.fail(f"{late} sent no digest of step {step} within the {self.step_timeout:g} s step timeout")

    def _monitor(self) -> None:
        while not self._closed and not self.failed.is_set():
            time.sleep(0.1)
            now = time.monotonic()
            for f in self.followers:
                if f.proc is not None and f.proc.poll() is not None:
                    self.fail(f"{f.name()} {describe_exit(f.proc)}")
                elif now - f.last_seen > self.heartbeat_timeout:
                    self.fail(f"{f.name()} sent no heartbeat for {now - f.last_seen:.1f} s (hung or stopped)")
            self._compare_digests()
            with self._lock:
                inflight = self._inflight
            if inflight is None:
                continue
            step, since, result = inflight
            if is_ready(result):
                with self._lock:
                    if self._inflight is inflight:
                        self._inflight = None
            elif now - since > self.step_timeout:
                self.fail(f"step {step} did not finish within the {self.step_timeout:g} s step timeout")

    def fail(self, reason: str) -> None:
        """Mark the group failed (once): kill local followers, then tell the callbacks."""
        with self._lock:
            if self.failure is not None or self._closed:
                return
            self.failure = reason
        log.error("worker group failed: %s", reason)
        self.failed.set()
        reap(self.procs, grace=0.0)
        for callback in self._callbacks:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - every callback runs
                log.exception("a worker-group failure callback raised")

    # ------------------------------------------------------------------ shutdown

    def close(self, kill: bool = False) -> None:
        """Tell the followers to exit, then reap every local child (SIGKILL after a grace period)."""
        if self._closed:
            return
        self._closed = True
        if not kill and self.failure is None:
            for f in self.followers:
                try:
                    f.channel.send(Kind.SHUTDOWN)
                except ChannelError:
                    pass
            # JAX's coordination service lives in this process: let the followers leave it first.
            deadline = time.monotonic() + 30
            for f in self.followers:
                f.gone.wait(max(0.0, deadline - time.monotonic()))
        reap(self.procs, grace=0.0 if kill or self.failure is not None else 10.0)
        for f in self.followers:
            f.channel.close()


class GroupRunner(ModelRunner):
    """A ModelRunner whose collective calls are first sent to the group's followers."""

    compiles_ahead = False  # the followers compile as they run the leader's warm-up steps, in order
    defers_cache = False
    samples_late = False  # a step crosses to the followers whole, its token masks included

    def __init__(self, group: WorkerGroup, *args, **kwargs):
        self.group = group
        self.steps = 0
        super().__init__(*args, **kwargs)

    def allocate_cache(self, num_blocks: int, deferred: bool = False) -> None:
        """The followers allocate theirs as the leader does: never deferred (`defers_cache`)."""
        self.group.wait_ready(describe_mesh(self.all_devices))
        self.group.broadcast(Kind.ALLOCATE, json.dumps({"num_blocks": num_blocks}).encode())
        super().allocate_cache(num_blocks)

    def dispatch(self, step: PackedStep | StepInput, late: bool = False):
        if late:
            raise ValueError("a worker group's steps go to the followers whole: they cannot sample late")
        # Followers get the packed buffers the leader's own jitted call takes: the same bytes
        # on every process, and no host work there but the call.
        if isinstance(step, StepInput):
            step = PackedStep.from_step_input(step)
        self.check_long_rows(step.ints, step.layout)  # before the followers take it
        self.group.broadcast(Kind.STEP, step.encode())
        result = super().dispatch(step)
        self.group.dispatched(self.steps, result)
        self.steps += 1
        return result

    # Snapshot pages: each operation goes to the followers, which keep their own shards between
    # the gather and the write (and between the read and the scatter).

    def _pages(self, op: str, **args) -> None:
        self.group.broadcast(Kind.PAGES, json.dumps({"op": op, **args}).encode())

    def gather_pages(self, block_ids, slot_ids) -> dict:
        self._pages("gather", block_ids=block_ids.tolist(), slot_ids=slot_ids.tolist())
        return super().gather_pages(block_ids, slot_ids)

    def write_pages(self, path, arrays, metadata, overwrite) -> None:
        self._pages("write", path=str(path), metadata=metadata, overwrite=overwrite)
        super().write_pages(path, arrays, metadata, overwrite)

    def read_pages(self, path, meta) -> dict:
        self._pages("read", path=str(path), meta=meta)
        return super().read_pages(path, meta)

    def scatter_pages(self, block_ids, block_rows, slot_ids, slot_rows, arrays) -> None:
        self._pages("scatter", block_ids=block_ids.tolist(), block_rows=block_rows.tolist(),
                    slot_ids=slot_ids.tolist(), slot_rows=slot_rows.tolist())
        super().scatter_pages(block_ids, block_rows, slot_ids, slot_rows, arrays)

    def close(self) -> None:
        super().close()
        self.group.close()


class GroupPipelineRunner(GroupRunner, PipelineRunner):
    """A pipeline's runner in a group: every process runs the stages on its own devices and the
    hand-offs it takes part in; the leader holds the last stage (it samples)."""

    def stage_stats(self) -> list[dict]:
        """Each stage's counts: the leader's own, and what the followers last reported of theirs."""
        reported = {stage["stage"]: stage for f in self.group.followers for stage in f.stages}
        return [reported.get(stage["stage"], stage) if stage["steps"] is None else stage
                for stage in super().stage_stats()]


def group_runner(group: WorkerGroup, config, devices) -> GroupRunner:
    return (GroupPipelineRunner if config.pipeline_parallel_size > 1 else GroupRunner)(group, config, devices)


def digest_interval(args) -> int:
    """Steps between digests of the sampled tokens; 0 (none) in a pipeline, where the leader alone
    samples (a follower that stalls stalls the leader's step: the step timeout sees it)."""
    return args.digest_interval if args.pipeline_parallel_size == 1 else 0


def start_leader(args) -> tuple[WorkerGroup, list]:
    """Form the group these engine args describe, as its leader: admit the followers, join JAX's
    runtime and check every device answers. Returns the group and the mesh's devices."""
    from jtp.distributed.launcher import fingerprint, join_group

    spec = LaunchSpec.resolve(args)
    if not spec.is_leader:
        raise ConfigError(f"process {spec.process_id} is a follower; it runs jtp.distributed.follower, not an engine")
    group = WorkerGroup.start(args, spec, fingerprint(args))
    try:
        devices = join_group(spec, group.devices_per_process, args.heartbeat_timeout)
    except BaseException:
        group.close(kill=True)
        raise
    log.info("worker group up: %d processes x %d devices", spec.num_processes, group.devices_per_process)
    return group, devices


def _refuse(channel: Channel, reason: str) -> None:
    try:
        channel.send(Kind.WELCOME, json.dumps({"refused": reason}).encode())
    except ChannelError:
        pass
    channel.close()


def _exited(proc: subprocess.Popen, wait: float) -> bool:
    try:
        proc.wait(wait)  # a killed child's channel closes a moment before its exit status exists
        return True
    except subprocess.TimeoutExpired:
        return False
