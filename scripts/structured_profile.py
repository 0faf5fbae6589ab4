"""Where a batch with constrained rows spends its steps: the engine driven in-process by a closed loop
of `--concurrency` requests (`--input-len` random prompt tokens, `--output-len` greedy tokens), a share
`--fractions` of them under bench_serving.py's JSON schema (a token mask in every step they sample in),
each step timed by the engine's hook (`Engine.step_timings`) and classed by what it held.

    python scripts/structured_profile.py --model DIR [--load-format dummy] [--fractions 0 0.5 1]

Per fraction: output tokens per second, steps, and per kind of step (pure decode or with a prefill
chunk; with or without masks) the count and the median wall, host and wait times, the mask fill and
the dispatch. The model directory needs a byte-level BPE tokenizer (scripts/synthetic_bpe_tokenizer.py
grows one to a real model's width).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def run(engine, fraction: float, args, seed: int) -> dict:
    from bench_serving import STRUCTURED

    from jtp.core.sampling_params import SamplingParams

    rng = random.Random(f"{seed}-{fraction}")  # prompts of their own: no run reads another's from the prefix cache
    vocab = min(engine.cfg.vocab_size, 150000)
    pending = collections.deque(range(args.num_prompts))
    live: dict[str, bool] = {}  # request id -> constrained
    steps = []
    fill = [0.0]
    write_masks = engine._write_masks

    def timed_write(packed, rows):
        t = time.perf_counter()
        write_masks(packed, rows)
        fill[0] += time.perf_counter() - t

    engine._write_masks = timed_write
    engine.step_timings = lambda t: steps.append(t)
    tokens, start = 0, time.perf_counter()
    kinds = []
    while pending or live:
        while pending and len(live) < args.concurrency:
            pending.popleft()
            constrained = rng.random() < fraction
            params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True,
                                    structured_outputs={"json": STRUCTURED} if constrained else None)
            live[engine.submit([rng.randrange(vocab) for _ in range(args.input_len)], params)] = constrained
        before = fill[0]
        for event in engine.step():
            tokens += len(event.token_ids)
            if event.finished:
                live.pop(event.request_id, None)
                engine.release(event.request_id)
        rows = engine._inflight[0] if engine._inflight else []  # what this step dispatched
        kind = "mixed" if any(row.num_tokens > 1 for row in rows) else "decode" if rows else "none"
        masked = any(row.request.grammar is not None and row.picks_next_token for row in rows)
        kinds.append((kind + ("+mask" if masked else ""), fill[0] - before))
    seconds = time.perf_counter() - start
    engine._write_masks = write_masks
    engine.step_timings = None
    table = collections.defaultdict(list)
    for t, (kind, masks) in zip(steps, kinds):
        table[kind].append((t.total, t.total - t.wait, t.wait, masks, t.dispatch))
    med = lambda xs: 1e3 * statistics.median(xs) if xs else 0.0  # noqa: E731
    rows = {kind: {"steps": len(v), "wall_ms": med([x[0] for x in v]), "host_ms": med([x[1] for x in v]),
                   "wait_ms": med([x[2] for x in v]), "fill_ms": med([x[3] for x in v]),
                   "dispatch_ms": med([x[4] for x in v]), "sum_s": sum(x[0] for x in v)}
            for kind, v in sorted(table.items())}
    return {"fraction": fraction, "tok_s": tokens / seconds, "seconds": seconds, "steps": len(steps), "kinds": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine

    engine = Engine.from_args(EngineArgs(model=args.model, load_format=args.load_format))
    engine.warmup()
    print(engine.warmup_report.summary())
    results = []
    run(engine, 0.5, argparse.Namespace(**{**vars(args), "num_prompts": 8}), 99)  # first touches: not timed
    for p in range(args.passes):
        for fraction in args.fractions:
            r = run(engine, fraction, args, p)
            results.append(r)
            print(f"fraction {fraction}: {r['tok_s']:.0f} output tok/s, {r['steps']} steps in {r['seconds']:.1f} s")
            for kind, k in r["kinds"].items():
                print(f"  {kind:12s} {k['steps']:5d} steps, {k['sum_s']:.2f} s: wall {k['wall_ms']:.2f} ms, host "
                      f"{k['host_ms']:.2f}, wait {k['wait_ms']:.2f}, mask fill {k['fill_ms']:.2f}, "
                      f"dispatch {k['dispatch_ms']:.2f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
