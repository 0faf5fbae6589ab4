"""Engine: the public face of continuous batching.

    engine = Engine("checkpoints/demo-qwen3")
    rid = engine.submit(prompt_ids, SamplingParams(max_tokens=32))
    for event in engine.stream(rid): ...          # tokens as they are sampled
    engine.abort(rid)                             # frees the request's blocks at once
    results = engine.generate(list_of_prompt_ids, params)   # offline batches

    async for event in engine.astream(rid): ...   # the same from asyncio, never blocking the loop

The engine can be driven two ways: call `step()` yourself (tests, offline batches), or
`start()` a background loop thread (servers); `stream()` and `generate()` work with both.
Every request ends with exactly one finished event: finish_reason "stop", "length",
"abort" or "error". A request is released (forgotten) once its finished event is consumed
by `stream` / `astream` / `result`; a consumer that stops early aborts it.

Threads: `submit` and `abort` only append to an inbox (a short lock, never held across device
work or compilation); whoever steps (the loop thread, or the caller in manual mode) drains
the inbox at the start of each step. So no caller waits on the device.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import random
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import jax

from jtp.config.engine_args import resolve_state_slots
from jtp.config.speculative import SpeculativeConfig
from jtp.core.block_hash import block_keys, root_key
from jtp.core.page_pool import PagePool
from jtp.core.sampling_params import SamplingParams, pack_sampling, request_seed
from jtp.core.scheduler import Request, ScheduledRow, Scheduler, Status
from jtp.core.snapshots import Snapshot, SnapshotRegistry
from jtp.core.state_pool import StatePool
from jtp.core.step_input import StepInput
from jtp.engine.step_timing import StepTiming
from jtp.engine.tokenizer import Tokenizer
from jtp.errors import (
    ContextLengthError,
    EngineClosedError,
    QueueFullError,
    RequestError,
    WorkerGroupError,
)
from jtp.worker.input_batch import InputBatch
from jtp.worker.runner import ModelRunner, is_ready

if TYPE_CHECKING:
    from jtp.config.engine_args import EngineArgs

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 256 << 20  # without device memory stats (CPU), size the pool to this

__all__ = ["Engine", "EngineStats", "TokenEvent", "Completion", "RequestError"]


@dataclasses.dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]  # new tokens
    text: str  # new text (complete UTF-8 characters; stop strings held back until resolved)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None  # set when finish_reason == "error"
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (finished event)
    retryable: bool = False  # an "error" the same request may succeed on later (worker group restart)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests (with prefix caching on)
    prefix_cache_hits: int = 0  # of those, tokens whose KV (and state) came from the cache
    prefix_cache_blocks: int = 0  # KV blocks registered in the prefix cache
    prompt_tokens_computed: int = 0  # prompt tokens prefilled (the work the cache saves)
    num_snapshots: int = 0
    spec_decode_num_drafts: int = 0  # speculating rows verified
    spec_decode_num_draft_tokens: int = 0  # tokens drafted for them
    spec_decode_num_accepted_tokens: int = 0  # of those, tokens the target model sampled too
    spec_decode_num_state_rollbacks: int = 0  # hybrid rows whose recurrent state went back before a rejected draft

    @property
    def spec_decode_acceptance_rate(self) -> float:
        return self.spec_decode_num_accepted_tokens / self.spec_decode_num_draft_tokens if self.spec_decode_num_draft_tokens else 0.0

    @property
    def spec_decode_mean_accepted_length(self) -> float:
        """Tokens a verified row emits on average: its accepted drafts plus the target's own token."""
        return 1 + self.spec_decode_num_accepted_tokens / self.spec_decode_num_drafts if self.spec_decode_num_drafts else 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclasses.dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    error: str | None = None


class _Output:
    """Per-request host-side output state: detokenization, stop strings, the event queue."""

    def __init__(self, request: Request, tokenizer: Tokenizer | None):
        self.request = request
        self.detok = tokenizer.incremental_decoder() if tokenizer else None
        self.text = ""
        self.emitted = 0  # chars of text already streamed
        self._events: collections.deque[TokenEvent] = collections.deque()
        self._ready = threading.Condition()
        self._wakers: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.done = threading.Event()
        self.error: str | None = None
        self.retryable = False
        self.stopped_by_string = False
        self.orphaned = False  # its consumer went away before the end
        stops = request.params.stop
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def add_token(self, token: int) -> bool:
        """Append the token's text; True if a stop string now ends the output."""
        if self.detok is None:
            return False
        self.text += self.detok.add(token)
        for stop in self.request.params.stop:
            # Only the tail can hold a new match; search from where it could start.
            at = self.text.find(stop, max(0, self.emitted - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped_by_string = True
                return True
        return False

    def put(self, event: TokenEvent) -> None:
        with self._ready:
            self._events.append(event)
            self._ready.notify_all()
            wakers = list(self._wakers)
        for loop, flag in wakers:
            try:
                loop.call_soon_threadsafe(flag.set)
            except RuntimeError:  # that consumer's event loop is closed
                pass

    def get(self, timeout: float | None = None) -> TokenEvent | None:
        """The next event, waiting up to `timeout` (None: forever); None if none came."""
        with self._ready:
            if not self._ready.wait_for(lambda: self._events, timeout):
                return None
            return self._events.popleft()

    def has_events(self) -> bool:
        with self._ready:
            return bool(self._events)

    def get_nowait(self) -> TokenEvent | None:
        with self._ready:
            return self._events.popleft() if self._events else None

    def add_waker(self, loop: asyncio.AbstractEventLoop, flag: asyncio.Event) -> None:
        with self._ready:
            self._wakers.append((loop, flag))

    def take_text(self, finished: bool) -> str:
        if finished and self.detok is not None and not self.stopped_by_string:
            self.text += self.detok.flush()
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta


def _drafts_of(row) -> list[int]:
    """A row's MTP drafts up to the first -1 (a chain that ran out of allocated pages)."""
    out = []
    for d in row:
        if d < 0:
            break
        out.append(int(d))
    return out


class Engine:
    # Called after every step with its `StepTiming` (host time by phase), when set.
    step_timings = None
    _input_batch: InputBatch | None = None  # built at the first step
    _timing: StepTiming | None = None  # the current step's

    def __init__(
        self,
        model_dir: str | Path,
        tensor_parallel_size: int = 1,
        dtype: str | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 512,
        block_size: int = 16,
        num_blocks: int | None = None,
        memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        tokenizer: Tokenizer | None | bool = True,
        max_waiting_requests: int | None = None,
        seed: int | None = None,
        enable_prefix_caching: bool = True,
        num_state_slots: int | None = None,
        max_snapshots: int = 64,
        snapshot_budget_bytes: int | None = None,
        num_scheduler_steps: int = 1,
        speculative_config: str | dict | SpeculativeConfig | None = None,
        enable_expert_parallel: bool = False,
        load_format: str = "auto",
        group=None,
        devices=None,
    ):
        speculative = SpeculativeConfig.parse(speculative_config)  # a bad config fails before the load
        # A multi-process group (jtp/distributed/group.py): the runner sends each collective call to the followers.
        runner_args = dict(block_size=block_size, max_seqs=max_num_seqs, devices=devices,
                           num_state_slots=resolve_state_slots(max_num_seqs, num_state_slots),
                           num_scheduler_steps=num_scheduler_steps, expert_parallel=enable_expert_parallel,
                           mtp_drafts=speculative.mtp_drafts if speculative else 0, load_format=load_format)
        if group is None:
            self.runner = ModelRunner(model_dir, tensor_parallel_size, dtype, **runner_args)
        else:
            from jtp.distributed.group import GroupRunner

            self.runner = GroupRunner(group, model_dir, tensor_parallel_size, dtype, **runner_args)
        self.group = group
        self.failure: str | None = None  # why the worker group failed (then this engine runs no more steps)
        self.failed = threading.Event()
        self.model_dir = Path(model_dir)
        cfg = self.cfg = self.runner.cfg
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        hybrid = self.runner.bytes_per_state_slot() > 0
        self.speculative = speculative
        num_blocks = num_blocks or self._blocks_for_memory(memory_utilization, max_num_seqs)
        self.runner.allocate_cache(num_blocks)
        self.pool = PagePool(num_blocks, block_size)
        log.info(
            "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB per device)",
            num_blocks, block_size, num_blocks * block_size, num_blocks * self.runner.bytes_per_block() / 2**20,
        )
        self.states = StatePool(self.runner.num_state_slots) if hybrid else None
        if hybrid:
            log.info("recurrent-state slots: %d (%.1f MiB per device)", self.runner.num_state_slots,
                     self.runner.num_state_slots * self.runner.bytes_per_state_slot() / 2**20)
        # The prefix cache's keys start from the model's identity: a key names one model's KV.
        self.cache_identity = f"{cfg!r}|{self.runner.dtype}|block_size={block_size}|tp={self.runner.tp}"
        self.scheduler = Scheduler(
            self.pool, max_num_seqs, max_num_batched_tokens, self.max_model_len,
            bucket_blocks=self.runner.attention.impl != "kernel",
            states=self.states, cache_root=root_key(self.cache_identity) if enable_prefix_caching else None,
            num_scheduler_steps=num_scheduler_steps, speculative=speculative,
        )
        self.snapshots = SnapshotRegistry(
            max_snapshots,
            snapshot_budget_bytes if snapshot_budget_bytes is not None else num_blocks * self.runner.bytes_per_block() // 2,
        )
        if tokenizer is True:
            tokenizer = Tokenizer.from_dir(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
        self.tokenizer = tokenizer or None
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer else cfg.eos_token_ids)
        self.max_waiting_requests = max_waiting_requests
        self._seeds = random.Random(seed) if seed is not None else None
        self.ready = threading.Event()  # set once warmed up (or at once without warm-up): servers' readiness

        # Intake, shared with caller threads under a short lock that is never held across device work.
        self._intake = threading.Condition()
        self._inbox: collections.deque[tuple[str, Request | str]] = collections.deque()
        self._outputs: dict[str, _Output] = {}
        self._ids = itertools.count()
        self._closed = False

        # Stepping: held by whoever runs a step (the loop thread, or the caller in manual mode).
        self._lock = threading.RLock()
        self._inflight: tuple[list[ScheduledRow], object] | None = None  # dispatched, not yet processed
        self._loop: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        if group is not None:
            group.on_failure(self._on_group_failure)

    @classmethod
    def from_args(cls, args: "EngineArgs") -> "Engine":
        args.validate()
        args.validate_model()
        group = devices = None
        if args.is_multiprocess:
            from jtp.distributed.group import start_leader

            group, devices = start_leader(args)
        try:
            return cls(
                args.model_dir(),
                args.tensor_parallel_size,
                None if args.dtype == "auto" else args.dtype,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                memory_utilization=args.gpu_memory_utilization,
                max_model_len=args.max_model_len,
                max_waiting_requests=args.max_waiting_requests,
                seed=args.seed,
                enable_prefix_caching=args.enable_prefix_caching,
                num_state_slots=args.num_state_slots,
                max_snapshots=args.max_snapshots,
                num_scheduler_steps=args.num_scheduler_steps,
                speculative_config=args.speculative_config,
                enable_expert_parallel=args.enable_expert_parallel,
                load_format=args.load_format,
                group=group,
                devices=devices,
            )
        except BaseException:
            if group is not None:  # its followers must not outlive a start-up that failed
                group.close(kill=True)
            raise

    # ------------------------------------------------------------------ sizing

    def _blocks_for_memory(self, utilization: float, max_num_seqs: int) -> int:
        per_block = self.runner.bytes_per_block()
        stats = self.runner.memory_stats()
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0)
            free -= self.runner.num_state_slots * self.runner.bytes_per_state_slot()
            blocks = int(free // per_block)
            log.info("KV pool sized from device memory: %.1f GiB free x %.2f", free / 2**30, utilization)
            if blocks < 1:
                raise RuntimeError(
                    f"no device memory left for the KV cache: {per_block} bytes per block, {free / 2**30:.2f} GiB "
                    f"free at --gpu-memory-utilization {utilization} (raise it, or lower --max-num-seqs)"
                )
            return blocks
        # No allocator stats (CPU): enough for every row at full length, within a host budget, but
        # never less than one request of max_model_len, so the configured context is really served.
        want = -(-max_num_seqs * self.max_model_len // self.runner.block_size)
        one_request = -(-self.max_model_len // self.runner.block_size)
        return max(min(want, CPU_KV_BUDGET_BYTES // per_block), one_request)

    def _num_waiting(self) -> int:
        """Requests not yet admitted: in the scheduler's queue or still in the inbox (intake lock held)."""
        return len(self.scheduler.waiting) + sum(kind == "add" for kind, _ in self._inbox)

    def stats(self) -> EngineStats:
        with self._intake:
            waiting = self._num_waiting()
        sched = self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=waiting,
            kv_blocks_used=self.pool.num_used_blocks,
            kv_blocks_total=self.pool.total_blocks,
            prefix_cache_queries=sched.prefix_queries,
            prefix_cache_hits=sched.prefix_hits,
            prefix_cache_blocks=self.pool.num_cached_blocks,
            prompt_tokens_computed=sched.prompt_tokens_computed,
            num_snapshots=len(self.snapshots),
            spec_decode_num_drafts=sched.spec_verified_rows,
            spec_decode_num_draft_tokens=sched.spec_draft_tokens,
            spec_decode_num_accepted_tokens=sched.spec_accepted_tokens,
            spec_decode_num_state_rollbacks=sched.spec_state_rollbacks,
        )

    # ------------------------------------------------------------------ requests

    def submit(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a request and return its id at once (validation only; no device work, no waiting)."""
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        self._validate(prompt_ids, params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        with self._intake:
            if self.failure is not None:
                raise WorkerGroupError(self.failure)
            if self._closed:
                raise EngineClosedError("the engine is closed and accepts no new requests")
            if self._draining:
                raise EngineClosedError("the engine is shutting down (draining) and accepts no new requests")
            waiting = self._num_waiting()
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise QueueFullError(f"{waiting} requests are already waiting (limit {self.max_waiting_requests}); retry later")
            rid = request_id
            while rid is None or (request_id is None and rid in self._outputs):
                rid = f"req-{next(self._ids)}"  # never collides with a caller-chosen id
            if rid in self._outputs:
                raise RequestError(f"request id {rid!r} is already in use")
            # An engine seed makes the seeds of requests that bring none reproducible too.
            seed = self._seeds.randrange(2**32) if params.seed is None and self._seeds else request_seed(params)
            req = Request(rid, prompt_ids, params, seed, frozenset(stop_ids))
            self._outputs[rid] = _Output(req, self.tokenizer)
            self._inbox.append(("add", req))
            self._intake.notify_all()
        return rid

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            params.validate(self.cfg.vocab_size)
        except ValueError as e:
            raise RequestError(str(e)) from e
        if not prompt_ids:
            raise RequestError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context length ({self.max_model_len})"
            )
        if not self.pool.can_ever_fit(total):
            raise ContextLengthError(
                f"prompt + max_tokens = {total} tokens needs {self.pool.blocks_needed(total)} KV blocks but the "
                f"whole pool has {self.pool.total_blocks}; lower max_tokens or give the engine more blocks"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it already finished or is unknown.

        In manual mode (no loop thread) the blocks are free when this returns; with the loop
        running they are freed at the start of the next step.
        """
        with self._intake:
            out = self._outputs.get(request_id)
            if out is None or out.request.status is Status.FINISHED:
                return False
            # Whoever aborts gives the request up: it is released once finished. A consumer already
            # streaming holds its output and still gets the finished event.
            out.orphaned = True
            self._inbox.append(("abort", request_id))
            self._intake.notify_all()
        if self._loop is None:
            with self._lock:
                self._drain_inbox()
        return True

    def _drain_inbox(self) -> None:
        """Hand queued submits to the scheduler and carry out queued aborts (step lock held)."""
        with self._intake:
            work, self._inbox = list(self._inbox), collections.deque()
        for kind, item in work:
            if kind == "add":
                self.scheduler.add(item)
            else:
                out = self._outputs.get(item)
                if out is not None and out.request.status is not Status.FINISHED:
                    self._finish(out, "abort")

    # ------------------------------------------------------------------ stepping

    def has_unfinished(self) -> bool:
        with self._intake:
            queued = bool(self._inbox)
        return queued or self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[TokenEvent]:
        """Dispatch the next step, then process the previous one's tokens while it runs.

        Overlapping keeps the device busy: the host schedules and builds step N+1 (whose decode
        rows feed step N's sampled tokens straight from device memory) before it waits for step
        N's results. A stop found in step N's tokens therefore costs one discarded token of
        compute. When step N has already finished (the host, not the device, is the bottleneck)
        its tokens are processed first, so they go out a host step earlier (a cached prompt's
        first token among them) at no cost to the idle device. Penalties need the exact token
        history, so batches that use them run in lockstep.
        Returns the events of the step whose results were processed.
        """
        timing = self._timing = StepTiming()
        start = time.perf_counter()
        with self._lock:
            self._drain_inbox()
            previous, self._inflight = self._inflight, None
            events = []
            # Penalties need the exact token history, and n-gram drafts the last token: lockstep.
            if previous is not None and (
                self._step_done(previous[1]) or self.speculative is not None
                or any(r.params.has_penalties for r in self.scheduler.running)
            ):
                events, previous = self._process(*previous), None
            t = time.perf_counter()
            rows = self.scheduler.schedule()
            while not rows and self.scheduler.waiting and not self.scheduler.running and len(self.snapshots):
                # Snapshots are a cache: they never hold a request back for good.
                victim = next(iter(self.snapshots))
                log.warning("evicting snapshot %s: the next request does not fit beside the snapshots", victim.id)
                self._unpin(self.snapshots.pop(victim.id))
                rows = self.scheduler.schedule()
            timing.schedule += time.perf_counter() - t
            if rows:
                self._inflight = (rows, self._dispatch(rows))
            if previous is not None:
                events = self._process(*previous)
        timing.total = time.perf_counter() - start
        if self.step_timings is not None:
            self.step_timings(timing)
        return events

    @staticmethod
    def _step_done(result) -> bool:
        """Whether a dispatched step's results are ready (the device is waiting for the host)."""
        return is_ready(result)

    def _dispatch(self, rows: list[ScheduledRow]):
        t0 = time.perf_counter()
        out = self.scheduler.output(rows)
        t1 = time.perf_counter()
        batch = self._input_batch
        if batch is None:
            sched = self.scheduler
            batch = self._input_batch = InputBatch(
                sched.max_num_seqs, self.max_model_len, self.pool.block_size, sched.buckets,
                self.speculative.verify_positions if self.speculative is not None else 0,
            )
        packed = batch.prepare(out)
        t2 = time.perf_counter()
        compilations = self.runner.compilations
        result = self.runner.dispatch(packed)
        self.scheduler.dispatched(rows)
        t3 = time.perf_counter()
        timing = self._timing
        timing.schedule += t1 - t0
        timing.prepare += t2 - t1
        timing.dispatch += t3 - t2
        layout = packed.layout
        timing.shape = (layout.num_tokens, layout.num_rows, layout.max_blocks)
        timing.compiled = self.runner.compilations != compilations
        return result

    def _process(self, rows: list[ScheduledRow], result) -> list[TokenEvent]:
        t0 = time.perf_counter()
        result = jax.device_get(result)  # waits for the device; fields are [steps, rows]
        t1 = time.perf_counter()
        per_step = [jax.tree.map(lambda x, i=i: x[i], result) for i in range(len(result.tokens))]
        tokens = result.tokens.tolist()
        events = []
        now = time.monotonic()
        for b, row in enumerate(rows):
            req = row.request
            if not row.samples:
                continue
            if row.drafts:
                events += self._accept(row, per_step, b, now)
                continue
            if result.draft is not None:  # MTP: the head's drafts after the row's newest token
                req.mtp_drafts = _drafts_of(per_step[row.steps - 1].draft[b])
            for i in range(row.steps):
                req.pending -= 1
                if req.status is Status.RUNNING:  # else finished or aborted meanwhile: discard
                    req.first_token_time = req.first_token_time or now
                    events.append(self._append(req, tokens[i][b], per_step[i], b))
        timing = self._timing
        if timing is not None:
            timing.wait += t1 - t0
            timing.process += time.perf_counter() - t0
        return events

    def _accept(self, row: ScheduledRow, per_step, b: int, now: float) -> list[TokenEvent]:
        """A verified row (results of position j in per_step[j]): the drafts the target sampled too,
        then the target's token where they part."""
        req = row.request
        sampled = [int(step.tokens[b]) for step in per_step]
        accepted = next((j for j, d in enumerate(row.drafts) if sampled[j] != d), len(row.drafts))
        self.scheduler.accepted(row, accepted)
        if per_step[0].draft is not None:  # MTP: its drafts from the last accepted position on
            req.mtp_drafts = _drafts_of(per_step[0].draft[b])
        req.pending -= 1
        events = []
        for j in range(accepted + 1):
            if req.status is not Status.RUNNING:  # a stop among the accepted tokens, or an abort
                break
            req.first_token_time = req.first_token_time or now
            events.append(self._append(req, sampled[j], per_step[j], b))
        return events

    def _append(self, req: Request, token: int, result, b: int) -> TokenEvent:
        out = self._outputs[req.id]
        req.output_ids.append(token)
        logprob = top = None
        if req.params.logprobs is not None:
            logprob = [float(result.logprob[b])]
            out.logprobs += logprob
            n = req.params.logprobs
            top = [{int(i): float(v) for i, v in zip(result.top_ids[b][:n], result.top_logprobs[b][:n])}] if n else None
            if top:
                out.top_logprobs += top
        reason = None
        if token in req.stop_ids:
            reason = "stop"
        hit_stop_string = out.add_token(token) if token not in req.stop_ids else False
        if hit_stop_string:
            reason = "stop"
        elif reason is None and len(req.output_ids) >= req.params.max_tokens:
            reason = "length"
        event = TokenEvent(req.id, [token], "", logprob, top)
        if reason:
            self._finish(out, reason, event)
        else:
            event.text = out.take_text(False)
            out.put(event)
        return event

    def _finish(self, out: _Output, reason: str, event: TokenEvent | None = None, touch_scheduler: bool = True) -> None:
        if out.done.is_set():  # already ended (a worker-group failure ends requests from another thread)
            return
        req = out.request
        if touch_scheduler:
            self.scheduler.remove(req)
        else:
            req.status = Status.FINISHED
        req.finish_reason = reason
        event = event or TokenEvent(req.id, [], "", error=out.error, retryable=out.retryable)
        event.cached_tokens = req.cached_tokens
        event.text += out.take_text(True)
        event.finished, event.finish_reason = True, reason
        out.put(event)
        out.done.set()
        if out.orphaned:
            self.release(req.id)

    # ------------------------------------------------------------------ consuming

    def _output(self, request_id: str) -> _Output:
        with self._intake:
            out = self._outputs.get(request_id)
        if out is None:
            raise KeyError(f"unknown request id {request_id!r} (never submitted, or already consumed)")
        return out

    def stream(self, request_id: str, timeout: float | None = None):
        """Yield TokenEvents of one request until its finished event, then release the request.

        The request is claimed at this call (not at the first `next`), so an abort after it still
        reaches this consumer as a finished event. Closing the generator before the end (a
        consumer that goes away) aborts the request. `timeout` bounds each wait (TimeoutError).
        """
        return self._stream(request_id, self._output(request_id), timeout)

    def _stream(self, request_id: str, out: _Output, timeout: float | None):
        finished = False
        try:
            while not finished:
                if self._loop is None:
                    while not out.has_events():
                        self.step()
                event = out.get(timeout)
                if event is None:
                    raise TimeoutError(f"no event for request {request_id!r} within {timeout} s")
                finished = event.finished
                yield event
        finally:
            self._end_consumer(request_id, finished)

    async def astream(self, request_id: str):
        """`stream` for asyncio: waits without blocking the event loop (needs the loop thread)."""
        out = self._output(request_id)
        flag = asyncio.Event()
        out.add_waker(asyncio.get_running_loop(), flag)
        finished = False
        try:
            while not finished:
                event = out.get_nowait()
                if event is None:
                    await flag.wait()
                    flag.clear()
                    continue
                finished = event.finished
                yield event
        finally:
            self._end_consumer(request_id, finished)

    def _end_consumer(self, request_id: str, finished: bool) -> None:
        if not finished:
            self.abort(request_id)  # marks it orphaned: released once its abort is carried out
        self.release(request_id)

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait for a request to finish and return it whole; releases the request."""
        out = self._output(request_id)
        if self._loop is None:
            while not out.done.is_set():
                self.step()
        if not out.done.wait(timeout):
            raise TimeoutError(f"request {request_id!r} did not finish within {timeout} s")
        req = out.request
        self.release(request_id)
        return Completion(
            req.id, req.prompt_ids, list(req.output_ids), out.text, req.finish_reason,
            out.logprobs or None, out.top_logprobs or None, out.error,
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request (the consumers above do it; idempotent)."""
        with self._intake:
            out = self._outputs.get(request_id)
            if out is not None and out.request.status is Status.FINISHED:
                del self._outputs[request_id]

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Offline batch: submit everything at once, run until all finish, results in input order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = []
        try:
            for p, sp in zip(prompts, params_list, strict=True):
                ids.append(self.submit(p, sp))
        except Exception:
            for rid in ids:  # all or nothing: don't leave the valid ones running unowned
                self.abort(rid)
                self.release(rid)
            raise
        return [self.result(rid) for rid in ids]

    # ------------------------------------------------------------------ prefix cache, snapshots

    def snapshot(self, request_id: str | None = None, *, tokens=None) -> str:
        """Pin a prefix in the cache and return a snapshot id to `restore` from later.

        From a request (running, or finished and not yet released): its prompt and output so far.
        From `tokens`: that sequence, prefilled first if the cache does not hold it. The snapshot
        holds the longest cached prefix (whole blocks; on hybrid models ending at a state
        checkpoint); `restore` recomputes the few tokens past it. Older snapshots are evicted
        (LRU) to stay within the entry cap and byte budget; when it cannot be made, an error
        says why and nothing is held.
        """
        if (request_id is None) == (tokens is None):
            raise RequestError("snapshot() takes a request id or tokens, not both or neither")
        if self.scheduler.cache_root is None:
            raise RequestError("snapshots need prefix caching (the engine runs with enable_prefix_caching=False)")
        if request_id is not None:
            with self._lock:
                req = self._output(request_id).request
                if req.status is Status.RUNNING:
                    self.scheduler._register(req)  # what the last steps computed
                seq = req.prompt_ids + req.output_ids
                return self._pin(seq)
        seq = [int(t) for t in tokens]
        if not seq:
            raise RequestError("cannot snapshot an empty token sequence")
        with self._lock:
            snap_id = self._pin(seq, partial_ok=False)
        if snap_id is None:  # not cached yet: prefill it (one sampled token, discarded), then pin
            self.result(self.submit(seq, SamplingParams(max_tokens=1, temperature=0.0)))
            with self._lock:
                snap_id = self._pin(seq)
        return snap_id

    def _pin(self, seq: list[int], partial_ok: bool = True) -> str | None:
        """Pin the cached prefix of `seq` as a new snapshot (step lock held). None when
        `partial_ok` is False and less than every cacheable token is cached."""
        sched, bs = self.scheduler, self.pool.block_size
        keys = block_keys(sched.cache_root, seq, bs)
        blocks, slot = sched.restorable(self.pool.lookup(keys), keys)
        # Hybrid: the last state checkpoint of a prompt sits a block before its end.
        full = len(keys) if self.states is None else (len(seq) - 1) // bs
        if not partial_ok and len(blocks) < full:
            return None
        nbytes = len(blocks) * self.runner.bytes_per_block() + (self.runner.bytes_per_state_slot() if slot >= 0 else 0)
        if nbytes > self.snapshots.budget_bytes or self.snapshots.max_entries == 0:
            raise RequestError(
                f"a snapshot of {len(blocks) * bs} cached tokens needs {nbytes} bytes; the snapshot budget is "
                f"{self.snapshots.budget_bytes} bytes and {self.snapshots.max_entries} entries"
            )
        for victim in self.snapshots.victims(nbytes):
            self._unpin(self.snapshots.pop(victim.id))
        if slot >= 0 and not self.states.refs(slot) and self.states.available() < 1:
            raise RequestError("no spare recurrent-state slot to pin a snapshot now (running requests hold "
                               "them); drop snapshots or retry when fewer requests run")
        snap = Snapshot(self.snapshots.new_id(), list(seq), len(blocks) * bs, blocks, slot, nbytes)
        if not self.pool.reserve(snap.pool_id, snap.num_cached_tokens, blocks):
            raise RequestError(
                f"the KV pool cannot pin {len(blocks)} more blocks now ({self.pool.num_available_blocks} available); "
                "drop snapshots or retry when fewer requests run"
            )
        if slot >= 0:
            self.states.acquire(slot)
        self.snapshots.add(snap)
        return snap.id

    def _unpin(self, snap: Snapshot) -> None:
        self.pool.free(snap.pool_id)
        if snap.state_slot >= 0:
            self.states.release(snap.state_slot)

    def restore(self, snapshot_id: str, prompt_ids=(), params: SamplingParams | None = None, request_id=None) -> str:
        """Continue generation from a snapshot: submit its tokens plus `prompt_ids` (new turn, if
        any) as a request; only the tokens past the pinned prefix are prefilled."""
        with self._lock:
            snap = self.snapshots.get(snapshot_id)
            seq = snap.tokens + [int(t) for t in prompt_ids]
        return self.submit(seq, params, request_id)

    def drop(self, snapshot_id: str) -> None:
        """Let go of a snapshot: its blocks and state return to the ordinary (evictable) cache."""
        with self._lock:
            self._unpin(self.snapshots.pop(snapshot_id))

    def list_snapshots(self) -> list[Snapshot]:
        """Every snapshot, least recently used first."""
        with self._lock:
            return list(self.snapshots)

    def save_snapshots(self, path, snapshot_ids=None, overwrite: bool = False, include_prefix_cache: bool = False):
        """Write snapshots (default: all; with `include_prefix_cache` also the rest of the prefix
        cache) to `path` with orbax; see jtp/engine/snapshot_store.py."""
        from jtp.engine.snapshot_store import save_snapshots

        return save_snapshots(self, path, snapshot_ids, overwrite=overwrite, include_prefix_cache=include_prefix_cache)

    def load_snapshots(self, path, include_prefix_cache: bool = True) -> list[str]:
        """Load snapshots (and any saved prefix-cache entries, as fit) saved by an engine of the same
        model, config, dtype and mesh; their ids."""
        from jtp.engine.snapshot_store import load_snapshots

        return load_snapshots(self, path, include_prefix_cache=include_prefix_cache)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block and state checkpoint that nothing holds; returns how many blocks."""
        with self._lock:
            return self._reset_prefix_cache()

    def _reset_prefix_cache(self) -> int:
        if self.states is not None:
            self.states.reset_cache()
        return self.pool.reset_cache()

    # ------------------------------------------------------------------ warm-up

    def warmup(self, progress: bool = False) -> int:
        """Compile the step for every shape the scheduler can produce, then set `ready`.

        Runs all-padding steps (nothing is written to the KV cache or the state slots) for each
        (tokens, rows, tokens-per-row, blocks-per-row) bucket the scheduler can pick, with the
        two common sampling variants (plain and top-k/top-p/min-p); penalties and logprobs
        compile on first use. Returns how many step variants were compiled (0 when all came
        from the persistent compilation cache or an earlier warm-up).
        """
        from tqdm import tqdm

        shapes = self.scheduler.buckets.shapes()
        variants = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)]
        before = self.runner.compilations
        bar = tqdm(total=len(shapes) * len(variants), desc="warm-up: compiling step shapes", unit="shape",
                   disable=not progress, mininterval=1.0)
        with self._lock, bar:
            self._settle()
            for shape in shapes:
                if self._stopping:  # stop() / close() during warm-up (Ctrl-C): give up at once
                    return self.runner.compilations - before
                _, B, max_row_len, _ = shape
                # Rows of several tokens may be speculating rows: their verify steps sample [1 + k, B].
                verify = (False, True) if self.speculative is not None and max_row_len > 1 else (False,)
                plans = [self.scheduler.padding_plan(*shape, verify=v) for v in verify]
                for params in variants:
                    sampling = pack_sampling([params] * B, B, [0] * B, [0] * B)
                    for plan in plans:
                        jax.block_until_ready(self.runner.dispatch(StepInput(plan, sampling)))
                    bar.update()
        self.ready.set()
        compiled = self.runner.compilations - before
        log.info("warm-up: %d step shapes x %d sampling variants, %d compiled", len(shapes), len(variants), compiled)
        return compiled

    def _settle(self) -> None:
        """Process the in-flight step, if any, so nothing is pending on the device (step lock held)."""
        previous, self._inflight = self._inflight, None
        if previous is not None:
            self._process(*previous)

    # ------------------------------------------------------------------ background loop, shutdown

    def start(self) -> None:
        """Run steps on a background thread until `stop()` (for servers)."""
        if self._loop is not None:
            return
        self._stopping = False  # a stopped engine may start again
        self._loop = threading.Thread(target=self._run_loop, name="jtp-engine", daemon=True)
        self._loop.start()

    def stop(self) -> None:
        """Stop the loop thread (and a warm-up under way) and end every unfinished request with an
        "abort" finished event."""
        with self._intake:
            self._stopping = True
            self._intake.notify_all()
        if self._loop is not None and self._loop is not threading.current_thread():
            # After a worker-group failure the loop may be stuck in a collective that never ends.
            self._loop.join(None if self.failure is None else 5.0)
        self._loop = None
        if self.failure is not None:  # its requests were ended by _on_group_failure
            return
        with self._lock:
            try:
                self._settle()
            except Exception:  # noqa: BLE001 - the device step failed; the requests end below anyway
                log.exception("the last in-flight step failed while stopping")
            self._drain_inbox()
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._finish(self._outputs[req.id], "abort")
            self._stopping = False  # the loop and any warm-up have seen it (they give up the lock first)

    def close(self) -> None:
        """Stop, refuse new requests, and free the device memory (weights and KV cache)."""
        with self._intake:
            self._closed = True
        self.stop()
        self.ready.clear()
        if self.failure is None:
            self.runner.close()
        else:  # the device may be stuck in a collective: free nothing there, just end the group
            self.group.close(kill=True)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def drain(self, timeout: float) -> bool:
        """Stop admitting requests and wait up to `timeout` seconds for the unfinished ones to
        finish (SIGTERM); True if all did. `stop()` then aborts whatever is left."""
        with self._intake:
            self._draining = True
        deadline = time.monotonic() + timeout
        while self.has_unfinished() and self.failure is None and time.monotonic() < deadline:
            if self._loop is None:
                self.step()
            else:
                time.sleep(0.05)
        return not self.has_unfinished()

    def _on_group_failure(self, reason: str) -> None:
        """A follower died, hung or diverged (called from the group's monitor): end every unfinished
        request with a retryable error and run no more steps. The step thread may be stuck in a
        collective, so the step lock is only waited for briefly."""
        message = f"the worker group failed ({reason}); retry the request"
        with self._intake:
            self.failure = message
            self._stopping = True
            self._intake.notify_all()
        locked = self._lock.acquire(timeout=2.0)
        try:
            with self._intake:
                outs = [out for out in self._outputs.values() if not out.done.is_set()]
            for out in outs:
                out.error, out.retryable = message, True
                self._finish(out, "error", touch_scheduler=locked)
        finally:
            if locked:
                self._lock.release()
        self.ready.clear()
        self.failed.set()

    def _run_loop(self) -> None:
        while True:
            with self._intake:
                while not self._stopping and not self._inbox and not self.scheduler.has_work() and self._inflight is None:
                    self._intake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed step must not strand its requests
                if self.group is not None:  # in a group a failed step means a broken group
                    if not self.group.failed.wait(1.0):  # let the monitor name the cause if it can
                        self.group.fail(f"a step failed: {type(e).__name__}: {e}")
                    self.failed.wait(10.0)  # _on_group_failure ends the requests (retryable)
                    return
                log.exception("engine step failed; failing the running requests")
                with self._lock:
                    self._inflight = None
                    for req in list(self.scheduler.running):
                        out = self._outputs[req.id]
                        out.error = f"{type(e).__name__}: {e}"
                        self._finish(out, "error")
                    self._reset_prefix_cache()  # what the failed step was to write is not trustworthy
