"""A decode step's cost follows the batch, not the KV pool: the engine's real decode program on the
demo checkpoint, with a small pool and one 64 times larger, in one process."""

import time

import pytest

from jtp import Engine, EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.core.step_input import StepInput
from jtp.engine.warmup import VARIANTS, _sampling

SMALL, LARGE = 256, 16384  # KV blocks: 4 MiB and 256 MiB of pages on the demo checkpoint
STEPS = 24


@pytest.fixture(scope="module")
def engines():
    built = {n: Engine.from_args(EngineArgs(num_blocks=n, max_num_seqs=4, max_num_batched_tokens=64, warmup=False))
             for n in (SMALL, LARGE)}
    yield built
    for engine in built.values():
        engine.close()


def decode_seconds(engine: Engine) -> float:
    """Seconds per decode step of one greedy request (its prefill and first steps not counted)."""
    rid = engine.submit([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=STEPS + 8, ignore_eos=True))
    for _ in range(6):
        engine.step()
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.step()
    seconds = (time.perf_counter() - start) / STEPS
    while engine.has_unfinished():
        engine.step()
    engine.release(rid)
    return seconds


def test_decode_step_time_does_not_grow_with_the_pool(engines):
    decode_seconds(engines[SMALL]), decode_seconds(engines[LARGE])  # compiles both programs
    # Interleaved, best of five: other tests' processes share the cores.
    small = min(decode_seconds(engines[SMALL]) for _ in range(5))
    large = min(decode_seconds(engines[LARGE]) for _ in range(5))
    # Before the reference attention carried the pages through its loop, every layer copied the
    # whole pool each step: 64x the pool was ~60x the step.
    assert large < 2.0 * small, f"decode step {large * 1e3:.2f} ms at {LARGE} blocks vs {small * 1e3:.2f} ms at {SMALL}"


def test_no_step_program_copies_a_page_array(engines):
    """The compiled forward program of every step shape (decode and prefill) holds no copy of a
    page array: the pool is updated in place."""
    engine = engines[LARGE]
    pages = engine.runner.cache[0].k
    shapes = {"[" + ",".join(map(str, shape)) + "]"
              for shape in (pages.shape, (pages.shape[0] * pages.shape[1], *pages.shape[2:]))}
    for T, B, L in engine.scheduler.buckets.shapes():
        step = StepInput(engine.scheduler.padding_plan(T, B, L), _sampling(VARIANTS[0], B))
        texts = [lowered.compile().as_text() for _, lowered in engine.runner.lower(step, again=True)]
        forward = [t for t in texts if any(shape in t for shape in shapes)]
        assert forward, f"no program of step {(T, B, L)} reads the pages"
        copies = [line.strip()[:160] for t in forward for line in t.splitlines()
                  if " copy(" in line and any(shape in line.split(" copy(")[0] for shape in shapes)]
        assert not copies, (T, B, L, copies)
