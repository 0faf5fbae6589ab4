"""Engine: the public face of continuous batching.

    engine = Engine("checkpoints/demo-qwen3")
    rid = engine.submit(prompt_ids, SamplingParams(max_tokens=32))
    for event in engine.stream(rid): ...          # tokens as they are sampled
    engine.abort(rid)                             # frees the request's blocks at once
    results = engine.generate(list_of_prompt_ids, params)   # offline batches

The engine can be driven two ways: call `step()` yourself (tests, offline batches), or
`start()` a background loop thread (servers); `stream()` and `generate()` work with both.
Every request ends with exactly one finished event: finish_reason "stop", "length",
"abort" or "error".
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
from pathlib import Path

import jax

from jtp.page_pool import PagePool
from jtp.runner import ModelRunner
from jtp.sampling import SamplingParams, pack_penalty_tokens, pack_sampling, request_seed
from jtp.scheduler import Request, Scheduler, ScheduledRow, Status
from jtp.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 256 << 20  # without device memory stats (CPU), size the pool to this


class RequestError(ValueError):
    """A request that can never be served (bad parameters, too long, larger than the pool)."""


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
        self.events: queue.Queue[TokenEvent] = queue.Queue()
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] = []
        self.done = threading.Event()
        self.error: str | None = None
        self.stopped_by_string = False
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

    def take_text(self, finished: bool) -> str:
        if finished and self.detok is not None and not self.stopped_by_string:
            self.text += self.detok.flush()
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta


class Engine:
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
    ):
        self.runner = ModelRunner(model_dir, tensor_parallel_size, dtype, block_size=block_size, max_seqs=max_num_seqs)
        cfg = self.cfg = self.runner.cfg
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        num_blocks = num_blocks or self._blocks_for_memory(memory_utilization, max_num_seqs)
        self.runner.allocate_cache(num_blocks)
        self.pool = PagePool(num_blocks, block_size)
        log.info(
            "KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB per device)",
            num_blocks, block_size, num_blocks * block_size, num_blocks * self.runner.bytes_per_block() / 2**20,
        )
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, self.max_model_len)
        if tokenizer is True:
            tokenizer = Tokenizer.from_dir(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None
        self.tokenizer = tokenizer or None
        self.eos_ids = frozenset(self.tokenizer.eos_token_ids if self.tokenizer else cfg.eos_token_ids)
        self._outputs: dict[str, _Output] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._wakeup = threading.Condition(self._lock)
        self._inflight: tuple[list[ScheduledRow], object] | None = None  # dispatched, not yet processed
        self._loop: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ sizing

    def _blocks_for_memory(self, utilization: float, max_num_seqs: int) -> int:
        per_block = self.runner.bytes_per_block()
        stats = self.runner.memory_stats()
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] * utilization - stats.get("bytes_in_use", 0)
            blocks = int(free // per_block)
            log.info("KV pool sized from device memory: %.1f GiB free x %.2f", free / 2**30, utilization)
        else:
            want = -(-max_num_seqs * self.max_model_len // self.runner.block_size)
            blocks = min(want, CPU_KV_BUDGET_BYTES // per_block)
        if blocks < 1:
            raise RuntimeError(f"no device memory left for the KV cache ({per_block} bytes per block)")
        return blocks

    # ------------------------------------------------------------------ requests

    def submit(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        prompt_ids = [int(t) for t in prompt_ids]
        self._validate(prompt_ids, params)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        with self._lock:
            rid = request_id
            while rid is None or (request_id is None and rid in self._outputs):
                rid = f"req-{next(self._ids)}"  # never collides with a caller-chosen id
            if rid in self._outputs:
                raise RequestError(f"request id {rid!r} is already in use")
            req = Request(rid, prompt_ids, params, request_seed(params), frozenset(stop_ids))
            self._outputs[rid] = _Output(req, self.tokenizer)
            self.scheduler.add(req)
            self._wakeup.notify_all()
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
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"the model's context length ({self.max_model_len})"
            )
        if not self.pool.can_ever_fit(total):
            raise RequestError(
                f"prompt + max_tokens = {total} tokens needs {self.pool.blocks_needed(total)} KV blocks but the "
                f"whole pool has {self.pool.total_blocks}; lower max_tokens or give the engine more blocks"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; False if it already finished or is unknown."""
        with self._lock:
            out = self._outputs.get(request_id)
            if out is None or out.request.status is Status.FINISHED:
                return False
            self._finish(out, "abort")
            return True

    # ------------------------------------------------------------------ stepping

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[TokenEvent]:
        """Dispatch the next step, then process the previous one's tokens while it runs.

        Overlapping keeps the device busy: the host schedules and builds step N+1 (whose decode
        rows feed step N's sampled tokens straight from device memory) before it waits for step
        N's results. A stop found in step N's tokens therefore costs one discarded token of
        compute. Penalties need the exact token history, so batches that use them run in lockstep.
        Returns the events of the step whose results were processed.
        """
        with self._lock:
            previous, self._inflight = self._inflight, None
            events = []
            if previous is not None and any(r.params.has_penalties for r in self.scheduler.running):
                events, previous = self._process(*previous), None
            rows = self.scheduler.schedule()
            if rows:
                self._inflight = (rows, self._dispatch(rows))
            if previous is not None:
                events = self._process(*previous)
            return events

    def _dispatch(self, rows: list[ScheduledRow]):
        plan = self.scheduler.build_plan(rows)
        B = len(plan.context_lens)
        sampling_rows = [r.request.params if r.samples else None for r in rows]
        seeds = [r.request.seed for r in rows]
        steps = [r.request.num_generated for r in rows]
        sampling = pack_sampling(sampling_rows, B, seeds, steps)
        penalty = None
        if sampling.static_flags().needs_penalties:
            reqs = [r.request if r.samples else None for r in rows]
            penalty = pack_penalty_tokens(
                [q.prompt_ids if q else None for q in reqs], [q.output_ids if q else None for q in reqs], B
            )
        result = self.runner.dispatch(plan, sampling, penalty)
        for row in rows:
            row.request.num_computed += row.num_tokens
            row.request.pending += row.samples
        return result

    def _process(self, rows: list[ScheduledRow], result) -> list[TokenEvent]:
        result = jax.device_get(result)  # waits for the device
        events = []
        for b, row in enumerate(rows):
            req = row.request
            if row.samples:
                req.pending -= 1
                if req.status is Status.RUNNING:  # else finished or aborted meanwhile: discard
                    events.append(self._append(req, int(result.tokens[b]), result, b))
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
            out.events.put(event)
        return event

    def _finish(self, out: _Output, reason: str, event: TokenEvent | None = None) -> None:
        req = out.request
        self.scheduler.remove(req)
        req.finish_reason = reason
        event = event or TokenEvent(req.id, [], "")
        event.text += out.take_text(True)
        event.finished, event.finish_reason = True, reason
        out.events.put(event)
        out.done.set()

    # ------------------------------------------------------------------ consuming

    def stream(self, request_id: str, timeout: float | None = None):
        """Yield TokenEvents of one request until its finished event."""
        out = self._outputs[request_id]
        while True:
            if self._loop is None:
                while out.events.empty():
                    self.step()
            event = out.events.get(timeout=timeout)
            yield event
            if event.finished:
                return

    def result(self, request_id: str) -> Completion:
        out = self._outputs[request_id]
        if self._loop is None:
            while not out.done.is_set():
                self.step()
        out.done.wait()
        req = out.request
        return Completion(
            req.id, req.prompt_ids, list(req.output_ids), out.text, req.finish_reason,
            out.logprobs or None, out.top_logprobs or None, out.error,
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request's outputs (servers call this after the last event)."""
        with self._lock:
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
        results = [self.result(rid) for rid in ids]
        for rid in ids:
            self.release(rid)
        return results

    # ------------------------------------------------------------------ background loop

    def start(self) -> None:
        """Run steps on a background thread until `stop()` (for servers)."""
        if self._loop is not None:
            return
        self._stopping = False
        self._loop = threading.Thread(target=self._run_loop, name="jtp-engine", daemon=True)
        self._loop.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wakeup.notify_all()
        if self._loop is not None:
            self._loop.join()
            self._loop = None

    def _run_loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not self.scheduler.has_work() and self._inflight is None:
                    self._wakeup.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a failed step must not strand its requests
                log.exception("engine step failed; failing the running requests")
                with self._lock:
                    for req in list(self.scheduler.running):
                        out = self._outputs[req.id]
                        out.error = f"{type(e).__name__}: {e}"
                        self._finish(out, "error", TokenEvent(req.id, [], "", error=out.error))

