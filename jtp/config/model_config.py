"""ModelConfig: the subset of a Hugging Face `config.json` that the forward pass needs.

Every field is read explicitly, with the HF class default where the field may be
missing, so a surprise in a checkpoint is an error that names the field rather
than a silently wrong model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

from jtp.config.quantization import Quantization, parse_quantization
from jtp.config.rope import Yarn, parse_rope
from jtp.errors import (
    ConfigError,  # raised here; importable from jtp.config.model_config as before
)

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# Hybrid (Gated DeltaNet + gated attention) types; the composite ones nest the LM in `text_config`.
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
COMPOSITE_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


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
    rope_yarn: Yarn | None = None  # YaRN RoPE scaling (rope_type 'yarn'); None: plain RoPE
    shared_expert_intermediate_size: int = 0  # Is (0: no shared expert)
    checkpoint_prefix: str = "model."  # "model.language_model." for the multimodal wrappers
    # Multi-token-prediction layers the checkpoint ships (mtp.*; Qwen3.5 / Qwen3-Next), used as a
    # speculative drafter with --speculative-config '{"method": "mtp"}'.
    mtp_layers: int = 0
    quantization: Quantization | None = None  # the checkpoint's quantization_config (None: full-precision weights)
    mrope_section: tuple[int, int, int] = (11, 11, 10)  # a vision checkpoint's M-RoPE split (jtp.config.vision_config)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

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

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_hf(raw, source=str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        return _parse(raw, source)


# ----------------------------------------------------------------------------- parsing

# HF class defaults for fields a config.json may leave out, per (text) model_type. head_dim None:
# hidden_size // num_attention_heads. intermediate_size None: required when a layer is dense.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(head_dim=128, intermediate_size=None, partial_rotary_factor=1.0),
    "qwen2": dict(head_dim=None, intermediate_size=None, partial_rotary_factor=1.0),
    "qwen3_moe": dict(head_dim=None, intermediate_size=None, partial_rotary_factor=1.0),
    "qwen3_next": dict(head_dim=256, intermediate_size=5632, partial_rotary_factor=0.25),
    "qwen3_5_text": dict(head_dim=256, intermediate_size=12288, partial_rotary_factor=0.25),
    "qwen3_5_moe_text": dict(head_dim=256, intermediate_size=None, partial_rotary_factor=0.25),
}


class _Moe(NamedTuple):
    """How a family places and configures its experts (HF class defaults)."""

    num_experts: int
    top_k: int
    intermediate: int
    every_layer: bool  # else: decoder_sparse_step and mlp_only_layers choose the MoE layers
    norm_topk_prob: bool | None  # the default; None: always renormalise
    shared_expert: bool


_MOE = {
    "qwen3_moe": _Moe(128, 8, 768, every_layer=False, norm_topk_prob=False, shared_expert=False),
    "qwen3_next": _Moe(512, 10, 512, every_layer=False, norm_topk_prob=True, shared_expert=True),
    "qwen3_5_moe_text": _Moe(256, 8, 512, every_layer=True, norm_topk_prob=None, shared_expert=True),
}

_LINEAR_DEFAULTS = dict(
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
)
_LAYER_KINDS = ("linear_attention", "full_attention")

# Upper bounds far past any released model, so a corrupt or hand-edited config.json is refused
# here, in one line, rather than by an allocator after minutes of loading.
MAX_POSITIONS = 1 << 24
_UPPER_BOUNDS = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "intermediate_size": 1 << 20,
    "max_position_embeddings": MAX_POSITIONS,
    "num_experts": 1 << 14,
    "num_local_experts": 1 << 14,
    "moe_intermediate_size": 1 << 20,
    "shared_expert_intermediate_size": 1 << 20,
    "linear_num_key_heads": 1024,
    "linear_num_value_heads": 1024,
    "linear_key_head_dim": 1024,
    "linear_value_head_dim": 1024,
    "linear_conv_kernel_dim": 64,
    "mtp_num_hidden_layers": 64,
    "num_nextn_predict_layers": 64,
}


def _parse(raw: dict[str, Any], source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported; jtp runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    quantization = parse_quantization(raw.get("quantization_config"), source)
    text, source, prefix = _text_config(raw, source)
    text_type = text["model_type"]
    f = _Fields(text, source)

    hidden = f.int("hidden_size", positive=True)
    num_layers = f.int("num_hidden_layers", positive=True)
    num_heads = f.int("num_attention_heads", positive=True)
    num_kv_heads = f.int("num_key_value_heads", default=num_heads, positive=True)
    if num_heads % num_kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
        )
    head_dim = f.int("head_dim", default=_DEFAULTS[text_type]["head_dim"], positive=True, allow_none=True)
    if head_dim is None:
        if hidden % num_heads:
            raise ConfigError(
                f"{source}: head_dim is missing and hidden_size ({hidden}) is not divisible by "
                f"num_attention_heads ({num_heads})"
            )
        head_dim = hidden // num_heads
    hidden_act = f.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConfigError(f"{source}: hidden_act {hidden_act!r} is not supported (only 'silu')")
    rope = parse_rope(text, source, _DEFAULTS[text_type]["partial_rotary_factor"], head_dim)
    max_positions = f.int("max_position_embeddings", default=32768, positive=True)
    if rope.yarn is not None:  # the extended context, as vLLM derives max_model_len
        max_positions = max(max_positions, rope.yarn.max_position_embeddings)
        if max_positions > MAX_POSITIONS:
            raise ConfigError(f"{source}: YaRN extends the context to {max_positions} positions, past the sane bound "
                              f"{MAX_POSITIONS} (a corrupt config?)")

    layers = _hybrid_fields(f, num_layers) if model_type in HYBRID_MODEL_TYPES else _dense_fields(f, num_layers)
    moe = _moe_fields(f, _MOE.get(text_type), num_layers)
    intermediate = f.int("intermediate_size", default=_DEFAULTS[text_type]["intermediate_size"], allow_none=True)
    if not (intermediate or 0) > 0 and not all(moe.get("moe_layers", ())):
        raise ConfigError(f"{source}: field 'intermediate_size' is missing or not positive, and some layers are dense")

    # A multimodal wrapper's own flags win (HF ties by the outer config); token ids and dtype
    # come from the text config first.
    tie = _first(raw, text, key="tie_word_embeddings", default=False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{source}: field 'tie_word_embeddings' must be true or false, got {tie!r}")
    dtype = next((c[k] for c in (text, raw) for k in ("dtype", "torch_dtype") if c.get(k)), "float32")
    if not isinstance(dtype, str):
        raise ConfigError(f"{source}: field 'dtype' must be a string, got {dtype!r}")
    vocab = f.int("vocab_size", positive=True)
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate or 0,
        rms_norm_eps=f.float("rms_norm_eps", default=1e-6, positive=True),
        rope_theta=rope.theta,
        partial_rotary_factor=rope.partial_rotary_factor,
        rope_yarn=rope.yarn,
        tie_word_embeddings=tie,
        max_position_embeddings=max_positions,
        eos_token_ids=_token_ids(_first(text, raw, key="eos_token_id"), "eos_token_id", source),
        bos_token_id=_token_id(_first(text, raw, key="bos_token_id"), "bos_token_id", source),
        dtype=dtype,
        checkpoint_prefix=prefix,
        quantization=quantization,
        **layers,
        **moe,
    )


def _text_config(raw: dict[str, Any], source: str) -> tuple[dict[str, Any], str, str]:
    """The language model's config: (fields, source for messages, checkpoint tensor prefix).

    The multimodal Qwen3.5 wrappers nest it in `text_config`; every other type is flat."""
    outer_type = raw["model_type"]
    if outer_type not in COMPOSITE_TEXT_TYPES:
        return raw, source, "model."
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: {outer_type} config has no 'text_config' object")
    want = COMPOSITE_TEXT_TYPES[outer_type]
    if text.get("model_type", want) != want:
        raise ConfigError(f"{source}: text_config.model_type is {text.get('model_type')!r}, expected {want!r}")
    return {"model_type": want, **text}, f"{source} (text_config)", "model.language_model."


def _first(*configs: dict[str, Any], key: str, default: Any = None) -> Any:
    """The first config's non-null value of key."""
    return next((c[key] for c in configs if c.get(key) is not None), default)


def _dense_fields(f: "_Fields", num_layers: int) -> dict[str, Any]:
    """Qwen3 / Qwen3-MoE / Qwen2 layers: attention biases and q/k norms."""
    layer_types = f.raw.get("layer_types")  # newer transformers write one entry per layer
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != num_layers):
        raise ConfigError(f"{f.source}: layer_types must be a list of num_hidden_layers ({num_layers}) entries")
    if f.get("use_sliding_window", False):
        raise ConfigError(f"{f.source}: use_sliding_window=true is not supported (sliding-window attention)")
    if f.raw.get("dual_chunk_attention_config"):  # Qwen2.5-1M's long-context attention (vLLM runs it)
        raise ConfigError(f"{f.source}: dual_chunk_attention_config is not supported (dual chunk attention)")
    if f.raw["model_type"] == "qwen2":
        return dict(qkv_bias=True, o_bias=False, qk_norm=False)
    attention_bias = bool(f.get("attention_bias", False))
    return dict(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)


def _hybrid_fields(f: "_Fields", num_layers: int) -> dict[str, Any]:
    """qwen3_next / qwen3_5[_moe]: the layer pattern and the Gated DeltaNet dimensions."""
    source = f.source
    if f.get("attention_bias", False):
        raise ConfigError(f"{source}: attention_bias=true is not supported for {f.raw['model_type']}")
    layer_types = f.raw.get("layer_types")
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
    # Qwen3.5 names it mtp_num_hidden_layers; Qwen3-Next's config (and vLLM) num_nextn_predict_layers.
    mtp_keys = [k for k in ("mtp_num_hidden_layers", "num_nextn_predict_layers") if f.get(k, None) is not None]
    mtp = f.int(mtp_keys[0]) if mtp_keys else 0
    return dict(qkv_bias=False, o_bias=False, qk_norm=True, layer_types=tuple(layer_types), mtp_layers=mtp, **linear)


def _moe_fields(f: "_Fields", moe: _Moe | None, num_layers: int) -> dict[str, Any]:
    """Expert count, routing and which layers are MoE; empty for dense families or 0 experts."""
    if moe is None:
        return {}
    # save_pretrained writes num_local_experts (attribute_map); hand-written configs use num_experts.
    num_experts = f.int("num_experts", default=None, allow_none=True)
    local = f.int("num_local_experts", default=None, allow_none=True)
    if num_experts is not None and local is not None and num_experts != local:
        raise ConfigError(f"{f.source}: num_experts ({num_experts}) contradicts num_local_experts ({local})")
    num_experts = next((n for n in (num_experts, local) if n is not None), moe.num_experts)
    if num_experts < 0:
        raise ConfigError(f"{f.source}: field 'num_experts' must not be negative, got {num_experts}")
    if num_experts == 0:
        return {}
    top_k = f.int("num_experts_per_tok", default=moe.top_k, positive=True)
    if top_k > num_experts:
        raise ConfigError(f"{f.source}: num_experts_per_tok ({top_k}) exceeds num_experts ({num_experts})")
    if moe.every_layer:
        layers = (True,) * num_layers
    else:
        step = f.int("decoder_sparse_step", default=1, positive=True)
        dense_only = f.get("mlp_only_layers", []) or []
        if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
            raise ConfigError(f"{f.source}: field 'mlp_only_layers' must be a list of layer indices")
        dense_only = set(dense_only)
        layers = tuple(i not in dense_only and (i + 1) % step == 0 for i in range(num_layers))
    fields = dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.int("moe_intermediate_size", default=moe.intermediate, positive=True),
        norm_topk_prob=True if moe.norm_topk_prob is None else bool(f.get("norm_topk_prob", moe.norm_topk_prob)),
        moe_layers=layers,
    )
    if moe.shared_expert:
        fields["shared_expert_intermediate_size"] = f.int("shared_expert_intermediate_size", default=512, positive=True)
    return fields


def _token_ids(value, key: str, source: str) -> tuple[int, ...]:
    """eos_token_id may be one id, a list of ids or absent."""
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    return tuple(_token_id(v, key, source) for v in values)


def _token_id(value, key: str, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{source}: field {key!r} must be a token id (an integer >= 0), got {value!r}")
    return value


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
        bound = _UPPER_BOUNDS.get(key)
        if bound is not None and value > bound:
            raise ConfigError(f"{self.source}: field {key!r} is {value}, past the sane bound {bound} (a corrupt config?)")
        return value

    def float(self, key: str, default: Any = _MISSING, positive: bool = False) -> float:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{self.source}: field {key!r} must be a finite number, got {value!r}")
        if positive and value <= 0:
            raise ConfigError(f"{self.source}: field {key!r} must be positive, got {value}")
        return float(value)
