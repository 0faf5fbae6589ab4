#!/usr/bin/env python
"""Write a Hugging Face-format Qwen3 / Qwen3.5 model directory with random weights (for benchmarks).

    python scripts/make_random_checkpoint.py --preset qwen3-0.6b --out /tmp/qwen3-0.6b
    python scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/qwen3-8b --generator jax
    python scripts/make_random_checkpoint.py --preset qwen3.5-9b --out /tmp/qwen3.5-9b --generator jax

config.json carries the published shapes of the preset (the real Qwen3 configs; for the
hybrid Qwen3.5 presets, model_type `qwen3_5_text`, the text-only model a `qwen3_5` checkpoint
holds), and the weights are random: N(0, 0.02) for matrices and embeddings, 1 + N(0, 0.02) for
plain norm weights (Qwen3's RMSNorm, the DeltaNet gated norm), N(0, 0.02) for Qwen3.5's
zero-centred (1 + w) norms, A_log ~ N(0, 0.02) and dt_bias ~ 1 + N(0, 0.02). So the model's
output is meaningless but its cost is exactly the real model's. Nothing is downloaded: this is
how benchmark machines without network access get weights.

Tensors are generated one at a time, split into chunks that a pool of threads fills (numpy's
generators release the GIL), and written with `safetensors.numpy.save_file` in the requested
dtype. Checkpoints larger than `--shard-gib` are written as several files plus
`model.safetensors.index.json`, so host memory stays around one shard.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

# Published Qwen3 dense configs (Hugging Face Qwen/Qwen3-*), plus small ones for CPUs.
_COMMON = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    attention_bias=False,
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151645,
    head_dim=128,
    hidden_act="silu",
    initializer_range=0.02,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_scaling=None,
    rope_theta=1000000.0,
    sliding_window=None,
    use_cache=True,
    use_sliding_window=False,
    vocab_size=151936,
)

PRESETS: dict[str, dict] = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    # CPU-sized: same structure (GQA, qk-norm, untied head), seconds to run.
    "qwen3-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, vocab_size=1024, max_position_embeddings=4096,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=1023),
    "qwen3-small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=4, head_dim=64, vocab_size=8192, max_position_embeddings=8192,
                        tie_word_embeddings=True, bos_token_id=None, eos_token_id=8191),
}

# Qwen3 MoE (Qwen/Qwen3-30B-A3B's published config): every layer routes top-8 of 128 experts.
MOE_PRESETS: dict[str, dict] = {
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8),
    # Its first 4 layers (real layer shapes, 3.11 B parameters): fits one GPU in float32 for gpu_check.py.
    "qwen3-30b-a3b-4l": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=4,
                             num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8),
    # Qwen/Qwen3-235B-A22B (~470 GB in bf16, more than two H200s or a GPU host's disk): serve it with
    # `--config-only` and the engine's `--load-format dummy`, which draws the weights on the devices.
    "qwen3-235b-a22b": dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, num_experts=128,
                            num_experts_per_tok=8),
    # CPU-sized, same structure.
    "qwen3-moe-tiny": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                           num_experts_per_tok=4, vocab_size=1024, max_position_embeddings=4096,
                           bos_token_id=None, eos_token_id=1023),
}
_MOE_COMMON = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", decoder_sparse_step=1,
                   mlp_only_layers=[], norm_topk_prob=True, output_router_logits=False, router_aux_loss_coef=0.001,
                   tie_word_embeddings=False)
PRESETS.update(MOE_PRESETS)

# Qwen3.5 (Gated DeltaNet + gated attention, dense MLP), written as the text-only
# `qwen3_5_text` model (Qwen3_5ForCausalLM, tensors under `model.`). Defaults are the HF class
# defaults of Qwen3_5TextConfig (the architecture reference §1), i.e. the 9B-class shape.
_QWEN3_5_COMMON = dict(
    architectures=["Qwen3_5ForCausalLM"],
    model_type="qwen3_5_text",
    attention_bias=False,
    attention_dropout=0.0,
    attn_output_gate=True,  # ignored by HF (always on); real checkpoints carry it
    bos_token_id=None,
    eos_token_id=248044,
    full_attention_interval=4,
    head_dim=256,
    hidden_act="silu",
    hidden_size=4096,
    initializer_range=0.02,
    intermediate_size=12288,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_value_head_dim=128,
    max_position_embeddings=262144,
    num_attention_heads=16,
    num_hidden_layers=32,
    num_key_value_heads=4,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_section=[11, 11, 10], mrope_interleaved=True),
    tie_word_embeddings=False,
    use_cache=True,
    vocab_size=248320,
)

HYBRID_PRESETS: dict[str, dict] = {
    # Qwen3.5-0.8B text model (reference §1: 24 layers, H 1024, 8/2 heads, Hk = Hv = 16; 0.75 B
    # parameters, the rest of "0.8B" being the vision tower). intermediate_size
    # 3584 is ASSUMED (not in the reference); head_dim 256 and dk = dv = 128 as the family.
    "qwen3.5-0.8b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                         num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16,
                         tie_word_embeddings=True),
    # The qwen3_5_text class defaults (reference §1): H 4096, 32 layers, 16/4 heads, D 256,
    # intermediate 12288, Hk 16, Hv 32, untied. 8.95 B parameters, 17.9 GB in bf16.
    "qwen3.5-9b": dict(),
    # CPU-sized, same structure at two layers (a DeltaNet layer, then a full-attention one: each
    # layer costs compile time, and the tests need one of each), r = Hv/Hk = 2, dk != dv, rotary
    # dim 16 (mrope sections sum to 8), untied head. Seconds to run.
    "qwen3.5-tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, full_attention_interval=2,
                         num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                         linear_key_head_dim=16, linear_value_head_dim=24, vocab_size=1024,
                         max_position_embeddings=4096, eos_token_id=1023,
                         rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                                              mrope_section=[4, 2, 2], mrope_interleaved=True)),
}
PRESETS.update(HYBRID_PRESETS)

# Hybrid MoE: every layer's FFN is top-k routed experts plus a sigmoid-gated shared expert.
# Qwen3.5-MoE (qwen3_5_moe_text) stores the experts fused ([E, 2I, H] gate|up, [E, H, I] down);
# Qwen3-Next stores them one by one and packs the DeltaNet projections per key head
# (in_proj_qkvz, in_proj_ba). Shapes: the architecture reference §1.
_HYBRID_MOE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, moe_intermediate_size=512,
                   shared_expert_intermediate_size=512, norm_topk_prob=True, output_router_logits=False,
                   router_aux_loss_coef=0.001)
_QWEN3_5_MOE = dict(_HYBRID_MOE, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text")
_QWEN3_NEXT = dict(_HYBRID_MOE, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", bos_token_id=151643,
                   eos_token_id=151645, vocab_size=151936, intermediate_size=5120, decoder_sparse_step=1,
                   mlp_only_layers=[], rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                                                            partial_rotary_factor=0.25))
_TINY_HYBRID = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24, vocab_size=1024,
                    max_position_embeddings=4096, eos_token_id=1023, num_hidden_layers=2, full_attention_interval=2,
                    num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
HYBRID_MOE_PRESETS: dict[str, dict] = {
    "qwen3.5-35b-a3b": dict(_QWEN3_5_MOE, num_hidden_layers=40, num_experts=256, num_experts_per_tok=8),
    "qwen3-next-80b-a3b": dict(_QWEN3_NEXT, num_hidden_layers=48, num_experts=512, num_experts_per_tok=10),
    # Their first 4 layers (3 DeltaNet + 1 gated attention, real shapes): float32 fits one GPU (gpu_check.py).
    "qwen3.5-35b-a3b-4l": dict(_QWEN3_5_MOE, num_hidden_layers=4, num_experts=256, num_experts_per_tok=8),
    "qwen3-next-80b-a3b-4l": dict(_QWEN3_NEXT, num_hidden_layers=4, num_experts=512, num_experts_per_tok=10),
    # CPU-sized, same structures (a DeltaNet layer and a full-attention layer).
    "qwen3.5-moe-tiny": dict(_QWEN3_5_MOE, **_TINY_HYBRID, rope_parameters=dict(
        rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25, mrope_section=[4, 2, 2],
        mrope_interleaved=True)),
    "qwen3-next-tiny": dict(_QWEN3_NEXT, **{**_TINY_HYBRID, "intermediate_size": 256}),
}
PRESETS.update(HYBRID_MOE_PRESETS)

WEIGHT_STD = 0.02
CHUNK = 1 << 24  # elements per generator call


def make_config(preset: str, dtype: str) -> dict:
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if preset in HYBRID_PRESETS or preset in HYBRID_MOE_PRESETS:
        cfg = {**_QWEN3_5_COMMON, **PRESETS[preset]}
        if cfg["model_type"] != "qwen3_5_text":
            del cfg["intermediate_size"]  # (Qwen3-Next's own is set again below; 3.5-MoE has none)
            cfg.update(PRESETS[preset])
        # Real Qwen3.5 configs list the layer kinds explicitly: full attention every 4th layer.
        interval = cfg.pop("full_attention_interval")
        cfg["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                              for i in range(cfg["num_hidden_layers"])]
        # The MTP head's depth, under each family's name for it.
        cfg["num_nextn_predict_layers" if cfg["model_type"] == "qwen3_next" else "mtp_num_hidden_layers"] = 1
    else:
        cfg = {**_COMMON, **(_MOE_COMMON if preset in MOE_PRESETS else {}), **PRESETS[preset]}
        cfg["max_window_layers"] = cfg["num_hidden_layers"]
    cfg["torch_dtype"] = dtype  # transformers 4 name; 5 reads "dtype" and accepts both
    cfg["dtype"] = dtype
    cfg["jtp_random_weights"] = f"preset {preset}: random weights, output is meaningless"
    return dict(sorted(cfg.items()))


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in checkpoint order; kind is 'weight', 'norm' (mean 1) or 'zero' (mean 0)."""
    if cfg["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        return _qwen3_5_specs(cfg)
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    D = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    specs = [("model.embed_tokens.weight", (V, H), "weight")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (H,), "norm"),
            (p + "self_attn.q_proj.weight", (q, H), "weight"),
            (p + "self_attn.k_proj.weight", (kv, H), "weight"),
            (p + "self_attn.v_proj.weight", (kv, H), "weight"),
            (p + "self_attn.o_proj.weight", (H, q), "weight"),
            (p + "self_attn.q_norm.weight", (D,), "norm"),
            (p + "self_attn.k_norm.weight", (D,), "norm"),
            (p + "post_attention_layernorm.weight", (H,), "norm"),
        ]
        specs += _moe_specs(p + "mlp.", cfg) if cfg["model_type"] == "qwen3_moe" else [
            (p + "mlp.gate_proj.weight", (I, H), "weight"),
            (p + "mlp.up_proj.weight", (I, H), "weight"),
            (p + "mlp.down_proj.weight", (H, I), "weight"),
        ]
    specs.append(("model.norm.weight", (H,), "norm"))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, H), "weight"))
    return specs


def _moe_specs(mlp: str, cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """A Qwen3 MoE layer's router and experts, one tensor per expert and projection (as HF saves them)."""
    H, I, E = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    specs = [(mlp + "gate.weight", (E, H), "weight")]
    for e in range(E):
        x = f"{mlp}experts.{e}."
        specs += [(x + "gate_proj.weight", (I, H), "weight"), (x + "up_proj.weight", (I, H), "weight"),
                  (x + "down_proj.weight", (H, I), "weight")]
    return specs


def _hybrid_moe_specs(mlp: str, cfg: dict, fused_experts: bool = True) -> list[tuple[str, tuple[int, ...], str]]:
    """Router, experts (fused for Qwen3.5-MoE, one by one for Qwen3-Next) and the gated shared expert."""
    H, I, E, Is = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"], cfg["shared_expert_intermediate_size"]
    specs = [(mlp + "gate.weight", (E, H), "weight")]
    if cfg["model_type"] == "qwen3_next" or not fused_experts:
        specs += _moe_specs(mlp, cfg)[1:]
    else:
        specs += [(mlp + "experts.gate_up_proj", (E, 2 * I, H), "weight"), (mlp + "experts.down_proj", (E, H, I), "weight")]
    return specs + [
        (mlp + "shared_expert.gate_proj.weight", (Is, H), "weight"),
        (mlp + "shared_expert.up_proj.weight", (Is, H), "weight"),
        (mlp + "shared_expert.down_proj.weight", (H, Is), "weight"),
        (mlp + "shared_expert_gate.weight", (1, H), "weight"),
    ]


def _qwen3_5_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """Qwen3.5 / Qwen3-Next tensors (reference §3): zero-centred norms are 'zero' (y = x(1 + w)).
    Real checkpoints ship a multi-token-prediction head (mtp.*, one full-attention layer) too."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    specs = [("model.embed_tokens.weight", (V, H), "weight")]
    for i, kind in enumerate(cfg["layer_types"]):
        specs += _qwen3_5_layer_specs(f"model.layers.{i}.", kind, cfg)
    specs.append(("model.norm.weight", (H,), "zero"))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, H), "weight"))
    specs += [("mtp.fc.weight", (H, 2 * H), "weight"), ("mtp.pre_fc_norm_embedding.weight", (H,), "zero"),
              ("mtp.pre_fc_norm_hidden.weight", (H,), "zero")]
    # Qwen3.5-MoE stores the MTP layer's experts one by one, unlike the model's fused ones.
    specs += _qwen3_5_layer_specs("mtp.layers.0.", "full_attention", cfg, fused_experts=False)
    return specs + [("mtp.norm.weight", (H,), "zero")]


def _qwen3_5_layer_specs(p: str, kind: str, cfg: dict, fused_experts: bool = True):
    H = cfg["hidden_size"]
    D, Nq, Nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv, K = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]
    key_dim, value_dim = Hk * dk, Hv * dv
    conv_dim = 2 * key_dim + value_dim
    specs = [(p + "input_layernorm.weight", (H,), "zero")]
    if kind == "linear_attention":
        a = p + "linear_attn."
        if cfg["model_type"] == "qwen3_next":  # grouped per key head: [q k v z] and [b a]
            specs += [(a + "in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, H), "weight"),
                      (a + "in_proj_ba.weight", (2 * Hv, H), "weight")]
        else:
            specs += [
                (a + "in_proj_qkv.weight", (conv_dim, H), "weight"),  # [Q | K | V]
                (a + "in_proj_z.weight", (value_dim, H), "weight"),
                (a + "in_proj_b.weight", (Hv, H), "weight"),
                (a + "in_proj_a.weight", (Hv, H), "weight"),
            ]
        specs += [
            (a + "conv1d.weight", (conv_dim, 1, K), "weight"),
            (a + "dt_bias", (Hv,), "norm"),
            (a + "A_log", (Hv,), "zero"),
            (a + "norm.weight", (dv,), "norm"),  # gated RMSNorm: plain w, not zero-centred
            (a + "out_proj.weight", (H, value_dim), "weight"),
        ]
    else:
        a = p + "self_attn."
        specs += [
            (a + "q_proj.weight", (2 * Nq * D, H), "weight"),  # per head [q_h | gate_h]
            (a + "k_proj.weight", (Nkv * D, H), "weight"),
            (a + "v_proj.weight", (Nkv * D, H), "weight"),
            (a + "o_proj.weight", (H, Nq * D), "weight"),
            (a + "q_norm.weight", (D,), "zero"),
            (a + "k_norm.weight", (D,), "zero"),
        ]
    specs.append((p + "post_attention_layernorm.weight", (H,), "zero"))
    if "num_experts" in cfg:
        specs += _hybrid_moe_specs(p + "mlp.", cfg, fused_experts)
    else:
        I = cfg["intermediate_size"]
        specs += [(p + "mlp.gate_proj.weight", (I, H), "weight"), (p + "mlp.up_proj.weight", (I, H), "weight"),
                  (p + "mlp.down_proj.weight", (H, I), "weight")]
    return specs


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise SystemExit(f"unsupported dtype {name!r} (bfloat16, float16, float32)")


class Generator:
    """Fills tensors with N(mean, std) in parallel chunks of numpy; deterministic for a seed."""

    def __init__(self, seed: int, threads: int):
        self.seed = np.random.SeedSequence(seed)
        self.pool = cf.ThreadPoolExecutor(max_workers=threads)

    def make(self, shape: tuple[int, ...], dtype, mean: float, std: float) -> np.ndarray:
        n = int(np.prod(shape))
        out = np.empty(n, dtype)
        seeds = self.seed.spawn(-(-n // CHUNK))

        def fill(k: int) -> None:
            lo, hi = k * CHUNK, min(n, (k + 1) * CHUNK)
            x = np.random.default_rng(seeds[k]).standard_normal(hi - lo, dtype=np.float32)
            x *= std
            if mean:
                x += mean
            out[lo:hi] = x  # the cast to the checkpoint dtype happens here, in the thread

        list(self.pool.map(fill, range(len(seeds))))
        return out.reshape(shape)

    def close(self) -> None:
        self.pool.shutdown()


class JaxGenerator:
    """The same distribution drawn on the default JAX device (a GPU fills 16 GB in seconds),
    then copied to the host and written by the very same safetensors path."""

    def __init__(self, seed: int):
        import jax

        self.jax = jax
        self.key = jax.random.PRNGKey(seed)
        self.count = 0

    def make(self, shape: tuple[int, ...], dtype, mean: float, std: float) -> np.ndarray:
        jax = self.jax
        key = jax.random.fold_in(self.key, self.count)
        self.count += 1
        x = _jax_normal(jax)(key, tuple(shape), np.dtype(dtype).name, float(mean), float(std))
        return np.asarray(jax.device_get(x)).view(dtype).reshape(shape)

    def close(self) -> None:
        pass


_JAX_NORMAL = None


def _jax_normal(jax):
    global _JAX_NORMAL
    if _JAX_NORMAL is None:
        import functools

        @functools.partial(jax.jit, static_argnums=(1, 2))
        def normal(key, shape, dtype, mean, std):
            x = jax.random.normal(key, shape, jax.numpy.float32) * std + mean
            return x.astype(dtype)

        _JAX_NORMAL = normal
    return _JAX_NORMAL


def write_placeholder_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json naming every id ("t0 t1 ..."), so servers and clients can encode
    and decode random-weight outputs (no real tokenizer can be downloaded); with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}, indent=2) + "\n")


def write_checkpoint(preset: str, out: Path, dtype: str = "bfloat16", shard_gib: float = 4.0,
                     seed: int = 0, threads: int | None = None, quiet: bool = False,
                     generator: str = "numpy", config_only: bool = False) -> dict:
    from safetensors.numpy import save_file

    cfg = make_config(preset, dtype)
    dt = np_dtype(dtype)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a stale shard from an earlier run would confuse the loader
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen_cfg = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    write_placeholder_tokenizer(out, cfg["vocab_size"])

    specs = tensor_specs(cfg)
    total_bytes = sum(int(np.prod(s)) * dt.itemsize for _, s, _ in specs)
    params = sum(int(np.prod(s)) for _, s, _ in specs)
    if config_only:  # the engine draws the weights itself (--load-format dummy)
        return dict(preset=preset, out=str(out), dtype=dtype, params=params, bytes=total_bytes, files=0)
    shard_bytes = int(shard_gib * 2**30)
    # Group tensors into shards of at most shard_bytes (one shard if everything fits).
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec[1])) * dt.itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    gen = JaxGenerator(seed) if generator == "jax" else Generator(seed, threads or os.cpu_count() or 1)
    weight_map = {}
    t0 = time.perf_counter()
    for file, shard in zip(names, shards):
        tensors = {}
        for name, shape, kind in shard:
            mean, std = (1.0, WEIGHT_STD) if kind == "norm" else (0.0, WEIGHT_STD)
            tensors[name] = gen.make(shape, dt, mean, std)
            weight_map[name] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
        if not quiet:
            print(f"  wrote {file} ({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    gen.close()
    info = dict(preset=preset, out=str(out), dtype=dtype, generator=generator, params=params, bytes=total_bytes,
                files=len(shards), seconds=round(time.perf_counter() - t0, 2))
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", required=True, choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shard-gib", type=float, default=4.0, help="largest safetensors file (default 4 GiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="numpy generator threads (default: all cores)")
    ap.add_argument("--generator", choices=["numpy", "jax"], default="numpy",
                    help="draw with numpy on the host (default) or jax.random on the default device (fast on GPUs)")
    ap.add_argument("--config-only", action="store_true",
                    help="write config.json and the tokenizer, no weights: for the engine's --load-format dummy")
    args = ap.parse_args(argv)
    info = write_checkpoint(args.preset, args.out, args.dtype, args.shard_gib, args.seed, args.threads,
                            generator=args.generator, config_only=args.config_only)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
