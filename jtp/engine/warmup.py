"""Warm-up: compile the step for every shape the scheduler can produce, before the first request.

Each (tokens, rows, tokens-per-row) bucket is one all-padding step (nothing is
written to the KV cache or the state slots) with the two common sampling variants (plain, and
top-k/top-p/min-p); where the runner samples in a program of its own (one forward program per
shape, one small sampling program per rows bucket and variant), also the logprobs variant and,
per rows bucket, the penalty variant at each history length. A test checks that serving then
compiles nothing more.

Ahead of time where the runner allows it (one process): this thread traces and lowers each step
(Python, under the GIL) while a pool of daemon threads runs XLA on the lowered programs (XLA
releases the GIL) and the runner keeps the executables, the largest shapes first (so the longest
compiles do not start last). Steps whose lowered programs are the same (many buckets differ only
in a bound the program does not use) share one compile. Daemon
threads, so a stop during warm-up never waits for a compile to end. A worker group instead runs
every padding step in order, as its followers must see the same calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import queue
import threading
import time
from typing import Callable

import jax
import numpy as np

from jtp.config.speculative import SpeculativeConfig
from jtp.core.sampling_params import SamplingParams, pack_penalty_tokens, pack_sampling, penalty_lengths
from jtp.core.scheduler import Scheduler
from jtp.core.step_input import PROMPT_CHUNK, StepInput, mask_words
from jtp.engine.memory import compile_threads_for_memory
from jtp.errors import ConfigError, is_out_of_memory
from jtp.worker.compile_cache import cache_hits, phase_seconds
from jtp.worker.executable_store import StoredProgram
from jtp.worker.runner import ModelRunner

log = logging.getLogger(__name__)

VARIANTS = (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9))
WITH_LOGPROBS = SamplingParams(temperature=1.0, logprobs=1)  # truncation on: one variant (compiled_flags)
PENALISED = SamplingParams(temperature=1.0, repetition_penalty=1.1)  # penalties compile as one variant
WORKERS_ENV = "JTP_COMPILE_WORKERS"  # compile threads (default: the CPU cores, at most 8; 1: no pool)


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    shapes: int  # buckets
    variants: int  # padding steps that cover them (sampling variants, verify steps)
    compiled: int  # programs traced by the warm-up (0 when an earlier warm-up had them)
    programs: int  # distinct XLA programs among them, compiled or loaded
    cache_hits: int  # of those, how many the persistent compilation cache answered
    seconds: float
    finished: bool  # False: stopped before the end
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # compile_cache.phase_seconds()' growth
    stored: int = 0  # of the programs, how many were loaded compiled from the executable store (not traced)
    threads: int = 1  # compile threads

    def summary(self) -> str:
        phases = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())
        return (f"warm-up: {self.shapes} step shapes, {self.variants} variants, {self.compiled} traced, "
                f"{self.programs} XLA programs, {self.cache_hits} of them from the persistent compilation cache, "
                f"{self.stored} loaded compiled, on {self.threads} compile threads, in {self.seconds:.1f} s"
                + (f" (summed over threads: {phases})" if phases else ""))


def compile_workers() -> int:
    """Compile threads: $JTP_COMPILE_WORKERS, else the cores this process may use (at most 8)."""
    value = os.environ.get(WORKERS_ENV, "")
    if value:
        try:
            workers = int(value)
        except ValueError:
            workers = 0
        if workers < 1:
            raise ConfigError(f"${WORKERS_ENV}={value!r}: must be a whole number of threads, at least 1")
        return workers
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def warmup_steps(scheduler: Scheduler, speculative: SpeculativeConfig | None,
                 samples_separately: Callable[[StepInput], bool] = lambda step: False,
                 mask_words: int = 0) -> list[StepInput]:
    """The padding steps that cover every program the scheduler can pick: per shape the two
    variants; where the runner samples in a program of its own (`samples_separately`), the
    logprobs variant too, once the prompt-logprobs program, and per rows bucket the two token-mask
    variants (`mask_words` > 0: structured outputs, min_tokens; verify steps too, for min_tokens) and
    the penalty variant at each history length, which carries the mask and the logit biases too
    (small programs: the forward program is the shape's)."""
    steps, rows_seen, scored = [], set(), False
    for shape in scheduler.buckets.shapes():
        _, B, max_row_len = shape
        # Rows of several tokens may be speculating rows: their verify steps sample [1 + k, B].
        for verify in (False, True) if speculative is not None and max_row_len > 1 else (False,):
            plan = scheduler.padding_plan(*shape, verify=verify)
            variants = [StepInput(plan, _sampling(params, B)) for params in VARIANTS]
            if samples_separately(variants[0]):
                variants.append(StepInput(plan, _sampling(WITH_LOGPROBS, B)))
                if max_row_len > 1 and not scored:  # the prompt-logprobs program: one shape for every step
                    scored = True
                    variants.append(StepInput(plan, variants[0].sampling,
                                              prompt_targets=np.zeros((2, PROMPT_CHUNK), np.int32)))
                if (B, verify) not in rows_seen:
                    rows_seen.add((B, verify))
                    mask = np.full((B, mask_words), -1, np.int32) if mask_words else None
                    if mask is not None:
                        variants += [StepInput(plan, _sampling(params, B), token_mask=mask) for params in VARIANTS]
                    variants += [StepInput(plan, _sampling(PENALISED, B), pack_penalty_tokens([[]] * B, [[]] * B, B,
                                                                                               length=length),
                                           token_mask=mask)
                                 for length in penalty_lengths(scheduler.max_model_len)]
            steps += variants
    return steps


def _sampling(params: SamplingParams, B: int):
    return pack_sampling([params] * B, B, [0] * B, [0] * B)


def compile_step_shapes(
    scheduler: Scheduler, runner: ModelRunner, speculative: SpeculativeConfig | None,
    should_stop: Callable[[], bool], progress: bool = False, workers: int | None = None,
) -> WarmupReport:
    """Compile (or load from the persistent cache) every step program, the engine paused. Gives up
    at once when `should_stop()` (stop() or close() during warm-up, Ctrl-C)."""
    from tqdm import tqdm

    start, hits, before, phases = time.perf_counter(), cache_hits(), runner.compilations, phase_seconds()
    stored = 0
    steps = warmup_steps(scheduler, speculative, runner.samples_separately, mask_words(runner.cfg.vocab_size))
    workers = compile_threads_for_memory(runner, compile_workers() if workers is None else workers)
    bar = tqdm(total=len(steps), desc="warm-up: compiling step shapes", unit="shape", disable=not progress,
               mininterval=1.0)
    with bar:
        if runner.compiles_ahead and workers > 1:
            bar.total, bar.unit = 0, "program"  # counted as the steps are lowered

            def found(n: int) -> None:
                bar.total += n
                bar.refresh()

            try:
                finished, programs, stored = _compile_ahead(runner, steps, workers, should_stop, bar.update, found)
            except Exception as e:  # noqa: BLE001 - out of memory: again on this thread (the rest is installed)
                if not is_out_of_memory(e):
                    raise
                log.warning("warm-up ran out of device memory compiling on %d threads; compiling the rest on one",
                            workers)
                before_retry = runner.compilations
                finished = _run_in_order(runner, steps, should_stop, bar.update)
                programs = runner.compilations - before_retry
        else:
            finished = _run_in_order(runner, steps, should_stop, bar.update)
            programs = runner.compilations - before  # each trace is one compile request
    if finished and getattr(runner, "warm_images", None):  # a vision tower: its encoder's patch buckets too
        runner.warm_images()
    return WarmupReport(len(scheduler.buckets.shapes()), len(steps), runner.compilations - before, programs,
                        cache_hits() - hits, time.perf_counter() - start, finished,
                        {name: seconds - phases[name] for name, seconds in phase_seconds().items()}, stored, workers)


def _size(step: StepInput) -> tuple[int, ...]:
    """A step's shape, largest dimension first: a proxy for how long XLA takes over its program."""
    plan = step.plan
    return len(plan.token_ids), len(plan.context_lens), plan.max_row_len or len(plan.token_ids)


def _program_digest(lowered) -> bytes:
    """The lowered program's identity: its MLIR bytecode, which is several times cheaper to write
    than its text (this runs on the thread that feeds the compile pool, under the GIL); a stored
    program's, its file's."""
    if isinstance(lowered, StoredProgram):
        return lowered.digest
    buffer = io.BytesIO()
    lowered.compiler_ir("stablehlo").operation.write_bytecode(buffer)
    return hashlib.sha256(buffer.getbuffer()).digest()


def _run_in_order(runner: ModelRunner, steps: list[StepInput], should_stop, done: Callable[[], None]) -> bool:
    for step in steps:
        if should_stop():
            return False
        jax.block_until_ready(runner.dispatch(step))
        done()
    return True


def _compile_ahead(runner: ModelRunner, steps: list[StepInput], workers: int, should_stop,
                   done: Callable[[], None], found: Callable[[int], None]) -> tuple[bool, int, int]:
    """(finished, distinct programs, of them loaded from the runner's executable store). `found(n)`: n more
    programs to compile; `done()`: one is installed."""
    todo: queue.Queue = queue.Queue(maxsize=2 * workers)  # bounded: lowered programs hold their HLO
    results: queue.Queue = queue.Queue()

    def compile_loop() -> None:
        while (job := todo.get()) is not None:
            program, key, lowered = job
            t = time.perf_counter()
            try:
                results.put((program, runner.compile_program(key, lowered), time.perf_counter() - t))
            except BaseException as e:  # noqa: BLE001 - re-raised on the warm-up thread
                results.put((program, e, 0.0))

    threads = [threading.Thread(target=compile_loop, name=f"jtp-compile-{i}", daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    waiting: dict[bytes, list] = {}  # program -> the step keys that wait for its compile
    executables: dict[bytes, jax.stages.Compiled] = {}
    lowered_keys: set = set()  # the runner's programs lowered so far (two steps may share one)
    stored: set = set()  # the programs loaded from the store

    def collect(block: bool) -> None:
        while waiting:
            try:
                program, compiled, seconds = results.get(timeout=0.1) if block else results.get_nowait()
            except queue.Empty:
                if not block or should_stop():
                    return
                continue
            if isinstance(compiled, BaseException):
                raise compiled
            executables[program] = compiled
            for i, key in enumerate(waiting.pop(program)):
                runner.install(key, compiled, seconds if i == 0 else 0.0)
                if i > 0 and program not in stored:  # (the first key's was stored as it compiled)
                    runner.store_program(key, compiled)
                done()

    try:
        for step in sorted(steps, key=_size, reverse=True):  # the longest compiles start first
            if should_stop():
                return False, len(executables), len(stored)
            for key, program_ir in runner.lower(step, skip=lowered_keys):
                lowered_keys.add(key)
                found(1)
                # (the same program on other devices, e.g. two pipeline stages', is another executable)
                program = _program_digest(program_ir) + repr(runner.placement(key)).encode()
                if program in executables:
                    runner.install(key, executables[program], 0.0)
                    if program not in stored:
                        runner.store_program(key, executables[program])
                    done()
                elif program in waiting:
                    waiting[program].append(key)
                else:
                    waiting[program] = [key]
                    if isinstance(program_ir, StoredProgram):
                        stored.add(program)
                    while True:  # hand it over, installing what has finished meanwhile
                        collect(block=False)
                        try:
                            todo.put((program, key, program_ir), timeout=0.1)
                            break
                        except queue.Full:
                            if should_stop():
                                return False, len(executables), len(stored)
        collect(block=True)
        return not waiting, len(executables), len(stored)
    finally:
        with contextlib.suppress(queue.Empty):
            while True:  # drop the jobs no thread has taken yet
                todo.get_nowait()
        for _ in threads:  # idle threads end now, busy ones after their compile (daemons: never waited for)
            todo.put(None)
