"""A checkpoint's `quantization_config`, checked: what the loader and the models need to know of it.

Served today: Qwen's FP8 format (`Qwen/Qwen3-8B-FP8` and its siblings), linear weights stored as
float8_e4m3fn with one float32 `weight_scale_inv` per block (weight ~= fp8 x scale_inv):

    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

Every other method or variant is refused at start-up with one line saying what is served.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jtp.errors import ConfigError

SERVED = "Qwen's FP8 block format (quant_method fp8, fmt e4m3, weight_block_size [b, b])"


@dataclasses.dataclass(frozen=True)
class Quantization:
    method: str  # "fp8"
    block: tuple[int, int]  # (rows, columns) of a weight covered by one scale, in the [out, in] layout
    skipped: tuple[str, ...] = ()  # modules_to_not_convert: names of modules kept in full precision


def parse_quantization(raw: Any, source: str) -> Quantization | None:
    """The `quantization_config` of a config.json (None when absent), or ConfigError saying why not."""
    if raw is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{where}: quant_method {method!r} is not served; jtp loads {SERVED} and unquantized weights")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{where}: fmt {raw.get('fmt')!r} is not served; jtp loads {SERVED}")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{where}: activation_scheme {raw.get('activation_scheme')!r} is not served "
                          f"(static activation scales); jtp loads {SERVED}")
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{where}: weight_block_size {block!r} is not [rows, columns] of positive integers "
                          f"(per-tensor FP8 scales are not served; jtp loads {SERVED})")
    skipped = raw.get("modules_to_not_convert") or ()
    if not (isinstance(skipped, (list, tuple)) and all(isinstance(s, str) for s in skipped)):
        raise ConfigError(f"{where}: modules_to_not_convert must be a list of module names, got {skipped!r}")
    return Quantization("fp8", (block[0], block[1]), tuple(skipped))
