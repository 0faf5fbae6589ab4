"""Model families. Each module exposes the same four functions:

    param_layout(cfg, tp) -> {path: Source}     where each parameter comes from in the checkpoint
    init_cache(cfg, mesh, num_blocks, block_size, num_state_slots, dtype) -> cache pytree
    forward(params, cfg, tokens, cache, meta, attend, routed) -> (hidden [T, H], cache)
        attend: a PagedAttention (jtp/models/attention.py), routed: a RoutedExperts (jtp/models/moe.py)
    compute_logits(params, hidden) -> float32 logits
"""

from jtp.config.model_config import ModelConfig


def family_of(cfg: ModelConfig):
    if cfg.model_type in ("qwen3", "qwen3_moe", "qwen2"):
        from jtp.models import qwen3

        return qwen3
    from jtp.models import (
        qwen3_5,  # the hybrids: qwen3_next, qwen3_5[_text], qwen3_5_moe[_text]
    )

    return qwen3_5
