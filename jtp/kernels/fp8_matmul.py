"""x @ w.T for a weight in 128 x 128 FP8 blocks, as one Pallas (Triton backend) GPU kernel that
dequantizes tile by tile in registers: a decode step reads the float8 bytes and their scales once,
half of what the bf16 weight costs, instead of a dequantized copy.

    y[t, n] = sum_k x[t, k] * values[n, k] * scale[n // 128, k // 128]

Program (n block, k split) walks its [BN, K / splits] stripe of the weight in 128-column steps (one
block's width, so one scale per tile): x[:, k0 : k0 + 128] (its rows padded to a power of two of at
least 16, the MMA's minimum), the float8 tile [BN, 128] converted to x's dtype, their product
scaled by the tile's block scale and accumulated in fp32. Few output blocks (a decode step's small
N) leave SMs idle, so K is split over programs writing fp32 partials that jnp sums afterwards.
Meant for few rows (decode); a prefill's GEMM has other needs (its rows are the big dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

BLOCK = 128  # the checkpoint's block: the kernel's K step and the granularity of its scales


def supported(rows: int, out: int, inner: int) -> bool:
    return out % 64 == 0 and inner % BLOCK == 0 and rows <= 64


def _kernel(x_ref, w_ref, s_ref, o_ref, *, k_steps: int):
    split = pl.program_id(1)

    def body(i, acc):
        kb = split * k_steps + i
        k0 = pl.multiple_of(kb * BLOCK, BLOCK)
        x = x_ref[:, pl.ds(k0, BLOCK)]  # [T, 128]
        w = w_ref[:, pl.ds(k0, BLOCK)].astype(x.dtype)  # [BN, 128]: float8 -> x's dtype, exact
        part = lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + part * s_ref[0, kb]

    acc = lax.fori_loop(0, k_steps, body, jnp.zeros((x_ref.shape[0], w_ref.shape[0]), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def fp8_matmul(x: jax.Array, values: jax.Array, scale: jax.Array, *, bn: int = 64, splits: int | None = None,
               interpret: bool = False) -> jax.Array:
    """x [T, K] (T <= 64), values float8 [N, K], scale f32 [N / 128, K / 128] -> [T, N] in x.dtype."""
    T, K = x.shape
    N = values.shape[0]
    kb = K // BLOCK
    if splits is None:  # about two programs per SM of an H200
        splits = 1
        while (N // bn) * splits < 264 and kb % (splits * 2) == 0 and splits < 16:
            splits *= 2
    rows = max(16, 1 << (T - 1).bit_length())
    x = jnp.pad(x, ((0, rows - T), (0, 0)))
    partials = pl.pallas_call(
        functools.partial(_kernel, k_steps=kb // splits),
        grid=(N // bn, splits),
        in_specs=[pl.BlockSpec((rows, K), lambda n, s: (0, 0)),
                  pl.BlockSpec((bn, K), lambda n, s: (n, 0)),
                  pl.BlockSpec((1, kb), lambda n, s: (n * bn // BLOCK, 0))],
        out_specs=pl.BlockSpec((None, rows, bn), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((splits, rows, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        interpret=interpret,
        name=f"jtp_fp8_matmul_n{bn}_s{splits}",
    )(x, values, scale.astype(jnp.float32))
    return partials.sum(axis=0)[:T].astype(x.dtype)
