"""Time the chunked gated delta rule alone (a DeltaNet layer's prompt recurrence) at a model's shapes.

    PYTHONPATH=. python3 scripts/delta_rule_bench.py [--heads 32 --dk 128 --dv 128] [--rows 4 --length 2048]
                                                      [--live 1] [--precisions highest,bf16x3,tf32x3] [--kernel]

The step layout of a lone `--length`-token prompt among `--rows` rows (`--live` of them hold tokens,
the rest are empty, as in a split prompt step's [P, L] rows): per precision of the rule's matmuls,
the device time of one layer's call (median of repeated calls chained in one program) with the
chunks past each row's end skipped (`row_lens`, as the model calls it) and without, and each
variant's largest relative error in the live rows' outputs and the final states against the first run.
--kernel: each variant also with the chunk-to-chunk loop and the outputs as one Pallas kernel
(`kernel=True`, jtp/kernels/delta_rule_chunks.py; its dots at the kernel's own precision), and the
largest absolute difference of its outputs (live rows) and final states from the same variant's jnp loop.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jtp.models.delta_rule import chunked_gated_delta_rule  # noqa: E402
from jtp.models.deltanet_rows import CHUNK  # noqa: E402

PRECISIONS = {
    "highest": jax.lax.Precision.HIGHEST,
    "bf16x3": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
    "bf16x6": jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": jax.lax.DotAlgorithmPreset.TF32_TF32_F32,
}


def inputs(rows, length, live, heads, dk, dv, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(ks[0], (rows, length, heads, dk))) * dk**-0.5
    k = unit(jax.random.normal(ks[1], (rows, length, heads, dk)))
    v = jax.random.normal(ks[2], (rows, length, heads, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (rows, length, heads)) - 2.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (rows, length, heads)))
    lens = jnp.where(jnp.arange(rows) < live, length, 0).astype(jnp.int32)
    empty = (jnp.arange(length)[None, :] >= lens[:, None])[..., None]
    k, g, beta = jnp.where(empty[..., None], 0.0, k), jnp.where(empty, 0.0, g), jnp.where(empty, 0.0, beta)
    state = 0.1 * jax.random.normal(ks[5], (rows, heads, dk, dv))
    return (q, k, v, g, beta, state), lens


def time_calls(fn, args, copies, reps):
    """Median device seconds per call: `copies` calls chained in one program, minus nothing (the
    program's launch is amortised over them)."""

    @jax.jit
    def many(args):
        acc = jnp.zeros((), jnp.float32)
        for i in range(copies):
            o, s, _ = fn(*args[:5], args[5] + acc)  # each call depends on the last: no overlap, no CSE
            acc = acc + 1e-30 * (o[0, 0, 0, 0] + s[0, 0, 0, 0])
        return acc

    many(args).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        many(args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / copies


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def absdiff(a, b):
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--live", type=int, default=1, help="rows that hold --length tokens; the others are empty")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=CHUNK)
    ap.add_argument("--precisions", default="highest,bf16x3,tf32x3")
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kernel", action="store_true", help="also run each variant with kernel=True")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    x, lens = inputs(args.rows, args.length, args.live, args.heads, args.dk, args.dv)
    tokens = args.live * args.length
    results, reference, jnp_loop = [], None, {}
    variants = [(name, skip, kernel) for name in args.precisions.split(",") for skip in (True, False)
                for kernel in ((False, True) if args.kernel else (False,))]
    for name, skip, kernel in variants:
        fn = functools.partial(chunked_gated_delta_rule, chunk=args.chunk, precision=PRECISIONS[name],
                               row_lens=lens if skip else None, max_tokens=tokens if skip else None, kernel=kernel)
        try:
            o, s, _ = jax.jit(fn)(*x)
            seconds = time_calls(fn, x, args.copies, args.reps)
        except Exception as e:  # a precision this backend does not run
            results.append(dict(precision=name, skip_empty_chunks=skip, kernel=kernel,
                                error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(results[-1], flush=True)
            continue
        if reference is None:
            reference = (o, s)
        results.append(dict(precision=name, skip_empty_chunks=skip, kernel=kernel, ms=1e3 * seconds,
                            tokens_per_s=tokens / seconds, rel_err_o=rel(o[: args.live], reference[0][: args.live]),
                            rel_err_state=rel(s, reference[1])))
        if not kernel:
            jnp_loop[name, skip] = (o, s)
        elif (name, skip) in jnp_loop:
            o_jnp, s_jnp = jnp_loop[name, skip]
            results[-1].update(abs_diff_o=absdiff(o[: args.live], o_jnp[: args.live]), abs_diff_state=absdiff(s, s_jnp))
        print(results[-1], flush=True)
    header = (f"chunked delta rule, rows {args.rows} x {args.length} ({args.live} live), heads {args.heads}, "
              f"dk {args.dk}, dv {args.dv}, chunk {args.chunk}, {jax.devices()[0].device_kind}")
    print(f"\n{header}\n\n| precision | skip empty chunks | kernel | ms per layer | tokens/s | rel err o | "
          "rel err state | abs diff o / state vs jnp loop |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in results:
        if "ms" in r:
            diff = f"{r['abs_diff_o']:.1e} / {r['abs_diff_state']:.1e}" if "abs_diff_o" in r else ""
            print(f"| {r['precision']} | {r['skip_empty_chunks']} | {r['kernel']} | {r['ms']:.3f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['rel_err_o']:.1e} | {r['rel_err_state']:.1e} | {diff} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(setup=header, results=results), f, indent=1)


if __name__ == "__main__":
    main()
