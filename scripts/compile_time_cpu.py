"""How long a few step compilations take on the CPU, under this process's XLA_FLAGS.

    XLA_FLAGS="..." python scripts/compile_time_cpu.py [--model DIR | --hybrid]

Builds an engine (the embedded demo by default; `--hybrid`: the tests' tiny Qwen3-Next, which
needs torch) with the shapes the tests use, runs two short generations (greedy, then top-p
sampling), and prints the wall time and JAX's own compile timings (tracing, lowering, XLA backend
compile), so flag choices for the test suite are compared on numbers (docs/bench/ci-time.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--model", help="a checkpoint directory (default: the embedded demo)")
    group.add_argument("--hybrid", action="store_true", help="the tests' tiny Qwen3-Next (built with torch)")
    args = ap.parse_args(argv)

    from jtp.worker.compile_cache import phase_seconds

    phase_seconds()  # listen from here on

    from jtp import Engine, EngineArgs, SamplingParams

    if args.hybrid:
        sys.path.insert(0, str(ROOT / "tests"))
        from hf_hybrid import build_model, save

        model = save(build_model("qwen3_next", seed=1), Path(tempfile.mkdtemp(prefix="jtp-hybrid-")))
    elif args.model:
        model = args.model
    else:
        from jtp.demo import ensure_demo_checkpoint

        model = ensure_demo_checkpoint()
    engine = Engine.from_args(EngineArgs(
        model=str(model), dtype="float32", skip_tokenizer_init=True, num_blocks=160, block_size=4,
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=160))
    start = time.perf_counter()
    prompts = [[1, 2, 3, 4, 5] * 3, [3, 4]]
    engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1))
    wall = time.perf_counter() - start
    engine.close()
    parts = " ".join(f"{name} {seconds:.1f}s" for name, seconds in phase_seconds().items())
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: wall {wall:.1f}s, {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
