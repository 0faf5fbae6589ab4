"""The engine's front end: intake that never waits on the device, async streams, release,
stop / close, warm-up coverage, queue limits.

Each check is against something independent: a wall-clock bound on submit measured while a
compile is known to be running, the same requests run with `generate`, the pool's own counts,
jax's list of live arrays, the runner's trace counter.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import threading
import time

import jax
import pytest

from jtp.config.engine_args import EngineArgs
from jtp.core.sampling_params import SamplingParams
from jtp.engine.engine import Engine
from jtp.errors import ContextLengthError, EngineClosedError, QueueFullError

SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_blocks=64)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(demo_dir):
    eng = Engine.from_args(EngineArgs(model=demo_dir, **SMALL))
    yield eng
    eng.close()


def prompt(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_submit_returns_in_milliseconds_while_the_loop_compiles(demo_dir):
    # A fresh engine: its first steps compile new shapes (seconds on this CPU) inside the loop.
    eng = Engine.from_args(EngineArgs(model=demo_dir, **SMALL))
    try:
        eng.start()
        compiles_before = eng.runner.compilations
        first = eng.submit(list(range(1, 60)), greedy(4))  # a 59-token prefill: a shape never compiled
        latencies = []
        deadline = time.monotonic() + 60
        while eng.runner.compilations == compiles_before and time.monotonic() < deadline:
            time.sleep(0.001)  # wait until the loop is tracing/compiling
        rids = []
        for i in range(16):
            t = time.perf_counter()
            rids.append(eng.submit(list(range(1, 10 + i)), greedy(3)))
            latencies.append(time.perf_counter() - t)
        still_compiling_or_running = eng.has_unfinished()
        results = [eng.result(r) for r in [first] + rids]
        assert still_compiling_or_running
        assert all(r.finish_reason == "length" for r in results)
        print(f"\nsubmit latency during compilation: median {statistics.median(latencies) * 1e3:.2f} ms, "
              f"max {max(latencies) * 1e3:.2f} ms; compilations {eng.runner.compilations - compiles_before}")
        assert statistics.median(latencies) < 0.02 and max(latencies) < 0.2, latencies
    finally:
        eng.close()


def test_astream_does_not_block_the_event_loop_and_matches_generate(engine):
    prompts = [prompt(engine, t) for t in ("Hello, world", "The cat sat", "Once upon a time there")]
    expected = [c.token_ids for c in engine.generate(prompts, greedy(12))]
    engine.start()
    try:

        async def main():
            ticks = 0
            stop = asyncio.Event()

            async def ticker():
                nonlocal ticks
                while not stop.is_set():
                    ticks += 1
                    await asyncio.sleep(0.001)

            async def consume(p):
                tokens, finished = [], []
                async for ev in engine.astream(engine.submit(p, greedy(12))):
                    tokens += ev.token_ids
                    finished.append(ev.finished)
                return tokens, finished

            tick_task = asyncio.create_task(ticker())
            t = time.perf_counter()
            outs = await asyncio.gather(*(consume(p) for p in prompts))
            elapsed = time.perf_counter() - t
            stop.set()
            await tick_task
            return outs, ticks, elapsed

        outs, ticks, elapsed = asyncio.run(main())
    finally:
        engine.stop()
    assert [tokens for tokens, _ in outs] == expected
    for _, finished in outs:
        assert finished[-1] and finished.count(True) == 1
    # The event loop kept running while the streams waited: ~1 tick per ms (generously bounded).
    assert ticks > 0.2 * elapsed * 1000, (ticks, elapsed)
    assert not engine.outputs, "finished requests are released after their final event"
    assert engine.pool.num_free_blocks == engine.pool.total_blocks


def test_closing_a_stream_early_aborts_and_frees(engine):
    engine.start()
    try:

        async def main():
            rid = engine.submit(prompt(engine, "Hello"), greedy(100))
            agen = engine.astream(rid)
            got = 0
            async for ev in agen:
                got += len(ev.token_ids)
                if got >= 3:
                    break
            await agen.aclose()  # what a server does when its client disconnects
            return rid

        rid = asyncio.run(main())
        deadline = time.monotonic() + 10
        while engine.pool.num_free_blocks != engine.pool.total_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert engine.pool.num_free_blocks == engine.pool.total_blocks
    assert rid not in engine.outputs
    assert not engine.has_unfinished()


def test_stop_ends_every_stream_with_a_finished_event(engine):
    engine.start()
    rids = [engine.submit(prompt(engine, f"Story {i}:"), greedy(110)) for i in range(12)]  # 8 run, 4 wait
    seen: dict[str, list] = {r: [] for r in rids}

    def consume(rid):
        for ev in engine.stream(rid, timeout=30):
            seen[rid].append(ev)

    threads = [threading.Thread(target=consume, args=(r,)) for r in rids]
    for t in threads:
        t.start()
    while not any(seen[r] for r in rids):
        time.sleep(0.005)
    engine.stop()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "a consumer is still blocked after stop()"
    for rid in rids:
        assert seen[rid] and seen[rid][-1].finished
        assert seen[rid][-1].finish_reason in ("abort", "length")
        assert sum(ev.finished for ev in seen[rid]) == 1
    assert sum(seen[r][-1].finish_reason == "abort" for r in rids) >= 4
    assert engine.pool.num_free_blocks == engine.pool.total_blocks
    assert not engine.has_unfinished()


def test_queue_limit_and_context_errors(demo_dir):
    eng = Engine.from_args(EngineArgs(model=demo_dir, **SMALL, max_waiting_requests=3))
    try:
        ids = [eng.submit([1, 2, 3], greedy(2)) for _ in range(3)]  # no loop: they wait in the inbox
        assert eng.stats().num_waiting == 3
        with pytest.raises(QueueFullError, match="3 requests are already waiting"):
            eng.submit([1, 2, 3], greedy(2))
        with pytest.raises(ContextLengthError, match="exceeds the model's context length"):
            eng.submit([1] * 100, greedy(50))
        assert [c.finish_reason for c in (eng.result(r) for r in ids)] == ["length"] * 3
        eng.submit([1, 2, 3], greedy(2))  # room again
    finally:
        eng.close()
    with pytest.raises(EngineClosedError):
        eng.submit([1, 2, 3], greedy(2))


@pytest.mark.parametrize("loop", [False, True])
def test_generate_feeds_more_prompts_than_the_queue_holds(demo_dir, engine, loop):
    """An offline batch larger than max_waiting_requests (a server's backpressure) is served whole,
    each prompt as it runs alone, instead of failing with QueueFullError on the prompt past it."""
    prompts = [[5 + i, 6, 7 + i % 3] for i in range(10)]
    eng = Engine.from_args(EngineArgs(model=demo_dir, **{**SMALL, "max_num_seqs": 2}, max_waiting_requests=3))
    try:
        if loop:
            eng.start()
        results = eng.generate(prompts, greedy(3))
        assert [c.token_ids for c in results] == [engine.generate([p], greedy(3))[0].token_ids for p in prompts]
        assert not eng.has_unfinished() and len(eng.outputs) == 0
    finally:
        eng.close()


def test_close_frees_device_memory_and_a_second_engine_starts(demo_dir):
    def live_bytes():
        return sum(a.nbytes for a in jax.live_arrays())

    gc.collect()  # earlier tests' unreachable arrays, which a collection mid-test would free
    baseline = live_bytes()
    eng = Engine.from_args(EngineArgs(model=demo_dir, **SMALL))
    (first,) = eng.generate([[5, 6, 7]], greedy(6))
    assert live_bytes() > baseline
    eng.close()
    assert live_bytes() <= baseline, "close() left weights or KV cache alive"
    with Engine.from_args(EngineArgs(model=demo_dir, **SMALL)) as again:
        assert again.generate([[5, 6, 7]], greedy(6))[0].token_ids == first.token_ids
    assert live_bytes() <= baseline


def test_warmup_compiles_every_shape_the_workload_hits(demo_dir):
    # Tiny buckets: tokens 16/32, rows 8, blocks per row 1/4/8 (max_model_len 128, block 16).
    args = EngineArgs(model=str(demo_dir), max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, num_blocks=64)
    with Engine.from_args(args) as eng:
        assert not eng.ready.is_set()
        compiled = eng.warmup()
        assert eng.ready.is_set()
        assert compiled == eng.runner.compilations > 0
        # A varied workload: prompts of 1..100 tokens (chunked prefill, mixed steps, decodes at every
        # context up to 128), greedy and sampled rows, with and without top-p.
        prompts = [list(range(1, 2 + (i * 37) % 100)) for i in range(20)]
        params = [
            SamplingParams(max_tokens=min(20, 127 - len(p)), temperature=[0.0, 0.8, 1.0][i % 3],
                           top_p=[1.0, 1.0, 0.9][i % 3], seed=i, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        results = eng.generate(prompts, params)
        assert all(r.finish_reason == "length" for r in results)
        assert eng.runner.compilations == compiled, "the workload hit a shape warm-up did not compile"
