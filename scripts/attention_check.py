"""GPU check of jtp's ragged paged-attention kernel: correctness, then timing.

    PYTHONPATH=. python3 scripts/attention_check.py --json out.json [--quick] [--kv-dtype fp8]

1. Correctness on fresh random inputs at Qwen3-8B attention shapes (32 q / 8 KV heads, head_dim
   128, bf16, page 16): decode batches 1, 8, 64 with ~1k context, one 2048-token prefill chunk,
   a mixed batch (decode rows + prefill chunks). Relative error against
   `paged_attention_reference` (fp32 softmax over the same bf16 inputs), NaN never passes.
2. Timing (median of repeated calls; each timed program runs several independent layers' worth of
   calls on different pages so small cases are not measured from L2): kernel vs reference vs
   JAX's bundled Pallas `paged_attention` (fed q pre-scaled by 1/sqrt(D), which it needs, and its
   own [kv_heads, pages, page, D] layout) for decode; kernel vs reference for prefill/mixed.
   Bytes moved = K/V bytes the rows must read; TB/s = those bytes / time. `--kv-dtype fp8`: the
   pages in float8 e4m3 (`--kv-cache-dtype fp8`), half the bytes; no bundled kernel to compare.
3. A few kernel configurations (tile rows, keys per iteration, splits, warps) per shape. Decode
   cases carry query_bound of length 1 (like the runner), so "kernel" is the dedicated decode kernel
   (its config ignores the tile rows); "kernel general" times the general tiled kernel on the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jtp.core.buckets import Buckets  # noqa: E402
from jtp.kernels.ragged_paged_attention import (  # noqa: E402
    choose_config,
    choose_decode_config,
    ragged_paged_attention,
)
from jtp.models.attention import AttentionMetadata, LayerKV, paged_attention_reference  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16
DTYPE = jnp.bfloat16
SCALE = D**-0.5
PAGE_DTYPE = DTYPE  # --kv-dtype fp8: float8_e4m3fn
INTERPRET = False  # --interpret: Pallas interpreter (CPU smoke test of this script)


def bucket(n, lo):
    b = lo
    while b < n:
        b *= 2
    return b


def make_plan(rng, rows, num_blocks, max_blocks=None, first_block=0):
    """rows: list of (query tokens, context). Padded like the scheduler (jtp.core.buckets)."""
    total, longest = sum(n for n, _ in rows), max(n for n, _ in rows)
    T, B, row_bound = Buckets.make(bucket(total, 16), bucket(len(rows), 8), 1).step_shape(total, len(rows), longest)
    need = [-(-c // BS) for _, c in rows]
    M = max_blocks or bucket(max(need), 1)
    positions = np.zeros(T, np.int32)
    token_rows = np.zeros(T, np.int32)
    tables = np.zeros((B, M), np.int32)
    ctx = np.zeros(B, np.int32)
    starts = np.full(B, total, np.int32)
    lens = np.zeros(B, np.int32)
    pages = rng.permutation(num_blocks - first_block)[: sum(need)] + first_block
    used = cur = 0
    for b, ((n, c), p) in enumerate(zip(rows, need)):
        tables[b, :p] = pages[used : used + p]
        used += p
        positions[cur : cur + n] = np.arange(c - n, c)
        token_rows[cur : cur + n] = b
        ctx[b], starts[b], lens[b] = c, cur, n
        cur += n
    meta = AttentionMetadata(
        jnp.asarray(positions), jnp.full(T, -1, jnp.int32), jnp.asarray(token_rows), jnp.asarray(tables),
        jnp.asarray(ctx), jnp.asarray(starts), jnp.asarray(lens), jnp.full(B, -1, jnp.int32), jnp.full(B, -1, jnp.int32),
        jnp.arange(row_bound, dtype=jnp.int32),  # query_bound, as the runner
    )
    kv_bytes = int(sum(c for _, c in rows)) * HKV * D * 2 * jnp.dtype(PAGE_DTYPE).itemsize
    return meta, total, kv_bytes


def kernel_fn(config=None):
    general = config == "general"  # the general tiled kernel even for a decode step
    config = None if general else config

    def f(q, cache, m):
        return ragged_paged_attention(
            q, cache.k, cache.v, m.positions, m.block_tables, m.context_lens, m.row_starts, m.row_lens,
            scale=SCALE, config=config, interpret=INTERPRET,
            max_row_len=None if general else m.query_bound.shape[0], token_rows=m.token_rows,
        )

    return f


def reference_fn(q, cache, m):
    return paged_attention_reference(q, cache, m, SCALE)


def bundled_fn():
    from jax.experimental.pallas.ops.gpu.paged_attention import (
        paged_attention as bundled,
    )

    def f(q, pages_hm, m, nrows):
        k_hm, v_hm = pages_hm
        qs = (q[:nrows].astype(jnp.float32) * SCALE).astype(q.dtype)  # it applies no scale itself
        return bundled(qs, k_hm, v_hm, m.block_tables[:nrows], m.context_lens[:nrows], interpret=INTERPRET)

    return f


def time_many(fn, args_list, reps):
    """Median seconds per call: one jitted program makes len(args_list) independent calls."""

    @jax.jit
    def many(all_args):
        acc = jnp.zeros((), jnp.float32)
        for a in all_args:
            acc = acc + fn(*a)[:1, :1, :1].astype(jnp.float32).sum()
        return acc

    many(args_list).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        many(args_list).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / len(args_list)


def rel_err(out, ref, n):
    out = np.asarray(out.astype(jnp.float32))[:n]
    ref = np.asarray(ref.astype(jnp.float32))[:n]
    finite = bool(np.isfinite(out).all())
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if finite else float("nan")
    return err, finite


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--num-blocks", type=int, default=12288)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--copies", type=int, default=8, help="independent calls per timed program")
    ap.add_argument("--max-seconds", type=float, default=240)
    ap.add_argument("--quick", action="store_true", help="fewer config variants")
    ap.add_argument("--cases", default="0,1,2,3,4", help="indices of the cases to run")
    ap.add_argument("--decode-sweep", action="store_true",
                    help="decode cases: a grid of (pages per iteration, splits, warps, stages) per batch size")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16", help="the pages' dtype")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    args = ap.parse_args()
    global INTERPRET, PAGE_DTYPE
    INTERPRET = args.interpret
    PAGE_DTYPE = jnp.float8_e4m3fn if args.kv_dtype == "fp8" else DTYPE
    t_start = time.time()
    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    rng = np.random.default_rng(seed)
    print(f"jax {jax.__version__} devices {jax.devices()} seed {seed}", flush=True)
    shape = (args.num_blocks, BS, HKV, D)
    k = jax.random.normal(jax.random.key(seed), shape, DTYPE).astype(PAGE_DTYPE)
    v = jax.random.normal(jax.random.key(seed + 1), shape, DTYPE).astype(PAGE_DTYPE)
    cache = LayerKV(k, v)
    pages_hm = (jnp.transpose(k, (2, 0, 1, 3)), jnp.transpose(v, (2, 0, 1, 3)))  # bundled kernel's layout
    results = {"seed": seed, "jax": jax.__version__, "device": str(jax.devices()[0]), "kv_dtype": args.kv_dtype,
               "cases": []}
    bundled = PAGE_DTYPE == DTYPE  # JAX's bundled kernel reads pages in q's dtype only

    def ctxs(n):
        return [int(c) for c in rng.integers(900, 1100, n)]

    cases = [
        ("decode B=1", lambda: [(1, c) for c in ctxs(1)], True),
        ("decode B=8", lambda: [(1, c) for c in ctxs(8)], True),
        ("decode B=64", lambda: [(1, c) for c in ctxs(64)], True),
        ("prefill 2048 (first chunk)", lambda: [(2048, 2048)], False),
        ("mixed: 48 decode + 1000-token chunk (ctx 1500) + 952-token first chunk",
         lambda: [(1, c) for c in ctxs(48)] + [(1000, 1500), (952, 952)], False),
    ]
    variants = {
        True: [None, "general", (4, 8, 1, 4, 2), (4, 4, 2, 4, 2), (4, 8, 4, 4, 3), (4, 8, 8, 4, 3), (4, 4, 1, 8, 2)],
        False: [None, (16, 4, 1, 4, 2), (16, 8, 1, 8, 2), (32, 4, 1, 8, 2)],
    }
    if args.quick:
        variants = {True: variants[True][:3], False: variants[False][:2]}
    decode_grid = {  # batch -> (pages per iteration, splits, warps, stages) variants, tile rows unused
        1: [(1, p, s, 4, st) for p in (1, 2, 4) for s in (8, 16, 32, 64) for st in (2, 3)],
        8: [(1, p, s, 4, st) for p in (2, 4) for s in (2, 4, 8, 16) for st in (2, 3)],
        64: [(1, p, s, w, st) for p in (2, 4, 8, 16) for s in (1, 2) for w in (4, 8) for st in (2, 3, 4)],
    }
    cases = [cases[int(i)] for i in args.cases.split(",")]
    for name, rows_fn, is_decode in cases:
        if time.time() - t_start > args.max_seconds:
            print(f"skip {name}: time", flush=True)
            continue
        rows = rows_fn()
        meta, n_real, kv_bytes = make_plan(rng, rows, args.num_blocks, max_blocks=128)
        T = meta.positions.shape[0]
        q = jax.random.normal(jax.random.key(int(rng.integers(1 << 30))), (T, HQ, D), DTYPE)
        entry = {"case": name, "T": T, "B": int(meta.block_tables.shape[0]), "tokens": n_real, "kv_bytes": kv_bytes,
                 "default_config": list(
                     choose_decode_config(T, meta.block_tables.shape[0], HKV, HQ // HKV, BS, meta.block_tables.shape[1],
                                          D, jnp.dtype(PAGE_DTYPE).itemsize)
                     if is_decode else choose_config(T, HKV, HQ // HKV, BS, None, D, jnp.dtype(PAGE_DTYPE).itemsize))}
        try:
            ref = jax.jit(reference_fn)(q, cache, meta)
            out = jax.jit(kernel_fn())(q, cache, meta)
            entry["rel_err"], entry["finite"] = rel_err(out, ref, n_real)
            if is_decode and bundled:
                b_out = jax.jit(bundled_fn(), static_argnums=3)(q, pages_hm, meta, len(rows))
                entry["bundled_rel_err"], _ = rel_err(b_out, ref[: len(rows)], len(rows))
            del ref, out
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            print(name, "ERROR", entry["error"], flush=True)
            results["cases"].append(entry)
            continue
        print(f"{name}: T={T} rel_err kernel {entry['rel_err']:.2e} finite {entry['finite']}"
              + (f" bundled {entry['bundled_rel_err']:.2e}" if is_decode and bundled else ""), flush=True)

        # Timing: `copies` independent plans over different pages per timed program.
        copies = args.copies if is_decode else 2
        plans = [meta] + [make_plan(rng, rows, args.num_blocks, max_blocks=128)[0] for _ in range(copies - 1)]
        qs = [jax.random.normal(jax.random.key(i), (T, HQ, D), DTYPE) for i in range(copies)]
        timings = {}
        try:
            timings["reference"] = time_many(reference_fn, [(qq, cache, m) for qq, m in zip(qs, plans)], max(3, args.reps // 4))
        except Exception as e:  # noqa: BLE001
            timings["reference_error"] = str(e)[:500]
        if is_decode and bundled:
            try:
                bf = bundled_fn()
                timings["bundled"] = time_many(lambda q, p, m: bf(q, p, m, len(rows)),
                                               [(qq, pages_hm, m) for qq, m in zip(qs, plans)], args.reps)
            except Exception as e:  # noqa: BLE001
                timings["bundled_error"] = str(e)[:500]
        configs = variants[is_decode]
        if is_decode and args.decode_sweep:
            configs = [None] + decode_grid.get(len(rows), [])
        for cfg in configs:
            key = "kernel" if cfg is None else "kernel general" if cfg == "general" else "kernel " + "x".join(map(str, cfg))
            if time.time() - t_start > args.max_seconds:
                break
            try:
                if cfg is not None:  # correctness of each variant too
                    err, fin = rel_err(jax.jit(kernel_fn(cfg))(q, cache, meta), jax.jit(reference_fn)(q, cache, meta), n_real)
                    entry.setdefault("variant_err", {})[key] = err if fin else "non-finite"
                timings[key] = time_many(kernel_fn(cfg), [(qq, cache, m) for qq, m in zip(qs, plans)], args.reps)
            except Exception as e:  # noqa: BLE001
                timings[key + " error"] = f"{type(e).__name__}: {e}"[:500]
        entry["seconds"] = timings
        entry["TB/s"] = {k: kv_bytes / t / 1e12 for k, t in timings.items() if isinstance(t, float)}
        results["cases"].append(entry)
        line = ", ".join(f"{k} {t * 1e6:.1f} us ({kv_bytes / t / 1e12:.2f} TB/s)" for k, t in timings.items() if isinstance(t, float))
        print(f"  {line}", flush=True)
        for k2, v2 in timings.items():
            if not isinstance(v2, float):
                print(f"  {k2}: {v2}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    ok = all(c.get("finite") and c.get("rel_err", 1) < 1e-2 for c in results["cases"] if "rel_err" in c) and not any(
        "error" in c for c in results["cases"]
    )
    results["ok"] = ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("\n| case | rel err | reference us | bundled us | kernel us (default) | best kernel us (cfg) | kernel TB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for c in results["cases"]:
        s = c.get("seconds", {})
        ks = {k: t for k, t in s.items() if k.startswith("kernel") and isinstance(t, float)}
        best = min(ks, key=ks.get) if ks else None
        fmt = lambda t: f"{t * 1e6:.1f}" if isinstance(t, float) else "-"  # noqa: E731
        print(f"| {c['case']} | {c.get('rel_err', c.get('error', '?'))} | {fmt(s.get('reference'))} | {fmt(s.get('bundled'))} "
              f"| {fmt(s.get('kernel'))} | {fmt(ks.get(best)) if best else '-'} ({best}) "
              f"| {c['kv_bytes'] / s['kernel'] / 1e12 if isinstance(s.get('kernel'), float) else 0:.2f} |")
    print("ATTENTION_CHECK", "OK" if ok else "FAILED", f"{time.time() - t_start:.0f}s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
