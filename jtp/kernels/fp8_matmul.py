"""x @ w.T for a weight in 128 x 128 FP8 blocks, as one Pallas (Triton backend) GPU kernel that
dequantizes tile by tile in registers: a decode step reads the float8 bytes and their scales once,
half of what the bf16 weight costs, instead of a dequantized copy.

    y[t, n] = sum_k x[t, k] * values[n, k] * scale[n // 128, k // 128]

Program (n block, k split) walks its [BN, K / splits] stripe of the weight in 128-column steps (one
block's width, so one scale per tile): x[:, k0 : k0 + 128] (its rows padded to a power of two of at
least 16, the MMA's minimum), the float8 tile [BN, 128] converted to x's dtype, their product
scaled by the tile's block scale and accumulated in fp32. With one split the program writes x's
dtype directly; with several (few output blocks would leave SMs idle) it writes fp32 partials that
jnp sums afterwards, one more kernel. For up to 4 rows a GEMV variant multiplies and sums on the CUDA
cores instead of the MMA (x is not padded to 16 rows). Meant for few rows (decode).
"""

from __future__ import annotations

import functools
import os
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
    gemv: bool = False  # multiply-and-sum on the CUDA cores instead of an MMA (rows not padded to 16)


def supported(rows: int, out: int, inner: int) -> bool:
    return out % 64 == 0 and inner % BLOCK == 0 and rows <= MAX_ROWS


def choose_config(rows: int, out: int, inner: int) -> Fp8MatmulConfig:
    """The best of scripts/fp8_kernel_bench.py's sweep on an H200 at Qwen3-8B's shapes
    (docs/bench/h200-fp8.md): up to 4 rows the CUDA-core GEMV, 32 columns and 4 K splits a program;
    more rows the MMA, 64 columns a program and K split until there are about two programs per SM.
    JTP_FP8_DECODE="bn,splits[,unroll,warps,stages,gemv]" overrides (benchmarks)."""
    forced = os.environ.get("JTP_FP8_DECODE", "").strip()
    if forced:
        return Fp8MatmulConfig(*(int(v) for v in forced.split(",")))
    kb = inner // BLOCK
    if rows <= 4 and kb % 4 == 0 and out % 32 == 0:
        return Fp8MatmulConfig(32, 4, 1, 4, 4, True)
    splits = 1
    while ((out // 64) * splits < 264 or splits < 2) and kb % (splits * 2) == 0 and splits < 16:
        splits *= 2
    return Fp8MatmulConfig(64, splits, 1, 4, 4)


def _kernel(x_ref, w_ref, s_ref, o_ref, *, k_steps: int, unroll: int, bn: int):
    split = pl.program_id(1)
    block_row = pl.program_id(0) * bn // BLOCK

    def body(i, acc):
        for j in range(unroll):
            kb = (split * k_steps + i) * unroll + j
            k0 = pl.multiple_of(kb * BLOCK, BLOCK)
            x = x_ref[:, pl.ds(k0, BLOCK)]  # [T, 128]
            w = w_ref[:, pl.ds(k0, BLOCK)].astype(x.dtype)  # [BN, 128]: float8 -> x's dtype, exact
            part = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            acc = acc + part * s_ref[block_row, kb]
        return acc

    acc = lax.fori_loop(0, k_steps, body, jnp.zeros((x_ref.shape[0], w_ref.shape[0]), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _gemv_kernel(x_ref, w_ref, s_ref, o_ref, *, k_steps: int, unroll: int, bn: int):
    """The same product for very few rows without the MMA: each row's dot products are sums of
    elementwise products, so x is neither padded nor moved through shared memory."""
    split = pl.program_id(1)
    block_row = pl.program_id(0) * bn // BLOCK
    rows = x_ref.shape[0]

    def body(i, accs):
        accs = list(accs)
        for j in range(unroll):
            kb = (split * k_steps + i) * unroll + j
            k0 = pl.multiple_of(kb * BLOCK, BLOCK)
            w = w_ref[:, pl.ds(k0, BLOCK)].astype(jnp.float32) * s_ref[block_row, kb]  # [BN, 128]
            for t in range(rows):
                accs[t] = accs[t] + jnp.sum(w * x_ref[t, pl.ds(k0, BLOCK)].astype(jnp.float32)[None, :], axis=1)
        return tuple(accs)

    accs = lax.fori_loop(0, k_steps, body, tuple(jnp.zeros((bn,), jnp.float32) for _ in range(rows)))
    for t in range(rows):
        o_ref[t, :] = accs[t].astype(o_ref.dtype)


def fp8_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, config: Fp8MatmulConfig | None = None, *,
               interpret: bool = False) -> jax.Array:
    """x [T, K] (T <= 64), values float8 [N, K], scale f32 [N / 128, K / 128] -> [T, N] in x.dtype."""
    T, K = x.shape
    N = values.shape[0]
    bn, splits, unroll, warps, stages, gemv = config or choose_config(T, N, K)
    kb = K // BLOCK
    if BLOCK % bn or kb % (splits * unroll):
        raise ValueError(f"fp8_matmul: {bn=} must divide {BLOCK} and {splits=} x {unroll=} the {kb} K blocks")
    rows = 1 << (T - 1).bit_length() if gemv else max(16, 1 << (T - 1).bit_length())
    x = jnp.pad(x, ((0, rows - T), (0, 0)))
    out_dtype = x.dtype if splits == 1 else jnp.float32
    out = pl.pallas_call(
        functools.partial(_gemv_kernel if gemv else _kernel, k_steps=kb // splits // unroll, unroll=unroll, bn=bn),
        grid=(N // bn, splits),
        in_specs=[pl.BlockSpec((rows, K), lambda n, s: (0, 0)),
                  pl.BlockSpec((bn, K), lambda n, s: (n, 0)),
                  pl.BlockSpec(scale.shape, lambda n, s: (0, 0))],
        out_specs=pl.BlockSpec((None, rows, bn), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, N), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"jtp_fp8_{'gemv' if gemv else 'matmul'}_n{bn}_s{splits}_u{unroll}",
    )(x, values, scale.astype(jnp.float32))
    return (out[0] if splits == 1 else out.sum(axis=0))[:T].astype(x.dtype)
