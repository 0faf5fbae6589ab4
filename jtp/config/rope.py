"""RoPE settings from a config.json: rope_theta, the partial rotary factor and YaRN scaling.

Read the way transformers reads them (modeling_rope_utils: `convert_rope_params_to_dict`,
`standardize_rope_params`, `_compute_yarn_parameters`), so jtp's numbers are HF's. Only 'default'
and 'yarn' RoPE are implemented; any other type is refused, and so is a config whose
`rope_scaling` and `rope_parameters` disagree on a value transformers would silently drop.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from jtp.errors import ConfigError

IMPLEMENTED = ("default", "yarn")
_DEFAULT_THETA = 10000.0  # transformers' default_theta


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN (arXiv 2309.00071) as transformers computes it; see jtp.models.layers.yarn_inv_freq."""

    factor: float  # context extension: interpolated frequencies are divided by it
    original_max_position_embeddings: int  # the pre-training context
    beta_fast: float = 32.0  # rotations above which a frequency is kept (extrapolated)
    beta_slow: float = 1.0  # rotations below which it is fully interpolated
    truncate: bool = True  # round the ramp's ends to whole dimensions
    attention_factor: float = 1.0  # multiplies cos and sin (so q.k by its square)

    @property
    def max_position_embeddings(self) -> int:
        """The extended context, as vLLM derives max_model_len for YaRN."""
        return int(self.original_max_position_embeddings * self.factor)


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float
    partial_rotary_factor: float
    yarn: Yarn | None


def parse_rope(raw: dict[str, Any], source: str, default_factor: float, head_dim: int) -> Rope:
    params = _rope_dict(raw, source)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in IMPLEMENTED:
        raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported (jtp implements "
                          f"{' and '.join(map(repr, IMPLEMENTED))} RoPE)")
    theta = params.get("rope_theta", raw.get("rope_theta", _DEFAULT_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ConfigError(f"{source}: rope_theta must be a positive finite number, got {theta!r}")
    factor = _partial_factor(raw, params, source, default_factor, head_dim)
    yarn = _yarn(raw, params, source) if rope_type == "yarn" else None
    return Rope(float(theta), factor, yarn)


def _rope_dict(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The RoPE parameters transformers uses: `rope_scaling` when present, else `rope_parameters`."""
    scaling, params = raw.get("rope_scaling"), raw.get("rope_parameters")
    for name, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{source}: {name} must be an object, got {value!r}")
    if not scaling:
        return dict(params or {})
    # transformers takes rope_scaling whole and drops rope_parameters; a value of rope_parameters
    # that would be lost that way is refused rather than ignored (its 'default' type aside: adding
    # rope_scaling is how Qwen documents turning YaRN on).
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    for key, value in (params or {}).items():
        if key in ("rope_type", "type"):
            if value not in ("default", kind):
                raise ConfigError(f"{source}: rope_parameters.{key} {value!r} contradicts rope_scaling's {kind!r}")
            continue
        kept = scaling.get(key, raw.get(key, _DEFAULT_THETA if key == "rope_theta" else None))
        if kept != value:
            raise ConfigError(
                f"{source}: rope_parameters.{key} ({value!r}) would be dropped: with rope_scaling present, "
                f"transformers reads rope_scaling alone (giving {key} {kept!r}); put every RoPE key in one of the two"
            )
    return scaling


def _partial_factor(raw, params, source: str, default_factor: float, head_dim: int) -> float:
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default_factor))
    if default_factor == 1.0:
        if factor != 1.0:
            raise ConfigError(f"{source}: partial_rotary_factor != 1 is not supported for {raw['model_type']}")
        return 1.0
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{source}: partial_rotary_factor must be in (0, 1], got {factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(
            f"{source}: partial_rotary_factor {factor} gives rotary dim {rotary_dim} of head_dim {head_dim}; "
            "it must be even and positive"
        )
    return float(factor)


def _number(params: dict, key: str, source: str, default=None, minimum: float | None = None):
    value = params.get(key)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or (minimum is not None and value < minimum)):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{source}: YaRN field {key!r} must be a number{bound}, got {value!r}")
    return value


def _yarn(raw: dict[str, Any], params: dict[str, Any], source: str) -> Yarn:
    max_positions = raw.get("max_position_embeddings", 32768)
    # A top-level original_max_position_embeddings wins (transformers' standardize_rope_params).
    original = raw.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    original = original or max_positions
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(f"{source}: YaRN field 'original_max_position_embeddings' must be a positive integer, "
                          f"got {original!r}")
    factor = _number(params, "factor", source, default=max_positions / original, minimum=1.0)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"{source}: YaRN field 'truncate' must be true or false, got {truncate!r}")
    attention_factor = _number(params, "attention_factor", source, minimum=0.0)
    if attention_factor is None:  # the paper's 0.1 ln(s) + 1, or DeepSeek's ratio of two of them
        mscale, mscale_all_dim = _number(params, "mscale", source), _number(params, "mscale_all_dim", source)
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor)
    return Yarn(
        factor=float(factor),
        original_max_position_embeddings=original,
        # `or`: transformers treats 0 / null as unset here too.
        beta_fast=float(_number(params, "beta_fast", source) or 32),
        beta_slow=float(_number(params, "beta_slow", source) or 1),
        truncate=truncate,
        attention_factor=float(attention_factor),
    )


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
