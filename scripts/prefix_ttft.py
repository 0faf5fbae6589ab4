#!/usr/bin/env python
"""Where a cached follow-up turn's time to first token goes, at the engine (no HTTP).

    python scripts/prefix_ttft.py --model DIR [--context 7500] [--follow-up 64] [--json-out F]

For each of a few conversations: turn 1 is a `--context`-token prompt (nothing cached), turn 2
resends it with the answer and `--follow-up` new tokens. Prints per turn the engine-level TTFT
(submit -> first token, the engine stepped by this thread) with prefix caching on and off, and
the host-side costs the server adds for such a prompt: chat-template rendering and tokenization
of the text, and the prefix-cache keys (hashing the prompt's blocks).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jtp.config.engine_args import EngineArgs  # noqa: E402
from jtp.core.block_hash import block_keys, root_key  # noqa: E402
from jtp.core.sampling_params import SamplingParams  # noqa: E402
from jtp.engine.engine import Engine  # noqa: E402


def ttft(engine: Engine, prompt: list[int], n: int) -> tuple[float, list[int], int]:
    """Seconds from submit to the first token event; the whole answer; cached prompt tokens."""
    t0 = time.perf_counter()
    rid = engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    first = None
    events = []
    for event in engine.stream(rid):
        if first is None and event.token_ids:
            first = time.perf_counter() - t0
        events.append(event)
    return first, [t for e in events for t in e.token_ids], events[-1].cached_tokens


def step_breakdown(engine: Engine, cached_prompt: list[int], n: int, vocab: int) -> dict:
    """Host and device time of the step that prefills a cached follow-up's tail, and of the same
    plan dispatched again (device time, steady state), next to a fresh prompt of the tail's length."""
    import jax

    out = {}
    for name, prompt in (("cached_follow_up", cached_prompt), ("fresh_short", cached_prompt[-80:])):
        engine.reset_prefix_cache() if name == "fresh_short" else None
        rid = engine.submit(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        sent = []
        inner = engine.runner.dispatch
        engine.runner.dispatch = lambda step, sent=sent, inner=inner: sent.append(step) or inner(step)  # keep it
        t0 = time.perf_counter()
        engine.step()  # schedules and dispatches the prompt's row (the request was queued)
        t1 = time.perf_counter()
        engine.runner.dispatch = inner
        rows = engine.inflight_rows
        jax.block_until_ready(engine.runner.sampled)  # the step just dispatched
        t2 = time.perf_counter()
        packed = sent[-1]
        jax.block_until_ready(engine.runner.dispatch(packed))
        t3 = time.perf_counter()
        reps = 10
        for _ in range(reps):
            r = engine.runner.dispatch(packed)
        jax.block_until_ready(r)
        t4 = time.perf_counter()
        out[name] = {"host_schedule_dispatch": 1e3 * (t1 - t0), "first_step_wait": 1e3 * (t2 - t1),
                     "redispatch_once": 1e3 * (t3 - t2), "device_steady": 1e3 * (t4 - t3) / reps,
                     "tokens": int(rows[0].num_tokens), "context": int(rows[0].start + rows[0].num_tokens)}
        engine.abort(rid)
        engine.release(rid)
        while engine.has_unfinished():
            engine.step()
    return out


def profile_host(args) -> None:
    """Where the host time of a step that admits a fresh prompt goes (cProfile, top functions)."""
    import cProfile
    import pstats

    import jax

    engine = Engine.from_args(EngineArgs(
        model=args.model, dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len))
    rng = random.Random(0)
    profiler = cProfile.Profile()
    for i in range(6):
        rid = engine.submit([rng.randrange(1000) for _ in range(80)], SamplingParams(max_tokens=1, temperature=0.0))
        if i:
            profiler.enable()
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        if i:
            profiler.disable()
        jax.block_until_ready(engine.runner.sampled)
        print(f"step {i}: host {1e3 * (t1 - t0):.2f} ms, then device {1e3 * (time.perf_counter() - t1):.2f} ms")
        engine.result(rid)
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--context", type=int, default=7500)
    ap.add_argument("--follow-up", type=int, default=64)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--json-out")
    ap.add_argument("--profile-host", action="store_true", help="cProfile engine.step() on fresh prompts, then exit")
    args = ap.parse_args()
    if args.profile_host:
        return profile_host(args)

    results = {}
    for cache in (True, False):
        engine = Engine.from_args(EngineArgs(
            model=args.model, dtype="bfloat16", max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
            gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=cache))
        vocab = engine.cfg.vocab_size
        rows = []
        for conv in range(args.conversations + 1):  # the first is an untimed warm-up (compiles)
            rng = random.Random(conv)
            prompt = [rng.randrange(vocab) for _ in range(args.context)]
            t1, answer, _ = ttft(engine, prompt, args.answer)
            follow = prompt + answer + [rng.randrange(vocab) for _ in range(args.follow_up)]
            t2, _, cached = ttft(engine, follow, args.answer)
            if conv:
                rows.append((t1, t2, cached, len(follow)))
        if cache:
            results["step_ms"] = step_breakdown(engine, follow, args.answer, vocab)
        results["on" if cache else "off"] = {
            "turn1_ms": 1e3 * statistics.mean(r[0] for r in rows),
            "turn2_ms": 1e3 * statistics.mean(r[1] for r in rows),
            "turn2_cached_tokens": rows[-1][2],
            "turn2_prompt_tokens": rows[-1][3],
        }
        # Host costs of such a prompt on the server path.
        if cache and engine.tokenizer is not None:
            words = " ".join(f"t{i}" for i in follow)
            t0 = time.perf_counter()
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": words}], add_generation_prompt=True)
            t_render = time.perf_counter() - t0
            t0 = time.perf_counter()
            ids = engine.tokenizer.encode(text)
            t_encode = time.perf_counter() - t0
            t0 = time.perf_counter()
            block_keys(root_key("x"), ids, engine.pool.block_size)
            t_hash = time.perf_counter() - t0
            results["host_ms"] = {"chat_template": 1e3 * t_render, "tokenize": 1e3 * t_encode,
                                  "block_keys": 1e3 * t_hash, "tokens": len(ids)}
        engine.close()
    print(json.dumps(results, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
