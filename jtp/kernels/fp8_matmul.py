"""x @ w.T for a weight in 128 x 128 FP8 blocks, as one Pallas (Triton backend) GPU kernel that
dequantizes tile by tile in registers: a decode step reads the float8 bytes and their scales once,
half of what the bf16 weight costs, instead of a dequantized copy.

    y[t, n] = sum_k x[t, k] * values[n, k] * scale[n // 128, k // 128]

Program (n block, k split) walks its [BN, K / splits] stripe of the weight in 128-column steps (one
block's width, so one scale per tile): x[:, k0 : k0 + 128] (its rows padded to a power of two of at
least 16, the MMA's minimum), the float8 tile [BN, 128] converted to x's dtype, their product
scaled by the tile's block scale and accumulated in fp32. With one split the program writes x's
dtype directly; with several (few output blocks would leave SMs idle) it writes fp32 partials that
jnp sums afterwards, one more kernel. For up to 4 rows a GEMV kind multiplies and adds on the CUDA
cores instead of the MMA (x is not padded to 16 rows); a w8a8 kind quantizes x per row and block
and multiplies two float8 tiles on the MMA (measured, not chosen: `choose_config`). Meant for few
rows (decode).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK = 128  # the checkpoint's block: the kernel's K step and the granularity of its scales
MAX_ROWS = 64


class Fp8MatmulConfig(NamedTuple):
    bn: int  # output columns per program (divides 128: one block row of scales per tile)
    splits: int  # programs along K, summed afterwards when > 1
    unroll: int = 1  # 128-column tiles loaded per loop step (more bytes in flight per program)
    warps: int = 4
    stages: int = 3
    kind: str = "mma"  # see KINDS


# How a program multiplies its x rows by a float8 tile:
#   mma:    x (rows padded to 16, the MMA's minimum) times the tile converted to x's dtype, on the tensor cores;
#   w8a8:   the same, with x quantized to float8 per 128 columns in the program (one scale per row and
#           block, as Qwen's "dynamic" activation scheme) and the product of two float8 tiles on the tensor cores;
#   gemv:   elementwise products on the CUDA cores, accumulated over the K range and summed at the end.
KINDS = ("mma", "w8a8", "gemv")
GEMV_MAX_ROWS = 4  # the CUDA-core kinds keep one accumulator per row


def supported(rows: int, out: int, inner: int) -> bool:
    return out % 64 == 0 and inner % BLOCK == 0 and rows <= MAX_ROWS


def parse_config(text: str) -> Fp8MatmulConfig:
    """"bn,splits[,unroll,warps,stages,kind]" (JTP_FP8_DECODE's format)."""
    *ints, last = [v.strip() for v in text.split(",")]
    kind = () if last.isdigit() else (last,)
    ints = [int(v) for v in (ints + [last] if not kind else ints)]
    return Fp8MatmulConfig(*ints, *kind)


@functools.cache
def _read_table(path: str) -> dict[tuple[int, int, int], Fp8MatmulConfig]:
    return {tuple(int(v) for v in key.split(",")): parse_config(config)
            for key, config in json.loads(Path(path).read_text()).items()}


def choose_config(rows: int, out: int, inner: int) -> Fp8MatmulConfig:
    """The best weight-only kinds of scripts/fp8_kernel_bench.py's sweep on an H200 at Qwen3-8B's
    shapes (docs/bench/h200-speed3.md): up to 4 rows the CUDA-core GEMV, 32 columns and 4 K splits a
    program; more rows the MMA, 64 columns a program and K split until there are about two programs
    per SM. The w8a8 kind (x quantized too) was faster only at 16 rows, by 18%, and would make a
    request's numbers depend on its batch's size: not chosen for these 128-block weights. (Per-channel
    weights, `--quantization fp8`, do run W8A8 from 5 rows on, in XLA: jtp/models/layers.py.)
    Benchmarks override it: JTP_FP8_DECODE="bn,splits[,unroll,warps,stages,kind]" for every shape, or
    JTP_FP8_DECODE_TABLE=FILE for the shapes it lists (scripts/fp8_kernel_bench.py --table writes it)."""
    forced = os.environ.get("JTP_FP8_DECODE", "").strip()
    if forced:
        return parse_config(forced)
    table = os.environ.get("JTP_FP8_DECODE_TABLE")
    if table and (rows, out, inner) in _read_table(table):
        return _read_table(table)[rows, out, inner]
    kb = inner // BLOCK
    if rows <= GEMV_MAX_ROWS and kb % 4 == 0 and out % 32 == 0:
        return Fp8MatmulConfig(32, 4, 1, 4, 3, "gemv")
    splits = 1
    while ((out // 64) * splits < 264 or splits < 2) and kb % (splits * 2) == 0 and splits < 16:
        splits *= 2
    return Fp8MatmulConfig(64, splits, 1, 4, 4)


def _tile_scale(s_ref, block_row, kb):
    return 1.0 if s_ref is None else s_ref[block_row, kb]


def _mma_kernel(x_ref, w_ref, s_ref, o_ref, *, k_steps: int, unroll: int, bn: int, quantize_x: bool = False):
    """x [T, 128] tile times the weight tile on the tensor cores, K step by K step. `quantize_x`
    (the w8a8 kind): x's tile is quantized to float8 here, one scale per row (its largest magnitude
    / 448, float8_e4m3fn's largest finite value; x is multiplied by the reciprocal), and the MMA
    multiplies two float8 tiles; else the float8 tile is converted to x's dtype (exact)."""
    split = pl.program_id(1)
    block_row = pl.program_id(0) * bn // BLOCK

    def body(i, acc):
        for j in range(unroll):
            kb = (split * k_steps + i) * unroll + j
            k0 = pl.multiple_of(kb * BLOCK, BLOCK)
            x, w = x_ref[:, pl.ds(k0, BLOCK)], w_ref[:, pl.ds(k0, BLOCK)]  # [T, 128], [BN, 128]
            if quantize_x:
                x = x.astype(jnp.float32)
                amax = jnp.maximum(jnp.max(jnp.abs(x), axis=1), 1e-30)  # [T]
                x, row_scale = (x * (448.0 / amax)[:, None]).astype(jnp.float8_e4m3fn), (amax * (1.0 / 448.0))[:, None]
            else:
                w, row_scale = w.astype(x.dtype), 1.0
            part = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            acc = acc + part * (row_scale * _tile_scale(s_ref, block_row, kb))
        return acc

    acc = lax.fori_loop(0, k_steps, body, jnp.zeros((x_ref.shape[0], w_ref.shape[0]), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, k_steps: int, unroll: int, bn: int):
    """The product for very few rows without the MMA, on the CUDA cores: x is neither padded to 16
    rows nor moved through shared memory. Each row keeps a [BN, 128] accumulator, so a step is
    elementwise multiply-adds only, and the sum over the 128 columns (a cross-thread reduction)
    happens once, after the loop (summing every step measured 5-50% slower)."""
    split = pl.program_id(1)
    block_row = pl.program_id(0) * bn // BLOCK
    rows = x_ref.shape[0]

    def body(i, accs):
        accs = list(accs)
        for j in range(unroll):
            kb = (split * k_steps + i) * unroll + j
            k0 = pl.multiple_of(kb * BLOCK, BLOCK)
            w = w_ref[:, pl.ds(k0, BLOCK)].astype(jnp.float32) * _tile_scale(s_ref, block_row, kb)  # [BN, 128]
            for t in range(rows):
                accs[t] = accs[t] + w * x_ref[t, pl.ds(k0, BLOCK)].astype(jnp.float32)[None, :]
        return tuple(accs)

    accs = lax.fori_loop(0, k_steps, body, tuple(jnp.zeros((bn, BLOCK), jnp.float32) for _ in range(rows)))
    for t in range(rows):
        o_ref[t, :] = jnp.sum(accs[t], axis=1).astype(o_ref.dtype)


_KERNELS = {"mma": _mma_kernel, "w8a8": functools.partial(_mma_kernel, quantize_x=True), "gemv": _gemv_kernel}


def fp8_matmul(x: jax.Array, values: jax.Array, scale: jax.Array | None, config: Fp8MatmulConfig | None = None, *,
               out_dtype=None, interpret: bool = False) -> jax.Array:
    """x [T, K] (T <= 64), values float8 [N, K], scale f32 [N / 128, K / 128] -> [T, N] in out_dtype
    (default x.dtype). `scale` None: `values` multiplied as they are (float8 values whose per-channel
    scale the caller applies, in a wide enough out_dtype; or a plain bf16 weight: the GEMV kinds measured
    against XLA's dot)."""
    T, K = x.shape
    N = values.shape[0]
    bn, splits, unroll, warps, stages, kind = config or choose_config(T, N, K)
    kb = K // BLOCK
    if BLOCK % bn or kb % (splits * unroll) or kind not in KINDS:
        raise ValueError(f"fp8_matmul: {bn=} must divide {BLOCK}, {splits=} x {unroll=} the {kb} K blocks, "
                         f"and {kind=} be one of {KINDS}")
    gemv = kind == "gemv"
    if gemv and T > GEMV_MAX_ROWS:
        raise ValueError(f"fp8_matmul: the {kind} kernel takes at most {GEMV_MAX_ROWS} rows, not {T}")
    rows = 1 << (T - 1).bit_length() if gemv else max(16, 1 << (T - 1).bit_length())
    x = jnp.pad(x, ((0, rows - T), (0, 0)))
    final_dtype = out_dtype or x.dtype
    out_dtype = final_dtype if splits == 1 else jnp.float32
    operands = [x, values] + ([] if scale is None else [scale.astype(jnp.float32)])
    in_specs = [pl.BlockSpec((rows, K), lambda n, s: (0, 0)), pl.BlockSpec((bn, K), lambda n, s: (n, 0))]
    if scale is not None:
        in_specs.append(pl.BlockSpec(scale.shape, lambda n, s: (0, 0)))
    body = functools.partial(_KERNELS[kind], k_steps=kb // splits // unroll, unroll=unroll, bn=bn)
    kernel = body if scale is not None else lambda x_ref, w_ref, o_ref: body(x_ref, w_ref, None, o_ref)
    out = pl.pallas_call(
        kernel,
        grid=(N // bn, splits),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, rows, bn), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, N), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"jtp_fp8_{kind}_n{bn}_s{splits}_u{unroll}",
    )(*operands)
    return (out[0] if splits == 1 else out.sum(axis=0))[:T].astype(final_dtype)
