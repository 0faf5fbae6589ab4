"""Tiny HF checkpoints for parity tests: random (seeded) weights, every parameter perturbed.

    hf_model, path = make_hf_checkpoint("qwen3", tmp_path / "qwen3")

kind is one of "qwen3", "qwen3_moe", "qwen2". The model comes back in eval mode, float32,
and is saved with `save_pretrained(path)` (no tokenizer). `overrides` replace config fields.
Every norm weight is perturbed too, so a wrong "1 + w" / "w" convention shows up.
"""
from __future__ import annotations

from pathlib import Path

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_hidden_layers=3,
    intermediate_size=96,
    max_position_embeddings=512,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,  # nothing stops a generation early unless a test asks for it
    pad_token_id=None,
)

MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[1],
    decoder_sparse_step=1,
)

KINDS = ("qwen3", "qwen3_moe", "qwen2")


def make_config(kind: str, **overrides):
    import transformers

    if kind == "qwen3":
        cls, extra = transformers.Qwen3Config, {}
    elif kind == "qwen3_moe":
        cls, extra = transformers.Qwen3MoeConfig, dict(MOE)
    elif kind == "qwen2":
        cls, extra = transformers.Qwen2Config, {}
    else:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    kwargs = {**TINY, **extra, **overrides}
    rope_theta = kwargs.pop("rope_theta")
    cfg = cls(**kwargs)
    # transformers 5 keeps rope settings in rope_parameters; older versions read rope_theta.
    if getattr(cfg, "rope_parameters", None) is not None:
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    cfg.rope_theta = rope_theta
    return cfg


def make_hf_checkpoint(kind: str, path, **overrides):
    """Build, perturb and save a tiny HF model of `kind`; returns (hf_model, path)."""
    import torch
    import transformers

    cfg = make_config(kind, **overrides)
    torch.manual_seed(0)
    model_cls = {
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }[kind]
    model = model_cls(cfg).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return model, path


def hf_greedy(model, prompt_ids, max_new_tokens: int) -> list[int]:
    """HF greedy generation of exactly max_new_tokens tokens (EOS cannot end it early)."""
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt_ids)]),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
