"""The residual add and the RMSNorm after it as one Pallas (Triton backend) GPU kernel:

    h = x + delta;   y = weight * RMSNorm(h)        (h and y in x's dtype)
                     y = (1 + weight) * RMSNorm(h)  (zero_centered: Qwen3.5 / Qwen3-Next)

Left to XLA, a decode step makes three kernels of it (the add, the mean-square reduction, the
scaling), each a few microseconds of launch-bound work, twice per layer (docs/bench/h200-speed6.md).
Program t holds token t's hidden vector in registers (in `pieces` power-of-two slices when the
hidden size is not a power of two, as Qwen3-4B's 2560 = 5 x 512) and writes h and y once. Rounded
where `jtp.models.layers.rms_norm` rounds (h, the normalised value, then its product with the
weight), or `rms_norm_zero_centered` (h, then the product in fp32). Meant for few tokens (decode and
small steps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_TOKENS = 128  # more tokens (prefill) keep XLA's fusions
MAX_PIECE = 4096


def pieces(hidden: int) -> int:
    """How many equal power-of-two slices a row is read in (0: none fits)."""
    for n in range(1, 9):
        size = hidden // n
        if hidden % n == 0 and size <= MAX_PIECE and size >= 32 and size & (size - 1) == 0:
            return n
    return 0


def supported(num_tokens: int, hidden: int) -> bool:
    return num_tokens <= MAX_TOKENS and pieces(hidden) > 0


def _kernel(x_ref, d_ref, w_ref, h_ref, y_ref, *, n: int, eps: float, zero_centered: bool):
    t = pl.program_id(0)
    hidden = x_ref.shape[1]
    size = hidden // n
    dtype = h_ref.dtype
    h = []
    for i in range(n):  # h, rounded to the activations' dtype as the plain add is
        cols = pl.ds(i * size, size)
        hi = (x_ref[t, cols].astype(jnp.float32) + d_ref[t, cols].astype(jnp.float32)).astype(dtype)
        h_ref[t, cols] = hi
        h.append(hi.astype(jnp.float32))
    inv = jax.lax.rsqrt(sum(jnp.sum(hi * hi) for hi in h) / hidden + eps)
    for i, hi in enumerate(h):
        cols = pl.ds(i * size, size)
        w = w_ref[cols].astype(jnp.float32)
        if zero_centered:
            y_ref[t, cols] = (hi * inv * (1.0 + w)).astype(dtype)
        else:
            y_ref[t, cols] = (w * (hi * inv).astype(dtype).astype(jnp.float32)).astype(dtype)


def add_rms_norm(x, delta, weight, *, eps: float, zero_centered: bool = False, interpret: bool = False):
    """x, delta [T, H], weight [H] -> (h = x + delta, weight * RMSNorm(h)), both [T, H] in x's dtype."""
    T, hidden = x.shape
    whole = lambda a: pl.BlockSpec(a.shape, lambda t: (0,) * a.ndim)  # noqa: E731
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, n=pieces(hidden), eps=float(eps), zero_centered=zero_centered),
        grid=(T,),
        in_specs=[whole(x), whole(delta), whole(weight)],
        out_specs=[whole(x), whole(x)],
        out_shape=[shape, shape],
        compiler_params=plgpu.CompilerParams(num_warps=4 if hidden <= 2048 else 8, num_stages=1),
        interpret=interpret,
        name="jtp_add_rms_norm",
    )(x, delta, weight)
