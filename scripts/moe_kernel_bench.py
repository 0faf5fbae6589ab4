"""The routed experts alone on a GPU: the grouped-matmul kernel against lax.ragged_dot at a real MoE
shape, per projection and per whole MoE layer, with the bytes and FLOPs each step must touch.

    python scripts/moe_kernel_bench.py --preset qwen3-30b-a3b --tokens 1,8,64,2048 --json out.json

Routing is uniform at random (each token picks k distinct experts), as a random-weight router does;
"touched" bytes are the distinct chosen experts' weights. `--sweep` also times a grid of tile
configs per shape and reports the best, which is how grouped_matmul.choose_config was set.
Prints a markdown table; the copy-bandwidth ceiling is measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import measure_ceilings  # noqa: E402

from jtp.kernels.grouped_matmul import (  # noqa: E402
    GroupedMatmulConfig,
    choose_config,
    grouped_matmul,
)
from jtp.models.moe import RoutedExperts, choose_experts  # noqa: E402

INTERPRET = jax.default_backend() != "gpu"
SHAPES = {  # hidden, expert intermediate, experts, top-k
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3.5-35b-a3b": (2048, 512, 256, 8),
    "qwen3-next-80b-a3b": (2048, 512, 512, 10),
    "tiny": (64, 32, 8, 2),  # a CPU smoke test (Pallas' interpreter)
}


def timed(fn, *args, iters: int = 5) -> float:
    """Median seconds of one call (after a warm-up call that compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def device_time(fn, *args, reps: int = 20) -> float:
    """Device seconds of one fn(*args): `reps` calls chained inside one jit (each call's first input
    depends on the previous call's output, so none is hoisted), minus the same loop without fn.
    No host dispatch is counted: a decode step's MoE layers run inside one jitted step too."""
    def chain(f):
        def run(*a):
            def body(i, carry):
                out = f(a[0] + carry.astype(a[0].dtype), *a[1:])
                # All of out feeds the next call (a zero-valued sum XLA cannot fold away or slice).
                return jnp.sum(out.astype(jnp.float32)) * 1e-30
            return jax.lax.fori_loop(0, reps, body, jnp.float32(0))
        return jax.jit(run)

    return max(1e-9, (timed(chain(fn), *args) - timed(chain(lambda first, *rest: first), *args)) / reps)


def routing(rng, tokens: int, experts: int, k: int):
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    return ids, weights / weights.sum(1, keepdims=True)


def sweep_configs(rows_per_group: float):
    if rows_per_group < 48:
        for bn, bk, splits in itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8)):
            yield GroupedMatmulConfig(16, bn, bk, splits, 4, 3)
    else:
        for bm, bn, bk, warps in itertools.product((64, 128), (64, 128), (32, 64), (4, 8)):
            yield GroupedMatmulConfig(bm, bn, bk, 1, warps, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=SHAPES, default="qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,64,2048")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tile configs per shape")
    ap.add_argument("--pad-to", type=int, default=16, help="pad each step to this many tokens (the token bucket)")
    ap.add_argument("--layer-env", default="",
                    help="also time the whole layer under these env settings: 'A=1,B=2;A=4' (JTP_MOE_* tile overrides)")
    ap.add_argument("--json")
    args = ap.parse_args()
    H, I, E, k = SHAPES[args.preset]
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    gate = (jax.random.normal(key, (E, H, I), jnp.float32) * 0.02).astype(dtype)
    up = (jax.random.normal(jax.random.fold_in(key, 1), (E, H, I), jnp.float32) * 0.02).astype(dtype)
    down = (jax.random.normal(jax.random.fold_in(key, 2), (E, I, H), jnp.float32) * 0.02).astype(dtype)
    ceilings = measure_ceilings(jax.devices()[0], dtype, copy_bytes=1 << 30 if not INTERPRET else 1 << 20,
                                matmul_n=8192 if not INTERPRET else 64)
    bw, peak = ceilings["copy_bandwidth_Bps"], ceilings["matmul_flops_per_s"]
    device = jax.devices()[0].device_kind
    print(f"# {args.preset}: H={H} I={I} E={E} top-{k}, bf16, {device}; copy bandwidth {bw / 1e12:.2f} TB/s "
          f"({ceilings['copy_method']}), matmul {peak / 1e12:.0f} TFLOP/s; device time per call (chained in one jit)")
    results = dict(preset=args.preset, device=device, ceilings=ceilings, rows=[])
    kernel_moe = jax.jit(RoutedExperts("kernel"))
    ragged_moe = jax.jit(RoutedExperts("ragged_dot"))
    print("| tokens | pairs | experts touched | op | kernel ms | ragged_dot ms | kernel GB/s (touched) | "
          "% of copy bw | kernel TFLOP/s | % of matmul | best sweep ms (config) |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for T in (int(t) for t in args.tokens.split(",")):
        ids, wts = routing(rng, T, E, k)
        order = np.argsort(ids.reshape(-1), kind="stable")
        sizes = jnp.asarray(np.bincount(ids.reshape(-1), minlength=E), jnp.int32)
        touched = int((np.asarray(sizes) > 0).sum())
        x = jax.random.normal(jax.random.fold_in(key, T), (T, H), jnp.float32).astype(dtype)
        xs = x[order // k]
        hs = jax.random.normal(jax.random.fold_in(key, T + 1), (T * k, I), jnp.float32).astype(dtype)
        for op, lhs, w in (("gate", xs, gate), ("down", hs, down)):
            K, N = w.shape[1:]
            kern = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, interpret=INTERPRET))
            ref = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s))
            err = float(jnp.abs(kern(lhs, w, sizes).astype(jnp.float32) - ref(lhs, w, sizes).astype(jnp.float32)).max())
            t_k, t_r = device_time(kern, lhs, w, sizes), device_time(ref, lhs, w, sizes)
            nbytes = touched * K * N * 2 + lhs.nbytes + T * k * N * 2
            flops = 2 * T * k * K * N
            best = None
            if args.sweep:
                for cfg in sweep_configs(T * k / touched):
                    if K % (cfg.bk * cfg.splits) or N % cfg.bn:
                        continue
                    try:
                        f = jax.jit(lambda a, b, s, c=cfg: grouped_matmul(a, b, s, config=c, interpret=INTERPRET))
                        t = device_time(f, lhs, w, sizes, reps=10)
                    except Exception as e:  # noqa: BLE001 - a config Triton cannot compile
                        print(f"  skip {cfg}: {type(e).__name__}", file=sys.stderr)
                        continue
                    if best is None or t < best[0]:
                        best = (t, cfg)
            row = dict(tokens=T, pairs=T * k, touched=touched, op=op, kernel_s=t_k, ragged_dot_s=t_r, max_abs_err=err,
                       touched_bytes=nbytes, flops=flops, config=str(choose_config(T * k, K, N, E)),
                       best_s=best[0] if best else None, best_config=str(best[1]) if best else None)
            results["rows"].append(row)
            best_txt = f"{best[0] * 1e3:.3f} ({best[1]})" if best else ""
            print(f"| {T} | {T * k} | {touched} | {op} [{K}->{N}] | {t_k * 1e3:.3f} | {t_r * 1e3:.3f} | "
                  f"{nbytes / t_k / 1e9:.0f} | {100 * nbytes / t_k / bw:.0f}% | {flops / t_k / 1e12:.1f} | "
                  f"{100 * flops / t_k / peak:.0f}% | {best_txt} |")
        # The whole layer: routing prep, gate+up, down, combine; `--pad-to` pads the step with tokens
        # that route nowhere, as the serving step's token bucket does (B=1 decode: 1 real of 16).
        rows = max(T, args.pad_to)
        w_arr = jnp.pad(jnp.asarray(wts, dtype), ((0, rows - T), (0, 0)))
        id_arr = jnp.pad(jnp.asarray(ids), ((0, rows - T), (0, 0)))
        xp = jnp.pad(x, ((0, rows - T), (0, 0)))
        real = jnp.arange(rows) < T
        layer_args = (xp, w_arr, id_arr, gate, up, down, real)
        t_k = device_time(kernel_moe, *layer_args)
        t_r = device_time(ragged_moe, *layer_args)
        diff = float(jnp.abs(kernel_moe(*layer_args).astype(jnp.float32)
                             - ragged_moe(*layer_args).astype(jnp.float32)).max())
        nbytes = touched * 3 * H * I * 2
        variants = [v for v in args.layer_env.split(";") if v]
        for variant in variants:
            env = dict(kv.split("=") for kv in variant.split(","))
            saved = {name: os.environ.get(name) for name in env}
            os.environ.update(env)  # read when the layer is traced
            t = device_time(jax.jit(choose_experts(impl="kernel")), *layer_args)
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
            results["rows"].append(dict(tokens=T, rows=rows, op="layer", env=env, kernel_s=t, touched_bytes=nbytes))
            print(f"| {T} | {T * k} | {touched} | whole MoE layer of {rows} rows, {variant} | {t * 1e3:.3f} | | "
                  f"{nbytes / t / 1e9:.0f} | {100 * nbytes / t / bw:.0f}% | | | |")
        results["rows"].append(dict(tokens=T, rows=rows, op="layer", kernel_s=t_k, ragged_dot_s=t_r, max_abs_err=diff,
                                    touched_bytes=nbytes, flops=3 * 2 * T * k * H * I))
        print(f"| {T} | {T * k} | {touched} | whole MoE layer of {rows} rows (max diff {diff:.1e}) | {t_k * 1e3:.3f} | "
              f"{t_r * 1e3:.3f} | {nbytes / t_k / 1e9:.0f} | {100 * nbytes / t_k / bw:.0f}% | "
              f"{3 * 2 * T * k * H * I / t_k / 1e12:.1f} | {100 * 3 * 2 * T * k * H * I / t_k / peak:.0f}% | |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
