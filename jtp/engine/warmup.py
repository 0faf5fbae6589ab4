"""Warm-up: compile the step for every shape the scheduler can produce, before the first request.

Each (tokens, rows, tokens-per-row, blocks-per-row) bucket runs as an all-padding step (nothing is
written to the KV cache or the state slots) with the two common sampling variants (plain, and
top-k/top-p/min-p); penalties and logprobs compile on first use. A test checks that serving then
compiles nothing more.
"""

from __future__ import annotations

from typing import Callable

import jax

from jtp.config.speculative import SpeculativeConfig
from jtp.core.sampling_params import SamplingParams, pack_sampling
from jtp.core.scheduler import Scheduler
from jtp.core.step_input import StepInput
from jtp.worker.runner import ModelRunner

VARIANTS = (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9))


def compile_step_shapes(
    scheduler: Scheduler, runner: ModelRunner, speculative: SpeculativeConfig | None,
    should_stop: Callable[[], bool], progress: bool = False,
) -> int:
    """Run every bucket once (the engine paused); how many step variants were compiled (0 when
    all came from the persistent compilation cache or an earlier warm-up). Gives up at once when
    `should_stop()` (stop() or close() during warm-up, Ctrl-C)."""
    from tqdm import tqdm

    shapes = scheduler.buckets.shapes()
    before = runner.compilations
    bar = tqdm(total=len(shapes) * len(VARIANTS), desc="warm-up: compiling step shapes", unit="shape",
               disable=not progress, mininterval=1.0)
    with bar:
        for shape in shapes:
            if should_stop():
                break
            _, B, max_row_len, _ = shape
            # Rows of several tokens may be speculating rows: their verify steps sample [1 + k, B].
            verify = (False, True) if speculative is not None and max_row_len > 1 else (False,)
            plans = [scheduler.padding_plan(*shape, verify=v) for v in verify]
            for params in VARIANTS:
                sampling = pack_sampling([params] * B, B, [0] * B, [0] * B)
                for plan in plans:
                    jax.block_until_ready(runner.dispatch(StepInput(plan, sampling)))
                bar.update()
    return runner.compilations - before
