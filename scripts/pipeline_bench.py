#!/usr/bin/env python
"""Pipeline and data parallelism on forced CPU devices: decode throughput and each stage's bubble
against the number of concurrent requests, next to one engine on one device.

    python scripts/make_random_checkpoint.py --preset qwen3-small --out /tmp/qwen3-small --config-only
    python scripts/pipeline_bench.py --model /tmp/qwen3-small --load-format dummy

Configurations: one engine (tp=1), two pipeline stages (--pipeline-parallel-size 2, tp=1 each) and
two data-parallel replicas (--data-parallel-size 2). For each number of concurrent requests, a
greedy batch (prompts of --prompt-len random tokens, --max-tokens each) runs once untimed
(compilation) and once timed. A stage's bubble is the share of the pipeline's active time it sat
idle, from the runner's StageClock (what GET /stats reports). Engines run their loop threads, as
`jtp serve` does. The engine keeps one step of
disjoint requests per stage in flight, so a stage idles when there are fewer request groups than
stages (1 request: half the time at 2 stages). CPU caveat: the forced devices share the host's
cores (2 on CI machines), so stages and replicas compete for them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--dtype", default="float32", help="float32: XLA's CPU dots are far slower in bfloat16")
    args = p.parse_args(argv)
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import jax
    import numpy as np

    jax.config.update("jax_platforms", "cpu")
    from jtp.config.engine_args import EngineArgs
    from jtp.core.sampling_params import SamplingParams
    from jtp.engine.data_parallel import build_engine

    most = max(args.concurrency)
    common = dict(model=args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=most, max_num_batched_tokens=max(
        64, most * args.prompt_len), block_size=16, num_blocks=most * (-(-(args.prompt_len + args.max_tokens) // 16) + 1) + 8,
        max_model_len=args.prompt_len + args.max_tokens + 16, warmup=False, skip_tokenizer_init=True,
        enable_prefix_caching=False)
    configs = {"one engine": {}, "pp=2": dict(pipeline_parallel_size=2), "dp=2": dict(data_parallel_size=2)}
    rng = np.random.default_rng(0)
    rows, base = [], {}
    print(f"host: {os.cpu_count()} cores, {len(jax.devices())} forced CPU devices; model {args.model}", flush=True)
    for name, extra in configs.items():
        with build_engine(EngineArgs(**common, **extra)) as engine:
            engine.start()  # as a server runs it: each replica's loop on its own thread
            vocab = engine.cfg.vocab_size
            runner = getattr(engine, "runner", None)
            clock = getattr(runner, "clock", None)
            for c in args.concurrency:
                prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(c)]
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
                engine.generate(prompts, params)  # compile this batch's shapes
                before = [clock.stats(s) for s in range(2)] if clock else None
                start = time.perf_counter()
                engine.generate(prompts, params)
                seconds = time.perf_counter() - start
                tok_s = c * args.max_tokens / seconds
                base.setdefault(c, tok_s) if name == "one engine" else None
                bubbles = "-"
                if clock:
                    after = [clock.stats(s) for s in range(2)]
                    _settle(clock, after)
                    after = [clock.stats(s) for s in range(2)]
                    active = after[-1]["active_seconds"] - before[-1]["active_seconds"]
                    bubbles = " / ".join(f"{1 - (a['busy_seconds'] - b['busy_seconds']) / active:.2f}"
                                         for a, b in zip(after, before))
                rows.append((name, c, tok_s, tok_s / base[c], bubbles))
                print(f"{name:>10} | {c:>3} requests | {tok_s:8.1f} tok/s | x{tok_s / base[c]:.2f} of one engine | "
                      f"bubble per stage {bubbles}", flush=True)
    print("\n| configuration | concurrent requests | decode tok/s | vs one engine | bubble (stage 0 / stage 1) |")
    print("|---|---:|---:|---:|---|")
    for name, c, tok_s, ratio, bubbles in rows:
        print(f"| {name} | {c} | {tok_s:.1f} | {ratio:.2f} | {bubbles} |")
    return 0


def _settle(clock, stats, wait: float = 2.0) -> None:
    """Let the stage watchers see the last outputs become ready (they run beside the engine)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and len({s["steps"] for s in stats}) > 1:
        time.sleep(0.01)
        stats[:] = [clock.stats(s) for s in range(len(stats))]


if __name__ == "__main__":
    sys.exit(main())
