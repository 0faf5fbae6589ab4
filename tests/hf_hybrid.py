"""Tiny Qwen3-Next / Qwen3.5 checkpoints built with transformers, and a step planner for ModelRunner.

The configs follow the architecture reference §4: r = Hv/Hk = 3 and dk != dv catch grouping and
transposition bugs; every parameter is perturbed so (1 + w) vs w mix-ups show.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=4,
    initializer_range=0.15,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 1, 1], mrope_interleaved=True)
VISION = dict(
    depth=1,
    hidden_size=32,
    num_heads=4,
    intermediate_size=32,
    out_hidden_size=64,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
)

KINDS = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_5_text_hk4")
# For tests that compare the engine with itself (speculation on and off, a group and one process,
# K steps per dispatch and one): one Gated DeltaNet layer and one attention layer. Compiling a
# step costs about its layer count; the HF parity tests keep COMMON's four layers, where three
# DeltaNet layers in a row show a layer mix-up.
SHALLOW = dict(num_hidden_layers=2, full_attention_interval=2)


def build_model(kind: str, seed: int = 0, vision: dict | None = None, outer: dict | None = None, **overrides):
    """A float32 HF model of the given tiny kind, all parameters perturbed, in eval mode.
    `overrides` replace (text) config fields, e.g. the layer pattern or SHALLOW; `vision` replaces
    vision_config fields of the multimodal kinds, `outer` their own config's (e.g. the vision token ids)."""
    import transformers as tf

    vision_cfg = {**VISION, **(vision or {})}

    torch.manual_seed(seed)
    if kind == "qwen3_next":
        kwargs = dict(**COMMON, intermediate_size=96, rope_theta=1e7, mlp_only_layers=[1], **MOE)
        model = tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{**kwargs, **overrides}))
    elif kind == "qwen3_5_text":
        kwargs = dict(**COMMON, intermediate_size=96, rope_parameters=ROPE)
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**{**kwargs, **overrides}))
    elif kind == "qwen3_5_text_hk4":  # 4 key heads, 8 value heads, 4 KV heads: tp=4 works
        cfg = {**COMMON, "num_key_value_heads": 4, "linear_num_key_heads": 4, "linear_num_value_heads": 8}
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**{**cfg, "intermediate_size": 96, "rope_parameters": ROPE,
                                                                **overrides}))
    elif kind == "qwen3_5":
        text = dict(**COMMON, intermediate_size=96, rope_parameters=ROPE)
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config={**text, **overrides},
                                                                     vision_config=vision_cfg, **(outer or {})))
    elif kind == "qwen3_5_moe_text":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**{**COMMON, "rope_parameters": ROPE, **MOE,
                                                                    **overrides}))
    elif kind == "qwen3_5_moe":
        text = dict(**COMMON, rope_parameters=ROPE, **MOE)
        model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config={**text, **overrides},
                                                                           vision_config=vision_cfg, **(outer or {})))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in name:
                # Vision weights far from their 0.02-std init: at that scale the attention is
                # nearly uniform, and a 2-D RoPE or masking mistake would move outputs by < 1e-4.
                p.add_((0.1 if "norm" in name else 0.3) * torch.randn_like(p))
            elif name.endswith("norm.weight") or name.endswith("A_log") or name.endswith("dt_bias"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.add_(0.01 * torch.randn_like(p))
            if name.endswith("conv1d.weight"):
                # Larger DeltaNet outputs: at the default scale their RMS is ~sqrt(eps) of the
                # gated norm, which amplifies fp32 round-off ~1000x and makes parity a coin toss.
                p.mul_(4.0)
    return model.float().eval()


def save(model, path: Path, fuse_experts: bool = False, extra: dict[str, np.ndarray] | None = None) -> Path:
    """save_pretrained, optionally rewriting per-expert tensors into the fused on-disk layout of
    real Qwen3.5-MoE checkpoints, and adding extra tensors (e.g. fake mtp.*)."""
    from safetensors.numpy import load_file, save_file

    model.save_pretrained(path)
    if fuse_experts or extra:
        file = path / "model.safetensors"
        tensors = load_file(file)
        if fuse_experts:
            tensors = _fuse_experts(tensors)
        tensors.update(extra or {})
        save_file(tensors, file, metadata={"format": "pt"})
    return path


# preprocessor_config.json in the layout of Qwen3-VL / Qwen3.5 checkpoints (their image processor,
# Qwen2VLImageProcessorFast), with the tiny vision tower's patch size. Non-trivial mean and std
# (per channel) and a small min_pixels so that small test images are not all upscaled alike.
PREPROCESSOR = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.45, 0.4], "image_std": [0.25, 0.3, 0.35],
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
    "merge_size": 2, "patch_size": 16, "temporal_patch_size": 2, "resample": 3,
    "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 96 * 96, "shortest_edge": 32 * 32},
}


def save_multimodal(model, path: Path, preprocessor: dict | None = None) -> Path:
    """A composite Qwen3.5 checkpoint with its vision tower (HF's save_pretrained: the official
    model.visual.* layout) plus preprocessor_config.json."""
    save(model, path)
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor or PREPROCESSOR, indent=2))
    return path


def _fuse_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import re

    out, groups = {}, {}
    for name, value in tensors.items():
        m = re.match(r"(.*\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = value
        else:
            out[name] = value
    for prefix, g in groups.items():
        E = 1 + max(e for e, _ in g)
        out[prefix + "gate_up_proj"] = np.stack([np.concatenate([g[e, "gate_proj"], g[e, "up_proj"]]) for e in range(E)])
        out[prefix + "down_proj"] = np.stack([g[e, "down_proj"] for e in range(E)])
    return out


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """Logits of every position. Pass a float64 copy (`double`) for the most accurate reference:
    a chunk of the delta rule can be ill-conditioned enough that HF's own fp32 is 1e-4 off."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].to(torch.float64).numpy()


def double(model):
    import copy

    model = copy.deepcopy(model).double()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # torch's grouped_mm has no float64
    return model


def hf_prefill_decode(model, prompt: list[int], decode: list[int]) -> np.ndarray:
    """Logits of the prompt's last token and of each decode token, through HF's cache path."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        r = model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        out.append(r.logits[0, -1].numpy())
        for t in decode:
            r = model(torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            out.append(r.logits[0, -1].numpy())
    return np.stack(out)


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt) :].tolist()


# ----------------------------------------------------------------------------- step planning


class Planner:
    """Builds StepPlans for ModelRunner: each sequence owns a fixed run of pages and a state slot."""

    def __init__(self, block_size: int = 16, blocks_per_seq: int = 16):
        self.block_size, self.blocks_per_seq = block_size, blocks_per_seq
        self.seen: dict[int, int] = {}  # sequence id -> tokens already in the cache

    def reset(self, seq: int):
        self.seen[seq] = 0

    def plan(self, rows: list[tuple[int, int, list[int]]], num_tokens: int | None = None, num_rows: int | None = None):
        """rows: (sequence id (also its page run), state slot, new tokens). Padded to num_tokens / num_rows."""
        from jtp.core.step_input import StepPlan

        T = num_tokens or sum(len(t) for _, _, t in rows)
        B = num_rows or len(rows)
        M = self.blocks_per_seq
        p = dict(
            token_ids=np.zeros(T, np.int32),
            positions=np.zeros(T, np.int32),
            slot_mapping=np.full(T, -1, np.int32),
            token_rows=np.zeros(T, np.int32),
            block_tables=np.zeros((B, M), np.int32),
            context_lens=np.zeros(B, np.int32),
            row_starts=np.zeros(B, np.int32),
            row_lens=np.zeros(B, np.int32),
            seq_slots=np.full(B, -1, np.int32),
            state_reads=np.full(B, -1, np.int32),
            state_writes=np.full(B, -1, np.int32),
            state_keeps=np.full(B, -1, np.int32),
            logits_indices=np.zeros(B, np.int32),
        )
        start = 0
        for b, (seq, slot, toks) in enumerate(rows):
            n, base = len(toks), self.seen.get(seq, 0)
            table = np.arange(seq * M, (seq + 1) * M, dtype=np.int32)
            pos = np.arange(base, base + n)
            sl = slice(start, start + n)
            p["token_ids"][sl] = toks
            p["positions"][sl] = pos
            p["slot_mapping"][sl] = table[pos // self.block_size] * self.block_size + pos % self.block_size
            p["token_rows"][sl] = b
            p["block_tables"][b] = table
            p["context_lens"][b] = base + n
            p["row_starts"][b] = start
            p["row_lens"][b] = n
            p["seq_slots"][b] = p["state_writes"][b] = slot
            p["state_reads"][b] = slot if base > 0 else -1  # a fresh sequence starts from the zero state
            p["logits_indices"][b] = start + n - 1
            self.seen[seq] = base + n
            start += n
        assert start <= T
        return StepPlan(**p)


def config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())
