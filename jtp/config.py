"""ModelConfig: the subset of a Hugging Face `config.json` that the forward pass needs.

Every field is read explicitly, with the HF class default where the field may be
missing, so a surprise in a checkpoint is an error that names the field rather
than a silently wrong model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# Hybrid (Gated DeltaNet + gated attention) types; the composite ones nest the LM in `text_config`.
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
COMPOSITE_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


from jtp.errors import ConfigError  # noqa: E402 - re-exported: config.json describes something jtp cannot run


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (0 when every layer is MoE)
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v carry a bias; Qwen3 with attention_bias: q/k/v/o do
    o_bias: bool
    qk_norm: bool  # Qwen3 per-head RMSNorm on q and k before RoPE
    max_position_embeddings: int
    # Mixture of experts (num_experts == 0: dense model).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[bool, ...] = ()
    # Token ids from config.json (the tokenizer and generation_config may add more).
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "float32"  # the checkpoint's declared dtype
    # Hybrid families (qwen3_next, qwen3_5*): per-layer "linear_attention" / "full_attention".
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0  # Hk
    linear_num_value_heads: int = 0  # Hv
    linear_key_head_dim: int = 0  # dk
    linear_value_head_dim: int = 0  # dv
    linear_conv_kernel_dim: int = 0  # K
    partial_rotary_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # Is (0: no shared expert)
    checkpoint_prefix: str = "model."  # "model.language_model." for the multimodal wrappers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def is_hybrid(self) -> bool:
        return self.model_type in HYBRID_MODEL_TYPES

    def is_linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:  # Hk * dk
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:  # Hv * dv
        return self.linear_num_value_heads * self.linear_value_head_dim

    def fingerprint(self) -> str:
        """A stable digest, so controllers can check they load the same model."""
        import hashlib

        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        return _parse(raw, source)


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported; jtp runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type in HYBRID_MODEL_TYPES:
        return _parse_hybrid(raw, source)
    f = _Fields(raw, source)

    hidden = f.int("hidden_size", positive=True)
    num_heads = f.int("num_attention_heads", positive=True)
    num_kv_heads = f.int("num_key_value_heads", default=num_heads, positive=True)
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    # Qwen3's class default is 128 whatever the hidden size; qwen2 / qwen3_moe fall back to H / heads.
    if model_type == "qwen3":
        head_dim = f.int("head_dim", default=128, positive=True)
    else:
        head_dim = f.int("head_dim", default=None, positive=True, allow_none=True)
        if head_dim is None:
            if hidden % num_heads:
                raise ConfigError(
                    f"{source}: head_dim is missing and hidden_size ({hidden}) is not divisible by "
                    f"num_attention_heads ({num_heads})"
                )
            head_dim = hidden // num_heads

    if f.get("use_sliding_window", False):
        raise ConfigError(f"{source}: use_sliding_window=true is not supported (sliding-window attention)")
    hidden_act = f.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")

    rope_theta = _rope_theta(raw, source)
    num_layers = f.int("num_hidden_layers", positive=True)

    if model_type == "qwen2":
        qkv_bias, o_bias, qk_norm = True, False, False
    else:
        attention_bias = bool(f.get("attention_bias", False))
        qkv_bias, o_bias, qk_norm = attention_bias, attention_bias, True

    moe: dict[str, Any] = {}
    intermediate = f.int("intermediate_size", positive=True)
    if model_type == "qwen3_moe":
        # save_pretrained writes num_local_experts (attribute_map); hand-written configs use num_experts.
        num_experts = f.int("num_experts", default=None, allow_none=True)
        local = f.int("num_local_experts", default=None, allow_none=True)
        if num_experts is not None and local is not None and num_experts != local:
            raise ConfigError(f"{source}: num_experts ({num_experts}) contradicts num_local_experts ({local})")
        num_experts = num_experts if num_experts is not None else (local if local is not None else 128)
        top_k = f.int("num_experts_per_tok", default=8, positive=True)
        if num_experts > 0 and top_k > num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
        step = f.int("decoder_sparse_step", default=1, positive=True)
        dense_only = set(f.get("mlp_only_layers", []) or [])
        layers = tuple(
            num_experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(num_layers)
        )
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=f.int("moe_intermediate_size", default=768, positive=True),
            norm_topk_prob=bool(f.get("norm_topk_prob", False)),
            moe_layers=layers,
        )

    eos_ids = _token_ids(f.get("eos_token_id", None))
    return ModelConfig(
        model_type=model_type,
        vocab_size=f.int("vocab_size", positive=True),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
        rope_theta=rope_theta,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=qk_norm,
        max_position_embeddings=f.int("max_position_embeddings", default=32768, positive=True),
        eos_token_ids=eos_ids,
        bos_token_id=f.get("bos_token_id", None),
        dtype=str(f.get("dtype", f.get("torch_dtype", "float32")) or "float32"),
        **moe,
    )


def _rope_params(raw: dict[str, Any], source: str) -> dict[str, Any]:
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported (only 'default' RoPE)")
    return params


def _token_ids(value) -> tuple[int, ...]:
    """eos_token_id may be one id, a list of ids or absent."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _rope_theta(raw: dict[str, Any], source: str) -> float:
    """RoPE settings live in `rope_parameters` (transformers 5) or legacy top-level keys."""
    params = _rope_params(raw, source)
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor != 1 is not supported for {raw.get('model_type')}")
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))  # HF's default_theta
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    return float(theta)


class _Fields:
    """Typed reads from the raw dict, with errors that name the field."""

    _MISSING = object()

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def get(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.raw and self.raw[key] is not None:
            return self.raw[key]
        if default is self._MISSING:
            raise ConfigError(f"{self.source}: required field {key!r} is missing")
        return default

    def int(self, key: str, default: Any = _MISSING, positive: bool = False, allow_none: bool = False):
        value = self.get(key, default)
        if value is None and allow_none:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.source}: field {key!r} must be an integer, got {value!r}")
        if positive and value <= 0:
            raise ConfigError(f"{self.source}: field {key!r} must be positive, got {value}")
        return value

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{self.source}: field {key!r} must be a number, got {value!r}")
        return float(value)


# ----------------------------------------------------------------------------- hybrid families

# HF class defaults (reference §1) for fields a hybrid config.json may leave out.
_HYBRID_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_next": dict(head_dim=256, intermediate_size=5632, num_experts=512, num_experts_per_tok=10),
    "qwen3_5_text": dict(head_dim=256, intermediate_size=12288, num_experts=0, num_experts_per_tok=0),
    "qwen3_5_moe_text": dict(head_dim=256, intermediate_size=0, num_experts=256, num_experts_per_tok=8),
}
_LINEAR_DEFAULTS = dict(
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
_LAYER_KINDS = ("linear_attention", "full_attention")


def _parse_hybrid(raw: dict[str, Any], source: str) -> ModelConfig:
    """qwen3_next / qwen3_5[_text] / qwen3_5_moe[_text]: Gated DeltaNet + gated attention layers."""
    outer_type = raw["model_type"]
    text, prefix = raw, "model."
    if outer_type in COMPOSITE_TEXT_TYPES:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"{source}: {outer_type} config has no 'text_config' object")
        want = COMPOSITE_TEXT_TYPES[outer_type]
        if text.get("model_type", want) != want:
            raise ConfigError(f"{source}: text_config.model_type is {text.get('model_type')!r}, expected {want!r}")
        text = {"model_type": want, **text}
        source = f"{source} (text_config)"
        prefix = "model.language_model."
    text_type = text["model_type"]
    defaults = _HYBRID_DEFAULTS[text_type]
    f = _Fields(text, source)

    hidden = f.int("hidden_size", positive=True)
    num_layers = f.int("num_hidden_layers", positive=True)
    num_heads = f.int("num_attention_heads", positive=True)
    num_kv_heads = f.int("num_key_value_heads", default=num_heads, positive=True)
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    head_dim = f.int("head_dim", default=defaults["head_dim"], positive=True)
    if f.get("attention_bias", False):
        raise ConfigError(f"{source}: attention_bias=true is not supported for {outer_type}")
    hidden_act = f.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")

    rope = _rope_params(text, source)
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{source}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(
            f"{source}: partial_rotary_factor {factor} gives rotary dim {rotary_dim} of head_dim {head_dim}; "
            "it must be even and positive"
        )

    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = f.int("full_attention_interval", default=4, positive=True)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ConfigError(f"{source}: layer_types must be a list of num_hidden_layers ({num_layers}) entries")
    for kind in layer_types:
        if kind not in _LAYER_KINDS:
            raise ConfigError(f"{source}: layer_types entry {kind!r} is not one of {', '.join(_LAYER_KINDS)}")

    linear = {k: f.int(k, default=v, positive=True) for k, v in _LINEAR_DEFAULTS.items()}
    if linear["linear_num_value_heads"] % linear["linear_num_key_heads"]:
        raise ConfigError(
            f"{source}: linear_num_value_heads ({linear['linear_num_value_heads']}) must be a multiple of "
            f"linear_num_key_heads ({linear['linear_num_key_heads']})"
        )

    # MoE placement: qwen3_next follows qwen3_moe's rule; qwen3_5_moe_text is MoE everywhere and
    # always renormalises the top-k weights; qwen3_5_text has no experts.
    intermediate = f.int("intermediate_size", default=defaults["intermediate_size"] or None, allow_none=True)
    num_experts = defaults["num_experts"]
    if text_type != "qwen3_5_text":
        num_experts = f.int("num_experts", default=num_experts)
        local = f.int("num_local_experts", default=None, allow_none=True)
        if local is not None and "num_experts" in text and local != num_experts:
            raise ConfigError(f"{source}: num_experts ({num_experts}) contradicts num_local_experts ({local})")
        num_experts = local if local is not None and "num_experts" not in text else num_experts
    moe: dict[str, Any] = {}
    if num_experts > 0:
        if text_type == "qwen3_next":
            step = f.int("decoder_sparse_step", default=1, positive=True)
            dense_only = set(f.get("mlp_only_layers", []) or [])
            layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
            normalize = bool(f.get("norm_topk_prob", True))
        else:
            layers, normalize = (True,) * num_layers, True
        top_k = f.int("num_experts_per_tok", default=defaults["num_experts_per_tok"], positive=True)
        if top_k > num_experts:
            raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=f.int("moe_intermediate_size", default=512, positive=True),
            norm_topk_prob=normalize,
            moe_layers=layers,
            shared_expert_intermediate_size=f.int("shared_expert_intermediate_size", default=512, positive=True),
        )
    has_dense = not moe or not all(moe["moe_layers"])
    if has_dense and not intermediate:
        raise ConfigError(f"{source}: required field 'intermediate_size' is missing (some layers are dense)")

    # The multimodal wrapper's own flags win (HF ties by the outer config).
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    eos_ids = _token_ids(text.get("eos_token_id", raw.get("eos_token_id")))
    dtype = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return ModelConfig(
        model_type=outer_type,
        vocab_size=f.int("vocab_size", positive=True),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate or 0,
        rms_norm_eps=f.float("rms_norm_eps", default=1e-6),
        rope_theta=float(theta),
        tie_word_embeddings=bool(tie),
        qkv_bias=False,
        o_bias=False,
        qk_norm=True,
        max_position_embeddings=f.int("max_position_embeddings", default=32768, positive=True),
        eos_token_ids=eos_ids,
        bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
        dtype=str(dtype),
        layer_types=tuple(layer_types),
        partial_rotary_factor=float(factor),
        checkpoint_prefix=prefix,
        **linear,
        **moe,
    )
