"""What each part of on-device sampling costs at a real vocabulary, to decide which parts may run
in every step (one compiled variant) and which stay compile-time variants.

Times `jtp.worker.sampler.sample` alone, jitted, on f32 logits [B, V] (device time per call,
median of timed batches of calls), for:
  plain         greedy / temperature rows only (no sort)
  top_k_p       + the sort for top-k / top-p / min-p
  logprobs      + top-20 logprobs
  mask          + a token mask (structured outputs), alone
  mask_top_k_p_logprobs   the mask with the sort and top-20 logprobs (the variant of a truncating masked step)
  penalties_L   + repetition / frequency / presence penalties from a [B, L] token history

    python scripts/sampler_cost.py --vocab 151936 --batches 1,8,64,256 --lengths 2048,40960

Prints a markdown table (ms per call) and writes --json when given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jtp.core.sampling_params import SamplingParams, pack_sampling
from jtp.worker.sampler import sample_jit


def _time(fn, *args, calls: int = 20, repeats: int = 7) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t) / calls)
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--lengths", default="2048,40960")
    ap.add_argument("--json")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = np.random.default_rng(0)
    rows = []
    for B in (int(x) for x in args.batches.split(",")):
        logits = jnp.asarray(rng.standard_normal((B, args.vocab), np.float32) * 4)
        sampling = pack_sampling([SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1)] * B, B,
                                 list(range(B)), [3] * B)
        sampling = jax.tree.map(jnp.asarray, sampling)
        row = {"B": B}
        row["plain"] = _time(lambda x, s: sample_jit(x, s, needs_top_k_p_min_p=False, needs_penalties=False,
                                                     num_logprobs=0), logits, sampling)
        row["top_k_p"] = _time(lambda x, s: sample_jit(x, s, needs_top_k_p_min_p=True, needs_penalties=False,
                                                       num_logprobs=0), logits, sampling)
        row["logprobs"] = _time(lambda x, s: sample_jit(x, s, needs_top_k_p_min_p=False, needs_penalties=False,
                                                        num_logprobs=20), logits, sampling)
        mask = jnp.asarray(rng.integers(-2**31, 2**31, (B, -(-args.vocab // 32)), dtype=np.int64).astype(np.int32))
        row["mask"] = _time(lambda x, s, m: sample_jit(x, s, needs_top_k_p_min_p=False, needs_penalties=False,
                                                       num_logprobs=0, needs_mask=True, token_mask=m),
                            logits, sampling, mask)
        row["mask_top_k_p_logprobs"] = _time(
            lambda x, s, m: sample_jit(x, s, needs_top_k_p_min_p=True, needs_penalties=False, num_logprobs=20,
                                       needs_mask=True, token_mask=m), logits, sampling, mask)
        for L in lengths:
            ids = jnp.asarray(rng.integers(0, args.vocab, (B, L), dtype=np.int32))
            is_output = jnp.asarray(np.arange(L)[None, :].repeat(B, 0) >= L // 2)
            row[f"penalties_{L}"] = _time(
                lambda x, s, i, o: sample_jit(x, s, needs_top_k_p_min_p=False, needs_penalties=True, num_logprobs=0,
                                              penalty_ids=i, penalty_is_output=o), logits, sampling, ids, is_output)
        rows.append(row)
        print(row, flush=True)
    cols = list(rows[0])
    print(f"\n{jax.devices()[0].device_kind}, V = {args.vocab}, ms per call (device, median)\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row["B"]) if c == "B" else f"{row[c]:.3f}" for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "vocab": args.vocab, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
