"""Qwen3 (dense and MoE) and Qwen2/2.5 forward pass over a flat, ragged batch of tokens.

    x = Embed[ids]
    per layer:  h = x + Attn(RMSNorm(x));   x = h + FFN(RMSNorm(h))
    logits = lm_head(RMSNorm(x))

Each residual add is done with the RMSNorm that follows it (one kernel on GPUs), so a layer hands
the next one its FFN output apart from h (`decoder_layer`).

Attn: q/k/v projections (+ bias for Qwen2), per-head RMSNorm on q and k (Qwen3), RoPE,
paged causal GQA; FFN: SwiGLU MLP, or top-k routed experts on MoE layers.
Params are a pytree (see `param_layout`, which also names each weight's logical axes for
jtp/parallel/rules.py). The loop over layers is unrolled in Python: XLA streams the weights far
better that way than through lax.scan (docs/bench/h200.md, "Unrolled layers"). Each layer is a
jitted call, so a step traces and lowers one layer of each kind rather than all of them (start-up
time), and XLA inlines the calls into the same program as before.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jtp.config.model_config import ModelConfig
from jtp.errors import CheckpointError
from jtp.kernels import add_rms_norm as fused_norm
from jtp.loading.sources import RepeatedHeads, Source, StackedExperts, Tensor
from jtp.models.attention import (
    AttentionMetadata,
    LayerKV,
    PagedAttention,
    zeroed_layer_kv,
)
from jtp.models.layers import (
    linear,
    project,
    rms_norm,
    rms_norm_zero_centered,
    rope_cos_sin,
    swiglu_mlp,
)
from jtp.models.moe import EXPERTS_IN_AXES, EXPERTS_OUT_AXES, RoutedExperts
from jtp.parallel.sharding import kv_head_replicas, on_each_copy


def attention(p: dict, cfg: ModelConfig, x, cos, sin, kv: LayerKV, meta: AttentionMetadata, attend: PagedAttention):
    T, D = x.shape[0], cfg.head_dim
    q, k, v = (y.reshape(T, -1, D) for y in project(x, p, "q_proj", "k_proj", "v_proj"))
    # q, k = RoPE(RMSNorm(q)), RoPE(RMSNorm(k)) (the norms on Qwen3 only); k, v into the cache.
    q, kv = attend.rope_and_write(q, k, v, kv, meta, cos, sin, p.get("q_norm"), p.get("k_norm"), cfg.rms_norm_eps)
    o, kv = attend(q, kv, meta, scale=D**-0.5)
    return linear(o.reshape(T, -1), p["o_proj"], p.get("o_bias")), kv


def feed_forward(p: dict, cfg: ModelConfig, x, routed: RoutedExperts, real_tokens):
    if "router" not in p:  # a dense layer
        return swiglu_mlp(x, p)
    weights, experts = routed.route(x, p["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    return routed(x, weights, experts, p["experts_gate"], p["experts_up"], p["experts_down"], real_tokens)


def add_rms_norm(x, delta, weight, eps: float, attend: PagedAttention, zero_centered: bool = False):
    """(h, RMSNorm(h)) for h = x + delta (`rms_norm_zero_centered` with zero_centered: the hybrids'):
    one kernel where the attention kernels run (attend.impl "kernel") and the step has few tokens;
    under tensor parallelism each device runs it on its copy of the (replicated) activations."""
    if attend.impl != "kernel" or not fused_norm.supported(*x.shape):
        h = x + delta
        return h, (rms_norm_zero_centered if zero_centered else rms_norm)(h, weight, eps)
    norm = functools.partial(fused_norm.add_rms_norm, eps=eps, zero_centered=zero_centered,
                             interpret=jax.default_backend() != "gpu")
    return on_each_copy(norm, attend.mesh, x, delta, weight)


@functools.partial(jax.jit, static_argnames=("cfg", "attend", "routed"))
def decoder_layer(p: dict, x, delta, cos, sin, kv: LayerKV, meta: AttentionMetadata, real_tokens, *,
                  cfg: ModelConfig, attend: PagedAttention, routed: RoutedExperts):
    """x <- x + delta (the previous layer's FFN output, zeros in the first: added here with the norm after it);
    h = x + Attn(RMSNorm(x));  returns h, FFN(RMSNorm(h)) (the next layer's delta) and the layer's KV."""
    x, normed = add_rms_norm(x, delta, p["input_norm"], cfg.rms_norm_eps, attend)
    a, kv = attention(p, cfg, normed, cos, sin, kv, meta, attend)
    h, normed = add_rms_norm(x, a, p["post_norm"], cfg.rms_norm_eps, attend)
    return h, feed_forward(p, cfg, normed, routed, real_tokens), kv


def embed(params: dict, cfg: ModelConfig, tokens, meta: AttentionMetadata):
    """tokens [T] -> the first layer's input [T, H]."""
    del cfg, meta  # (the hybrids' images are read here)
    return params["embed"][tokens]


def decoder_layers(
    params: dict, cfg: ModelConfig, x, cache: list[LayerKV], meta: AttentionMetadata, attend: PagedAttention,
    routed: RoutedExperts, layer_ids: range,
):
    """Layers `layer_ids` (all of them, or a pipeline stage's) over x [T, H]; `cache` holds their
    K/V in that order. Returns x and the updated K/V."""
    cos, sin = rope_cos_sin(meta.positions, cfg.head_dim, cfg.rope_theta, x.dtype, cfg.rope_yarn)
    real_tokens = meta.slot_mapping >= 0  # padding tokens (-1) route to no expert
    new_cache, delta = [], jnp.zeros_like(x)  # every layer one trace: the first adds zeros
    for i, kv in zip(layer_ids, cache, strict=True):
        x, delta, kv = decoder_layer(params["layers"][i], x, delta, cos, sin, kv, meta, real_tokens, cfg=cfg,
                                     attend=attend, routed=routed)
        new_cache.append(kv)
    return x + delta, new_cache


def final_norm(params: dict, cfg: ModelConfig, x):
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps)


def forward(
    params: dict, cfg: ModelConfig, tokens, kv_cache: list[LayerKV], meta: AttentionMetadata, attend: PagedAttention,
    routed: RoutedExperts,
):
    """tokens [T] -> final hidden states [T, H] and the updated KV cache."""
    x = embed(params, cfg, tokens, meta)
    x, kv_cache = decoder_layers(params, cfg, x, kv_cache, meta, attend, routed, range(cfg.num_layers))
    return final_norm(params, cfg, x), kv_cache


def compute_logits(params: dict, hidden) -> jax.Array:
    """hidden [N, H] -> float32 logits [N, V] (tied embeddings reuse the embedding table)."""
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    return linear(hidden, head).astype(jnp.float32)


def init_cache(cfg: ModelConfig, mesh, num_blocks: int, block_size: int, num_state_slots: int, dtype,
               kv_dtype=None, layer_ids: range | None = None) -> list[LayerKV]:
    """Zeroed paged K/V for layers `layer_ids` (default: every layer)."""
    del num_state_slots  # no per-sequence state beyond the pages
    layer_ids = range(cfg.num_layers) if layer_ids is None else layer_ids
    return [zeroed_layer_kv(cfg, mesh, num_blocks, block_size, kv_dtype or dtype) for _ in layer_ids]


mtp_forward = None  # these checkpoints have no multi-token-prediction head
uses_row_len_bound = False  # no layer here reads meta.query_bound
lays_out_long_rows_apart = False


def param_layout(cfg: ModelConfig, tp: int = 1, mtp: bool = False) -> dict[str, Source]:
    """Parameter path -> where it comes from in a HF Qwen3/Qwen3-MoE/Qwen2 checkpoint."""
    if mtp:
        raise CheckpointError(f"{cfg.model_type} checkpoints have no multi-token-prediction head")
    H, D = cfg.hidden_size, cfg.head_dim
    kv = kv_source(cfg, tp)
    layout = embedding_layout(cfg)
    for i in range(cfg.num_layers):
        hf = f"{cfg.checkpoint_prefix}layers.{i}."
        attn = hf + "self_attn."
        entries: dict[str, Source] = {
            "input_norm": Tensor(hf + "input_layernorm.weight", (H,), ("embed",)),
            "post_norm": Tensor(hf + "post_attention_layernorm.weight", (H,), ("embed",)),
            "q_proj": Tensor(attn + "q_proj.weight", (cfg.q_size, H), ("q_heads_x_dim", "embed")),
            "k_proj": kv(attn + "k_proj.weight", (cfg.kv_size, H), ("kv_heads_x_dim", "embed")),
            "v_proj": kv(attn + "v_proj.weight", (cfg.kv_size, H), ("kv_heads_x_dim", "embed")),
            "o_proj": Tensor(attn + "o_proj.weight", (H, cfg.q_size), ("embed", "q_heads_x_dim")),
        }
        if cfg.qkv_bias:
            entries["q_bias"] = Tensor(attn + "q_proj.bias", (cfg.q_size,), ("q_heads_x_dim",))
            entries["k_bias"] = kv(attn + "k_proj.bias", (cfg.kv_size,), ("kv_heads_x_dim",))
            entries["v_bias"] = kv(attn + "v_proj.bias", (cfg.kv_size,), ("kv_heads_x_dim",))
        if cfg.o_bias:
            entries["o_bias"] = Tensor(attn + "o_proj.bias", (H,), ("embed",))
        if cfg.qk_norm:
            entries["q_norm"] = Tensor(attn + "q_norm.weight", (D,), ("head_dim",))
            entries["k_norm"] = Tensor(attn + "k_norm.weight", (D,), ("head_dim",))
        mlp = hf + "mlp."
        if cfg.is_moe_layer(i):
            entries["router"] = Tensor(mlp + "gate.weight", (cfg.num_experts, H), ("scores", "embed"))
            entries |= stacked_experts_layout(mlp, cfg)
        else:
            entries |= mlp_layout(mlp, cfg)
        layout.update({f"layers.{i}.{k}": v for k, v in entries.items()})
    return layout


# Layout pieces the hybrid family shares.


def embedding_layout(cfg: ModelConfig) -> dict[str, Source]:
    """The embedding, the final norm and (unless tied) the LM head."""
    H, V, prefix = cfg.hidden_size, cfg.vocab_size, cfg.checkpoint_prefix
    layout: dict[str, Source] = {
        "embed": Tensor(prefix + "embed_tokens.weight", (V, H), ("vocab", "embed")),
        "final_norm": Tensor(prefix + "norm.weight", (H,), ("embed",)),
    }
    if not cfg.tie_word_embeddings:
        layout["lm_head"] = Tensor("lm_head.weight", (V, H), ("vocab", "embed"))
    return layout


def kv_source(cfg: ModelConfig, tp: int):
    """(name, shape, axes) -> the Source of a k/v projection, its heads repeated when tp > KV heads."""
    replicas = kv_head_replicas(cfg, tp)

    def kv(name: str, shape: tuple[int, ...], axes: tuple[str, ...]) -> Source:
        return Tensor(name, shape, axes) if replicas == 1 else RepeatedHeads(name, shape, cfg.head_dim, replicas, axes)

    return kv


def mlp_layout(mlp: str, cfg: ModelConfig) -> dict[str, Source]:
    """A dense SwiGLU MLP."""
    H, I = cfg.hidden_size, cfg.intermediate_size
    return {
        "gate_proj": Tensor(mlp + "gate_proj.weight", (I, H), ("mlp", "embed")),
        "up_proj": Tensor(mlp + "up_proj.weight", (I, H), ("mlp", "embed")),
        "down_proj": Tensor(mlp + "down_proj.weight", (H, I), ("embed", "mlp")),
    }


def stacked_experts_layout(mlp: str, cfg: ModelConfig) -> dict[str, Source]:
    """Routed experts stored one by one (mlp.experts.{e}.*_proj), stacked [E, in, out] for grouped matmuls."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    experts = [f"{mlp}experts.{e}." for e in range(cfg.num_experts)]

    def stacked(proj: str, shape: tuple[int, int], axes: tuple[str, ...]) -> StackedExperts:
        return StackedExperts(tuple(x + proj + ".weight" for x in experts), shape, axes)

    return {
        "experts_gate": stacked("gate_proj", (I, H), EXPERTS_IN_AXES),
        "experts_up": stacked("up_proj", (I, H), EXPERTS_IN_AXES),
        "experts_down": stacked("down_proj", (H, I), EXPERTS_OUT_AXES),
    }
