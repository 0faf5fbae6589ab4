"""The step between an attention layer's q/k/v projection and its attention, as one Pallas (Triton
backend) GPU kernel: per-head RMSNorm of q and k (Qwen3's q_norm / k_norm), RoPE on both, and the
write of k and v into the paged cache (in q's dtype, or float8 e4m3 for `--kv-cache-dtype fp8`).
Left to XLA these are 5-6 small kernels per layer (two norm reductions, the rotations, two cache
updates; two clips more with float8 pages), each a few microseconds of launch-bound work in a
decode step (docs/bench/h200-speed6.md).

    q_t,h  = rope(norm(q_t,h; q_norm), cos_t, sin_t)            -> q out [T, Hq, D]
    k_t,h  = rope(norm(k_t,h; k_norm), cos_t, sin_t)            -> pages[slot_t, h]
    v_t,h                                                       -> pages[slot_t, h]

Same function as `jtp.models.attention.rope_and_write_reference`. Program (t, j) handles one token
and one head: j < Hq a query head, else KV head j - Hq (its k and its v). q, k and v are read as
one [T, (Hq + 2 Hkv) D] array, the fused q/k/v projection's output. The pages are updated in
place (input_output_aliases); a padding token (slot -1) writes the scratch page past the pool's,
as `write_kv` does. Rotation is NeoX-style over the whole head (rotary dim = head dim). Arithmetic
in fp32: the norm rounded where the reference rounds (the normalised value, then its product with
the weight), the rotation once at the end (the reference rounds each of its products in bf16, so
bf16 results may differ by a rounding). Meant for few tokens (decode and small steps): one program
per token and head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_TOKENS = 128  # more tokens (prefill) keep XLA's fusions: one program per token and head stops paying


def supported(num_tokens: int, head_dim: int, rotary_dim: int, q_dtype, cache_dtype) -> bool:
    """Few tokens, rotation over a power-of-two head, pages in q's dtype or float8 e4m3 (FP8 KV cache)."""
    pow2 = head_dim >= 32 and head_dim & (head_dim - 1) == 0
    page_dtype_ok = jnp.dtype(cache_dtype) in (jnp.dtype(q_dtype), jnp.dtype(jnp.float8_e4m3fn))
    return num_tokens <= MAX_TOKENS and pow2 and rotary_dim == head_dim and page_dtype_ok


def to_page(x, page_dtype):
    """x as paged K/V stores it: float8 pages saturate at their largest finite value (e4m3 has no
    inf, as vLLM's fp8 pages); this kernel's writes and `jtp.models.attention.write_kv`'s both."""
    if jnp.dtype(page_dtype) == jnp.dtype(jnp.float8_e4m3fn):
        bound = float(jnp.finfo(page_dtype).max)
        x = jnp.clip(x, -bound, bound)
    return x.astype(page_dtype)


def _normed(x1, x2, w_ref, eps, dtype):
    """Both halves of one head after the per-head RMSNorm (reference order: normalise in fp32, round,
    times the weight, round)."""
    half = x1.shape[0]
    inv = jax.lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / (2 * half) + eps)
    w1 = w_ref[pl.ds(0, half)].astype(jnp.float32)
    w2 = w_ref[pl.ds(half, half)].astype(jnp.float32)
    r = lambda y: y.astype(dtype).astype(jnp.float32)  # noqa: E731
    return r(w1 * r(x1 * inv)), r(w2 * r(x2 * inv))


def _kernel(slot_ref, cos_ref, sin_ref, qn_ref, kn_ref, qkv_ref, k_in, v_in, q_out, k_out, v_out, *,
            hq: int, eps: float, norm: bool):
    del k_in, v_in  # the same buffers as k_out / v_out
    t, j = pl.program_id(0), pl.program_id(1)
    head_dim = q_out.shape[1] // hq
    hkv = k_out.shape[1]
    half = head_dim // 2
    dtype = q_out.dtype
    c1, c2 = (cos_ref[t, pl.ds(i * half, half)].astype(jnp.float32) for i in (0, 1))
    s1, s2 = (sin_ref[t, pl.ds(i * half, half)].astype(jnp.float32) for i in (0, 1))

    def rotated(h, w_ref):  # head h of the [q heads, k heads, v heads] row
        x1, x2 = (qkv_ref[t, pl.ds(h * head_dim + i * half, half)].astype(jnp.float32) for i in (0, 1))
        if norm:
            x1, x2 = _normed(x1, x2, w_ref, eps, dtype)
        return (x1 * c1 - x2 * s1).astype(dtype), (x2 * c2 + x1 * s2).astype(dtype)

    @pl.when(j < hq)
    def _():
        o1, o2 = rotated(j, qn_ref)
        q_out[t, pl.ds(j * head_dim, half)] = o1
        q_out[t, pl.ds(j * head_dim + half, half)] = o2

    @pl.when(j >= hq)
    def _():
        h = j - hq
        num_slots = k_out.shape[0]
        slot = slot_ref[t]
        slot = jnp.where(slot < 0, num_slots - 1, slot)  # padding: the scratch page
        o1, o2 = rotated(hq + h, kn_ref)
        k_out[slot, h, pl.ds(0, half)] = to_page(o1, k_out.dtype)
        k_out[slot, h, pl.ds(half, half)] = to_page(o2, k_out.dtype)
        v_out[slot, h, :] = to_page(qkv_ref[t, pl.ds((hq + hkv + h) * head_dim, head_dim)].astype(dtype), v_out.dtype)


def rope_and_write(q, k, v, k_pages, v_pages, slots, cos, sin, q_norm=None, k_norm=None, *, eps: float = 1e-6,
                   interpret: bool = False):
    """q [T, Hq, D], k and v [T, Hkv, D], pages [num_blocks, block_size, Hkv, D], slots i32[T]
    (-1: padding), cos/sin [T, D], norm weights [D] or None -> (rotated q, k pages, v pages)."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    norm = q_norm is not None
    if not norm:  # the kernel's signature is fixed; unused weights cost nothing
        q_norm = k_norm = jnp.ones((d,), q.dtype)
    page_shape = k_pages.shape
    flat = lambda x: x.reshape(T, -1)  # noqa: E731
    pages = lambda p: p.reshape(-1, hkv, d)  # noqa: E731
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)  # noqa: E731
    # One [T, (Hq + 2 Hkv) D] operand: on one device XLA folds this concatenation of the fused
    # projection's slices back into the projection's output, so no copy is made.
    qkv = jnp.concatenate([flat(q), flat(k), flat(v)], axis=1)
    args = (slots.astype(jnp.int32), cos, sin, q_norm, k_norm, qkv, pages(k_pages), pages(v_pages))
    q_out, k_out, v_out = pl.pallas_call(
        functools.partial(_kernel, hq=hq, eps=float(eps), norm=norm),
        grid=(T, hq + hkv),
        in_specs=[whole(a) for a in args],
        out_specs=[pl.BlockSpec((T, hq * d), lambda t, j: (0, 0)), whole(args[6]), whole(args[7])],
        out_shape=[jax.ShapeDtypeStruct((T, hq * d), q.dtype), jax.ShapeDtypeStruct(args[6].shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(args[7].shape, v_pages.dtype)],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name=f"jtp_rope_kv_write{'_norm' if norm else ''}",
    )(*args)
    return q_out.reshape(T, hq, d), k_out.reshape(page_shape), v_out.reshape(page_shape)
