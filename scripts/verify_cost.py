"""What a speculative verify step costs against a plain decode step, through the engine's real step.

    python scripts/verify_cost.py --model DIR [--batch-sizes 1,8,32] [--drafts 1,2,3,4] [--json F --markdown F]

One engine with `--speculative-config` (k = the most drafts asked for). B requests of `--context`
random tokens are prefilled; then each decode row is given exactly k drafts per step (k = 0: a
plain decode step, then each k of `--drafts`) and the engine's `step()` is timed. The drafts are
random tokens, so the target (random weights too) rejects them: the figures are the cost of
verifying, not the gain. The gain follows from the acceptance rate a of real drafts on real
weights, which random weights cannot show: a verify step of k drafts emits (1 - a^(k+1)) / (1 - a)
tokens per row on average (drafts accepted independently with probability a), so its speed-up is
that over the cost ratio; the table gives it for a few rates.

Speculating engines run lockstep (the host needs the accepted tokens before it drafts again), so
both the plain and the verify steps here are lockstep steps: the step time is host + device.
On hybrid models every step after a rejection also recomputes the row's last accepted token (the
Gated DeltaNet state rolls back), so rows carry 2 + k tokens: the cost of the all-rejected case.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ACCEPTANCE_RATES = (0.5, 0.7, 0.9)


def parse_sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", type=parse_sizes, default=parse_sizes("1,8,32"))
    ap.add_argument("--drafts", type=parse_sizes, default=parse_sizes("1,2,3,4"), help="drafts per row (k) to time")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=16, help="timed steps per (B, k)")
    ap.add_argument("--warmup-steps", type=int, default=3, help="untimed steps first (they compile)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    return ap


def expected_tokens(k: int, rate: float) -> float:
    """Tokens a row emits per verify step of k drafts, each accepted with probability `rate`
    (independently, until the first rejection), plus the target's own token."""
    return (1 - rate ** (k + 1)) / (1 - rate)


def time_steps(engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def max_new_tokens(args) -> int:
    """Enough for every timed step to accept all its drafts and still leave room for k more."""
    k_max = max(args.drafts)
    return (args.warmup_steps + args.steps) * (len(args.drafts) + 1) * (1 + k_max) + k_max + 4


def measure(engine, batch: int, draft_counts: list[int], args, rng, forced: dict) -> list[dict]:
    """Prefill `batch` requests, then time steps with k forced drafts per row for each k."""
    from jtp.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_new_tokens(args), temperature=0.0, ignore_eos=True)
    forced["k"] = 0
    rids = [engine.submit(rng.integers(0, engine.cfg.vocab_size, args.context).tolist(), params) for _ in range(batch)]
    outs = [engine.outputs.stream(r) for r in rids]
    while any(not o.request.output_ids for o in outs):
        engine.step()
    rows = []
    for k in [0, *draft_counts]:
        forced["k"] = k
        time_steps(engine, args.warmup_steps)
        drafted = engine.scheduler.spec_draft_tokens
        times = time_steps(engine, args.steps)
        drafts_per_row = (engine.scheduler.spec_draft_tokens - drafted) / (args.steps * batch)
        rows.append(dict(batch=batch, drafts=k, drafts_per_row=drafts_per_row,
                         ms_per_step_median=1e3 * statistics.median(times), ms_per_step_min=1e3 * min(times)))
    for r in rids:
        engine.abort(r)
        engine.release(r)
    plain = rows[0]["ms_per_step_median"]
    for row in rows:
        row["cost_vs_plain"] = row["ms_per_step_median"] / plain
        row["speedup_at_acceptance"] = {str(a): expected_tokens(row["drafts"], a) / row["cost_vs_plain"]
                                        for a in ACCEPTANCE_RATES}
    return rows


def markdown(res: dict) -> str:
    hw = res["hardware"]
    lines = [
        f"# Verify-step cost: {res['model']['model_type']} ({res['model_dir']})",
        "",
        f"- command: `{res['command']}`",
        f"- hardware: {hw['device_count']} x {hw['device_kind']} ({hw['platform']}), jax {hw['jax_version']}",
        f"- {res['model']['num_layers']} layers, tp {res['tp']}, {res['dtype']}, context {res['context']} tokens, "
        f"random weights and random drafts (rejected): cost only; speed-up = E[tokens | a] / cost",
        "",
        "| B | drafts k | drafts/row | ms/step (median) | cost vs plain | "
        + " | ".join(f"speed-up at a={a}" for a in ACCEPTANCE_RATES) + " |",
        "|---:|---:|---:|---:|---:|" + "---:|" * len(ACCEPTANCE_RATES),
    ]
    for row in res["rows"]:
        speedups = " | ".join(f"{row['speedup_at_acceptance'][str(a)]:.2f}x" for a in ACCEPTANCE_RATES)
        lines.append(f"| {row['batch']} | {row['drafts']} | {row['drafts_per_row']:.2f} | "
                     f"{row['ms_per_step_median']:.2f} | {row['cost_vs_plain']:.3f} | {speedups} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import jax
    import numpy as np

    import jtp.core.scheduler
    from jtp.config.engine_args import EngineArgs
    from jtp.engine.engine import Engine

    forced = {"k": 0}
    vocab = {}

    def forced_drafts(tokens, k, max_n, min_n):  # stands in for prompt lookup: exactly k random drafts
        n = min(k, forced["k"])
        return [int(t) for t in draft_rng.integers(0, vocab["size"], n)]

    draft_rng = np.random.default_rng(args.seed + 1)
    jtp.core.scheduler.propose_ngram = forced_drafts
    k_max, b_max = max(args.drafts), max(args.batch_sizes)
    budget = max(512, b_max * (2 + k_max) + 1)
    engine = Engine.from_args(EngineArgs(model=args.model, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, max_num_seqs=b_max, max_num_batched_tokens=budget, max_model_len=args.context + max_new_tokens(args) + 1, enable_prefix_caching=False, skip_tokenizer_init=True, speculative_config={"method": "ngram", "num_speculative_tokens": k_max}))
    vocab["size"] = engine.cfg.vocab_size
    dev0 = jax.local_devices()[0]
    res = {
        "command": " ".join(shlex.quote(a) for a in ["scripts/verify_cost.py", *(sys.argv[1:] if argv is None else argv)]),
        "timestamp_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model_dir": str(args.model),
        "model": dict(model_type=engine.cfg.model_type, num_layers=engine.cfg.num_layers,
                      hybrid=engine.states is not None),
        "hardware": dict(platform=dev0.platform, device_kind=dev0.device_kind, device_count=jax.device_count(),
                         jax_version=jax.__version__, python=platform.python_version(), cpu_count=os.cpu_count()),
        "tp": args.tensor_parallel_size, "dtype": args.dtype, "context": args.context, "rows": [],
    }
    rng = np.random.default_rng(args.seed)
    for batch in args.batch_sizes:
        print(f"B={batch}", file=sys.stderr, flush=True)
        res["rows"] += measure(engine, batch, args.drafts, args, rng, forced)
    res["spec_decode_num_state_rollbacks"] = engine.stats().spec_decode_num_state_rollbacks
    engine.close()
    text = markdown(res)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
