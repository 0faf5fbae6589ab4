"""Per-token decode time of one greedy request on the demo checkpoint at a given KV pool size (CPU):
    python scripts/cpu_pool_decode.py 256 8192
The two figures should agree: a decode step's cost follows the batch, not the pool."""

import sys
import time

from jtp import Engine, EngineArgs
from jtp.core.sampling_params import SamplingParams

TOKENS = 64

for blocks in map(int, sys.argv[1:] or ["256", "8192"]):
    with Engine.from_args(EngineArgs(num_blocks=blocks, warmup=False)) as engine:
        params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
        ids = engine.tokenizer.encode("Hello, world")
        engine.generate([ids], params)  # compiles
        start = time.perf_counter()
        engine.generate([ids], params)
        print(f"{blocks} blocks: {(time.perf_counter() - start) / TOKENS * 1e3:.2f} ms a token", flush=True)
