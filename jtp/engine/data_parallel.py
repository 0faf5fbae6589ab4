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
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
from typing import Callable, Sequence

import jax

from jtp.config.engine_args import EngineArgs
from jtp.config.engine_config import EngineConfig
from jtp.core.block_hash import block_keys, root_key
from jtp.core.multimodal import ImagePrompt
from jtp.core.sampling_params import SamplingParams
from jtp.engine.engine import Completion, Engine
from jtp.engine.stats import EngineStats
from jtp.errors import ConfigError, RequestError

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


class DataParallelEngine:
    group = None  # replicas are single-process (see replica_devices)
    failure = None  # only a worker group fails an engine as a whole

    def __init__(self, replicas: Sequence[Engine]):
        self.replicas = list(replicas)
        first = self.replicas[0]
        # What every replica shares (one config, one checkpoint): read off the first.
        self.config, self.cfg, self.tokenizer = first.config, first.cfg, first.tokenizer
        self.max_model_len, self.vision, self.grammars = first.max_model_len, first.vision, first.grammars
        self.sampling_defaults, self.default_params = first.sampling_defaults, first.default_params
        self.ready = threading.Event()  # every replica warmed up (or the server says so without warm-up)
        self.failed = threading.Event()
        self.warmup_report = None
        self._lock = threading.Lock()  # routing state: owners, pending, affinity
        self._owner: dict[str, Engine] = {}  # request id -> replica (stale once the replica released it)
        self._pending: dict[str, Engine] = {}  # ids being submitted right now
        self._sweep_at = 1024
        self._ids = itertools.count()
        self._affinity: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._root = root_key(first.cache_identity)
        self._block_size = first.config.block_size
        self._prefix_caching = first.config.enable_prefix_caching

    @classmethod
    def from_args(cls, args: EngineArgs) -> "DataParallelEngine":
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
        """The replica for a new prompt (routing lock held); remembers its blocks' keys there."""
        loads = [self._load(r, e.stats()) for r, e in enumerate(self.replicas)]
        least = min(range(len(loads)), key=lambda r: (loads[r], r))
        keys = block_keys(self._root, prompt_ids, self._block_size) if self._prefix_caching else []
        chosen = least
        # The longest remembered prefix wins, unless its replica's batch is full and another has room.
        home = next((self._affinity[k] for k in reversed(keys) if k in self._affinity), None)
        if home is not None and not (loads[home][0] >= self.config.max_num_seqs and loads[home][0] > loads[least][0]):
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
        """Route the request to a replica and submit it there; the id is unique across replicas."""
        prompt_ids = [int(t) for t in prompt_ids]
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
        return Engine.generate(self, prompts, params)  # only submit / abort / release / result: ours

    # ------------------------------------------------------------------ stepping and lifetime

    def step(self) -> list:
        """Manual mode: one step of every replica (each dispatches before it waits on its previous
        step, so the replicas' devices overlap)."""
        return [event for replica in self.replicas for event in replica.step()]

    def has_unfinished(self) -> bool:
        return any(replica.has_unfinished() for replica in self.replicas)

    def _each(self, fn: Callable[[Engine], object]) -> list:
        """fn on every replica at once (warm-up, drain: each waits on its own devices)."""
        with concurrent.futures.ThreadPoolExecutor(len(self.replicas), "jtp-dp") as pool:
            return list(pool.map(fn, self.replicas))

    def warmup(self, progress: bool = False, interrupted: Callable[[], bool] = lambda: False) -> int:
        compiled = self._each(lambda e: e.warmup(progress and e is self.replicas[0], interrupted))
        self.warmup_report = self.replicas[0].warmup_report
        if all(replica.ready.is_set() for replica in self.replicas):
            self.ready.set()
        return sum(compiled)

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()

    def drain(self, timeout: float) -> bool:
        return all(self._each(lambda e: e.drain(timeout)))

    def close(self) -> None:
        self.ready.clear()
        for replica in self.replicas:
            replica.close()

    def __enter__(self) -> "DataParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset_prefix_cache(self) -> int:
        with self._lock:
            self._affinity.clear()
        return sum(replica.reset_prefix_cache() for replica in self.replicas)

    # ------------------------------------------------------------------ stats

    def replica_stats(self) -> list[EngineStats]:
        """Each replica's stats, in replica order (/metrics labels them `replica`)."""
        return [replica.stats() for replica in self.replicas]

    def stats(self) -> EngineStats:
        """Every replica's counts added up."""
        per = self.replica_stats()
        return EngineStats(**{f.name: sum(getattr(s, f.name) for s in per) for f in dataclasses.fields(EngineStats)})
