"""Data parallelism in one process: N `Engine` replicas, each with its own mesh over a disjoint
slice of the devices (replica r: devices [r*tp, (r+1)*tp)), behind the one Engine interface the
server, the CLI and the batch script use.

    engine = build_engine(EngineArgs(model=..., tensor_parallel_size=2, data_parallel_size=4))

Each replica keeps its own scheduler, KV pool, prefix cache and loop thread; nothing crosses
replicas but the requests this front routes. Routing (`_route`):

- prefix affinity: the prompt's full blocks are keyed with the scheduler's own block-key chain
  (jtp/core/block_hash.py) and each key remembers the replica it was sent to, so a conversation
  resent with its history (or another prompt sharing a system prompt) goes where its prefix is
  cached -- unless that replica's batch is full and another has less load;
- otherwise the least loaded replica: running + waiting (+ being submitted) requests, then KV use.

Health: a replica whose step fails fails whole (`Engine.fail`: its device state is no longer
trustworthy, so every request it held ends with a retryable error, an HTTP 503). It leaves the
routing at once -- new requests go to the others; with none left, `submit` raises NoReplicaError
(503) and `ready` clears -- and is rebuilt on its devices in the background (closed first, to free
its memory; warmed up and started as the others were), then routed to again. `replica_health()`:
each replica's state, restarts, steps, tokens and step time (/metrics labels them `replica`).
In manual mode (`step()` called by hand, no loop) a failed step raises to its caller, as with one Engine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
from typing import Callable, Sequence

import jax

from jtp.config.engine_args import EngineArgs
from jtp.worker.devices import with_device_defaults
from jtp.config.engine_config import EngineConfig
from jtp.core.block_hash import block_keys, root_key
from jtp.core.multimodal import ImagePrompt
from jtp.core.sampling_params import SamplingParams
from jtp.engine.engine import Completion, Engine
from jtp.engine.output_processor import generate_all
from jtp.engine.stats import EngineStats
from jtp.engine.step_timing import StepTiming
from jtp.errors import ConfigError, NoReplicaError, RequestError, WorkerGroupError

log = logging.getLogger(__name__)

AFFINITY_KEYS = 1 << 16  # block keys remembered for routing (LRU): about 1M prompt tokens at 16 per block


def build_engine(args: EngineArgs):
    """The engine `args` describe: an `Engine`, or a `DataParallelEngine` for --data-parallel-size > 1."""
    if args.data_parallel_size == 1:
        return Engine.from_args(args)
    return DataParallelEngine.from_args(args)


def replica_devices(args: EngineArgs) -> list[list]:
    """Each replica's devices; ConfigError in one line when there are too few."""
    dp, tp = args.data_parallel_size, args.tensor_parallel_size * args.pipeline_parallel_size
    if args.is_multiprocess:
        raise ConfigError(f"--data-parallel-size {dp}: not yet with --num-processes {args.num_processes} "
                          "(replicas live in one process for now)")
    devices = jax.devices()
    if dp * tp > len(devices):
        size = f"--tensor-parallel-size {args.tensor_parallel_size}" + (
            f" x --pipeline-parallel-size {args.pipeline_parallel_size}" if args.pipeline_parallel_size > 1 else "")
        raise ConfigError(f"--data-parallel-size {dp} x {size} needs {dp * tp} devices, "
                          f"but {len(devices)} ({devices[0].platform}) are visible")
    return [devices[r * tp:(r + 1) * tp] for r in range(dp)]


@dataclasses.dataclass
class ReplicaHealth:
    """One replica's health and work; the counters add up over its restarts (they never go back)."""

    serving: bool = True  # routed to; False from a failure until its rebuild serves
    restarts: int = 0  # rebuilds that came back
    steps: int = 0
    tokens: int = 0  # tokens generated
    step_seconds: float = 0.0  # the steps' time, all together
    failure: str | None = None  # why it last failed

    @property
    def state(self) -> str:
        return "healthy" if self.serving else "restarting"

    @property
    def mean_step_seconds(self) -> float:
        return self.step_seconds / self.steps if self.steps else 0.0

    def record(self, timing: StepTiming) -> None:
        """The replica's `step_timings` hook (on its loop thread)."""
        self.steps += 1
        self.tokens += timing.tokens
        self.step_seconds += timing.total


class DataParallelEngine:
    group = None  # replicas are single-process (see replica_devices)
    failure = None  # a failed replica is rebuilt: the engine as a whole never fails (jtp serve's restart)

    def __init__(self, replicas: Sequence[Engine]):
        self.replicas = list(replicas)
        # What a rebuild needs: each replica's devices (a pipeline's: every stage's), in the runner's order.
        self.devices = [replica.runner.all_devices for replica in self.replicas]
        self.health = [ReplicaHealth() for _ in self.replicas]
        first = self.replicas[0]
        # What every replica shares (one config, one checkpoint): read off the first.
        self.config, self.cfg, self.tokenizer = first.config, first.cfg, first.tokenizer
        self.max_model_len, self.vision, self.grammars = first.max_model_len, first.vision, first.grammars
        self.sampling_defaults, self.default_params = first.sampling_defaults, first.default_params
        self.ready = threading.Event()  # every replica warmed up (or the server says so without warm-up)
        self.failed = threading.Event()
        self.warmup_report = None
        self._lock = threading.Lock()  # routing state (owners, pending, affinity), the replicas and their health
        self._owner: dict[str, Engine] = {}  # request id -> replica (stale once the replica released it)
        self._pending: dict[str, Engine] = {}  # ids being submitted right now
        self._sweep_at = 1024
        self._ids = itertools.count()
        self._affinity: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._root = root_key(first.cache_identity)
        self._block_size = first.config.block_size
        self._prefix_caching = first.config.enable_prefix_caching
        # How a rebuilt replica joins the others (set by warmup / start / stop, under the lock).
        self._warmed = self._started = self._ready_lost = False
        self._retired = threading.Event()  # draining or closed: a failed replica is not rebuilt
        self._rebuilds: dict[int, threading.Thread] = {}
        for r, replica in enumerate(self.replicas):
            self._watch(r, replica)

    @classmethod
    def from_args(cls, args: EngineArgs) -> "DataParallelEngine":
        args = with_device_defaults(args)
        config = EngineConfig.from_args(args)
        replicas: list[Engine] = []
        try:
            for devices in replica_devices(args):
                replicas.append(Engine(config, devices=devices))
        except BaseException:
            for engine in replicas:  # free what was loaded before the failure
                engine.close()
            raise
        return cls(replicas)

    @property
    def runner(self):
        """The first replica's runner (what the CLI reports; every replica's is alike)."""
        return self.replicas[0].runner

    # ------------------------------------------------------------------ routing

    def _load(self, r: int, stats: EngineStats) -> tuple:
        replica = self.replicas[r]
        pending = sum(owner is replica for owner in self._pending.values())
        used = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        return stats.num_running + stats.num_waiting + pending, used

    def _route(self, prompt_ids: list[int]) -> int:
        """The serving replica for a new prompt (routing lock held); remembers its blocks' keys there."""
        loads = {r: self._load(r, self.replicas[r].stats()) for r, h in enumerate(self.health) if h.serving}
        if not loads:
            raise NoReplicaError(f"all {len(self.replicas)} replicas failed and are being rebuilt; retry shortly")
        least = min(loads, key=lambda r: (loads[r], r))
        keys = block_keys(self._root, prompt_ids, self._block_size) if self._prefix_caching else []
        chosen = least
        # The longest remembered prefix wins, unless its replica's batch is full and another has room.
        home = next((self._affinity[k] for k in reversed(keys) if k in self._affinity), None)
        if home in loads and not (loads[home][0] >= self.config.max_num_seqs and loads[home][0] > loads[least][0]):
            chosen = home
        for key in keys:
            self._affinity[key] = chosen
            self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_KEYS:
            self._affinity.popitem(last=False)
        return chosen

    def _replica_of(self, request_id: str) -> Engine:
        """The replica that holds `request_id` (the first for an unknown id: its error is the Engine's)."""
        with self._lock:
            return self._owner.get(request_id) or self._pending.get(request_id) or self.replicas[0]

    # ------------------------------------------------------------------ requests

    def submit(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None,
               images: Sequence[ImagePrompt] = ()) -> str:
        """Route the request to a serving replica and submit it there; the id is unique across replicas.
        A replica that fails between the routing and its submit passes the request on to another."""
        prompt_ids = [int(t) for t in prompt_ids]
        for attempt in itertools.count(1):
            try:
                return self._submit_once(prompt_ids, params, request_id, images)
            except WorkerGroupError:  # the replica failed (it is out of routing now): route again
                if attempt >= len(self.replicas):
                    raise

    def _submit_once(self, prompt_ids: list[int], params, request_id, images) -> str:
        with self._lock:
            rid = request_id
            while rid is None or (request_id is None and self._in_use(rid)):
                rid = f"req-{next(self._ids)}"
            if self._in_use(rid):
                raise RequestError(f"request id {rid!r} is already in use")
            replica = self.replicas[self._route(prompt_ids)]
            self._pending[rid] = replica
        ok = False
        try:
            replica.submit(prompt_ids, params, rid, images)
            ok = True
        finally:
            with self._lock:
                del self._pending[rid]
                if ok:
                    self._owner[rid] = replica
                    if len(self._owner) >= self._sweep_at:  # forget the released ones, now and then
                        self._owner = {i: e for i, e in self._owner.items() if i in e.outputs}
                        self._sweep_at = max(1024, 2 * len(self._owner))
        return rid

    def _in_use(self, rid: str) -> bool:
        owner = self._owner.get(rid)
        return rid in self._pending or (owner is not None and rid in owner.outputs)

    def abort(self, request_id: str) -> bool:
        return self._replica_of(request_id).abort(request_id)

    def stream(self, request_id: str, timeout: float | None = None):
        return self._replica_of(request_id).stream(request_id, timeout)

    def astream(self, request_id: str):
        return self._replica_of(request_id).astream(request_id)

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        return self._replica_of(request_id).result(request_id, timeout)

    def release(self, request_id: str) -> None:
        self._replica_of(request_id).release(request_id)

    def request(self, request_id: str):
        return self._replica_of(request_id).request(request_id)

    def replica_index(self, request_id: str) -> int:
        """Which replica holds a live request (tests, logs)."""
        return self.replicas.index(self._replica_of(request_id))

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Offline batch, spread over the replicas; results in input order."""
        return generate_all(self, prompts, params)

    # ------------------------------------------------------------------ stepping and lifetime

    def _serving(self) -> list[Engine]:
        with self._lock:
            return [replica for replica, health in zip(self.replicas, self.health) if health.serving]

    def step(self) -> list:
        """Manual mode: one step of every serving replica (each dispatches before it waits on its
        previous step, so the replicas' devices overlap)."""
        return [event for replica in self._serving() for event in replica.step()]

    def has_unfinished(self) -> bool:
        return any(replica.has_unfinished() for replica in self._serving())

    def _each(self, fn: Callable[[Engine], object], replicas: Sequence[Engine] | None = None) -> list:
        """fn on every replica at once (warm-up, drain: each waits on its own devices)."""
        replicas = self.replicas if replicas is None else replicas
        with concurrent.futures.ThreadPoolExecutor(len(replicas), "jtp-dp") as pool:
            return list(pool.map(fn, replicas))

    def warmup(self, progress: bool = False, interrupted: Callable[[], bool] = lambda: False) -> int:
        compiled = self._each(lambda e: e.warmup(progress and e is self.replicas[0], interrupted))
        self.warmup_report = self.replicas[0].warmup_report
        with self._lock:
            if all(replica.ready.is_set() for replica in self.replicas):
                self._warmed = True  # a rebuilt replica is warmed up too
                self.ready.set()
        return sum(compiled)

    def start(self) -> None:
        with self._lock:
            self._started = True  # a rebuilt replica starts its loop too
        for replica in self._serving():
            replica.start()

    def stop(self) -> None:
        with self._lock:
            self._started = False
            replicas = list(self.replicas)
        for replica in replicas:
            replica.stop()

    def drain(self, timeout: float) -> bool:
        self._retired.set()  # shutting down: no rebuilds
        serving = self._serving()
        return all(self._each(lambda e: e.drain(timeout), serving)) if serving else True

    def close(self) -> None:
        self._retired.set()
        self.ready.clear()
        with self._lock:
            rebuilds = list(self._rebuilds.values())
        for thread in rebuilds:  # a rebuild gives up at its next look at _retired (a load runs to its end)
            thread.join()
        for replica in self.replicas:
            replica.close()

    def __enter__(self) -> "DataParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset_prefix_cache(self) -> int:
        with self._lock:
            self._affinity.clear()
        return sum(replica.reset_prefix_cache() for replica in self._serving())

    # ------------------------------------------------------------------ health

    def _watch(self, r: int, replica: Engine) -> None:
        """Hook replica `r` up: its failure is reported here, its steps counted in its health."""
        replica.on_failure = self._on_replica_failure
        replica.step_timings = self.health[r].record

    def _on_replica_failure(self, replica: Engine) -> None:
        """A replica failed (its requests have ended, retryable): out of the routing at once, and
        rebuilt in the background. Called on its loop thread."""
        with self._lock:
            r = next((i for i, e in enumerate(self.replicas) if e is replica), None)
            if r is None or not self.health[r].serving:
                return  # an old replica, or a failure already reported
            health = self.health[r]
            health.serving, health.failure = False, replica.failure
            for key in [k for k, home in self._affinity.items() if home == r]:  # its prefix cache is lost
                del self._affinity[key]
            if not any(h.serving for h in self.health) and self.ready.is_set():
                self.ready.clear()  # nothing serves: /ready says so until a replica is back
                self._ready_lost = True
            if self._retired.is_set():
                return
            thread = self._rebuilds[r] = threading.Thread(target=self._rebuild, args=(r, replica),
                                                          name=f"jtp-dp-rebuild-{r}", daemon=True)
        log.error("replica %d failed (%s); rebuilding it on its devices", r, replica.failure)
        thread.start()

    def build_replica(self, r: int) -> Engine:
        """A new engine on replica `r`'s devices (a rebuild's; tests hold it up)."""
        return Engine(self.config, devices=self.devices[r])

    def _rebuild(self, r: int, failed: Engine) -> None:
        """Free the failed replica's device memory, then build its successor there, warm it up and start
        it as the others were, and route to it; an attempt that fails is retried after a pause."""
        try:
            failed.close()
        except Exception:  # noqa: BLE001 - what it held is dropped with it anyway
            log.exception("closing failed replica %d", r)
        pause = 1.0
        while not self._retired.is_set():
            replica = None
            try:
                replica = self.build_replica(r)
                self._watch(r, replica)
                if self._warmed:
                    replica.warmup(interrupted=self._retired.is_set)
                with self._lock:
                    if self._retired.is_set():  # closed meanwhile: this one is not needed
                        replica.close()
                        return
                    self.replicas[r] = replica
                    if self._started:
                        replica.start()
                    self.health[r].serving = True
                    self.health[r].restarts += 1
                    if self._ready_lost:
                        self.ready.set()
                        self._ready_lost = False
                    del self._rebuilds[r]
                log.warning("replica %d is back (restart %d)", r, self.health[r].restarts)
                return
            except Exception:  # noqa: BLE001 - a rebuild must not die: the slot would stay out for good
                log.exception("rebuilding replica %d failed; retrying in %.0f s", r, pause)
                if replica is not None:
                    replica.close()
                self._retired.wait(pause)
                pause = min(2 * pause, 60.0)

    def replica_health(self) -> list[ReplicaHealth]:
        """Each replica's health and work, in replica order (a copy)."""
        with self._lock:
            return [dataclasses.replace(health) for health in self.health]

    # ------------------------------------------------------------------ stats

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's stats, in replica order (/metrics labels them `replica`)."""
        return [replica.stats() for replica in self.replicas]

    def stats(self) -> EngineStats:
        """Every replica's counts added up."""
        per = self.replica_stats()
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in per) for f in dataclasses.fields(EngineStats)})
