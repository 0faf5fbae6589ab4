"""Model families: modules that satisfy `jtp.models.base.ModelFamily` (param_layout, init_cache,
forward, compute_logits, and mtp_forward or None)."""

from jtp.config.model_config import ModelConfig
from jtp.models.base import ModelFamily


def family_of(cfg: ModelConfig) -> ModelFamily:
    if cfg.model_type in ("qwen3", "qwen3_moe", "qwen2"):
        from jtp.models import qwen3

        return qwen3
    from jtp.models import (
        qwen3_5,  # the hybrids: qwen3_next, qwen3_5[_text], qwen3_5_moe[_text]
    )

    return qwen3_5
