"""A staggered batch driven through the engine's real step: requests arrive at fixed step counts,
so prefill chunks, decode rows and finished rows mix differently from step to step.

Used in-process for the single-process references and as a script for a multi-process group:

    python tests/staggered.py '{"model": "...", "num_processes": 2, "tensor_parallel_size": 4}'

prints one JSON line: every request's greedy token ids, in submission order.
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
    from jtp.sampling import SamplingParams

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


def main(argv: list[str]) -> int:
    from jtp.engine_args import EngineArgs

    args = EngineArgs(**{**ENGINE_ARGS, **json.loads(argv[0])})
    with args.create_engine() as engine:
        print(json.dumps(run_staggered(engine, engine.cfg.vocab_size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
