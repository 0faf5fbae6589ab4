"""A checkpoint's `quantization_config`, checked: what the loader and the models need to know of it.

Served today:

- Qwen's FP8 format (`Qwen/Qwen3-8B-FP8` and its siblings), linear weights stored as
  float8_e4m3fn with one float32 `weight_scale_inv` per block (weight ~= fp8 x scale_inv):

    {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

- int4 weight-only groups (jtp/loading/int4.py): AutoAWQ's GEMM format and AutoGPTQ's v1 format,
  one scale and zero per group of `group_size` input rows and output column:

    {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": true}
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false, "sym": true}

  (GPTQ with desc_act true is accepted here; the loader refuses it unless every g_idx is the
  trivial arange(in) // group_size, the only grouping it serves.)

Every other method or variant is refused at start-up with one line saying what is served.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jtp.errors import ConfigError

SERVED = ("Qwen's FP8 block format (quant_method fp8, fmt e4m3, weight_block_size [b, b]), "
          "4-bit AWQ (version gemm, zero_point true) and 4-bit GPTQ (checkpoint_format gptq)")
INT4_METHODS = ("awq", "gptq")


@dataclasses.dataclass(frozen=True)
class Quantization:
    method: str  # "fp8", "awq" or "gptq"
    block: tuple[int, int] = (0, 0)  # fp8: (rows, columns) of a weight covered by one scale, in the [out, in] layout
    group_size: int = 0  # awq / gptq: input rows that share one scale and zero (4-bit values, 8 to an int32)
    skipped: tuple[str, ...] = ()  # modules_to_not_convert: names of modules kept in full precision


def parse_quantization(raw: Any, source: str) -> Quantization | None:
    """The `quantization_config` of a config.json (None when absent), or ConfigError saying why not."""
    if raw is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method in INT4_METHODS:
        return _int4(raw, method, where)
    if method != "fp8":
        raise ConfigError(f"{where}: quant_method {method!r} is not served; jtp loads {SERVED} and unquantized weights")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{where}: fmt {raw.get('fmt')!r} is not served; jtp loads {SERVED}")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{where}: activation_scheme {raw.get('activation_scheme')!r} is not served "
                          f"(static activation scales); jtp loads {SERVED}")
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(_positive_int(b) for b in block)):
        raise ConfigError(f"{where}: weight_block_size {block!r} is not [rows, columns] of positive integers "
                          f"(per-tensor FP8 scales are not served; jtp loads {SERVED})")
    return Quantization("fp8", (block[0], block[1]), skipped=_skipped(raw, where))


def _int4(raw: dict, method: str, where: str) -> Quantization:
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise ConfigError(f"{where}: {method} with bits {bits!r} is not served; jtp loads 4-bit {method} only")
    group = raw.get("group_size", raw.get("q_group_size"))
    if not _positive_int(group) or group % 8:
        raise ConfigError(f"{where}: {method} group_size {group!r} is not served; jtp loads groups of a positive "
                          "multiple of 8 input rows (group_size -1, one group per column, is not served)")
    if method == "awq":
        if str(raw.get("version", "gemm")).lower() != "gemm":
            raise ConfigError(f"{where}: awq version {raw.get('version')!r} is not served; jtp loads AutoAWQ's "
                              "gemm layout (qweight [in, out/8])")
        if raw.get("zero_point", True) is not True:
            raise ConfigError(f"{where}: awq zero_point {raw.get('zero_point')!r} is not served; jtp loads "
                              "zero_point true")
        return Quantization(method, group_size=group, skipped=_skipped(raw, where))
    if raw.get("checkpoint_format", "gptq") != "gptq":
        raise ConfigError(f"{where}: gptq checkpoint_format {raw.get('checkpoint_format')!r} is not served; jtp "
                          "loads the v1 format 'gptq' (qzeros store zero - 1)")
    for key in ("desc_act", "sym"):
        if not isinstance(raw.get(key, False), bool):
            raise ConfigError(f"{where}: gptq {key} must be true or false, got {raw.get(key)!r}")
    dynamic = raw.get("dynamic") or {}
    overrides = [k for k, v in dynamic.items() if not (k.startswith("-:") and not v)] \
        if isinstance(dynamic, dict) else [dynamic]
    if overrides:
        raise ConfigError(f"{where}: gptq dynamic {overrides[0]!r} is not served; jtp loads one bits / group_size "
                          "for every module (only '-:<regex>' exclusions)")
    return Quantization(method, group_size=group)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _skipped(raw: dict, where: str) -> tuple[str, ...]:
    skipped = raw.get("modules_to_not_convert") or ()
    if not (isinstance(skipped, (list, tuple)) and all(isinstance(s, str) for s in skipped)):
        raise ConfigError(f"{where}: modules_to_not_convert must be a list of module names, got {skipped!r}")
    return tuple(skipped)
