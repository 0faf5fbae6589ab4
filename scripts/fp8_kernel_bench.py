"""The FP8 decode kernel alone on a GPU, at one model's linear shapes: device time per projection for
jtp/kernels/fp8_matmul.py against XLA's bf16 dot, XLA's dequantize-then-bf16-dot (the engine's
prefill path) and XLA's FP8 dot (one per-tensor scale: cuBLASLt's FP8 GEMM, the peer), with the
weight bytes each reads and the FLOPs, against the copy and matmul ceilings measured in the same run.

    python scripts/fp8_kernel_bench.py [--preset qwen3-8b] [--rows 1,64,4096] [--sweep] [--json FILE]

Each figure is one projection's share of `LAYERS` distinct layers' weights multiplied in turn inside
one jit, chained `REPS` times (each product feeds the next input), so no host dispatch is counted and
the weights do not sit in L2. `--sweep` times a grid of tile configs per shape; every config's
output is also checked against the dequantized weight. (A Triton W8A8 block-scaled GEMM was measured
this way too, at 300-340 TFLOP/s against cuBLAS bf16's 620-660, and dropped: docs/bench/h200-fp8.md.)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import measure_ceilings  # noqa: E402
from moe_kernel_bench import timed  # noqa: E402

from jtp.kernels import fp8_matmul  # noqa: E402
from jtp.models.layers import BlockFp8  # noqa: E402

INTERPRET = jax.default_backend() != "gpu"
SHAPES = {  # projection: (out, in), fused as the FP8 kernel path runs them
    "qwen3-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "tiny": {"a": (256, 256)},  # a CPU smoke test (Pallas' interpreter)
}
LAYERS, REPS = (8, 8) if not INTERPRET else (1, 1)
C = fp8_matmul.Fp8MatmulConfig
DECODE_SWEEP = {  # rows: configs (bn, splits, unroll, warps, stages, kind)
    1: [C(64, 4, 1, 4, 4),
        *(C(*c, kind="gemv") for c in ((16, 4, 1, 4, 3), (32, 2, 1, 4, 3), (32, 4, 1, 4, 3), (8, 4, 2, 2, 3),
                                       (32, 8, 1, 4, 3), (32, 16, 1, 4, 3), (16, 8, 1, 4, 3), (64, 8, 1, 8, 3),
                                       (32, 8, 1, 4, 4), (32, 8, 2, 4, 3), (16, 16, 1, 2, 3))),
        *(C(*c, kind="w8a8") for c in ((64, 2, 1, 4, 3), (64, 4, 1, 4, 4)))],
    16: [C(64, 2, 1, 4, 3), C(128, 2, 1, 8, 3),
         *(C(*c, kind="w8a8") for c in ((64, 2, 1, 4, 3), (64, 4, 1, 4, 4), (32, 4, 1, 4, 3), (128, 2, 1, 8, 3)))],
    64: [C(64, 1, 1), C(128, 1, 1),
         *(C(*c, kind="w8a8") for c in ((64, 1, 1, 4, 3), (64, 2, 1, 4, 4), (128, 1, 1, 8, 3), (128, 2, 1, 8, 3)))],
}
# The CUDA-core kinds on a plain bf16 weight, against XLA's dot (issue 28's GEMV at the ceiling).
BF16_SWEEP = {1: [C(*c, kind="gemv") for c in ((16, 2, 1, 4, 3), (32, 4, 1, 4, 3), (32, 8, 1, 4, 3), (16, 8, 1, 4, 3),
                                               (32, 16, 1, 4, 3))]}
_empty_loop: dict = {}


def per_layer_seconds(product, x, weights) -> float:
    """Device seconds of one `product(x, layer_weight)`, over LAYERS layers chained REPS times."""
    def chained(x, weights):
        def body(_, x):
            for w in weights:
                y = product(x, w)
                x = x + (jnp.sum(y.astype(jnp.float32)) * 1e-30).astype(x.dtype)
            return x
        return jax.lax.fori_loop(0, REPS, body, x)

    if x.shape not in _empty_loop:
        _empty_loop[x.shape] = timed(jax.jit(lambda x: jax.lax.fori_loop(0, REPS, lambda _, x: x + 1e-30, x)), x)
    empty = _empty_loop[x.shape]
    return max(1e-9, (timed(jax.jit(chained), x, weights) - empty) / (REPS * LAYERS))


def random_fp8(key, n: int, k: int) -> BlockFp8:
    values = (jax.random.normal(key, (n, k), jnp.float32) * 0.5).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(jax.random.fold_in(key, 1), (n // 128, k // 128), jnp.float32, 0.01, 0.02)
    return BlockFp8(values, scale)


def channel_fp8(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """w [N, K] as float8 values with one scale per output channel [N]."""
    scale = jnp.maximum(jnp.max(jnp.abs(w.astype(jnp.float32)), axis=1), 1e-12) / 448.0
    return (w.astype(jnp.float32) / scale[:, None]).astype(jnp.float8_e4m3fn), scale


def w8a8_per_channel(x, w):
    """x quantized per row (dynamic), times per-channel float8 weights: cuBLASLt's FP8 GEMM with the
    row and column scales applied to its bf16 output."""
    values, scale = w
    xs = jnp.maximum(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1), 1e-12) / 448.0
    xq = (x.astype(jnp.float32) / xs[:, None]).astype(jnp.float8_e4m3fn)
    y = jax.lax.dot_general(xq, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16)
    return (y.astype(jnp.float32) * xs[:, None] * scale[None, :]).astype(x.dtype)


def reduce_gemv(x, w: BlockFp8):
    """One row times a block-FP8 weight as an elementwise product and a sum over K (no dot)."""
    n, k = w.values.shape
    blocks = w.values.reshape(n // 128, 128, k // 128, 128).astype(jnp.float32) * w.scale[:, None, :, None]
    prod = blocks * x.astype(jnp.float32).reshape(1, 1, k // 128, 128)
    return jnp.sum(prod, axis=(2, 3)).reshape(1, n).astype(x.dtype)


def rel_error(y, ref) -> float:
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(y - ref)) / max(1e-30, np.max(np.abs(ref))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=SHAPES, default="qwen3-8b")
    ap.add_argument("--rows", default="1,16,64,4096", help="rows of x; the kernel serves up to 64")
    ap.add_argument("--sweep", action="store_true", help="time a grid of tile configs per shape")
    ap.add_argument("--json")
    ap.add_argument("--table", help="write the fastest FP8 kernel config per (rows, N, K) here, as JSON "
                                    "(JTP_FP8_DECODE_TABLE reads it)")
    args = ap.parse_args()
    dtype = jnp.bfloat16
    ceilings = measure_ceilings(jax.devices()[0], dtype, copy_bytes=1 << 30 if not INTERPRET else 1 << 20,
                                matmul_n=8192 if not INTERPRET else 64)
    bw, peak = ceilings["copy_bandwidth_Bps"], ceilings["matmul_flops_per_s"]
    print(f"# {args.preset} linear shapes on {jax.devices()[0].device_kind}: copy {bw / 1e12:.2f} TB/s "
          f"({ceilings['copy_method']}), bf16 matmul {peak / 1e12:.0f} TFLOP/s; device us per projection")
    print("| rows | proj | N x K | op | config | us | weight GB/s | % of copy | TFLOP/s | rel. error |")
    print("|---:|---|---|---|---|---:|---:|---:|---:|---:|")
    rows_out = []
    best: dict = {}  # (rows, N, K): {is w8a8: (seconds, config)} of the fastest accurate FP8 kernel configs
    key = jax.random.key(0)

    def report(rows, name, shape, op, config, seconds, weight_bytes, err):
        N, K = shape
        rate = weight_bytes / seconds
        flops = 2 * rows * N * K / seconds
        rows_out.append(dict(rows=rows, proj=name, n=N, k=K, op=op, config=str(config), us=seconds * 1e6,
                             weight_GBps=rate / 1e9, copy_fraction=rate / bw, tflops=flops / 1e12, rel_error=err))
        print(f"| {rows} | {name} | {N} x {K} | {op} | {config} | {seconds * 1e6:.1f} | {rate / 1e9:.0f} | "
              f"{100 * rate / bw:.0f}% | {flops / 1e12:.1f} | {err:.1e} |", flush=True)

    def kernel_run(rows, name, shape, op_name, config, op, x, weights, weight_bytes, ref):
        """Time and report one kernel config: (seconds, error), or None (reported as failed) for a
        config Triton cannot compile here."""
        try:
            seconds, err = per_layer_seconds(op, x, weights), rel_error(op(x, weights[0]), ref)
        except Exception as e:  # noqa: BLE001
            print(f"| {rows} | {name} | {shape[0]} x {shape[1]} | {op_name} | {config} | failed: "
                  f"{type(e).__name__}: {str(e).splitlines()[0][:120]} |", flush=True)
            return None
        report(rows, name, shape, op_name, config, seconds, weight_bytes, err)
        return seconds, err

    for name, (N, K) in SHAPES[args.preset].items():
        fp8 = [random_fp8(jax.random.fold_in(key, i), N, K) for i in range(LAYERS)]
        bf16 = [w.dequantize(dtype) for w in fp8]
        per_tensor = [(w.values, jnp.max(w.scale)) for w in fp8]  # cuBLASLt's FP8 GEMM: one scale per tensor
        per_channel = [channel_fp8(w) for w in bf16]
        ref_per_channel = None
        for rows in map(int, args.rows.split(",")):
            x = (jax.random.normal(jax.random.fold_in(key, rows), (rows, K), jnp.float32)).astype(dtype)
            ref = jnp.einsum("tk,nk->tn", x.astype(jnp.float32), bf16[0].astype(jnp.float32))
            ref_per_channel = jnp.einsum("tk,nk->tn", x.astype(jnp.float32),
                                         per_channel[0][0].astype(jnp.float32) * per_channel[0][1][:, None])
            dot = lambda x, w: jnp.einsum("tk,nk->tn", x, w)  # noqa: E731
            report(rows, name, (N, K), "xla bf16", "-", per_layer_seconds(dot, x, bf16), N * K * 2,
                   rel_error(dot(x, bf16[0]), ref))

            def xla_fp8(x, w):
                values, scale = w
                xs = jnp.max(jnp.abs(x)).astype(jnp.float32) / 448.0  # float8_e4m3fn's largest finite value
                xq = (x.astype(jnp.float32) / xs).astype(jnp.float8_e4m3fn)
                y = jax.lax.dot_general(xq, values, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                return (y * (xs * scale)).astype(x.dtype)
            report(rows, name, (N, K), "xla fp8 per-tensor", "-", per_layer_seconds(xla_fp8, x, per_tensor), N * K,
                   float("nan"))
            report(rows, name, (N, K), "xla fp8 per-channel w8a8", "-", per_layer_seconds(w8a8_per_channel, x, per_channel),
                   N * K, rel_error(w8a8_per_channel(x, per_channel[0]), ref_per_channel))
            if rows == 1:  # the product as XLA's multiply-and-reduce, the float8 bytes read in the fusion
                report(rows, name, (N, K), "xla fp8 reduce", "-", per_layer_seconds(reduce_gemv, x, fp8), N * K,
                       rel_error(reduce_gemv(x, fp8[0]), ref))
            dequantized = lambda x, w: jnp.einsum("tk,nk->tn", x, w.dequantize(x.dtype))  # noqa: E731
            report(rows, name, (N, K), "xla dequantize + bf16", "-", per_layer_seconds(dequantized, x, fp8), N * K,
                   rel_error(dequantized(x, fp8[0]), ref))
            if fp8_matmul.supported(rows, N, K):
                configs = [None, *(DECODE_SWEEP.get(rows, []) if args.sweep else [])]
                for config in configs:
                    if config is not None and ((K // 128) % (config.splits * config.unroll) or N % config.bn):
                        continue
                    op = lambda x, w, c=config: fp8_matmul.fp8_matmul(x, w.values, w.scale, c, interpret=INTERPRET)  # noqa: E731
                    config = config or fp8_matmul.choose_config(rows, N, K)
                    measured = kernel_run(rows, name, (N, K), "fp8 decode kernel", config, op, x, fp8, N * K, ref)
                    if measured is None:
                        continue
                    seconds, err = measured
                    group = best.setdefault((rows, N, K), {})  # w8a8 apart: it also rounds x
                    if err < 0.05 and seconds < group.get(config.kind == "w8a8", (float("inf"),))[0]:
                        group[config.kind == "w8a8"] = (seconds, config)
                for config in BF16_SWEEP.get(rows, []) if args.sweep else []:
                    op = lambda x, w, c=config: fp8_matmul.fp8_matmul(x, w, None, c, interpret=INTERPRET)  # noqa: E731
                    kernel_run(rows, name, (N, K), "bf16 gemv kernel", config, op, x, bf16, N * K * 2, ref)
        del fp8, bf16, per_tensor, per_channel
    if args.table:
        # The weight-only kinds, unless quantizing x too buys at least 10%.
        pick = lambda g: g[True] if True in g and (False not in g or g[True][0] < 0.9 * g[False][0]) else g[False]  # noqa: E731
        Path(args.table).write_text(json.dumps(
            {f"{r},{n},{k}": ",".join(map(str, pick(g)[1])) for (r, n, k), g in sorted(best.items()) if g}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(preset=args.preset, device=jax.devices()[0].device_kind,
                                                   ceilings=ceilings, rows=rows_out), indent=1))


if __name__ == "__main__":
    main()
