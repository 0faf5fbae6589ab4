"""A staggered batch driven through the engine's real step: requests arrive at fixed step counts,
so prefill chunks, decode rows and finished rows mix differently from step to step.

Used in-process for the single-process references and as a script for a multi-process group:

    python tests/staggered.py '{"model": "...", "num_processes": 2, "tensor_parallel_size": 4}' [SNAPSHOT_DIR]

prints one JSON line: every request's greedy token ids, in submission order (with a directory:
the snapshot save / load round trip's tokens instead).
"""

from __future__ import annotations

import json
import sys

# (arrives at step, prompt token ids, max_tokens): lengths straddle the blocks and the token budget.
SCHEDULE = [
    (0, [11, 22, 33, 44, 55, 66, 77], 12),
    (0, list(range(3, 40)), 9),
    (2, [5, 9], 14),
    (3, list(range(50, 71)), 6),
    (5, [101, 7, 64, 3, 19, 88, 42, 17, 6, 23, 99], 10),
    (9, [8] * 18, 8),
]
ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=24, block_size=8, num_blocks=64, max_model_len=96,
                   warmup=False, enable_prefix_caching=False)


def run_staggered(engine, vocab_size: int) -> list[list[int]]:
    from jtp.core.sampling_params import SamplingParams

    pending = sorted(SCHEDULE, key=lambda s: s[0])
    ids, step = [], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            ids.append(engine.submit([t % vocab_size for t in prompt], params))
        engine.step()
        step += 1
    return [engine.result(rid).token_ids for rid in ids]


def snapshot_roundtrip(engine, directory: str) -> dict:
    """Snapshot a finished request, save it to disk, forget everything, load it back and continue
    from it: the continuation's tokens and how many prompt tokens the loaded pages saved."""
    from jtp.core.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = [t % engine.cfg.vocab_size for t in range(7, 47)]
    first = engine.result(engine.submit(prompt, greedy))
    snap = engine.snapshot(tokens=prompt + first.token_ids)
    engine.save_snapshots(directory)
    engine.drop(snap)
    engine.reset_prefix_cache()
    (loaded,) = engine.load_snapshots(directory)
    hits = engine.stats().prefix_cache_hits
    follow = engine.result(engine.restore(loaded, [3, 1, 4, 1, 5], greedy))
    return {"first": first.token_ids, "follow": follow.token_ids, "hits": engine.stats().prefix_cache_hits - hits}


def main(argv: list[str]) -> int:
    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine

    args = EngineArgs(**{**ENGINE_ARGS, "enable_prefix_caching": len(argv) > 1, **json.loads(argv[0])})
    with Engine.from_args(args) as engine:
        if len(argv) > 1:  # a directory: the snapshot round trip
            print(json.dumps(snapshot_roundtrip(engine, argv[1])), flush=True)
        else:
            print(json.dumps(run_staggered(engine, engine.cfg.vocab_size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
