"""Qwen3-Next and Qwen3.5 (dense and MoE): hybrid Gated DeltaNet / gated attention layers.

    x = Embed[ids]
    per layer:  h = x + Mixer(Norm(x));   x = h + FFN(Norm(h))        Norm: zero-centred (1 + w)
    logits = lm_head(Norm(x))

Mixer is, per `cfg.layer_types`, either
  * gated full attention: q_proj packs [q_h | gate_h] per head; zero-centred q/k norms, partial
    RoPE, paged causal GQA; the output is multiplied by sigmoid(gate) before o_proj;
  * Gated DeltaNet (linear attention): a causal depthwise conv over the q/k/v channels, then the
    delta rule  S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,  o_t = S_t^T q_t  per value
    head, run chunk-wise (64 tokens at a time, as in HF), and a gated RMSNorm on the output.
FFN is a SwiGLU MLP or top-k routed experts plus a sigmoid-gated shared expert.

A DeltaNet layer's memory of a sequence is its (conv, recurrent) state, kept in slots of
per-layer arrays. A step gathers each row's tokens into a padded [B, L] layout, runs the row
from the state in slot `meta.state_reads[b]` (the zero state when -1: a fresh sequence),
scatters the outputs back to the flat token order and writes the final state to slot
`meta.state_writes[b]` (the same slot, or another one when the read slot is a cached
checkpoint that must stay intact; see jtp/core/state_pool.py). L is the
static bound `meta.query_bound` on tokens per row (T when unknown). L = 1 (a pure decode step)
takes the single-token recurrence (conv-state update + one delta-rule step, HF's decode path);
L > 1 the chunked rule, min(64, L) tokens per chunk, rows padded to a multiple of the chunk.
A step with a row over SHORT_ROW tokens (a prompt chunk among decodes) runs its few rows of
several tokens in the chunked layout and every lone token as one recurrence step
(jtp/models/deltanet_rows.py), so padding rows cost no chunked work.

Sharding: q/k/v/z/b/a (and the conv weights of the q/k/v channels) are separate parameters,
each split by heads (their logical axes in `param_layout`, the rules in jtp/parallel/rules.py),
so the fused checkpoint tensors' segment-wise TP split is just a contiguous split of each; the
whole DeltaNet is then head-local and XLA all-reduces once, after out_proj.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jtp.config.model_config import ModelConfig
from jtp.loading.sources import (
    FirstPresent,
    FusedExperts,
    Segment,
    Source,
    StridedRows,
    Tensor,
)
from jtp.models import qwen3
from jtp.models.attention import (
    AttentionMetadata,
    LayerKV,
    PagedAttention,
    set_rows,
    write_kv,
    zeroed_layer_kv,
)
from jtp.models.deltanet_rows import RowLayout, SplitRows, deltanet_row_length, deltanet_rows
from jtp.models.delta_rule import (
    chunk_kernel_supported,
    chunked_gated_delta_rule,
    chunked_rule_kernel,
    decode_step,
    fused_decode,
    fused_decode_supported,
    read_states,
)
from jtp.models.layers import (
    apply_rope,
    gated_rms_norm,
    linear,
    mrope_cos_sin,
    project,
    project_columns,
    rms_norm_zero_centered,
    rope_cos_sin,
    swiglu_mlp,
    take_columns,
)
from jtp.models.moe import EXPERTS_IN_AXES, EXPERTS_OUT_AXES, RoutedExperts
from jtp.parallel.rules import sharded_zeros

class DeltaNetState(NamedTuple):
    """Per-sequence state of one DeltaNet layer: `num_state_slots` slots and a scratch slot last.

    conv_*: the last K-1 pre-conv inputs of the q, k and v channels [slots, channels, K-1]
    (oldest first; HF keeps K columns, only the last K-1 matter). recurrent: [slots, Hv, dk, dv] fp32.
    """

    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    recurrent: jax.Array


# Logical axes of the state arrays: channels (and value heads) split like the weights that make them.
STATE_AXES = DeltaNetState(
    conv_q=("state_slots", "gdn_k_heads_x_dim", "conv_taps"),
    conv_k=("state_slots", "gdn_k_heads_x_dim", "conv_taps"),
    conv_v=("state_slots", "gdn_v_heads_x_dim", "conv_taps"),
    recurrent=("state_slots", "gdn_v_heads", "gdn_k_dim", "gdn_v_dim"),
)


def _slot_state(state: jax.Array, rows: RowLayout) -> jax.Array:
    return read_states(state, rows.read_slots, rows.fresh)


# ----------------------------------------------------------------------------- DeltaNet math


def causal_conv(x: jax.Array, weight: jax.Array, state: jax.Array, rows: RowLayout):
    """Depthwise causal conv + silu of each row's channels, continuing from the slot state.

    x [T, C] pre-conv inputs; weight [C, K]; state [slots, C, K-1].
    Returns the outputs [B, L, C] and the updated state array.
    """
    K = weight.shape[1]
    xs = jnp.where(rows.valid[..., None], x[rows.gather], 0)  # [B, L, C]
    prev = _slot_state(state, rows).swapaxes(1, 2).astype(xs.dtype)  # [B, K-1, C]
    full = jnp.concatenate([prev, xs], axis=1)  # [B, K-1+L, C]; full[:, s] is token s-(K-1)
    L = xs.shape[1]
    w = weight.astype(jnp.float32)
    out = sum(full[:, j : j + L].astype(jnp.float32) * w[:, j] for j in range(K))
    # The new state is the K-1 inputs before each row's end: full[len .. len+K-2].
    def tail(lens):  # the K-1 inputs before each row's token `lens`, as a state [B, C, K-1]
        cols = jnp.take_along_axis(full, (lens[:, None] + jnp.arange(K - 1))[:, :, None], axis=1)
        return cols.swapaxes(1, 2).astype(state.dtype)

    state = set_rows(state, rows.write_slots, tail(rows.valid.sum(axis=1)))
    if rows.keep_slots is not None:
        state = set_rows(state, rows.keep_slots, tail(rows.keep_lens))
    return jax.nn.silu(out), state


def conv_step(x: jax.Array, weight: jax.Array, state: jax.Array, rows: RowLayout):
    """`causal_conv` for rows of at most one token (L = 1): a conv-state update.

    x [T, C]; weight [C, K]; state [slots, C, K-1]. Returns the outputs [B, 1, C] and the state.
    Same arithmetic, in the same order, as `causal_conv`.
    """
    K = weight.shape[1]
    xs = jnp.where(rows.valid, x[rows.gather[:, 0]], 0)  # [B, C]; zero for empty rows
    full = jnp.concatenate([_slot_state(state, rows).astype(xs.dtype), xs[:, :, None]], axis=2)  # [B, C, K]
    w = weight.astype(jnp.float32)
    out = sum(full[:, :, j].astype(jnp.float32) * w[:, j] for j in range(K))
    # Empty rows write the scratch slot (write_slots), so the K-1 newest inputs are the new state.
    state = set_rows(state, rows.write_slots, full[:, :, 1:])
    return jax.nn.silu(out)[:, None], state


def _l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_deltanet(p: dict, cfg: ModelConfig, x, state: DeltaNetState, rows: RowLayout | SplitRows, chunk: int,
                   attend: PagedAttention):
    """One DeltaNet mixer over the flat tokens x [T, H]. A layout's rows.valid is [B, L]: L = 1 takes
    the single-step recurrence, L > 1 the chunked rule (L a multiple of chunk)."""
    T = x.shape[0]
    Hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    q, k, v, z, a, b = project_columns(x, p, "gdn_q", "gdn_k", "gdn_v", "gdn_z", "gdn_a", "gdn_b")
    z = take_columns(z)
    columns = (q, k, v, a, b)
    if isinstance(rows, SplitRows):  # the multi-token rows first, then every lone token
        o_many, state = _mix(p, cfg, columns, state, rows.many, chunk, attend)
        o_one, state = _mix(p, cfg, columns, state, rows.one, chunk, attend)
        o = jnp.where(rows.single[:, None, None], o_one[rows.one.token_row, 0],
                      o_many[rows.many.token_row, rows.many.token_t])
    else:
        o, state = _mix(p, cfg, columns, state, rows, chunk, attend)
        o = o[rows.token_row, rows.token_t]  # back to the flat order [T, Hv, dv]
    o = gated_rms_norm(o.astype(x.dtype), z.reshape(T, Hv, dv), p["gdn_norm"], cfg.rms_norm_eps).reshape(T, Hv * dv)
    return linear(o, p["gdn_out"]), state


def _mix(p: dict, cfg: ModelConfig, columns, state: DeltaNetState, rows: RowLayout, chunk: int, attend: PagedAttention):
    """The conv and recurrence of one row layout -> (o [B, L, Hv, dv], the new state): the two decode
    kernels where they run (L = 1), else `deltanet_mixer`."""
    q, k, v, a, b = columns
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if rows.valid.shape[1] == 1 and fused_decode_supported(attend, dk, dv, cfg.linear_num_key_heads, q[2], k[2], v[2]):
        convs = (p["gdn_conv_q"], p["gdn_conv_k"], p["gdn_conv_v"])
        o, conv_states, recurrent = fused_decode(
            columns, convs, state[:3], p["gdn_A_log"], p["gdn_dt_bias"], state.recurrent,
            (rows.gather[:, 0], rows.valid[:, 0], rows.read_slots, rows.fresh, rows.write_slots), attend)
        return o[:, None], DeltaNetState(*conv_states, recurrent)
    return deltanet_mixer(p, cfg, *map(take_columns, columns), state, rows, chunk, attend)


def deltanet_mixer(p: dict, cfg: ModelConfig, q, k, v, a, b, state: DeltaNetState, rows: RowLayout, chunk: int,
                   attend: PagedAttention | None = None):
    """`gated_deltanet`'s conv, gates and recurrence in jnp (`fused_decode`'s reference for L = 1):
    q, k, v [T, C] the projections before the conv, a, b [T, Hv] -> (o [B, L, Hv, dv] fp32, the new state).
    With attend on the kernel path, the chunked rule's loop runs as a kernel (`chunk_kernel_supported`)."""
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    B, L = rows.valid.shape
    conv = conv_step if L == 1 else causal_conv
    dtype = q.dtype
    q, conv_q = conv(q, p["gdn_conv_q"], state.conv_q, rows)
    k, conv_k = conv(k, p["gdn_conv_k"], state.conv_k, rows)
    v, conv_v = conv(v, p["gdn_conv_v"], state.conv_v, rows)
    # Activation-dtype conv outputs, as in HF, then fp32 for the recurrence.
    q, k, v = (u.astype(dtype).astype(jnp.float32) for u in (q, k, v))

    # Key head h serves value heads h*r .. h*r+r-1.
    r = Hv // Hk
    q = jnp.repeat(_l2_normalize(q.reshape(B, L, Hk, dk)) * dk**-0.5, r, axis=2)
    k = jnp.repeat(_l2_normalize(k.reshape(B, L, Hk, dk)), r, axis=2)
    v = v.reshape(B, L, Hv, dv)

    beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [T, Hv]
    dt = a.astype(jnp.float32) + p["gdn_dt_bias"].astype(jnp.float32)
    g = -jnp.exp(p["gdn_A_log"].astype(jnp.float32)) * jax.nn.softplus(dt)
    valid = rows.valid[..., None]
    k = jnp.where(valid[..., None], k, 0.0)
    beta = jnp.where(valid, beta[rows.gather], 0.0)
    g = jnp.where(valid, g[rows.gather], 0.0)

    if L == 1:  # the state read from its slot, one step, written to its slot
        o, recurrent = decode_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent, rows.read_slots,
                                   rows.fresh, rows.write_slots)
        o = o[:, None]
    else:
        # The step's T flat tokens bound its rows' lengths: rows are disjoint slices of them.
        args = (q, k, v, g, beta, _slot_state(state.recurrent, rows), chunk, rows.keep_lens, rows.valid.sum(-1))
        if attend is not None and chunk_kernel_supported(attend, chunk, dk, dv, Hk):
            o, final, kept = chunked_rule_kernel(attend, *args, max_tokens=a.shape[0])
        else:
            o, final, kept = chunked_gated_delta_rule(*args, max_tokens=a.shape[0])
        recurrent = set_rows(state.recurrent, rows.write_slots, final)
        if rows.keep_slots is not None:  # (verify rows always have several tokens: never L = 1)
            recurrent = set_rows(recurrent, rows.keep_slots, kept)
    return o, DeltaNetState(conv_q, conv_k, conv_v, recurrent)


# ----------------------------------------------------------------------------- attention, FFN


def gated_attention(
    p: dict, cfg: ModelConfig, x, cos, sin, kv: LayerKV, meta: AttentionMetadata, attend: PagedAttention
):
    T, D = x.shape[0], cfg.head_dim
    qg, k, v = project(x, p, "q_proj", "k_proj", "v_proj")
    qg, k, v = qg.reshape(T, -1, 2 * D), k.reshape(T, -1, D), v.reshape(T, -1, D)  # qg per head: [q_h | gate_h]
    q, gate = qg[..., :D], qg[..., D:]
    q = apply_rope(rms_norm_zero_centered(q, p["q_norm"], cfg.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm_zero_centered(k, p["k_norm"], cfg.rms_norm_eps), cos, sin)
    kv = write_kv(kv, k, v, meta.slot_mapping)
    o, kv = attend(q, kv, meta, scale=D**-0.5)
    o = o * jax.nn.sigmoid(gate)
    return linear(o.reshape(T, -1), p["o_proj"]), kv


def feed_forward(p: dict, cfg: ModelConfig, x, routed: RoutedExperts, real_tokens):
    y = qwen3.feed_forward(p, cfg, x, routed, real_tokens)  # SwiGLU MLP or routed experts
    if "shared_down" in p:  # MoE layers' sigmoid-gated shared expert (its gate and up may be fused)
        shared = swiglu_mlp(x, p, "shared_gate", "shared_up", "shared_down")
        y = y + jax.nn.sigmoid(linear(x, p["shared_expert_gate"])) * shared
    return y


# ----------------------------------------------------------------------------- the model


def embed(params: dict, cfg: ModelConfig, tokens, meta: AttentionMetadata):
    """tokens [T] -> the first layer's input [T, H]: image tokens take their rows of the encoder's pool."""
    del cfg
    x = params["embed"][tokens]
    if meta.image_rows is not None:
        image = meta.image_rows >= 0
        x = jnp.where(image[:, None], params["image_pool"][jnp.where(image, meta.image_rows, 0)].astype(x.dtype), x)
    return x


def decoder_layers(
    params: dict, cfg: ModelConfig, x, cache: list, meta: AttentionMetadata, attend: PagedAttention,
    routed: RoutedExperts, layer_ids: range,
):
    """Layers `layer_ids` (all of them, or a pipeline stage's) over x [T, H]; `cache` holds their K/V
    pages or slot states in that order. Returns x and the updated cache."""
    T = x.shape[0]
    if meta.rope_positions is None:
        cos, sin = rope_cos_sin(meta.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype, cfg.rope_yarn)
    else:  # M-RoPE: text and image tokens' three position rows
        cos, sin = mrope_cos_sin(meta.rope_positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section, x.dtype)
    length, chunk = deltanet_row_length(meta, T)
    real_tokens = meta.slot_mapping >= 0  # padding tokens (-1) route to no expert
    rows = None
    new_cache, delta = [], jnp.zeros_like(x)  # as qwen3's: each layer adds the last one's FFN output
    for i, layer_cache in zip(layer_ids, cache, strict=True):
        p = params["layers"][i]
        if cfg.is_linear_layer(i):
            if rows is None:
                rows = deltanet_rows(meta, T, length, layer_cache.recurrent.shape[0])
            x, delta, layer_cache = deltanet_layer(p, x, delta, layer_cache, rows, real_tokens, cfg=cfg, chunk=chunk,
                                                   attend=attend, routed=routed)
        else:
            x, delta, layer_cache = attention_layer(p, x, delta, cos, sin, layer_cache, meta, real_tokens, cfg=cfg,
                                                    attend=attend, routed=routed)
        new_cache.append(layer_cache)
    return x + delta, new_cache


def final_norm(params: dict, cfg: ModelConfig, x):
    return rms_norm_zero_centered(x, params["final_norm"], cfg.rms_norm_eps)


def forward(
    params: dict, cfg: ModelConfig, tokens, cache: list, meta: AttentionMetadata, attend: PagedAttention,
    routed: RoutedExperts,
):
    """tokens [T] -> final hidden states [T, H] and the updated cache (K/V pages and slot states)."""
    x = embed(params, cfg, tokens, meta)
    x, cache = decoder_layers(params, cfg, x, cache, meta, attend, routed, range(cfg.num_layers))
    return final_norm(params, cfg, x), cache


def _norm(x, delta, weight, cfg: ModelConfig, attend: PagedAttention):
    """(x + delta, Norm(x + delta)): one kernel on GPUs (qwen3.add_rms_norm)."""
    return qwen3.add_rms_norm(x, delta, weight, cfg.rms_norm_eps, attend, zero_centered=True)


# Each layer is a jitted call, so a step traces and lowers one layer of each kind rather than all
# of them (start-up time); XLA inlines the calls into the same program.
@functools.partial(jax.jit, static_argnames=("cfg", "chunk", "attend", "routed"))
def deltanet_layer(p: dict, x, delta, cache, rows, real_tokens, *, cfg: ModelConfig, chunk: int,
                   attend: PagedAttention, routed: RoutedExperts):
    """x <- x + delta (the previous layer's FFN output); h = x + GatedDeltaNet(Norm(x)).  Returns h,
    FFN(Norm(h)) (the next layer's delta) and the layer's updated state."""
    x, normed = _norm(x, delta, p["input_norm"], cfg, attend)
    a, layer_cache = gated_deltanet(p, cfg, normed, cache, rows, chunk, attend)
    h, normed = _norm(x, a, p["post_norm"], cfg, attend)
    return h, feed_forward(p, cfg, normed, routed, real_tokens), layer_cache


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "routed"))
def attention_layer(p: dict, x, delta, cos, sin, kv: LayerKV, meta: AttentionMetadata, real_tokens, *,
                    cfg: ModelConfig, attend: PagedAttention, routed: RoutedExperts):
    """x <- x + delta (the previous layer's FFN output); h = x + GatedAttention(Norm(x)).  Returns h,
    FFN(Norm(h)) (the next layer's delta) and the layer's updated KV."""
    x, normed = _norm(x, delta, p["input_norm"], cfg, attend)
    a, kv = gated_attention(p, cfg, normed, cos, sin, kv, meta, attend)
    h, normed = _norm(x, a, p["post_norm"], cfg, attend)
    return h, feed_forward(p, cfg, normed, routed, real_tokens), kv


def mtp_forward(
    params: dict, cfg: ModelConfig, hidden, next_tokens, kv: LayerKV, meta: AttentionMetadata, attend: PagedAttention,
    routed: RoutedExperts,
):
    """The multi-token-prediction head: (target hidden h_t [T, H], token t+1 [T]) at position t ->
    its hidden state [T, H] (the shared lm_head turns it into a guess for token t+2), and its K/V.

        x = fc([RMSNorm_e(Embed(x_{t+1})); RMSNorm_h(h_t)])
        one full-attention decoder layer over x (own paged K/V, same slots as the target's), RMSNorm

    `hidden` is the target's final-normed output, as vLLM's Qwen3-Next / Qwen3.5 MTP takes it.
    """
    m, eps = params["mtp"], cfg.rms_norm_eps
    embedded = rms_norm_zero_centered(params["embed"][next_tokens], m["pre_fc_norm_embedding"], eps)
    x = linear(jnp.concatenate([embedded, rms_norm_zero_centered(hidden, m["pre_fc_norm_hidden"], eps)], -1), m["fc"])
    cos, sin = rope_cos_sin(meta.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype, cfg.rope_yarn)
    x, delta, kv = attention_layer(m["layer"], x, jnp.zeros_like(x), cos, sin, kv, meta, meta.slot_mapping >= 0,
                                   cfg=cfg, attend=attend, routed=routed)
    return rms_norm_zero_centered(x + delta, m["norm"], eps), kv


compute_logits = qwen3.compute_logits  # the same LM head (tied or not)
uses_row_len_bound = True  # the DeltaNet layers chunk each row by it
lays_out_long_rows_apart = True  # a prompt step holds at most `long_rows` rows of several tokens


def init_cache(cfg: ModelConfig, mesh, num_blocks: int, block_size: int, num_state_slots: int, dtype,
               kv_dtype=None, layer_ids: range | None = None) -> list:
    """Paged K/V for full-attention layers; zeroed slot states for DeltaNet layers (of `layer_ids`,
    default every layer): the pool's `num_state_slots` slots, then a scratch slot padding rows write."""
    K = cfg.linear_conv_kernel_dim
    slots = num_state_slots + 1
    shapes = DeltaNetState(
        conv_q=(slots, cfg.linear_key_dim, K - 1),
        conv_k=(slots, cfg.linear_key_dim, K - 1),
        conv_v=(slots, cfg.linear_value_dim, K - 1),
        recurrent=(slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
    )
    dtypes = DeltaNetState(dtype, dtype, dtype, jnp.float32)  # the recurrence is fp32
    cache = []
    for i in range(cfg.num_layers) if layer_ids is None else layer_ids:
        if cfg.is_linear_layer(i):
            cache.append(DeltaNetState(*(
                sharded_zeros(mesh, f"layer {i} {name} state", shape, axes, dt)
                for name, shape, axes, dt in zip(DeltaNetState._fields, shapes, STATE_AXES, dtypes)
            )))
        else:
            cache.append(zeroed_layer_kv(cfg, mesh, num_blocks, block_size, kv_dtype or dtype))
    return cache


def _deltanet_layout(cfg: ModelConfig, la: str) -> dict[str, Source]:
    """The DeltaNet projections, split out of the fused checkpoint tensors into q|k|v|z|b|a."""
    H, K = cfg.hidden_size, cfg.linear_conv_kernel_dim
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd, vd, r = cfg.linear_key_dim, cfg.linear_value_dim, Hv // Hk
    C = 2 * kd + vd
    conv = (la + "conv1d.weight", (C, 1, K))
    k_rows, v_rows = ("gdn_k_heads_x_dim", "embed"), ("gdn_v_heads_x_dim", "embed")  # by key / value heads
    v_heads = ("gdn_v_heads", "embed")
    entries: dict[str, Source] = {
        # conv1d channels are [Q | K | V] in both families.
        "gdn_conv_q": Segment(*conv, 0, kd, ("gdn_k_heads_x_dim", "conv_taps"), squeeze=True),
        "gdn_conv_k": Segment(*conv, kd, kd, ("gdn_k_heads_x_dim", "conv_taps"), squeeze=True),
        "gdn_conv_v": Segment(*conv, 2 * kd, vd, ("gdn_v_heads_x_dim", "conv_taps"), squeeze=True),
        "gdn_A_log": Tensor(la + "A_log", (Hv,), ("gdn_v_heads",)),
        "gdn_dt_bias": Tensor(la + "dt_bias", (Hv,), ("gdn_v_heads",)),
        "gdn_norm": Tensor(la + "norm.weight", (dv,), ("gdn_v_dim",)),
        "gdn_out": Tensor(la + "out_proj.weight", (H, vd), ("embed", "gdn_v_heads_x_dim")),
    }
    if cfg.model_type == "qwen3_next":
        # Grouped per key head g: qkvz rows [q_g (dk) | k_g (dk) | v_g (r dv) | z_g (r dv)], ba rows [b_g (r) | a_g (r)].
        G = 2 * dk + 2 * r * dv
        qkvz = (la + "in_proj_qkvz.weight", (Hk * G, H))
        ba = (la + "in_proj_ba.weight", (2 * Hv, H))
        entries |= {
            "gdn_q": StridedRows(*qkvz, rows=kd, run=dk, stride=G, offset=0, axes=k_rows),
            "gdn_k": StridedRows(*qkvz, rows=kd, run=dk, stride=G, offset=dk, axes=k_rows),
            "gdn_v": StridedRows(*qkvz, rows=vd, run=r * dv, stride=G, offset=2 * dk, axes=v_rows),
            "gdn_z": StridedRows(*qkvz, rows=vd, run=r * dv, stride=G, offset=2 * dk + r * dv, axes=v_rows),
            "gdn_b": StridedRows(*ba, rows=Hv, run=r, stride=2 * r, offset=0, axes=v_heads),
            "gdn_a": StridedRows(*ba, rows=Hv, run=r, stride=2 * r, offset=r, axes=v_heads),
        }
    else:
        qkv = (la + "in_proj_qkv.weight", (C, H))
        entries |= {
            "gdn_q": Segment(*qkv, 0, kd, k_rows),
            "gdn_k": Segment(*qkv, kd, kd, k_rows),
            "gdn_v": Segment(*qkv, 2 * kd, vd, v_rows),
            "gdn_z": Tensor(la + "in_proj_z.weight", (vd, H), v_rows),
            "gdn_b": Tensor(la + "in_proj_b.weight", (Hv, H), v_heads),
            "gdn_a": Tensor(la + "in_proj_a.weight", (Hv, H), v_heads),
        }
    return entries


def _moe_layout(cfg: ModelConfig, mlp: str) -> dict[str, Source]:
    H, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    # Qwen3.5-MoE checkpoints fuse the experts on disk; Qwen3-Next (and HF's save_pretrained) write
    # them one by one. Accept both, preferring the family's usual form.
    fused = {
        "experts_gate": FusedExperts(mlp + "experts.gate_up_proj", (E, 2 * I, H), 0, I, EXPERTS_IN_AXES),
        "experts_up": FusedExperts(mlp + "experts.gate_up_proj", (E, 2 * I, H), I, I, EXPERTS_IN_AXES),
        "experts_down": FusedExperts(mlp + "experts.down_proj", (E, H, I), 0, H, EXPERTS_OUT_AXES),
    }
    split = qwen3.stacked_experts_layout(mlp, cfg)
    first, second = (split, fused) if cfg.model_type == "qwen3_next" else (fused, split)
    entries: dict[str, Source] = {k: FirstPresent((first[k], second[k])) for k in fused}
    entries["router"] = Tensor(mlp + "gate.weight", (E, H), ("scores", "embed"))
    if Is:
        entries |= {
            "shared_gate": Tensor(mlp + "shared_expert.gate_proj.weight", (Is, H), ("mlp", "embed")),
            "shared_up": Tensor(mlp + "shared_expert.up_proj.weight", (Is, H), ("mlp", "embed")),
            "shared_down": Tensor(mlp + "shared_expert.down_proj.weight", (H, Is), ("embed", "mlp")),
            "shared_expert_gate": Tensor(mlp + "shared_expert_gate.weight", (1, H), ("scores", "embed")),
        }
    return entries


def param_layout(cfg: ModelConfig, tp: int = 1, mtp: bool = False) -> dict[str, Source]:
    """Parameter path -> where it comes from in a HF Qwen3-Next / Qwen3.5 checkpoint; with `mtp`,
    also the checkpoint's multi-token-prediction head (mtp.*, the speculative drafter)."""
    H = cfg.hidden_size
    layout = qwen3.embedding_layout(cfg)
    for i in range(cfg.num_layers):
        entries = _decoder_layer_layout(
            cfg, tp, f"{cfg.checkpoint_prefix}layers.{i}.", cfg.is_linear_layer(i), cfg.is_moe_layer(i)
        )
        layout.update({f"layers.{i}.{k}": v for k, v in entries.items()})
    if mtp:
        # fc [H, 2H] over [norm_e(embed(next token)); norm_h(hidden)], one full-attention decoder
        # layer with its own K/V, a final norm; the embedding and lm_head are the model's.
        layout |= {
            "mtp.fc": Tensor("mtp.fc.weight", (H, 2 * H), ("embed", "embed_concat")),
            "mtp.pre_fc_norm_embedding": Tensor("mtp.pre_fc_norm_embedding.weight", (H,), ("embed",)),
            "mtp.pre_fc_norm_hidden": Tensor("mtp.pre_fc_norm_hidden.weight", (H,), ("embed",)),
            "mtp.norm": Tensor("mtp.norm.weight", (H,), ("embed",)),
        }
        layer = _decoder_layer_layout(cfg, tp, "mtp.layers.0.", linear=False, moe=cfg.num_experts > 0)
        layout.update({f"mtp.layer.{k}": v for k, v in layer.items()})
    return layout


def _decoder_layer_layout(cfg: ModelConfig, tp: int, hf: str, linear: bool, moe: bool) -> dict[str, Source]:
    H, D = cfg.hidden_size, cfg.head_dim
    kv = qwen3.kv_source(cfg, tp)
    entries: dict[str, Source] = {
        "input_norm": Tensor(hf + "input_layernorm.weight", (H,), ("embed",)),
        "post_norm": Tensor(hf + "post_attention_layernorm.weight", (H,), ("embed",)),
    }
    if linear:
        entries |= _deltanet_layout(cfg, hf + "linear_attn.")
    else:
        attn = hf + "self_attn."
        entries |= {
            # [q_h | gate_h] per head: still head-major, so split by heads like any q projection.
            "q_proj": Tensor(attn + "q_proj.weight", (2 * cfg.q_size, H), ("q_heads_x_dim", "embed")),
            "k_proj": kv(attn + "k_proj.weight", (cfg.kv_size, H), ("kv_heads_x_dim", "embed")),
            "v_proj": kv(attn + "v_proj.weight", (cfg.kv_size, H), ("kv_heads_x_dim", "embed")),
            "o_proj": Tensor(attn + "o_proj.weight", (H, cfg.q_size), ("embed", "q_heads_x_dim")),
            "q_norm": Tensor(attn + "q_norm.weight", (D,), ("head_dim",)),
            "k_norm": Tensor(attn + "k_norm.weight", (D,), ("head_dim",)),
        }
    mlp = hf + "mlp."
    return entries | (_moe_layout(cfg, mlp) if moe else qwen3.mlp_layout(mlp, cfg))
