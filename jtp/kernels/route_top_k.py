"""An MoE router's softmax, top-k and renormalisation as one Pallas (Triton backend) GPU kernel.

    probs = softmax(logits[t]) in fp32;  the k largest, largest first (ties: the lower expert id);
    weights = those probabilities (divided by their sum with `normalize`)

Program t takes token t's row of logits. (Unlike lax.top_k, a row holding NaN yields the
out-of-range id E, which the experts then skip like a padding token's.) XLA makes this a softmax, a top-k (a sort) and a few small
fusions per MoE layer; on a decode step each is a launch of a microsecond or two for 128 numbers.
The top-k is k passes of (max, the first index holding it, mask it out) over the row in registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_TOKENS = 128  # decode-sized steps; prefill keeps XLA's sort


def supported(tokens: int, num_experts: int) -> bool:
    return tokens <= MAX_TOKENS and num_experts & (num_experts - 1) == 0


def _kernel(logits_ref, weights_ref, ids_ref, *, top_k: int, normalize: bool):
    num_experts, width = logits_ref.shape[0], weights_ref.shape[0]
    logits = logits_ref[...].astype(jnp.float32)
    e = jnp.exp(logits - jnp.max(logits))
    probs = e / jnp.sum(e)
    expert = lax.broadcasted_iota(jnp.int32, (num_experts,), 0)
    slot = lax.broadcasted_iota(jnp.int32, (width,), 0)
    weights, ids = jnp.zeros((width,), jnp.float32), jnp.zeros((width,), jnp.int32)
    left = probs
    for j in range(top_k):
        best = jnp.max(left)
        first = jnp.min(jnp.where(left == best, expert, num_experts))
        weights = jnp.where(slot == j, best, weights)
        ids = jnp.where(slot == j, first, ids)
        left = jnp.where(expert == first, -1.0, left)  # probabilities are >= 0
    if normalize:
        weights = weights / jnp.sum(weights)
    weights_ref[...] = weights.astype(weights_ref.dtype)
    ids_ref[...] = ids


def route_top_k(logits: jax.Array, top_k: int, normalize: bool, dtype, *, interpret: bool = False):
    """logits [T, E] -> (weights [T, k] in `dtype`, expert ids int32 [T, k]), as
    jtp.models.layers.route_top_k computes them from the router's output."""
    T, E = logits.shape
    width = 1 << (top_k - 1).bit_length()  # Triton blocks are powers of two
    weights, ids = pl.pallas_call(
        lambda *refs: _kernel(*refs, top_k=top_k, normalize=normalize),
        grid=(T,),
        in_specs=[pl.BlockSpec((None, E), lambda t: (t, 0))],
        out_specs=[pl.BlockSpec((None, width), lambda t: (t, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((T, width), dtype), jax.ShapeDtypeStruct((T, width), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=1 if E <= 256 else 4, num_stages=1),
        interpret=interpret,
        name="jtp_route_top_k",
    )(logits)
    if width != top_k:
        weights, ids = weights[:, :top_k], ids[:, :top_k]
    return weights, ids
