"""The image side of a Qwen3.5 checkpoint: its vision tower (config.json `vision_config`), the
M-RoPE layout of its language model (`text_config.rope_parameters.mrope_section`), the special
token ids, and the image processor (preprocessor_config.json).

Read field by field with HF's class defaults (transformers' Qwen3_5VisionConfig, Qwen3_5Config,
Qwen2VLImageProcessor), so a surprise in a checkpoint is an error naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from jtp.errors import ConfigError

VISION_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
# The vision MLP's activation (config `hidden_act`) -> how jtp.models.vision computes it.
VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "silu", "quick_gelu")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision encoder and how its outputs enter the language model."""

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584  # the language model's hidden size
    num_position_embeddings: int = 2304  # a square grid of learned position embeddings
    rope_theta: float = 10000.0  # the vision attention's axial 2-D RoPE
    # Token ids (Qwen3_5Config defaults).
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    # The language model's M-RoPE: rotary frequency pairs taken from the (T, H, W) position rows.
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    checkpoint_prefix: str = "model.visual."

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: C x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per image token (spatial_merge_size^2)."""
        return self.spatial_merge_size**2

    @property
    def position_grid_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "VisionConfig":
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, OSError) as e:
            raise ConfigError(f"{path}: cannot read the model config ({e})") from e
        return cls.from_hf(raw, str(path))

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "config.json") -> "VisionConfig":
        if not isinstance(raw, dict) or raw.get("model_type") not in VISION_MODEL_TYPES:
            raise ConfigError(f"{source}: image input needs a {' or '.join(VISION_MODEL_TYPES)} checkpoint (with a "
                              f"vision tower), got model_type {raw.get('model_type') if isinstance(raw, dict) else raw!r}")
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise ConfigError(f"{source}: no 'vision_config' object (this checkpoint has no vision tower)")
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
        default = cls()
        v = _Reader(vision, f"{source} (vision_config)")
        ints = {k: v.int(k, getattr(default, k)) for k in (
            "depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
            "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings")}
        hidden_act = vision.get("hidden_act", default.hidden_act)
        if hidden_act not in VISION_ACTIVATIONS:
            raise ConfigError(f"{v.source}: hidden_act {hidden_act!r} is not supported ({', '.join(VISION_ACTIVATIONS)})")
        if ints["hidden_size"] % ints["num_heads"] or (ints["hidden_size"] // ints["num_heads"]) % 4:
            raise ConfigError(f"{v.source}: hidden_size {ints['hidden_size']} / num_heads {ints['num_heads']} must "
                              "be a whole head dim divisible by 4 (2-D RoPE over half of it)")
        side = math.isqrt(ints["num_position_embeddings"])
        if side * side != ints["num_position_embeddings"]:
            raise ConfigError(f"{v.source}: num_position_embeddings {ints['num_position_embeddings']} is not a square")
        rope = vision.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(f"{v.source}: rope_type {rope.get('rope_type')!r}: only axial vision RoPE is supported")
        theta = rope.get("rope_theta", default.rope_theta)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise ConfigError(f"{v.source}: rope_theta must be a positive number, got {theta!r}")
        outer = _Reader(raw, source)
        tokens = {k: outer.int(k, getattr(default, k), zero_ok=True) for k in (
            "image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
        if "hidden_size" in text and text["hidden_size"] != ints["out_hidden_size"]:
            raise ConfigError(f"{v.source}: out_hidden_size {ints['out_hidden_size']} differs from the language "
                              f"model's hidden_size {text['hidden_size']}")
        return cls(**ints, hidden_act=hidden_act, rope_theta=float(theta), **tokens,
                   mrope_section=_mrope_section(text, f"{source} (text_config)"))


def _mrope_section(text: dict[str, Any], source: str) -> tuple[int, int, int]:
    """rope_parameters.mrope_section (HF's default [11, 11, 10]); rope_scaling wins as in jtp.config.rope."""
    params = text.get("rope_scaling") or text.get("rope_parameters") or {}
    section = params.get("mrope_section", [11, 11, 10])
    if (not isinstance(section, list) or len(section) != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in section)):
        raise ConfigError(f"{source}: mrope_section must be three non-negative integers (T, H, W), got {section!r}")
    return tuple(section)


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    """preprocessor_config.json of a Qwen2-VL-style image processor (Qwen3-VL, Qwen3.5)."""

    min_pixels: int = 56 * 56  # size.shortest_edge: the fewest pixels after resizing
    max_pixels: int = 28 * 28 * 1280  # size.longest_edge: the most
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL.Image.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one image token's square of patches."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ImageProcessorConfig":
        """preprocessor_config.json, or the processor section of processor_config.json."""
        model_dir = Path(model_dir)
        for name in ("preprocessor_config.json", "processor_config.json"):
            path = model_dir / name
            if path.is_file():
                try:
                    raw = json.loads(path.read_text(encoding="utf-8"))
                except ValueError as e:
                    raise ConfigError(f"{path}: not valid JSON ({e})") from e
                if name == "processor_config.json":
                    raw = raw.get("image_processor", raw)
                return cls.from_hf(raw, str(path))
        raise ConfigError(f"{model_dir}: no preprocessor_config.json (the image processor's settings)")

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str = "preprocessor_config.json") -> "ImageProcessorConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        default = cls()
        f = _Reader(raw, source)
        # min_pixels / max_pixels override size.shortest_edge / longest_edge (as HF's __init__ does).
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise ConfigError(f"{source}: field 'size' must be an object, got {size!r}")
        sized = _Reader(size, f"{source} (size)")
        min_pixels = f.int("min_pixels", None) or sized.int("shortest_edge", default.min_pixels)
        max_pixels = f.int("max_pixels", None) or sized.int("longest_edge", default.max_pixels)
        if min_pixels > max_pixels:
            raise ConfigError(f"{source}: min_pixels {min_pixels} exceeds max_pixels {max_pixels}")
        flags = {}
        for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            value = raw.get(key, getattr(default, key))
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: field {key!r} must be true or false, got {value!r}")
            flags[key] = value
        return cls(
            min_pixels=min_pixels, max_pixels=max_pixels,
            patch_size=f.int("patch_size", default.patch_size),
            temporal_patch_size=f.int("temporal_patch_size", default.temporal_patch_size),
            merge_size=f.int("merge_size", default.merge_size),
            image_mean=f.triple("image_mean", default.image_mean),
            image_std=f.triple("image_std", default.image_std, positive=True),
            rescale_factor=f.number("rescale_factor", default.rescale_factor),
            resample=f.int("resample", default.resample, zero_ok=True),
            **flags,
        )


class _Reader:
    """Typed reads with errors that name the field."""

    def __init__(self, raw: dict[str, Any], source: str):
        self.raw, self.source = raw, source

    def int(self, key: str, default, zero_ok: bool = False):
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"{self.source}: field {key!r} must be a {'non-negative' if zero_ok else 'positive'} "
                              f"integer, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"{self.source}: field {key!r} must be a positive number, got {value!r}")
        return float(value)

    def triple(self, key: str, default: tuple, positive: bool = False) -> tuple[float, float, float]:
        value = self.raw.get(key, list(default))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value] * 3  # HF accepts one number for every channel
        if (not isinstance(value, list) or len(value) != 3
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
                or (positive and not all(x > 0 for x in value))):
            raise ConfigError(f"{self.source}: field {key!r} must be three {'positive ' if positive else ''}numbers "
                              f"(one per RGB channel), got {value!r}")
        return tuple(float(x) for x in value)
