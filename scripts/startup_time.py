"""Cold vs warm start: the same model started twice in fresh processes sharing one
persistent XLA compilation cache (what `jtp` uses by default, see jtp.cli_support.enable_compilation_cache).

    python scripts/startup_time.py --model DIR [--tensor-parallel-size N] [--dtype bfloat16]

Each start loads the weights, builds the engine and completes one short greedy request; the
second start should skip compilation. Prints one JSON object.
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
from jtp.cli_support import enable_compilation_cache
enable_compilation_cache()
from jtp.engine import Engine
from jtp.sampling import SamplingParams
engine = Engine(sys.argv[1], int(sys.argv[2]), sys.argv[3], num_blocks=64, max_num_seqs=8, tokenizer=False)
t1 = time.perf_counter()
engine.generate([[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "first_request_s": t2 - t1, "total_s": t2 - t0,
                  "compilations": engine.runner.compilations}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, JTP_COMPILATION_CACHE=cache)
        runs = []
        for name in ("first_start", "second_start"):
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-c", CHILD, args.model, str(args.tensor_parallel_size), args.dtype],
                env=env, capture_output=True, text=True, check=True,
            )
            record = json.loads(out.stdout.strip().splitlines()[-1])
            record["process_s"] = time.perf_counter() - t
            runs.append((name, record))
    print(json.dumps(dict(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
