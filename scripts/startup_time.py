"""Time to ready, cold vs warm: the same engine started twice in fresh processes sharing one
persistent XLA compilation cache (what `jtp` uses by default, see jtp.entrypoints.cli_support.enable_compilation_cache).

    python scripts/startup_time.py --model DIR [--tensor-parallel-size N] [--dtype bfloat16]
        [--load-format dummy] [--enable-expert-parallel] [--no-warmup]

Each start builds the engine as `jtp serve` does (load the weights, size the pool, and compile
every step shape the scheduler can pick unless --no-warmup: then it is ready to serve without a
compilation stall), then completes one short greedy request. The second start should skip
compilation. Prints one JSON object: per start, load_and_warmup_s (time to ready), first_request_s,
total_s and the process's wall time.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import sys, time, json
t0 = time.perf_counter()
from jtp.entrypoints.cli_support import enable_compilation_cache
enable_compilation_cache()
from jtp.config.engine_args import EngineArgs
from jtp.engine.engine import Engine
from jtp.core.sampling_params import SamplingParams
args = EngineArgs(**json.loads(sys.argv[1]))
engine = Engine.from_args(args)
warmed = engine.warmup() if args.warmup else 0  # what `jtp serve` does before it listens
t1 = time.perf_counter()
out = engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
t2 = time.perf_counter()
print(json.dumps({"load_and_warmup_s": t1 - t0, "first_request_s": t2 - t1, "total_s": t2 - t0,
                  "tokens": len(out[0].token_ids), "warmup_compilations": warmed,
                  "compilations": engine.runner.compilations}))
engine.close()
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights from config.json alone")
    ap.add_argument("--enable-expert-parallel", action="store_true")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=64)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="ready before compiling the step shapes")
    args = ap.parse_args(argv)
    engine_args = dict(model=args.model, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
                       load_format=args.load_format, enable_expert_parallel=args.enable_expert_parallel,
                       max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks, warmup=args.warmup)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JTP_COMPILATION_CACHE=cache)
        runs = {"engine_args": engine_args}
        for name in ("first_start", "second_start"):
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(engine_args)],
                                 env=env, capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{name} failed:\n{out.stderr[-3000:]}")
            record = json.loads(out.stdout.strip().splitlines()[-1])
            record["process_s"] = time.perf_counter() - t
            runs[name] = record
    print(json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
