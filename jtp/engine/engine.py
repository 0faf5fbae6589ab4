"""Engine: the public face of continuous batching.

    engine = Engine.from_args(EngineArgs(model="checkpoints/demo-qwen3"))   # or Engine(EngineConfig)
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
work or compilation; a request with images waits for the step lock to encode them); whoever steps
(the loop thread, or the caller in manual mode) drains the inbox at the start of each step.

This module is intake and the step loop; the rest is beside it: output_processor.py (streams,
detokenising, stop strings, logprobs), snapshot_api.py (the snapshot methods), failures.py (a failed step), snapshot_manager.py
(pinned prefixes), snapshot_store.py (snapshots on disk), structured_output.py (grammars, token
masks), warmup.py (compiling the step shapes), memory.py (KV pool size), stats.py.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import jax

from jtp.config.engine_args import EngineArgs
from jtp.config.engine_config import EngineConfig
from jtp.core.block_hash import root_key
from jtp.core.multimodal import ImagePrompt
from jtp.core.sampling_params import SamplingParams
from jtp.core.scheduler import Request, ScheduledRow, Scheduler, Status
from jtp.core.step_input import mask_words
from jtp.engine.failures import EngineFailures
from jtp.engine.input_processor import InputProcessor
from jtp.engine.memory import LOAD_REMEDY, POOL_REMEDY, STEP_REMEDY, allocate_pools
from jtp.engine.multimodal import engine_vision, live_images, prompt_images
from jtp.engine.output_processor import Completion, OutputProcessor, RequestStream, TokenEvent, generate_all
from jtp.engine.snapshot_api import EngineSnapshots
from jtp.engine.snapshot_manager import SnapshotManager
from jtp.engine.stats import EngineStats, collect_stats
from jtp.engine.step_timing import StepTiming
from jtp.engine.structured_output import (
    GrammarCompiler,
    advance_grammars,
    constrained_rows,
    has_masks,
    request_matcher,
    token_masks,
)
from jtp.engine.tokenizer import Tokenizer
from jtp.engine.warmup import compile_step_shapes
from jtp.errors import EngineClosedError, QueueFullError, RequestError, WorkerGroupError, is_out_of_memory, out_of_memory
from jtp.worker.devices import with_device_defaults
from jtp.worker.input_batch import InputBatch
from jtp.worker.pipeline import runner_class
from jtp.worker.runner import is_ready

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineStats", "TokenEvent", "Completion", "RequestError"]


def _drafts_of(row) -> list[int]:
    """A row's MTP drafts up to the first -1 (a chain that ran out of allocated pages)."""
    return [int(d) for d in itertools.takewhile(lambda d: d >= 0, row)]


class Engine(EngineSnapshots, EngineFailures):
    # Called after every step with its `StepTiming` (host time by phase), when set.
    step_timings = None
    _timing: StepTiming | None = None  # the current step's
    warmup_report = None  # the last warm-up's WarmupReport

    def __init__(self, config: EngineConfig, *, group=None, devices=None):
        """Load `config`'s model and build the pools, the scheduler and the tokenizer.

        `group` / `devices`: a multi-process worker group this process leads and the mesh's
        devices (`from_args` starts both from the args); the runner then sends each collective
        call to the followers (jtp/distributed/group.py).
        """
        if config.is_multiprocess and group is None:
            raise ValueError("a multi-process engine needs its worker group: build it with Engine.from_args")
        self.config = config
        try:
            if group is None:
                self.runner = runner_class(config)(config, devices)
            else:
                from jtp.distributed.group import group_runner

                self.runner = group_runner(group, config, devices)
        except Exception as e:
            if is_out_of_memory(e):
                raise out_of_memory(e, "loading the weights", LOAD_REMEDY) from e
            raise
        self.group = group
        self.failure: str | None = None  # why the engine failed: its worker group, or a replica's step (`fail`)
        self.failed = threading.Event()
        self.model_dir = Path(config.model)
        cfg = self.cfg = self.runner.cfg
        self.max_model_len = config.max_model_len
        self.speculative = config.speculative_config
        try:
            # With warm-up ahead, the pool waits for its end: the compiles' autotuning may use its memory.
            deferred = config.warmup and self.runner.compiles_ahead and self.runner.defers_cache
            self.pool, self.states = allocate_pools(self.runner, config, deferred)
        except Exception as e:
            if is_out_of_memory(e):
                raise out_of_memory(e, "allocating the KV cache", POOL_REMEDY) from e
            raise
        # The prefix cache's keys start from the model's identity: a key names one model's KV.
        self.cache_identity = f"{cfg!r}|{self.runner.dtype}|{config.quantization}{'-channel-w8a8' if config.quantization == 'fp8' else ''}|kv={config.kv_cache_dtype}|block_size={config.block_size}|tp={self.runner.tp}"
        self.scheduler = Scheduler(
            self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            bucket_row_lens=self.runner.uses_row_len_bound, limit_long_rows=self.runner.limit_long_rows,
            states=self.states, cache_root=root_key(self.cache_identity) if config.enable_prefix_caching else None,
            num_scheduler_steps=config.num_scheduler_steps, speculative=self.speculative,
            pipeline_depth=self.runner.pipeline_depth,
        )
        has_tokenizer = not config.skip_tokenizer_init and (self.model_dir / "tokenizer.json").is_file()
        self.tokenizer = Tokenizer.from_dir(self.model_dir) if has_tokenizer else None
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer else cfg.eos_token_ids)
        # Structured outputs' grammars (the tokenizer's vocabulary, the model's width).
        self.grammars = GrammarCompiler(self.model_dir / "tokenizer.json", cfg.vocab_size, self.eos_ids) if has_tokenizer else None
        if self.grammars is not None:
            self.grammars.load_in_background()
        self._masks = concurrent.futures.ThreadPoolExecutor(1, "jtp-masks")  # a late step's masks, filled beside processing
        # The worker's persistent rows, updated each step from the scheduler's output.
        self.input_batch = InputBatch(config.max_num_seqs, self.max_model_len, config.block_size, self.scheduler.buckets,
                                      self.speculative.verify_positions if self.speculative is not None else 0,
                                      mask_words(cfg.vocab_size), self.runner.images is not None)
        self.vision = engine_vision(self.runner, self.model_dir, config.args.max_images_per_prompt())  # None: no images
        per_block, budget = self.runner.bytes_per_block(), config.snapshot_budget_bytes
        self.snapshots = SnapshotManager(
            config.max_snapshots, budget if budget is not None else self.pool.total_blocks * per_block // 2,
            self.scheduler, self.pool, self.states, per_block, self.runner.bytes_per_state_slot(),
        )
        self.inputs = InputProcessor(cfg, self.max_model_len, self.pool, self.eos_ids, config.seed,
                                     config.sampling_defaults, "the MTP head" if config.mtp_drafts else None)
        # What requests leave unset (--generation-config); default_params(**given): SamplingParams with them.
        self.sampling_defaults, self.default_params = self.inputs.sampling_defaults, self.inputs.default_params
        if self.sampling_defaults:
            log.info("sampling defaults from the generation config: %s", self.sampling_defaults)
        self.ready = threading.Event()  # set once warmed up (or at once without warm-up): servers' readiness
        # Whether a dispatched step finished: process its tokens first, or overlap (tests replace it).
        self.step_done = is_ready

        # Intake, shared with caller threads under a short lock that is never held across device work.
        self._intake = threading.Condition()
        self._inbox: collections.deque[tuple[str, Request | str]] = collections.deque()
        self.outputs = OutputProcessor(self.tokenizer, self._intake, self._pump, self.abort)
        self._ids = itertools.count()
        self._closed = False

        # Stepping: held by whoever runs a step (the loop thread, or the caller in manual mode).
        self._lock = threading.RLock()
        # Steps dispatched, not yet processed, oldest first: (rows, device results).
        self._inflight: collections.deque[tuple[list[ScheduledRow], object]] = collections.deque()
        self._loop: threading.Thread | None = None
        self._stopping = False
        self._draining = False
        if group is not None:
            group.on_failure(lambda reason: self.fail(f"the worker group failed ({reason}); retry the request"))

    @classmethod
    def from_args(cls, args: EngineArgs) -> "Engine":
        """Resolve `args` (ConfigError naming a bad setting) and build the engine; a multi-process
        configuration first forms its worker group, as leader (its followers get the batch sizes the
        leader's device chose)."""
        args = with_device_defaults(args)
        config = EngineConfig.from_args(args)
        group = devices = None
        if config.is_multiprocess:
            from jtp.distributed.group import start_leader

            group, devices = start_leader(args)
        try:
            return cls(config, group=group, devices=devices)
        except BaseException:
            if group is not None:  # its followers must not outlive a start-up that failed
                group.close(kill=True)
            raise

    def _num_waiting(self) -> int:
        """Requests not yet admitted: in the scheduler's queue or still in the inbox (intake lock held)."""
        return len(self.scheduler.waiting) + sum(kind == "add" for kind, _ in self._inbox)

    def stats(self) -> EngineStats:
        with self._intake:
            waiting = self._num_waiting()
        return collect_stats(self.scheduler, self.pool, waiting, len(self.snapshots), self.runner)

    def submit(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None,
               images: Sequence[ImagePrompt] = ()) -> str:
        """Queue a request and return its id at once (validation, and the encoding of the images the
        pool lacks; no waiting for the step). Without `params`: the generation config's sampling
        defaults (`default_params`). `images`: the prompt's, their placeholders already in `prompt_ids`."""
        params = params or self.default_params()
        prompt_ids = [int(t) for t in prompt_ids]
        self.inputs.validate(prompt_ids, params)
        mm = prompt_images(self.vision, prompt_ids, images, "speculative decoding" if self.speculative else None)
        # Compiled here, on the caller's thread, never on the step loop.
        grammar = request_matcher(self.grammars, params, "--num-scheduler-steps > 1" if self.config.num_scheduler_steps > 1
                                  else "speculative decoding" if self.speculative is not None else None)
        # Encoded under the step lock (the step reads the pool), then registered: one move, the intake
        # lock (which the server's event loop takes) never held across device work.
        with self._lock if mm is not None else contextlib.nullcontext():
            rows = () if mm is None else tuple(self.runner.place_images(mm.images, lambda: live_images(self)))
            with self._intake:
                if self.failure is not None:
                    raise WorkerGroupError(self.failure)
                if self._closed:
                    raise EngineClosedError("the engine is closed and accepts no new requests")
                if self._draining:
                    raise EngineClosedError("the engine is shutting down (draining) and accepts no new requests")
                waiting, limit = self._num_waiting(), self.config.max_waiting_requests
                if limit is not None and waiting >= limit:
                    raise QueueFullError(f"{waiting} requests are already waiting (limit {limit}); retry later")
                rid = request_id
                while rid is None or (request_id is None and rid in self.outputs):
                    rid = f"req-{next(self._ids)}"  # never collides with a caller-chosen id
                if rid in self.outputs:
                    raise RequestError(f"request id {rid!r} is already in use")
                req = self.inputs.make_request(rid, prompt_ids, params)
                req.grammar, req.mm, req.image_rows = grammar, mm and mm.without_pixels(), rows
                self.outputs.add(req)
                self._inbox.append(("add", req))
                self._intake.notify_all()
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False if it already finished or is unknown.

        In manual mode (no loop thread) the blocks are free when this returns; with the loop
        running they are freed at the start of the next step.
        """
        with self._intake:
            out = self.outputs.get(request_id)
            if out is None or out.request.status is Status.FINISHED:
                return False
            # Whoever aborts gives the request up: it is released once finished. A consumer already
            # streaming holds its output and still gets the finished event.
            out.orphaned = True
            self._inbox.append(("abort", request_id))
            self._intake.notify_all()
        if self._loop is None:
            with self._lock:
                self.apply_inbox()
        return True

    def apply_inbox(self) -> None:
        """Hand queued submits to the scheduler and carry out queued aborts (step lock held; the
        step does it first)."""
        with self._intake:
            work, self._inbox = list(self._inbox), collections.deque()
        for kind, item in work:
            if kind == "add":
                self.scheduler.add(item)
            else:
                out = self.outputs.get(item)
                if out is not None and out.request.status is not Status.FINISHED:
                    self._finish(out, "abort")

    def has_unfinished(self) -> bool:
        with self._intake:
            queued = bool(self._inbox)
        return queued or self.scheduler.has_work() or bool(self._inflight)

    @property
    def inflight_rows(self) -> list[ScheduledRow]:
        return [row for rows, _ in list(self._inflight) for row in rows]  # dispatched, not yet processed

    def step(self) -> list[TokenEvent]:
        """Dispatch the next step, then process the previous one's tokens while it runs.

        Overlapping keeps the device busy: the host schedules and builds step N+1 (whose decode
        rows feed step N's sampled tokens straight from device memory) before it waits for step
        N's results. A stop found in step N's tokens therefore costs one discarded token of
        compute. When step N has already finished (the host, not the device, is the bottleneck)
        its tokens are processed first, so they go out a host step earlier (a cached prompt's
        first token among them) at no cost to the idle device. Penalties need the exact token
        history, so batches that use them run in lockstep. A step with a grammar's token masks
        (structured outputs) enqueues its forward program, feeds step N's tokens to the grammars,
        fills the masks on the mask thread while it processes the rest of step N, then enqueues its
        sampling program (where the runner cannot sample late: lockstep). A pipeline keeps one step of
        other requests per stage in flight (`pipeline_depth`), processing the oldest once that many
        are, or once nothing new can run. Returns the events of the steps processed. In a
        multi-process group a failed step raises WorkerGroupError (the group is broken: failures.py)."""
        try:
            return self._step()
        except Exception as e:
            if self.group is None:
                raise
            raise self._group_failure(e) from e

    def _step(self) -> list[TokenEvent]:
        timing = self._timing = StepTiming()
        start = time.perf_counter()
        with self._lock:
            self.apply_inbox()
            inflight, events = self._inflight, []
            # Penalties need the exact token history, n-gram drafts the last token, and a grammar's
            # mask the token before (unless the runner samples late): lockstep.
            masks_wait = not self.runner.samples_late
            lockstep = self.speculative is not None or any(
                r.params.has_penalties or (masks_wait and r.grammar is not None) for r in self.scheduler.running)
            while inflight and (lockstep or self.step_done(inflight[0][1])):
                events += self._process(*inflight.popleft())
            t = time.perf_counter()
            rows = self.scheduler.schedule(overlap=not lockstep)
            while not rows and self.scheduler.waiting and not self.scheduler.running and len(self.snapshots):
                # Snapshots are a cache: they never hold a request back for good.
                victim = self.snapshots.evict_oldest()
                log.warning("evicted snapshot %s: the next request does not fit beside the snapshots", victim.id)
                rows = self.scheduler.schedule()
            timing.schedule += time.perf_counter() - t
            start_masks = sample = None
            if rows:
                result, sample = self._dispatch(rows)
                if sample is None:
                    inflight.append((rows, result))
                else:  # token masks: filled once step N's tokens advanced the grammars
                    start_masks = result
            # The oldest step's tokens while the new one runs (a pipeline keeps one step per stage in
            # flight); with nothing new to run, wait for it.
            if inflight and (len(inflight) + (sample is not None) > self.scheduler.pipeline_depth or not rows):
                events += self._process(*inflight.popleft(), start_masks)
            if sample is not None:
                inflight.append((rows, sample()))
        timing.total, timing.tokens = time.perf_counter() - start, len(events)
        if self.step_timings is not None:
            self.step_timings(timing)
        return events

    def _dispatch(self, rows: list[ScheduledRow]):
        t0 = time.perf_counter()
        out = self.scheduler.output(rows)
        t1 = time.perf_counter()
        masked = has_masks(rows)
        packed = self.input_batch.prepare(out, masked)
        # Sampling late: a grammar's mask waits for step N's tokens (see `step`); min_tokens' is known now.
        late = bool(constrained_rows(rows)) and self.runner.samples_late and self.runner.samples_separately(packed)
        if masked and not late:
            self._write_masks(packed, rows)
        t2 = time.perf_counter()
        compilations = self.runner.compilations
        result = self.runner.dispatch(packed, late=True) if late else self.runner.dispatch(packed)
        self.scheduler.dispatched(rows)
        self._timing.dispatched(t0, t1, t2, time.perf_counter(), packed.layout, self.runner.compilations != compilations)
        if late:  # (start the masks' fill on the mask thread, enqueue the sampling program once they are in)
            filling = []

            def sample():
                filling[0].result() if filling else self._write_masks(packed, rows)
                return result()

            return lambda: filling.append(self._masks.submit(self._write_masks, packed, rows)), sample
        return result, None

    def _write_masks(self, packed, rows: list[ScheduledRow]) -> None:
        masks = token_masks(self.grammars, rows, self.input_batch.mask_words)
        if masks is not None:
            packed.fields()["token_mask"][: len(rows)] = masks

    def _process(self, rows: list[ScheduledRow], result, grammars_advanced=None) -> list[TokenEvent]:
        """Hand out a step's tokens; `grammars_advanced()` is called once they are in the grammars."""
        t0 = time.perf_counter()
        result = jax.device_get(result)  # waits for the device; fields are [steps, rows]
        t1 = time.perf_counter()
        grammar_ends = advance_grammars(rows, result.tokens[0].tolist())
        if grammars_advanced is not None:
            grammars_advanced()
        if result.prompt is not None:  # the prompt positions' scores, chunk after chunk
            self.outputs.add_prompt_scores(rows, result.prompt)
            result = result._replace(prompt=None)
        per_step = [jax.tree.map(lambda x, i=i: x[i], result) for i in range(len(result.tokens))]
        tokens = result.tokens.tolist()
        events = []
        now = time.monotonic()
        for b, row in enumerate(rows):
            req = row.request
            if not row.picks_next_token:
                continue
            if row.drafts:
                events += self._accept(row, per_step, b, now)
                continue
            if result.draft is not None:  # MTP: the head's drafts after the row's newest token
                req.mtp_drafts = _drafts_of(per_step[row.steps - 1].draft[b])
            for i in range(row.steps):
                req.num_unseen_tokens -= 1
                if req.status is Status.RUNNING:  # else finished or aborted meanwhile: discard
                    req.first_token_time = req.first_token_time or now
                    events.append(self._append(req, tokens[i][b], per_step[i], b, grammar_ends.get(b)))
        self.outputs.publish()  # the step's events: one wake-up per request
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
        req.num_unseen_tokens -= 1
        events = []
        for j in range(accepted + 1):
            if req.status is not Status.RUNNING:  # a stop among the accepted tokens, or an abort
                break
            req.first_token_time = req.first_token_time or now
            events.append(self._append(req, sampled[j], per_step[j], b))
        return events

    def _append(self, req: Request, token: int, result, b: int, grammar_end: str | None = None) -> TokenEvent:
        event, reason = self.outputs.append_token(req, token, result, b)
        reason = reason or grammar_end
        if reason:
            self._finish(self.outputs.get(req.id), reason, event)
        return event

    def _finish(self, out: RequestStream, reason: str, event: TokenEvent | None = None,
                touch_scheduler: bool = True) -> None:
        if out.done.is_set():  # already ended (a worker-group failure ends requests from another thread)
            return
        if touch_scheduler:
            self.scheduler.remove(out.request)
        else:
            out.request.status = Status.FINISHED
        self.outputs.finish(out, reason, event)

    def _finish_inflight_step(self) -> None:
        """Process the steps in flight, so nothing is pending on the device (step lock held)."""
        while self._inflight:
            self._process(*self._inflight.popleft())

    @contextlib.contextmanager
    def paused(self):
        """Hold the step lock with no step in flight: the pools, the prefix cache and the device
        cache stay as they are inside (snapshots on disk, warm-up). Blocks other steppers, never
        `submit` / `abort`."""
        with self._lock:
            self._finish_inflight_step()
            yield self

    def request(self, request_id: str) -> Request:
        """A live request (submitted, not yet released): its status, tokens, timings."""
        return self.outputs.stream(request_id).request

    def _pump(self) -> bool:
        """Run a step when no loop thread does (manual mode); whether one ran."""
        if self._loop is not None:
            return False
        self.step()
        return True

    def stream(self, request_id: str, timeout: float | None = None):
        """Yield TokenEvents of one request until its finished event, then release the request.

        The request is claimed at this call (not at the first `next`), so an abort after it still
        reaches this consumer as a finished event. Closing the generator early aborts the request.
        `timeout` bounds each wait (TimeoutError).
        """
        return self.outputs.events(request_id, timeout)

    def astream(self, request_id: str):
        """`stream` for asyncio: waits without blocking the event loop (needs the loop thread)."""
        return self.outputs.aevents(request_id)

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait for a request to finish and return it whole; releases the request."""
        return self.outputs.result(request_id, timeout)

    def release(self, request_id: str) -> None:
        """Forget a finished request (the consumers above do it; idempotent)."""
        self.outputs.release(request_id)

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[Completion]:
        """Offline batch: submit everything (fed as the waiting queue has room), run until all finish,
        results in input order."""
        return generate_all(self, prompts, params)

    def warmup(self, progress: bool = False, interrupted: Callable[[], bool] = lambda: False) -> int:
        """Compile every step shape (engine/warmup.py), then set `ready`; give up on stop() or `interrupted()`."""
        with self.paused():
            try:
                report = self.warmup_report = compile_step_shapes(
                    self.scheduler, self.runner, self.speculative, lambda: self._stopping or interrupted(), progress)
            except Exception as e:
                if is_out_of_memory(e):
                    raise out_of_memory(e, "compiling the step programs (warm-up)", STEP_REMEDY) from e
                raise
            if not report.finished:  # stop() / close() during warm-up (Ctrl-C): gave up
                return report.compiled
            try:
                self.runner.materialize_cache()
            except Exception as e:
                if is_out_of_memory(e):
                    raise out_of_memory(e, "allocating the KV cache", POOL_REMEDY) from e
                raise
        log.info(report.summary())  # before ready: a client that saw /ready 200 may look for it
        self.ready.set()
        return report.compiled

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
        if self.failure is not None:  # its requests were ended by `fail`
            return
        with self._lock:
            try:
                self._finish_inflight_step()
            except Exception:  # noqa: BLE001 - the device step failed; the requests end below anyway
                log.exception("the last in-flight step failed while stopping")
            self.apply_inbox()
            for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._finish(self.outputs.get(req.id), "abort")
            self._stopping = False  # the loop and any warm-up have seen it (they give up the lock first)

    def close(self) -> None:
        """Stop, refuse new requests, and free the device memory (weights and KV cache)."""
        with self._intake:
            self._closed = True
        self.stop()
        self.ready.clear()
        self._masks.shutdown(wait=True)  # the mask thread: nothing is stepping any more
        if self.failure is None or self.group is None:
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

    def _run_loop(self) -> None:
        while True:
            with self._intake:
                while not self._stopping and not self._inbox and not self.scheduler.has_work() and not self._inflight:
                    self._intake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed step must not strand its requests
                if not self._step_failed(e):
                    return
