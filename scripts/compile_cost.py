"""Where a step program's XLA compile time goes: a few of the warm-up's step programs compiled one
after another on one thread, each sampling variant in turn, so the second variant of a shape shows
what XLA's in-process autotuning cache saves. Run it under different XLA_FLAGS to compare.

    python scripts/compile_cost.py --model DIR --load-format dummy [--shapes 3]

Prints one JSON line per program: shape (tokens, rows, tokens per row, blocks per row), variant,
lower and compile seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from jtp.config.engine_args import EngineArgs
from jtp.engine.engine import Engine
from jtp.engine.warmup import warmup_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--shapes", type=int, default=3, help="the largest prefill shape, a middle one, the largest decode")
    args = ap.parse_args()
    with Engine.from_args(EngineArgs(model=args.model, load_format=args.load_format, warmup=False)) as engine:
        steps = warmup_steps(engine.scheduler, engine.speculative)
        shape = lambda s: (len(s.plan.token_ids), len(s.plan.context_lens), s.plan.max_row_len,  # noqa: E731
                           s.plan.block_tables.shape[1])
        shapes = sorted({shape(s) for s in steps}, key=lambda x: (x[2] > 1, x[0]))
        decode = [x for x in shapes if x[2] == 1]
        mixed = [x for x in shapes if x[2] > 1]
        picked = [mixed[-1], mixed[len(mixed) // 2], decode[-1]][: args.shapes]
        for want in picked:
            for variant, step in enumerate(s for s in steps if shape(s) == want):
                t = time.perf_counter()
                programs = engine.runner.lower(step, again=True)
                lower_s = time.perf_counter() - t
                for key, lowered in programs:
                    t = time.perf_counter()
                    lowered.compile()
                    print(json.dumps({"shape": want, "variant": variant, "program": key[0], "lower_s": round(lower_s, 2),
                                      "compile_s": round(time.perf_counter() - t, 2),
                                      "xla_flags": os.environ.get("XLA_FLAGS", "")}), flush=True)

if __name__ == "__main__":
    main()
