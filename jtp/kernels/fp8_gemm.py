"""x @ w.T with both operands in FP8 (W8A8), for a weight in 128 x 128 FP8 blocks: the prefill's
GEMM, on Hopper's FP8 tensor cores (twice the bf16 rate).

    xq[t, k] * xs[t, k // 128] ~= x[t, k]              (per token and 128-group, dynamic)
    y[t, n] = sum_kb xs[t, kb] * scale[n // 128, kb] * (xq[t, kb-block] . values[n, kb-block])

The activations are quantized on the fly, one scale per token per 128 columns (the checkpoint's
"activation_scheme": "dynamic", as vLLM and SGLang run Qwen's FP8 releases). Program (m block, n
block) walks K one 128-block at a time: an FP8 x FP8 MMA into fp32, scaled by the outer product of
the two scales and accumulated in fp32, so every 128 products are promoted (Hopper's FP8 MMA
accumulates with fewer bits). BN = 128: one weight scale per tile.
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

BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


class Fp8GemmConfig(NamedTuple):
    bm: int = 128
    warps: int = 8
    stages: int = 4


def supported(out: int, inner: int) -> bool:
    return out % BLOCK == 0 and inner % BLOCK == 0


def choose_config(rows: int) -> Fp8GemmConfig:
    """JTP_FP8_GEMM="bm,warps,stages" overrides (benchmarks)."""
    forced = os.environ.get("JTP_FP8_GEMM", "").strip()
    if forced:
        return Fp8GemmConfig(*(int(v) for v in forced.split(",")))
    return Fp8GemmConfig(64 if rows <= 64 else 128)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> float8 [T, K] and float32 scales [K / 128, T] (transposed: the kernel loads a
    block's scales for its rows as one contiguous row)."""
    T, K = x.shape
    groups = x.astype(jnp.float32).reshape(T, K // BLOCK, BLOCK)
    scale = jnp.maximum(jnp.max(jnp.abs(groups), axis=-1), 1e-12) / FP8_MAX
    q = jnp.clip(groups / scale[..., None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(T, K), scale.T


def _kernel(x_ref, xs_ref, w_ref, s_ref, o_ref, *, k_steps: int):
    block_row = pl.program_id(1)

    def body(kb, acc):
        k0 = pl.multiple_of(kb * BLOCK, BLOCK)
        part = lax.dot_general(x_ref[:, pl.ds(k0, BLOCK)], w_ref[:, pl.ds(k0, BLOCK)],
                               (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + part * (xs_ref[kb, :][:, None] * s_ref[block_row, kb])

    acc = lax.fori_loop(0, k_steps, body, jnp.zeros((x_ref.shape[0], w_ref.shape[0]), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def fp8_gemm(x: jax.Array, values: jax.Array, scale: jax.Array, config: Fp8GemmConfig | None = None, *,
             interpret: bool = False) -> jax.Array:
    """x [T, K], values float8 [N, K], scale f32 [N / 128, K / 128] -> [T, N] in x.dtype."""
    T, K = x.shape
    N = values.shape[0]
    bm, warps, stages = config or choose_config(T)
    rows = -(-T // bm) * bm
    xq, xs = quantize_rows(jnp.pad(x, ((0, rows - T), (0, 0))))
    kb = K // BLOCK
    y = pl.pallas_call(
        functools.partial(_kernel, k_steps=kb),
        grid=(rows // bm, N // BLOCK),
        in_specs=[pl.BlockSpec((bm, K), lambda m, n: (m, 0)),
                  pl.BlockSpec((kb, bm), lambda m, n: (0, m)),
                  pl.BlockSpec((BLOCK, K), lambda m, n: (n, 0)),
                  pl.BlockSpec(scale.shape, lambda m, n: (0, 0))],
        out_specs=pl.BlockSpec((bm, BLOCK), lambda m, n: (m, n)),
        out_shape=jax.ShapeDtypeStruct((rows, N), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name=f"jtp_fp8_gemm_m{bm}",
    )(xq, xs, values, scale.astype(jnp.float32))
    return y[:T]
